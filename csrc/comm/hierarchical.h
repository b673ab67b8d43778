#pragma once
// The collectives of a group that spans hosts: shared memory inside each host, the ranks of each
// local rank (or the hosts' leaders) across them.

#include "comm/communicator.h"
#include "comm/header.h"
#include "comm/hierarchy.h"
#include "comm/reduce_op.h"

#include <ATen/ATen.h>

namespace ddpkit::comm {

// Note [Hierarchical collectives]
// When a group spans more than one host (Note [Topology]), shared memory carries what stays on a host
// and the process group what crosses hosts; with one rank on every host only the steps across hosts
// run, and the check and small collectives still take Note [One round across hosts]. The
// all-reduce, with L ranks on every host (Horovod's split):
//  1. reduce-scatter inside each host over shared memory: local rank j holds the host's sum of
//     slice j of L;
//  2. every local rank at once all-reduces its slice with the ranks of the same local rank on the
//     other hosts ("cross"), so each host's link carries 2(H-1)/H of the vector once: between two
//     hosts the two ranks swap their slices over their socket link, both ways at once, and each
//     reduces the pair in host order (Note [Socket links]); among more hosts, through the process
//     group's own all-reduce on that subgroup (gloo's TCP ring is pipelined and tuned);
//  3. all-gather inside each host over shared memory.
// Hosts with different numbers of ranks take the leaders' form instead: an all-reduce inside each
// host, the all-reduce of the hosts' leaders (their lowest ranks) across hosts, and a broadcast from
// the leader inside each host. The steps inside a host move no messages (the direct collectives of
// shm_direct.h). The collective check runs first and the data steps unchecked: with equal hosts, one
// step of each host's shared memory and one round of messages among the ranks of each local rank
// (Note [One round across hosts]: one round trip across hosts, where the process group's check takes
// two); with unequal hosts, the process group's check through rank 0. Either way a mismatched call
// raises on every rank of every host. Among more than two hosts, sum and mean cross hosts through
// gloo's all-reduce; max and min through ddpkit's ring on the same subgroup, so that they keep Note
// [Reductions]'s semantics (gloo's max drops a NaN held by a later rank); between two, every op takes
// the swap, reduced by Note [Reductions]'s rules. Every slice is reduced in one place, or in the same
// order in both, so every rank ends with the same bits.
// Between two hosts every step across hosts moves over the socket links: the all-reduce's swap, the
// broadcast's and the reduce's one frame, the all-gather's and the reduce-scatter's swap of blocks;
// the receiver reduces as parts arrive, in host order. The collectives here ask the channel across
// hosts for each step, never how many hosts there are: the group set-up picked the channel that
// does it so (Note [Steps across hosts] in cross_host.h). The rest of this Note names the schedules
// among three hosts or more.
// The broadcast follows the same forms: with equal hosts, the ranks of the root's local rank carry
// the tensor across hosts (ddpkit's binomial tree on their subgroup), then every host
// broadcasts it from that local rank over shared memory; with unequal hosts, the root's host
// broadcasts first, then the hosts' leaders across hosts, then every other host from its leader. With
// equal hosts and checks on, the barrier is the check alone: a step of every host's shared memory,
// then a round across hosts that completes only once every host's step has.
// The reduce follows the all-reduce, stopping at the root's host: with equal hosts, reduce-scatter
// inside every host, each slice reduced across hosts to the root's host (ddpkit's binomial tree on
// the cross subgroup, which keeps Note [Reductions]'s semantics for every op), all-gather inside
// that host; with unequal hosts, the leaders' form ending with a broadcast on the root's host alone.
// The all-gather and the reduce-scatter hold the ranks' blocks in local-major order (local rank j of
// host i at position j·H + i), so that each local rank's H blocks are one run: the all-gather sends
// this rank's block to the ranks of its local rank (ddpkit's ring on their subgroup), then
// all-gathers the hosts' runs inside the host; the reduce-scatter reduce-scatters the runs inside the
// host, then each run among the ranks of its local rank (ddpkit's ring). Each host's link carries
// (H-1)/H of its ranks' data once, the least an all-gather or reduce-scatter can. Among three hosts
// or more, only the sum's and mean's all-reduce takes the process group's own collective (gloo's
// pipelined ring); every other step takes ddpkit's schedules over its messages, which beat gloo's
// collectives there (16M floats across two simulated hosts: the ring all-gather 0.4x gloo's; gloo's
// reduce-scatter is an all-reduce). With one rank per host the all-gather's ring runs in the output
// itself. The steps' temporary buffers are reused from call to call (ScratchBuffers). With
// unequal hosts the all-gather takes the leaders' form (runs padded to the largest host's), and the
// reduce-scatter is the leaders' all-reduce of the whole input, of which each rank keeps its block.
// gather, scatter and all_to_all run flat over the process group.
// The data parts, run after the collective check passed on every rank (Communicator::begin), in
// place on contiguous tensors; every rank ends with the same bits. Reductions take float32/64 and
// int32/64 (the caller's working copy).

// The all-reduce of `flat`: with equal hosts Horovod's split, else the leaders' form.
void hierarchical_all_reduce(const at::Tensor& flat, ReduceOp op, const Hierarchy& h, Communicator& comm);

// The broadcast of `flat` (any dtype: bytes move) from rank `root`.
void hierarchical_broadcast(const at::Tensor& flat, int root, const Hierarchy& h, Communicator& comm);

// The reduce of `flat` to rank `root`. With equal hosts: reduce-scatter inside every host, each local
// rank's slice reduced across hosts to the root's host, all-gather inside that host; else the
// leaders' form: all-reduce inside every host, the leaders reduce to the root's host's leader, which
// broadcasts inside its host. Ranks off the root's host keep partial results, as torch's reduce allows.
void hierarchical_reduce(const at::Tensor& flat, int root, ReduceOp op, const Hierarchy& h, Communicator& comm);

// torch's all_gather_into_tensor (any dtype). With equal hosts: this rank's block to the ranks of its
// local rank on every host, then the hosts' runs inside the host, in local-major order, put in rank
// order at the end. Else the leaders' form: the host's blocks inside the host, the hosts' runs (padded
// to the largest host's) among the leaders, and every host's result from its leader.
void hierarchical_all_gather(const at::Tensor& output, const at::Tensor& input, const Hierarchy& h, Communicator& comm);

// torch's reduce_scatter_tensor; `input` (n blocks of output.numel()) stays unchanged. With equal
// hosts: the blocks in local-major order (a copy, in the working dtype), the host's reduce-scatter of
// those runs over shared memory (local rank j receives the host's sum of run j: the blocks of the
// ranks of local rank j on every host), then the reduce-scatter of that run among those ranks. Else
// the leaders' form of the all-reduce on a copy of the whole input, of which each rank keeps its block.
void hierarchical_reduce_scatter(const at::Tensor& output, const at::Tensor& input, ReduceOp op, const Hierarchy& h,
                                 Communicator& comm);

// The whole collective, check included, with its data riding in the check's one round (Note [One
// round across hosts] in cross_host_check.h); only on the route kOneRound (routes.h), so
// that every rank of the group takes it or raises in it.
//  - all-reduce of `tensor` (any reduction dtype; a copy until the round agreed): each host's result
//    to the center, which answers with the hosts' results reduced in host order. `header` may be a
//    reduce's or a reduce-scatter's, which take this on a copy of their input.
void hierarchical_all_reduce_in_one_round(const at::Tensor& tensor, ReduceOp op, const CollectiveHeader& header,
                                          const Hierarchy& h, Communicator& comm);
//  - broadcast: the root's tensor rides to the center, whose reply carries it to the root's partners,
//    then every host broadcasts it from the root's local rank.
void hierarchical_broadcast_in_one_round(const at::Tensor& tensor, int root, const CollectiveHeader& header,
                                         const Hierarchy& h, Communicator& comm);
//  - all-gather: this rank's block rides to the center, whose reply carries its partners' blocks, then
//    the hosts' runs are all-gathered inside the host.
void hierarchical_all_gather_in_one_round(const at::Tensor& output, const at::Tensor& input,
                                          const CollectiveHeader& header, const Hierarchy& h, Communicator& comm);

}  // namespace ddpkit::comm
