#include "comm/hierarchy/equal_hosts.h"

#include "comm/core/arguments.h"
#include "comm/core/communicator.h"
#include "comm/reduction/reduce_kernel.h"
#include "comm/reduction/split.h"

namespace ddpkit::comm {

EqualHostsForm::HostSlices EqualHostsForm::reduce_scatter_in_host(const at::Tensor& flat, ReduceOp op,
                                                                  std::string_view what) const {
  const PaddedSplit split{flat.numel(), h_.topology.local_size()};
  at::Tensor padded = flat;
  if (split.padded_numel() != flat.numel()) {
    padded = h_.scratch.get(0, split.padded_numel(), flat.scalar_type());
    padded.narrow(0, 0, flat.numel()).copy_(flat);
    padded.narrow(0, flat.numel(), split.padded_numel() - flat.numel()).zero_();
  }
  HostSlices slices{padded, padded.narrow(0, split.start(h_.topology.local_rank()), split.length())};
  if (DirectCollectives* host = h_.host()) host->reduce_scatter(slices.mine, padded, op, what);
  return slices;
}

void EqualHostsForm::all_gather_in_host(const HostSlices& slices, const at::Tensor& flat, std::string_view what) const {
  if (DirectCollectives* host = h_.host()) host->all_gather(slices.padded, slices.mine, what);
  if (!slices.padded.is_same(flat)) flat.copy_(slices.padded.narrow(0, 0, flat.numel()));
}

void EqualHostsForm::all_reduce(const at::Tensor& flat, ReduceOp op, Communicator& comm) const {
  // Inside a host the mean is a sum: the division by the group's size comes once, at the end.
  const ReduceOp local_op = accumulating_op(op);
  on_hosts(h_, OnFailure::kCutLinks, [&] {
    // Horovod's split: reduce-scatter in the host, the slices across hosts, all-gather in the host.
    const HostSlices slices = reduce_scatter_in_host(flat, local_op, comm.what());
    across_hosts(h_, comm, [&] { h_.cross->all_reduce(slices.mine, op, comm); });
    finish_reduction_(slices.mine, op, comm.size());
    all_gather_in_host(slices, flat, comm.what());
  });
}

void EqualHostsForm::broadcast(const at::Tensor& flat, int root, Communicator& comm) const {
  const Topology& topology = h_.topology;
  const int root_host = topology.host_of[root];
  const int root_local = topology.local_rank_of(root);
  on_hosts(h_, OnFailure::kCutLinks, [&] {
    // The ranks of the root's local rank carry the tensor across hosts (cross rank = host), then
    // every host broadcasts it from that local rank over shared memory.
    if (topology.local_rank() == root_local) {
      across_hosts(h_, comm, [&] { h_.cross->broadcast(flat, root_host, comm); });
    }
    if (DirectCollectives* host = h_.host()) host->broadcast(flat, root_local, comm.what());
  });
}

void EqualHostsForm::reduce(const at::Tensor& flat, int root, ReduceOp op, Communicator& comm) const {
  const ReduceOp local_op = accumulating_op(op);
  const int root_host = h_.topology.host_of[root];
  on_hosts(h_, OnFailure::kCutLinks, [&] {
    const HostSlices slices = reduce_scatter_in_host(flat, local_op, comm.what());
    across_hosts(h_, comm, [&] { h_.cross->reduce(slices.mine, root_host, local_op, comm); });
    if (h_.topology.host() != root_host) return;
    finish_reduction_(slices.mine, op, comm.size());
    all_gather_in_host(slices, flat, comm.what());
  });
}

void EqualHostsForm::all_gather(const at::Tensor& output, const at::Tensor& input, Communicator& comm) const {
  const Topology& topology = h_.topology;
  const int hosts = static_cast<int>(topology.hosts.size());
  const at::Tensor in = input.reshape(-1).view(at::kByte);
  const at::Tensor out = output.view(-1).view(at::kByte);
  const int64_t m = in.numel();
  auto block = [m](const at::Tensor& bytes, int64_t i) { return bytes.narrow(0, i * m, m); };
  on_hosts(h_, OnFailure::kCutLinks, [&] {
    DirectCollectives* host = h_.host();
    if (host == nullptr) {
      // One rank per host, numbered as the hosts: the ring runs in the output itself.
      if (!is_own_block(out, in, comm.rank())) block(out, comm.rank()).copy_(in);
      across_hosts(h_, comm, [&] { h_.cross->all_gather(out, m, comm); });
      return;
    }
    at::Tensor run = h_.scratch.get(0, hosts * m, at::kByte);
    run.narrow(0, h_.cross->rank() * m, m).copy_(in);
    across_hosts(h_, comm, [&] { h_.cross->all_gather(run, m, comm); });
    at::Tensor gathered = h_.scratch.get(1, comm.size() * m, at::kByte);
    host->all_gather(gathered, run, comm.what());
    for (int p = 0; p < comm.size(); ++p) block(out, topology.local_major_rank(p)).copy_(block(gathered, p));
  });
}

void EqualHostsForm::reduce_scatter(const at::Tensor& output, const at::Tensor& input, ReduceOp op,
                                    Communicator& comm) const {
  const Topology& topology = h_.topology;
  DirectCollectives* host = h_.host();
  const int n = comm.size();
  const int hosts = static_cast<int>(topology.hosts.size());
  const int64_t m = output.numel();
  const ReduceOp local_op = accumulating_op(op);
  const at::ScalarType dtype = working_dtype(output);
  // The blocks in local-major order (a copy, in the working dtype), the host's reduce-scatter of
  // those runs (local rank j receives the host's sum of run j: the blocks of the ranks of local
  // rank j on every host), then the reduce-scatter of that run among those ranks.
  const at::Tensor blocks = input.reshape({n, m});
  at::Tensor ordered = h_.scratch.get(0, n * m, dtype);
  for (int p = 0; p < n; ++p) slice(ordered, p * m, (p + 1) * m).copy_(blocks[topology.local_major_rank(p)]);
  at::Tensor run = host != nullptr ? h_.scratch.get(1, hosts * m, dtype) : ordered;
  on_hosts(h_, OnFailure::kCutLinks, [&] {
    if (host != nullptr) host->reduce_scatter(run, ordered, local_op, comm.what());
    if (m > 0) across_hosts(h_, comm, [&] { h_.cross->reduce_scatter(run, m, local_op, comm); });
  });
  at::Tensor result = slice(run, h_.cross->rank() * m, (h_.cross->rank() + 1) * m);
  finish_reduction_(result, op, n);
  output.view(-1).copy_(result);
}

}  // namespace ddpkit::comm
