#pragma once
// Element-wise reductions: the one definition of every ReduceOp that every ddpkit collective uses
// (Note [Reductions]).

#include <ATen/ATen.h>

#include <array>
#include <bit>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <string_view>
#include <type_traits>

namespace ddpkit::comm {

// Note [Reductions]
// Every path that reduces (the message schedules' combine_, the shared-memory collectives'
// reduce loops, gather-scatter's parameter server) calls reduce_value below, for float32/64 and
// int32/64 (float16/bfloat16 are reduced in a float32 copy: collectives.h), so that they agree
// bit for bit on what an op means:
//  - kSum, kMean: a + b; kMean divides by the world size once, at the end (finish_reduction_).
//  - kMax, kMin on floating point, as IEEE 754-2019 maximum/minimum: a NaN on any rank makes the
//    result NaN (always the same quiet NaN, whatever payloads came in), as torch.maximum/minimum's,
//    and +0 is larger than -0 (where torch's return the first of two zeros). Both make the result
//    independent of the operands' order, so every
//    schedule, recursive doubling included (where the two ranks of a pair combine in opposite
//    orders), gives every rank the same bits. gloo differs: its max/min keep a NaN only when it
//    comes from a rank reduced earlier (std::max), so a NaN on a later rank is dropped there.
//  - Sums are combined in an order every rank agrees on (each schedule computes every element in
//    one place, or, in recursive doubling, with the lower rank's operand first), since a + b and
//    b + a differ in the payload of a NaN.

enum class ReduceOp : int64_t { kSum = 0, kMean = 1, kMax = 2, kMin = 3 };

// One name per ReduceOp, in enum order; parse_reduce_op reads it ("avg" is accepted for kMean, as
// torch.distributed spells it).
inline constexpr std::array<std::string_view, 4> kReduceOpNames = {"sum", "mean", "max", "min"};

// Parses a name of kReduceOpNames (or "avg"); TORCH_CHECK-fails on anything else.
ReduceOp parse_reduce_op(std::string_view name);
std::string_view reduce_op_name(ReduceOp op);

// a (op) b for one element (Note [Reductions]).
template <class T>
inline T reduce_value(T a, T b, ReduceOp op) {
  if (op == ReduceOp::kSum || op == ReduceOp::kMean) return a + b;
  if constexpr (std::is_floating_point_v<T>) {
    if (a != a || b != b) return std::numeric_limits<T>::quiet_NaN();
    if (a == b) {
      // Equal values differ in bits only as +0 and -0: max takes +0 (the sign bits and-ed), min -0.
      using Bits = std::conditional_t<sizeof(T) == 4, uint32_t, uint64_t>;
      const Bits bits = op == ReduceOp::kMax ? (std::bit_cast<Bits>(a) & std::bit_cast<Bits>(b))
                                             : (std::bit_cast<Bits>(a) | std::bit_cast<Bits>(b));
      return std::bit_cast<T>(bits);
    }
  }
  if (op == ReduceOp::kMax) return a > b ? a : b;
  return a < b ? a : b;
}

// True for the dtypes reduce_value serves directly: float32, float64, int32, int64.
bool reduces_natively(at::ScalarType dtype);

// out[i] = a[i] (op) b[i] for `count` elements of `dtype` (reduces_natively); `out` may be `a` or `b`.
void reduce_into(at::ScalarType dtype, void* out, const void* a, const void* b, int64_t count, ReduceOp op);

// accumulator <- accumulator (op) other, in place, or other (op) accumulator with `other_first` (the
// order that decides the bits of a sum's NaN payload; Note [Reductions]). Both tensors have the
// same numel, dtype and device. kMean accumulates as a sum: the division by the world size happens
// once, in finish_reduction_.
void combine_(const at::Tensor& accumulator, const at::Tensor& other, ReduceOp op, bool other_first = false);

// Turns a fully combined value into the result of `op` (divides by `world_size` for kMean).
void finish_reduction_(const at::Tensor& reduced, ReduceOp op, int64_t world_size);

}  // namespace ddpkit::comm
