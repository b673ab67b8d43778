#include "comm/engine/engine.h"

#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <mutex>
#include <optional>
#include <unordered_map>

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

// Never destroyed: engines may still be running when static destructors would run at exit.
std::unordered_map<std::string, RegistryEntry>& registry() {
  static auto* entries = new std::unordered_map<std::string, RegistryEntry>();
  return *entries;
}

std::mutex& registry_mutex() {
  static auto* mutex = new std::mutex();
  return *mutex;
}

// Erases every entry but `kept` whose group is no longer alive and registered. Under registry_mutex().
void erase_destroyed_locked(const RegistryEntry* kept) {
  for (auto it = registry().begin(); it != registry().end();) {
    if (&it->second != kept && !registered(it->first, it->second)) {
      it = registry().erase(it);
    } else {
      ++it;
    }
  }
}

}  // namespace

void Engine::release_destroyed() {
  std::lock_guard<std::mutex> lock(registry_mutex());
  erase_destroyed_locked(nullptr);
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
  std::lock_guard<std::mutex> lock(registry_mutex());
  RegistryEntry& entry = registry()[group_name];
  if (!entry.engine || entry.group->lock().get() != group.get()) {
    // A new engine: first free those of destroyed groups (their threads, segments and the backends
    // they hold), so that creating and destroying groups holds memory, threads and fds flat. Not
    // per call: resolving every registered name costs a lookup each.
    erase_destroyed_locked(&entry);
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

}  // namespace ddpkit::comm
