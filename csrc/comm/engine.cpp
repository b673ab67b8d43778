#include "comm/engine.h"

#include "comm/exit.h"
#include "comm/part_factory.h"
#include "comm/shm_wait.h"

#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <optional>

namespace ddpkit::comm {
namespace {

struct RegistryEntry {
  std::optional<c10::weak_intrusive_ptr<c10d::ProcessGroup>> group;
  std::shared_ptr<Engine> engine;
};

// True while the group `entry` was made for is alive and still registered under `name`.
bool registered(const std::string& name, const RegistryEntry& entry) {
  if (!entry.group) return false;
  c10::intrusive_ptr<c10d::ProcessGroup> alive = entry.group->lock();
  if (!alive) return false;
  try {
    return c10d::resolve_process_group(name).get() == alive.get();
  } catch (const std::exception&) {
    return false;  // destroy_process_group unregistered it
  }
}

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
// A forked child gets a pool of its own (the parent's threads do not exist there).
class CompletionPool {
 public:
  static CompletionPool& instance() {
    static const bool registered = [] {
      // The child's pool is a fresh one: the parent's may be locked, and its threads are not the child's.
      pthread_atfork(nullptr, nullptr, [] { current() = new CompletionPool(); });
      return true;
    }();
    (void)registered;
    return *current();
  }

  void prepare_for_exit() {
    std::unique_lock<std::mutex> lock(mutex_);
    exiting_ = true;
    // Bounded: a callback that blocks (on a collective whose peers are gone, say) must not hold the
    // exit; after this, it is the process's end that stops it.
    done_cv_.wait_for(lock, kIdleSeconds, [&] { return running_ == 0; });
    for (auto& task : tasks_) new std::function<void()>(std::move(task));  // kept, never run or destroyed
    tasks_.clear();
  }

  void post(std::function<void()> task) {
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

 private:
  static constexpr auto kIdleSeconds = std::chrono::seconds(10);

  static CompletionPool*& current() {
    static CompletionPool* pool = new CompletionPool();  // never destroyed: its threads may outlive static destructors
    return pool;
  }

  void loop() {
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

  std::mutex mutex_;
  std::condition_variable cv_;
  std::condition_variable done_cv_;
  std::deque<std::function<void()>> tasks_;
  int64_t idle_ = 0;
  int64_t running_ = 0;
  bool exiting_ = false;
};

std::atomic<uint64_t> forks_since_load{0};
const bool counts_forks = [] {
  pthread_atfork(nullptr, nullptr, [] { forks_since_load.fetch_add(1, std::memory_order_relaxed); });
  return true;
}();

}  // namespace

// Note [Forked children]
// A forked child has its parent's memory but none of its threads, and shares its sockets and shared
// memory. A group made before the fork stays the parent's. In the child, a collective or a wait on its
// work fails at once: it would wait forever for the engine's thread, which is not there. Destroying
// the group there (destroy_process_group, or the last reference dropped) destroys nothing: the engine
// is leaked whole. Its members' destructors would join a thread that does not exist, destroy a
// condition variable the parent's thread was waiting on (which waits for that waiter), and shut down
// the cross-host sockets the parent still uses. The child's copy of that memory costs nothing more.
// A forked child's own completions get a pool of their own (Note [Exit paths]). Test:
// test_exit_paths.py's forked-child test.
uint64_t fork_generation() {
  (void)counts_forks;
  return forks_since_load.load(std::memory_order_relaxed);
}

void check_not_forked(uint64_t made_in, std::string_view what, int rank) {
  TORCH_CHECK(fork_generation() == made_in, "ddpkit.", what, " (rank ", rank,
              "): this process is a fork of the one that made the group, and a forked child cannot use its "
              "parent's process group (its threads are the parent's); make a new group in the child");
}

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

void prepare_for_exit() { CompletionPool::instance().prepare_for_exit(); }

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

std::shared_ptr<Engine> Engine::of(const std::string& group_name) {
  c10::intrusive_ptr<c10d::ProcessGroup> group;
  try {
    group = c10d::resolve_process_group(group_name);
  } catch (const std::exception&) {
    TORCH_CHECK(false, "ddpkit: no process group named '", group_name,
                "' is registered; call torch.distributed.init_process_group (or ddpkit.init_distributed) first");
  }
  if (group->hasBackends()) {
    try {
      c10::intrusive_ptr<c10d::Backend> cpu = group->getBackend(c10::kCPU);
      if (auto* owner = dynamic_cast<EngineBackend*>(cpu.get())) return owner->engine();
    } catch (const std::exception&) {
      // no CPU backend: an engine of the group's own, below
    }
  }
  // Never destroyed: engines may still be running when static destructors would run at exit.
  static auto* registry = new std::unordered_map<std::string, RegistryEntry>();
  static auto* registry_mutex = new std::mutex();
  std::lock_guard<std::mutex> lock(*registry_mutex);
  RegistryEntry& entry = (*registry)[group_name];
  if (!entry.engine || entry.group->lock().get() != group.get()) {
    // A new engine: first free those of destroyed groups (their threads, segments and the backends
    // they hold), so that creating and destroying groups holds memory, threads and fds flat. Not
    // per call: resolving every registered name costs a lookup each.
    for (auto it = registry->begin(); it != registry->end();) {
      if (&it->second != &entry && !registered(it->first, it->second)) {
        it = registry->erase(it);
      } else {
        ++it;
      }
    }
    entry.group.emplace(group);
    c10::weak_intrusive_ptr<c10d::ProcessGroup> weak(group);
    EngineGroup handle;
    handle.name = group_name;
    handle.rank = group->getRank();
    handle.size = group->getSize();
    handle.store = [weak]() -> c10::intrusive_ptr<c10d::Store> {
      auto alive = weak.lock();
      TORCH_CHECK(alive, "ddpkit: the process group was destroyed");
      return alive->getStore();
    };
    handle.backend = [weak](c10::DeviceType device) {
      auto alive = weak.lock();
      TORCH_CHECK(alive, "ddpkit: the process group was destroyed");
      try {
        return alive->getBackend(device);
      } catch (const std::exception&) {
        TORCH_CHECK(false, "ddpkit: process group '", alive->getGroupName(), "' (", alive->getBackendName(),
                    ") cannot carry ", c10::DeviceTypeName(device, /*lower_case=*/true),
                    " tensors; gloo carries CPU tensors, NCCL CUDA tensors");
      }
    };
    entry.engine = create(std::move(handle));
  }
  return entry.engine;
}

std::shared_ptr<Engine> Engine::create(EngineGroup group) {
  return std::shared_ptr<Engine>(new Engine(std::move(group)), [](Engine* engine) {
    if (fork_generation() == engine->fork_generation_) delete engine;  // else leaked: Note [Forked children]
  });
}

Engine::Engine(EngineGroup group) : group_(std::move(group)), fork_generation_(fork_generation()) {}

Engine::~Engine() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  cv_.notify_all();
  // Never from the engine's own thread (a last reference dropped there): join would throw there.
  if (worker_.joinable()) {
    if (worker_.get_id() == std::this_thread::get_id()) {
      worker_.detach();
    } else {
      worker_.join();
    }
  }
}

void Engine::run(c10::DeviceType device, TransportKind requested, std::string_view what, const Body& body) {
  check_not_forked(fork_generation_, what, group_.rank);
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
    Engine* engine;
    ~Done() {
      std::lock_guard<std::mutex> lock(engine->mutex_);
      engine->busy_ = false;
      if (!engine->queue_.empty()) engine->cv_.notify_all();
    }
  } done{this};
  execute(device, requested, what, sequence, body);
}

c10::intrusive_ptr<CollectiveWork> Engine::submit(c10::DeviceType device, TransportKind requested,
                                                  std::string_view what, Body body, c10d::OpType type,
                                                  std::vector<at::Tensor> outputs) {
  check_not_forked(fork_generation_, what, group_.rank);
  std::lock_guard<std::mutex> lock(mutex_);
  return enqueue_locked(device, requested, what, next_sequence_++, std::move(body), type, std::move(outputs));
}

c10::intrusive_ptr<CollectiveWork> Engine::enqueue_locked(c10::DeviceType device, TransportKind requested,
                                                          std::string_view what, uint64_t sequence, Body body,
                                                          c10d::OpType type, std::vector<at::Tensor> outputs) {
  auto work = c10::make_intrusive<CollectiveWork>(group_.rank, type, std::move(outputs));
  queue_.push_back(Task{device, requested, std::string(what), sequence, std::move(body), work,
                        c10::impl::tls_local_dispatch_key_set(), c10::AutogradState::get_tls_state(), is_checked()});
  if (!worker_.joinable()) worker_ = std::thread([this] { worker_loop(); });
  cv_.notify_all();
  return work;
}

void Engine::worker_loop() {
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
      execute(task.device, task.requested, task.what, task.sequence, task.body);
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

c10::intrusive_ptr<c10d::Backend> Engine::backend(c10::DeviceType device) {
  auto found = backends_.find(static_cast<int>(device));
  if (found != backends_.end()) return found->second;
  c10::intrusive_ptr<c10d::Backend> backend = group_.backend(device);
  backends_.emplace(static_cast<int>(device), backend);
  return backend;
}

TransportKind forced_by_environment() {
  // Read once: getenv walks the whole environment, on every small collective's path.
  static const std::string forced = [] {
    const char* set = std::getenv("DDPKIT_TRANSPORT");
    return set == nullptr ? std::string() : std::string(set);
  }();
  const std::string_view value = forced;
  if (value.empty() || value == "auto") return TransportKind::kAuto;
  const bool known = std::find(kTransportNames.begin(), kTransportNames.end(), value) != kTransportNames.end();
  TORCH_CHECK(known, "ddpkit: DDPKIT_TRANSPORT=", value, " is not one of auto, shm, process_group");
  return parse_transport(value);
}

void Engine::set_up(std::string_view what, uint64_t sequence) {
  if (set_up_) return;
  const Lane& cpu = device_lane(c10::kCPU).process_group;
  std::chrono::milliseconds timeout{300000};
  try {
    timeout = cpu.backend->getBackendOptions()->timeout;
  } catch (const std::exception&) {
  }
  Communicator setup(group_.rank, group_.size, c10::kCPU, cpu.backend,
                     part_factory().setup_transport(cpu.transport, group_.rank), sequence, group_.name, what);
  const std::string setup_what = c10::str(what, "'s shared-memory set-up");
  setup.use_for_setup(setup_what);
  setup_ = set_up_group(setup, cpu.backend, group_.store, timeout, what);
  if (setup_.shm) shm_lane_ = Lane{c10::kCPU, cpu.backend, setup_.shm, setup_.shm_check.get(), nullptr};
  if (setup_.hierarchy) {
    hierarchy_lane_ = Lane{c10::kCPU, cpu.backend, cpu.transport, setup_.hierarchy_check.get(), setup_.hierarchy.get()};
  }
  set_up_ = true;
}

Topology Engine::topology() {
  Topology result;
  run(c10::kCPU, TransportKind::kProcessGroup, "topology", [&](Communicator& comm) {
    set_up("topology", comm.sequence());
    result = setup_.topology;
  });
  return result;
}

const Engine::DeviceLane& Engine::device_lane(c10::DeviceType device) {
  auto found = device_lanes_.find(static_cast<int>(device));
  if (found != device_lanes_.end()) return found->second;
  DeviceLane made;
  made.carrier = stages_through_host(device) ? c10::kCPU : device;
  if (made.carrier == device) {
    made.check = std::make_unique<RootVerdictCheck>();
    c10::intrusive_ptr<c10d::Backend> device_backend = backend(device);
    made.process_group = Lane{device, device_backend, std::make_shared<ProcessGroupTransport>(device_backend, device),
                              made.check.get(), nullptr};
  }
  return device_lanes_.emplace(static_cast<int>(device), std::move(made)).first->second;
}

const Engine::Lane& Engine::lane(c10::DeviceType device, TransportKind requested, std::string_view what,
                                 uint64_t sequence) {
  if (requested == TransportKind::kAuto) requested = forced_by_environment();
  const DeviceLane* own = &device_lane(device);
  if (own->carrier != device) own = &device_lane(own->carrier);
  if (requested == TransportKind::kProcessGroup || group_.size == 1) return own->process_group;
  if (own->carrier != c10::kCPU) {
    TORCH_CHECK(requested != TransportKind::kShm, "ddpkit: transport 'shm' carries CPU tensors only, got a ",
                c10::DeviceTypeName(device, /*lower_case=*/true), " tensor");
    return own->process_group;
  }
  set_up(what, sequence);
  if (setup_.topology.single_host()) {
    TORCH_INTERNAL_ASSERT(shm_lane_.transport, "a group on one host without its shared memory");
    return shm_lane_;
  }
  TORCH_CHECK(requested != TransportKind::kShm,
              "ddpkit: transport 'shm' needs every rank of the group on this host; use transport='auto' or "
              "'process_group'");
  return hierarchy_lane_.transport ? hierarchy_lane_ : own->process_group;
}

bool Engine::stages_through_host(c10::DeviceType device) {
  if (device == c10::kCPU || device == c10::kMeta) return false;  // meta tensors have no data to copy
  // Note [Device tensors on a host group]: gloo's send/recv, and a group with no backend for the
  // device at all, leave the messages to host copies carried by the CPU backend.
  c10::intrusive_ptr<c10d::Backend> device_backend;
  try {
    device_backend = backend(device);
  } catch (const std::exception&) {
    return true;
  }
  return device_backend->getBackendName() == "gloo";
}

void Engine::execute(c10::DeviceType device, TransportKind requested, std::string_view what, uint64_t sequence,
                     const Body& body) {
  const Lane& lane = this->lane(device, requested, what, sequence);
  Communicator comm(group_.rank, group_.size, lane.device, lane.backend, lane.transport, sequence, group_.name, what,
                    lane.check);
  if (lane.hierarchy != nullptr) comm.use_hierarchy(lane.hierarchy);
  body(comm);
}

}  // namespace ddpkit::comm
