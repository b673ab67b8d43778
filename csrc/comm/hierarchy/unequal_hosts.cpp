#include "comm/hierarchy/unequal_hosts.h"

#include "comm/core/arguments.h"
#include "comm/core/communicator.h"
#include "comm/reduction/reduce_kernel.h"

#include <algorithm>

namespace ddpkit::comm {

void UnequalHostsForm::all_reduce(const at::Tensor& flat, ReduceOp op, Communicator& comm) const {
  // Inside a host the mean is a sum: the division by the group's size comes once, at the end.
  const ReduceOp local_op = accumulating_op(op);
  DirectCollectives* host = h_.host();
  on_hosts(h_, OnFailure::kCutLinks, [&] {
    // All-reduce in the host, the leaders across hosts, broadcast in the host.
    if (host != nullptr) host->all_reduce(flat, local_op, comm.what());
    if (h_.topology.local_rank() == 0) {
      across_hosts(h_, comm, [&] { h_.cross->all_reduce(flat, op, comm); });
      finish_reduction_(flat, op, comm.size());
    }
    if (host != nullptr) host->broadcast(flat, 0, comm.what());
  });
}

void UnequalHostsForm::broadcast(const at::Tensor& flat, int root, Communicator& comm) const {
  const Topology& topology = h_.topology;
  DirectCollectives* host = h_.host();
  const int root_host = topology.host_of[root];
  const int root_local = topology.local_rank_of(root);
  const bool root_side = topology.host() == root_host;
  on_hosts(h_, OnFailure::kCutLinks, [&] {
    // The root's host first (its leader among the receivers), the leaders across hosts, then every
    // other host from its leader.
    if (root_side && host != nullptr) host->broadcast(flat, root_local, comm.what());
    if (topology.local_rank() == 0) across_hosts(h_, comm, [&] { h_.cross->broadcast(flat, root_host, comm); });
    if (!root_side && host != nullptr) host->broadcast(flat, 0, comm.what());
  });
}

void UnequalHostsForm::reduce(const at::Tensor& flat, int root, ReduceOp op, Communicator& comm) const {
  const Topology& topology = h_.topology;
  DirectCollectives* host = h_.host();
  const ReduceOp local_op = accumulating_op(op);
  const int root_host = topology.host_of[root];
  on_hosts(h_, OnFailure::kCutLinks, [&] {
    if (host != nullptr) host->all_reduce(flat, local_op, comm.what());
    if (topology.local_rank() == 0) across_hosts(h_, comm, [&] { h_.cross->reduce(flat, root_host, local_op, comm); });
    if (topology.host() != root_host) return;
    if (topology.local_rank() == 0) finish_reduction_(flat, op, comm.size());
    if (host != nullptr) host->broadcast(flat, 0, comm.what());
  });
}

void UnequalHostsForm::all_gather(const at::Tensor& output, const at::Tensor& input, Communicator& comm) const {
  const Topology& topology = h_.topology;
  DirectCollectives* host = h_.host();
  const int hosts = static_cast<int>(topology.hosts.size());
  const at::Tensor in = input.reshape(-1).view(at::kByte);
  const at::Tensor out = output.view(-1).view(at::kByte);
  const int64_t m = in.numel();
  auto block = [m](const at::Tensor& bytes, int64_t i) { return bytes.narrow(0, i * m, m); };
  size_t widest = 0;
  for (const auto& ranks : topology.hosts) widest = std::max(widest, ranks.size());
  const int64_t run_bytes = static_cast<int64_t>(widest) * m;
  on_hosts(h_, OnFailure::kCutLinks, [&] {
    at::Tensor run = h_.scratch.get(0, run_bytes, at::kByte);
    if (host != nullptr) {
      host->all_gather(run.narrow(0, 0, topology.local_size() * m), in, comm.what());
    } else {
      block(run, 0).copy_(in);
    }
    if (topology.local_rank() == 0) {
      at::Tensor runs = h_.scratch.get(1, hosts * run_bytes, at::kByte);
      runs.narrow(0, h_.cross->rank() * run_bytes, run_bytes).copy_(run);
      across_hosts(h_, comm, [&] { h_.cross->all_gather(runs, run_bytes, comm); });
      for (int i = 0; i < hosts; ++i) {
        for (size_t j = 0; j < topology.hosts[i].size(); ++j) {
          block(out, topology.hosts[i][j]).copy_(block(runs, static_cast<int64_t>(i * widest + j)));
        }
      }
    }
    if (host != nullptr) host->broadcast(out, 0, comm.what());
  });
}

void UnequalHostsForm::reduce_scatter(const at::Tensor& output, const at::Tensor& input, ReduceOp op,
                                      Communicator& comm) const {
  const int64_t m = output.numel();
  const auto options = output.options().dtype(working_dtype(output));
  at::Tensor whole = input.reshape(-1).to(options, /*non_blocking=*/false, /*copy=*/true);
  all_reduce(whole, accumulating_op(op), comm);
  at::Tensor result = slice(whole, comm.rank() * m, (comm.rank() + 1) * m);
  finish_reduction_(result, op, comm.size());
  output.view(-1).copy_(result);
}

}  // namespace ddpkit::comm
