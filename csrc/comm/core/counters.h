#pragma once
// What ddpkit sent, counted per process for tests and benchmarks (ddpkit.comm_counters()): every
// module that sends counts here, without needing the Communicator.

#include <atomic>
#include <cstdint>

namespace ddpkit::comm {

struct CommCounters {
  int64_t collectives = 0;
  int64_t messages_sent = 0;
  int64_t bytes_sent = 0;
  // The most bytes of not-yet-received messages held outside shared memory at any one time by one
  // transport of this process (Note [Shared-memory messages]).
  int64_t peak_buffered_bytes = 0;
};
CommCounters counters();
void reset_counters();

namespace counters_detail {
inline std::atomic<int64_t> collectives{0};
inline std::atomic<int64_t> messages{0};
inline std::atomic<int64_t> bytes{0};
}  // namespace counters_detail

// Counts one collective (Communicator::begin and run_direct, once per collective).
inline void note_collective() { counters_detail::collectives.fetch_add(1, std::memory_order_relaxed); }
// Counts one message of `bytes` sent, by a Communicator or over the socket links (Note [Socket links]).
inline void note_message_sent(int64_t bytes) {
  counters_detail::messages.fetch_add(1, std::memory_order_relaxed);
  counters_detail::bytes.fetch_add(bytes, std::memory_order_relaxed);
}
// Records that a transport now holds `bytes` of early messages on the heap (for peak_buffered_bytes).
void note_buffered_bytes(int64_t bytes);

}  // namespace ddpkit::comm
