#include "comm/reduction/reduce_kernel.h"

namespace ddpkit::comm {
namespace {

// True where the CPU loops reduce `tensor` in place: contiguous on the CPU, in a dtype of the family.
bool on_cpu_loops(const at::Tensor& tensor) {
  return tensor.device().is_cpu() && tensor.is_contiguous() && reduces_natively(tensor.scalar_type());
}

}  // namespace

void reduce_pair(at::ScalarType dtype, ReduceOp op, void* out, const void* a, const void* b, int64_t count) {
  visit_reduction(dtype, op, [&](auto fn) {
    using T = typename decltype(fn)::Element;
    reduce_pair(fn, static_cast<T*>(out), static_cast<const T*>(a), static_cast<const T*>(b), count);
  });
}

void combine_(const at::Tensor& accumulator, const at::Tensor& other, ReduceOp op, bool other_first) {
  TORCH_INTERNAL_ASSERT(accumulator.numel() == other.numel());
  if (on_cpu_loops(accumulator) && other.device().is_cpu() && other.is_contiguous() &&
      accumulator.scalar_type() == other.scalar_type()) {
    void* acc = accumulator.data_ptr();
    const void* oth = other.data_ptr();
    reduce_pair(accumulator.scalar_type(), op, acc, other_first ? oth : acc, other_first ? acc : oth,
                accumulator.numel());
    return;
  }
  visit_reduction(accumulator.scalar_type(), op,
                  [&](auto fn) { decltype(fn)::combine_on_device(accumulator, other, other_first); });
}

void finish_reduction_(const at::Tensor& reduced, ReduceOp op, int64_t world_size) {
  if (op != ReduceOp::kMean || world_size == 1) return;
  if (!on_cpu_loops(reduced)) {
    reduced.div_(world_size);  // the device's own division (Note [One reduction family])
    return;
  }
  visit_reduction(reduced.scalar_type(), op, [&](auto fn) {
    using T = typename decltype(fn)::Element;
    divide_for_mean(reduced.data_ptr<T>(), reduced.numel(), world_size);
  });
}

}  // namespace ddpkit::comm
