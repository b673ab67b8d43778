#pragma once
// The one rule by which every ddpkit collective splits a vector among ranks (the ring's chunks, the
// halving-doubling's halves, the direct all-reduce's slices): identical bits on every rank rest on
// every path agreeing on which rank owns which element.

#include <algorithm>
#include <cstdint>

namespace ddpkit::comm {

// `numel` elements in `parts` consecutive pieces, the first numel % parts one element longer.
struct BalancedSplit {
  int64_t numel;
  int64_t parts;
  int64_t start(int64_t i) const { return i * (numel / parts) + std::min(i, numel % parts); }
  int64_t length(int64_t i) const { return start(i + 1) - start(i); }
  int64_t max_length() const { return (numel + parts - 1) / parts; }
};

}  // namespace ddpkit::comm
