#pragma once
// The data steps of the hierarchical collectives across hosts that hold the same number of ranks
// (Note [Equal hosts]).

#include "comm/hierarchy/hierarchy.h"

namespace ddpkit::comm {

// Note [Equal hosts]
// The all-reduce, with L ranks on every host (Horovod's split):
//  1. reduce-scatter inside each host over shared memory: local rank j holds the host's sum of
//     slice j of L;
//  2. every local rank at once all-reduces its slice with the ranks of the same local rank on the
//     other hosts ("cross"), so each host's link carries 2(H-1)/H of the vector once: between two
//     hosts the two ranks swap their slices over their socket link, both ways at once, and each
//     reduces the pair in host order (Note [Socket links]); among more hosts, on a ring over the
//     same links (Note [A ring across hosts]);
//  3. all-gather inside each host over shared memory.
// The broadcast: the ranks of the root's local rank carry the tensor across hosts (among three hosts
// or more, ddpkit's binomial tree on their subgroup), then every host broadcasts it from that local
// rank over shared memory.
// The reduce follows the all-reduce, stopping at the root's host: reduce-scatter inside every host,
// each slice reduced across hosts to the root's host (ddpkit's binomial tree on the cross subgroup,
// which keeps Note [Reductions]'s semantics for every op), all-gather inside that host.
// The all-gather and the reduce-scatter hold the ranks' blocks in local-major order (local rank j of
// host i at position j·H + i, Topology::local_major_rank), so that each local rank's H blocks are one
// run: the all-gather sends this rank's block to the ranks of its local rank (ddpkit's ring on their
// subgroup), then all-gathers the hosts' runs inside the host; the reduce-scatter reduce-scatters the
// runs inside the host, then each run among the ranks of its local rank (ddpkit's ring). Each host's
// link carries (H-1)/H of its ranks' data once, the least an all-gather or reduce-scatter can. The
// rings across hosts run over the socket links (Note [A ring across hosts]); the broadcast's and the
// reduce's trees over the cross subgroup's messages (Note [Steps across hosts]). With one rank per
// host the all-gather's ring runs in the output itself.
class EqualHostsForm final : public HierarchicalForm {
 public:
  // `h` outlives the form (it holds it).
  explicit EqualHostsForm(const Hierarchy& h) : h_(h) {}
  void all_reduce(const at::Tensor& flat, ReduceOp op, Communicator& comm) const override;
  void broadcast(const at::Tensor& flat, int root, Communicator& comm) const override;
  void reduce(const at::Tensor& flat, int root, ReduceOp op, Communicator& comm) const override;
  void all_gather(const at::Tensor& output, const at::Tensor& input, Communicator& comm) const override;
  void reduce_scatter(const at::Tensor& output, const at::Tensor& input, ReduceOp op,
                      Communicator& comm) const override;

 private:
  // `flat` in one slice per rank of this host (Horovod's split), by PaddedSplit: the direct
  // reduce-scatter and all-gather take equal blocks (Note [Splitting among ranks]). Padded with zeros
  // in a scratch buffer where the host's size does not divide it.
  struct HostSlices {
    at::Tensor padded;  // `flat`, or its padded copy
    at::Tensor mine;    // this rank's slice of `padded`
  };
  // The host's reduce-scatter of `flat`: this rank's slice then holds `op` over the host's slices.
  HostSlices reduce_scatter_in_host(const at::Tensor& flat, ReduceOp op, std::string_view what) const;
  // The host's all-gather of its ranks' slices back into `flat`.
  void all_gather_in_host(const HostSlices& slices, const at::Tensor& flat, std::string_view what) const;

  const Hierarchy& h_;
};

}  // namespace ddpkit::comm
