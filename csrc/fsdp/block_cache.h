#pragma once
// The memory of ddpkit.FullyShardedDataParallel's buffers, kept between uses (Note [Block cache]).

#include <ATen/ATen.h>
#include <c10/core/Allocator.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace ddpkit::fsdp {

// Note [Block cache]
// A unit's buffers are large (its compute buffer, its gradient, its reduced shard) and come and go
// several times a step. From the system allocator each would come as fresh pages: glibc maps a block
// that large anew each time (its dynamic threshold sends a request of the size just freed to mmap
// again), and the kernel zeroes every page at its first touch, which costs about as much as the copy
// that fills it. A BlockCache keeps the blocks its tensors release, by size, and hands them out again,
// so after the first step a state allocates nothing. It holds at most what was in use at once (a
// block is cached only once released), and close() frees what it holds; blocks still in use then
// (gradients the optimizer holds) are freed when released.
class BlockCache final : public c10::Allocator, public std::enable_shared_from_this<BlockCache> {
 public:
  at::DataPtr allocate(size_t bytes) override;
  void copy_data(void* dest, const void* src, std::size_t count) const override { default_copy_data(dest, src, count); }
  // A 1-D tensor of `numel` elements of `options` (CPU) over a block of this cache.
  at::Tensor empty(int64_t numel, const at::TensorOptions& options);
  // Frees the cached blocks; from now on released blocks are freed, not cached.
  void close();
  int64_t cached_bytes() const;

 private:
  struct Block {
    std::shared_ptr<BlockCache> cache;
    void* data;
    size_t bytes;
  };
  static void release(void* block);

  mutable std::mutex mutex_;
  std::unordered_map<size_t, std::vector<void*>> free_;
  int64_t cached_bytes_ = 0;
  bool closed_ = false;
};

}  // namespace ddpkit::fsdp
