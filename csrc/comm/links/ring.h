#pragma once
// The ring across three hosts or more over ddpkit's own socket links (Note [A ring across hosts]).

#include "comm/core/scratch.h"
#include "comm/core/wire_format.h"
#include "comm/links/links.h"
#include "comm/reduction/reduce_op.h"

#include <ATen/ATen.h>

#include <cstdint>

namespace ddpkit::comm {

// Note [A ring across hosts]
// Among N >= 3 hosts the steps across hosts run on a ring over the socket links (Note [Socket
// links]): rank r sends to r + 1 and receives from r - 1, one frame each way per step, both at
// once. The vocabulary, said once:
//  - a block is one of the N parts a ring splits a tensor into (BalancedSplit's: sizes differing
//    by at most one element, the first numel % N one longer), or one of a reduce-scatter's N
//    blocks of m elements;
//  - a step is one frame each way: a block out to the right, a block in from the left; a
//    collective's steps all go in one exchange (Note [A streaming ring]);
//  - a part is what the receiver reduces at a time while the rest of its block arrives
//    (kLinkPartBytes in links/links.h), so that receiving, reducing and the right neighbour's sending overlap.
// The reduce-scatter takes N - 1 steps: at step s rank r sends block r - 1 - s and receives block
// r - 2 - s (through a window, Note [Receiving windows], where blocks exceed one), which it
// reduces into its own copy, the incoming partial result first; after the last step rank r holds
// block r reduced over every rank, in the one order the ring gives it (x_{b+1}, x_{b+2}, ...,
// x_b), so every element is reduced in one place (Note [Reductions]). The
// all-gather takes N - 1 steps more: at step s rank r sends block r - s and receives block r - 1 - s
// straight into place. Each link carries 2(N-1)/N of the tensor, what a bandwidth-optimal
// all-reduce must; a kMean is summed (the caller divides once).
// With a compressed wire format (Note [Compressed crossing]) every frame carries the block in
// that format: the sender encodes what it sends, the receiver decodes a part into a float32
// scratch and reduces it from there; the all-gather forwards the frames' bytes as they came, and
// the owner of a block replaces its own copy by the decoded one, so that every rank ends with the
// same bits.

// Note [A streaming ring]
// A ring's step sends what the step before it received (reduced, in the reduce-scatter; as it came,
// in the all-gather). Run as one exchange per step, each step waited for the last part of the
// block before it, and across a path of some milliseconds every step paid the path's delay again
// with its link idle meanwhile: 2(N - 1) delays per all-reduce. So a collective's steps are the
// frames of one exchange: frames to the right neighbour go in order, and each after the first
// follows the frame before it from the left (Links::Send::follows), going out part by part as that
// frame's parts are reduced. The link stays busy from the first frame to the last and a path's
// delay is paid about once. Each part is still reduced once, in the order the ring gives it, so
// the results are the bits the steps gave one at a time. The frames from the left share one
// receiving buffer (or window), each received once the one before it was reduced whole. The 4x1
// points of bench_multihost.py --links 1gbit-10ms time it against gloo; compare_builds.sh --hosts
// against the build before it on undelayed links.

// In place: op over every rank's `flat` (contiguous; any dtype the reduction family takes; `wire`
// only for float32 sums and means, Note [Compressed crossing]).
void ring_all_reduce(Links& links, uint64_t sequence, const at::Tensor& flat, ReduceOp op, WireFormat wire,
                     ScratchBuffers& scratch);

// `run` holds N blocks of `m` elements: op over every rank's block rank into this rank's block rank;
// the other blocks are left with partial results.
void ring_reduce_scatter(Links& links, uint64_t sequence, const at::Tensor& run, int64_t m, ReduceOp op,
                         WireFormat wire, ScratchBuffers& scratch);

// `flat` holds N blocks of `m` elements (any dtype: bytes move), this rank's at its rank: every
// rank's block into every rank's `flat`.
void ring_all_gather(Links& links, uint64_t sequence, const at::Tensor& flat, int64_t m);

}  // namespace ddpkit::comm
