// Test ops of the testing build only (csrc/testing/faults.h says why), in the op library
// ddpkit_testing: the reduction family's loops and the split rules, called on one process's tensors,
// so that tests/test_reductions.py pins them against torch for every op and dtype
// (Note [One reduction family], Note [Splitting among ranks]).

#include "comm/reduction/reduce_kernel.h"
#include "comm/reduction/split.h"

#include <torch/library.h>

#include <string>
#include <vector>

namespace ddpkit::testing {
namespace {

using namespace ddpkit::comm;

// op over `inputs` (one per rank, in rank order; contiguous CPU tensors of one dtype and numel) the
// way one of the family's loops computes it:
//   "pairs"            combine_ of each input into a copy of the first, in rank order, then
//                      finish_reduction_ (the message schedules' way);
//   "sources"          reduce_sources into a new tensor, dividing a mean there (the direct
//                      reduce-scatter's way);
//   "sources_in_place" reduce_sources into a copy of the first input that is also its first source,
//                      each block copied on into a second tensor, which is returned after checking
//                      it equals the first (the direct all-reduce's slice).
at::Tensor reduce_with_family(const std::vector<at::Tensor>& inputs, const std::string& op_name,
                              const std::string& loop) {
  TORCH_CHECK(!inputs.empty(), "reduce_with_family: no inputs");
  for (const auto& input : inputs) {
    TORCH_CHECK(input.device().is_cpu() && input.is_contiguous() && input.scalar_type() == inputs[0].scalar_type() &&
                    input.numel() == inputs[0].numel(),
                "reduce_with_family: inputs must be contiguous CPU tensors of one dtype and numel");
  }
  const ReduceOp op = parse_reduce_op(op_name);
  const auto n = static_cast<int64_t>(inputs.size());
  const at::ScalarType dtype = inputs[0].scalar_type();
  if (loop == "pairs") {
    at::Tensor result = inputs[0].clone();
    for (int64_t i = 1; i < n; ++i) combine_(result, inputs[i], op);
    finish_reduction_(result, op, n);
    return result;
  }
  std::vector<const char*> sources;
  for (const auto& input : inputs) sources.push_back(static_cast<const char*>(input.data_ptr()));
  if (loop == "sources") {
    at::Tensor result = at::empty_like(inputs[0]);
    reduce_sources(dtype, op, static_cast<char*>(result.data_ptr()), sources, 0, result.numel());
    return result;
  }
  TORCH_CHECK(loop == "sources_in_place", "reduce_with_family: unknown loop '", loop, "'");
  at::Tensor result = inputs[0].clone();
  at::Tensor copy = at::empty_like(result);
  sources[0] = static_cast<const char*>(result.data_ptr());
  reduce_sources(dtype, op, static_cast<char*>(result.data_ptr()), sources, 0, result.numel(),
                 static_cast<char*>(copy.data_ptr()));
  TORCH_CHECK(at::equal(result.view(at::kByte), copy.view(at::kByte)),
              "reduce_with_family: the block copies differ from the result");
  return copy;
}

// The first element of each of `parts` pieces of `numel` elements under `rule` ("balanced",
// "padded"), and where the last piece ends (numel, or the padded numel).
std::vector<int64_t> split_starts(int64_t numel, int64_t parts, const std::string& rule) {
  TORCH_CHECK(numel >= 0 && parts >= 1, "split_starts: numel must be >= 0 and parts >= 1");
  std::vector<int64_t> starts;
  if (rule == "balanced") {
    const BalancedSplit split{numel, parts};
    for (int64_t i = 0; i <= parts; ++i) starts.push_back(split.start(i));
    TORCH_INTERNAL_ASSERT(split.max_length() == split.length(0));
  } else {
    TORCH_CHECK(rule == "padded", "split_starts: unknown rule '", rule, "'");
    const PaddedSplit split{numel, parts};
    for (int64_t i = 0; i < parts; ++i) starts.push_back(split.start(i));
    starts.push_back(split.padded_numel());
  }
  return starts;
}

}  // namespace
}  // namespace ddpkit::testing

TORCH_LIBRARY_FRAGMENT(ddpkit_testing, m) {
  m.def("reduce_with_family(Tensor[] inputs, str op, str loop) -> Tensor", &ddpkit::testing::reduce_with_family);
  m.def("split_starts(int numel, int parts, str rule) -> int[]", &ddpkit::testing::split_starts);
}
