#include "comm/core/fork_guard.h"

#include <c10/util/Exception.h>

#include <pthread.h>

#include <atomic>

namespace ddpkit::comm {
namespace {

std::atomic<uint64_t> forks_since_load{0};
const bool counts_forks = [] {
  pthread_atfork(nullptr, nullptr, [] { forks_since_load.fetch_add(1, std::memory_order_relaxed); });
  return true;
}();

}  // namespace

// Note [Forked children]
// A forked child has its parent's memory but none of its threads, and shares its sockets and shared
// memory. A group made before the fork stays the parent's. In the child, a collective or a wait on its
// work fails at once: it would wait forever for the engine's thread, which is not there. Destroying
// the group there (destroy_process_group, or the last reference dropped) destroys nothing: the engine
// is leaked whole. Its members' destructors would join a thread that does not exist, destroy a
// condition variable the parent's thread was waiting on (which waits for that waiter), and shut down
// the cross-host sockets the parent still uses. The child's copy of that memory costs nothing more.
// A forked child's own completions get a pool of their own (Note [Exit paths]). Test:
// test_exit_paths.py's forked-child test.
uint64_t fork_generation() {
  (void)counts_forks;
  return forks_since_load.load(std::memory_order_relaxed);
}

void check_not_forked(uint64_t made_in, std::string_view what, int rank) {
  TORCH_CHECK(fork_generation() == made_in, "ddpkit.", what, " (rank ", rank,
              "): this process is a fork of the one that made the group, and a forked child cannot use its "
              "parent's process group (its threads are the parent's); make a new group in the child");
}

}  // namespace ddpkit::comm
