#pragma once
// The reduction family: what every ReduceOp means for one element, the one dispatch over (op ×
// dtype), and the loops every ddpkit collective reduces with (Note [One reduction family]).

#include "comm/reduction/reduce_op.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace ddpkit::comm {

// Note [Reductions]
// Every path that reduces (the message schedules' combine_, the shared-memory collectives' reduce
// loops, gather-scatter's parameter server, the swap across hosts) reduces with the functors below,
// for float32/64 and int32/64 (float16/bfloat16 are reduced in a float32 copy: collectives/collectives.h), so
// that they agree bit for bit on what an op means:
//  - kSum, kMean: a + b; kMean divides by the world size once, at the end (Note [One reduction family]).
//  - kMax, kMin on floating point, as IEEE 754-2019 maximum/minimum: a NaN on any rank makes the
//    result NaN (always the same quiet NaN, whatever payloads came in), as torch.maximum/minimum's,
//    and +0 is larger than -0 (where torch's return the first of two zeros). Both make the result
//    independent of the operands' order, so every
//    schedule, recursive doubling included (where the two ranks of a pair combine in opposite
//    orders), gives every rank the same bits. gloo differs: its max/min keep a NaN only when it
//    comes from a rank reduced earlier (std::max), so a NaN on a later rank is dropped there.
//  - Sums are combined in an order every rank agrees on (each schedule computes every element in
//    one place, or, in recursive doubling, with the lower rank's operand first), since a + b and
//    b + a differ in the payload of a NaN. The shared-memory collectives (shm/direct.h) sum every
//    element in rank order, whichever rank's slice it falls in, so that an all-reduce, which slices
//    by chunk, and a reduce-scatter, which slices by block, give every element the same bits: what
//    makes ZeRO-2's gradient shards DDP's (Note [Sharded gradients] in ddp/reducer.h).
//
// Note [One reduction family]
// As NCCL's reduction/reduce_kernel.h: one functor per way of combining two elements (FuncSum, FuncMax,
// FuncMin), templated on the element type, and one dispatch, visit_reduction, the only code that
// turns a runtime (dtype, op) into them. Every loop is written once, as a template over a functor,
// and instantiated through that dispatch: reduce_pair (combine_: the message schedules,
// gather-scatter's root, the swap across hosts), reduce_sources (the shared-memory collectives),
// and, for tensors off the CPU, the functor's ATen kernel (combine_on_device). The functor is a
// type, so each (op, dtype) gets its own loop with no branch on the op and no call through a
// pointer inside, which the compiler vectorises (the sum's); a new op is a functor and a case in
// visit_reduction, a new dtype a case there.
// The mean, as NCCL's FuncSumPostDiv: it combines as a sum (visit_reduction hands kMean FuncSum,
// and one sum loop per dtype serves both ops), and the result is divided by the number of ranks
// once, by divide_for_mean, the one division: finish_reduction_ calls it on a finished result (the
// schedules, the process group's sum, the hierarchical collectives), reduce_sources on each block it
// finishes while the block is still in L1 (the direct all-reduce's and reduce-scatter's). Tensors
// off the CPU take ATen's div_ instead, whose rounding is the device's (CUDA's multiplies by the
// reciprocal). On the CPU the division is x / n, element by element, which is what ATen's CPU div_
// computes: every loop agrees with the others and with torch, for every op and dtype, in every bit
// but a sum's NaN payloads (tests/test_reductions.py). Those payloads are the compiler's choice of
// operand order in a + b, which C++ leaves open and which moves with the code around a loop: what
// is promised is that every rank gets the same bits (every rank runs the same loops;
// tests/test_hardening.py's test_nan_and_signed_zeros_reduce_alike_on_every_algorithm), and one sum
// loop per dtype serves both the sum and the mean.

// a + b: kSum, and kMean's combining (the division comes after: divide_for_mean).
template <class T>
struct FuncSum {
  using Element = T;
  T operator()(T a, T b) const { return a + b; }
  static void combine_on_device(const at::Tensor& accumulator, const at::Tensor& other, bool other_first) {
    if (other_first) {
      at::add_out(const_cast<at::Tensor&>(accumulator), other, accumulator);
    } else {
      accumulator.add_(other);
    }
  }
};

// IEEE 754-2019 maximum (Note [Reductions]) on floating point; the larger of two integers.
template <class T>
struct FuncMax {
  using Element = T;
  T operator()(T a, T b) const {
    if constexpr (std::is_floating_point_v<T>) {
      if (a != a || b != b) return std::numeric_limits<T>::quiet_NaN();
      // Equal values differ in bits only as +0 and -0: max takes +0 (the sign bits and-ed).
      if (a == b) return std::bit_cast<T>(std::bit_cast<Bits>(a) & std::bit_cast<Bits>(b));
    }
    return a > b ? a : b;
  }
  static void combine_on_device(const at::Tensor& accumulator, const at::Tensor& other, bool /*other_first*/) {
    at::maximum_out(const_cast<at::Tensor&>(accumulator), accumulator, other);
  }

 private:
  using Bits = std::conditional_t<sizeof(T) == 4, uint32_t, uint64_t>;
};

// IEEE 754-2019 minimum (Note [Reductions]) on floating point; the smaller of two integers.
template <class T>
struct FuncMin {
  using Element = T;
  T operator()(T a, T b) const {
    if constexpr (std::is_floating_point_v<T>) {
      if (a != a || b != b) return std::numeric_limits<T>::quiet_NaN();
      // Equal values differ in bits only as +0 and -0: min takes -0 (the sign bits or-ed).
      if (a == b) return std::bit_cast<T>(std::bit_cast<Bits>(a) | std::bit_cast<Bits>(b));
    }
    return a < b ? a : b;
  }
  static void combine_on_device(const at::Tensor& accumulator, const at::Tensor& other, bool /*other_first*/) {
    at::minimum_out(const_cast<at::Tensor&>(accumulator), accumulator, other);
  }

 private:
  using Bits = std::conditional_t<sizeof(T) == 4, uint32_t, uint64_t>;
};

// data[i] <- data[i] / ranks: the one division of every mean (Note [One reduction family]). Only
// floating point: tensor_error (core/arguments.h) rejects an integer mean before it reduces.
template <class T>
void divide_for_mean(T* data, int64_t count, int64_t ranks) {
  if constexpr (std::is_floating_point_v<T>) {
    const T divisor = static_cast<T>(ranks);
    for (int64_t i = 0; i < count; ++i) data[i] = data[i] / divisor;
  } else {
    TORCH_INTERNAL_ASSERT(count == 0, "an integer mean reached a reduction (tensor_error rejects it)");
  }
}

// True for the dtypes the family reduces: float32, float64, int32, int64.
inline bool reduces_natively(at::ScalarType dtype) {
  return dtype == at::kFloat || dtype == at::kDouble || dtype == at::kInt || dtype == at::kLong;
}

namespace reduce_detail {

template <class T, class Visitor>
void visit_op(ReduceOp op, Visitor&& visit) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kMean: return visit(FuncSum<T>{});
    case ReduceOp::kMax: return visit(FuncMax<T>{});
    case ReduceOp::kMin: return visit(FuncMin<T>{});
  }
  TORCH_INTERNAL_ASSERT(false, "unknown reduce op ", static_cast<int64_t>(op));
}

}  // namespace reduce_detail

// The one dispatch (Note [One reduction family]): calls visit(Func<T>{}) with the functor `op`
// combines with (FuncSum for kSum and kMean) for the element type T of `dtype` (reduces_natively:
// the caller reduces other dtypes in a working copy, core/arguments.h).
template <class Visitor>
void visit_reduction(at::ScalarType dtype, ReduceOp op, Visitor&& visit) {
  switch (dtype) {
    case at::kFloat: return reduce_detail::visit_op<float>(op, visit);
    case at::kDouble: return reduce_detail::visit_op<double>(op, visit);
    case at::kInt: return reduce_detail::visit_op<int32_t>(op, visit);
    case at::kLong: return reduce_detail::visit_op<int64_t>(op, visit);
    default: TORCH_INTERNAL_ASSERT(false, "ddpkit reduces float32/64 and int32/64, got ", dtype);
  }
}

// out[i] = fn(a[i], b[i]) for `count` elements; `out` may be `a` or `b`. A step: nothing is divided.
template <class Fn, class T = typename Fn::Element>
void reduce_pair(Fn fn, T* out, const T* a, const T* b, int64_t count) {
  for (int64_t i = 0; i < count; ++i) out[i] = fn(a[i], b[i]);
}

// reduce_pair for `count` elements of `dtype` (reduces_natively), through visit_reduction: a step,
// so a kMean only sums.
void reduce_pair(at::ScalarType dtype, ReduceOp op, void* out, const void* a, const void* b, int64_t count);

// out[i] = sources[0][i] fn sources[1][i] fn ... fn sources[n-1][i], each source read from element
// `offset` on, in the order given, so the bits depend only on the inputs and that order; then, with
// `mean`, divide_for_mean by n (a whole reduction). `out` may be sources[0], no other source. Blocks
// keep `out` in L1 across the passes; `also` (when not null) receives a copy of each finished block
// from L1, which costs only its writes.
template <class Fn, class T = typename Fn::Element>
void reduce_sources(Fn fn, T* out, const std::vector<const char*>& sources, int64_t offset, int64_t count, T* also,
                    bool mean) {
  constexpr int64_t kBlock = 4096 / sizeof(T) * 4;
  const int n = static_cast<int>(sources.size());
  for (int64_t b = 0; b < count; b += kBlock) {
    const int64_t m = std::min(kBlock, count - b);
    T* o = out + b;
    const T* s0 = reinterpret_cast<const T*>(sources[0]) + offset + b;
    if (n == 1 && o != s0) std::memmove(o, s0, m * sizeof(T));
    for (int j = 1; j < n; ++j) {
      const T* a = j == 1 ? s0 : o;
      const T* s = reinterpret_cast<const T*>(sources[j]) + offset + b;
      for (int64_t i = 0; i < m; ++i) o[i] = fn(a[i], s[i]);
    }
    if (mean) divide_for_mean(o, m, n);
    if (also != nullptr) std::memcpy(also + b, o, m * sizeof(T));
  }
}

// reduce_sources for `count` elements of `dtype` (reduces_natively), through visit_reduction; a
// kMean is whole here, divided by the number of sources.
inline void reduce_sources(at::ScalarType dtype, ReduceOp op, char* out, const std::vector<const char*>& sources,
                           int64_t offset, int64_t count, char* also = nullptr) {
  visit_reduction(dtype, op, [&](auto fn) {
    using T = typename decltype(fn)::Element;
    reduce_sources(fn, reinterpret_cast<T*>(out), sources, offset, count, reinterpret_cast<T*>(also),
                   op == ReduceOp::kMean);
  });
}

// accumulator <- accumulator (op) other, in place, or other (op) accumulator with `other_first` (the
// order that decides the bits of a sum's NaN payload; Note [Reductions]). Both tensors have the
// same numel, dtype and device. A step: kMean accumulates as a sum, divided once, in
// finish_reduction_. On the CPU reduce_pair; other devices (CUDA tensors of an NCCL group), the
// functor's ATen kernel, NaN-propagating like the CPU's; the sign of a zero max/min there is the device's.
void combine_(const at::Tensor& accumulator, const at::Tensor& other, ReduceOp op, bool other_first = false);

// Turns a fully combined value into the result of `op`: for kMean divide_for_mean by `world_size`
// (on the CPU; ATen's div_ elsewhere); nothing for the other ops or a world of one.
void finish_reduction_(const at::Tensor& reduced, ReduceOp op, int64_t world_size);

}  // namespace ddpkit::comm
