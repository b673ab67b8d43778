#include "comm/core/counters.h"

namespace ddpkit::comm {
namespace {

std::atomic<int64_t> peak_buffered{0};

}  // namespace

CommCounters counters() {
  return CommCounters{counters_detail::collectives.load(), counters_detail::messages.load(),
                      counters_detail::bytes.load(), peak_buffered.load()};
}

void reset_counters() {
  counters_detail::collectives.store(0);
  counters_detail::messages.store(0);
  counters_detail::bytes.store(0);
  peak_buffered.store(0);
}

void note_buffered_bytes(int64_t bytes) {
  int64_t peak = peak_buffered.load(std::memory_order_relaxed);
  while (bytes > peak && !peak_buffered.compare_exchange_weak(peak, bytes, std::memory_order_relaxed)) {
  }
}

}  // namespace ddpkit::comm
