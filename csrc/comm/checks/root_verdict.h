#pragma once
// The collective check over a transport's messages: every rank's header to rank 0, whose verdict
// every rank raises (Note [Check seam] in core/collective_check.h).

#include "comm/core/collective_check.h"
#include "comm/core/communicator.h"
#include "comm/core/transport.h"

#include <ATen/ATen.h>

#include <string>
#include <string_view>

namespace ddpkit::comm {

// Note [Collective checks]' root verdict: every rank sends its header to rank 0 (kCheckRoot), which
// compares them and sends every rank a verdict: agreement, or the first rank that differs from rank 0
// and how. start() posts the messages; settle() waits for the verdict (a rank that rejected its
// arguments settles at once). A root that loses a peer while collecting headers still sends the
// others a verdict naming it. One per transport of the group; it holds the check in flight between
// start() and settle(), which the Engine's order keeps to one collective at a time.
class RootVerdictCheck final : public CollectiveCheck {
 public:
  // `host`: the host's shared memory that a rank rejecting its arguments with checks off stops (the
  // hierarchy's, where the group's collectives inside the host take it), or null.
  explicit RootVerdictCheck(DirectCollectives* host = nullptr) : host_(host) {}
  at::Tensor start(Communicator& comm, const CollectiveHeader& header, const std::string& local_error,
                   const RideAlong* ride) override;
  void settle(Communicator& comm) override;
  void reject_unchecked(std::string_view what) override {
    if (host_ != nullptr) host_->reject_unchecked(what);
  }

 private:
  at::Tensor make_verdict(const Communicator& comm) const;                                  // on the root
  void send_failure_verdict(Communicator& comm);                                            // the root, a header lost
  std::string describe_verdict(const Communicator& comm, const at::Tensor& verdict) const;  // "": agreement

  DirectCollectives* host_;
  std::string local_error_;
  bool pending_ = false;
  at::Tensor headers_;  // root: [size, kHeaderWords] int64, every rank's header; others: their own
  at::Tensor verdict_;  // others: the root's verdict
  MessageList messages_;
};

}  // namespace ddpkit::comm
