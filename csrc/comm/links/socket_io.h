#pragma once
// What the socket links' set-up (links/socket_setup.h) and their exchange of frames
// (links/socket_exchange.cpp, links/outgoing_frames.h, links/incoming_frames.h) share, internal to the
// links: the descriptor that closes itself, the blocking reads and writes, the frame header and magic
// words, and how a move of frames ends.

#include <unistd.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

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
inline constexpr auto kHeaderBytes = static_cast<int64_t>(sizeof(FrameHeader));

// A descriptor closed when it goes out of scope, unless released: a link's socket is one from its
// set-up to the links' end.
class Fd {
 public:
  explicit Fd(int fd = -1) : fd_(fd) {}
  ~Fd() { reset(); }
  Fd(Fd&& other) noexcept : fd_(other.release()) {}
  Fd& operator=(Fd&& other) noexcept {
    if (this != &other) {
      reset();
      fd_ = other.release();
    }
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }
  int release() { return std::exchange(fd_, -1); }
  void reset() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_;
};

// Why an exchange gives up: `peer` failed (-1: this rank's own failure), and, with `failed_rank`
// (a rank of the caller's group; -1: none), the rank every other peer is told failed (Note [News
// of a failure]).
struct Failure {
  int peer = -1;
  std::string why;
  int64_t failed_rank = -1;
};

// What a news frame from `peer` tells (Note [News of a failure]): the rank it names failed, as the
// peer it is among `ranks` (every peer's group rank), else `peer`.
Failure failure_in_news(const FrameHeader& news, int peer, const std::vector<int>& ranks);

// How a move of one frame ended for now. kFull: it waits for the caller's reports: its window is
// full (Note [Receiving windows]), the frame before it from the same peer is not reported whole, or
// it forwards data not reported yet (Links::Send::follows). kQueued: an earlier frame with the same
// peer goes first, which does the waiting.
enum class Moved { kDone, kBlocked, kFailed, kFull, kQueued };

// Whether data growing from `from` to `to` bytes passed a multiple of `step` (any growth, for no
// step): receiving thread and caller count steps alike, so that the thread's news is a report's.
inline bool passed_a_step(int64_t from, int64_t to, int64_t step) {
  return step > 0 ? to / step > from / step : to > from;
}

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
