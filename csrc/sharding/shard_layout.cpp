#include "sharding/shard_layout.h"

#include <c10/util/Exception.h>

#include <algorithm>

namespace ddpkit::sharding {

int64_t shard_size(int64_t total, int64_t world_size) {
  TORCH_CHECK(world_size >= 1, "shard_size: world_size must be >= 1, got ", world_size);
  TORCH_CHECK(total >= 0, "shard_size: a buffer of ", total, " elements");
  return (total + world_size - 1) / world_size;
}

ShardRange shard_range(int64_t total, int64_t world_size, int64_t rank) {
  TORCH_CHECK(rank >= 0 && rank < world_size, "shard_range: rank ", rank, " of a world of ", world_size);
  const int64_t size = shard_size(total, world_size);
  return {std::min(rank * size, total), std::min((rank + 1) * size, total)};
}

std::vector<ShardPiece> shard_pieces(const std::vector<int64_t>& numels, int64_t world_size, int64_t rank) {
  int64_t total = 0;
  for (size_t i = 0; i < numels.size(); ++i) {
    TORCH_CHECK(numels[i] >= 0, "shard_pieces: parameter ", i, " has ", numels[i], " elements");
    total += numels[i];
  }
  const ShardRange shard = shard_range(total, world_size, rank);
  std::vector<ShardPiece> pieces;
  int64_t start = 0;  // the parameter's first element in the buffer
  for (size_t i = 0; i < numels.size() && start < shard.end; start += numels[i], ++i) {
    const int64_t begin = std::max(start, shard.begin);
    const int64_t end = std::min(start + numels[i], shard.end);
    if (begin < end) {
      pieces.push_back({static_cast<int64_t>(i), begin - start, end - begin, begin - shard.begin});
    }
  }
  return pieces;
}

}  // namespace ddpkit::sharding
