#pragma once
// What a group that spans hosts needs for its hierarchical collectives (Note [Hierarchical collectives]
// in hierarchical.h).

#include "comm/cross_host.h"
#include "comm/scratch.h"
#include "comm/topology.h"
#include "comm/transport.h"

#include <c10/util/FunctionRef.h>

#include <array>
#include <exception>
#include <memory>
#include <string>
#include <vector>

namespace ddpkit::comm {

struct Hierarchy {
  Topology topology;
  // This host's shared memory (null when this rank is alone on its host).
  std::shared_ptr<Transport> local;
  bool uniform = true;  // topology.uniform(): the split form, else the leaders' form
  mutable ScratchBuffers scratch;
  // The steps across hosts (Note [Steps across hosts]) among the ranks this rank crosses hosts with:
  // the ranks of its local rank on every host (every host holding the same number of ranks), or the
  // hosts' leaders; null on the other ranks.
  std::unique_ptr<CrossHostChannel> cross;
};

class Communicator;

// An exception's message without the C++ backtrace a c10::Error carries.
std::string without_backtrace(const std::exception& e);

// Runs `step` among the ranks `h.cross` spans (this rank crosses hosts); its failure raises naming them.
void across_hosts(const Hierarchy& h, Communicator& comm, c10::function_ref<void()> step);

// What a failure inside on_hosts' steps leaves of the links across hosts.
enum class OnFailure {
  kKeepLinks,  // the check's round, which still sends the partners this rank's words naming the failure
  kCutLinks,   // the data steps, after the check: the partners may be waiting for this rank's frames
};

// Runs steps of a hierarchical collective on this rank. A failure (a rank lost, a step across hosts
// that failed) stops this host's other ranks too, who may be waiting for this one inside the host,
// then raises here. With kCutLinks it also shuts the links across hosts down, so that a partner on
// another host waiting for this rank's frame raises at once instead of at the group's timeout (this
// rank is alive, so its connections would stay open). Among three hosts or more the sums cross on
// gloo's all-reduce, which nothing here can interrupt: those partners wait for the timeout.
void on_hosts(const Hierarchy& h, OnFailure on_failure, c10::function_ref<void()> steps);

}  // namespace ddpkit::comm
