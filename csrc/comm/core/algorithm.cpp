#include "comm/core/algorithm.h"

#include <c10/util/Exception.h>

#include <string>

namespace ddpkit::comm {

Algorithm parse_algorithm(std::string_view name) {
  for (size_t i = 0; i < kAlgorithmNames.size(); ++i) {
    if (kAlgorithmNames[i] == name) return static_cast<Algorithm>(i);
  }
  std::string expected;
  for (std::string_view known : kAlgorithmNames) expected += c10::str(expected.empty() ? "" : ", ", known);
  TORCH_CHECK(false, "ddpkit: unknown algorithm '", name, "'; expected one of ", expected);
}

std::string_view algorithm_name(Algorithm algorithm) {
  const auto index = static_cast<size_t>(algorithm);
  TORCH_INTERNAL_ASSERT(index < kAlgorithmNames.size(), "unknown algorithm ", index);
  return kAlgorithmNames[index];
}

Algorithm choose_algorithm(int64_t bytes, int world_size, c10::DeviceType device, bool shared_memory, bool hierarchical,
                           ReduceOp op) {
  if (device != c10::kCPU) return Algorithm::kProcessGroup;
  if (shared_memory) return Algorithm::kDirect;
  if (hierarchical) return Algorithm::kHierarchical;
  // Note [Choosing an algorithm]: small messages go through the star, large ones through the
  // schedules that spread the reduction evenly over the ranks.
  constexpr int64_t kStarMaxBytes = 512 * 1024;
  constexpr int64_t kStarBudgetBytes = 16 * 1024 * 1024;  // what rank 0 receives: (n-1)·bytes
  if (bytes <= kStarMaxBytes && static_cast<int64_t>(world_size - 1) * bytes <= kStarBudgetBytes) {
    return Algorithm::kStar;
  }
  if (op == ReduceOp::kSum || op == ReduceOp::kMean) return Algorithm::kProcessGroup;
  const bool power_of_two = (world_size & (world_size - 1)) == 0;
  return power_of_two ? Algorithm::kHalvingDoubling : Algorithm::kRing;
}

}  // namespace ddpkit::comm
