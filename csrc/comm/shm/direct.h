#pragma once
// The collectives shared memory runs without messages: every rank publishes its data in its slot of
// the segment and its peers read it there (Note [Shared-memory vocabulary] in shm/layout.h).

#include "comm/core/transport.h"
#include "comm/shm/segment.h"

#include <memory>
#include <string>
#include <vector>

namespace ddpkit::comm {

// Note [Direct all-reduce]
// The all-reduce that shared memory makes possible: no messages, every rank reads its peers' data
// where they published it. Per chunk of at most slot_bytes():
//  1. each rank copies its chunk into its own slot (with its header, for the first chunk) and posts
//     `arrived`; it waits for every peer's `arrived` (with the check: compares all headers);
//  2. small chunks (n·bytes <= kDirectWholeBytes): every rank reduces the whole chunk from all
//     slots straight into its tensor, in rank order: one barrier, identical bits everywhere;
//     larger ones: rank r reduces its 1/n slice r from its own tensor and the peers' slots, in rank
//     order, into its slot's slice r, writing each finished block also into its tensor, posts `reduced`, and copies
//     every slice j from rank j's slot once j has posted it. Step 1 then copies in only the slices
//     the peers reduce. Per rank: (n-1)/n of the chunk copied in, one reduce pass over 1/n of it
//     from n sources, (n-1)/n copied out. At n=2 that is 4 chunk-sized memory passes per rank
//     against the whole-chunk path's 5; it costs a second barrier per chunk, which only matters
//     for small chunks: the whole path is kept up to n·bytes = kDirectWholeBytes where ranks sleep in their
//     waits (more ranks than CPUs: each barrier is a futex wake-up, which small calls feel most),
//     while the sliced path is the faster one for large vectors at every n (bench_allreduce.py with
//     more ranks than cores, DDPKIT_SHM_WHOLE_BYTES in a testing build moving the threshold). Two
//     ranks that spin pass a barrier far faster, and there the sliced path wins from a few KiB on
//     (the two paths as two groups of the same processes, interleaved: a probe, not a committed
//     benchmark). Ranks that spin keep it only up to kDirectWholeBytesSpinning, at any n: the
//     grid on a machine with cores for every rank decided it against MPICH (scripts/gpu_checks.sh's
//     grid times both thresholds side by side: allreduce_whole_16core.json).
// Each step alternates between the rank's two slots; a rank writes slot s again only two steps
// later, after passing the next step's barrier, i.e. after every peer has finished reading it.
// Every rank takes the same number of steps per collective (the numel is checked on the first), so
// the step counters stay equal on all ranks, also after a mismatch has been reported.
//
// Note [Direct all-gather and reduce-scatter]
// The same steps as the direct all-reduce, each rank publishing part of its input in its slot
// (header in the first step's), then reading what it needs from every peer's slot.
//  all_gather: `input` is `bytes` bytes (any dtype: only bytes move; it may be exactly this rank's
//    block of `output`); `output` n·bytes, rank i's input at offset i·bytes. Per step each rank
//    publishes up to a slot of its input and copies every peer's out: one copy in, n-1 copies out.
//  reduce_scatter: `input` holds n blocks of `output.numel()` elements (float32/float64/int32/int64);
//    `output` (not overlapping `input`, or exactly its block `rank`) receives op over the ranks'
//    block `rank`, summed in rank order. Per step each rank publishes a 1/n-slot piece of
//    every peer's block and reduces its own block's piece straight from the peers' slots and its
//    own input.
// The broadcast: per step the root publishes a slot of its tensor, every other rank copies it out.
// The collective check rides in the first step of every direct collective, armed by the group's
// SlotCheck (Note [Check seam]: carry_check()); the check of a collective that runs over messages is
// one step of the same protocol carrying only the header (barrier()): a direct all-reduce and a
// message-based collective called against each other therefore meet in the same step and both
// report it. A step of a hierarchical collective inside its host, after the check, carries none.

// DirectCollectives (core/transport.h) over a segment: the collectives run in the engine's order, one at
// a time, so the slots need no locking.
class ShmDirect final : public DirectCollectives {
 public:
  explicit ShmDirect(std::shared_ptr<ShmSegment> segment)
      : segment_(std::move(segment)), seg_(*segment_), memory_(segment_->memory()) {}

  std::vector<CollectiveHeader> exchange_headers(const CollectiveHeader& header, std::string_view what) override;
  void carry_check(const CollectiveHeader& header, std::string_view local_error) override;
  int group_rank(int rank) const override { return seg_.group_ranks()[rank]; }
  int failed_rank() const override { return seg_.liveness().failed_group_rank(); }
  void all_reduce(const at::Tensor& flat, ReduceOp op, std::string_view what) override;
  void all_gather(const at::Tensor& output, const at::Tensor& input, std::string_view what) override;
  void reduce_scatter(const at::Tensor& output, const at::Tensor& input, ReduceOp op, std::string_view what) override;
  void broadcast(const at::Tensor& tensor, int root, std::string_view what) override;
  void barrier(std::string_view what) override;
  void reject_unchecked(std::string_view what) override { seg_.liveness().reject_unchecked(what); }
  void abandon(const std::string& why) override { seg_.liveness().mark_broken(why); }

 private:
  // The check a collective's first step carries (carry_check).
  struct CarriedCheck {
    CollectiveHeader header;       // stamped
    std::string_view local_error;  // the caller's, alive until its collective returns
  };
  // What every collective does first: takes the check its first step carries (`check`: null when
  // nothing armed one), raises if the transport failed earlier, and gives the context of its waits.
  WaitContext begin(std::string_view what, const CarriedCheck*& check);
  // The first step's part of the check: this rank's header into its slot of set `set`, before the
  // step's arrival.
  void post_header(const CarriedCheck* check, int set) const;
  // After the first step's arrivals: compares every rank's header in slot set `set`; throws this
  // rank's `local_error` first if there is one.
  void verify_headers(const CarriedCheck* check, int set, std::string_view what) const;
  // Every rank's header in slot set `set`, in rank order (after the step's arrivals).
  std::vector<CollectiveHeader> read_headers(int set) const;
  // Posts this rank's arrival at step `target` and waits for every peer's.
  void arrive_and_wait(uint32_t target, const WaitContext& context);

  std::shared_ptr<ShmSegment> segment_;
  const ShmSegment& seg_;
  const SegmentMemory& memory_;
  uint32_t step_ = 0;     // steps taken (Note [Direct all-reduce]); the same on every rank
  CarriedCheck carried_;  // the check the next collective's first step carries, while armed_
  bool armed_ = false;
};

}  // namespace ddpkit::comm
