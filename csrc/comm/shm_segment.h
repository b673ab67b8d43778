#pragma once
// The shared-memory segment of a process group whose ranks all run on this host: its set-up, layout,
// liveness and waits. The transport built on it is ShmTransport (shm_channels.h): point-to-point
// messages through channels, and the direct collectives of shm_direct.h.

#include "comm/call_timeout.h"
#include "comm/header.h"
#include "comm/peer_watch.h"
#include "comm/topology.h"

#include <ATen/ATen.h>

#include <sched.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

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
//           moves in (at most channel_chunk_bytes()).
//  slice    rank r's share of a chunk (BalancedSplit, split.h), which rank r alone reduces.
//  channel  per ordered pair of ranks, a ring of kChannelSlots chunks carrying point-to-point messages.

// Note [Shared-memory segment]
// One segment per host that holds more than one rank of a group, made by a collective of the group
// that runs over the group's own point-to-point messages (the process group's connections), never
// through the store, after discovery has told every rank the group's hosts and pids (Note [Topology]):
//  1. each host's leader (its lowest rank) creates an anonymous memfd of the layout's size (mode
//     0600, never a name in /dev/shm), writes a header with a fresh 128-bit nonce into it and sends
//     the host's other ranks its pid, the fd's number, the layout and the nonce;
//  2. each of them opens /proc/<leader's pid>/fd/<fd>, requires a regular file of its own uid, mode
//     0600 and the exact size, maps it, requires the header's magic, layout and nonce, and answers;
//  3. every leader reports its host to rank 0, which sends every rank the verdict (every rank mapped
//     its segment, or which rank failed and why); the leaders have closed their fds: from then on the
//     memory lives only in the mappings.
// A rank that dies or stops at any step is reported by its peers' process-group waits (its
// connection closes, or the group's timeout expires), naming it; rank 0 relays a failure it sees to
// the others, so no rank waits out the timeout for a peer that is gone. Nothing is ever left in
// /dev/shm: the memfd has no name, and the kernel frees it with its last mapping or descriptor.
//
// Threat model. The store is a TCP server that any local user can read and write, so nothing about
// the segment travels through it. A local user of another uid cannot open the segment (it has no
// name, and the kernel lets only processes of the ranks' uid, or root, open /proc/<pid>/fd), cannot
// make a rank map memory of theirs (a rank maps only the descriptor its host's leader named over the
// process group, and only when its owner, mode, size, header and nonce are those the leader set), and so can
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
// when the word's sleeper count says there are any, so the fast path makes no system call. How long
// a wait spins depends on its thread: the thread that called a synchronous collective is blocked on
// it anyway, so it spins up to kCallerSpinMicros (a peer a little behind, e.g. still computing the
// batch-norm statistics it brings to the same all-reduce, then costs no futex wake-up, which takes
// tens of microseconds); a thread that runs collectives in the background (the engine's, for DDP
// buckets) spins only kSpinMicros, since the core it holds is the one its process computes on
// (spin_briefly_on_this_thread). Spinning is skipped when the group has more ranks on this kernel
// than it has CPUs, where a spinning rank only takes the core from the peer it waits for (the
// collapse of busy-polling MPI on oversubscribed hosts); ranks count whether or not they share this
// host's memory, since containers or namespaces with a /dev/shm of their own (simulated hosts)
// still share the kernel's CPUs. A spin that outlasts kSpinMicros yields the core at each clock
// check, so that another thread runnable on it (a peer, or gloo's event loop serving the step
// across hosts) runs before the wait ends. A wait whose peer last waited on this same CPU (each
// rank records its CPU as it starts a wait) yields from the first check on: the scheduler sometimes
// keeps two ranks on one CPU for a while although another CPU is there (a fresh pair of processes
// that started on one CPU, or ranks that gloo's socket wake-ups left on one), and each wait's
// spin then only kept the peer it waited for off the CPU (n=2 pinned to one CPU: yielding at once
// made a 1k-float all-reduce several times faster, measured by hand with taskset). A peer's exit
// wakes every sleeper of the segment at once (Note [Prompt death notice]), and so does a rank that
// gives up (mark_broken): the woken wait checks its peers right away. Sleeps are still bounded
// (kLivenessMillis), the backstop for a peer the pidfd watch does not cover: each timeout checks
// that the peers still live (their pid in /proc, zombies counting as dead) and the group's timeout.
// Either way a peer killed in the middle of a collective is reported, naming it.
// The first rank any rank finds dead is recorded in the segment, and every later report names that
// rank, so a survivor that reported it and exited is never blamed in its place. A rank whose
// transport fails (a dead peer, a timeout, corrupt data) records that and why in the segment too
// (mark_broken) and wakes the segment's sleepers, so every peer stops, saying which rank gave up and why. A
// timeout names the ranks still awaited, and says which of them are stopped (SIGSTOP) or gone.
//
// Note [Only an awaited peer is blamed]
// The liveness check looks only at the peers the wait still needs (awaited_peers): a rank may
// finish its part of a collective and exit while its peers are still inside it (the leaves of a
// reduce's tree return once their message is in the channel; the last step of a program often
// is such a reduce), and its slots and messages stay readable after it exits. Blaming it would
// fail a collective that every rank completed. A dead peer that no wait needs still stops the
// group: whoever waits for it reports it in the segment (mark_broken), and every other wait sees
// that within a liveness period.

namespace shm_detail {

constexpr size_t kLine = 128;               // two cache lines: no false sharing with the adjacent-line prefetcher
constexpr int64_t kChannelSlots = 4;        // chunks per channel
constexpr size_t kChunkHeaderBytes = 64;    // a channel chunk's header (shm_channels.cpp)
constexpr size_t kSlotHeaderBytes = kLine;  // a CollectiveHeader, padded
constexpr auto kSpinMicros = std::chrono::microseconds(30);
constexpr auto kCallerSpinMicros = std::chrono::microseconds(1000);
// How long a wait on this thread spins before it sleeps: kCallerSpinMicros unless
// spin_briefly_on_this_thread() was called on it.
std::chrono::microseconds spin_budget();
constexpr int kLivenessMillis = 50;
static_assert(sizeof(CollectiveHeader) <= kSlotHeaderBytes);

// True when the 32-bit counter `value` has reached `target` (counters wrap).
inline bool reached(uint32_t value, uint32_t target) { return static_cast<int32_t>(value - target) >= 0; }

void cpu_relax();
// Sleeps in futex(FUTEX_WAIT) while `*word` holds `expected`, for at most `millis`.
void futex_wait(std::atomic<uint32_t>* word, uint32_t expected, int millis);

}  // namespace shm_detail

// Waits on this thread spin only briefly from now on (Note [Waiting on shared memory]): for a thread
// that runs collectives while its process computes on another (the engine's).
void spin_briefly_on_this_thread();

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
  // the set-up, and `group` what discovery learnt of its ranks. Returns this rank's host's segment,
  // or null when this rank is alone on its host. Throws on every rank, naming the rank and the
  // reason, when a rank could not create, open, verify or map its host's segment or died during
  // set-up. `timeout` bounds every later wait on the segment (the set-up's own waits are the process
  // group's, bounded by the group's timeout).
  static std::shared_ptr<ShmSegment> set_up(Communicator& setup, const Discovery& group,
                                            std::chrono::milliseconds timeout);
  // Stops the peer watch before the memory it wakes goes.
  ~ShmSegment();

  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;

  // This rank's index among the segment's ranks (its host's), and their number.
  int rank() const { return rank_; }
  int size() const { return size_; }
  // The group's rank of the segment's rank `local`.
  int group_rank(int local) const { return ranks_[local]; }
  // "rank 0 of 4 in group '1'": where an error happened (the group's numbering).
  std::string where() const;
  // The group's timeout, or the running collective's own (Note [A call's timeout]).
  std::chrono::milliseconds timeout() const { return call_timeout_or(timeout_); }
  int64_t slot_bytes() const { return slot_bytes_; }
  int64_t channel_chunk_bytes() const { return chunk_bytes_; }

  // Waits until `ready()` holds, sleeping on `signal` (Note [Waiting on shared memory]). Throws,
  // naming the peer, when a peer died or gave up, or when the deadline passed.
  template <class Ready>
  void wait_for(Signal& signal, Ready ready, const WaitContext& context) const;

  // Throws when a peer the wait still needs died (and `ready()` still fails), a rank of the group
  // gave up, or the deadline passed (after marking the segment broken).
  void check_peers(const WaitContext& context, const std::function<bool()>& ready) const;
  // The peers `context`'s wait still needs: its one peer, or those whose counter lacks its step.
  std::vector<int> awaited_peers(const WaitContext& context) const;

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
  // The group's rank that died first, else the one whose transport failed first; -1 when none.
  int failed_group_rank() const;

 private:
  // The transport's two halves lay their data out in the segment.
  friend class ShmDirect;
  friend class ShmTransport;

  struct SegmentHeader;
  struct Layout;
  // The first failure of a set-up step, as far as this rank knows it: a setup_messages::Failure,
  // the errno it came with, and the group's rank it happened on.
  struct HostFailure {
    int64_t failure = 0;
    int64_t error_number = 0;
    int64_t rank = -1;
  };
  struct RankControl {
    alignas(shm_detail::kLine) Signal arrived;   // steps whose slot this rank has filled (Note [Direct all-reduce])
    alignas(shm_detail::kLine) Signal reduced;   // steps whose slice this rank has reduced
    alignas(shm_detail::kLine) Signal doorbell;  // bumped when a chunk arrives for this rank, or one it sent was taken
    alignas(shm_detail::kLine) std::atomic<int32_t> cpu;  // 1 + the CPU this rank last waited on (0: none yet)
  };
  struct Channel {
    alignas(shm_detail::kLine) std::atomic<uint64_t> head;  // chunks written by the sender
    alignas(shm_detail::kLine) std::atomic<uint64_t> tail;  // chunks taken by the receiver
    alignas(shm_detail::kLine) char chunks[1];              // kChannelSlots x (chunk header + chunk bytes)
  };

  ShmSegment() = default;
  // Set-up step 1 on the host's leader: creates the segment and offers it to the host's other ranks;
  // records the host's first failure in `failed`.
  void offer_to_host(Communicator& setup, HostFailure& failed);
  // Set-up step 2 on the host's other ranks: opens, verifies and maps `leader`'s segment and answers.
  void accept_from_leader(Communicator& setup, int leader, HostFailure& failed);
  // Maps `bytes` of `fd` and lays out the segment for `size` ranks with `layout`'s settings.
  void map(int fd, size_t bytes, const Layout& layout);
  SegmentHeader& header() const;
  RankControl& control(int rank) const;
  Channel& channel(int src, int dst) const;
  char* slot(int rank, int set) const;  // the data of rank's collective slot `set` (0 or 1)
  CollectiveHeader& slot_header(int rank, int set) const;
  // The rank a failure is blamed on: the first rank any rank of the group found dead (so that a
  // survivor that reported it and exited is never blamed in its place), else `peer`.
  int blame(int peer) const;
  // "rank 2 (pid 1234)" and, when it is stopped (SIGSTOP) or gone, that too.
  std::string describe_rank(int peer) const;
  // Records the CPU this thread runs on as this rank's, and says whether a rank `context` still
  // waits for (the first one found) last waited on that same CPU (Note [Waiting on shared memory]).
  bool awaits_a_rank_on_this_cpu(const WaitContext& context) const;
  // The ranks `context` still waits for, in the words of an error ("rank 1 (pid 42, stopped)").
  std::string describe_awaited(const WaitContext& context) const;
  // Whether a wait must check its peers now, before its liveness period is up: a peer exited since
  // `seen` (which this updates) or some rank gave up (Note [Prompt death notice]).
  bool alarmed(uint32_t& seen) const;
  // Wakes every sleeper on the segment's words, in every process, changing none of them.
  void wake_all_sleepers() const;
  // Starts the peer watch of this rank's host peers (set-up's last step).
  void watch_peers();

  int rank_ = 0;
  int size_ = 1;
  std::vector<int> ranks_;  // the group's rank of each of the segment's ranks
  int group_rank_ = 0;
  int group_size_ = 1;
  std::string group_;
  std::chrono::milliseconds timeout_{0};
  std::vector<int> pids_;
  char* base_ = nullptr;
  size_t bytes_ = 0;
  int64_t slot_bytes_ = 0;   // data bytes of one collective slot
  int64_t whole_bytes_ = 0;  // n·chunk bytes up to which the direct all-reduce reduces whole chunks
  int64_t chunk_bytes_ = 0;  // data bytes of one channel chunk
  size_t header_offset_ = 0, controls_offset_ = 0, slots_offset_ = 0, slot_stride_ = 0, channels_offset_ = 0,
         channel_stride_ = 0;
  bool spin_ = true;
  mutable std::mutex broken_mutex_;
  mutable std::string broken_;                    // why this rank's transport failed (guarded by broken_mutex_)
  mutable std::atomic<bool> broken_flag_{false};  // broken_ is set: the lock-free test of check_usable
  std::atomic<uint32_t> exits_{0};                // peers the watch saw exit (Note [Prompt death notice])
  std::unique_ptr<PeerWatch> watch_;
  bool poll_liveness_ = true;  // the periodic check runs (off only under the no_liveness_poll test fault)
};

template <class Ready>
void ShmSegment::wait_for(Signal& signal, Ready ready, const WaitContext& context) const {
  if (ready()) return;
  // Note [Waiting on shared memory]
  if (spin_) {
    const auto start = std::chrono::steady_clock::now();
    const auto spin_until = start + shm_detail::spin_budget();
    // A peer on this very CPU runs only when this thread gives the CPU up: yield from the start.
    const auto yield_from = awaits_a_rank_on_this_cpu(context) ? start : start + shm_detail::kSpinMicros;
    for (int i = 1;; ++i) {
      shm_detail::cpu_relax();
      if (ready()) return;
      if ((i & 63) == 0) {
        const auto now = std::chrono::steady_clock::now();
        if (now > spin_until) break;
        if (now >= yield_from) sched_yield();
      }
    }
  }
  auto next_check = std::chrono::steady_clock::now() + std::chrono::milliseconds(shm_detail::kLivenessMillis);
  // Note [Prompt death notice]. Every exit counts, also one seen before this wait began: the peer
  // may be one this wait needs.
  uint32_t exits_seen = 0;
  for (;;) {
    const uint32_t observed = signal.value.load(std::memory_order_seq_cst);
    if (ready()) return;
    bool alarm = alarmed(exits_seen);
    if (!alarm) {
      signal.sleepers.fetch_add(1, std::memory_order_seq_cst);
      if (signal.value.load(std::memory_order_seq_cst) == observed &&
          exits_.load(std::memory_order_seq_cst) == exits_seen)
        shm_detail::futex_wait(&signal.value, observed, shm_detail::kLivenessMillis);
      signal.sleepers.fetch_sub(1, std::memory_order_seq_cst);
      if (ready()) return;
      alarm = alarmed(exits_seen);
    }
    const auto now = std::chrono::steady_clock::now();
    if (alarm || (poll_liveness_ && now >= next_check)) {
      check_peers(context, [&] { return static_cast<bool>(ready()); });
      next_check = now + std::chrono::milliseconds(shm_detail::kLivenessMillis);
    }
  }
}

}  // namespace ddpkit::comm
