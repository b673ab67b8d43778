#include "comm/hierarchy.h"

#include "comm/communicator.h"

namespace ddpkit::comm {
namespace {

// "rank 2" or "ranks 2, 4": the ranks this one crosses hosts with, for errors.
std::string cross_ranks_text(const Hierarchy& h) {
  std::string ranks;
  for (int j = 0; j < h.cross_size; ++j) {
    if (j != h.cross_rank) ranks += c10::str(ranks.empty() ? "" : ", ", h.cross_ranks[j]);
  }
  return c10::str(h.cross_size > 2 ? "ranks " : "rank ", ranks);
}

}  // namespace

std::string without_backtrace(const std::exception& e) {
  const auto* error = dynamic_cast<const c10::Error*>(&e);
  return error != nullptr ? error->what_without_backtrace() : e.what();
}

void across_hosts(const Hierarchy& h, Communicator& comm, c10::function_ref<void()> step) {
  try {
    step();
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "ddpkit.", comm.what(), " (", comm.where(), "): the step across hosts, with ",
                cross_ranks_text(h), ", failed: ", without_backtrace(e));
  }
}

void on_hosts(const Hierarchy& h, OnFailure on_failure, c10::function_ref<void()> steps) {
  try {
    steps();
  } catch (const std::exception& e) {
    if (DirectCollectives* local = h.local ? h.local->direct() : nullptr) local->abandon(without_backtrace(e));
    if (on_failure == OnFailure::kCutLinks && h.links) h.links->break_off(without_backtrace(e));
    throw;
  }
}

}  // namespace ddpkit::comm
