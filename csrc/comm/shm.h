#pragma once
// The shared-memory transport: one segment per process group whose ranks all run on this host,
// carrying point-to-point messages (ShmTransport) and ddpkit's direct all-reduce (ShmSegment::all_reduce).

#include "comm/header.h"
#include "comm/reduce_op.h"
#include "comm/transport.h"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace ddpkit::comm {

// Note [Shared-memory segment]
// Rendezvous goes through the group's store, under keys unique to the group and to this creation
// (ddpkit/shm/<group name>/<nth segment of this group in this process>/...; torchrun restarts get
// a fresh store prefix): every rank publishes its host identity (hostname, boot id and the device of
// /dev/shm, so that two containers on one kernel with private /dev/shm are told apart) and its pid.
// If any differs, every rank sees the same keys and returns no segment (the caller falls back to the
// process group). Otherwise rank 0 creates the segment (shm_open, O_EXCL, a name with its pid and a
// random part), publishes the name, the others map it and count themselves in, and rank 0 unlinks
// the name as soon as all have: from then on the memory lives only in the mappings, so nothing is
// left in /dev/shm however the processes end (a SIGKILL included). The window between create and
// unlink is the rendezvous itself; rank 0 also unlinks when the rendezvous fails.
//
// Layout: a RankControl per rank, then per rank two collective slots (Note [Direct all-reduce]),
// then one channel per ordered pair of ranks (Note [Shared-memory messages]). Sizes are fixed at
// creation from the world size, so memory per rank is bounded whatever the message size.
//
// Note [Waiting on shared memory]
// Every wait is on a 32-bit word of the segment (a Signal): spin briefly while it may change soon,
// then sleep in futex(FUTEX_WAIT) on the word itself; whoever changes the word wakes sleepers only
// when the word's sleeper count says there are any, so the fast path makes no system call. Spinning
// is short (kSpinMicros) and skipped when there are more ranks than CPUs, where a spinning rank only
// takes the core from the peer it waits for (the collapse of busy-polling MPI on oversubscribed
// hosts). Sleeps are bounded (kLivenessMillis): each timeout checks that the peers still live
// (their pid in /proc, zombies counting as dead) and the group's timeout, so a peer killed in the
// middle of a collective is reported within a fraction of a second, naming it.

struct Signal {
  std::atomic<uint32_t> value{0};
  std::atomic<uint32_t> sleepers{0};
  // Stores `v` and wakes whoever sleeps on this word.
  void post(uint32_t v);
  // Adds one to the word and wakes whoever sleeps on it.
  void bump();
};

class ShmSegment;

// What a wait on shared memory needs beyond the word: the ranks that could be holding it up (for the
// liveness check and the error), the deadline, and what to call the operation in errors.
struct WaitContext {
  const ShmSegment* segment = nullptr;
  std::chrono::steady_clock::time_point deadline;
  std::string_view what = "collective";
};

class ShmSegment {
 public:
  // Collective over the `size` ranks of group `group_name` that share `store` (every rank calls it
  // at the same point of its program). Returns nullptr on every rank when the ranks are not all on
  // this host or there is no store; throws when the rendezvous or the mapping fails. `timeout`
  // bounds the rendezvous and every later wait.
  static std::shared_ptr<ShmSegment> create(const c10::intrusive_ptr<c10d::Store>& store,
                                            const std::string& group_name, int rank, int size,
                                            std::chrono::milliseconds timeout);
  ~ShmSegment();

  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  std::chrono::milliseconds timeout() const { return timeout_; }
  int64_t slot_bytes() const { return slot_bytes_; }
  int64_t channel_chunk_bytes() const { return chunk_bytes_; }

  // Note [Direct all-reduce]: reduces `flat` (contiguous, float32/float64/int32/int64, the same
  // numel on every rank) in place with `op`; every rank ends with the same bits. Synchronous; only
  // one collective of the group runs at a time (the engine's order, Note [Collective engine]).
  // With `checked`, the rank's header rides in the slot of the first chunk and every rank compares
  // all of them (Note [Collective checks]): a mismatch, or a rank that rejected its arguments
  // (`local_error` non-empty; `flat` may then be undefined), raises the same error on every rank
  // without touching any tensor, and the segment stays usable.
  void all_reduce(at::Tensor& flat, ReduceOp op, const CollectiveHeader& header, const std::string& local_error,
                  bool checked);

  // Note [Direct all-gather and reduce-scatter]: the same steps as the direct all-reduce, each rank
  // publishing part of its input in its slot (header in the first step's), then reading what it
  // needs from every peer's slot; synchronous, one collective of the group at a time.
  //  all_gather: `input` is `bytes` bytes (any dtype: only bytes move); `output` n·bytes, rank i's
  //    input at offset i·bytes. Per step each rank publishes up to a slot of its input and copies
  //    every peer's out: one copy in, n-1 copies out.
  //  reduce_scatter: `input` holds n blocks of `output.numel()` elements (float32/float64/int32/int64);
  //    `output` (not overlapping `input`) receives op over the ranks' block `rank`. Per step each
  //    rank publishes a 1/n-slot piece of every peer's block and reduces its own block's piece
  //    straight from the peers' slots and its own input.
  // A rejected rank (`local_error` non-empty) passes undefined tensors; checks as in all_reduce.
  void all_gather(const at::Tensor& output, const at::Tensor& input, const CollectiveHeader& header,
                  const std::string& local_error, bool checked);
  void reduce_scatter(const at::Tensor& output, const at::Tensor& input, ReduceOp op, const CollectiveHeader& header,
                      const std::string& local_error, bool checked);

  // The collective check of a collective that runs over messages (Note [Collective checks]): one
  // step of the direct all-reduce's protocol carrying only `header` (its magic says whether this
  // rank rejected its arguments, `local_error` then being its own error). Every rank compares all
  // headers and raises the same error on a mismatch; a direct all-reduce and a message-based
  // collective called against each other therefore meet in the same step and both report it.
  void check_header(const CollectiveHeader& header, const std::string& local_error, std::string_view what);

  // Waits until `ready()` holds, sleeping on `signal` (Note [Waiting on shared memory]). Throws,
  // naming the peer, when a peer died, or when the deadline passed.
  template <class Ready>
  void wait_for(Signal& signal, Ready ready, const WaitContext& context) const;

  // Throws when a rank of the group died, or the deadline passed (after marking the segment broken).
  void check_peers(const WaitContext& context) const;

  // After a failure in the middle of a collective the slots' state is unknown: every later use raises.
  void mark_broken(const std::string& why) const;
  void check_usable(std::string_view what) const;

  struct RankControl;
  struct Channel;
  RankControl& control(int rank) const;
  Channel& channel(int src, int dst) const;
  char* slot(int rank, int set) const;  // the data of rank's collective slot `set` (0 or 1)
  CollectiveHeader& slot_header(int rank, int set) const;

 private:
  ShmSegment() = default;
  void map(int fd, size_t bytes);
  // Posts this rank's arrival at step `target` and waits for every peer's.
  void arrive_and_wait(uint32_t target, const WaitContext& context);
  // Compares the headers of every rank in slot set `set`; throws `local_error` first if there is one.
  void compare_headers(int set, const std::string& local_error, std::string_view what) const;

  int rank_ = 0;
  int size_ = 1;
  std::chrono::milliseconds timeout_{0};
  std::vector<int> pids_;
  char* base_ = nullptr;
  size_t bytes_ = 0;
  int64_t slot_bytes_ = 0;   // data bytes of one collective slot
  int64_t whole_bytes_ = 0;  // n·chunk bytes up to which the direct all-reduce reduces whole chunks
  int64_t chunk_bytes_ = 0;  // data bytes of one channel chunk
  int64_t channel_slots_ = 0;
  size_t controls_offset_ = 0, slots_offset_ = 0, slot_stride_ = 0, channels_offset_ = 0, channel_stride_ = 0;
  uint32_t step_ = 0;        // collective steps taken (Note [Direct all-reduce]); the same on every rank
  bool spin_ = true;
  mutable std::mutex broken_mutex_;
  mutable std::string broken_;
};

// Note [Shared-memory messages]
// Point-to-point messages between ranks of one host, so that every schedule of collectives.cpp runs
// unchanged over shared memory. Each ordered pair (src, dst) has a channel: a ring of fixed-size
// chunks, each tagged with the message's tag, its total size and the chunk's offset. A send copies
// its tensor into the channel chunk by chunk (eager: a send is complete when its last chunk is in
// shared memory, so its tensor is free again); a receive copies chunks out into its tensor. Progress
// is made by whichever thread waits: it pushes pending sends while the channel has room and drains
// every incoming channel into the posted receives. Sends to one peer leave in the order they were
// posted; receives match by (peer, tag).
//
// A chunk whose receive is not posted yet stays in the channel (its sender waits for room), so the
// memory a rank uses is the segment's whatever the message size. Only when a posted receive from
// the same peer waits behind such a chunk is the chunk moved to a heap buffer kept for its receive,
// so that a channel never stays blocked. The schedules of collectives.cpp post their receives round
// by round ahead of their sends (Note [Pre-posted receives]) and send to a peer in round order, so
// that case needs a peer that sends what this rank never receives (a mismatched schedule, or the
// rest of an aborted collective); comm_counters' peak_buffered_bytes shows what it ever held. No
// rank waits forever on a parked chunk: the rank furthest behind has posted the receives of its
// current round, so the chunks its peers send it are taken.
class ShmTransport final : public Transport {
 public:
  explicit ShmTransport(std::shared_ptr<ShmSegment> segment);
  ~ShmTransport() override;
  std::string_view name() const override { return "shm"; }
  c10::intrusive_ptr<c10d::Work> send(const at::Tensor& tensor, int dst, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(const at::Tensor& tensor, int src, int tag) override;

  class Message;  // the Work of one send or receive

 private:
  friend class Message;
  // Moves every message as far as the channels allow; true if anything moved. Call with mutex_ held.
  bool progress_locked();
  void wait_for_message(Message& message, std::string_view what);
  void abort_message(Message& message);

  std::shared_ptr<ShmSegment> segment_;
  std::mutex mutex_;
  std::vector<std::deque<c10::intrusive_ptr<Message>>> sends_;  // per destination, in posting order
  std::vector<std::vector<c10::intrusive_ptr<Message>>> recvs_;  // per source, posted and incomplete
  struct Unexpected {
    std::vector<char> bytes;
    int64_t total = 0;
    int64_t received = 0;
  };
  std::vector<std::map<int, Unexpected>> unexpected_;  // per source, by tag
  int64_t buffered_bytes_ = 0;                          // bytes held in unexpected_
};

}  // namespace ddpkit::comm
