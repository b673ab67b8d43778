#pragma once
// Buffers a group's hierarchical collectives reuse from call to call.

#include <ATen/ATen.h>

#include <array>
#include <cstdint>

namespace ddpkit::comm {

// Buffers the hierarchical collectives of one group reuse from call to call, so that a large
// collective does not fault in fresh pages each time (the large points of bench_multihost.py are what
// it keeps down). Only that group's collectives use them, one at a time (the engine's
// order), and never past the collective's end. Slots 0 and 1 hold a collective's own steps; kFromPeer
// what another host sends in a step across hosts, which may reduce into either of them; kWire and
// kDecoded the frames of a compressed crossing and a part of one decoded (Note [Compressed crossing]).
class ScratchBuffers {
 public:
  static constexpr int kFromPeer = 2;
  static constexpr int kWire = 3;
  static constexpr int kDecoded = 4;

  // `numel` elements of `dtype` of buffer `slot` (0, 1 or a named one), contents undefined; grows the
  // buffer.
  at::Tensor get(int slot, int64_t numel, at::ScalarType dtype) {
    TORCH_INTERNAL_ASSERT(slot >= 0 && slot < static_cast<int>(buffers_.size()));
    const int64_t bytes = numel * static_cast<int64_t>(c10::elementSize(dtype));
    at::Tensor& buffer = buffers_[slot];
    if (!buffer.defined() || buffer.numel() < bytes) buffer = at::empty({bytes}, at::kByte);
    return buffer.narrow(0, 0, bytes).view(dtype);
  }

 private:
  std::array<at::Tensor, 5> buffers_;
};

}  // namespace ddpkit::comm
