#include "testing/faults.h"

#include <csignal>
#include <cstdlib>
#include <string>

#include <unistd.h>

namespace ddpkit::testing {
namespace {

struct Armed {
  std::string fault;
  int rank = -1;
};

const Armed& configured() {
  static const Armed armed = [] {
    Armed parsed;
    const char* value = std::getenv("DDPKIT_TEST_FAULT");
    if (value == nullptr) return parsed;
    const std::string text(value);
    const size_t colon = text.rfind(':');
    if (colon == std::string::npos) return parsed;
    parsed.fault = text.substr(0, colon);
    parsed.rank = std::atoi(text.c_str() + colon + 1);
    return parsed;
  }();
  return armed;
}

}  // namespace

bool fault_armed(std::string_view fault, int rank) {
  const Armed& set = configured();
  return set.rank == rank && set.fault == fault;
}

void die() {
  kill(getpid(), SIGKILL);
  for (;;) pause();  // the signal is on its way
}

std::string test_host() {
  const char* value = std::getenv("DDPKIT_TEST_HOSTS");
  const char* process_rank = std::getenv("RANK");  // the process's, whatever group asks
  if (value == nullptr || process_rank == nullptr) return {};
  const int rank = std::atoi(process_rank);
  const std::string labels(value);
  size_t start = 0;
  for (int r = 0; r < rank; ++r) {
    start = labels.find(',', start);
    if (start == std::string::npos) return {};
    ++start;
  }
  return labels.substr(start, labels.find(',', start) - start);
}

}  // namespace ddpkit::testing
