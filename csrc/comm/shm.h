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
// One segment per group whose ranks all run on this host, made by a collective of the group that
// runs over the group's own point-to-point messages (the process group's connections), never
// through the store:
//  1. every rank sends rank 0 its pid, effective uid and host identity (hostname, boot id, the
//     device of /dev/shm and the pid namespace, so that two containers or network namespaces with
//     private /dev/shm on one kernel are told apart);
//  2. if any differs, rank 0 answers "not shared" and every rank returns no segment (the caller
//     falls back to the process group); otherwise rank 0 creates an anonymous memfd of the layout's
//     size (mode 0600, never a name in /dev/shm), writes a header with a fresh 128-bit nonce into it
//     and sends every rank its pid, the fd's number, the layout, the nonce and all pids;
//  3. each rank opens /proc/<rank 0's pid>/fd/<fd>, requires a regular file of its own uid, mode
//     0600 and the exact size, maps it, requires the header's magic, layout and nonce, and answers;
//  4. rank 0 sends every rank the verdict (every rank mapped it, or which rank failed and why) and
//     closes its fd: from then on the memory lives only in the mappings.
// A rank that dies or stops at any step is reported by its peers' process-group waits (its
// connection closes, or the group's timeout expires), naming it; rank 0 relays a failure it sees to
// the others, so no rank waits out the timeout for a peer that is gone. Nothing is ever left in
// /dev/shm: the memfd has no name, and the kernel frees it with its last mapping or descriptor.
//
// Threat model. The store is a TCP server that any local user can read and write, so nothing about
// the segment travels through it. A local user of another uid cannot open the segment (it has no
// name, and the kernel lets only processes of the ranks' uid, or root, open /proc/<pid>/fd), cannot
// make a rank map memory of theirs (a rank maps only the descriptor rank 0 named over the process
// group, and only when its owner, mode, size, header and nonce are those rank 0 set), and so can
// neither read a payload nor write one. They can still deny service as for any torch.distributed
// job: disturb the store's own keys or its port, or exhaust memory. A process of the ranks' own uid
// (or root) can read and write their memory anyway (ptrace), so it is outside this model. Every
// offset and length read from the segment (chunk headers, channel counters, peers' headers) is
// checked against the layout before use, so even a corrupted segment raises, naming the peer whose
// data is bad, instead of writing outside a buffer.
//
// Layout: a SegmentHeader, a RankControl per rank, then per rank two collective slots (Note [Direct
// all-reduce]), then one channel per ordered pair of ranks (Note [Shared-memory messages]). Sizes
// are fixed at creation from the world size and rank 0's settings, so memory per rank is bounded
// whatever the message size.
//
// Note [Waiting on shared memory]
// Every wait is on a 32-bit word of the segment (a Signal): spin briefly while it may change soon,
// then sleep in futex(FUTEX_WAIT) on the word itself; whoever changes the word wakes sleepers only
// when the word's sleeper count says there are any, so the fast path makes no system call. Spinning
// is short (kSpinMicros) and skipped when there are more ranks than CPUs, where a spinning rank only
// takes the core from the peer it waits for (the collapse of busy-polling MPI on oversubscribed
// hosts). Sleeps are bounded (kLivenessMillis): each timeout checks that the peers still live
// (their pid in /proc, zombies counting as dead) and the group's timeout, so a peer killed in the
// middle of a collective is reported within a fraction of a second, naming it. The first rank any
// rank finds dead is recorded in the segment, and every later report names that rank, so a survivor
// that reported it and exited is never blamed in its place. A rank whose transport fails (a dead
// peer, a timeout, corrupt data) records that and why in the segment too (mark_broken), so every
// peer stops within a liveness period, saying which rank gave up and why. A timeout names the
// ranks still awaited, and says which of them are stopped (SIGSTOP) or gone.

struct Signal {
  std::atomic<uint32_t> value{0};
  std::atomic<uint32_t> sleepers{0};
  // Stores `v` and wakes whoever sleeps on this word.
  void post(uint32_t v);
  // Adds one to the word and wakes whoever sleeps on it.
  void bump();
};

class ShmSegment;
class Communicator;

// What a wait on shared memory needs beyond the word: the deadline, what to call the operation in
// errors, and whom it waits for, so that a timeout names the ranks that never arrived: one `peer`,
// or every peer whose `arrived` (or `reduced`) counter has not reached `step`.
struct WaitContext {
  const ShmSegment* segment = nullptr;
  std::chrono::steady_clock::time_point deadline;
  std::string_view what = "collective";
  enum class Awaited { kPeer, kArrived, kReduced } awaited = Awaited::kPeer;
  int peer = -1;
  uint32_t step = 0;
};

class ShmSegment {
 public:
  // Collective over the ranks of `setup`'s group (Note [Shared-memory segment]): `setup` is a
  // Communicator of the process-group transport for the collective being run, whose messages carry
  // the set-up. Returns nullptr on every rank when the ranks are not all on this host (or not all
  // one user); throws on every rank, naming the rank and the reason, when a rank could not create,
  // open, verify or map the segment or died during set-up. `timeout` bounds every later wait on
  // the segment (the set-up's own waits are the process group's, bounded by the group's timeout).
  static std::shared_ptr<ShmSegment> create(Communicator& setup, std::chrono::milliseconds timeout);
  ~ShmSegment();

  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  // "rank 0 of 4 in group '1'": where an error happened.
  std::string where() const;
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
  //  all_gather: `input` is `bytes` bytes (any dtype: only bytes move; it may be exactly this rank's
  //    block of `output`); `output` n·bytes, rank i's input at offset i·bytes. Per step each rank
  //    publishes up to a slot of its input and copies every peer's out: one copy in, n-1 copies out.
  //  reduce_scatter: `input` holds n blocks of `output.numel()` elements (float32/float64/int32/int64);
  //    `output` (not overlapping `input`, or exactly its block `rank`) receives op over the ranks'
  //    block `rank`, this rank's own piece first. Per step each
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

  // After a failure in the middle of a collective the slots' state is unknown: every later use raises,
  // on this rank and (through the segment) on every peer.
  void mark_broken(const std::string& why) const;
  // This rank rejected the arguments of a `what` with the collective checks off: its peers never
  // learn it and wait for it, so its own collectives must not go on (each would take the step of
  // its peers' current one): marks the segment broken.
  void reject_unchecked(std::string_view what) const;
  // Raises when this rank's or a peer's transport failed (mark_broken).
  void check_usable(std::string_view what) const;
  // How a peer's transport failed ("rank 1 gave up: ..."), read from the segment; "" when none has.
  std::string peer_failure() const;

  struct SegmentHeader;
  struct RankControl;
  struct Channel;
  RankControl& control(int rank) const;
  Channel& channel(int src, int dst) const;
  char* slot(int rank, int set) const;  // the data of rank's collective slot `set` (0 or 1)
  CollectiveHeader& slot_header(int rank, int set) const;

 private:
  ShmSegment() = default;
  struct Layout;
  // Maps `bytes` of `fd` and lays out the segment for `size` ranks with `layout`'s settings.
  void map(int fd, size_t bytes, const Layout& layout);
  SegmentHeader& header() const;
  // The rank a failure is blamed on: the first rank any rank of the group found dead (so that a
  // survivor that reported it and exited is never blamed in its place), else `peer`.
  int blame(int peer) const;
  // "rank 2 (pid 1234)" and, when it is stopped (SIGSTOP) or gone, that too.
  std::string describe_rank(int peer) const;
  // The ranks `context` still waits for, in the words of an error ("rank 1 (pid 42, stopped)").
  std::string describe_awaited(const WaitContext& context) const;
  // Posts this rank's arrival at step `target` and waits for every peer's.
  void arrive_and_wait(uint32_t target, const WaitContext& context);
  // Compares the headers of every rank in slot set `set`; throws `local_error` first if there is one.
  void compare_headers(int set, const std::string& local_error, std::string_view what) const;

  int rank_ = 0;
  int size_ = 1;
  std::string group_;
  std::chrono::milliseconds timeout_{0};
  std::vector<int> pids_;
  char* base_ = nullptr;
  size_t bytes_ = 0;
  int64_t slot_bytes_ = 0;   // data bytes of one collective slot
  int64_t whole_bytes_ = 0;  // n·chunk bytes up to which the direct all-reduce reduces whole chunks
  int64_t chunk_bytes_ = 0;  // data bytes of one channel chunk
  int64_t channel_slots_ = 0;
  size_t header_offset_ = 0, controls_offset_ = 0, slots_offset_ = 0, slot_stride_ = 0, channels_offset_ = 0, channel_stride_ = 0;
  uint32_t step_ = 0;        // collective steps taken (Note [Direct all-reduce]); the same on every rank
  bool spin_ = true;
  mutable std::mutex broken_mutex_;
  mutable std::string broken_;  // why this rank's transport failed (guarded by broken_mutex_)
  mutable std::atomic<bool> broken_flag_{false};  // broken_ is set: the lock-free test of check_usable
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
  // Raises (and marks the segment broken) for data from `peer`'s channel that cannot be right.
  [[noreturn]] void corrupt(int peer, const std::string& what) const;
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
  bool corrupt_next_chunk_ = false;                     // test-only (faults.h)
};

}  // namespace ddpkit::comm
