#pragma once
// A thread that learns at once when a peer process on this host exits, by waiting on its pidfd.

#include <cstdint>
#include <functional>
#include <thread>
#include <vector>

namespace ddpkit::comm {

// Note [Prompt death notice]
// A wait on shared memory sleeps in futex(FUTEX_WAIT) on a word of the segment, and a peer killed in
// the middle of a collective never changes that word: left alone, the wait learns of the death only
// at its next liveness check (Note [Waiting on shared memory]). A PeerWatch makes the death an event
// instead: one thread per segment blocks in poll() on a pidfd of every peer (pidfd_open, Linux 5.3),
// which the kernel makes readable the moment the process exits, whether it was killed or ended
// normally (a zombie counts as exited, as in the liveness check). The watch then calls its `exited`
// callback with the peer's index; the segment wakes every sleeper on its words, and each wait checks
// its peers at once (check_peers decides, so a peer that finished its part and exited normally is
// still not blamed: Note [Only an awaited peer is blamed]). The thread sleeps in poll() from set-up
// to destruction, so it costs no CPU while nothing happens.
// The periodic liveness check stays, as the backstop: for a pid whose pidfd could not be opened
// (an older kernel, a seccomp filter), and for a wake that races with a wait about to sleep (the
// futex compares the word, which did not change, not the alarm).
// tests/test_reliability.py's test_dead_rank_is_named_without_the_liveness_poll turns the periodic
// check off (a test fault) and requires the survivor to name the rank killed while it slept, and
// tests/test_hardening.py that threads and descriptors stay flat over 1000 group cycles.
class PeerWatch {
 public:
  // Watches `pids` except `pids[self]`; `exited(i)` runs on the watch's thread once for each peer i
  // that exits, the first time it is seen (also at once for one already gone).
  PeerWatch(const std::vector<int>& pids, int self, std::function<void(int)> exited);
  // Stops and joins the thread (detaches it in a forked child, where it does not run).
  ~PeerWatch();

  PeerWatch(const PeerWatch&) = delete;
  PeerWatch& operator=(const PeerWatch&) = delete;

 private:
  void loop();

  std::vector<int> fds_;          // a pidfd per peer, -1 for this rank and for a peer not watched
  int stop_fd_ = -1;              // an eventfd: the destructor's word to the thread
  int watched_ = 0;               // peers watched by pidfd (the others only by the liveness check)
  uint64_t fork_generation_ = 0;  // the process whose thread this is (a forked child has none)
  std::function<void(int)> exited_;
  std::thread thread_;
};

}  // namespace ddpkit::comm
