#include "comm/checks/slot_check.h"

#include "comm/core/communicator.h"

namespace ddpkit::comm {

at::Tensor SlotCheck::start(Communicator& comm, const CollectiveHeader& header, const std::string& local_error,
                            const RideAlong* ride) {
  TORCH_INTERNAL_ASSERT(ride == nullptr, "the shared-memory check carries no data");
  start_in_direct_step(comm, header, local_error);
  direct_.barrier(comm.what());  // one step, no messages
  return {};
}

void SlotCheck::start_in_direct_step(Communicator& comm, const CollectiveHeader& header,
                                     const std::string& local_error) {
  direct_.carry_check(comm.stamp(header, local_error), local_error);
}

}  // namespace ddpkit::comm
