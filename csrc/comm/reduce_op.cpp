#include "comm/reduce_op.h"

namespace ddpkit::comm {

ReduceOp parse_reduce_op(std::string_view name) {
  if (name == "avg") return ReduceOp::kMean;
  for (size_t i = 0; i < kReduceOpNames.size(); ++i) {
    if (kReduceOpNames[i] == name) return static_cast<ReduceOp>(i);
  }
  TORCH_CHECK(false, "ddpkit: unknown reduce op '", name, "'; expected one of sum, mean, max, min");
}

std::string_view reduce_op_name(ReduceOp op) {
  const auto index = static_cast<size_t>(op);
  TORCH_INTERNAL_ASSERT(index < kReduceOpNames.size(), "unknown reduce op ", index);
  return kReduceOpNames[index];
}

bool reduces_natively(at::ScalarType dtype) {
  return dtype == at::kFloat || dtype == at::kDouble || dtype == at::kInt || dtype == at::kLong;
}

namespace {

template <class T>
void reduce_into_typed(T* out, const T* a, const T* b, int64_t count, ReduceOp op) {
  // One loop per op, so that the compiler vectorises each without a branch on `op` inside.
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kMean:
      for (int64_t i = 0; i < count; ++i) out[i] = a[i] + b[i];
      return;
    case ReduceOp::kMax:
      for (int64_t i = 0; i < count; ++i) out[i] = reduce_value(a[i], b[i], ReduceOp::kMax);
      return;
    case ReduceOp::kMin:
      for (int64_t i = 0; i < count; ++i) out[i] = reduce_value(a[i], b[i], ReduceOp::kMin);
      return;
  }
}

}  // namespace

void reduce_into(at::ScalarType dtype, void* out, const void* a, const void* b, int64_t count, ReduceOp op) {
  switch (dtype) {
    case at::kFloat:
      return reduce_into_typed(static_cast<float*>(out), static_cast<const float*>(a), static_cast<const float*>(b),
                               count, op);
    case at::kDouble:
      return reduce_into_typed(static_cast<double*>(out), static_cast<const double*>(a), static_cast<const double*>(b),
                               count, op);
    case at::kInt:
      return reduce_into_typed(static_cast<int32_t*>(out), static_cast<const int32_t*>(a),
                               static_cast<const int32_t*>(b), count, op);
    case at::kLong:
      return reduce_into_typed(static_cast<int64_t*>(out), static_cast<const int64_t*>(a),
                               static_cast<const int64_t*>(b), count, op);
    default: TORCH_INTERNAL_ASSERT(false, "reduce_into reduces float32/64 and int32/64, got ", dtype);
  }
}

void combine_(const at::Tensor& accumulator, const at::Tensor& other, ReduceOp op, bool other_first) {
  TORCH_INTERNAL_ASSERT(accumulator.numel() == other.numel());
  if (accumulator.device().is_cpu() && other.device().is_cpu() && accumulator.is_contiguous() &&
      other.is_contiguous() && accumulator.scalar_type() == other.scalar_type() &&
      reduces_natively(accumulator.scalar_type())) {
    void* acc = accumulator.data_ptr();
    const void* oth = other.data_ptr();
    reduce_into(accumulator.scalar_type(), acc, other_first ? oth : acc, other_first ? acc : oth, accumulator.numel(),
                op);
    return;
  }
  // Other devices (CUDA tensors of an NCCL group): ATen's own kernels, NaN-propagating like the
  // CPU path; the sign of a zero max/min there is the device's.
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kMean:
      if (other_first) {
        at::add_out(const_cast<at::Tensor&>(accumulator), other, accumulator);
      } else {
        accumulator.add_(other);
      }
      return;
    case ReduceOp::kMax: at::maximum_out(const_cast<at::Tensor&>(accumulator), accumulator, other); return;
    case ReduceOp::kMin: at::minimum_out(const_cast<at::Tensor&>(accumulator), accumulator, other); return;
  }
}

void finish_reduction_(const at::Tensor& reduced, ReduceOp op, int64_t world_size) {
  if (op != ReduceOp::kMean || world_size == 1) return;
  reduced.div_(world_size);
}

}  // namespace ddpkit::comm
