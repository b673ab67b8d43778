#include "comm/shm/liveness.h"

#include "comm/core/call_timeout.h"

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <algorithm>
#include <cstring>
#include <fstream>

namespace ddpkit::comm {

using namespace shm_detail;

namespace {

// The state letter of /proc/<pid>/stat ('R', 'S', 'T' for stopped, 'Z' for a zombie, ...), or 'X'
// when there is no such process.
char process_state(int pid) {
  std::ifstream stat_file(c10::str("/proc/", pid, "/stat"));
  if (!stat_file) return 'X';
  std::string content;
  std::getline(stat_file, content);
  const size_t paren = content.rfind(')');
  if (paren == std::string::npos || paren + 2 >= content.size()) return 'X';
  return content[paren + 2];
}

// A pid whose process has exited (or is a zombie waiting to be reaped) is dead.
bool process_alive(int pid) {
  const char state = process_state(pid);
  return state != 'Z' && state != 'X';
}

}  // namespace

SegmentLiveness::SegmentLiveness(const SegmentMemory& memory, SegmentRanks ranks)
    : memory_(memory), ranks_(std::move(ranks)) {}

std::string SegmentLiveness::where() const {
  return c10::str("rank ", ranks_.group_ranks[ranks_.rank], " of ", ranks_.group_size, " in group '", ranks_.group,
                  "'");
}

std::chrono::milliseconds SegmentLiveness::timeout() const { return call_timeout_or(ranks_.timeout); }

void SegmentLiveness::mark_broken(const std::string& why) const {
  {
    std::lock_guard<std::mutex> lock(broken_mutex_);
    if (broken_.empty()) broken_ = why;
  }
  broken_flag_.store(true, std::memory_order_release);
  // Every peer stops too, at its next collective or at once in its current wait (woken below), and
  // says why (peer_failure).
  SegmentHeader& shared = memory_.header();
  const int rank = ranks_.rank;
  int32_t none = 0;
  if (shared.broken_by.compare_exchange_strong(none, -(rank + 1))) {
    const size_t length = std::min(why.size(), kBrokenWhyBytes - 1);
    std::memcpy(shared.broken_why, why.data(), length);
    shared.broken_why[length] = '\0';
    shared.broken_by.store(rank + 1, std::memory_order_release);
  }
  memory_.wake_all_sleepers();  // its waits and its peers' stop now, not at their next liveness check
}

int SegmentLiveness::failed_group_rank() const {
  const int size = memory_.size();
  const int dead = memory_.header().first_dead.load(std::memory_order_acquire) - 1;
  if (dead >= 0 && dead < size) return ranks_.group_ranks[dead];
  const int32_t by = memory_.header().broken_by.load(std::memory_order_acquire);
  const int gave_up = by > 0 ? by - 1 : -by - 1;
  return by != 0 && gave_up < size ? ranks_.group_ranks[gave_up] : -1;
}

std::string SegmentLiveness::peer_failure() const {
  const int32_t by = memory_.header().broken_by.load(std::memory_order_acquire);
  const int rank = by > 0 ? by - 1 : -by - 1;
  if (by == 0 || rank == ranks_.rank || rank < 0 || rank >= memory_.size()) return {};
  if (by < 0) return c10::str("rank ", ranks_.group_ranks[rank], "'s shared-memory transport failed");
  char why[kBrokenWhyBytes];
  std::memcpy(why, memory_.header().broken_why, kBrokenWhyBytes);
  why[kBrokenWhyBytes - 1] = '\0';  // whatever the segment holds, read no further
  return c10::str("rank ", ranks_.group_ranks[rank], " gave up: ", why);
}

void SegmentLiveness::reject_unchecked(std::string_view what) const {
  mark_broken(c10::str("this rank rejected the arguments of a ", what,
                       " with collective checks off, so its peers could not learn it and wait for it"));
}

void SegmentLiveness::check_usable(std::string_view what) const {
  if (!failed()) return;
  std::string why;
  {
    std::lock_guard<std::mutex> lock(broken_mutex_);
    why = broken_;
  }
  if (why.empty()) why = peer_failure();
  if (why.empty()) return;  // this rank's own failure, still being recorded by another of its threads
  TORCH_CHECK(false, "ddpkit.", what, " (", where(), "): this process group's shared-memory transport failed (", why,
              "); destroy the group and create a new one");
}

int SegmentLiveness::blame(int peer) const {
  std::atomic<int32_t>& first_dead = memory_.header().first_dead;
  int32_t expected = 0;
  if (first_dead.compare_exchange_strong(expected, peer + 1)) return peer;
  const int blamed = expected - 1;
  return blamed >= 0 && blamed < memory_.size() ? blamed : peer;  // a value out of range is not trusted
}

std::string SegmentLiveness::describe_rank(int peer) const {
  const char state = process_state(ranks_.pids[peer]);
  const char* note = state == 'T' || state == 't' ? ", stopped" : state == 'Z' || state == 'X' ? ", dead" : "";
  return c10::str("rank ", ranks_.group_ranks[peer], " (pid ", ranks_.pids[peer], note, ")");
}

bool SegmentLiveness::awaited(int peer, const WaitContext& context) const {
  if (peer == ranks_.rank) return false;
  if (context.awaited == WaitContext::Awaited::kPeer) return peer == context.peer;
  const Signal& counter =
      context.awaited == WaitContext::Awaited::kArrived ? memory_.control(peer).arrived : memory_.control(peer).reduced;
  return !reached(counter.value.load(std::memory_order_acquire), context.step);
}

int SegmentLiveness::first_awaited_peer(const WaitContext& context) const {
  if (context.awaited == WaitContext::Awaited::kPeer) {
    const bool valid = context.peer >= 0 && context.peer < memory_.size() && context.peer != ranks_.rank;
    return valid ? context.peer : -1;
  }
  for (int peer = 0; peer < memory_.size(); ++peer) {
    if (awaited(peer, context)) return peer;
  }
  return -1;
}

std::vector<int> SegmentLiveness::awaited_peers(const WaitContext& context) const {
  std::vector<int> missing;
  if (context.awaited == WaitContext::Awaited::kPeer) {
    const int peer = first_awaited_peer(context);
    if (peer >= 0) missing.push_back(peer);
    return missing;
  }
  for (int peer = 0; peer < memory_.size(); ++peer) {
    if (awaited(peer, context)) missing.push_back(peer);
  }
  return missing;
}

std::string SegmentLiveness::describe_awaited(const WaitContext& context) const {
  const std::vector<int> missing = awaited_peers(context);
  if (missing.empty()) return "the peers";
  std::string text;
  for (size_t i = 0; i < missing.size(); ++i) {
    text += (i == 0 ? "" : i + 1 == missing.size() ? " and " : ", ") + describe_rank(missing[i]);
  }
  return text;
}

void SegmentLiveness::check_peers(const WaitContext& context, const std::function<bool()>& ready) const {
  // Note [Only an awaited peer is blamed]
  for (const int peer : awaited_peers(context)) {
    if (process_alive(ranks_.pids[peer])) continue;
    // It may have posted what this wait lacks just before it exited: it failed only if that is missing.
    if (ready()) return;
    const int dead = blame(peer);
    const std::string why =
        c10::str("rank ", ranks_.group_ranks[dead], " (pid ", ranks_.pids[dead], ") failed: the process died");
    mark_broken(why);
    TORCH_CHECK(false, "ddpkit.", context.what, " (", where(), "): ", why,
                " during the collective (shared-memory transport)");
  }
  const std::string given_up = peer_failure();
  if (!given_up.empty()) {
    const std::string awaited = describe_awaited(context);
    mark_broken(given_up);
    TORCH_CHECK(false, "ddpkit.", context.what, " (", where(), "): waiting for ", awaited, " failed: ", given_up,
                "; destroy the group and create a new one");
  }
  check_usable(context.what);
  if (std::chrono::steady_clock::now() > context.deadline) {
    const std::string awaited = describe_awaited(context);
    mark_broken(c10::str("no progress within the timeout (", timeout().count(), " ms) waiting for ", awaited));
    TORCH_CHECK(false, "ddpkit.", context.what, " (", where(), "): waiting for ", awaited,
                " failed: no progress within the timeout (", timeout().count(),
                " ms); they stopped calling this collective or called another one");
  }
}

}  // namespace ddpkit::comm
