#pragma once
// The threads that settle the futures of a group's collectives (Note [Future callbacks]).

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>

namespace ddpkit::comm {

// Note [Future callbacks]
// A Work's future runs its then() callbacks on the thread that completes it. Those callbacks may
// start collectives of the same group and wait for them (PowerSGD's hook does, and so may any user
// hook), so they must never run on the engine's thread, which alone runs the group's queued
// collectives: the engine's thread finishes the Work (waking wait()) and hands the future to this
// pool, which runs each completion on an idle thread of its own, or on a new one when all are busy,
// so that a callback blocked on a later collective never holds up that collective's completion.
// Threads idle for kIdleSeconds exit, so a program without futures keeps none.
//
// Note [Exit paths]
// A future's callbacks may be Python functions, and so may the objects they hold. Settling such a
// future takes the GIL, and so does dropping its callbacks afterwards. Once the interpreter is
// finalizing, a thread that is not the finalizing one and asks for the GIL is ended with pthread_exit,
// whose forced unwinding through a destructor (a dropped Python callback's) is std::terminate:
// "terminate called without an active exception", SIGABRT, in a job that merely ended (an exception
// or sys.exit with asynchronous work outstanding). So Python's atexit, which runs before the
// finalization, calls prepare_for_exit(): it waits, with the GIL released, for the completions
// already running, and from then on a completion is kept unsettled (its future and callbacks are
// never destroyed: the process is ending). The Work itself still completes, so a C++ wait() returns.
// The same atexit call then frees the engines of destroyed groups (Engine::release_destroyed, in
// csrc/python.cpp), with the GIL still released: a gloo backend an engine holds would otherwise keep
// its worker threads into the finalization, where one may drop a tensor's last reference and ask
// for the GIL (torch's race, pytorch/pytorch#190489; seen in a core dump of docs/ddp.md's
// ddp_hooks.py).
// A forked child gets a pool of its own (the parent's threads do not exist there).
class CompletionPool {
 public:
  // This process's pool (a forked child gets a fresh one: the parent's may be locked, and its
  // threads are not the child's).
  static CompletionPool& instance();

  // Runs `task` on an idle thread of the pool, or on a new one when all are busy; once the process
  // prepares for its exit, keeps it unrun and undestroyed instead (Note [Exit paths]).
  void post(std::function<void()> task);

  // Waits (boundedly) for the completions already running; from then on every posted task is kept
  // unrun (Note [Exit paths]).
  void prepare_for_exit();

 private:
  static CompletionPool*& current();
  void loop();

  std::mutex mutex_;
  std::condition_variable cv_;
  std::condition_variable done_cv_;
  std::deque<std::function<void()>> tasks_;
  int64_t idle_ = 0;
  int64_t running_ = 0;
  bool exiting_ = false;
};

}  // namespace ddpkit::comm
