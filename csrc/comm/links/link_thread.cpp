#include "comm/links/link_thread.h"

#include "comm/core/fork_guard.h"

#include <c10/util/Exception.h>

#include <pthread.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace ddpkit::comm {
namespace {

void post(int fd) noexcept {
  const uint64_t one = 1;
  while (::write(fd, &one, sizeof(one)) < 0 && errno == EINTR) {
  }
}

void drain(int fd) noexcept {
  uint64_t count = 0;
  while (::read(fd, &count, sizeof(count)) < 0 && errno == EINTR) {
  }
}

}  // namespace

LinkThread::LinkThread(const char* name) : name_(name) {
  for (int* fd : {&stop_fd_, &job_news_fd_, &news_fd_}) {
    *fd = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (*fd >= 0) continue;
    const std::string why = std::strerror(errno);
    for (int made : {stop_fd_, job_news_fd_, news_fd_}) {
      if (made >= 0) ::close(made);
    }
    TORCH_CHECK(false, "eventfd failed: ", why);
  }
}

LinkThread::~LinkThread() {
  if (thread_.joinable() && fork_generation() != fork_generation_) {
    // A forked child: the parent's thread does not exist here.
    thread_.detach();
    (void)shared_.release();
  } else if (thread_.joinable()) {
    stop();
    {
      std::lock_guard<std::mutex> lock(shared_->mutex);
      shared_->quit = true;
    }
    shared_->changed.notify_all();
    thread_.join();
  }
  ::close(stop_fd_);
  ::close(job_news_fd_);
  ::close(news_fd_);
}

void LinkThread::start(std::function<void()> job) {
  Shared& shared = *shared_;
  if (!thread_.joinable()) {
    // Every signal blocked while the thread is made, so that it inherits the mask: process signals
    // reach the caller's threads, as before the links had one.
    sigset_t all, previous;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &previous);
    try {
      thread_ = std::thread([this] {
        ::pthread_setname_np(::pthread_self(), name_);
        loop();
      });
    } catch (...) {
      pthread_sigmask(SIG_SETMASK, &previous, nullptr);
      throw;
    }
    pthread_sigmask(SIG_SETMASK, &previous, nullptr);
    fork_generation_ = fork_generation();
  }
  {
    std::lock_guard<std::mutex> lock(shared.mutex);
    TORCH_INTERNAL_ASSERT(!shared.running, "a LinkThread runs one job at a time");
    stop_.store(false, std::memory_order_release);
    drain(stop_fd_);
    drain(job_news_fd_);
    drain(news_fd_);
    shared.job = std::move(job);
    shared.running = true;
  }
  shared.changed.notify_all();
}

void LinkThread::stop() noexcept {
  {
    std::lock_guard<std::mutex> lock(shared_->mutex);
    if (!shared_->running) return;
    stop_.store(true, std::memory_order_release);
  }
  post(stop_fd_);
  wait();
}

void LinkThread::wait() noexcept {
  std::unique_lock<std::mutex> lock(shared_->mutex);
  shared_->changed.wait(lock, [&] { return !shared_->running; });
}

void LinkThread::tell_job() noexcept { post(job_news_fd_); }

void LinkThread::clear_job_news() noexcept { drain(job_news_fd_); }

void LinkThread::tell_caller() noexcept { post(news_fd_); }

void LinkThread::clear_news() noexcept { drain(news_fd_); }

void LinkThread::loop() {
  Shared& shared = *shared_;
  std::unique_lock<std::mutex> lock(shared.mutex);
  while (true) {
    shared.changed.wait(lock, [&] { return shared.quit || shared.job; });
    if (!shared.job) return;  // quit, with nothing left to run
    std::function<void()> job = std::move(shared.job);
    shared.job = nullptr;
    lock.unlock();
    job();  // it catches its own failures (start()'s contract)
    job = nullptr;
    post(news_fd_);
    lock.lock();
    shared.running = false;
    shared.changed.notify_all();
  }
}

}  // namespace ddpkit::comm
