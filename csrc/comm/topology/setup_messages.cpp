#include "comm/topology/setup_messages.h"

namespace ddpkit::comm::setup_messages {

std::string describe_failure(int64_t failure, int64_t error_number) {
  const std::string errno_text = error_number != 0 ? c10::str(": ", std::strerror(static_cast<int>(error_number))) : "";
  switch (failure) {
    case kCreateFailed: return c10::str("creating the segment (memfd_create, ftruncate, mmap) failed", errno_text);
    case kOpenFailed: return c10::str("opening rank 0's segment through /proc failed", errno_text);
    case kNotRegularFile: return "the descriptor rank 0 named is not a regular file";
    case kWrongOwner: return "the segment is not owned by this rank's user";
    case kWrongMode: return "the segment's mode is not 0600";
    case kWrongSize: return "the segment does not have the size rank 0 announced";
    case kMapFailed: return c10::str("mapping the segment failed", errno_text);
    case kWrongHeader: return "the segment's header (magic, layout or nonce) is not the one rank 0 announced";
    case kPeerFailed: return "it died or stopped answering during the set-up";
    case kBadSettings:
      return "its segment settings give no valid layout (slots and chunks of 4096 bytes to 1 GiB, in whole "
             "cache lines)";
  }
  return c10::str("unknown failure ", failure);
}

Words::Words(const Communicator& setup) : prefix(c10::str("ddpkit.", setup.what(), " (", setup.where(), ")")) {}

std::string Words::relayed(int64_t failed_rank, int64_t failure, int64_t error_number) const {
  return c10::str(prefix, ": rank ", failed_rank, " failed: ", describe_failure(failure, error_number), kHint);
}

void tell(Communicator& setup, const std::vector<int>& ranks, const at::Tensor& message, int round, int skip) {
  for (int peer : ranks) {
    if (peer == setup.rank() || peer == skip) continue;
    MessageList one;
    try {
      one.push_back(setup.isend(message, peer, round));
      setup.wait(one);
    } catch (const std::exception&) {
    }
  }
}

std::vector<int> all_ranks(int size) {
  std::vector<int> ranks(size);
  for (int r = 0; r < size; ++r) ranks[r] = r;
  return ranks;
}

}  // namespace ddpkit::comm::setup_messages
