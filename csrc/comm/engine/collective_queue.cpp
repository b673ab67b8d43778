#include "comm/engine/collective_queue.h"

#include "comm/core/communicator.h"
#include "comm/core/spin_budget.h"

#include <exception>

namespace ddpkit::comm {

CollectiveQueue::~CollectiveQueue() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  cv_.notify_all();
  // Never from the queue's own thread (a last reference dropped there): join would throw there.
  if (worker_.joinable()) {
    if (worker_.get_id() == std::this_thread::get_id()) {
      worker_.detach();
    } else {
      worker_.join();
    }
  }
}

void CollectiveQueue::run(c10::DeviceType device, TransportKind requested, std::string_view what, const Body& body) {
  std::unique_lock<std::mutex> lock(mutex_);
  const uint64_t sequence = next_sequence_++;
  if (busy_ || !queue_.empty()) {
    auto work = enqueue_locked(device, requested, what, sequence, body, c10d::OpType::UNKNOWN, {});
    lock.unlock();
    work->wait();
    return;
  }
  busy_ = true;
  lock.unlock();
  struct Done {
    CollectiveQueue* queue;
    ~Done() {
      std::lock_guard<std::mutex> lock(queue->mutex_);
      queue->busy_ = false;
      if (!queue->queue_.empty()) queue->cv_.notify_all();
    }
  } done{this};
  execute_(device, requested, what, sequence, body);
}

c10::intrusive_ptr<CollectiveWork> CollectiveQueue::submit(c10::DeviceType device, TransportKind requested,
                                                           std::string_view what, Body body, c10d::OpType type,
                                                           std::vector<at::Tensor> outputs) {
  std::lock_guard<std::mutex> lock(mutex_);
  return enqueue_locked(device, requested, what, next_sequence_++, std::move(body), type, std::move(outputs));
}

c10::intrusive_ptr<CollectiveWork> CollectiveQueue::enqueue_locked(c10::DeviceType device, TransportKind requested,
                                                                   std::string_view what, uint64_t sequence, Body body,
                                                                   c10d::OpType type, std::vector<at::Tensor> outputs) {
  auto work = c10::make_intrusive<CollectiveWork>(rank_, type, std::move(outputs));
  queue_.push_back(Task{device, requested, std::string(what), sequence, std::move(body), work,
                        c10::impl::tls_local_dispatch_key_set(), c10::AutogradState::get_tls_state(), is_checked()});
  if (!worker_.joinable()) worker_ = std::thread([this] { worker_loop(); });
  cv_.notify_all();
  return work;
}

void CollectiveQueue::worker_loop() {
  spin_briefly_on_this_thread();  // the process computes (backward) while this thread communicates
  for (;;) {
    std::unique_lock<std::mutex> lock(mutex_);
    cv_.wait(lock, [&] { return (stopping_ && queue_.empty()) || (!queue_.empty() && !busy_); });
    if (queue_.empty()) return;
    Task task = std::move(queue_.front());
    queue_.pop_front();
    busy_ = true;
    lock.unlock();
    std::exception_ptr error;
    try {
      // Note [Issued, then run]
      const c10::impl::ForceDispatchKeyGuard dispatch_keys(task.dispatch_keys);
      struct AutogradScope {
        c10::AutogradState previous = c10::AutogradState::get_tls_state();
        explicit AutogradScope(const c10::AutogradState& state) { c10::AutogradState::set_tls_state(state); }
        ~AutogradScope() { c10::AutogradState::set_tls_state(previous); }
      } autograd(task.autograd);
      const ScopedChecks checks(task.checked);
      execute_(task.device, task.requested, task.what, task.sequence, task.body);
    } catch (...) {
      error = std::current_exception();
    }
    task.body = nullptr;  // release what it captured before anyone is told it ran
    lock.lock();
    busy_ = false;
    lock.unlock();
    cv_.notify_all();
    task.work->complete(error);
  }
}

}  // namespace ddpkit::comm
