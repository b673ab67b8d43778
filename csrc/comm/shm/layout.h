#pragma once
// Where everything lies in a group's shared-memory segment, and the mapping that holds it (Note
// [Shared-memory segment] in shm/setup.h).

#include "comm/core/header.h"
#include "comm/shm/signal.h"

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>

namespace ddpkit::comm {

// Note [Shared-memory vocabulary]
// Words the shared-memory code uses in one sense only:
//  segment  one anonymous shared mapping per group (Note [Shared-memory segment]), mapped by every rank.
//  slot     where a rank publishes data for the direct collectives: two per rank (sets 0 and 1,
//           alternating by step), each a header line then slot_bytes() of data.
//  step     one round of the direct collectives: every rank fills its slot of the step's set, posts
//           its `arrived` counter and waits for every peer's. Every rank takes the same steps, so
//           the counters agree on every rank.
//  chunk    the part of a tensor one step carries (at most a slot); in a channel, the unit a message
//           moves in (at most chunk_bytes()).
//  slice    rank r's share of a chunk (BalancedSplit, reduction/split.h), which rank r alone reduces.
//  channel  per ordered pair of ranks, a ring of kChannelSlots chunks carrying point-to-point messages.
//
// Note [Segment layout]
// A SegmentHeader, a RankControl per rank, then per rank two collective slots (Note [Direct
// all-reduce]), then one channel per ordered pair of ranks (Note [Shared-memory messages]). Sizes
// are fixed at creation from the host's number of ranks and its leader's SegmentSettings, so memory
// per rank is bounded whatever the message size.

namespace shm_detail {

constexpr size_t kLine = 128;               // two cache lines: no false sharing with the adjacent-line prefetcher
constexpr int64_t kChannelSlots = 4;        // chunks per channel
constexpr size_t kChunkHeaderBytes = 64;    // a channel chunk's header (ChunkHeader)
constexpr size_t kSlotHeaderBytes = kLine;  // a CollectiveHeader, padded
constexpr size_t kBrokenWhyBytes = 512;
static_assert(sizeof(CollectiveHeader) <= kSlotHeaderBytes);

inline size_t round_up(size_t x, size_t to) { return (x + to - 1) / to * to; }

}  // namespace shm_detail

// What fixes a segment's layout besides its number of ranks: decided by the host's leader and sent
// to its host's other ranks with the segment (Note [Shared-memory segment]).
struct SegmentSettings {
  int64_t slot_bytes = 0;   // data bytes of one collective slot
  int64_t whole_bytes = 0;  // n·chunk bytes up to which the direct all-reduce reduces whole chunks
  int64_t chunk_bytes = 0;  // data bytes of one channel chunk
};

// The settings a host of `size` ranks takes, whose waits spin or not (Note [Waiting on shared memory]).
SegmentSettings default_segment_settings(int size, bool spinning);

// The segment's first line: what its creator wrote, and the group's record of its first failure.
struct SegmentHeader {
  uint64_t magic;
  uint64_t nonce[2];
  int64_t bytes;
  int64_t size;
  SegmentSettings settings;
  // 1 + the first rank any rank found dead (Note [Waiting on shared memory]); 0 while none has.
  alignas(shm_detail::kLine) std::atomic<int32_t> first_dead;
  // The first rank whose transport failed (mark_broken): 0 while none has, -(rank + 1) while it
  // writes broken_why, rank + 1 once it has.
  std::atomic<int32_t> broken_by;
  char broken_why[shm_detail::kBrokenWhyBytes];  // its reason, NUL-terminated
};

// Each rank's words in the segment.
struct RankControl {
  alignas(shm_detail::kLine) Signal arrived;   // steps whose slot this rank has filled (Note [Direct all-reduce])
  alignas(shm_detail::kLine) Signal reduced;   // steps whose slice this rank has reduced
  alignas(shm_detail::kLine) Signal doorbell;  // bumped when a chunk arrives for this rank, or one it sent was taken
  alignas(shm_detail::kLine) std::atomic<int32_t> cpu;  // 1 + the CPU this rank last waited on (0: none yet)
};

// The ring of chunks from one rank to another (Note [Shared-memory messages]).
struct Channel {
  alignas(shm_detail::kLine) std::atomic<uint64_t> head;  // chunks written by the sender
  alignas(shm_detail::kLine) std::atomic<uint64_t> tail;  // chunks taken by the receiver
  alignas(shm_detail::kLine) char chunks[1];              // kChannelSlots x (chunk header + chunk bytes)
};

// What starts every chunk of a channel.
struct ChunkHeader {
  int64_t tag;
  int64_t total;   // bytes of the whole message
  int64_t offset;  // of this chunk in the message
  int64_t length;  // of this chunk
};
static_assert(sizeof(ChunkHeader) <= shm_detail::kChunkHeaderBytes);

// The offsets of a segment of `size` ranks with `settings` (Note [Segment layout]).
struct SegmentLayout {
  int size = 1;
  SegmentSettings settings;

  // Settings every rank can lay out: slots and chunks of 4 KiB to 1 GiB, in whole lines.
  bool valid() const;
  size_t controls_offset() const;
  size_t control_stride() const;
  size_t slots_offset() const;
  size_t slot_stride() const;
  size_t channels_offset() const;
  size_t channel_stride() const;
  size_t bytes() const;
};

// A segment mapped into this process, laid out; unmapped when destroyed. Every accessor is a pointer
// computation into the mapping: what they return is shared with the host's other ranks.
class SegmentMemory {
 public:
  // Maps `layout.bytes()` of `fd` (read and write, shared); TORCH_CHECK-fails, leaving errno, when
  // mmap does.
  SegmentMemory(int fd, const SegmentLayout& layout);
  ~SegmentMemory();
  SegmentMemory(const SegmentMemory&) = delete;
  SegmentMemory& operator=(const SegmentMemory&) = delete;

  int size() const { return layout_.size; }
  size_t bytes() const { return layout_.bytes(); }
  int64_t slot_bytes() const { return layout_.settings.slot_bytes; }
  int64_t whole_bytes() const { return layout_.settings.whole_bytes; }
  int64_t chunk_bytes() const { return layout_.settings.chunk_bytes; }

  SegmentHeader& header() const { return *reinterpret_cast<SegmentHeader*>(base_); }
  RankControl& control(int rank) const {
    return *reinterpret_cast<RankControl*>(base_ + controls_offset_ + control_stride_ * rank);
  }
  Channel& channel(int src, int dst) const {
    return *reinterpret_cast<Channel*>(base_ + channels_offset_ + channel_stride_ * (src * layout_.size + dst));
  }
  // Chunk `index` of `channel` (modulo its kChannelSlots): a ChunkHeader, then chunk_bytes() of data.
  char* chunk(Channel& channel, uint64_t index) const {
    return channel.chunks + (index % shm_detail::kChannelSlots) * (shm_detail::kChunkHeaderBytes + chunk_bytes());
  }
  // The header and the data of rank's collective slot `set` (0 or 1).
  CollectiveHeader& slot_header(int rank, int set) const {
    return *reinterpret_cast<CollectiveHeader*>(base_ + slots_offset_ + slot_stride_ * (2 * rank + set));
  }
  char* slot(int rank, int set) const {
    return base_ + slots_offset_ + slot_stride_ * (2 * rank + set) + shm_detail::kSlotHeaderBytes;
  }

  // Wakes every sleeper on the segment's words, in every process, changing none of them.
  void wake_all_sleepers() const;

 private:
  SegmentLayout layout_;
  char* base_ = nullptr;
  size_t controls_offset_, control_stride_, slots_offset_, slot_stride_, channels_offset_, channel_stride_;
};

}  // namespace ddpkit::comm
