#pragma once
// The algorithms of ddpkit's collectives: their names, and what kAuto takes.

#include <c10/core/DeviceType.h>

#include "comm/reduction/reduce_op.h"

#include <array>
#include <cstdint>
#include <string_view>

namespace ddpkit::comm {

// Note [All-reduce algorithms]
// n ranks, a vector of N elements, α the latency of one message round, β the time per byte.
//  kRing              reduce-scatter then all-gather around the ring, n chunks:
//                     2(n-1) rounds, 2(n-1)/n·N bytes sent per rank. Bandwidth-optimal.
//  kButterfly         pairwise: rank i owns chunk i, receives it from every peer,
//                     reduces it and sends it back to every peer: 2 rounds of n-1 concurrent
//                     messages each, 2(n-1)/n·N bytes per rank.
//  kStar              linear reduce to rank 0 and linear broadcast back (the naive one):
//                     rank 0 sends and receives (n-1)·N.
//  kGatherScatter     rank 0 gathers all n vectors into one [n, N] buffer, reduces it along the first
//                     dimension and sends the result back (a parameter server).
//  kRecursiveDoubling log2(n) rounds exchanging the whole vector with rank^2^k: the fewest rounds,
//                     N·log2(n) bytes per rank; wins for small messages.
//  kHalvingDoubling   Rabenseifner: reduce-scatter by recursive halving, all-gather by recursive
//                     doubling: 2·log2(n) rounds and the ring's byte count.
//  kDirect            shared memory only, no messages: every rank publishes its vector in its slot
//                     and reduces its 1/n slice (or, small, the whole vector) straight from its
//                     peers' slots: one copy in, one reduce pass, one copy out (Note [Direct all-reduce]).
//  kHierarchical      a group spanning hosts: shared memory inside each host; across them a swap
//                     over ddpkit's own TCP links between two hosts, else the process group's own
//                     all-reduce; small vectors in the check's one round (Note [Hierarchical
//                     collectives] in hierarchy/one_round.h, Note [One round across hosts] in
//                     checks/cross_host_check.h, Note [Socket links] in links/socket_links.h).
// For n not a power of two, the recursive algorithms first fold the 2·(n-p) lowest ranks pairwise
// (p the largest power of two below n) and unfold at the end: two more rounds of the whole vector.
// kAuto picks by message size and n (choose_algorithm), from benchmarks/bench_allreduce.py on
// gloo over loopback (Note [Choosing an algorithm]).
//
// Note [Choosing an algorithm]
// Over shared memory (every rank on this host, CPU tensors; Note [Collective engine]) kAuto always
// takes kDirect: it has no per-message cost and touches each byte the fewest times, and it beats
// every message schedule over the same memory (bench_allreduce.py's shared-memory candidates,
// benchmarks/results/allreduce.json).
// Over the process group (gloo over TCP, across hosts), on a small machine with more ranks than
// cores, an all-reduce of up to a few hundred KB costs scheduling, not bytes: each rank has a main
// thread and a gloo event-loop thread, and whenever more of them are runnable than there are cores,
// one waits out a time slice. Schedules whose rounds keep both ends of every message busy at once
// (ring, recursive doubling) hit that often; the star, where rank 0 receives while the others wait
// and then sends while they receive, hits it least (bench_allreduce.py's process-group candidates
// against gloo's own all-reduce decided it). Large messages are the opposite case: inside DDP's
// backward the CPUs are busy anyway, and the star's rank 0, which alone receives, reduces and
// returns the whole vector, finishes a large bucket far later than a ring that spreads that work
// evenly. So over the process group kAuto takes the star up to kStarMaxBytes while rank 0's share,
// (n-1)·bytes, stays within kStarBudgetBytes; beyond that, sums and means take the group's own
// all-reduce (gloo's pipelined TCP ring, which point-to-point schedules over its send/recv do not
// beat there: bench_multihost.py's ddpkit_flat candidate), max and min halving-doubling for powers
// of two, else the ring (they keep Note [Reductions]'s semantics, which gloo's do not). So these
// choices serve a group on one host whose collectives go over the process group (by request, or
// where shared memory cannot be had); a group spanning hosts takes kHierarchical at every size, also
// with one rank per host. On GPUs kAuto takes the group's own all-reduce: NCCL's kernels beat any
// schedule of point-to-point calls. The collective check runs whichever algorithm kAuto takes; only
// kProcessGroup asked for by name skips it (the baseline).

// Note [All-gather and reduce-scatter]
// The two halves of the ring all-reduce, as collectives of their own (torch's
// all_gather_into_tensor and reduce_scatter_tensor), on n ranks and blocks of m elements:
//  kRing    n-1 rounds around the ring; all-gather forwards the block received last round,
//           reduce-scatter passes on its partial sum of the next block: (n-1)·m elements per rank.
//  kHalvingDoubling  power-of-two n only: log2(n) rounds with partner r^d; reduce-scatter halves
//           the run of blocks it keeps each round (d = n/2 .. 1), all-gather doubles the run it
//           holds (d = 1 .. n/2): the ring's bytes in log2(n) rounds instead of n-1.
//  kDirect  shared memory only: every rank publishes its input in its slot and reads what it needs
//           from its peers' (Note [Direct all-gather and reduce-scatter] in shm/direct.h).
//  kHierarchical  a group spanning hosts: shared memory inside each host, the ranks of each local
//           rank across them (Note [Hierarchical collectives] in hierarchy/one_round.h).
//  kAuto    kDirect over shared memory, kHierarchical across hosts, else kRing.
// Any other algorithm (or kDirect without shared memory, kHalvingDoubling on another n) is one a
// rank cannot run.

enum class Algorithm : int64_t {
  kRing = 0,
  kButterfly = 1,
  kStar = 2,
  kGatherScatter = 3,
  kRecursiveDoubling = 4,
  kHalvingDoubling = 5,
  kAuto = 6,
  kProcessGroup = 7,
  kDirect = 8,
  kHierarchical = 9,
};

// One name per Algorithm, in enum order (what the Python API and errors say).
inline constexpr std::array<std::string_view, 10> kAlgorithmNames = {
    "ring", "butterfly",     "star",   "gather_scatter", "recursive_doubling", "halving_doubling",
    "auto", "process_group", "direct", "hierarchical"};
// Parses a name of kAlgorithmNames; TORCH_CHECK-fails otherwise.
Algorithm parse_algorithm(std::string_view name);
std::string_view algorithm_name(Algorithm algorithm);

// What kAuto runs for a message of `bytes` bytes on `world_size` ranks of a `device` tensor, over
// shared memory or not (never kAuto); Note [Choosing an algorithm].
Algorithm choose_algorithm(int64_t bytes, int world_size, c10::DeviceType device = c10::kCPU,
                           bool shared_memory = false, bool hierarchical = false, ReduceOp op = ReduceOp::kSum);

}  // namespace ddpkit::comm
