#pragma once
// The frames one exchange of the socket links receives, their receiving and the reports of their data
// to the caller (Note [Socket links], Note [Receiving windows]): internal to the links.

#include "comm/links/links.h"
#include "comm/links/socket_io.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

namespace ddpkit::comm {

class LinkThread;

// The frames `recvs` of the collective numbered `sequence` expects, each with its header and how
// far it has come: received by whichever thread receives (the caller's or the links' receiving
// thread), reported to Links::Recv::on_data by the caller's, each side reading the other's count
// with acquire (a window's room is what the reports have passed).
class IncomingFrames {
 public:
  // `fds` and `ranks`: every peer's socket and group rank, by peer; both, and `recvs`, outlive this.
  IncomingFrames(std::vector<Links::Recv>& recvs, uint64_t sequence, const std::vector<socket_io::Fd>& fds,
                 const std::vector<int>& ranks);

  size_t size() const { return recvs_.size(); }
  int peer(size_t i) const { return recvs_[i].peer; }
  int fd(size_t i) const { return fds_[recvs_[i].peer].get(); }
  bool windowed(size_t i) const { return recvs_[i].window > 0; }
  // Whether a later frame from the same peer waits for frame `i`'s reports (Links::exchange).
  bool queues_behind(size_t i) const { return later_[i]; }
  // The data bytes of frame `i` its on_data is done with (a send that follows it may forward them):
  // what the reports passed, to the last multiple of Recv::step before the frame's end (a report may
  // end inside an element, which its on_data leaves for the next).
  int64_t done_with(size_t i) const;
  // Frame `i` has come whole.
  bool received(size_t i) const {
    const int64_t done = progress_[i].done.load(std::memory_order_acquire);
    return done == total(i, done);
  }

  // Receives as much of frame `i` as its socket holds now (kFull once its window is), checking its
  // header, or, on `thread` (null: the caller's), until the caller asks it to stop; on failure says
  // why in `failure`. `news`: set when another step of data (Recv::step) or the frame's end is in
  // for the caller to report (a thread has told the caller already). kQueued while an earlier frame
  // from the same peer is still coming, kFull while it is not reported whole.
  socket_io::Moved receive_some(size_t i, LinkThread* thread, socket_io::Failure& failure, bool& news);
  // On the caller's thread: passes what is ready of frame `i`, no further than `sent` data bytes (the
  // frame sent to the same peer, where there is one, so that the caller may overwrite what it sent),
  // to its on_data; true when it passed more. What on_data throws goes to the caller, the frame
  // then only partly read.
  bool report(size_t i, int64_t sent);
  // Sets every Recv::received, once every frame has come whole.
  void set_received() const;

 private:
  struct Progress {
    socket_io::FrameHeader header{};  // complete, and checked, before `done` passes it
    // Bytes of header and data received: written by whichever thread receives, read by the other
    // with acquire.
    std::atomic<int64_t> done{0};
    // Data bytes passed to on_data: written by the caller, read by the receiving thread with acquire
    // (a window's room).
    std::atomic<int64_t> reported{0};
    int64_t told = 0;  // data bytes the receiving thread woke the caller for (its own)
  };
  int64_t reported(size_t i) const { return progress_[i].reported.load(std::memory_order_acquire); }
  // Frame `i`'s data bytes, once its header is in (and checked), as far as `data` holds them.
  int64_t whole(size_t i) const {
    return std::min(static_cast<int64_t>(progress_[i].header.bytes), recvs_[i].capacity);
  }
  // Frame `i`'s bytes with its header once `done` bytes of it are in (a byte more while the header
  // is not).
  int64_t total(size_t i, int64_t done) const {
    return done < socket_io::kHeaderBytes ? socket_io::kHeaderBytes + 1
                                          : socket_io::kHeaderBytes + static_cast<int64_t>(progress_[i].header.bytes);
  }

  std::vector<Links::Recv>& recvs_;
  const uint64_t sequence_;
  const std::vector<socket_io::Fd>& fds_;
  const std::vector<int>& ranks_;
  std::unique_ptr<Progress[]> progress_;
  std::vector<int> earlier_;  // by frame: the frame before it from the same peer, or -1
  std::vector<char> later_;   // by frame: whether a frame after it comes from the same peer
};

}  // namespace ddpkit::comm
