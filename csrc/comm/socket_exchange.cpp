// SocketLinks::exchange: a collective's frames over the socket links, all at once (Note [Socket
// links]), the sends of a large one on the links' sending thread (Note [A thread for sending]).

#include "comm/socket_links.h"

#include "comm/call_timeout.h"
#include "comm/communicator.h"
#include "comm/send_thread.h"
#include "comm/socket_io.h"

#include <ATen/ThreadLocalState.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <memory>
#include <optional>
#include <utility>

namespace ddpkit::comm {

using namespace socket_io;

namespace {

constexpr auto kHeaderBytes = static_cast<int64_t>(sizeof(FrameHeader));

// How long a rank that gives up spends finishing its frames cut halfway and sending the news
// (Note [News of a failure]), within the exchange's deadline.
constexpr std::chrono::seconds kNewsWithin{1};

// Why a frame could not go on: `peer` failed (it closed, a send failed), or, with `peer` -1, this
// rank's own prepare() raised.
struct SendFailure {
  int peer = -1;
  std::string why;
};

enum class Sent { kDone, kBlocked, kFailed };

}  // namespace

// One call of exchange(): its frames' progress, and the ways it gives up.
class SocketLinks::Exchange {
 public:
  Exchange(SocketLinks& links, uint64_t sequence, std::vector<Send> sends, std::vector<Recv>& recvs);
  // Moves every frame; on the links' sending thread (Note [A thread for sending]) with `sender`.
  void run(SendThread* sender);

 private:
  struct Outgoing {
    FrameHeader header{};
    // Bytes of header, first and second sent: written by whichever thread runs send_some, read by
    // the other (the caller's on_data) with acquire.
    std::atomic<int64_t> done{0};
    int64_t prepared = 0;          // data bytes prepare() has made (all of them without prepare)
  };
  struct Incoming {
    FrameHeader header{};
    int64_t done = 0;      // bytes of header and data received
    int64_t reported = 0;  // data bytes passed to on_data
  };

  int64_t send_total(size_t i) const { return kHeaderBytes + static_cast<int64_t>(outgoing_[i].header.bytes); }
  bool sent(size_t i) const { return outgoing_[i].done.load(std::memory_order_acquire) == send_total(i); }
  int64_t recv_total(size_t i) const {
    return incoming_[i].done < kHeaderBytes ? kHeaderBytes + 1
                                            : kHeaderBytes + static_cast<int64_t>(incoming_[i].header.bytes);
  }
  // Sends as much of frame `i` as its socket takes now (prepare()-ing it as it goes), or, on the
  // sending thread, until the caller asks it to stop; on failure says why in `failure`. Whichever
  // thread sends runs it.
  Sent send_some(size_t i, SendFailure& failure);
  // Receives as much of frame `i` as its socket holds now and reports what is ready to on_data;
  // true once the whole frame is in. Gives up (raising) on a failure.
  bool receive_some(size_t i);
  // The sending thread's job: every frame, until done, failed or stopped.
  void send_on_thread(const at::ThreadLocalState& caller) noexcept;
  // Sends the rest of frame `i`, cut halfway, by `until`; false when it cannot.
  bool finish(size_t i, Clock::time_point until) noexcept;
  // Gives up this exchange over `peer`'s failure (-1: this rank's own), cutting off the peers whose
  // frame from this rank stopped halfway. With `failed_rank` (a rank of the caller's group, or -1),
  // tells every other peer first that it failed (Note [News of a failure]).
  [[noreturn]] void give_up(int peer, const std::string& why, int64_t failed_rank = -1);
  // Gives up over `peer`'s failure, telling the others.
  [[noreturn]] void peer_failed(int peer, const std::string& why) { give_up(peer, why, links_.group_ranks_[peer]); }
  [[noreturn]] void failed_sending(const SendFailure& failure) {
    if (failure.peer < 0) give_up(-1, failure.why);
    peer_failed(failure.peer, failure.why);
  }
  // The first peer whose frame this rank still waits to send or receive, or -1.
  int waiting_peer() const;

  SocketLinks& links_;
  const uint64_t sequence_;
  const std::vector<Send> sends_;
  std::vector<Recv>& recvs_;
  std::unique_ptr<Outgoing[]> outgoing_;
  std::vector<Incoming> incoming_;
  const Clock::time_point deadline_;
  SendThread* sender_ = nullptr;  // while the sends are the thread's
  bool gated_ = false;            // an on_data waits for the frame sent to its peer
  std::atomic<bool> sends_finished_{false};
  std::atomic<bool> send_failed_{false};
  SendFailure send_failure_;  // the thread's, written before send_failed_
};

SocketLinks::Exchange::Exchange(SocketLinks& links, uint64_t sequence, std::vector<Send> sends,
                                std::vector<Recv>& recvs)
    : links_(links),
      sequence_(sequence),
      sends_(std::move(sends)),
      recvs_(recvs),
      outgoing_(new Outgoing[sends_.size()]),
      incoming_(recvs.size()),
      deadline_(Clock::now() + call_timeout_or(links.timeout_)) {
  // One frame per peer and direction: two would interleave on the one stream.
  std::vector<char> sending(links_.fds_.size(), 0), receiving(links_.fds_.size(), 0);
  for (size_t i = 0; i < sends_.size(); ++i) {
    const Send& send = sends_[i];
    TORCH_INTERNAL_ASSERT(send.peer != links_.rank_ && links_.fds_.at(send.peer) >= 0 && !sending[send.peer]++);
    TORCH_INTERNAL_ASSERT(!send.prepare || (send.second_bytes == 0 && send.prepare_step > 0));
    outgoing_[i].header = {kFrameMagic, sequence, static_cast<uint64_t>(send.first_bytes + send.second_bytes)};
    outgoing_[i].prepared = send.prepare ? 0 : send.first_bytes + send.second_bytes;
    note_message_sent(send.first_bytes + send.second_bytes);
  }
  for (Recv& recv : recvs_) {
    TORCH_INTERNAL_ASSERT(recv.peer != links_.rank_ && links_.fds_.at(recv.peer) >= 0 && !receiving[recv.peer]++);
    recv.received = 0;
    gated_ = gated_ || (recv.on_data && sending[recv.peer]);
  }
}

Sent SocketLinks::Exchange::send_some(size_t i, SendFailure& failure) {
  Outgoing& out = outgoing_[i];
  const Send& send = sends_[i];
  const int fd = links_.fds_[send.peer];
  int64_t done = out.done.load(std::memory_order_relaxed);  // this thread is its one writer
  while (done < send_total(i)) {
    if (sender_ != nullptr && sender_->stop_requested()) return Sent::kBlocked;
    const int64_t data_sent = std::max<int64_t>(0, done - kHeaderBytes);
    if (send.prepare && out.prepared <= data_sent && out.prepared < send.first_bytes) {
      out.prepared = std::min(send.first_bytes, out.prepared + send.prepare_step);
      try {
        send.prepare(out.prepared);
      } catch (const std::exception& e) {
        failure = {-1, e.what()};
        return Sent::kFailed;
      } catch (...) {
        failure = {-1, "preparing a frame failed"};
        return Sent::kFailed;
      }
    }
    iovec parts[3];
    int count = 0;
    int64_t skip = done;
    auto add = [&](const void* data, int64_t bytes) {
      if (skip >= bytes) {
        skip -= bytes;
        return;
      }
      parts[count++] = {const_cast<char*>(static_cast<const char*>(data)) + skip, static_cast<size_t>(bytes - skip)};
      skip = 0;
    };
    add(&out.header, kHeaderBytes);
    add(send.first, send.prepare ? out.prepared : send.first_bytes);  // never past what is prepared
    add(send.second, send.second_bytes);
    msghdr message{};
    message.msg_iov = parts;
    message.msg_iovlen = count;
    const ssize_t written = ::sendmsg(fd, &message, MSG_NOSIGNAL);
    if (written < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return Sent::kBlocked;
    if (written < 0 && errno == EINTR) continue;
    if (written < 0) {
      failure = {send.peer, c10::str("sending to rank ", links_.group_ranks_[send.peer], " failed: ", errno_text())};
      return Sent::kFailed;
    }
    done += written;
    out.done.store(done, std::memory_order_release);
  }
  return Sent::kDone;
}

bool SocketLinks::Exchange::receive_some(size_t i) {
  Incoming& in = incoming_[i];
  Recv& recv = recvs_[i];
  const int peer = recv.peer;
  const std::vector<int>& ranks = links_.group_ranks_;
  while (in.done < recv_total(i)) {
    char* into = in.done < kHeaderBytes ? reinterpret_cast<char*>(&in.header) + in.done
                                        : static_cast<char*>(recv.data) + (in.done - kHeaderBytes);
    const int64_t want = in.done < kHeaderBytes ? kHeaderBytes - in.done : recv_total(i) - in.done;
    const ssize_t got = ::recv(links_.fds_[peer], into, static_cast<size_t>(want), 0);
    if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
    if (got < 0 && errno == EINTR) continue;
    if (got == 0) {
      peer_failed(peer,
                  c10::str("rank ", ranks[peer], " closed its connection: its process died or gave up this collective"));
    }
    if (got < 0) peer_failed(peer, c10::str("receiving from rank ", ranks[peer], " failed: ", errno_text()));
    in.done += got;
    if (in.done == kHeaderBytes) {
      const FrameHeader& header = in.header;
      if (header.magic == kNewsMagic) {
        // Another rank failed; the messenger gave up over it (Note [News of a failure]).
        const auto failed = static_cast<int64_t>(header.bytes);
        const auto known = std::find(ranks.begin(), ranks.end(), failed);
        const int about = known == ranks.end() ? peer : static_cast<int>(known - ranks.begin());
        give_up(about, c10::str("rank ", failed, " failed or died (rank ", ranks[peer], " reported it)"), failed);
      }
      if (header.magic != kFrameMagic || header.sequence != sequence_ ||
          header.bytes > static_cast<uint64_t>(recv.capacity) || header.bytes < static_cast<uint64_t>(recv.minimum)) {
        give_up(peer, c10::str("rank ", ranks[peer], " sent a frame of collective ", header.sequence, " with ",
                               header.bytes, " bytes where collective ", sequence_, " expected ", recv.minimum, " to ",
                               recv.capacity));
      }
    }
  }
  if (recv.on_data) {
    int64_t ready = std::max<int64_t>(0, in.done - kHeaderBytes);
    const int64_t total = in.done < kHeaderBytes ? -1 : static_cast<int64_t>(in.header.bytes);
    for (size_t j = 0; j < sends_.size(); ++j) {
      if (sends_[j].peer == peer) {
        ready = std::min(ready, std::max<int64_t>(0, outgoing_[j].done.load(std::memory_order_acquire) - kHeaderBytes));
      }
    }
    if (ready > in.reported && (ready == total || ready - in.reported >= recv.step)) {
      try {
        recv.on_data(ready);
      } catch (const std::exception& e) {
        give_up(peer, e.what());  // the frame is only partly read: the stream cannot go on
      }
      in.reported = ready;
    }
  }
  if (in.done < recv_total(i)) return false;
  recv.received = static_cast<int64_t>(in.header.bytes);
  return true;
}

void SocketLinks::Exchange::send_on_thread(const at::ThreadLocalState& caller) noexcept {
  try {
    const at::ThreadLocalStateGuard state(caller);  // prepare() runs tensor ops in the caller's modes
    std::vector<pollfd> waiting;
    while (!sender_->stop_requested()) {
      waiting.clear();
      bool moved = false;
      for (size_t i = 0; i < sends_.size(); ++i) {
        const int64_t before = outgoing_[i].done.load(std::memory_order_relaxed);
        if (before == send_total(i)) continue;
        const Sent result = send_some(i, send_failure_);
        if (result == Sent::kFailed) {
          send_failed_.store(true, std::memory_order_release);
          return;
        }
        moved = moved || outgoing_[i].done.load(std::memory_order_relaxed) > before;
        if (result == Sent::kBlocked) waiting.push_back({links_.fds_[sends_[i].peer], POLLOUT, 0});
      }
      if (waiting.empty()) {
        sends_finished_.store(true, std::memory_order_release);
        return;
      }
      if (gated_ && moved) sender_->tell_caller();
      waiting.push_back({sender_->stop_fd(), POLLIN, 0});
      // No deadline here: the caller keeps the exchange's, and stops this job when it passes.
      if (::poll(waiting.data(), waiting.size(), -1) < 0 && errno != EINTR) {
        send_failure_ = {-1, c10::str("poll failed: ", errno_text())};
        send_failed_.store(true, std::memory_order_release);
        return;
      }
    }
  } catch (const std::exception& e) {
    send_failure_ = {-1, e.what()};
    send_failed_.store(true, std::memory_order_release);
  } catch (...) {
    send_failure_ = {-1, "the sending thread failed"};
    send_failed_.store(true, std::memory_order_release);
  }
}

bool SocketLinks::Exchange::finish(size_t i, Clock::time_point until) noexcept {
  const Send& send = sends_[i];
  Outgoing& out = outgoing_[i];
  try {
    if (send.prepare && out.prepared < send.first_bytes) send.prepare(send.first_bytes);
    const std::string whom = c10::str("rank ", links_.group_ranks_[send.peer]);
    int64_t skip = out.done.load(std::memory_order_acquire);
    for (auto [data, bytes] : {std::pair<const void*, int64_t>{&out.header, kHeaderBytes},
                               {send.first, send.first_bytes},
                               {send.second, send.second_bytes}}) {
      if (skip < bytes) {
        write_all(links_.fds_[send.peer], static_cast<const char*>(data) + skip, static_cast<size_t>(bytes - skip),
                  until, whom);
      }
      skip = std::max<int64_t>(0, skip - bytes);
    }
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

void SocketLinks::Exchange::give_up(int peer, const std::string& why, int64_t failed_rank) {
  if (sender_ != nullptr) sender_->stop();  // the frames' progress is this thread's again
  std::vector<int> cut_off;
  const Clock::time_point until = std::min(deadline_, Clock::now() + kNewsWithin);
  for (size_t i = 0; i < sends_.size(); ++i) {
    const int64_t done = outgoing_[i].done.load(std::memory_order_acquire);
    const bool halfway = done > 0 && done < send_total(i);
    if (halfway && (failed_rank < 0 || sends_[i].peer == peer || !finish(i, until))) cut_off.push_back(sends_[i].peer);
  }
  if (failed_rank >= 0) {
    const FrameHeader news{kNewsMagic, sequence_, static_cast<uint64_t>(failed_rank)};
    for (int other = 0; other < links_.size(); ++other) {
      if (other == links_.rank_ || other == peer || links_.fds_[other] < 0 ||
          std::find(cut_off.begin(), cut_off.end(), other) != cut_off.end())
        continue;
      try {
        write_all(links_.fds_[other], &news, sizeof(news), until, c10::str("rank ", links_.group_ranks_[other]));
      } catch (const std::exception&) {
      }
    }
  }
  links_.fail(peer, why, cut_off);
}

int SocketLinks::Exchange::waiting_peer() const {
  for (size_t i = 0; i < sends_.size(); ++i) {
    if (!sent(i)) return sends_[i].peer;
  }
  for (size_t i = 0; i < recvs_.size(); ++i) {
    if (incoming_[i].done < recv_total(i)) return recvs_[i].peer;
  }
  return -1;
}

void SocketLinks::Exchange::run(SendThread* sender) {
  // Stops the thread's job however this call ends, since the job works on this Exchange; declared
  // after `caller`, which the job reads, so that it runs first.
  std::optional<at::ThreadLocalState> caller;
  struct StopOnExit {
    SendThread*& thread;
    ~StopOnExit() {
      if (thread != nullptr) thread->stop();
    }
  } stop_on_exit{sender_};
  if (sender != nullptr) {
    caller.emplace();
    sender_ = sender;  // before the job starts: it reads it
    try {
      sender->start([this, &caller] { send_on_thread(*caller); });
    } catch (const std::exception&) {
      sender_ = nullptr;  // no thread could be made (out of threads or memory): the sends stay here
    }
  }
  const bool threaded = sender_ != nullptr;
  std::vector<pollfd> waiting;
  while (true) {
    // Read before the receives report: the last report then sees every byte sent.
    const bool sending = threaded && !sends_finished_.load(std::memory_order_acquire);
    if (threaded && send_failed_.load(std::memory_order_acquire)) {
      sender_->wait();
      failed_sending(send_failure_);
    }
    waiting.clear();
    for (size_t i = 0; i < sends_.size() && !threaded; ++i) {
      SendFailure failure;
      const Sent result = send_some(i, failure);
      if (result == Sent::kFailed) failed_sending(failure);
      if (result == Sent::kBlocked) waiting.push_back({links_.fds_[sends_[i].peer], POLLOUT, 0});
    }
    for (size_t i = 0; i < recvs_.size(); ++i) {
      if (!receive_some(i)) waiting.push_back({links_.fds_[recvs_[i].peer], POLLIN, 0});
    }
    if (waiting.empty() && !sending) break;
    if (threaded) waiting.push_back({sender_->news_fd(), POLLIN, 0});
    const int ready = ::poll(waiting.data(), waiting.size(), remaining_ms(deadline_));
    if (ready < 0 && errno == EINTR) continue;
    if (ready < 0) give_up(-1, c10::str("poll failed: ", errno_text()));
    if (ready == 0) {
      if (threaded) sender_->stop();
      const int peer = waiting_peer();
      if (peer >= 0) {
        peer_failed(peer, c10::str("timed out after ", call_timeout_or(links_.timeout_).count(),
                                   " ms waiting for rank ", links_.group_ranks_[peer]));
      }
      continue;  // the thread sent the last bytes as the deadline passed: the last report is left
    }
    if (threaded && waiting.back().revents != 0) sender_->clear_news();
  }
  if (threaded) sender_->wait();
}

void SocketLinks::exchange(uint64_t sequence, std::vector<Send> sends, std::vector<Recv>& recvs) {
  if (!broken_.empty()) {
    shut_down();  // so that no peer waits for this rank's frames
    TORCH_CHECK(false, "the links across hosts broke in an earlier collective: ", broken_);
  }
  int64_t sent_bytes = 0;
  for (const Send& send : sends) sent_bytes += send.first_bytes + send.second_bytes;
  bool threaded = thread_bytes_ > 0 && sent_bytes >= thread_bytes_ && !recvs.empty();
  if (threaded && !sender_) {
    try {
      sender_ = std::make_unique<SendThread>();
    } catch (const std::exception&) {
      threaded = false;  // no eventfd: the sends stay on the caller's thread
    }
  }
  Exchange(*this, sequence, std::move(sends), recvs).run(threaded ? sender_.get() : nullptr);
}

}  // namespace ddpkit::comm
