#pragma once
// Element-wise reductions used by every ddpkit collective.

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <string_view>

namespace ddpkit::comm {

enum class ReduceOp : int64_t { kSum = 0, kMean = 1, kMax = 2, kMin = 3 };

// Parses "sum" | "mean" | "avg" | "max" | "min"; TORCH_CHECK-fails on anything else.
ReduceOp parse_reduce_op(std::string_view name);
std::string_view reduce_op_name(ReduceOp op);

// accumulator <- accumulator (op) other, in place. Both tensors have the same numel, dtype and device.
// kMean accumulates as a sum: the division by the world size happens once, in finish_reduction_.
void combine_(const at::Tensor& accumulator, const at::Tensor& other, ReduceOp op);

// Turns a fully combined value into the result of `op` (divides by `world_size` for kMean).
void finish_reduction_(const at::Tensor& reduced, ReduceOp op, int64_t world_size);

}  // namespace ddpkit::comm
