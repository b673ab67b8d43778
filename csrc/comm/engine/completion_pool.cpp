#include "comm/engine/completion_pool.h"

#include <pthread.h>

#include <chrono>
#include <thread>

namespace ddpkit::comm {
namespace {

constexpr auto kIdleSeconds = std::chrono::seconds(10);

}  // namespace

CompletionPool*& CompletionPool::current() {
  static CompletionPool* pool = new CompletionPool();  // never destroyed: its threads may outlive static destructors
  return pool;
}

CompletionPool& CompletionPool::instance() {
  static const bool registered = [] {
    // The child's pool is a fresh one: the parent's may be locked, and its threads are not the child's.
    pthread_atfork(nullptr, nullptr, [] { current() = new CompletionPool(); });
    return true;
  }();
  (void)registered;
  return *current();
}

void CompletionPool::prepare_for_exit() {
  std::unique_lock<std::mutex> lock(mutex_);
  exiting_ = true;
  // Bounded: a callback that blocks (on a collective whose peers are gone, say) must not hold the
  // exit; after this, it is the process's end that stops it.
  done_cv_.wait_for(lock, kIdleSeconds, [&] { return running_ == 0; });
  for (auto& task : tasks_) new std::function<void()>(std::move(task));  // kept, never run or destroyed
  tasks_.clear();
}

void CompletionPool::post(std::function<void()> task) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (exiting_) {
    new std::function<void()>(std::move(task));  // Note [Exit paths]: kept, never run or destroyed
    return;
  }
  tasks_.push_back(std::move(task));
  // Every queued task needs an idle thread of its own: a woken thread leaves the idle count only
  // once it runs, so counting idle threads alone would hand two completions posted within one
  // wake-up to one thread, whose first callback may wait for the second.
  if (static_cast<int64_t>(tasks_.size()) <= idle_) {
    cv_.notify_one();
  } else {
    std::thread([this] { loop(); }).detach();
  }
}

void CompletionPool::loop() {
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    ++idle_;
    const bool woken = cv_.wait_for(lock, kIdleSeconds, [&] { return !tasks_.empty(); });
    --idle_;
    if (!woken) return;
    std::function<void()> task = std::move(tasks_.front());
    tasks_.pop_front();
    ++running_;
    lock.unlock();
    task();
    task = nullptr;  // its callbacks dropped here, before the exit may begin
    lock.lock();
    if (--running_ == 0) done_cv_.notify_all();
  }
}

}  // namespace ddpkit::comm
