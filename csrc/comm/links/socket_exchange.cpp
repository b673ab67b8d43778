// SocketLinks::exchange: a collective's frames over the socket links, all at once (Note [Socket
// links]), a large exchange's sends and receives on the links' threads (Note [Threads of the links]).

#include "comm/links/socket_links.h"

#include "comm/core/call_timeout.h"
#include "comm/core/counters.h"
#include "comm/links/link_thread.h"
#include "comm/links/socket_io.h"

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
#include <new>
#include <optional>
#include <system_error>
#include <utility>

namespace ddpkit::comm {

using namespace socket_io;

namespace {

constexpr auto kHeaderBytes = static_cast<int64_t>(sizeof(FrameHeader));

// How long a rank that gives up spends finishing its frames cut halfway and sending the news
// (Note [News of a failure]), within the exchange's deadline.
constexpr std::chrono::seconds kNewsWithin{1};

// Why an exchange gives up: `peer` failed (-1: this rank's own failure), and, with `failed_rank`
// (a rank of the caller's group; -1: none), the rank every other peer is told failed (Note [News
// of a failure]).
struct Failure {
  int peer = -1;
  std::string why;
  int64_t failed_rank = -1;
};

// kFull: the frame's window is full (Note [Receiving windows]) until the caller reports more of it.
enum class Moved { kDone, kBlocked, kFailed, kFull };

// Whether data growing from `from` to `to` bytes passed a multiple of `step` (any growth, for no
// step): receiving thread and caller count steps alike, so that the thread's news is a report's.
bool passed_a_step(int64_t from, int64_t to, int64_t step) { return step > 0 ? to / step > from / step : to > from; }

}  // namespace

// One call of exchange(): its frames' progress, and the ways it gives up.
class SocketLinks::Exchange {
 public:
  Exchange(SocketLinks& links, uint64_t sequence, std::vector<Send> sends, std::vector<Recv>& recvs);
  // Moves every frame: the sends on `sender` and the receives on `receiver` where not null (Note
  // [Threads of the links]), the rest on this thread, which keeps the deadline and reports data.
  void run(LinkThread* sender, LinkThread* receiver);

 private:
  struct Outgoing {
    FrameHeader header{};
    // Bytes of header, first and second sent: written by whichever thread sends, read by the other
    // (the caller's on_data) with acquire.
    std::atomic<int64_t> done{0};
    int64_t prepared = 0;  // data bytes prepare() has made (all of them without prepare)
  };
  struct Incoming {
    FrameHeader header{};  // complete, and checked, before `done` passes it
    // Bytes of header and data received: written by whichever thread receives, read by the other
    // (the caller's reports) with acquire.
    std::atomic<int64_t> done{0};
    // Data bytes passed to on_data: written by the caller, read by the receiving thread with acquire
    // (a window's room).
    std::atomic<int64_t> reported{0};
    int64_t told = 0;  // data bytes the receiving thread woke the caller for (its own)
  };
  // One direction's job on a thread, and whether it failed (it returns when done, failed or stopped).
  struct Direction {
    LinkThread* thread = nullptr;  // null: the caller's thread moves it
    std::atomic<bool> failed{false};
    Failure failure;  // written before `failed`
  };

  int64_t send_total(size_t i) const { return kHeaderBytes + static_cast<int64_t>(outgoing_[i].header.bytes); }
  bool sent(size_t i) const { return outgoing_[i].done.load(std::memory_order_acquire) == send_total(i); }
  // Frame `i`'s bytes with its header once `done` bytes of it are in (a byte more while the header
  // is not).
  int64_t recv_total(size_t i, int64_t done) const {
    return done < kHeaderBytes ? kHeaderBytes + 1 : kHeaderBytes + static_cast<int64_t>(incoming_[i].header.bytes);
  }
  bool received(size_t i) const {
    const int64_t done = incoming_[i].done.load(std::memory_order_acquire);
    return done == recv_total(i, done);
  }
  // Sends as much of frame `i` as its socket takes now (prepare()-ing it as it goes), or, on a
  // thread, until the caller asks it to stop; on failure says why in `failure`. `news`: set when
  // the caller should look (a report waits for this send).
  Moved send_some(size_t i, Failure& failure, bool& news);
  // Receives as much of frame `i` as its socket holds now (kFull once its window is), checking its
  // header, or, on a thread, until the caller asks it to stop; on failure says why in `failure`.
  // `news`: set when another step of data (Recv::step) or the frame's end is in for the caller to
  // report (a thread has told the caller already).
  Moved receive_some(size_t i, Failure& failure, bool& news);
  // Passes what is ready of frame `i` to its on_data (the caller's thread).
  void report(size_t i);
  // A thread's job: every frame of its direction, until done, failed or stopped.
  void move_on_thread(Direction& direction, bool sending, const at::ThreadLocalState& caller) noexcept;
  // Hands `direction` to `thread`; false, leaving it to the caller, when the thread cannot start.
  bool start(Direction& direction, LinkThread* thread, bool sending, const at::ThreadLocalState* caller);
  // Stops the threads' jobs: the frames' progress is this thread's again.
  void stop_threads() noexcept;
  // Sends the rest of frame `i`, cut halfway, by `until`; false when it cannot.
  bool finish(size_t i, Clock::time_point until) noexcept;
  // Gives up this exchange over `failure`, cutting off the peers whose frame from this rank stopped
  // halfway and telling every other peer which rank failed, where it names one.
  [[noreturn]] void give_up(const Failure& failure);
  [[noreturn]] void give_up(int peer, const std::string& why) { give_up(Failure{peer, why, -1}); }
  Failure peer_failed(int peer, std::string why) const { return {peer, std::move(why), links_.group_ranks_[peer]}; }
  // The first peer whose frame this rank still waits to send or receive, or -1.
  int waiting_peer() const;

  SocketLinks& links_;
  const uint64_t sequence_;
  const std::vector<Send> sends_;
  std::vector<Recv>& recvs_;
  std::unique_ptr<Outgoing[]> outgoing_;
  std::unique_ptr<Incoming[]> incoming_;
  const Clock::time_point deadline_;
  bool gated_ = false;  // an on_data waits for the frame sent to its peer
  Direction sending_;
  Direction receiving_;
};

SocketLinks::Exchange::Exchange(SocketLinks& links, uint64_t sequence, std::vector<Send> sends,
                                std::vector<Recv>& recvs)
    : links_(links),
      sequence_(sequence),
      sends_(std::move(sends)),
      recvs_(recvs),
      outgoing_(new Outgoing[sends_.size()]),
      incoming_(new Incoming[recvs.size()]),
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
    // A window is emptied by reports alone: a report that waited for a send could wait forever.
    TORCH_INTERNAL_ASSERT(recv.window == 0 ||
                          (recv.on_data && recv.step > 0 && recv.window % recv.step == 0 && !sending[recv.peer]));
  }
}

Moved SocketLinks::Exchange::send_some(size_t i, Failure& failure, bool& news) {
  Outgoing& out = outgoing_[i];
  const Send& send = sends_[i];
  const int fd = links_.fds_[send.peer];
  int64_t done = out.done.load(std::memory_order_relaxed);  // this thread is its one writer
  while (done < send_total(i)) {
    if (sending_.thread != nullptr && sending_.thread->stop_requested()) return Moved::kBlocked;
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
    if (written < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return Moved::kBlocked;
    if (written < 0 && errno == EINTR) continue;
    if (written < 0) {
      failure = peer_failed(send.peer,
                            c10::str("sending to rank ", links_.group_ranks_[send.peer], " failed: ", errno_text()));
      return Moved::kFailed;
    }
    done += written;
    out.done.store(done, std::memory_order_release);
    news = news || gated_;
  }
  return Moved::kDone;
}

Moved SocketLinks::Exchange::receive_some(size_t i, Failure& failure, bool& news) {
  Incoming& in = incoming_[i];
  const Recv& recv = recvs_[i];
  const int peer = recv.peer;
  const std::vector<int>& ranks = links_.group_ranks_;
  int64_t done = in.done.load(std::memory_order_relaxed);  // this thread is its one writer
  Moved result = Moved::kDone;
  while (done < recv_total(i, done)) {
    if (receiving_.thread != nullptr && receiving_.thread->stop_requested()) return Moved::kBlocked;
    char* into = reinterpret_cast<char*>(&in.header) + done;
    int64_t want = (done < kHeaderBytes ? kHeaderBytes : recv_total(i, done)) - done;
    if (done >= kHeaderBytes && recv.window == 0) {
      into = static_cast<char*>(recv.data) + (done - kHeaderBytes);
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
    const ssize_t got = ::recv(links_.fds_[peer], into, static_cast<size_t>(want), 0);
    if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      result = Moved::kBlocked;
      break;
    }
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) {
      failure = peer_failed(peer, got == 0 ? c10::str("rank ", ranks[peer],
                                                      " closed its connection: its process died or gave up this "
                                                      "collective")
                                           : c10::str("receiving from rank ", ranks[peer], " failed: ", errno_text()));
      return Moved::kFailed;
    }
    done += got;
    if (done == kHeaderBytes) {
      const FrameHeader& header = in.header;
      if (header.magic == kNewsMagic) {
        // Another rank failed; the messenger gave up over it (Note [News of a failure]).
        const auto failed = static_cast<int64_t>(header.bytes);
        const auto known = std::find(ranks.begin(), ranks.end(), failed);
        const int about = known == ranks.end() ? peer : static_cast<int>(known - ranks.begin());
        failure = {about, c10::str("rank ", failed, " failed or died (rank ", ranks[peer], " reported it)"), failed};
        return Moved::kFailed;
      }
      if (header.magic != kFrameMagic || header.sequence != sequence_ ||
          header.bytes > static_cast<uint64_t>(recv.capacity) || header.bytes < static_cast<uint64_t>(recv.minimum)) {
        failure = {peer, c10::str("rank ", ranks[peer], " sent a frame of collective ", header.sequence, " with ",
                                  header.bytes, " bytes where collective ", sequence_, " expected ", recv.minimum,
                                  " to ", recv.capacity)};
        return Moved::kFailed;
      }
    }
    in.done.store(done, std::memory_order_release);
    const int64_t data = std::max<int64_t>(0, done - kHeaderBytes);
    const bool whole = done >= kHeaderBytes && data == static_cast<int64_t>(in.header.bytes);
    if (recv.on_data && data > in.told && (whole || passed_a_step(in.told, data, recv.step))) {
      in.told = data;
      // On a thread, tell the caller at once, so that it reduces this step while the next arrives.
      if (receiving_.thread != nullptr) receiving_.thread->tell_caller();
      news = true;
    }
  }
  return result;
}

void SocketLinks::Exchange::report(size_t i) {
  Incoming& in = incoming_[i];
  Recv& recv = recvs_[i];
  if (!recv.on_data) return;
  const int64_t done = in.done.load(std::memory_order_acquire);
  int64_t ready = std::max<int64_t>(0, done - kHeaderBytes);
  const int64_t total = done < kHeaderBytes ? -1 : static_cast<int64_t>(in.header.bytes);
  for (size_t j = 0; j < sends_.size(); ++j) {
    if (sends_[j].peer == recv.peer) {
      ready = std::min(ready, std::max<int64_t>(0, outgoing_[j].done.load(std::memory_order_acquire) - kHeaderBytes));
    }
  }
  const int64_t reported = in.reported.load(std::memory_order_relaxed);  // this thread is its one writer
  if (ready > reported && (ready == total || passed_a_step(reported, ready, recv.step))) {
    try {
      recv.on_data(ready);
    } catch (const std::exception& e) {
      give_up(recv.peer, e.what());  // the frame is only partly read: the stream cannot go on
    }
    in.reported.store(ready, std::memory_order_release);
    // Room in the window: a receiving thread that found it full waits for this.
    if (recv.window > 0 && receiving_.thread != nullptr) receiving_.thread->tell_job();
  }
}

void SocketLinks::Exchange::move_on_thread(Direction& direction, bool sending,
                                           const at::ThreadLocalState& caller) noexcept {
  auto fail = [&direction](std::string why) {
    direction.failure = {-1, std::move(why), -1};
    direction.failed.store(true, std::memory_order_release);
  };
  try {
    const at::ThreadLocalStateGuard state(caller);  // prepare() runs tensor ops in the caller's modes
    const size_t count = sending ? sends_.size() : recvs_.size();
    std::vector<pollfd> waiting;
    // A full window waits for the caller's reports to make room (Note [Receiving windows]): their
    // news is emptied before the room is read again, so that none after that read is lost.
    bool full = false;
    while (!direction.thread->stop_requested()) {
      if (full) direction.thread->clear_job_news();
      waiting.clear();
      bool news = false;
      full = false;
      for (size_t i = 0; i < count; ++i) {
        if (sending ? sent(i) : received(i)) continue;
        const Moved result = sending ? send_some(i, direction.failure, news) : receive_some(i, direction.failure, news);
        if (result == Moved::kFailed) {
          direction.failed.store(true, std::memory_order_release);
          return;
        }
        if (result == Moved::kBlocked) {
          waiting.push_back({links_.fds_[sending ? sends_[i].peer : recvs_[i].peer],
                             static_cast<short>(sending ? POLLOUT : POLLIN), 0});
        }
        full = full || result == Moved::kFull;
      }
      if (waiting.empty() && !full) return;                  // done: the thread tells the caller as its job returns
      if (news && sending) direction.thread->tell_caller();  // a receiving thread told at each step
      waiting.push_back({direction.thread->stop_fd(), POLLIN, 0});
      if (full) waiting.push_back({direction.thread->job_news_fd(), POLLIN, 0});
      // No deadline here: the caller keeps the exchange's, and stops this job when it passes.
      if (::poll(waiting.data(), waiting.size(), -1) < 0 && errno != EINTR) {
        return fail(c10::str("poll failed: ", errno_text()));
      }
    }
  } catch (const std::exception& e) {
    fail(e.what());
  } catch (...) {
    fail("a thread of the links failed");
  }
}

bool SocketLinks::Exchange::start(Direction& direction, LinkThread* thread, bool sending,
                                  const at::ThreadLocalState* caller) {
  if (thread == nullptr) return false;
  direction.thread = thread;  // before the job starts: it reads it
  try {
    thread->start([this, &direction, sending, caller] { move_on_thread(direction, sending, *caller); });
    return true;
  } catch (const std::system_error&) {
    direction.thread = nullptr;  // no thread could be made (out of threads)
  } catch (const std::bad_alloc&) {
    direction.thread = nullptr;
  }
  return false;
}

void SocketLinks::Exchange::stop_threads() noexcept {
  for (Direction* direction : {&sending_, &receiving_}) {
    if (direction->thread != nullptr) direction->thread->stop();
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

void SocketLinks::Exchange::give_up(const Failure& failure) {
  stop_threads();
  const int peer = failure.peer;
  std::vector<int> cut_off;
  const Clock::time_point until = std::min(deadline_, Clock::now() + kNewsWithin);
  for (size_t i = 0; i < sends_.size(); ++i) {
    const int64_t done = outgoing_[i].done.load(std::memory_order_acquire);
    const bool halfway = done > 0 && done < send_total(i);
    if (halfway && (failure.failed_rank < 0 || sends_[i].peer == peer || !finish(i, until))) {
      cut_off.push_back(sends_[i].peer);
    }
  }
  if (failure.failed_rank >= 0) {
    const FrameHeader news{kNewsMagic, sequence_, static_cast<uint64_t>(failure.failed_rank)};
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
  links_.fail(peer, failure.why, cut_off);
}

int SocketLinks::Exchange::waiting_peer() const {
  for (size_t i = 0; i < sends_.size(); ++i) {
    if (!sent(i)) return sends_[i].peer;
  }
  for (size_t i = 0; i < recvs_.size(); ++i) {
    if (!received(i)) return recvs_[i].peer;
  }
  return -1;
}

void SocketLinks::Exchange::run(LinkThread* sender, LinkThread* receiver) {
  // Stops the threads' jobs however this call ends, since they work on this Exchange; declared
  // after `caller`, which the jobs read, so that it runs first.
  const std::optional<at::ThreadLocalState> caller =
      sender != nullptr || receiver != nullptr ? std::make_optional<at::ThreadLocalState>() : std::nullopt;
  struct StopOnExit {
    Exchange& exchange;
    ~StopOnExit() { exchange.stop_threads(); }
  } stop_on_exit{*this};
  const at::ThreadLocalState* state = caller ? &*caller : nullptr;
  const bool threaded_sends = start(sending_, sender, /*sending=*/true, state);
  const bool threaded_receives = start(receiving_, receiver, /*sending=*/false, state);
  std::vector<pollfd> waiting;
  std::vector<LinkThread*> waking;  // the thread of each of waiting's last entries
  while (true) {
    // Read before the reports: the last report then sees every byte the threads moved.
    bool sending = false, receiving = false;
    for (size_t i = 0; i < sends_.size() && threaded_sends; ++i) sending = sending || !sent(i);
    for (size_t i = 0; i < recvs_.size() && threaded_receives; ++i) receiving = receiving || !received(i);
    for (Direction* direction : {&sending_, &receiving_}) {
      if (direction->thread != nullptr && direction->failed.load(std::memory_order_acquire)) {
        direction->thread->wait();
        give_up(direction->failure);
      }
    }
    waiting.clear();
    Failure failure;
    bool news = false, full = false;
    for (size_t i = 0; i < sends_.size() && !threaded_sends; ++i) {
      const Moved result = send_some(i, failure, news);
      if (result == Moved::kFailed) give_up(failure);
      if (result == Moved::kBlocked) waiting.push_back({links_.fds_[sends_[i].peer], POLLOUT, 0});
    }
    for (size_t i = 0; i < recvs_.size() && !threaded_receives; ++i) {
      if (received(i)) continue;
      const Moved result = receive_some(i, failure, news);
      if (result == Moved::kFailed) give_up(failure);
      if (result == Moved::kBlocked) waiting.push_back({links_.fds_[recvs_[i].peer], POLLIN, 0});
      full = full || result == Moved::kFull;
    }
    for (size_t i = 0; i < recvs_.size(); ++i) report(i);
    if (full) continue;  // the reports just made room: receive again before waiting
    if (waiting.empty() && !sending && !receiving) break;
    const size_t own = waiting.size();
    waking.clear();
    for (Direction* direction : {&sending_, &receiving_}) {
      if (direction->thread == nullptr) continue;
      waiting.push_back({direction->thread->news_fd(), POLLIN, 0});
      waking.push_back(direction->thread);
    }
    const int ready = ::poll(waiting.data(), waiting.size(), remaining_ms(deadline_));
    if (ready < 0 && errno == EINTR) continue;
    if (ready < 0) give_up(-1, c10::str("poll failed: ", errno_text()));
    if (ready == 0) {
      stop_threads();
      for (Direction* direction : {&sending_, &receiving_}) {
        if (direction->thread != nullptr && direction->failed.load(std::memory_order_acquire)) {
          give_up(direction->failure);  // it failed as the deadline passed: its failure is the news
        }
      }
      const int peer = waiting_peer();
      if (peer >= 0) {
        give_up(peer_failed(peer, c10::str("timed out after ", call_timeout_or(links_.timeout_).count(),
                                           " ms waiting for rank ", links_.group_ranks_[peer])));
      }
      continue;  // the threads moved the last bytes as the deadline passed: the last report is left
    }
    for (size_t k = own; k < waiting.size(); ++k) {
      if (waiting[k].revents != 0) waking[k - own]->clear_news();
    }
  }
  stop_threads();  // their frames are done: this only waits for the jobs to return
  for (size_t i = 0; i < recvs_.size(); ++i) recvs_[i].received = static_cast<int64_t>(incoming_[i].header.bytes);
}

LinkThread* SocketLinks::thread(std::unique_ptr<LinkThread>& slot, const char* name) noexcept {
  if (!slot) {
    try {
      slot = std::make_unique<LinkThread>(name);
    } catch (const std::exception&) {
      return nullptr;  // no eventfd: the caller's thread moves this direction
    }
  }
  return slot.get();
}

void SocketLinks::exchange(uint64_t sequence, std::vector<Send> sends, std::vector<Recv>& recvs) {
  if (!broken_.empty()) {
    shut_down();  // so that no peer waits for this rank's frames
    TORCH_CHECK(false, "the links across hosts broke in an earlier collective: ", broken_);
  }
  // By what it sends: the steps of data send what they receive, and the check's round, which may
  // receive up to a payload per partner, sends little (Note [One round across hosts]).
  int64_t sent_bytes = 0;
  for (const Send& send : sends) sent_bytes += send.first_bytes + send.second_bytes;
  const bool large = threading_.from_bytes > 0 && sent_bytes >= threading_.from_bytes && !recvs.empty();
  LinkThread* sender = large ? thread(send_thread_, "ddpkit-send") : nullptr;
  LinkThread* receiver = large && threading_.receives ? thread(receive_thread_, "ddpkit-recv") : nullptr;
  Exchange(*this, sequence, std::move(sends), recvs).run(sender, receiver);
}

}  // namespace ddpkit::comm
