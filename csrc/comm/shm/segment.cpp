#include "comm/shm/segment.h"

namespace ddpkit::comm {

ShmSegment::ShmSegment(std::unique_ptr<SegmentMemory> memory, SegmentRanks ranks, bool spin,
                       std::chrono::milliseconds liveness_period)
    : memory_(std::move(memory)),
      liveness_(*memory_, std::move(ranks)),
      waits_(*memory_, liveness_, spin, liveness_period) {
  // Note [Prompt death notice]
  watch_ = std::make_unique<PeerWatch>(liveness_.ranks().pids, rank(), [this](int) { waits_.peer_exited(); });
}

ShmSegment::~ShmSegment() {
  watch_.reset();  // its thread wakes words of the mapping
}

}  // namespace ddpkit::comm
