#pragma once
// What a group's collectives share, made once, as part of its first collective that needs it
// (Note [Group set-up]).

#include "comm/core/collective_check.h"
#include "comm/core/communicator.h"
#include "comm/core/transport.h"
#include "comm/hierarchy/hierarchy.h"
#include "comm/topology/topology.h"

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <functional>
#include <memory>
#include <string_view>

namespace ddpkit::comm {

// Note [Group set-up]
// A group's set-up is one unit, run over the group's own messages as part of one collective, alike
// on every rank: discovery of the group's topology (Note [Topology]), then this host's segment given
// that topology (Note [Shared-memory segment]); where the group spans hosts and its backend can be
// split, the subgroup of the ranks this rank crosses hosts with, their socket links and the steps
// across hosts (Note [Steps across hosts]); the collective checks all of it calls for (Note [Check
// seam]); and last the whole group's agreement that every rank set its part up, so that either
// every rank goes on, or every rank raises and the next collective sets up again.
struct GroupSetUp {
  Topology topology;
  std::shared_ptr<Transport> shm;              // this host's shared memory, when it holds more ranks
  std::unique_ptr<CollectiveCheck> shm_check;  // with `shm`: one step of it
  std::unique_ptr<Hierarchy> hierarchy;        // when the group spans hosts (Note [Hierarchical collectives])
  // With `hierarchy`: the check every collective taking it takes (the round across equal hosts, else
  // the root's verdict over the process group).
  std::unique_ptr<CollectiveCheck> hierarchy_check;
};

// Sets the group up over `setup` (a communicator of the group's CPU backend `cpu`, made for this
// set-up: Communicator::use_for_setup). `store` (null: none) gives the group's store, from which the
// subgroups across hosts get their own; `timeout` bounds the set-up and the socket links' exchanges.
// Raises alike on every rank when some rank could not set its part up.
GroupSetUp set_up_group(Communicator& setup, const c10::intrusive_ptr<c10d::Backend>& cpu,
                        const std::function<c10::intrusive_ptr<c10d::Store>()>& store,
                        std::chrono::milliseconds timeout, std::string_view what);

}  // namespace ddpkit::comm
