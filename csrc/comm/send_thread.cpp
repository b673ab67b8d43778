#include "comm/send_thread.h"

#include "comm/exit.h"

#include <c10/util/Exception.h>

#include <pthread.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
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

SendThread::SendThread() {
  stop_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  news_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (stop_fd_ < 0 || news_fd_ < 0) {
    const std::string why = std::strerror(errno);
    if (stop_fd_ >= 0) ::close(stop_fd_);
    if (news_fd_ >= 0) ::close(news_fd_);
    TORCH_CHECK(false, "eventfd failed: ", why);
  }
}

SendThread::~SendThread() {
  if (thread_.joinable() && fork_generation() != fork_generation_) {
    // A forked child: the parent's thread does not exist here (Note [Forked children]), and it may
    // have held the mutex at the fork.
    thread_.detach();
  } else if (thread_.joinable()) {
    stop();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      quit_ = true;
    }
    changed_.notify_all();
    thread_.join();
  }
  ::close(stop_fd_);
  ::close(news_fd_);
}

void SendThread::start(std::function<void()> job) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_INTERNAL_ASSERT(!running_, "a SendThread runs one job at a time");
    stop_.store(false, std::memory_order_release);
    drain(stop_fd_);
    drain(news_fd_);
    job_ = std::move(job);
    running_ = true;
  }
  if (!thread_.joinable()) {
    fork_generation_ = fork_generation();
    thread_ = std::thread([this] {
      ::pthread_setname_np(::pthread_self(), "ddpkit-send");  // for top -H and perf
      loop();
    });
  } else {
    changed_.notify_all();
  }
}

void SendThread::stop() noexcept {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!running_) return;
    stop_.store(true, std::memory_order_release);
  }
  post(stop_fd_);
  wait();
}

void SendThread::wait() noexcept {
  std::unique_lock<std::mutex> lock(mutex_);
  changed_.wait(lock, [&] { return !running_; });
}

void SendThread::tell_caller() noexcept { post(news_fd_); }

void SendThread::clear_news() noexcept { drain(news_fd_); }

void SendThread::loop() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    changed_.wait(lock, [&] { return quit_ || job_; });
    if (!job_) return;  // quit_, with nothing left to run
    std::function<void()> job = std::move(job_);
    job_ = nullptr;
    lock.unlock();
    job();  // a job catches its own failures: it runs in the exchange's place (socket_exchange.cpp)
    job = nullptr;
    post(news_fd_);
    lock.lock();
    running_ = false;
    changed_.notify_all();
  }
}

}  // namespace ddpkit::comm
