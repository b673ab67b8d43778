#include "comm/engine/group_state.h"

#include "comm/engine/part_factory.h"

#include <algorithm>
#include <cstdlib>

namespace ddpkit::comm {

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

c10::intrusive_ptr<c10d::Backend> GroupState::backend(c10::DeviceType device) {
  auto found = backends_.find(static_cast<int>(device));
  if (found != backends_.end()) return found->second;
  c10::intrusive_ptr<c10d::Backend> backend = group_.backend(device);
  backends_.emplace(static_cast<int>(device), backend);
  return backend;
}

void GroupState::set_up(std::string_view what, uint64_t sequence) {
  if (set_up_) return;
  const Lane& cpu = device_lane(c10::kCPU).send_recv;
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

const GroupState::DeviceLane& GroupState::device_lane(c10::DeviceType device) {
  auto found = device_lanes_.find(static_cast<int>(device));
  if (found != device_lanes_.end()) return found->second;
  DeviceLane made;
  made.carrier = stages_through_host(device) ? c10::kCPU : device;
  if (made.carrier == device) {
    made.check = std::make_unique<RootVerdictCheck>();
    c10::intrusive_ptr<c10d::Backend> device_backend = backend(device);
    made.send_recv = Lane{device, device_backend, std::make_shared<SendRecvTransport>(device_backend, device),
                          made.check.get(), nullptr};
  }
  return device_lanes_.emplace(static_cast<int>(device), std::move(made)).first->second;
}

const GroupState::Lane& GroupState::lane(c10::DeviceType device, TransportKind requested, std::string_view what,
                                         uint64_t sequence) {
  if (requested == TransportKind::kAuto) requested = forced_by_environment();
  const DeviceLane* own = &device_lane(device);
  if (own->carrier != device) own = &device_lane(own->carrier);
  if (requested == TransportKind::kSendRecv || group_.size == 1) return own->send_recv;
  if (own->carrier != c10::kCPU) {
    TORCH_CHECK(requested != TransportKind::kShm, "ddpkit: transport 'shm' carries CPU tensors only, got a ",
                c10::DeviceTypeName(device, /*lower_case=*/true), " tensor");
    return own->send_recv;
  }
  set_up(what, sequence);
  if (setup_.topology.single_host()) {
    TORCH_INTERNAL_ASSERT(shm_lane_.transport, "a group on one host without its shared memory");
    return shm_lane_;
  }
  TORCH_CHECK(requested != TransportKind::kShm,
              "ddpkit: transport 'shm' needs every rank of the group on this host; use transport='auto' or "
              "'process_group'");
  return hierarchy_lane_.transport ? hierarchy_lane_ : own->send_recv;
}

bool GroupState::stages_through_host(c10::DeviceType device) {
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

}  // namespace ddpkit::comm
