#pragma once
// Which rank owns which elements of a flat buffer that ranks shard (ZeRO-1/2/3). Pure functions: no
// tensors, no state; ddpkit.sharding (python/ddpkit/sharding.py) is their Python face.

#include <cstdint>
#include <vector>

namespace ddpkit::sharding {

// Note [Shard layout]
// A flat buffer of T elements (the concatenation of some parameters, or of their gradients, in an
// order every rank agrees on) is split over N ranks into N equal contiguous shards of S = ceil(T / N)
// elements: the buffer is padded to N·S elements, the padding zero and owned by no parameter, and
// rank r owns elements [r·S, min((r+1)·S, T)) (its shard; the last ranks' may be shorter, or empty
// where T < N·S - S). As Megatron's distributed optimizer, and unlike torch's ZeroRedundancyOptimizer
// (which hands out whole parameters greedily):
//  - equal blocks are what a reduce-scatter and an all-gather of the padded buffer exchange
//    (torch's reduce_scatter_tensor and all_gather_into_tensor take equal blocks), so a rank's
//    shard of the gradients and of the parameters is one collective each, whatever the parameters;
//  - every rank owns within S of T/N elements, however the parameters' sizes fall;
//  - a parameter may straddle two or more ranks' shards: each owner holds a piece of it
//    (shard_pieces), a view of the parameter's elements [param_offset, param_offset + length).
// No alignment: shards start wherever ceil(T / N) puts them and parameters follow each other without
// gaps. An elementwise optimizer gives the same bits on a piece at any offset as on the whole
// parameter (torch's CPU kernels compute their vectorised body and scalar tail alike:
// tests/test_shard_layout.py's test_elementwise_optimizers_give_the_same_bits_on_pieces), so nothing is
// gained by aligning, and a layout with no gaps is the one every user of it computes alike.

// S = ceil(total / world_size) (0 for an empty buffer): the elements of each rank's shard, padding
// included. world_size >= 1, total >= 0.
int64_t shard_size(int64_t total, int64_t world_size);

// The elements [begin, end) of the buffer that rank `rank` owns (end == begin: none).
struct ShardRange {
  int64_t begin = 0;
  int64_t end = 0;
};
ShardRange shard_range(int64_t total, int64_t world_size, int64_t rank);

// One parameter's elements that fall in one rank's shard.
struct ShardPiece {
  int64_t param = 0;         // index into the `numels` given to shard_pieces
  int64_t param_offset = 0;  // first element of the piece in the (flattened) parameter
  int64_t length = 0;        // elements, > 0
  int64_t shard_offset = 0;  // first element of the piece in the rank's shard
};

// The pieces of rank `rank`'s shard of the buffer that holds parameters of `numels` elements back to
// back, in that order (a parameter of 0 elements has no piece), in buffer order: their lengths add
// up to the shard's elements without the padding.
std::vector<ShardPiece> shard_pieces(const std::vector<int64_t>& numels, int64_t world_size, int64_t rank);

}  // namespace ddpkit::sharding
