#pragma once
// The Work of a collective a group's engine runs (Note [Collective engine] in engine/engine.h).

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <cstdint>
#include <exception>
#include <mutex>
#include <vector>

namespace ddpkit::comm {

// The Work of a collective run by an Engine: wait() returns when it ran (rethrowing its error),
// result() and getFuture()'s value are `outputs` (a list of tensors, as torch's backends give
// DistributedDataParallel's communication hooks). The future is made only when asked for: a
// synchronous collective, waited on at once, never pays for it. Its callbacks never run on the
// engine's thread (Note [Future callbacks] in engine/completion_pool.h), so they may start collectives and wait.
class CollectiveWork final : public c10d::Work {
 public:
  CollectiveWork(int rank, c10d::OpType type, std::vector<at::Tensor> outputs);
  void complete(std::exception_ptr error);
  std::vector<at::Tensor> result() override { return outputs_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
  // Fails at once in a forked child (Note [Forked children] in core/fork_guard.cpp): the thread that
  // completes it is the parent's.
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;

 private:
  void settle(c10::ivalue::Future& future) const;  // with the outcome; call once complete

  std::vector<at::Tensor> outputs_;
  const uint64_t fork_generation_;
  std::mutex future_mutex_;  // guards the three below
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  bool done_ = false;
  std::exception_ptr error_;
};

}  // namespace ddpkit::comm
