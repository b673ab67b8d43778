#pragma once
// The collective checks of a group on one host (Note [Check seam] in collective_check.h): over the
// transport's messages, or in one step of its shared memory.

#include "comm/collective_check.h"
#include "comm/communicator.h"
#include "comm/transport.h"

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
