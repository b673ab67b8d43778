#pragma once
// A thread to which the socket links hand the sending or the receiving of a large exchange (Note
// [Threads of the links] in links/socket_links.h).

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

namespace ddpkit::comm {

// One thread that runs one job at a time for its owner (the caller), with wake-ups that a poll can
// wait on: for the job's poll, stop_fd(), readable once the caller asked the job to stop, and
// job_news_fd(), readable once the caller told the job something (tell_job()); for the caller's
// poll, news_fd(), readable once the job told the caller something (tell_caller()) or returned.
// The thread, named `name` (for top -H and perf), starts with the first job, blocking every signal
// (they are the caller's), and is joined by the destructor.
class LinkThread {
 public:
  // Raises when the eventfds cannot be made. `name`: at most 15 characters.
  explicit LinkThread(const char* name);
  ~LinkThread();
  LinkThread(const LinkThread&) = delete;
  LinkThread& operator=(const LinkThread&) = delete;

  // Runs `job` on the thread and returns at once; raises, with nothing started, when the thread
  // cannot be made. No job may be running (the previous one waited for). `job` must not throw.
  void start(std::function<void()> job);
  // Asks the running job to stop (stop_requested(), stop_fd()) and waits until it returned; returns
  // at once when no job runs. Never raises.
  void stop() noexcept;
  // Waits until the running job returned; returns at once when no job runs.
  void wait() noexcept;

  // For the job: whether the caller asked it to stop, and the descriptor that turns readable then.
  bool stop_requested() const { return stop_.load(std::memory_order_acquire); }
  int stop_fd() const { return stop_fd_; }
  // For the caller: wakes the job's poll on job_news_fd(), after it published what changed; for the
  // job: clear_job_news() empties it (before it looks at what changed, so that no later news is
  // lost).
  void tell_job() noexcept;
  int job_news_fd() const { return job_news_fd_; }
  void clear_job_news() noexcept;
  // For the job: wakes the caller's poll on news_fd().
  void tell_caller() noexcept;
  // For the caller: readable after tell_caller() or a job's return; clear_news() empties it.
  int news_fd() const { return news_fd_; }
  void clear_news() noexcept;

 private:
  // What the caller and the thread share under its mutex. Left undestroyed in a forked child,
  // whose copy may show the parent's thread waiting on it or holding it (Note [Forked children]).
  struct Shared {
    std::mutex mutex;
    std::condition_variable changed;
    std::function<void()> job;  // the job to run; empty while none is waiting
    bool running = false;       // a job was started and has not returned
    bool quit = false;
  };

  void loop();

  std::unique_ptr<Shared> shared_ = std::make_unique<Shared>();
  std::atomic<bool> stop_{false};
  int stop_fd_ = -1;  // eventfds
  int job_news_fd_ = -1;
  int news_fd_ = -1;
  const char* name_;
  uint64_t fork_generation_ = 0;  // the process that started the thread (Note [Forked children])
  std::thread thread_;
};

}  // namespace ddpkit::comm
