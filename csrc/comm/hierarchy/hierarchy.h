#pragma once
// What a group that spans hosts needs for its hierarchical collectives (Note [Hierarchical collectives]
// in hierarchy/one_round.h), and the form their data steps take, chosen for the shape of its hosts.

#include "comm/core/scratch.h"
#include "comm/core/transport.h"
#include "comm/hierarchy/cross_host_steps.h"
#include "comm/reduction/reduce_op.h"
#include "comm/topology/topology.h"

#include <ATen/ATen.h>
#include <c10/util/FunctionRef.h>

#include <array>
#include <exception>
#include <memory>
#include <string>
#include <vector>

namespace ddpkit::comm {

class Communicator;

// The data steps of a group's hierarchical collectives, run after their check (Note [Hierarchical
// collectives]): one form per shape of hosts, chosen once at the group's set-up: EqualHostsForm
// (hierarchy/equal_hosts.h) where every host holds the same number of ranks, else UnequalHostsForm
// (hierarchy/unequal_hosts.h). Each step runs in place on contiguous tensors, and every rank ends with
// the same bits. Reductions take float32/64 and int32/64 (the caller's working copy).
class HierarchicalForm {
 public:
  virtual ~HierarchicalForm() = default;
  // The all-reduce of `flat`.
  virtual void all_reduce(const at::Tensor& flat, ReduceOp op, Communicator& comm) const = 0;
  // The broadcast of `flat` (any dtype: bytes move) from rank `root`.
  virtual void broadcast(const at::Tensor& flat, int root, Communicator& comm) const = 0;
  // The reduce of `flat` to rank `root`. Ranks off the root's host keep partial results, as torch's
  // reduce allows.
  virtual void reduce(const at::Tensor& flat, int root, ReduceOp op, Communicator& comm) const = 0;
  // torch's all_gather_into_tensor (any dtype; a non-empty input).
  virtual void all_gather(const at::Tensor& output, const at::Tensor& input, Communicator& comm) const = 0;
  // torch's reduce_scatter_tensor (a non-empty output); `input` (n blocks of output.numel()) stays
  // unchanged.
  virtual void reduce_scatter(const at::Tensor& output, const at::Tensor& input, ReduceOp op,
                              Communicator& comm) const = 0;
};

struct Hierarchy {
  Topology topology;
  // This host's shared memory (null when this rank is alone on its host).
  std::shared_ptr<Transport> local;
  mutable ScratchBuffers scratch;
  // The steps across hosts (Note [Steps across hosts]) among the ranks this rank crosses hosts with:
  // the ranks of its local rank on every host (every host holding the same number of ranks), or the
  // hosts' leaders; null on the other ranks.
  std::unique_ptr<CrossHostSteps> cross;
  // The data steps, in the form the set-up chose for the hosts' shape.
  std::unique_ptr<HierarchicalForm> form;

  // This host's direct collectives, or null when this rank is alone on its host.
  DirectCollectives* host() const { return local ? local->direct() : nullptr; }
};

// An exception's message without the C++ backtrace a c10::Error carries.
std::string without_backtrace(const std::exception& e);

// Runs `step` among the ranks `h.cross` spans (this rank crosses hosts); its failure raises naming them
// (a CheckVerdict passes unchanged).
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
// rank is alive, so its connections would stay open). Among three hosts or more the broadcast and the
// reduce cross on the gloo subgroup's messages, which nothing here can interrupt: there those partners
// wait for the timeout. A CheckVerdict passes unchanged and stops nothing: the check's error leaves
// the links in step.
void on_hosts(const Hierarchy& h, OnFailure on_failure, c10::function_ref<void()> steps);

}  // namespace ddpkit::comm
