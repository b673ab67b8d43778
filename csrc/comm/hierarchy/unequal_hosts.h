#pragma once
// The data steps of the hierarchical collectives across hosts that hold different numbers of ranks
// (Note [Unequal hosts]).

#include "comm/hierarchy/hierarchy.h"

namespace ddpkit::comm {

// Note [Unequal hosts]
// The leaders' form: only the hosts' leaders (their lowest ranks) cross hosts, each carrying its
// whole host's share.
//  - all-reduce: an all-reduce inside each host, the all-reduce of the hosts' leaders across hosts,
//    and a broadcast from the leader inside each host;
//  - broadcast: the root's host broadcasts first (its leader among the receivers), then the hosts'
//    leaders across hosts, then every other host from its leader;
//  - reduce: the all-reduce's first two steps, the leaders reducing to the root's host's leader,
//    then a broadcast on the root's host alone;
//  - all-gather: the host's blocks inside the host, the hosts' runs (padded to the largest host's)
//    among the leaders, and every host's result from its leader;
//  - reduce-scatter: the leaders' all-reduce of a copy of the whole input, of which each rank keeps
//    its block.
class UnequalHostsForm final : public HierarchicalForm {
 public:
  // `h` outlives the form (it holds it).
  explicit UnequalHostsForm(const Hierarchy& h) : h_(h) {}
  void all_reduce(const at::Tensor& flat, ReduceOp op, Communicator& comm) const override;
  void broadcast(const at::Tensor& flat, int root, Communicator& comm) const override;
  void reduce(const at::Tensor& flat, int root, ReduceOp op, Communicator& comm) const override;
  void all_gather(const at::Tensor& output, const at::Tensor& input, Communicator& comm) const override;
  void reduce_scatter(const at::Tensor& output, const at::Tensor& input, ReduceOp op,
                      Communicator& comm) const override;

 private:
  const Hierarchy& h_;
};

}  // namespace ddpkit::comm
