#include "comm/engine/collective_work.h"

#include "comm/core/fork_guard.h"
#include "comm/engine/completion_pool.h"

namespace ddpkit::comm {

CollectiveWork::CollectiveWork(int rank, c10d::OpType type, std::vector<at::Tensor> outputs)
    : c10d::Work(rank, type), outputs_(std::move(outputs)), fork_generation_(fork_generation()) {}

bool CollectiveWork::wait(std::chrono::milliseconds timeout) {
  check_not_forked(fork_generation_, "wait", rank_);
  return c10d::Work::wait(timeout);
}

void CollectiveWork::complete(std::exception_ptr error) {
  c10::intrusive_ptr<c10::ivalue::Future> future;
  {
    std::lock_guard<std::mutex> lock(future_mutex_);
    done_ = true;
    error_ = error;
    future = future_;
  }
  // Only now wake wait(): a getFuture() after wait() returned then gets a future that is already
  // settled, as gloo's is, so a then() chained on it runs at once on the caller's thread (torchft's
  // managed work chains its callbacks right after wait() and relies on that).
  finish(error);
  // Outside the lock, and off this thread (Note [Future callbacks]): the future runs its callbacks
  // on whichever thread settles it.
  if (future) {
    CompletionPool::instance().post(
        [self = c10::intrusive_ptr<CollectiveWork>::reclaim_copy(this), future] { self->settle(*future); });
  }
}

c10::intrusive_ptr<c10::ivalue::Future> CollectiveWork::getFuture() {
  static const c10::TypePtr kTensorList = c10::ListType::create(c10::TensorType::get());
  c10::intrusive_ptr<c10::ivalue::Future> future;
  bool settle_now = false;
  {
    std::lock_guard<std::mutex> lock(future_mutex_);
    if (future_) return future_;
    future_ = future = c10::make_intrusive<c10::ivalue::Future>(kTensorList);
    settle_now = done_;
  }
  if (settle_now) settle(*future);
  return future;
}

void CollectiveWork::settle(c10::ivalue::Future& future) const {
  if (error_) {
    future.setError(error_);
  } else {
    future.markCompleted(c10::IValue(outputs_));
  }
}

}  // namespace ddpkit::comm
