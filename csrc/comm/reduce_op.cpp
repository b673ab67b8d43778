#include "comm/reduce_op.h"

namespace ddpkit::comm {

ReduceOp parse_reduce_op(std::string_view name) {
  if (name == "sum") return ReduceOp::kSum;
  if (name == "mean" || name == "avg") return ReduceOp::kMean;
  if (name == "max") return ReduceOp::kMax;
  if (name == "min") return ReduceOp::kMin;
  TORCH_CHECK(false, "ddpkit: unknown reduce op '", name, "'; expected one of sum, mean, max, min");
}

std::string_view reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kMean: return "mean";
    case ReduceOp::kMax: return "max";
    case ReduceOp::kMin: return "min";
  }
  TORCH_INTERNAL_ASSERT(false, "unreachable reduce op");
}

void combine_(const at::Tensor& accumulator, const at::Tensor& other, ReduceOp op) {
  TORCH_INTERNAL_ASSERT(accumulator.numel() == other.numel());
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kMean:
      accumulator.add_(other);
      return;
    case ReduceOp::kMax:
      accumulator.clamp_min_(other);  // elementwise max(accumulator, other)
      return;
    case ReduceOp::kMin:
      accumulator.clamp_max_(other);  // elementwise min(accumulator, other)
      return;
  }
}

void finish_reduction_(const at::Tensor& reduced, ReduceOp op, int64_t world_size) {
  if (op != ReduceOp::kMean || world_size == 1) return;
  reduced.div_(world_size);
}

}  // namespace ddpkit::comm
