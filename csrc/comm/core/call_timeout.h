#pragma once
// A collective's own timeout, in place of its group's (Note [A call's timeout]).

#include <chrono>
#include <optional>

namespace ddpkit::comm {

// Note [A call's timeout]
// torch's barrier takes a timeout of its own (dist.barrier(timeout=...), BarrierOptions::timeout),
// which gloo honours. While a ScopedCallTimeout lives on a thread, every wait of the collective
// running there gives up after that timeout instead of the group's: the steps over shared memory
// (SegmentLiveness::timeout), the process group's messages (Communicator::wait) and the socket links
// across hosts. As with the group's timeout, the rank that gives up marks the transport broken, so
// the group must be made anew afterwards, as with gloo's.
inline thread_local std::optional<std::chrono::milliseconds> call_timeout;

// The timeout a wait on this thread takes: the running collective's own, else `group`'s.
inline std::chrono::milliseconds call_timeout_or(std::chrono::milliseconds group) {
  return call_timeout.value_or(group);
}

class ScopedCallTimeout {
 public:
  explicit ScopedCallTimeout(std::optional<std::chrono::milliseconds> timeout) : previous_(call_timeout) {
    if (timeout) call_timeout = timeout;
  }
  ~ScopedCallTimeout() { call_timeout = previous_; }
  ScopedCallTimeout(const ScopedCallTimeout&) = delete;
  ScopedCallTimeout& operator=(const ScopedCallTimeout&) = delete;

 private:
  std::optional<std::chrono::milliseconds> previous_;
};

}  // namespace ddpkit::comm
