#include "comm/hierarchical.h"

#include "comm/arguments.h"
#include "comm/algorithm.h"
#include "comm/schedules.h"
#include "testing/faults.h"

#include <algorithm>
#include <vector>

namespace ddpkit::comm {
namespace {

// A communicator for ddpkit's own schedules among the ranks `h.cross` spans, as part of `comm`'s
// collective (its sequence number, so its tags).
Communicator cross_communicator(const Hierarchy& h, const Communicator& comm) {
  return Communicator(h.cross_rank, h.cross_size, c10::kCPU, h.cross, h.cross_messages, comm.sequence(), comm.group());
}

// The part of a frame across two hosts reduced at a time while the rest arrives: reducing parts as
// they land beat reducing once everything is in, unshaped and at 1 Gbit/s, and 256 KiB parts beat
// 1 MiB ones at 1M floats while tying at 16M (bench_multihost.py's 2x1 points, the part size

constexpr int64_t kSwapStepBytes = 256 << 10;

// The steps across two hosts (h.cross_size == 2) move over the socket links (Note [Socket links]):
// `sends` go to the other host while its frame of exactly `mine`'s size arrives and is reduced into
// `mine` (contiguous) part by part, in host order, so that both hosts reduce to the same bits. A
// part is reduced once it is in and, where `sends` reads `mine`, once this rank's copy of it has
// left. A kMean is summed; the caller divides once. A peer that passed another size breaks the links
// (with checks off), and both ranks raise, naming the sizes.
void receive_and_combine_across_two_hosts(const at::Tensor& mine, ReduceOp op, std::vector<SocketLinks::Send> sends,
                                          const Hierarchy& h, Communicator& comm) {
  TORCH_INTERNAL_ASSERT(h.cross_size == 2 && mine.is_contiguous());
  const int peer = 1 - h.cross_rank;
  const int64_t element = mine.element_size();
  const int64_t bytes = mine.numel() * element;
  const ReduceOp sum_or_op = op == ReduceOp::kMean ? ReduceOp::kSum : op;
  at::Tensor theirs = h.scratch.get(ScratchBuffers::kFromPeer, mine.numel(), mine.scalar_type());
  int64_t reduced = 0;  // elements
  auto reduce_ready = [&](int64_t ready_bytes) {
    const int64_t ready = ready_bytes / element;
    combine_(slice(mine, reduced, ready), slice(theirs, reduced, ready), sum_or_op, /*other_first=*/peer == 0);
    reduced = ready;
  };
  std::vector<SocketLinks::Recv> recvs{{peer, theirs.data_ptr(), bytes, 0, reduce_ready, kSwapStepBytes, bytes}};
  h.links->exchange(comm.sequence(), std::move(sends), recvs);
  TORCH_INTERNAL_ASSERT(reduced == mine.numel());
}

// Between two hosts, sends `outgoing` (null: nothing) to the other host while its frame of exactly
// `incoming`'s size (undefined: none) arrives into `incoming`, both contiguous, over the socket links.
void move_across_two_hosts(const at::Tensor& outgoing, const at::Tensor& incoming, const Hierarchy& h,
                           Communicator& comm) {
  TORCH_INTERNAL_ASSERT(h.cross_size == 2);
  const int peer = 1 - h.cross_rank;
  std::vector<SocketLinks::Send> sends;
  if (outgoing.defined()) sends.push_back({peer, outgoing.data_ptr(), static_cast<int64_t>(outgoing.nbytes())});
  std::vector<SocketLinks::Recv> recvs;
  if (incoming.defined()) {
    const auto bytes = static_cast<int64_t>(incoming.nbytes());
    recvs.push_back({peer, incoming.data_ptr(), bytes, 0, nullptr, 0, bytes});
  }
  h.links->exchange(comm.sequence(), std::move(sends), recvs);
}

// The all-reduce of `block` (contiguous) among the ranks `h.cross` spans (one per host), in place
// (Note [Hierarchical collectives]): between two hosts a swap over the socket links, each host
// sending the other its block whole, both ways at once, then both reducing the two in host order (each
// link carries the block once each way, as a ring's reduce-scatter and all-gather together would);
// else gloo's own for sums, ddpkit's ring for max and min. A kMean is summed here; the caller
// divides once.
void cross_host_all_reduce(const at::Tensor& block, ReduceOp op, const Hierarchy& h, Communicator& comm) {
  if (h.cross_size == 1 || block.numel() == 0) return;
  across_hosts(h, comm, [&] {
    if (h.cross_size == 2) {
      const int peer = 1 - h.cross_rank;
      receive_and_combine_across_two_hosts(block, op, {{peer, block.data_ptr(), block.numel() * block.element_size()}},
                                           h, comm);
      return;
    }
    if (op == ReduceOp::kSum || op == ReduceOp::kMean) {
      c10d::AllreduceOptions options;
      options.reduceOp = c10d::ReduceOp::SUM;
      std::vector<at::Tensor> tensors{block};
      h.cross->allreduce(tensors, options)->wait();
      return;
    }
    Communicator cross = cross_communicator(h, comm);
    Schedule schedule = ring_schedule(block, op, h.cross_size, h.cross_rank);
    run_schedule(cross, schedule, schedule.size());
  });
}

// `flat` in one slice per rank of this host (Horovod's split), padded with zeros in a scratch buffer
// where the host's size does not divide it.
struct HostSlices {
  at::Tensor padded;  // `flat`, or its padded copy
  at::Tensor mine;    // this rank's slice of `padded`
};

// The host's reduce-scatter of `flat` (unchecked: the check already ran): this rank's slice then
// holds `op` over the host's slices.
HostSlices reduce_scatter_in_host(const at::Tensor& flat, ReduceOp op, const CollectiveHeader& header,
                                  const Hierarchy& h) {
  const int64_t parts = h.topology.local_size();
  const int64_t m = (flat.numel() + parts - 1) / parts;
  at::Tensor padded = flat;
  if (m * parts != flat.numel()) {
    padded = h.scratch.get(0, m * parts, flat.scalar_type());
    padded.narrow(0, 0, flat.numel()).copy_(flat);
    padded.narrow(0, flat.numel(), m * parts - flat.numel()).zero_();
  }
  HostSlices slices{padded, padded.narrow(0, h.topology.local_rank() * m, m)};
  if (h.local != nullptr) h.local->direct()->reduce_scatter(slices.mine, padded, op, header, {}, /*checked=*/false);
  return slices;
}

// The host's all-gather of its ranks' slices back into `flat` (unchecked).
void all_gather_in_host(const HostSlices& slices, const at::Tensor& flat, const CollectiveHeader& header,
                        const Hierarchy& h) {
  if (h.local != nullptr) h.local->direct()->all_gather(slices.padded, slices.mine, header, {}, /*checked=*/false);
  if (!slices.padded.is_same(flat)) flat.copy_(slices.padded.narrow(0, 0, flat.numel()));
}

// `flat` of cross rank `root` to the other ranks `h.cross` spans (one per host): between two hosts
// over the socket link, else ddpkit's binomial tree on that subgroup (every dtype alike: only bytes
// move).
void cross_host_broadcast(const at::Tensor& flat, int root, const Hierarchy& h, Communicator& comm) {
  if (h.cross_size == 1 || flat.numel() == 0) return;
  across_hosts(h, comm, [&] {
    if (h.cross_size == 2) {
      const bool sender = h.cross_rank == root;
      move_across_two_hosts(sender ? flat : at::Tensor(), sender ? at::Tensor() : flat, h, comm);
      return;
    }
    Communicator cross = cross_communicator(h, comm);
    Schedule schedule = broadcast_schedule(flat, h.cross_size, h.cross_rank, root);
    run_schedule(cross, schedule);
  });
}

// The group's rank at local-major position p = j·H + i of H equal hosts: local rank j of host i.
// The hierarchical all-gather and reduce-scatter hold the ranks' blocks in this order, so that the
// step across hosts moves one contiguous run of H blocks per local rank and the step inside the host
// the L runs.
int local_major_rank(const Topology& topology, int position) {
  const int hosts = static_cast<int>(topology.hosts.size());
  return topology.hosts[position % hosts][position / hosts];
}

// op over the `flat` of the ranks `h.cross` spans, into `flat` of cross rank `root`: between two
// hosts the other sends its `flat` over the socket link, else ddpkit's binomial reduce on the cross
// subgroup (the others keep partial results).
void cross_host_reduce(const at::Tensor& flat, int root, ReduceOp op, const Hierarchy& h, Communicator& comm) {
  if (h.cross_size == 1 || flat.numel() == 0) return;
  across_hosts(h, comm, [&] {
    if (h.cross_size == 2) {
      if (h.cross_rank == root) {
        receive_and_combine_across_two_hosts(flat, op, {}, h, comm);
      } else {
        move_across_two_hosts(flat, at::Tensor(), h, comm);
      }
      return;
    }
    Communicator cross = cross_communicator(h, comm);
    Schedule schedule = reduce_schedule(flat, op, h.cross_size, h.cross_rank, root);
    run_schedule(cross, schedule);
  });
}

// The blocks of `flat` (cross_size blocks of m bytes, this rank's at its cross rank) of every rank
// `h.cross` spans, into every rank's `flat`: between two hosts a swap of the blocks over the socket
// link, else ddpkit's ring all-gather on the cross subgroup, which over gloo's messages took well
// under half the time of gloo's own all-gather (bench_multihost.py's all_gather_into_tensor at 16M
// floats).
void cross_host_all_gather(const at::Tensor& flat, int64_t m, const Hierarchy& h, Communicator& comm) {
  if (h.cross_size == 1 || m == 0) return;
  across_hosts(h, comm, [&] {
    if (h.cross_size == 2) {
      const int peer = 1 - h.cross_rank;
      move_across_two_hosts(flat.narrow(0, h.cross_rank * m, m), flat.narrow(0, peer * m, m), h, comm);
      return;
    }
    Communicator cross = cross_communicator(h, comm);
    Schedule schedule = ring_all_gather_schedule(flat, m, h.cross_size, h.cross_rank);
    run_schedule(cross, schedule, schedule.size());
  });
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
  const ReduceOp sum_or_op = op == ReduceOp::kMean ? ReduceOp::kSum : op;
  // The host's result on every rank of the host, then to the center with the check's words; the
  // center reduces the hosts' results in host order and answers with the total: the same bits everywhere.
  const int64_t data_bytes = flat.numel() * static_cast<int64_t>(flat.element_size());
  auto payload = [&] {
    DDPKIT_DIE_IF_FAULT_ARMED("die_in_host_step", comm.rank());
    if (local != nullptr && flat.numel() > 0) {
      on_hosts(h, OnFailure::kKeepLinks,
               [&] { local->all_reduce(flat, sum_or_op, comm.stamp(header, {}), {}, /*checked=*/false); });
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
  const ReduceOp local_op = op == ReduceOp::kMean ? ReduceOp::kSum : op;
  // Unchecked steps: the group's check already ran over the process group.
  CollectiveHeader header = comm.stamp(make_header(CollectiveKind::kAllReduce, flat, local_op, Algorithm::kHierarchical, -1), {});
  on_hosts(h, OnFailure::kCutLinks, [&] {
    if (h.uniform) {
      // Horovod's split: reduce-scatter in the host, the slices across hosts, all-gather in the host.
      DDPKIT_DIE_IF_FAULT_ARMED("die_in_host_data_step", comm.rank());
      const HostSlices slices = reduce_scatter_in_host(flat, local_op, header, h);
      cross_host_all_reduce(slices.mine, op, h, comm);
      finish_reduction_(slices.mine, op, comm.size());
      all_gather_in_host(slices, flat, header, h);
    } else {
      // The leaders' form: all-reduce in the host, the leaders across hosts, broadcast in the host.
      at::Tensor whole = flat;
      if (local != nullptr) local->all_reduce(whole, local_op, header, {}, /*checked=*/false);
      if (topology.local_rank() == 0) {
        cross_host_all_reduce(whole, op, h, comm);
        finish_reduction_(whole, op, comm.size());
      }
      if (local != nullptr) local->broadcast(whole, 0, header, {}, /*checked=*/false);
    }
  });
}

void hierarchical_broadcast(const at::Tensor& flat, int root, const Hierarchy& h, Communicator& comm) {
  const Topology& topology = h.topology;
  DirectCollectives* local = h.local ? h.local->direct() : nullptr;
  const int root_host = topology.host_of[root];
  const int root_local = topology.local_rank_of(root);
  const CollectiveHeader header =
      comm.stamp(make_header(CollectiveKind::kBroadcast, flat, std::nullopt, Algorithm::kHierarchical, root), {});
  on_hosts(h, OnFailure::kCutLinks, [&] {
    if (h.uniform) {
      // The ranks of the root's local rank carry the tensor across hosts (cross rank = host), then
      // every host broadcasts it from that local rank over shared memory.
      if (topology.local_rank() == root_local) cross_host_broadcast(flat, root_host, h, comm);
      if (local != nullptr) local->broadcast(flat, root_local, header, {}, /*checked=*/false);
    } else {
      // The leaders' form: the root's host first (its leader among the receivers), the leaders
      // across hosts, then every other host from its leader.
      const bool root_side = topology.host() == root_host;
      if (root_side && local != nullptr) local->broadcast(flat, root_local, header, {}, /*checked=*/false);
      if (topology.local_rank() == 0) cross_host_broadcast(flat, root_host, h, comm);
      if (!root_side && local != nullptr) local->broadcast(flat, 0, header, {}, /*checked=*/false);
    }
  });
}

void hierarchical_reduce(const at::Tensor& flat, int root, ReduceOp op, const Hierarchy& h, Communicator& comm) {
  const Topology& topology = h.topology;
  DirectCollectives* local = h.local ? h.local->direct() : nullptr;
  const ReduceOp local_op = op == ReduceOp::kMean ? ReduceOp::kSum : op;
  const int root_host = topology.host_of[root];
  const bool root_side = topology.host() == root_host;
  const CollectiveHeader header =
      comm.stamp(make_header(CollectiveKind::kReduce, flat, local_op, Algorithm::kHierarchical, root), {});
  on_hosts(h, OnFailure::kCutLinks, [&] {
    if (h.uniform) {
      const HostSlices slices = reduce_scatter_in_host(flat, local_op, header, h);
      cross_host_reduce(slices.mine, root_host, local_op, h, comm);
      if (!root_side) return;
      finish_reduction_(slices.mine, op, comm.size());
      all_gather_in_host(slices, flat, header, h);
    } else {
      if (local != nullptr) local->all_reduce(const_cast<at::Tensor&>(flat), local_op, header, {}, /*checked=*/false);
      if (topology.local_rank() == 0) cross_host_reduce(flat, root_host, local_op, h, comm);
      if (!root_side) return;
      if (topology.local_rank() == 0) finish_reduction_(flat, op, comm.size());
      if (local != nullptr) local->broadcast(flat, 0, header, {}, /*checked=*/false);
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
  const CollectiveHeader header =
      comm.stamp(make_header(CollectiveKind::kAllGather, input, std::nullopt, Algorithm::kHierarchical, -1), {});
  on_hosts(h, OnFailure::kCutLinks, [&] {
    if (h.uniform && local == nullptr) {
      // One rank per host, numbered as the hosts: the ring runs in the output itself.
      if (!is_own_block(out, in, comm.rank())) block(out, comm.rank()).copy_(in);
      cross_host_all_gather(out, m, h, comm);
    } else if (h.uniform) {
      at::Tensor run = h.scratch.get(0, hosts * m, at::kByte);
      run.narrow(0, h.cross_rank * m, m).copy_(in);
      cross_host_all_gather(run, m, h, comm);
      at::Tensor gathered = h.scratch.get(1, comm.size() * m, at::kByte);
      local->all_gather(gathered, run, header, {}, /*checked=*/false);
      for (int p = 0; p < comm.size(); ++p) block(out, local_major_rank(topology, p)).copy_(block(gathered, p));
    } else {
      size_t widest = 0;
      for (const auto& ranks : topology.hosts) widest = std::max(widest, ranks.size());
      const int64_t run_bytes = static_cast<int64_t>(widest) * m;
      at::Tensor run = h.scratch.get(0, run_bytes, at::kByte);
      if (local != nullptr) {
        local->all_gather(run.narrow(0, 0, topology.local_size() * m), in, header, {}, /*checked=*/false);
      } else {
        block(run, 0).copy_(in);
      }
      if (topology.local_rank() == 0) {
        at::Tensor runs = h.scratch.get(1, hosts * run_bytes, at::kByte);
        runs.narrow(0, h.cross_rank * run_bytes, run_bytes).copy_(run);
        cross_host_all_gather(runs, run_bytes, h, comm);
        for (int i = 0; i < hosts; ++i) {
          for (size_t j = 0; j < topology.hosts[i].size(); ++j) {
            block(out, topology.hosts[i][j]).copy_(block(runs, static_cast<int64_t>(i * widest + j)));
          }
        }
      }
      if (local != nullptr) local->broadcast(out, 0, header, {}, /*checked=*/false);
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
  const ReduceOp local_op = op == ReduceOp::kMean ? ReduceOp::kSum : op;
  const auto options = output.options().dtype(working_dtype(output));
  const CollectiveHeader header =
      comm.stamp(make_header(CollectiveKind::kReduceScatter, output, local_op, Algorithm::kHierarchical, -1), {});
  at::Tensor result;
  if (h.uniform) {
    const at::Tensor blocks = input.reshape({n, m});
    at::Tensor ordered = h.scratch.get(0, n * m, options.dtype().toScalarType());
    for (int p = 0; p < n; ++p) slice(ordered, p * m, (p + 1) * m).copy_(blocks[local_major_rank(topology, p)]);
    at::Tensor run = local != nullptr ? h.scratch.get(1, hosts * m, options.dtype().toScalarType()) : ordered;
    on_hosts(h, OnFailure::kCutLinks, [&] {
      if (local != nullptr) local->reduce_scatter(run, ordered, local_op, header, {}, /*checked=*/false);
      if (m == 0) return;
      across_hosts(h, comm, [&] {
        if (h.cross_size == 2) {  // each host sends the other its block of the run, and reduces its own
          const int peer = 1 - h.cross_rank;
          const at::Tensor theirs = slice(run, peer * m, (peer + 1) * m);
          const at::Tensor mine = slice(run, h.cross_rank * m, (h.cross_rank + 1) * m);
          receive_and_combine_across_two_hosts(
              mine, local_op, {{peer, theirs.data_ptr(), static_cast<int64_t>(theirs.nbytes())}}, h, comm);
          return;
        }
        Communicator cross = cross_communicator(h, comm);
        Schedule schedule = ring_reduce_scatter_schedule(run, m, local_op, h.cross_size, h.cross_rank);
        run_schedule(cross, schedule);
      });
    });
    result = slice(run, h.cross_rank * m, (h.cross_rank + 1) * m);
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
  on_hosts(h, OnFailure::kCutLinks,
           [&] { h.local->direct()->broadcast(bytes, root_local, comm.stamp(header, {}), {}, /*checked=*/false); });
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
  const at::Tensor run = reply.narrow(0, 0, h.cross_size * m);
  at::Tensor gathered = run;
  if (h.local != nullptr) {
    gathered = h.scratch.get(0, comm.size() * m, at::kByte);
    on_hosts(h, OnFailure::kCutLinks,
             [&] { h.local->direct()->all_gather(gathered, run, comm.stamp(header, {}), {}, /*checked=*/false); });
  }
  for (int p = 0; p < comm.size(); ++p) {
    out.narrow(0, local_major_rank(topology, p) * m, m).copy_(gathered.narrow(0, p * m, m));
  }
}

}  // namespace ddpkit::comm
