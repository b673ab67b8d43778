#pragma once
// How long a wait on this thread spins before it sleeps (Note [Waiting on shared memory] in
// shm/wait.h): set by the thread's role, read by the waits.

#include <chrono>

namespace ddpkit::comm {

// A thread that runs collectives in the background spins this long at most; a caller of a
// synchronous collective, which is blocked on it anyway, kCallerSpinMicros.
constexpr auto kSpinMicros = std::chrono::microseconds(30);
constexpr auto kCallerSpinMicros = std::chrono::microseconds(1000);

// How long a wait on this thread spins before it sleeps: kCallerSpinMicros unless
// spin_briefly_on_this_thread() was called on it.
std::chrono::microseconds spin_budget();

// Waits on this thread spin only briefly (kSpinMicros) from now on: for a thread that runs
// collectives while its process computes on another (the engine's).
void spin_briefly_on_this_thread();

}  // namespace ddpkit::comm
