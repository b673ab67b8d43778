#pragma once
// The 32-bit words of a shared-memory segment that ranks wait on, and the primitives of those waits
// (Note [Waiting on shared memory] in shm/wait.h).

#include <atomic>
#include <cstdint>

namespace ddpkit::comm {

// A word of the segment that ranks wait on, with a count of its sleepers: whoever changes the word
// wakes sleepers only when there are any, so the fast path makes no system call.
struct Signal {
  std::atomic<uint32_t> value{0};
  std::atomic<uint32_t> sleepers{0};
  // Stores `v` and wakes whoever sleeps on this word.
  void post(uint32_t v);
  // Adds one to the word and wakes whoever sleeps on it.
  void bump();
};

namespace shm_detail {

// True when the 32-bit counter `value` has reached `target` (counters wrap).
inline bool reached(uint32_t value, uint32_t target) { return static_cast<int32_t>(value - target) >= 0; }

// The CPU's spin-wait hint (pause, yield).
void cpu_relax();
// Sleeps in futex(FUTEX_WAIT) while `*word` holds `expected`, for at most `millis`.
void futex_wait(std::atomic<uint32_t>* word, uint32_t expected, int millis);
// Wakes every process sleeping on `*word`.
void futex_wake_all(std::atomic<uint32_t>* word);

}  // namespace shm_detail
}  // namespace ddpkit::comm
