#pragma once
// The collectives of a group that spans hosts: shared memory inside each host, the ranks of each
// local rank (or the hosts' leaders) across them. Their data steps take the form the group's set-up
// chose for its hosts' shape (HierarchicalForm in hierarchy/hierarchy.h); here, the small collectives that ride
// in the check's round across equal hosts.

#include "comm/core/communicator.h"
#include "comm/core/header.h"
#include "comm/hierarchy/hierarchy.h"
#include "comm/reduction/reduce_op.h"

#include <ATen/ATen.h>

namespace ddpkit::comm {

// Note [Hierarchical collectives]
// When a group spans more than one host (Note [Topology]), shared memory carries what stays on a host
// and the process group what crosses hosts; with one rank on every host only the steps across hosts
// run, and the check and small collectives still take Note [One round across hosts]. The data steps
// take one of two forms, chosen once at the group's set-up for the shape of its hosts
// (HierarchicalForm): hosts holding the same number of ranks take Horovod's split (Note [Equal
// hosts] in hierarchy/equal_hosts.h), hosts with different numbers of ranks the leaders' form (Note
// [Unequal hosts] in hierarchy/unequal_hosts.h). The steps inside a host move no messages (the direct
// collectives of shm/direct.h). The collective check runs first and the data steps unchecked: with
// equal hosts, one step of each host's shared memory and one round of messages among the ranks of
// each local rank (Note [One round across hosts]: one round trip across hosts, where the process
// group's check takes two; one crossing where the check rides in front of the data, Note [A check in
// front of the swap]); with unequal hosts, the process group's check through rank 0. Either way
// a mismatched call raises on every rank of every host. Among more than two hosts every op's
// all-reduce crosses on the ring over the socket links (Note [A ring across hosts] in links/ring.h), or
// in two shots on long paths (Note [Two shots across hosts] in hierarchy/cross_host_steps.h);
// between two, every op takes the swap; both reduce by Note [Reductions]'s rules. Every slice is reduced in one place,
// or in the same order in both, so every rank ends with the same bits.
// Between two hosts every step across hosts moves over the socket links: the all-reduce's swap, the
// broadcast's and the reduce's one frame, the all-gather's and the reduce-scatter's swap of blocks;
// the receiver reduces as parts arrive, in host order. The forms ask the steps across hosts for
// each one, never how many hosts there are: the group set-up picked the CrossHostSteps that do it so
// (Note [Steps across hosts] in hierarchy/cross_host_steps.h). The forms' Notes name the schedules among three hosts
// or more. With equal hosts and checks on, the barrier is the check alone: a step of every host's
// shared memory, then a round across hosts that completes only once every host's step has. The
// steps' temporary buffers are reused from call to call (ScratchBuffers). gather, scatter and
// all_to_all run flat over the process group.

// The whole collective, check included, with its data riding in the check's one round (Note [One
// round across hosts] in checks/cross_host_check.h); only on the route kOneRound (collectives/routes.h), so
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
