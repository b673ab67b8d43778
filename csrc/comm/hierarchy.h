#pragma once
// What a group that spans hosts needs for its hierarchical collectives (Note [Hierarchical collectives]).

#include "comm/header.h"
#include "comm/socket_links.h"
#include "comm/topology.h"
#include "comm/transport.h"

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <array>
#include <memory>
#include <string>
#include <vector>

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
// the receiver reduces as parts arrive, in host order. The rest of this Note names the schedules
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
// Note [One round across hosts]
// The check across equal hosts is one round through a center, the first of the ranks of this rank's
// local rank (its partners), for every collective (so ranks that disagree on the collective, its
// root or its size always pick the same center): every other partner sends the center one message holding its words (its
// header, its host's culprit with that culprit's header, the rank its host lost); once all are in,
// the center answers each with every partner's words, so every rank compares every host's headers
// after two one-way messages. The round runs over the partners' socket links (Note [Socket links]),
// not gloo's send/recv, for the reasons of that Note. Up to kOneRoundMaxBytes of data ride in the same messages, after the words, so that a small
// collective crosses hosts once, check included: for the all-reduce each partner sends its host's
// result (the host's all-reduce runs between the check's step and the round) and the center answers
// with the hosts' results reduced in host order (the same bits everywhere); the reduce and the
// reduce-scatter take that all-reduce on a copy; for the broadcast the root sends its tensor and the
// center answers with it; for the all-gather each partner sends its block and
// the center answers with all of them. The steps inside each host follow. Messages carry only the data
// their sender has, and every receive is posted at the largest size a message may have (words plus
// kOneRoundMaxBytes, or a reply's partners·(words plus kOneRoundMaxBytes)), so calls that disagree
// (another size, another collective, one on each side of the threshold) still meet in this round,
// and raise, instead of overflowing a receive. A center that loses a partner tells the others which
// rank failed.

// Buffers the hierarchical collectives of one group reuse from call to call, so that a large
// collective does not fault in fresh pages each time (filling a fresh 64 MB buffer took several
// times as long as filling a reused one). Only that group's collectives use them, one at a time (the engine's
// order), and never past the collective's end. Slots 0 and 1 hold a collective's own steps; kFromPeer
// what the other host sends in a step across two hosts, which may reduce into either of them.
class ScratchBuffers {
 public:
  static constexpr int kFromPeer = 2;

  // `numel` elements of `dtype` of buffer `slot` (0, 1 or kFromPeer), contents undefined; grows the
  // buffer.
  at::Tensor get(int slot, int64_t numel, at::ScalarType dtype) {
    TORCH_INTERNAL_ASSERT(slot >= 0 && slot < static_cast<int>(buffers_.size()));
    const int64_t bytes = numel * static_cast<int64_t>(c10::elementSize(dtype));
    at::Tensor& buffer = buffers_[slot];
    if (!buffer.defined() || buffer.numel() < bytes) buffer = at::empty({bytes}, at::kByte);
    return buffer.narrow(0, 0, bytes).view(dtype);
  }

 private:
  std::array<at::Tensor, 3> buffers_;
};

struct Hierarchy {
  Topology topology;
  // This host's shared memory (null when this rank is alone on its host).
  std::shared_ptr<Transport> local;
  // The process group's own backend on the ranks this rank crosses hosts with: the ranks of its
  // local rank on every host (every host holding the same number of ranks), or the hosts' leaders
  // (null on the other ranks).
  c10::intrusive_ptr<c10d::Backend> cross;
  std::shared_ptr<Transport> cross_messages;  // point-to-point messages on `cross`
  std::unique_ptr<SocketLinks> links;         // TCP links among them (Note [Socket links])
  std::vector<int> cross_ranks;               // the group's ranks `cross` spans, in its order
  int cross_rank = 0;
  int cross_size = 1;
  bool uniform = true;  // topology.uniform(): the split form, else the leaders' form
  mutable ScratchBuffers scratch;
};

class Communicator;

// The collective check across equal hosts (`h.uniform`; Note [One round across hosts]) with no data:
// raises alike on every rank unless every rank's header agrees and none rejected its arguments
// (`error`). Counts the collective. Communicator::begin takes it for every collective of a group
// whose hosts are equal, whatever path the collective's data take, so that ranks that ask for
// different algorithms, or reject their arguments, still meet in one round and raise.
void hierarchical_check(const CollectiveHeader& header, const std::string& error, const Hierarchy& h,
                        Communicator& comm);

}  // namespace ddpkit::comm
