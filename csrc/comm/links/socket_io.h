#pragma once
// The blocking reads and writes, frame header and magic words that the socket links' set-up
// (links/socket_links.cpp) and their exchange of frames (links/socket_exchange.cpp) share: internal to the links.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>

namespace ddpkit::comm::socket_io {

using Clock = std::chrono::steady_clock;

inline constexpr uint64_t kFrameMagic = 0x64646b6672616d65ULL;  // "ddkframe"
inline constexpr uint64_t kNewsMagic = 0x64646b6e65777321ULL;   // "ddknews!": its bytes field names a failed rank

// What precedes every frame's bytes (Note [Socket links]).
struct FrameHeader {
  uint64_t magic;
  uint64_t sequence;
  uint64_t bytes;
};

std::string errno_text();

// Milliseconds until `deadline`, clamped to [0, 2^30]: poll's timeout.
int remaining_ms(Clock::time_point deadline);

// Waits until `fd` is ready for `events` or the deadline passes; false on the deadline.
bool wait_for(int fd, short events, Clock::time_point deadline);

// Writes all `bytes` of `data` to the non-blocking `fd` by the deadline; raises naming `whom`.
void write_all(int fd, const void* data, size_t bytes, Clock::time_point deadline, const std::string& whom);

// Reads exactly `bytes` into `data` from the non-blocking `fd` by the deadline; raises naming `whom`.
void read_all(int fd, void* data, size_t bytes, Clock::time_point deadline, const std::string& whom);

}  // namespace ddpkit::comm::socket_io
