#include "comm/hierarchical.h"

#include "comm/arguments.h"
#include "comm/algorithm.h"
#include "comm/reduce_kernel.h"
#include "comm/split.h"

#include <algorithm>
#include <vector>

namespace ddpkit::comm {
namespace {

// The steps across hosts (Note [Steps across hosts]), on this rank's channel; a failure raises
// naming the partners.
void cross_host_all_reduce(const at::Tensor& block, ReduceOp op, const Hierarchy& h, Communicator& comm) {
  across_hosts(h, comm, [&] { h.cross->all_reduce(block, op, comm); });
}

void cross_host_broadcast(const at::Tensor& flat, int root, const Hierarchy& h, Communicator& comm) {
  across_hosts(h, comm, [&] { h.cross->broadcast(flat, root, comm); });
}

void cross_host_reduce(const at::Tensor& flat, int root, ReduceOp op, const Hierarchy& h, Communicator& comm) {
  across_hosts(h, comm, [&] { h.cross->reduce(flat, root, op, comm); });
}

void cross_host_all_gather(const at::Tensor& flat, int64_t m, const Hierarchy& h, Communicator& comm) {
  across_hosts(h, comm, [&] { h.cross->all_gather(flat, m, comm); });
}

// `flat` in one slice per rank of this host (Horovod's split), by PaddedSplit: the direct
// reduce-scatter and all-gather take equal blocks (Note [Splitting among ranks]). Padded with zeros
// in a scratch buffer where the host's size does not divide it.
struct HostSlices {
  at::Tensor padded;  // `flat`, or its padded copy
  at::Tensor mine;    // this rank's slice of `padded`
};

// The host's reduce-scatter of `flat` (unchecked: the check already ran): this rank's slice then
// holds `op` over the host's slices.
HostSlices reduce_scatter_in_host(const at::Tensor& flat, ReduceOp op, const Hierarchy& h, std::string_view what) {
  const PaddedSplit split{flat.numel(), h.topology.local_size()};
  at::Tensor padded = flat;
  if (split.padded_numel() != flat.numel()) {
    padded = h.scratch.get(0, split.padded_numel(), flat.scalar_type());
    padded.narrow(0, 0, flat.numel()).copy_(flat);
    padded.narrow(0, flat.numel(), split.padded_numel() - flat.numel()).zero_();
  }
  HostSlices slices{padded, padded.narrow(0, split.start(h.topology.local_rank()), split.length())};
  if (h.local != nullptr) h.local->direct()->reduce_scatter(slices.mine, padded, op, what);
  return slices;
}

// The host's all-gather of its ranks' slices back into `flat` (unchecked).
void all_gather_in_host(const HostSlices& slices, const at::Tensor& flat, const Hierarchy& h, std::string_view what) {
  if (h.local != nullptr) h.local->direct()->all_gather(slices.padded, slices.mine, what);
  if (!slices.padded.is_same(flat)) flat.copy_(slices.padded.narrow(0, 0, flat.numel()));
}

// The group's rank at local-major position p = j·H + i of H equal hosts: local rank j of host i.
// The hierarchical all-gather and reduce-scatter hold the ranks' blocks in this order, so that the
// step across hosts moves one contiguous run of H blocks per local rank and the step inside the host
// the L runs.
int local_major_rank(const Topology& topology, int position) {
  const int hosts = static_cast<int>(topology.hosts.size());
  return topology.hosts[position % hosts][position / hosts];
}

}  // namespace

void hierarchical_all_reduce_in_one_round(const at::Tensor& tensor, ReduceOp op, const CollectiveHeader& header,
                                          const Hierarchy& h, Communicator& comm) {
  DirectCollectives* local = h.local ? h.local->direct() : nullptr;
  // A copy whatever the dtype: the host's all-reduce runs before the round has compared every host's
  // header, and a call that another host disagrees with must leave the tensor as it was (Note
  // [Collective checks]). At most kOneRoundMaxBytes.
  at::Tensor work = working_copy(tensor);
  if (work.is_same(tensor)) work = tensor.clone();
  at::Tensor flat = work.view(-1);
  const ReduceOp sum_or_op = accumulating_op(op);
  // The host's result on every rank of the host, then to the center with the check's words; the
  // center reduces the hosts' results in host order and answers with the total: the same bits everywhere.
  const int64_t data_bytes = flat.numel() * static_cast<int64_t>(flat.element_size());
  auto payload = [&] {
    if (local != nullptr && flat.numel() > 0) {
      on_hosts(h, OnFailure::kKeepLinks, [&] { local->all_reduce(flat, sum_or_op, comm.what()); });
    }
    return flat.view(at::kByte);
  };
  auto reply_of = [&](const std::vector<at::Tensor>& payloads) {
    at::Tensor total = payloads[0].narrow(0, 0, data_bytes).view(flat.scalar_type()).clone();
    for (size_t j = 1; j < payloads.size(); ++j) {
      combine_(total, payloads[j].narrow(0, 0, data_bytes).view(flat.scalar_type()), sum_or_op);
    }
    finish_reduction_(total, op, comm.size());
    return total.view(at::kByte);
  };
  const RideAlong ride{payload, reply_of};
  const at::Tensor reply = comm.begin(header, {}, /*exchange_header=*/true, &ride);
  if (data_bytes > 0) flat.view(at::kByte).copy_(reply.narrow(0, 0, data_bytes));
  write_back(const_cast<at::Tensor&>(tensor), work);
}

void hierarchical_all_reduce(const at::Tensor& flat, ReduceOp op, const Hierarchy& h, Communicator& comm) {
  const Topology& topology = h.topology;
  DirectCollectives* local = h.local ? h.local->direct() : nullptr;
  // Inside a host the mean is a sum: the division by the group's size comes once, at the end.
  const ReduceOp local_op = accumulating_op(op);
  on_hosts(h, OnFailure::kCutLinks, [&] {
    if (h.uniform) {
      // Horovod's split: reduce-scatter in the host, the slices across hosts, all-gather in the host.
      const HostSlices slices = reduce_scatter_in_host(flat, local_op, h, comm.what());
      cross_host_all_reduce(slices.mine, op, h, comm);
      finish_reduction_(slices.mine, op, comm.size());
      all_gather_in_host(slices, flat, h, comm.what());
    } else {
      // The leaders' form: all-reduce in the host, the leaders across hosts, broadcast in the host.
      at::Tensor whole = flat;
      if (local != nullptr) local->all_reduce(whole, local_op, comm.what());
      if (topology.local_rank() == 0) {
        cross_host_all_reduce(whole, op, h, comm);
        finish_reduction_(whole, op, comm.size());
      }
      if (local != nullptr) local->broadcast(whole, 0, comm.what());
    }
  });
}

void hierarchical_broadcast(const at::Tensor& flat, int root, const Hierarchy& h, Communicator& comm) {
  const Topology& topology = h.topology;
  DirectCollectives* local = h.local ? h.local->direct() : nullptr;
  const int root_host = topology.host_of[root];
  const int root_local = topology.local_rank_of(root);
  on_hosts(h, OnFailure::kCutLinks, [&] {
    if (h.uniform) {
      // The ranks of the root's local rank carry the tensor across hosts (cross rank = host), then
      // every host broadcasts it from that local rank over shared memory.
      if (topology.local_rank() == root_local) cross_host_broadcast(flat, root_host, h, comm);
      if (local != nullptr) local->broadcast(flat, root_local, comm.what());
    } else {
      // The leaders' form: the root's host first (its leader among the receivers), the leaders
      // across hosts, then every other host from its leader.
      const bool root_side = topology.host() == root_host;
      if (root_side && local != nullptr) local->broadcast(flat, root_local, comm.what());
      if (topology.local_rank() == 0) cross_host_broadcast(flat, root_host, h, comm);
      if (!root_side && local != nullptr) local->broadcast(flat, 0, comm.what());
    }
  });
}

void hierarchical_reduce(const at::Tensor& flat, int root, ReduceOp op, const Hierarchy& h, Communicator& comm) {
  const Topology& topology = h.topology;
  DirectCollectives* local = h.local ? h.local->direct() : nullptr;
  const ReduceOp local_op = accumulating_op(op);
  const int root_host = topology.host_of[root];
  const bool root_side = topology.host() == root_host;
  on_hosts(h, OnFailure::kCutLinks, [&] {
    if (h.uniform) {
      const HostSlices slices = reduce_scatter_in_host(flat, local_op, h, comm.what());
      cross_host_reduce(slices.mine, root_host, local_op, h, comm);
      if (!root_side) return;
      finish_reduction_(slices.mine, op, comm.size());
      all_gather_in_host(slices, flat, h, comm.what());
    } else {
      if (local != nullptr) local->all_reduce(flat, local_op, comm.what());
      if (topology.local_rank() == 0) cross_host_reduce(flat, root_host, local_op, h, comm);
      if (!root_side) return;
      if (topology.local_rank() == 0) finish_reduction_(flat, op, comm.size());
      if (local != nullptr) local->broadcast(flat, 0, comm.what());
    }
  });
}

void hierarchical_all_gather(const at::Tensor& output, const at::Tensor& input, const Hierarchy& h,
                             Communicator& comm) {
  const Topology& topology = h.topology;
  DirectCollectives* local = h.local ? h.local->direct() : nullptr;
  const int hosts = static_cast<int>(topology.hosts.size());
  const at::Tensor in = input.reshape(-1).view(at::kByte);
  const at::Tensor out = output.view(-1).view(at::kByte);
  const int64_t m = in.numel();
  auto block = [m](const at::Tensor& bytes, int64_t i) { return bytes.narrow(0, i * m, m); };
  on_hosts(h, OnFailure::kCutLinks, [&] {
    if (h.uniform && local == nullptr) {
      // One rank per host, numbered as the hosts: the ring runs in the output itself.
      if (!is_own_block(out, in, comm.rank())) block(out, comm.rank()).copy_(in);
      cross_host_all_gather(out, m, h, comm);
    } else if (h.uniform) {
      at::Tensor run = h.scratch.get(0, hosts * m, at::kByte);
      run.narrow(0, h.cross->rank() * m, m).copy_(in);
      cross_host_all_gather(run, m, h, comm);
      at::Tensor gathered = h.scratch.get(1, comm.size() * m, at::kByte);
      local->all_gather(gathered, run, comm.what());
      for (int p = 0; p < comm.size(); ++p) block(out, local_major_rank(topology, p)).copy_(block(gathered, p));
    } else {
      size_t widest = 0;
      for (const auto& ranks : topology.hosts) widest = std::max(widest, ranks.size());
      const int64_t run_bytes = static_cast<int64_t>(widest) * m;
      at::Tensor run = h.scratch.get(0, run_bytes, at::kByte);
      if (local != nullptr) {
        local->all_gather(run.narrow(0, 0, topology.local_size() * m), in, comm.what());
      } else {
        block(run, 0).copy_(in);
      }
      if (topology.local_rank() == 0) {
        at::Tensor runs = h.scratch.get(1, hosts * run_bytes, at::kByte);
        runs.narrow(0, h.cross->rank() * run_bytes, run_bytes).copy_(run);
        cross_host_all_gather(runs, run_bytes, h, comm);
        for (int i = 0; i < hosts; ++i) {
          for (size_t j = 0; j < topology.hosts[i].size(); ++j) {
            block(out, topology.hosts[i][j]).copy_(block(runs, static_cast<int64_t>(i * widest + j)));
          }
        }
      }
      if (local != nullptr) local->broadcast(out, 0, comm.what());
    }
  });
}

void hierarchical_reduce_scatter(const at::Tensor& output, const at::Tensor& input, ReduceOp op, const Hierarchy& h,
                                 Communicator& comm) {
  const Topology& topology = h.topology;
  DirectCollectives* local = h.local ? h.local->direct() : nullptr;
  const int n = comm.size();
  const int hosts = static_cast<int>(topology.hosts.size());
  const int64_t m = output.numel();
  const ReduceOp local_op = accumulating_op(op);
  const auto options = output.options().dtype(working_dtype(output));
  at::Tensor result;
  if (h.uniform) {
    const at::Tensor blocks = input.reshape({n, m});
    at::Tensor ordered = h.scratch.get(0, n * m, options.dtype().toScalarType());
    for (int p = 0; p < n; ++p) slice(ordered, p * m, (p + 1) * m).copy_(blocks[local_major_rank(topology, p)]);
    at::Tensor run = local != nullptr ? h.scratch.get(1, hosts * m, options.dtype().toScalarType()) : ordered;
    on_hosts(h, OnFailure::kCutLinks, [&] {
      if (local != nullptr) local->reduce_scatter(run, ordered, local_op, comm.what());
      if (m > 0) across_hosts(h, comm, [&] { h.cross->reduce_scatter(run, m, local_op, comm); });
    });
    result = slice(run, h.cross->rank() * m, (h.cross->rank() + 1) * m);
  } else {
    at::Tensor whole = input.reshape(-1).to(options, /*non_blocking=*/false, /*copy=*/true);
    hierarchical_all_reduce(whole, local_op, h, comm);
    result = slice(whole, comm.rank() * m, (comm.rank() + 1) * m);
  }
  finish_reduction_(result, op, n);
  output.view(-1).copy_(result);
}

void hierarchical_broadcast_in_one_round(const at::Tensor& tensor, int root, const CollectiveHeader& header,
                                         const Hierarchy& h, Communicator& comm) {
  const Topology& topology = h.topology;
  const at::Tensor bytes = tensor.view(-1).view(at::kByte);
  const int root_host = topology.host_of[root];
  const int root_local = topology.local_rank_of(root);
  // The center is cross rank 0 as in every other round across hosts, whatever the root: ranks that
  // disagree on the root, or on whether the tensor fits, must still meet in one round to learn it.
  const bool carries = topology.local_rank() == root_local;
  auto payload = [&] { return comm.rank() == root ? bytes : at::empty({0}, at::kByte); };
  auto reply_of = [&](const std::vector<at::Tensor>& payloads) {
    return carries ? payloads[root_host].narrow(0, 0, bytes.numel()) : at::empty({0}, at::kByte);
  };
  const RideAlong ride{payload, reply_of};
  const at::Tensor reply = comm.begin(header, {}, /*exchange_header=*/true, &ride);
  if (bytes.numel() == 0) return;
  if (carries && comm.rank() != root) bytes.copy_(reply.narrow(0, 0, bytes.numel()));
  if (h.local == nullptr) return;
  on_hosts(h, OnFailure::kCutLinks, [&] { h.local->direct()->broadcast(bytes, root_local, comm.what()); });
}

void hierarchical_all_gather_in_one_round(const at::Tensor& output, const at::Tensor& input,
                                          const CollectiveHeader& header, const Hierarchy& h, Communicator& comm) {
  const Topology& topology = h.topology;
  const at::Tensor in = input.reshape(-1).view(at::kByte);
  const at::Tensor out = output.view(-1).view(at::kByte);
  const int64_t m = in.numel();
  // The center answers with the blocks of every partner, in host order: this local rank's run.
  auto payload = [&] { return in; };
  auto reply_of = [&](const std::vector<at::Tensor>& payloads) {
    at::Tensor run = at::empty({static_cast<int64_t>(payloads.size()) * m}, at::kByte);
    for (size_t j = 0; j < payloads.size(); ++j) run.narrow(0, j * m, m).copy_(payloads[j].narrow(0, 0, m));
    return run;
  };
  const RideAlong ride{payload, reply_of};
  const at::Tensor reply = comm.begin(header, {}, /*exchange_header=*/true, &ride);
  if (m == 0) return;
  const at::Tensor run = reply.narrow(0, 0, h.cross->size() * m);
  at::Tensor gathered = run;
  if (h.local != nullptr) {
    gathered = h.scratch.get(0, comm.size() * m, at::kByte);
    on_hosts(h, OnFailure::kCutLinks, [&] { h.local->direct()->all_gather(gathered, run, comm.what()); });
  }
  for (int p = 0; p < comm.size(); ++p) {
    out.narrow(0, local_major_rank(topology, p) * m, m).copy_(gathered.narrow(0, p * m, m));
  }
}

}  // namespace ddpkit::comm
