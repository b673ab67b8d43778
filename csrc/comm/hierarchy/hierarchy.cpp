#include "comm/hierarchy/hierarchy.h"

#include "comm/core/communicator.h"

namespace ddpkit::comm {
namespace {

// "rank 2" or "ranks 2, 4": the ranks this one crosses hosts with, for errors.
std::string cross_ranks_text(const CrossHostSteps& cross) {
  std::string ranks;
  for (int j = 0; j < cross.size(); ++j) {
    if (j != cross.rank()) ranks += c10::str(ranks.empty() ? "" : ", ", cross.group_ranks()[j]);
  }
  return c10::str(cross.size() > 2 ? "ranks " : "rank ", ranks);
}

}  // namespace

std::string without_backtrace(const std::exception& e) {
  const auto* error = dynamic_cast<const c10::Error*>(&e);
  return error != nullptr ? error->what_without_backtrace() : e.what();
}

void across_hosts(const Hierarchy& h, Communicator& comm, c10::function_ref<void()> step) {
  TORCH_INTERNAL_ASSERT(h.cross != nullptr, "a step across hosts on a rank that crosses none");
  try {
    step();
  } catch (const CheckVerdict&) {
    throw;  // the check's own error, already naming the call
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "ddpkit.", comm.what(), " (", comm.where(), "): the step across hosts, with ",
                cross_ranks_text(*h.cross), ", failed: ", without_backtrace(e));
  }
}

void on_hosts(const Hierarchy& h, OnFailure on_failure, c10::function_ref<void()> steps) {
  try {
    steps();
  } catch (const CheckVerdict&) {
    throw;  // the links are in step (Note [A check in front of the swap] in checks/cross_host_check.h)
  } catch (const std::exception& e) {
    if (DirectCollectives* host = h.host()) host->abandon(without_backtrace(e));
    if (on_failure == OnFailure::kCutLinks && h.cross) h.cross->break_off(without_backtrace(e));
    throw;
  }
}

}  // namespace ddpkit::comm
