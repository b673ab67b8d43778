#include "comm/hierarchy/one_round.h"

#include "comm/core/algorithm.h"
#include "comm/core/arguments.h"
#include "comm/reduction/reduce_kernel.h"

#include <vector>

namespace ddpkit::comm {

void hierarchical_all_reduce_in_one_round(const at::Tensor& tensor, ReduceOp op, const CollectiveHeader& header,
                                          const Hierarchy& h, Communicator& comm) {
  DirectCollectives* local = h.host();
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
  DirectCollectives* host = h.host();
  if (host == nullptr) return;
  on_hosts(h, OnFailure::kCutLinks, [&] { host->broadcast(bytes, root_local, comm.what()); });
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
  if (DirectCollectives* host = h.host()) {
    gathered = h.scratch.get(0, comm.size() * m, at::kByte);
    on_hosts(h, OnFailure::kCutLinks, [&] { host->all_gather(gathered, run, comm.what()); });
  }
  for (int p = 0; p < comm.size(); ++p) {
    out.narrow(0, topology.local_major_rank(p) * m, m).copy_(gathered.narrow(0, p * m, m));
  }
}

}  // namespace ddpkit::comm
