#pragma once
// Flat message schedules: collectives as rounds of point-to-point messages among the ranks of one
// Communicator, which knows nothing of hosts (a group spanning hosts runs them on a subgroup of its
// own: hierarchy/one_round.h). Note [All-reduce algorithms] and Note [All-gather and reduce-scatter] in
// core/algorithm.h describe them; Note [Pre-posted receives] in core/communicator.h how they run.

#include "comm/core/communicator.h"
#include "comm/reduction/reduce_op.h"

#include <ATen/ATen.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

namespace ddpkit::comm {

// One round of a schedule: this rank's sends and receives, then local work on what arrived.
// Messages of round k carry round tag `tag` (default k); sender and receiver must agree on it.
struct Transfer {
  at::Tensor tensor;
  int peer;
};
struct Round {
  std::vector<Transfer> sends;
  std::vector<Transfer> recvs;
  std::function<void()> then;
  int tag = -1;
};
using Schedule = std::vector<Round>;

// Runs `schedule` with the receives of rounds k+1 .. k+look_ahead posted before round k is waited
// on (Note [Pre-posted receives]), or round by round in groups where the backend needs that. No
// payload leaves before comm.settle_header() (Note [Collective checks]).
void run_schedule(Communicator& comm, Schedule& schedule, size_t look_ahead = 1);

// The all-reduces of Note [All-reduce algorithms], in place on `flat` (contiguous, float32/64 or
// int32/64) as rank `r` of `n`; every rank ends with the same bits, finish_reduction_ included.
Schedule ring_schedule(const at::Tensor& flat, ReduceOp op, int n, int r);
Schedule butterfly_schedule(const at::Tensor& flat, ReduceOp op, int n, int r);
Schedule star_schedule(const at::Tensor& flat, ReduceOp op, int n, int r);
Schedule gather_scatter_schedule(const at::Tensor& flat, ReduceOp op, int n, int r);
Schedule recursive_doubling_schedule(const at::Tensor& flat, ReduceOp op, int n, int r);
Schedule halving_doubling_schedule(const at::Tensor& flat, ReduceOp op, int n, int r);

// The binomial tree towards `root`: every rank combines its children's partial results into `flat`,
// then passes its own to its parent; `flat` of `root` ends with op over every rank's (before
// finish_reduction_), the others with partial results.
Schedule reduce_schedule(const at::Tensor& flat, ReduceOp op, int n, int r, int root);

// The binomial tree from `root`, over ranks relative to it: receive `tensor` from the parent, then
// send it to the children (ceil(log2 n) rounds in all).
Schedule broadcast_schedule(const at::Tensor& tensor, int n, int r, int root);

// The reduce-scatter halves of Note [All-gather and reduce-scatter] on `acc`: n blocks of m elements,
// partial sums accumulating in place. After the rounds block r holds op over every rank's block r
// (before finish_reduction_). The ring takes any n; halving a power of two.
Schedule ring_reduce_scatter_schedule(const at::Tensor& acc, int64_t m, ReduceOp op, int n, int r);
Schedule halving_reduce_scatter_schedule(const at::Tensor& acc, int64_t m, ReduceOp op, int n, int r);

// The all-gather halves on `flat`: n blocks of m elements, block r already this rank's; after the
// rounds every block holds its rank's. Every receive lands in a block of its own, sent on only after
// it arrived, so all may be posted up front (Note [Ring receives up front]). The ring takes any n;
// doubling a power of two.
Schedule ring_all_gather_schedule(const at::Tensor& flat, int64_t m, int n, int r);
Schedule doubling_all_gather_schedule(const at::Tensor& flat, int64_t m, int n, int r);

}  // namespace ddpkit::comm
