#include "fsdp/block_cache.h"

#include <c10/core/impl/alloc_cpu.h>
#include <c10/core/Storage.h>

namespace ddpkit::fsdp {

at::DataPtr BlockCache::allocate(size_t bytes) {
  void* data = nullptr;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto found = free_.find(bytes);
    if (found != free_.end() && !found->second.empty()) {
      data = found->second.back();
      found->second.pop_back();
      cached_bytes_ -= static_cast<int64_t>(bytes);
    }
  }
  if (data == nullptr && bytes > 0) data = c10::alloc_cpu(bytes);
  auto* block = new Block{shared_from_this(), data, bytes};
  return {data, block, &BlockCache::release, at::Device(at::kCPU)};
}

void BlockCache::release(void* context) {
  std::unique_ptr<Block> block(static_cast<Block*>(context));
  if (block->data == nullptr) return;
  BlockCache& cache = *block->cache;
  {
    std::lock_guard<std::mutex> lock(cache.mutex_);
    if (!cache.closed_) {
      cache.free_[block->bytes].push_back(block->data);
      cache.cached_bytes_ += static_cast<int64_t>(block->bytes);
      return;
    }
  }
  c10::free_cpu(block->data);
}

at::Tensor BlockCache::empty(int64_t numel, const at::TensorOptions& options) {
  const size_t bytes = static_cast<size_t>(numel) * c10::elementSize(c10::typeMetaToScalarType(options.dtype()));
  c10::Storage storage(c10::Storage::use_byte_size_t(), bytes, allocate(bytes), /*allocator=*/nullptr,
                       /*resizable=*/false);
  return at::empty({0}, options).set_(std::move(storage), 0, {numel}, {1});
}

void BlockCache::close() {
  std::vector<void*> blocks;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    closed_ = true;
    for (auto& [bytes, list] : free_) blocks.insert(blocks.end(), list.begin(), list.end());
    free_.clear();
    cached_bytes_ = 0;
  }
  for (void* data : blocks) c10::free_cpu(data);
}

int64_t BlockCache::cached_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return cached_bytes_;
}

}  // namespace ddpkit::fsdp
