#pragma once
// The reduce ops' names, and the one rule for a mean's steps. What an op computes, and the loops
// that compute it, are the reduction family's (Note [Reductions] and Note [One reduction family] in
// reduction/reduce_kernel.h).

#include <array>
#include <cstdint>
#include <string_view>

namespace ddpkit::comm {

enum class ReduceOp : int64_t { kSum = 0, kMean = 1, kMax = 2, kMin = 3 };

// One name per ReduceOp, in enum order; parse_reduce_op reads it ("avg" is accepted for kMean, as
// torch.distributed spells it).
inline constexpr std::array<std::string_view, 4> kReduceOpNames = {"sum", "mean", "max", "min"};

// Parses a name of kReduceOpNames (or "avg"); TORCH_CHECK-fails on anything else.
ReduceOp parse_reduce_op(std::string_view name);
std::string_view reduce_op_name(ReduceOp op);

// The op of a step that is not the last of a collective: a mean is summed, and divided once at the
// end (finish_reduction_, Note [One reduction family]); every other op is its own.
constexpr ReduceOp accumulating_op(ReduceOp op) { return op == ReduceOp::kMean ? ReduceOp::kSum : op; }

}  // namespace ddpkit::comm
