#pragma once
// The steps of a hierarchical collective across hosts, behind one interface (Note [Steps across hosts]).

#include "comm/core/scratch.h"
#include "comm/core/transport.h"
#include "comm/core/wire_format.h"
#include "comm/links/links.h"
#include "comm/reduction/reduce_op.h"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace ddpkit::comm {

class Communicator;

// Note [Steps across hosts]
// A hierarchical collective (Note [Hierarchical collectives] in hierarchy/one_round.h) crosses hosts among
// the ranks of one local rank, one per host (or among the hosts' leaders), through the CrossHostSteps the
// group set-up picked once for them; a collective asks them for a step, never how many hosts
// there are:
//  - SwapSteps, between two hosts: every step over the two ranks' socket link (Note [Socket
//    links]), the receiver reducing parts as they arrive, in host order;
//  - RingSteps, among three hosts or more: the all-reduce, all-gather and reduce-scatter on a ring
//    over the socket links (Note [A ring across hosts] in links/ring.h), or in two shots where the
//    paths are long (Note [Two shots across hosts]), the broadcast and the reduce through ddpkit's
//    schedules over the gloo subgroup's messages.
// Every step is part of the caller's collective (its sequence number names its frames and tags),
// takes contiguous tensors, and moves nothing when they are empty. A kMean is summed; the caller
// divides once. Every rank ends with the same bits: each element is reduced in one place, or in the
// same order everywhere (Note [Reductions]).
class CrossHostSteps {
 public:
  // `rank`: this rank's index among `group_ranks` (the group's ranks the steps span, in its order);
  // `links`: their socket links, which also carry the collective check's round (Note [One round
  // across hosts]).
  CrossHostSteps(int rank, std::vector<int> group_ranks, std::shared_ptr<Links> links)
      : rank_(rank), group_ranks_(std::move(group_ranks)), links_(std::move(links)) {}
  virtual ~CrossHostSteps() = default;

  int rank() const { return rank_; }
  int size() const { return static_cast<int>(group_ranks_.size()); }
  // Some link of the group crosses a long path (Note [Send buffers] in links/send_buffers.h): the same
  // on every rank, set once the group's set-up learnt it. Among three hosts or more the check and the
  // steps then cross in fewer, larger exchanges (Note [A check in front of the swap] in
  // checks/cross_host_check.h, Note [Two shots across hosts]).
  bool long_paths() const { return long_paths_; }
  void set_long_paths(bool long_paths) { long_paths_ = long_paths; }
  const std::vector<int>& group_ranks() const { return group_ranks_; }
  Links& links() const { return *links_; }

  // In place, op over every rank's `block`.
  virtual void all_reduce(const at::Tensor& block, ReduceOp op, Communicator& comm) = 0;
  // `flat` of rank `root` into every rank's (any dtype: bytes move).
  virtual void broadcast(const at::Tensor& flat, int root, Communicator& comm) = 0;
  // op over every rank's `flat` into rank `root`'s; the others keep partial results.
  virtual void reduce(const at::Tensor& flat, int root, ReduceOp op, Communicator& comm) = 0;
  // `flat` holds size() blocks of `m` elements, this rank's at rank(): every rank's block into every
  // rank's `flat` (any dtype).
  virtual void all_gather(const at::Tensor& flat, int64_t m, Communicator& comm) = 0;
  // `run` holds size() blocks of `m` elements: op over every rank's block rank() into this rank's
  // block rank(); the other blocks are left with partial results.
  virtual void reduce_scatter(const at::Tensor& run, int64_t m, ReduceOp op, Communicator& comm) = 0;

  // A failure of this rank's own in a collective's data steps (`why`): breaks the links, so that a
  // partner waiting for this rank's frames raises at once (Links::break_off).
  void break_off(const std::string& why) noexcept { links_->break_off(why); }

 private:
  int rank_;
  std::vector<int> group_ranks_;
  std::shared_ptr<Links> links_;
  bool long_paths_ = false;
};

// Between two hosts (Note [Steps across hosts]). `scratch`'s kFromPeer buffer receives the other
// host's frames; it outlives the steps.
class SwapSteps final : public CrossHostSteps {
 public:
  SwapSteps(int rank, std::vector<int> group_ranks, std::shared_ptr<Links> links, ScratchBuffers& scratch);
  void all_reduce(const at::Tensor& block, ReduceOp op, Communicator& comm) override;
  void broadcast(const at::Tensor& flat, int root, Communicator& comm) override;
  void reduce(const at::Tensor& flat, int root, ReduceOp op, Communicator& comm) override;
  void all_gather(const at::Tensor& flat, int64_t m, Communicator& comm) override;
  void reduce_scatter(const at::Tensor& run, int64_t m, ReduceOp op, Communicator& comm) override;

 private:
  // `sends` go to the other host while its frame of exactly `mine`'s size arrives and is reduced
  // into `mine` part by part, in host order.
  void receive_and_combine(const at::Tensor& mine, ReduceOp op, std::vector<Links::Send> sends, Communicator& comm);
  // receive_and_combine with a compressed wire format (Note [Compressed crossing]), `out` the tensor
  // sent to the other host.
  void swap_compressed(const at::Tensor& mine, const at::Tensor& out, ReduceOp op, Communicator& comm);
  // Sends `outgoing` (undefined: nothing) while the other host's frame of exactly `incoming`'s size
  // (undefined: none) arrives into it.
  void move(const at::Tensor& outgoing, const at::Tensor& incoming, Communicator& comm);

  int peer() const { return 1 - rank(); }

  ScratchBuffers& scratch_;
};

// Note [Two shots across hosts]
// A ring's step waits out the path's delay once, and an all-reduce takes 2(n-1) of them in a row: on a
// long path (CrossHostSteps::long_paths, learnt at the set-up) they are most of a mid-sized collective's
// time. There the all-reduce takes two shots, each one exchange with every partner at once: the
// reduce-scatter sends each partner its block and reduces the n - 1 blocks it receives into this
// rank's own, in one order (its own, then the partners' from the next rank round: each element is
// reduced in one place, Note [Reductions]); the all-gather sends the finished block to every partner
// and receives theirs into place. Each rank sends and receives 2(n-1)/n of the tensor, as on the ring,
// in two crossings of the path instead of 2(n-1), and the check rides in front of the first shot's
// frames (Note [A check in front of the swap] in checks/cross_host_check.h). The reduce-scatter and
// the all-gather take one shot each. But n - 1 flows into each host share its link less evenly than
// the ring's one (their ends straggle, and a flow left alone takes round trips to claim the whole
// link), a cost that grows with the tensor while the delays saved stay the same: above
// kTwoShotsMaxBytes the ring stays (bench_multihost.py's delayed 4x1 points, two shots against the
// ring at 2M to 16M floats, put the crossing near 8M). On short paths the ring stays too: there
// nothing waits on the path, and a rank's n - 1 frames at once would contend for its CPUs and caches.
// The compressed crossing keeps the ring.

// The largest reduction that takes two shots (Note [Two shots across hosts]).
inline constexpr int64_t kTwoShotsMaxBytes = 16 << 20;

// Among three hosts or more (Note [Steps across hosts]): `backend` is the gloo subgroup of the ranks
// the steps span, split from the group's; `scratch` receives the ring's frames and outlives the
// steps.
class RingSteps final : public CrossHostSteps {
 public:
  RingSteps(int rank, std::vector<int> group_ranks, std::shared_ptr<Links> links,
            c10::intrusive_ptr<c10d::Backend> backend, ScratchBuffers& scratch);
  void all_reduce(const at::Tensor& block, ReduceOp op, Communicator& comm) override;
  void broadcast(const at::Tensor& flat, int root, Communicator& comm) override;
  void reduce(const at::Tensor& flat, int root, ReduceOp op, Communicator& comm) override;
  void all_gather(const at::Tensor& flat, int64_t m, Communicator& comm) override;
  void reduce_scatter(const at::Tensor& run, int64_t m, ReduceOp op, Communicator& comm) override;

 private:
  // A communicator for ddpkit's schedules on the subgroup, as part of `comm`'s collective (its
  // sequence number, so its tags, and its call's name for errors).
  Communicator subgroup(const Communicator& comm) const;
  // Whether a reduction of `tensor` takes two shots rather than the ring (Note [Two shots across
  // hosts]).
  bool takes_two_shots(const at::Tensor& tensor, ReduceOp op, const Communicator& comm) const;
  // Before the ring: its frames do not carry a check in front, whose words cross alone first.
  static void settle_check_alone(Communicator& comm);
  // The two shots, over blocks [start(b), start(b + 1)) of `flat` (elements) and `bytes` (bytes).
  void reduce_scatter_shot(const at::Tensor& flat, const std::function<int64_t(int)>& start, ReduceOp op,
                           Communicator& comm);
  void all_gather_shot(const at::Tensor& bytes, const std::function<int64_t(int)>& start, Communicator& comm);

  c10::intrusive_ptr<c10d::Backend> backend_;
  std::shared_ptr<Transport> messages_;  // point-to-point messages on `backend_`
  ScratchBuffers& scratch_;
};

}  // namespace ddpkit::comm
