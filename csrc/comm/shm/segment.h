#pragma once
// The shared-memory segment of a group's ranks on this host, as this rank holds it: its parts, each
// owning its state (the memory and its layout, the liveness and failure record, the waits, the peer
// watch). Made by set_up_segment (shm/setup.h); the transport built on it is ShmTransport
// (shm/channels.h): point-to-point messages through its channels, and the direct collectives of
// shm/direct.h in its slots.

#include "comm/shm/layout.h"
#include "comm/shm/liveness.h"
#include "comm/shm/peer_watch.h"
#include "comm/shm/wait.h"

#include <chrono>
#include <memory>
#include <string>
#include <vector>

namespace ddpkit::comm {

class ShmSegment {
 public:
  // This rank's hold of `memory` (set up and verified), whose ranks are `ranks`; `spin` and
  // `liveness_period` as SegmentWaits takes them. Starts the peer watch of this rank's host peers
  // (Note [Prompt death notice]).
  ShmSegment(std::unique_ptr<SegmentMemory> memory, SegmentRanks ranks, bool spin,
             std::chrono::milliseconds liveness_period);
  // Stops the peer watch before the memory it wakes goes.
  ~ShmSegment();
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;

  // This rank's index among the segment's ranks (its host's), and their number.
  int rank() const { return liveness_.ranks().rank; }
  int size() const { return memory_->size(); }
  // The group's rank of each of the segment's ranks.
  const std::vector<int>& group_ranks() const { return liveness_.ranks().group_ranks; }

  const SegmentMemory& memory() const { return *memory_; }
  const SegmentLiveness& liveness() const { return liveness_; }
  const SegmentWaits& waits() const { return waits_; }

  // A wait's context for `what`, its deadline the timeout from now.
  WaitContext wait_context(std::string_view what) const {
    return WaitContext{std::chrono::steady_clock::now() + liveness_.timeout(), what};
  }

 private:
  const std::unique_ptr<SegmentMemory> memory_;
  const SegmentLiveness liveness_;
  const SegmentWaits waits_;
  std::unique_ptr<PeerWatch> watch_;  // last made, first gone: its thread wakes the memory's words
};

}  // namespace ddpkit::comm
