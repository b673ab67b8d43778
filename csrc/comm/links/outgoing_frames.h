#pragma once
// The frames one exchange of the socket links sends, and their sending (Note [Socket links]):
// internal to the links.

#include "comm/links/links.h"
#include "comm/links/socket_io.h"

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

namespace ddpkit::comm {

class LinkThread;

// The frames of `sends` for the collective numbered `sequence`, each with its header and how far it
// has gone: moved by whichever thread sends (the caller's or the links' sending thread), read by the
// other with acquire (the caller's reports, Links::Recv::on_data).
class OutgoingFrames {
 public:
  // `fds` and `ranks`: every peer's socket and group rank, by peer; both outlive this.
  // `reports_wait`: a report waits for a frame sent to its peer, so each send is news to the caller.
  // `sends` moves in as the constructor runs, after every argument is evaluated.
  OutgoingFrames(std::vector<Links::Send>&& sends, uint64_t sequence, const std::vector<socket_io::Fd>& fds,
                 const std::vector<int>& ranks, bool reports_wait);

  size_t size() const { return sends_.size(); }
  int peer(size_t i) const { return sends_[i].peer; }
  int fd(size_t i) const { return fds_[sends_[i].peer].get(); }
  // Frame `i` has gone whole.
  bool sent(size_t i) const { return progress_[i].done.load(std::memory_order_acquire) == total(i); }
  // Frame `i` has begun and not gone whole: its peer's stream cannot go on without the rest.
  bool halfway(size_t i) const {
    const int64_t done = progress_[i].done.load(std::memory_order_acquire);
    return done > 0 && done < total(i);
  }
  // Frame `i` waits for its peer to take more: not gone whole, not queued behind an earlier frame to
  // the same peer, and short of the `sendable` data bytes (send_some's) that may go.
  bool waits_for_peer(size_t i, int64_t sendable) const {
    const int64_t done = progress_[i].done.load(std::memory_order_acquire);
    return done < may_go(i, sendable) && (earlier_[i] < 0 || sent(earlier_[i]));
  }
  // The data bytes (its header left out) of frame `i` sent so far.
  int64_t data_sent(size_t i) const {
    return std::max<int64_t>(0, progress_[i].done.load(std::memory_order_acquire) - socket_io::kHeaderBytes);
  }

  // The received frame whose reports frame `i` forwards (Links::Send::follows), or -1.
  int follows(size_t i) const { return sends_[i].follows; }

  // Sends as much of frame `i` as its socket takes now, no further than `sendable` data bytes (what
  // its followed frame's reports passed; anything past the frame's end for one that follows none),
  // prepare()-ing it as it goes, or, on `thread` (null: the caller's), until the caller asks it to
  // stop; on failure says why in `failure`. `news`: set when the caller should look (a report waits
  // for this send). kQueued while an earlier frame to the same peer has not gone whole.
  socket_io::Moved send_some(size_t i, int64_t sendable, const LinkThread* thread, socket_io::Failure& failure,
                             bool& news);
  // Sends the rest of frame `i`, cut halfway, by `until`, blocking; false when it cannot.
  bool finish(size_t i, socket_io::Clock::time_point until) noexcept;

 private:
  struct Progress {
    socket_io::FrameHeader header{};
    // Bytes of header, first and second sent: written by whichever thread sends, read by the other
    // with acquire.
    std::atomic<int64_t> done{0};
    int64_t prepared = 0;  // data bytes prepare() has made (all of them without prepare)
  };
  int64_t total(size_t i) const { return socket_io::kHeaderBytes + static_cast<int64_t>(progress_[i].header.bytes); }
  // Frame `i`'s bytes with its header that may go once `sendable` data bytes may: the header waits for
  // data to go with it (alone, it would cost a segment and a wake-up of its own).
  int64_t may_go(size_t i, int64_t sendable) const {
    if (sendable == 0 && total(i) > socket_io::kHeaderBytes) return 0;
    return std::min(total(i), socket_io::kHeaderBytes + sendable);
  }

  const std::vector<Links::Send> sends_;
  const std::vector<socket_io::Fd>& fds_;
  const std::vector<int>& ranks_;
  const bool reports_wait_;
  std::unique_ptr<Progress[]> progress_;
  std::vector<int> earlier_;  // by frame: the frame before it to the same peer, or -1
};

}  // namespace ddpkit::comm
