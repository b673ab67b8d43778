#include "comm/links/incoming_frames.h"

#include "comm/links/link_thread.h"

#include <c10/util/StringUtil.h>

#include <sys/socket.h>

#include <algorithm>
#include <cerrno>

namespace ddpkit::comm {

using namespace socket_io;

IncomingFrames::IncomingFrames(std::vector<Links::Recv>& recvs, uint64_t sequence, const std::vector<Fd>& fds,
                               const std::vector<int>& ranks)
    : recvs_(recvs),
      sequence_(sequence),
      fds_(fds),
      ranks_(ranks),
      progress_(new Progress[recvs.size()]),
      earlier_(recvs.size(), -1),
      later_(recvs.size(), 0) {
  for (size_t i = 0; i < recvs_.size(); ++i) {
    recvs_[i].received = 0;
    for (size_t j = i; j-- > 0;) {
      if (recvs_[j].peer == recvs_[i].peer) {
        earlier_[i] = static_cast<int>(j);
        later_[j] = 1;
        break;
      }
    }
  }
}

Moved IncomingFrames::receive_some(size_t i, LinkThread* thread, Failure& failure, bool& news) {
  Progress& in = progress_[i];
  const Links::Recv& recv = recvs_[i];
  const int peer = recv.peer;
  int64_t done = in.done.load(std::memory_order_relaxed);  // this thread is its one writer
  if (done == 0 && earlier_[i] >= 0) {
    const auto earlier = static_cast<size_t>(earlier_[i]);
    if (!received(earlier)) return Moved::kQueued;
    // Its data may still be in the buffer this frame would receive into.
    if (recvs_[earlier].on_data && reported(earlier) < whole(earlier)) return Moved::kFull;
  }
  Moved result = Moved::kDone;
  while (done < total(i, done)) {
    if (thread != nullptr && thread->stop_requested()) return Moved::kBlocked;
    char* into = reinterpret_cast<char*>(&in.header) + done;
    int64_t want = (done < kHeaderBytes ? kHeaderBytes : total(i, done)) - done;
    if (done >= kHeaderBytes && recv.window == 0 && done - kHeaderBytes >= recv.capacity) {
      // A drained frame's bytes past the capacity (Links::Recv::drain).
      thread_local char dropped[64 << 10];
      into = dropped;
      want = std::min<int64_t>(want, sizeof(dropped));
    } else if (done >= kHeaderBytes && recv.window == 0) {
      into = static_cast<char*>(recv.data) + (done - kHeaderBytes);
      want = std::min(want, recv.capacity - (done - kHeaderBytes));
    } else if (done >= kHeaderBytes) {
      // Up to the window's end, and no further past the reports' last whole step than it holds: the
      // part of an element a report ends with is still to be reduced.
      const int64_t data = done - kHeaderBytes;
      const int64_t at = data % recv.window;
      const int64_t done_with = in.reported.load(std::memory_order_acquire) / recv.step * recv.step;
      const int64_t room = done_with + recv.window - data;
      if (room == 0) return Moved::kFull;
      into = static_cast<char*>(recv.data) + at;
      want = std::min({want, recv.window - at, room});
    }
    const ssize_t got = ::recv(fds_[peer].get(), into, static_cast<size_t>(want), 0);
    if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      result = Moved::kBlocked;
      break;
    }
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) {
      failure = {peer,
                 got == 0 ? c10::str("rank ", ranks_[peer],
                                     " closed its connection: its process died or gave up this collective")
                          : c10::str("receiving from rank ", ranks_[peer], " failed: ", errno_text()),
                 ranks_[peer]};
      return Moved::kFailed;
    }
    done += got;
    if (done == kHeaderBytes) {
      const FrameHeader& header = in.header;
      if (header.magic == kNewsMagic) {
        // Another rank failed; the messenger gave up over it (Note [News of a failure]).
        failure = failure_in_news(header, peer, ranks_);
        return Moved::kFailed;
      }
      if (header.magic != kFrameMagic || header.sequence != sequence_ ||
          (header.bytes > static_cast<uint64_t>(recv.capacity) && !recv.drain) ||
          header.bytes < static_cast<uint64_t>(recv.minimum)) {
        failure = {peer, c10::str("rank ", ranks_[peer], " sent a frame of collective ", header.sequence, " with ",
                                  header.bytes, " bytes where collective ", sequence_, " expected ", recv.minimum,
                                  " to ", recv.capacity)};
        return Moved::kFailed;
      }
    }
    in.done.store(done, std::memory_order_release);
    const bool whole = done >= kHeaderBytes && done - kHeaderBytes == static_cast<int64_t>(in.header.bytes);
    const int64_t data = std::min(std::max<int64_t>(0, done - kHeaderBytes), recv.capacity);
    if (recv.on_data && data > in.told && (whole || passed_a_step(in.told, data, recv.step))) {
      in.told = data;
      // On a thread, tell the caller at once, so that it reduces this step while the next arrives.
      if (thread != nullptr) thread->tell_caller();
      news = true;
    }
  }
  return result;
}

bool IncomingFrames::report(size_t i, int64_t sent) {
  Progress& in = progress_[i];
  Links::Recv& recv = recvs_[i];
  if (!recv.on_data) return false;
  const int64_t done = in.done.load(std::memory_order_acquire);
  const int64_t ready = std::min({std::max<int64_t>(0, done - kHeaderBytes), sent, recv.capacity});
  const int64_t whole = done < kHeaderBytes ? -1 : std::min(static_cast<int64_t>(in.header.bytes), recv.capacity);
  const int64_t reported = in.reported.load(std::memory_order_relaxed);  // this thread is its one writer
  if (ready <= reported || (ready != whole && !passed_a_step(reported, ready, recv.step))) return false;
  recv.on_data(ready);
  in.reported.store(ready, std::memory_order_release);
  return true;
}

int64_t IncomingFrames::done_with(size_t i) const {
  const int64_t passed = reported(i);  // after the header: a report needs data
  if (passed > 0 && passed == whole(i)) return passed;
  const int64_t step = recvs_[i].step;
  return step > 0 ? passed / step * step : passed;
}

void IncomingFrames::set_received() const {
  for (size_t i = 0; i < recvs_.size(); ++i) recvs_[i].received = static_cast<int64_t>(progress_[i].header.bytes);
}

}  // namespace ddpkit::comm
