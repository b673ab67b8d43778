#pragma once
// What a group that spans hosts needs for its hierarchical collectives (Note [Hierarchical collectives]
// in hierarchical.h).

#include "comm/header.h"
#include "comm/socket_links.h"
#include "comm/topology.h"
#include "comm/transport.h"

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <c10/util/FunctionRef.h>

#include <array>
#include <exception>
#include <memory>
#include <string>
#include <vector>

namespace ddpkit::comm {

// Buffers the hierarchical collectives of one group reuse from call to call, so that a large
// collective does not fault in fresh pages each time (filling a fresh 64 MB buffer took several
// times as long as filling a reused one). Only that group's collectives use them, one at a time (the engine's
// order), and never past the collective's end. Slots 0 and 1 hold a collective's own steps; kFromPeer
// what the other host sends in a step across two hosts, which may reduce into either of them.
class ScratchBuffers {
 public:
  static constexpr int kFromPeer = 2;

  // `numel` elements of `dtype` of buffer `slot` (0, 1 or kFromPeer), contents undefined; grows the
  // buffer.
  at::Tensor get(int slot, int64_t numel, at::ScalarType dtype) {
    TORCH_INTERNAL_ASSERT(slot >= 0 && slot < static_cast<int>(buffers_.size()));
    const int64_t bytes = numel * static_cast<int64_t>(c10::elementSize(dtype));
    at::Tensor& buffer = buffers_[slot];
    if (!buffer.defined() || buffer.numel() < bytes) buffer = at::empty({bytes}, at::kByte);
    return buffer.narrow(0, 0, bytes).view(dtype);
  }

 private:
  std::array<at::Tensor, 3> buffers_;
};

struct Hierarchy {
  Topology topology;
  // This host's shared memory (null when this rank is alone on its host).
  std::shared_ptr<Transport> local;
  // The process group's own backend on the ranks this rank crosses hosts with: the ranks of its
  // local rank on every host (every host holding the same number of ranks), or the hosts' leaders
  // (null on the other ranks).
  c10::intrusive_ptr<c10d::Backend> cross;
  std::shared_ptr<Transport> cross_messages;  // point-to-point messages on `cross`
  std::unique_ptr<SocketLinks> links;         // TCP links among them (Note [Socket links])
  std::vector<int> cross_ranks;               // the group's ranks `cross` spans, in its order
  int cross_rank = 0;
  int cross_size = 1;
  bool uniform = true;  // topology.uniform(): the split form, else the leaders' form
  mutable ScratchBuffers scratch;
};

class Communicator;

// An exception's message without the C++ backtrace a c10::Error carries.
std::string without_backtrace(const std::exception& e);

// Runs `step` among the ranks `h.cross` spans; its failure raises naming them.
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
