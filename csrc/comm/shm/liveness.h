#pragma once
// Whether the ranks of a shared-memory segment still live, and whom a failure is blamed on (Note
// [Only an awaited peer is blamed]).

#include "comm/shm/layout.h"

#include <atomic>
#include <chrono>
#include <functional>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

namespace ddpkit::comm {

// Note [Only an awaited peer is blamed]
// The liveness check looks only at the peers the wait still needs (awaited_peers): a rank may
// finish its part of a collective and exit while its peers are still inside it (the leaves of a
// reduce's tree return once their message is in the channel; the last step of a program often
// is such a reduce), and its slots and messages stay readable after it exits. Blaming it would
// fail a collective that every rank completed. A dead peer that no wait needs still stops the
// group: whoever waits for it reports it in the segment (mark_broken), and every other wait sees
// that within a liveness period.
// The first rank any rank finds dead is recorded in the segment, and every later report names that
// rank, so a survivor that reported it and exited is never blamed in its place. A rank whose
// transport fails (a dead peer, a timeout, corrupt data) records that and why in the segment too
// (mark_broken) and wakes the segment's sleepers, so every peer stops, saying which rank gave up
// and why. A timeout names the ranks still awaited, and says which of them are stopped (SIGSTOP)
// or gone.

// What a wait on shared memory needs beyond the word: the deadline, what to call the operation in
// errors, and whom it waits for, so that a timeout names the ranks that never arrived: one `peer`,
// or every peer whose `arrived` (or `reduced`) counter has not reached `step`.
struct WaitContext {
  std::chrono::steady_clock::time_point deadline;
  std::string_view what = "collective";
  enum class Awaited { kPeer, kArrived, kReduced } awaited = Awaited::kPeer;
  int peer = -1;
  uint32_t step = 0;
};

// Who the segment's ranks are, in the group's words.
struct SegmentRanks {
  int rank = 0;                  // this rank's index among the segment's ranks (its host's)
  std::vector<int> group_ranks;  // the group's rank of each of the segment's ranks
  std::vector<int> pids;         // the pid of each
  int group_size = 1;
  std::string group;                     // the group's name, for errors
  std::chrono::milliseconds timeout{0};  // the group's
};

// The liveness and the failure record of a segment's ranks, for this rank: who died or gave up, and
// what a failed wait says. Its state is the segment's header (shared) and this rank's own record of
// why it gave up.
class SegmentLiveness {
 public:
  SegmentLiveness(const SegmentMemory& memory, SegmentRanks ranks);

  const SegmentRanks& ranks() const { return ranks_; }
  // "rank 0 of 4 in group '1'": where an error happened (the group's numbering).
  std::string where() const;
  // The group's timeout, or the running collective's own (Note [A call's timeout]).
  std::chrono::milliseconds timeout() const;

  // After a failure in the middle of a collective the slots' state is unknown: every later use
  // raises, on this rank and (through the segment) on every peer, whose waits are woken.
  void mark_broken(const std::string& why) const;
  // This rank rejected the arguments of a `what` with the collective checks off: its peers never
  // learn it and wait for it, so its own collectives must not go on (each would take the step of
  // its peers' current one): marks the segment broken.
  void reject_unchecked(std::string_view what) const;
  // Raises when this rank's or a peer's transport failed (mark_broken).
  void check_usable(std::string_view what) const;
  // Lock-free: this rank's or a peer's transport failed (mark_broken), so a wait must look now.
  bool failed() const {
    return broken_flag_.load(std::memory_order_acquire) ||
           memory_.header().broken_by.load(std::memory_order_acquire) != 0;
  }
  // How a peer's transport failed ("rank 1 gave up: ..."), read from the segment; "" when none has.
  std::string peer_failure() const;
  // The group's rank that died first, else the one whose transport failed first; -1 when none.
  int failed_group_rank() const;

  // Throws when a peer the wait still needs died (and `ready()` still fails), a rank of the group
  // gave up, or the deadline passed (after marking the segment broken).
  void check_peers(const WaitContext& context, const std::function<bool()>& ready) const;
  // The peers `context`'s wait still needs: its one peer, or those whose counter lacks its step.
  std::vector<int> awaited_peers(const WaitContext& context) const;
  // The first of them, or -1: no allocation, for the start of every wait.
  int first_awaited_peer(const WaitContext& context) const;

 private:
  // The rank a failure is blamed on: the first rank any rank of the group found dead (so that a
  // survivor that reported it and exited is never blamed in its place), else `peer`.
  int blame(int peer) const;
  // "rank 2 (pid 1234)" and, when it is stopped (SIGSTOP) or gone, that too.
  std::string describe_rank(int peer) const;
  // The ranks `context` still waits for, in the words of an error ("rank 1 (pid 42, stopped)").
  std::string describe_awaited(const WaitContext& context) const;
  bool awaited(int peer, const WaitContext& context) const;

  const SegmentMemory& memory_;
  const SegmentRanks ranks_;
  mutable std::mutex broken_mutex_;
  mutable std::string broken_;                    // why this rank's transport failed (guarded by broken_mutex_)
  mutable std::atomic<bool> broken_flag_{false};  // broken_ is set: the lock-free test of check_usable
};

}  // namespace ddpkit::comm
