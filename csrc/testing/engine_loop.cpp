// A benchmark op of the testing build only (csrc/testing/faults.h says why), in an op library of its
// own, ddpkit_testing: bench_latency.py times the engine's layers with it, in C++ loops.

#include "comm/collectives/collectives.h"
#include "comm/engine/engine.h"

#include <torch/library.h>

#include <algorithm>
#include <array>
#include <chrono>

namespace ddpkit::testing {
namespace {

using namespace ddpkit::comm;

// Seconds per call of `iterations` back-to-back calls of `stage`, looped in C++ (no Python, no
// dispatcher between calls), after one untimed all-reduce that lines the ranks up. Stages, each
// one layer more of what `ddpkit.all_reduce` does (Note [Where a small all-reduce's time goes]):
//   "lookup"               Engine::of(group_name): the group's engine from its name;
//   "engine"               that plus an empty collective through the engine (numbering, ordering,
//                          transport resolution; no communication);
//   "all_reduce"           that plus the sum all-reduce, algorithm "auto", of `numel` float32 values;
//   "all_reduce_unchecked" the same with Note [Collective checks] off for the loop.
// Every rank of the group calls it with the same arguments (the all-reduces pair across ranks).
double time_engine_loop(int64_t numel, int64_t iterations, std::string_view stage, const std::string& group_name) {
  TORCH_CHECK(numel >= 0 && iterations >= 1,
              "ddpkit.testing.time_engine_loop: numel must be >= 0 and iterations >= 1, got ", numel, " and ",
              iterations);
  enum class Stage { kLookup, kEngine, kAllReduce, kAllReduceUnchecked };
  constexpr std::array<std::string_view, 4> kStageNames = {"lookup", "engine", "all_reduce", "all_reduce_unchecked"};
  const auto found = std::find(kStageNames.begin(), kStageNames.end(), stage);
  TORCH_CHECK(found != kStageNames.end(), "ddpkit.testing.time_engine_loop: unknown stage '", stage,
              "' (lookup, engine, all_reduce, all_reduce_unchecked)");
  const auto which = static_cast<Stage>(found - kStageNames.begin());
  at::Tensor tensor = at::ones({numel}, at::kFloat);
  const auto all_reduce = [&] {
    Engine::of(group_name)->run(c10::kCPU, TransportKind::kAuto, "all_reduce", [&](Communicator& comm) {
      all_reduce_(tensor, ReduceOp::kSum, Algorithm::kAuto, comm);
    });
  };
  all_reduce();  // sets the group up if needed and lines the ranks up
  struct RestoreChecks {
    bool checked = is_checked();
    ~RestoreChecks() { set_checked(checked); }
  } restore;
  if (which == Stage::kAllReduceUnchecked) set_checked(false);
  const auto start = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < iterations; ++i) {
    switch (which) {
      case Stage::kLookup: {
        const std::shared_ptr<Engine> engine = Engine::of(group_name);
        asm volatile("" : : "r"(engine.get()) : "memory");  // keep the lookup
        break;
      }
      case Stage::kEngine:
        Engine::of(group_name)->run(c10::kCPU, TransportKind::kAuto, "all_reduce", [](Communicator&) {});
        break;
      case Stage::kAllReduce:
      case Stage::kAllReduceUnchecked: all_reduce(); break;
    }
  }
  const std::chrono::duration<double> elapsed = std::chrono::steady_clock::now() - start;
  return elapsed.count() / static_cast<double>(iterations);
}

}  // namespace
}  // namespace ddpkit::testing

TORCH_LIBRARY(ddpkit_testing, m) {
  m.def("time_engine_loop(int numel, int iterations, str stage, str group_name) -> float",
        &ddpkit::testing::time_engine_loop);
}
