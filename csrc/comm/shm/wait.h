#pragma once
// How a rank waits on a word of its host's segment (Note [Waiting on shared memory]).

#include "comm/core/spin_budget.h"
#include "comm/shm/layout.h"
#include "comm/shm/liveness.h"

#include <sched.h>

#include <atomic>
#include <chrono>
#include <cstdint>

namespace ddpkit::comm {

// Note [Waiting on shared memory]
// Every wait is on a 32-bit word of the segment (a Signal): spin briefly while it may change soon,
// then sleep in futex(FUTEX_WAIT) on the word itself; whoever changes the word wakes sleepers only
// when the word's sleeper count says there are any, so the fast path makes no system call. How long
// a wait spins depends on its thread: the thread that called a synchronous collective is blocked on
// it anyway, so it spins up to kCallerSpinMicros (a peer a little behind, e.g. still computing the
// batch-norm statistics it brings to the same all-reduce, then costs no futex wake-up, which takes
// far longer than the spin: bench_latency.py's small all-reduce is what it keeps fast); a thread that
// runs collectives in the background (the engine's, for DDP buckets) spins only kSpinMicros, since
// the core it holds is the one its process computes on (spin_briefly_on_this_thread, core/spin_budget.h). Spinning is
// skipped (cpus_for_each_rank) when the group has more ranks on this kernel than it has CPUs, where
// a spinning rank only takes the core from the peer it waits for (the
// collapse of busy-polling MPI on oversubscribed hosts); ranks count whether or not they share this
// host's memory, since containers or namespaces with a /dev/shm of their own (simulated hosts)
// still share the kernel's CPUs. A spin that outlasts kSpinMicros yields the core at each clock
// check, so that another thread runnable on it (a peer, or gloo's event loop serving the step
// across hosts) runs before the wait ends. A wait whose peer last waited on this same CPU (each
// rank records its CPU as it starts a wait) yields from the first check on: the scheduler sometimes
// keeps two ranks on one CPU for a while although another CPU is there (a fresh pair of processes
// that started on one CPU, or ranks that gloo's socket wake-ups left on one), and each wait's
// spin then only kept the peer it waited for off the CPU (bench_latency.py's all-reduce with both
// ranks pinned to one CPU by taskset is where yielding at once shows). A peer's exit
// wakes every sleeper of the segment at once (Note [Prompt death notice]), and so does a rank that
// gives up (mark_broken): the woken wait checks its peers right away. Sleeps are still bounded
// (kSleepMillis), and every liveness period the wait checks its peers (SegmentLiveness::check_peers:
// their pid in /proc, zombies counting as dead, and the deadline), the backstop for a peer the pidfd
// watch does not cover. Either way a peer killed in the middle of a collective is reported, naming
// it (Note [Only an awaited peer is blamed]).

namespace shm_detail {

// How long one futex sleep lasts at most, and the default liveness period.
constexpr int kSleepMillis = 50;

}  // namespace shm_detail

// A liveness period that never comes: the waits rely on the peer watch alone.
constexpr auto kNoLivenessPoll = std::chrono::milliseconds::max();

// This rank's waits on its host's segment. Its state: whether waits spin, the liveness period, and
// how many peer exits the peer watch reported (Note [Prompt death notice]).
class SegmentWaits {
 public:
  // `spin`: the group has no more ranks on this kernel than it has CPUs. `liveness_period`: how
  // often a sleeping wait checks its peers (kNoLivenessPoll: never; the peer watch alone).
  SegmentWaits(const SegmentMemory& memory, const SegmentLiveness& liveness, bool spin,
               std::chrono::milliseconds liveness_period)
      : memory_(memory), liveness_(liveness), spin_(spin), liveness_period_(liveness_period) {}

  // Waits until `ready()` holds, sleeping on `signal` (Note [Waiting on shared memory]). Throws,
  // naming the peer, when a peer died or gave up, or when the deadline passed.
  template <class Ready>
  void wait_for(Signal& signal, Ready ready, const WaitContext& context) const;

  // A peer exited (the peer watch's report): every wait checks its peers now.
  void peer_exited() const;

 private:
  // Records the CPU this thread runs on as this rank's, and says whether a rank `context` still
  // waits for (the first one found) last waited on that same CPU (Note [Waiting on shared memory]).
  bool awaits_a_rank_on_this_cpu(const WaitContext& context) const;
  // Whether a wait must check its peers now, before its liveness period is up: a peer exited since
  // `seen` (which this updates) or some rank gave up (Note [Prompt death notice]).
  bool alarmed(uint32_t& seen) const {
    const uint32_t exits = exits_.load(std::memory_order_seq_cst);
    const bool exited = exits != seen;
    seen = exits;
    return exited || liveness_.failed();
  }
  // The time of the next liveness check after `now`.
  std::chrono::steady_clock::time_point next_check(std::chrono::steady_clock::time_point now) const {
    return liveness_period_ == kNoLivenessPoll ? std::chrono::steady_clock::time_point::max() : now + liveness_period_;
  }

  const SegmentMemory& memory_;
  const SegmentLiveness& liveness_;
  const bool spin_;
  const std::chrono::milliseconds liveness_period_;
  mutable std::atomic<uint32_t> exits_{0};  // peers the watch saw exit (Note [Prompt death notice])
};

template <class Ready>
void SegmentWaits::wait_for(Signal& signal, Ready ready, const WaitContext& context) const {
  if (ready()) return;
  // Note [Waiting on shared memory]
  if (spin_) {
    const auto start = std::chrono::steady_clock::now();
    const auto spin_until = start + spin_budget();
    // A peer on this very CPU runs only when this thread gives the CPU up: yield from the start.
    const auto yield_from = awaits_a_rank_on_this_cpu(context) ? start : start + kSpinMicros;
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
  auto check_at = next_check(std::chrono::steady_clock::now());
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
        shm_detail::futex_wait(&signal.value, observed, shm_detail::kSleepMillis);
      signal.sleepers.fetch_sub(1, std::memory_order_seq_cst);
      if (ready()) return;
      alarm = alarmed(exits_seen);
    }
    const auto now = std::chrono::steady_clock::now();
    if (alarm || now >= check_at) {
      liveness_.check_peers(context, [&] { return static_cast<bool>(ready()); });
      check_at = next_check(now);
    }
  }
}

}  // namespace ddpkit::comm
