#include "comm/engine/engine.h"

namespace ddpkit::comm {

std::shared_ptr<Engine> Engine::create(EngineGroup group) {
  return std::shared_ptr<Engine>(new Engine(std::move(group)), [](Engine* engine) {
    if (fork_generation() == engine->fork_generation_) delete engine;  // else leaked: Note [Forked children]
  });
}

Engine::Engine(EngineGroup group)
    : group_(std::move(group)),
      fork_generation_(fork_generation()),
      state_(group_),
      queue_(group_.rank,
             [this](c10::DeviceType device, TransportKind requested, std::string_view what, uint64_t sequence,
                    const Body& body) { execute(device, requested, what, sequence, body); }) {}

void Engine::run(c10::DeviceType device, TransportKind requested, std::string_view what, const Body& body) {
  check_not_forked(fork_generation_, what, group_.rank);
  queue_.run(device, requested, what, body);
}

c10::intrusive_ptr<CollectiveWork> Engine::submit(c10::DeviceType device, TransportKind requested,
                                                  std::string_view what, Body body, c10d::OpType type,
                                                  std::vector<at::Tensor> outputs) {
  check_not_forked(fork_generation_, what, group_.rank);
  return queue_.submit(device, requested, what, std::move(body), type, std::move(outputs));
}

Topology Engine::topology() {
  Topology result;
  run(c10::kCPU, TransportKind::kSendRecv, "topology", [&](Communicator& comm) {
    state_.set_up("topology", comm.sequence());
    result = state_.topology();
  });
  return result;
}

void Engine::execute(c10::DeviceType device, TransportKind requested, std::string_view what, uint64_t sequence,
                     const Body& body) {
  const GroupState::Lane& lane = state_.lane(device, requested, what, sequence);
  Communicator comm(group_.rank, group_.size, lane.device, lane.backend, lane.transport, sequence, group_.name, what,
                    lane.check);
  if (lane.hierarchy != nullptr) comm.use_hierarchy(lane.hierarchy);
  body(comm);
}

}  // namespace ddpkit::comm
