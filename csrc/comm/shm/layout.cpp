#include "comm/shm/layout.h"

#include <c10/util/Exception.h>

#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace ddpkit::comm {

using namespace shm_detail;

namespace {

// Small enough that a chunk is still in cache when peers reduce it and when it is copied out, while
// the extra steps it takes cost a barrier each, cheap when the ranks have cores: bench_allreduce.py's
// large sizes decided it against 1 and 4 MiB slots (DDPKIT_SHM_SLOT_BYTES in a testing build moves it).
constexpr int64_t kSlotBytes = 256 << 10;
// Note [Direct all-reduce]
constexpr int64_t kDirectWholeBytes = 128 << 10;
constexpr int64_t kDirectWholeBytesSpinning = 2 << 10;

}  // namespace

SegmentSettings default_segment_settings(int size, bool spinning) {
  // Note [Direct all-reduce]: two slots per rank; Note [Shared-memory messages]: kChannelSlots
  // chunks per ordered pair, shrinking with the host's ranks, so the whole segment stays bounded.
  SegmentSettings settings;
  settings.slot_bytes = kSlotBytes;
  settings.whole_bytes = spinning ? kDirectWholeBytesSpinning : kDirectWholeBytes;
  settings.chunk_bytes = std::clamp<int64_t>(static_cast<int64_t>(round_up((1 << 20) / std::max(1, size - 1), kLine)),
                                             64 << 10, 512 << 10);
  return settings;
}

bool SegmentLayout::valid() const {
  const SegmentSettings& s = settings;
  return size >= 1 && size <= (1 << 16) && s.slot_bytes >= 4096 && s.slot_bytes <= (1LL << 30) && s.whole_bytes >= 0 &&
         s.chunk_bytes >= 4096 && s.chunk_bytes <= (1LL << 30) && s.slot_bytes % kLine == 0 &&
         s.chunk_bytes % kLine == 0;
}

size_t SegmentLayout::controls_offset() const { return round_up(sizeof(SegmentHeader), kLine); }

size_t SegmentLayout::control_stride() const { return round_up(sizeof(RankControl), kLine); }

size_t SegmentLayout::slots_offset() const {
  return round_up(controls_offset() + control_stride() * static_cast<size_t>(size), 4096);
}

size_t SegmentLayout::slot_stride() const {
  return round_up(kSlotHeaderBytes + static_cast<size_t>(settings.slot_bytes), 4096);
}

size_t SegmentLayout::channels_offset() const { return slots_offset() + slot_stride() * 2 * static_cast<size_t>(size); }

size_t SegmentLayout::channel_stride() const {
  return round_up(
      offsetof(Channel, chunks) + kChannelSlots * (kChunkHeaderBytes + static_cast<size_t>(settings.chunk_bytes)),
      4096);
}

size_t SegmentLayout::bytes() const { return channels_offset() + channel_stride() * static_cast<size_t>(size * size); }

SegmentMemory::SegmentMemory(int fd, const SegmentLayout& layout)
    : layout_(layout),
      controls_offset_(layout.controls_offset()),
      control_stride_(layout.control_stride()),
      slots_offset_(layout.slots_offset()),
      slot_stride_(layout.slot_stride()),
      channels_offset_(layout.channels_offset()),
      channel_stride_(layout.channel_stride()) {
  errno = 0;
  void* address = mmap(nullptr, layout.bytes(), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int error = errno;
  TORCH_CHECK(address != MAP_FAILED, "ddpkit: mapping the shared-memory segment (", layout.bytes(),
              " bytes) failed: ", std::strerror(error));
  base_ = static_cast<char*>(address);
}

SegmentMemory::~SegmentMemory() { munmap(base_, layout_.bytes()); }

void SegmentMemory::wake_all_sleepers() const {
  for (int r = 0; r < size(); ++r) {
    RankControl& c = control(r);
    for (Signal* signal : {&c.arrived, &c.reduced, &c.doorbell}) futex_wake_all(&signal->value);
  }
}

}  // namespace ddpkit::comm
