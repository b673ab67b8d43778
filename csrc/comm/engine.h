#pragma once
// One entry point per process group for every ddpkit collective (Note [Collective engine]).

#include "comm/checks.h"
#include "comm/communicator.h"
#include "comm/group_setup.h"

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <c10/core/AutogradState.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <vector>

namespace ddpkit::comm {

// Note [Collective engine]
// Every ddpkit collective of a process group, from the Python ops, the DDP reducer, SyncBatchNorm
// and the training loop's evaluation, goes through the group's Engine, which owns what the
// collectives of one group share: the group lookup, sequence numbers (Note [Tags]), the choice of
// transport, the shared-memory segment, the collective checks and the one thread that runs
// asynchronous collectives.
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
// Note [Issued, then run]
// A collective queued for the engine's thread runs there under the issuing thread's modes, as one
// run on the calling thread does: its grad and inference mode (the autograd state and the dispatch
// keys that carry them: a collective under torch.no_grad() writes into a parameter, one under
// torch.inference_mode() into inference tensors, and both raise on a thread with the defaults) and
// its checked mode (Note [Collective checks]): a rank that turns the checks off while its
// asynchronous collectives are queued still runs those as its peers, which ran them at once, did.
// Not the whole at::ThreadLocalState, as gloo's work takes: copying it cost a 1k-float asynchronous
// all-reduce at 2 ranks a fifth of its time, these two fields nothing measurable (an interleaved
// loop of async_op=True all-reduces, the two builds alternated); and Python's dispatch and function
// modes belong to the issuing thread, whose own calls they see.

// Note [Lanes]
// What a collective runs on, its lane, is decided once per device and transport, and looked up per
// call: the backend, the transport, the collective check (Note [Check seam]) and whether the
// hierarchy is offered (Note [Hierarchical collectives]). A device's own lane, over its process group
// with the root's verdict, is made at the device's first collective (a device whose tensors travel
// through host copies takes the CPU's lanes); the CPU's shared-memory lane (the host's segment and
// its slot check) and hierarchy lane (the process group, the hierarchy and its check: the round
// across equal hosts, else the root's verdict) are made by the group's set-up. A call takes its
// device's own lane when it asks for the process group (by name, or through DDPKIT_TRANSPORT), when
// the group has one rank, or off the CPU; else the shared-memory lane when every rank is on this
// host; else the hierarchy lane where the group's backend could be split for it, and the CPU's own
// lane where it could not.

// Note [Where a small all-reduce's time goes]
// benchmarks/bench_latency.py loops each layer of ddpkit.all_reduce's call path back to back: the
// engine's layers from C++ (ddpkit.testing.time_engine_loop, csrc/testing/engine_loop.cpp: no Python
// and no dispatcher between calls), then the Python layers. The decision it backs: a blocking
// collective runs inline on the caller's thread (no queue, no thread hand-off, no heap allocation
// of the engine's own, no store access), so that communication (the copy into this rank's slot,
// the arrivals, the waits, the reduction: Note [Direct all-reduce], Note [Waiting on shared memory])
// is most of a small call, and the collective check rides in the payload's slot. latency.json
// holds the figures of each layer against MPICH's; the report shows them.

// Note [Device tensors on a host group]
// gloo's all-reduce stages CUDA tensors through host memory itself, but its send/recv hands the raw
// pointer to a TCP socket, and the shared-memory transport reads tensors with the CPU. So when a
// collective's tensor is on an accelerator and the group would carry it with gloo (a "gloo" group
// for every device, or a group without a backend for that device but with a CPU one), the engine
// runs the collective as a CPU collective: the Communicator is the CPU one (shared memory when the
// ranks share the host) and each collective (collectives.cpp) copies its tensors to the host, runs
// and copies the result back. The copies are synchronous on the current stream, so the collective
// sees everything queued before it and the caller sees the result after it. Groups whose backend
// carries device pointers (NCCL) send the device tensors themselves.

// What DDPKIT_TRANSPORT (auto | shm | process_group) forces in place of kAuto, so that a whole
// program, the DDP reducer's buckets and SyncBatchNorm's passes included, can be switched without
// changing its calls; kAuto when it is unset. TORCH_CHECK-fails on any other value. Read once, at
// the program's first collective: set it before the program starts, alike on every rank.
TransportKind forced_by_environment();

// What an Engine needs of its group. For a torch.distributed process group (Engine::of) these come
// from the group; the "ddpkit" torch.distributed backend (csrc/backend) passes its own.
struct EngineGroup {
  std::string name;  // the group's registered name: errors and shared-memory store keys
  int rank = 0;
  int size = 1;
  // The store for the shared-memory rendezvous (Note [Shared-memory segment]); null: none.
  std::function<c10::intrusive_ptr<c10d::Store>()> store;
  // The backend that carries `device`'s point-to-point messages and the group's own collectives;
  // TORCH_CHECK-fails, naming the group, when there is none.
  std::function<c10::intrusive_ptr<c10d::Backend>(c10::DeviceType)> backend;
};

// A c10d backend whose collectives all run on a ddpkit Engine (the "ddpkit" torch.distributed
// backend): ddpkit's own collectives on a group of that backend go through that same engine, so the
// group has one sequence of collectives and one shared-memory segment.
class EngineBackend {
 public:
  virtual ~EngineBackend() = default;
  virtual std::shared_ptr<class Engine> engine() = 0;
};

// The Work of a collective run by an Engine: wait() returns when it ran (rethrowing its error),
// result() and getFuture()'s value are `outputs` (a list of tensors, as torch's backends give
// DistributedDataParallel's communication hooks). The future is made only when asked for: a
// synchronous collective, waited on at once, never pays for it. Its callbacks never run on the
// engine's thread (Note [Future callbacks] in engine.cpp), so they may start collectives and wait.
class CollectiveWork final : public c10d::Work {
 public:
  CollectiveWork(int rank, c10d::OpType type, std::vector<at::Tensor> outputs);
  void complete(std::exception_ptr error);
  std::vector<at::Tensor> result() override { return outputs_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
  // Fails at once in a forked child (Note [Forked children]): the thread that completes it is the parent's.
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

class Engine {
 public:
  using Body = std::function<void(Communicator&)>;

  // The engine of the group registered as `group_name` (made on first use; a group destroyed and
  // registered again under the same name gets a new one); for a group whose CPU backend is an
  // EngineBackend, that backend's engine. Fails clearly when there is no such group.
  static std::shared_ptr<Engine> of(const std::string& group_name);

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

  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

 private:
  explicit Engine(EngineGroup group);
  struct Task {
    c10::DeviceType device;
    TransportKind requested;
    std::string what;
    uint64_t sequence;
    Body body;
    c10::intrusive_ptr<CollectiveWork> work;
    // The issuing thread's modes, under which the engine's thread runs it (Note [Issued, then run]).
    c10::impl::LocalDispatchKeySet dispatch_keys;
    c10::AutogradState autograd;
    bool checked;
  };
  void execute(c10::DeviceType device, TransportKind requested, std::string_view what, uint64_t sequence,
               const Body& body);
  c10::intrusive_ptr<CollectiveWork> enqueue_locked(c10::DeviceType device, TransportKind requested,
                                                    std::string_view what, uint64_t sequence, Body body,
                                                    c10d::OpType type, std::vector<at::Tensor> outputs);
  void worker_loop();
  // What a collective runs on (Note [Lanes]).
  struct Lane {
    c10::DeviceType device = c10::kCPU;         // whose tensors it carries
    c10::intrusive_ptr<c10d::Backend> backend;  // the group's backend for that device
    std::shared_ptr<Transport> transport;
    CollectiveCheck* check = nullptr;
    const Hierarchy* hierarchy = nullptr;  // the hierarchy offered to its collectives, or null
  };
  // A device's own lane over its process group, made at the device's first collective.
  struct DeviceLane {
    c10::DeviceType carrier;  // the device whose lanes carry its collectives (Note [Device tensors on a host group])
    Lane process_group;
    std::unique_ptr<RootVerdictCheck> check;
  };
  // The lane of a `device` collective numbered `sequence` asking for `requested`. The first one
  // that takes shared memory, or a hierarchy, sets the group up as part of that collective (Note
  // [Group set-up]), so every rank must ask alike there.
  const Lane& lane(c10::DeviceType device, TransportKind requested, std::string_view what, uint64_t sequence);
  // `device`'s own lane (and its carrier), made the first time.
  const DeviceLane& device_lane(c10::DeviceType device);
  // Sets the group up (Note [Group set-up]) as part of collective `sequence`, once, with the lanes
  // of its set-up; every rank must reach it in the same collective.
  void set_up(std::string_view what, uint64_t sequence);
  c10::intrusive_ptr<c10d::Backend> backend(c10::DeviceType device);
  // True when `device` tensors travel through host copies (Note [Device tensors on a host group]).
  bool stages_through_host(c10::DeviceType device);

  const EngineGroup group_;
  const uint64_t fork_generation_;  // the process that made it (Note [Forked children])
  // The group's state: touched only by the thread that runs its collectives, one at a time.
  std::unordered_map<int, c10::intrusive_ptr<c10d::Backend>> backends_;  // by device type
  std::unordered_map<int, DeviceLane> device_lanes_;                     // by device type
  bool set_up_ = false;
  GroupSetUp setup_;     // once set_up_ (Note [Group set-up])
  Lane shm_lane_;        // once set_up_, where this host holds more ranks: its shared memory
  Lane hierarchy_lane_;  // once set_up_, where the group spans hosts: the process group and the hierarchy
  std::mutex mutex_;     // guards everything below
  std::condition_variable cv_;
  uint64_t next_sequence_ = 0;
  bool busy_ = false;  // a collective of this group is running
  std::deque<Task> queue_;
  std::thread worker_;
  bool stopping_ = false;
};

}  // namespace ddpkit::comm
