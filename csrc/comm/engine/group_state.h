#pragma once
// What a group's collectives share, and what each one runs on (Note [Lanes]).

#include "comm/checks/root_verdict.h"
#include "comm/core/communicator.h"
#include "comm/core/transport.h"
#include "comm/engine/group_setup.h"

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>

namespace ddpkit::comm {

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

// Note [Device tensors on a host group]
// gloo's all-reduce stages CUDA tensors through host memory itself, but its send/recv hands the raw
// pointer to a TCP socket, and the shared-memory transport reads tensors with the CPU. So when a
// collective's tensor is on an accelerator and the group would carry it with gloo (a "gloo" group
// for every device, or a group without a backend for that device but with a CPU one), the engine
// runs the collective as a CPU collective: the Communicator is the CPU one (shared memory when the
// ranks share the host) and each collective (collectives/collectives.cpp) copies its tensors to the host, runs
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

// A group's state, for its engine: its backends, its set-up (Note [Group set-up]) and its lanes.
// Touched only by the thread running the group's collective, one at a time (Note [Collective engine]).
class GroupState {
 public:
  // What a collective runs on (Note [Lanes]).
  struct Lane {
    c10::DeviceType device = c10::kCPU;         // whose tensors it carries
    c10::intrusive_ptr<c10d::Backend> backend;  // the group's backend for that device
    std::shared_ptr<Transport> transport;
    CollectiveCheck* check = nullptr;
    const Hierarchy* hierarchy = nullptr;  // the hierarchy offered to its collectives, or null
  };

  explicit GroupState(const EngineGroup& group) : group_(group) {}

  // The lane of a `device` collective numbered `sequence` asking for `requested`. The first one
  // that takes shared memory, or a hierarchy, sets the group up as part of that collective (Note
  // [Group set-up]), so every rank must ask alike there. TORCH_CHECK-fails for a transport the
  // group cannot give the device ('shm' across hosts, or off the CPU).
  const Lane& lane(c10::DeviceType device, TransportKind requested, std::string_view what, uint64_t sequence);
  // Sets the group up (Note [Group set-up]) as part of collective `sequence`, once, with the lanes
  // of its set-up; every rank must reach it in the same collective.
  void set_up(std::string_view what, uint64_t sequence);
  // Which of the group's ranks share a host; once set up.
  const Topology& topology() const { return setup_.topology; }

 private:
  // A device's own lane over its process group, made at the device's first collective.
  struct DeviceLane {
    c10::DeviceType carrier;  // the device whose lanes carry its collectives (Note [Device tensors on a host group])
    Lane send_recv;           // over the backend's send/recv
    std::unique_ptr<RootVerdictCheck> check;
  };
  // `device`'s own lane (and its carrier), made the first time.
  const DeviceLane& device_lane(c10::DeviceType device);
  c10::intrusive_ptr<c10d::Backend> backend(c10::DeviceType device);
  // True when `device` tensors travel through host copies (Note [Device tensors on a host group]).
  bool stages_through_host(c10::DeviceType device);

  const EngineGroup& group_;
  std::unordered_map<int, c10::intrusive_ptr<c10d::Backend>> backends_;  // by device type
  std::unordered_map<int, DeviceLane> device_lanes_;                     // by device type
  bool set_up_ = false;
  GroupSetUp setup_;     // once set_up_ (Note [Group set-up])
  Lane shm_lane_;        // once set_up_, where this host holds more ranks: its shared memory
  Lane hierarchy_lane_;  // once set_up_, where the group spans hosts: the process group and the hierarchy
};

}  // namespace ddpkit::comm
