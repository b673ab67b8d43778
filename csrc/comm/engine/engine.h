#pragma once
// One entry point per process group for every ddpkit collective (Note [Collective engine]).

#include "comm/core/communicator.h"
#include "comm/core/fork_guard.h"
#include "comm/engine/collective_queue.h"
#include "comm/engine/collective_work.h"
#include "comm/engine/group_state.h"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace ddpkit::comm {

// Note [Collective engine]
// Every ddpkit collective of a process group, from the Python ops, the DDP reducer, SyncBatchNorm
// and the training loop's evaluation, goes through the group's Engine, which owns what the
// collectives of one group share, each part in a unit of its own: the group lookup (Engine::of,
// engine/engine_registry.cpp), the order of its collectives and the one thread that runs asynchronous ones
// (CollectiveQueue, engine/collective_queue.h: sequence numbers, Note [Tags]), their Work
// (engine/collective_work.h) and the pool that settles its futures (engine/completion_pool.h), and the group's
// state (GroupState, engine/group_state.h: the set-up, with the shared-memory segment, and the lanes, each a
// transport with its collective check: Note [Lanes]).
//  - run() and submit() reserve the group's next sequence number on the calling thread, so the
//    collectives of a group are numbered in program order, identically on every rank.
//  - The engine runs them strictly in that order, one at a time: run() on the calling thread when
//    nothing of the group is queued or running (no thread hand-off on the synchronous fast path),
//    otherwise after what came before it; submit() queues the collective for the engine's thread
//    and returns a c10d::Work at once (a DDP bucket launched during backward).
//  - Serial execution per group is what lets the shared-memory slots and channels be used without
//    per-collective locking, and it keeps two threads of one process (a DDP bucket on the engine's
//    thread, SyncBatchNorm's backward on the autograd thread) from ever interleaving their messages.
//
// Note [Where a small all-reduce's time goes]
// benchmarks/bench_latency.py loops each layer of ddpkit.all_reduce's call path back to back: the
// engine's layers from C++ (ddpkit.testing.time_engine_loop, csrc/testing/engine_loop.cpp: no Python
// and no dispatcher between calls), then the Python layers. The decision it backs: a blocking
// collective runs inline on the caller's thread (no queue, no thread hand-off, no heap allocation
// of the engine's own, no store access), so that communication (the copy into this rank's slot,
// the arrivals, the waits, the reduction: Note [Direct all-reduce], Note [Waiting on shared memory])
// is most of a small call, and the collective check rides in the payload's slot. latency.json
// holds the figures of each layer against MPICH's; the report shows them.

// A c10d backend whose collectives all run on a ddpkit Engine (the "ddpkit" torch.distributed
// backend): ddpkit's own collectives on a group of that backend go through that same engine, so the
// group has one sequence of collectives and one shared-memory segment.
class EngineBackend {
 public:
  virtual ~EngineBackend() = default;
  virtual std::shared_ptr<class Engine> engine() = 0;
};

class Engine {
 public:
  using Body = CollectiveQueue::Body;

  // The engine of the group registered as `group_name` (made on first use; a group destroyed and
  // registered again under the same name gets a new one); for a group whose CPU backend is an
  // EngineBackend, that backend's engine. Fails clearly when there is no such group.
  static std::shared_ptr<Engine> of(const std::string& group_name);

  // Frees the engines of() made for groups destroyed since: their threads, segments and the
  // backends they hold, a gloo group's worker threads among them (Note [Exit paths]).
  static void release_destroyed();

  // A new engine for `group`, owned by the caller (the "ddpkit" backend). In a forked child it is
  // never destroyed, and its collectives fail at once (Note [Forked children]).
  static std::shared_ptr<Engine> create(EngineGroup group);

  // Runs `body` as the group's next collective with a Communicator for `device`'s backend (the CPU
  // one for a device whose tensors travel through host copies, Note [Device tensors on a host
  // group]) and the transport `requested` resolves to; returns when it has run (rethrowing its error).
  // `what` names the call `body` serves, as its caller knows it ("all_gather", "all_reduce"): every
  // error of the collective starts with it (Communicator::what()), the shared-memory set-up's its
  // first use may make and the collective check's included.
  void run(c10::DeviceType device, TransportKind requested, std::string_view what, const Body& body);

  // Queues `body` as the group's next collective; the returned Work completes (or fails) when it has
  // run on the engine's thread, its future then holding `outputs`. Everything `body` touches must
  // stay alive until then (capture tensors by value).
  c10::intrusive_ptr<CollectiveWork> submit(c10::DeviceType device, TransportKind requested, std::string_view what,
                                            Body body, c10d::OpType type = c10d::OpType::UNKNOWN,
                                            std::vector<at::Tensor> outputs = {});

  int rank() const { return group_.rank; }
  int size() const { return group_.size; }
  const std::string& name() const { return group_.name; }

  // Which of the group's ranks share a host (Note [Topology]): a collective of the group (its
  // first, when nothing set the group up yet), so every rank calls it at the same point.
  Topology topology();

  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

 private:
  explicit Engine(EngineGroup group);
  // Runs collective `sequence` on the lane its device and request take (Note [Lanes]).
  void execute(c10::DeviceType device, TransportKind requested, std::string_view what, uint64_t sequence,
               const Body& body);

  const EngineGroup group_;
  const uint64_t fork_generation_;  // the process that made it (Note [Forked children])
  GroupState state_;                // touched only by the collective running
  CollectiveQueue queue_;           // last: its thread, which runs collectives on state_, goes first
};

}  // namespace ddpkit::comm
