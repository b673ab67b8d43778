// SocketLinks::exchange: a collective's frames over the socket links, all at once (Note [Socket
// links]), a large exchange's sends and receives on the links' threads (Note [Threads of the links]).
// Its parts each own one job: OutgoingFrames sends, IncomingFrames receives and reports, and the
// Exchange here runs them, on the caller's thread or the links' threads, keeps the deadline and gives
// up for all of them.

#include "comm/links/socket_links.h"

#include "comm/core/call_timeout.h"
#include "comm/links/incoming_frames.h"
#include "comm/links/link_thread.h"
#include "comm/links/outgoing_frames.h"
#include "comm/links/socket_io.h"

#include <ATen/ThreadLocalState.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <limits>
#include <new>
#include <optional>
#include <system_error>
#include <utility>

namespace ddpkit::comm {

using namespace socket_io;

namespace {

// How long a rank that gives up spends finishing its frames cut halfway and sending the news
// (Note [News of a failure]), within the exchange's deadline.
constexpr std::chrono::seconds kNewsWithin{1};

// Whether an on_data waits for a frame sent to its peer; checks the rules of Links::exchange: where
// a report waits for a send, one frame per peer each way and none that follows another (each could
// wait for the other), a followed frame's conditions, and a window's (Note [Receiving windows]).
bool reports_wait_for_sends(const std::vector<Links::Send>& sends, const std::vector<Links::Recv>& recvs,
                            const std::vector<Fd>& fds, int rank) {
  std::vector<int> sending(fds.size(), 0), receiving(fds.size(), 0);
  bool following = false;
  for (const Links::Send& send : sends) {
    TORCH_INTERNAL_ASSERT(send.peer != rank && fds.at(send.peer).get() >= 0);
    ++sending[send.peer];
    TORCH_INTERNAL_ASSERT(!send.prepare || (send.second_bytes == 0 && send.prepare_step > 0));
    if (send.follows >= 0) {
      following = true;
      const Links::Recv& followed = recvs.at(send.follows);
      TORCH_INTERNAL_ASSERT(followed.on_data && followed.step > 0 && !followed.drain && !send.prepare &&
                            send.second_bytes == 0 && send.first_bytes <= followed.minimum);
    }
  }
  bool wait = false, several = following;
  for (const Links::Recv& recv : recvs) {
    TORCH_INTERNAL_ASSERT(recv.peer != rank && fds.at(recv.peer).get() >= 0);
    several = several || ++receiving[recv.peer] > 1 || sending[recv.peer] > 1;
    wait = wait || (recv.on_data && sending[recv.peer]);
    // A window is emptied by reports alone: a report that waited for a send could wait forever.
    TORCH_INTERNAL_ASSERT(recv.window == 0 || (recv.on_data && recv.step > 0 && recv.window % recv.step == 0 &&
                                               !sending[recv.peer] && !recv.drain));
  }
  TORCH_INTERNAL_ASSERT(!(wait && several));
  return wait;
}

}  // namespace

// One call of exchange(): its frames, the threads that move them, and the ways it gives up.
class SocketLinks::Exchange {
 public:
  Exchange(SocketLinks& links, uint64_t sequence, std::vector<Send> sends, std::vector<Recv>& recvs)
      : links_(links),
        sequence_(sequence),
        outgoing_(std::move(sends), sequence, links.fds_, links.group_ranks_,
                  reports_wait_for_sends(sends, recvs, links.fds_, links.rank_)),
        incoming_(recvs, sequence, links.fds_, links.group_ranks_),
        deadline_(Clock::now() + call_timeout_or(links.timeout_)) {}
  // Moves every frame: the sends on `sender` and the receives on `receiver` where not null (Note
  // [Threads of the links]), the rest on this thread, which keeps the deadline and reports data.
  void run(LinkThread* sender, LinkThread* receiver);

 private:
  // One direction's job on a thread, and whether it failed (it returns when done, failed or stopped).
  struct Direction {
    LinkThread* thread = nullptr;  // null: the caller's thread moves it
    std::atomic<bool> failed{false};
    Failure failure;  // written before `failed`
  };

  // Passes what is ready of received frame `i` to its on_data (the caller's thread); true when it
  // passed more.
  bool report(size_t i);
  // The data bytes of sent frame `i` that may go now (Links::Send::follows).
  int64_t sendable(size_t i) const {
    const int followed = outgoing_.follows(i);
    return followed < 0 ? std::numeric_limits<int64_t>::max() : incoming_.done_with(followed);
  }
  // A thread's job: every frame of its direction, until done, failed or stopped.
  void move_on_thread(Direction& direction, bool sending, const at::ThreadLocalState& caller) noexcept;
  // Hands `direction` to `thread`; false, leaving it to the caller, when the thread cannot start.
  bool start(Direction& direction, LinkThread* thread, bool sending, const at::ThreadLocalState* caller);
  // Stops the threads' jobs: the frames' progress is this thread's again.
  void stop_threads() noexcept;
  // Gives up this exchange over `failure`, cutting off the peers whose frame from this rank stopped
  // halfway and telling every other peer which rank failed, where it names one.
  [[noreturn]] void give_up(const Failure& reported);
  // `failure`, or, where its peer gave up first and left news of the rank that failed on a stream this
  // exchange does not read (Note [News of a failure]), that news: a send to a peer that hung up after
  // telling this rank names the rank that failed, not the messenger.
  Failure news_behind(const Failure& failure) const;
  [[noreturn]] void give_up(int peer, const std::string& why) { give_up(Failure{peer, why, -1}); }
  // The first peer whose frame this rank still waits to send or receive, or -1: a send that waits
  // for what this rank has yet to receive waits for that receive's peer.
  int waiting_peer() const;

  SocketLinks& links_;
  const uint64_t sequence_;
  OutgoingFrames outgoing_;
  IncomingFrames incoming_;
  const Clock::time_point deadline_;
  Direction sending_;
  Direction receiving_;
};

bool SocketLinks::Exchange::report(size_t i) {
  int64_t sent = std::numeric_limits<int64_t>::max();
  for (size_t j = 0; j < outgoing_.size(); ++j) {
    // Past the end of a frame sent whole, nothing received can overwrite what it sent (the two
    // frames may differ in length: blocks of a balanced split).
    if (outgoing_.peer(j) == incoming_.peer(i) && !outgoing_.sent(j)) sent = std::min(sent, outgoing_.data_sent(j));
  }
  bool reported = false;
  try {
    reported = incoming_.report(i, sent);
  } catch (const std::exception& e) {
    give_up(incoming_.peer(i), e.what());  // the frame is only partly read: the stream cannot go on
  }
  if (!reported) return false;
  // Room in the window, or a later frame's turn: a receiving thread that found either waits for this.
  if ((incoming_.windowed(i) || incoming_.queues_behind(i)) && receiving_.thread != nullptr) {
    receiving_.thread->tell_job();
  }
  // More to forward: a sending thread that found nothing left to send waits for this.
  for (size_t j = 0; j < outgoing_.size() && sending_.thread != nullptr; ++j) {
    if (outgoing_.follows(j) == static_cast<int>(i)) {
      sending_.thread->tell_job();
      break;
    }
  }
  return true;
}

void SocketLinks::Exchange::move_on_thread(Direction& direction, bool sending,
                                           const at::ThreadLocalState& caller) noexcept {
  auto fail = [&direction](std::string why) {
    direction.failure = {-1, std::move(why), -1};
    direction.failed.store(true, std::memory_order_release);
  };
  try {
    const at::ThreadLocalStateGuard state(caller);  // prepare() runs tensor ops in the caller's modes
    const size_t count = sending ? outgoing_.size() : incoming_.size();
    std::vector<pollfd> waiting;
    // A frame that waits for the caller's reports (a full window, Note [Receiving windows], a frame
    // behind one not reported whole, a send that forwards reported data): their news is emptied
    // before the reports are read again, so that none after that read is lost.
    bool full = false;
    while (!direction.thread->stop_requested()) {
      if (full) direction.thread->clear_job_news();
      waiting.clear();
      bool news = false;
      full = false;
      for (size_t i = 0; i < count; ++i) {
        if (sending ? outgoing_.sent(i) : incoming_.received(i)) continue;
        const Moved result = sending ? outgoing_.send_some(i, sendable(i), direction.thread, direction.failure, news)
                                     : incoming_.receive_some(i, direction.thread, direction.failure, news);
        if (result == Moved::kFailed) {
          direction.failed.store(true, std::memory_order_release);
          return;
        }
        if (result == Moved::kBlocked) {
          waiting.push_back(
              {sending ? outgoing_.fd(i) : incoming_.fd(i), static_cast<short>(sending ? POLLOUT : POLLIN), 0});
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

void SocketLinks::Exchange::give_up(const Failure& reported) {
  stop_threads();
  const Failure failure = news_behind(reported);
  const int peer = failure.peer;
  std::vector<int> cut_off;
  const Clock::time_point until = std::min(deadline_, Clock::now() + kNewsWithin);
  for (size_t i = 0; i < outgoing_.size(); ++i) {
    if (outgoing_.halfway(i) && (failure.failed_rank < 0 || outgoing_.peer(i) == peer || !outgoing_.finish(i, until))) {
      cut_off.push_back(outgoing_.peer(i));
    }
  }
  if (failure.failed_rank >= 0) {
    const FrameHeader news{kNewsMagic, sequence_, static_cast<uint64_t>(failure.failed_rank)};
    for (int other = 0; other < links_.size(); ++other) {
      if (other == links_.rank_ || other == peer || links_.fds_[other].get() < 0 ||
          std::find(cut_off.begin(), cut_off.end(), other) != cut_off.end())
        continue;
      try {
        write_all(links_.fds_[other].get(), &news, sizeof(news), until, c10::str("rank ", links_.group_ranks_[other]));
      } catch (const std::exception&) {
      }
    }
  }
  links_.fail(peer, failure.why, cut_off);
}

Failure SocketLinks::Exchange::news_behind(const Failure& failure) const {
  // Only a stream this exchange does not read from: elsewhere the next bytes are a frame's.
  const int peer = failure.peer;
  if (peer < 0 || peer == links_.rank_ || links_.fds_[peer].get() < 0) return failure;
  for (size_t i = 0; i < incoming_.size(); ++i) {
    if (incoming_.peer(i) == peer) return failure;
  }
  FrameHeader news{};
  const ssize_t got = ::recv(links_.fds_[peer].get(), &news, sizeof(news), MSG_PEEK | MSG_DONTWAIT);
  if (got != static_cast<ssize_t>(sizeof(news)) || news.magic != kNewsMagic) return failure;
  return failure_in_news(news, peer, links_.group_ranks_);
}

int SocketLinks::Exchange::waiting_peer() const {
  for (size_t i = 0; i < outgoing_.size(); ++i) {
    if (outgoing_.waits_for_peer(i, sendable(i))) return outgoing_.peer(i);
  }
  for (size_t i = 0; i < incoming_.size(); ++i) {
    if (!incoming_.received(i)) return incoming_.peer(i);
  }
  for (size_t i = 0; i < outgoing_.size(); ++i) {
    if (!outgoing_.sent(i)) return outgoing_.peer(i);  // its data is in, the last report to come
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
    for (size_t i = 0; i < outgoing_.size() && threaded_sends; ++i) sending = sending || !outgoing_.sent(i);
    for (size_t i = 0; i < incoming_.size() && threaded_receives; ++i) receiving = receiving || !incoming_.received(i);
    for (Direction* direction : {&sending_, &receiving_}) {
      if (direction->thread != nullptr && direction->failed.load(std::memory_order_acquire)) {
        direction->thread->wait();
        give_up(direction->failure);
      }
    }
    waiting.clear();
    Failure failure;
    bool news = false, full = false, forwarding = false;
    for (size_t i = 0; i < outgoing_.size() && !threaded_sends; ++i) {
      const Moved result = outgoing_.send_some(i, sendable(i), nullptr, failure, news);
      if (result == Moved::kFailed) give_up(failure);
      if (result == Moved::kBlocked) waiting.push_back({outgoing_.fd(i), POLLOUT, 0});
      forwarding = forwarding || result == Moved::kFull;
    }
    for (size_t i = 0; i < incoming_.size() && !threaded_receives; ++i) {
      if (incoming_.received(i)) continue;
      const Moved result = incoming_.receive_some(i, nullptr, failure, news);
      if (result == Moved::kFailed) give_up(failure);
      if (result == Moved::kBlocked) waiting.push_back({incoming_.fd(i), POLLIN, 0});
      full = full || result == Moved::kFull;
    }
    bool reported = false;
    for (size_t i = 0; i < incoming_.size(); ++i) reported = report(i) || reported;
    // The reports just made room, or gave a send waiting for them more to forward: move again before
    // waiting (where they gave nothing, a receive's socket is what the send waits for).
    if (full || (forwarding && reported)) continue;
    if (waiting.empty() && !sending && !receiving) {
      TORCH_INTERNAL_ASSERT(waiting_peer() < 0, "an exchange stopped with frames left to move");
      break;
    }
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
        give_up(Failure{peer,
                        c10::str("timed out after ", call_timeout_or(links_.timeout_).count(), " ms waiting for rank ",
                                 links_.group_ranks_[peer]),
                        links_.group_ranks_[peer]});
      }
      continue;  // the threads moved the last bytes as the deadline passed: the last report is left
    }
    for (size_t k = own; k < waiting.size(); ++k) {
      if (waiting[k].revents != 0) waking[k - own]->clear_news();
    }
  }
  stop_threads();  // their frames are done: this only waits for the jobs to return
  incoming_.set_received();
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
  send_buffers_.before_exchange(sends);
  Exchange(*this, sequence, std::move(sends), recvs).run(sender, receiver);
  send_buffers_.after_exchange();
}

}  // namespace ddpkit::comm
