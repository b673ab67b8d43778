#include "comm/reduction/reduce_op.h"

#include <c10/util/Exception.h>

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

}  // namespace ddpkit::comm
