#include "comm/links/outgoing_frames.h"

#include "comm/core/counters.h"
#include "comm/links/link_thread.h"

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <sys/socket.h>
#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <string>
#include <utility>

namespace ddpkit::comm {

using namespace socket_io;

OutgoingFrames::OutgoingFrames(std::vector<Links::Send>&& sends, uint64_t sequence, const std::vector<Fd>& fds,
                               const std::vector<int>& ranks, bool reports_wait)
    : sends_(std::move(sends)),
      fds_(fds),
      ranks_(ranks),
      reports_wait_(reports_wait),
      progress_(new Progress[sends_.size()]),
      earlier_(sends_.size(), -1) {
  for (size_t i = 0; i < sends_.size(); ++i) {
    for (size_t j = i; j-- > 0;) {
      if (sends_[j].peer == sends_[i].peer) {
        earlier_[i] = static_cast<int>(j);
        break;
      }
    }
    const Links::Send& send = sends_[i];
    progress_[i].header = {kFrameMagic, sequence, static_cast<uint64_t>(send.first_bytes + send.second_bytes)};
    progress_[i].prepared = send.prepare ? 0 : send.first_bytes + send.second_bytes;
    note_message_sent(send.first_bytes + send.second_bytes);
  }
}

Moved OutgoingFrames::send_some(size_t i, int64_t sendable, const LinkThread* thread, Failure& failure, bool& news) {
  Progress& out = progress_[i];
  const Links::Send& send = sends_[i];
  const int fd = fds_[send.peer].get();
  if (earlier_[i] >= 0 && !sent(earlier_[i])) return Moved::kQueued;
  const int64_t until = may_go(i, sendable);
  int64_t done = out.done.load(std::memory_order_relaxed);  // this thread is its one writer
  while (done < total(i)) {
    if (thread != nullptr && thread->stop_requested()) return Moved::kBlocked;
    if (done >= until) return Moved::kFull;
    const int64_t data_sent = std::max<int64_t>(0, done - kHeaderBytes);
    if (send.prepare && out.prepared <= data_sent && out.prepared < send.first_bytes) {
      out.prepared = std::min(send.first_bytes, out.prepared + send.prepare_step);
      try {
        send.prepare(out.prepared);
      } catch (const std::exception& e) {
        failure = {-1, e.what()};
        return Moved::kFailed;
      } catch (...) {
        failure = {-1, "preparing a frame failed"};
        return Moved::kFailed;
      }
    }
    iovec parts[3];
    int count = 0;
    int64_t skip = done;
    int64_t left = until - done;
    auto add = [&](const void* data, int64_t bytes) {
      if (skip >= bytes) {
        skip -= bytes;
        return;
      }
      const int64_t taken = std::min(bytes - skip, left);
      if (taken > 0)
        parts[count++] = {const_cast<char*>(static_cast<const char*>(data)) + skip, static_cast<size_t>(taken)};
      left -= taken;
      skip = 0;
    };
    add(&out.header, kHeaderBytes);
    add(send.first, send.prepare ? out.prepared : send.first_bytes);  // never past what is prepared
    add(send.second, send.second_bytes);
    msghdr message{};
    message.msg_iov = parts;
    message.msg_iovlen = count;
    const ssize_t written = ::sendmsg(fd, &message, MSG_NOSIGNAL);
    if (written < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return Moved::kBlocked;
    if (written < 0 && errno == EINTR) continue;
    if (written < 0) {
      failure = {send.peer, c10::str("sending to rank ", ranks_[send.peer], " failed: ", errno_text()),
                 ranks_[send.peer]};
      return Moved::kFailed;
    }
    done += written;
    out.done.store(done, std::memory_order_release);
    news = news || reports_wait_;
  }
  return Moved::kDone;
}

bool OutgoingFrames::finish(size_t i, Clock::time_point until) noexcept {
  const Links::Send& send = sends_[i];
  Progress& out = progress_[i];
  try {
    if (send.prepare && out.prepared < send.first_bytes) send.prepare(send.first_bytes);
    const std::string whom = c10::str("rank ", ranks_[send.peer]);
    int64_t skip = out.done.load(std::memory_order_acquire);
    for (auto [data, bytes] : {std::pair<const void*, int64_t>{&out.header, kHeaderBytes},
                               {send.first, send.first_bytes},
                               {send.second, send.second_bytes}}) {
      if (skip < bytes) {
        write_all(fds_[send.peer].get(), static_cast<const char*>(data) + skip, static_cast<size_t>(bytes - skip),
                  until, whom);
      }
      skip = std::max<int64_t>(0, skip - bytes);
    }
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

}  // namespace ddpkit::comm
