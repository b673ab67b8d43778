#pragma once
// How ddpkit's collectives split a vector among ranks: two named rules, and no other
// (Note [Splitting among ranks]).

#include <algorithm>
#include <cstdint>

namespace ddpkit::comm {

// Note [Splitting among ranks]
// Identical bits on every rank rest on every path agreeing on which rank reduces which element; and
// the rank that reduces an element decides the order its operands are summed in (the direct
// reduce-scatter sums the reducing rank's own piece first: Note [Direct all-gather and
// reduce-scatter]), so the rule is part of a collective's result. Two rules, each for a reason:
//  - BalancedSplit, wherever a collective picks its own pieces: the ring's chunks (in shared memory
//    and across hosts: links/ring.cpp), the butterfly's, the halving-doubling's halves, the direct
//    all-reduce's slices.
//  - PaddedSplit, where the pieces must be equal blocks: the host step of the hierarchical
//    all-reduce and reduce between equal hosts (Horovod's split, Note [Hierarchical collectives])
//    is the direct reduce-scatter and all-gather, whose contract is torch's reduce_scatter_tensor's
//    and all_gather_into_tensor's (n blocks of one size); so the vector is padded with zeros to
//    parts · length(), and each local rank's slice crosses hosts as a message of one size on every
//    host. BalancedSplit there would need a direct reduce-scatter of unequal blocks, and would move
//    elements to other reducing ranks, changing the bits of a sum over three or more ranks per
//    host: kept, as a rule of its own. tests/test_multihost_one_machine.py's
//    test_every_collective_with_test_hosts_is_exact_with_identical_bits runs it on sizes that no
//    host's size divides (7, 1001), and tests/test_reductions.py pins both rules.
// Steps sized by a buffer's capacity (the shared-memory slots') cut a vector in time, not among
// ranks, and are not splits in this sense.

// `numel` elements in `parts` consecutive pieces, the first numel % parts one element longer.
struct BalancedSplit {
  int64_t numel;
  int64_t parts;
  int64_t start(int64_t i) const { return i * (numel / parts) + std::min(i, numel % parts); }
  int64_t length(int64_t i) const { return start(i + 1) - start(i); }
  int64_t max_length() const { return (numel + parts - 1) / parts; }
};

// `numel` elements in `parts` pieces of one length, ceil(numel / parts), the vector padded past its
// end to padded_numel() (the last pieces hold the padding; with numel < parts some hold only padding).
struct PaddedSplit {
  int64_t numel;
  int64_t parts;
  int64_t length() const { return (numel + parts - 1) / parts; }
  int64_t start(int64_t i) const { return i * length(); }
  int64_t padded_numel() const { return parts * length(); }
};

}  // namespace ddpkit::comm
