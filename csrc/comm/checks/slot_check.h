#pragma once
// The collective check over a host's shared memory, in one step of its direct collectives (Note
// [Check seam] in core/collective_check.h).

#include "comm/core/collective_check.h"
#include "comm/core/transport.h"

#include <ATen/ATen.h>

#include <string>
#include <string_view>

namespace ddpkit::comm {

// The check over shared memory: the header in the first step of a direct collective (Note [Direct
// all-reduce]), or, before a collective over messages, one step of the direct collectives with the
// header alone (DirectCollectives::barrier), complete when start() returns.
class SlotCheck final : public CollectiveCheck {
 public:
  explicit SlotCheck(DirectCollectives& direct) : direct_(direct) {}
  at::Tensor start(Communicator& comm, const CollectiveHeader& header, const std::string& local_error,
                   const RideAlong* ride) override;
  bool rides_in_direct_steps() const override { return true; }
  void start_in_direct_step(Communicator& comm, const CollectiveHeader& header,
                            const std::string& local_error) override;
  void reject_unchecked(std::string_view what) override { direct_.reject_unchecked(what); }

 private:
  DirectCollectives& direct_;
};

}  // namespace ddpkit::comm
