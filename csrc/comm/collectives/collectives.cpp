#include "comm/collectives/collectives.h"

#include "comm/collectives/routes.h"
#include "comm/core/arguments.h"
#include "comm/hierarchy/one_round.h"
#include "comm/reduction/reduce_kernel.h"
#include "comm/schedules/schedules.h"

#include <optional>
#include <string>
#include <vector>

namespace ddpkit::comm {
namespace {

// True when `tensor` lives on a device whose messages travel through host copies (Note [Device
// tensors on a host group]): the engine then gave the collective a CPU communicator.
bool staged(const at::Tensor& tensor, const Communicator& comm) {
  return tensor.defined() && tensor.device().type() != comm.device_type();
}

// A host copy of `tensor`, in pinned memory when it comes from a CUDA device: the driver copies
// pageable memory through a pinned bounce buffer of its own, so a pinned target is the faster copy
// both ways (gloo stages CUDA tensors in pinned memory too). The blocks come from torch's caching
// host allocator, so a warm DDP step allocates none. bench_ddp.py --device cuda measures it.
at::Tensor to_host(const at::Tensor& tensor) {
  if (!tensor.defined()) return tensor;
  if (!tensor.is_cuda()) return tensor.to(at::kCPU);
  at::Tensor host = at::empty_like(tensor, tensor.options().device(at::kCPU).pinned_memory(true));
  host.copy_(tensor);
  return host;
}

// The bytes of `tensor` as it is, or in the dtype it is reduced in; 0 where this rank rejected its
// arguments (`error`: the tensor may be undefined).
int64_t bytes_of(const at::Tensor& tensor, const std::string& error) {
  return error.empty() ? tensor.numel() * static_cast<int64_t>(tensor.element_size()) : 0;
}
int64_t working_bytes_of(const at::Tensor& tensor, const std::string& error) {
  return error.empty() ? tensor.numel() * static_cast<int64_t>(working_element_size(tensor)) : 0;
}

// Runs `collective` on a host copy of `tensor`, then copies the result back into `tensor`.
template <class Collective>
void on_host_copy(at::Tensor& tensor, Collective&& collective) {
  at::Tensor host = to_host(tensor);
  collective(host);
  tensor.copy_(host);
}

// The all-reduce schedule of `algorithm` and how many rounds of receives it posts ahead: all of the
// ring's (Note [Ring receives up front]), one round of the others' (Note [Pre-posted receives]).
Schedule all_reduce_schedule(Algorithm algorithm, const at::Tensor& flat, ReduceOp op, int n, int r,
                             size_t& look_ahead) {
  look_ahead = 1;
  switch (algorithm) {
    case Algorithm::kRing: {
      Schedule schedule = ring_schedule(flat, op, n, r);
      look_ahead = schedule.size();
      return schedule;
    }
    case Algorithm::kButterfly: return butterfly_schedule(flat, op, n, r);
    case Algorithm::kStar: return star_schedule(flat, op, n, r);
    case Algorithm::kGatherScatter: return gather_scatter_schedule(flat, op, n, r);
    case Algorithm::kRecursiveDoubling: return recursive_doubling_schedule(flat, op, n, r);
    case Algorithm::kHalvingDoubling: return halving_doubling_schedule(flat, op, n, r);
    case Algorithm::kAuto:
    case Algorithm::kDirect:
    case Algorithm::kHierarchical:
    case Algorithm::kProcessGroup: break;
  }
  TORCH_INTERNAL_ASSERT(false, "no schedule for algorithm ", algorithm_name(algorithm));
}

}  // namespace

// Every entry point below: arguments checked into `error` (core/arguments.h), its route chosen once
// (Note [Routes]), then the route run. Routes whose check rides with the data (kTransportCollective, kOneRound)
// run whole; the others take the check (Communicator::begin), then move data.

void all_reduce_(at::Tensor& tensor, ReduceOp op, Algorithm algorithm, Communicator& comm) {
  if (staged(tensor, comm)) {
    return on_host_copy(tensor, [&](at::Tensor& host) { all_reduce_(host, op, algorithm, comm); });
  }
  std::string error = tensor_error(tensor, comm.what(), op);
  const RouteChoice route = choose_route(
      {CollectiveKind::kAllReduce, algorithm, bytes_of(tensor, error), working_bytes_of(tensor, error), op}, comm,
      error);
  const CollectiveHeader header = make_header(CollectiveKind::kAllReduce, tensor, op, algorithm, -1);
  if (route.route == Route::kTransportCollective) {
    // Note [Direct all-reduce]: the header check rides in the transport's first step, no messages.
    at::Tensor work = error.empty() ? working_copy(tensor) : at::Tensor();
    at::Tensor flat = work.defined() ? work.view(-1) : work;
    comm.run_direct(header, error, [&](DirectCollectives& direct) { direct.all_reduce(flat, op, comm.what()); });
    write_back(tensor, work);
    return;
  }
  if (route.route == Route::kOneRound) {
    return hierarchical_all_reduce_in_one_round(tensor, op, header, *comm.hierarchy(), comm);
  }
  // Across hosts of one rank each (two, or more on long paths), the check rides in front of the first
  // frames of the steps across hosts (Note [A check in front of the swap] in checks/cross_host_check.h).
  const bool check_in_front = route.route == Route::kHostSteps && comm.check_rides_in_front_of_steps();
  if (check_in_front) {
    comm.begin_in_front_of_steps(header, error);
  } else {
    // The group's own all-reduce asked for by name is the unchecked baseline (Note [Choosing an algorithm]).
    comm.begin(header, error, /*exchange_header=*/algorithm != Algorithm::kProcessGroup);
  }
  const int n = comm.size();
  if (tensor.numel() == 0 || n == 1) {
    comm.settle_header();
    return;
  }
  at::Tensor work = working_copy(tensor);
  at::Tensor flat = work.view(-1);
  if (route.route == Route::kHostSteps) {
    if (!check_in_front) comm.settle_header();
    comm.hierarchy()->form->all_reduce(flat, op, comm);
  } else if (route.route == Route::kBackendCollective) {
    comm.settle_header();
    comm.process_group_all_reduce(work, op)->wait();
    finish_reduction_(work, op, n);
  } else {
    size_t look_ahead = 1;
    Schedule schedule = all_reduce_schedule(route.algorithm, flat, op, n, comm.rank(), look_ahead);
    run_schedule(comm, schedule, look_ahead);
  }
  write_back(tensor, work);
}

void broadcast_(at::Tensor& tensor, int src, Communicator& comm) {
  if (staged(tensor, comm)) return on_host_copy(tensor, [&](at::Tensor& host) { broadcast_(host, src, comm); });
  const int n = comm.size();
  std::string error = tensor_error(tensor, comm.what(), std::nullopt);
  if (error.empty()) error = root_error(src, n, comm.what(), "src");
  const int64_t bytes = bytes_of(tensor, error);
  const RouteChoice route = choose_route({CollectiveKind::kBroadcast, Algorithm::kAuto, bytes, bytes}, comm, error);
  const CollectiveHeader header = make_header(CollectiveKind::kBroadcast, tensor, std::nullopt, std::nullopt, src);
  if (route.route == Route::kOneRound) {
    return hierarchical_broadcast_in_one_round(tensor, src, header, *comm.hierarchy(), comm);
  }
  comm.begin(header, error);
  if (n == 1 || tensor.numel() == 0) {
    comm.settle_header();
    return;
  }
  if (route.route == Route::kHostSteps) {
    comm.settle_header();
    // The tensor itself, whatever its dtype: a broadcast moves bytes, and a float32 working copy of a
    // float16/bfloat16 tensor would rewrite its NaNs' bits on every rank, the root's too.
    return comm.hierarchy()->form->broadcast(tensor.view(-1), src, comm);
  }
  Schedule schedule = broadcast_schedule(tensor, n, comm.rank(), src);
  run_schedule(comm, schedule);
}

void reduce_(at::Tensor& tensor, int dst, ReduceOp op, Communicator& comm) {
  if (staged(tensor, comm)) return on_host_copy(tensor, [&](at::Tensor& host) { reduce_(host, dst, op, comm); });
  const int n = comm.size();
  std::string error = tensor_error(tensor, comm.what(), op);
  if (error.empty()) error = root_error(dst, n, comm.what(), "dst");
  const int64_t working_bytes = working_bytes_of(tensor, error);
  const RouteChoice route =
      choose_route({CollectiveKind::kReduce, Algorithm::kAuto, working_bytes, working_bytes, op}, comm, error);
  const CollectiveHeader header = make_header(CollectiveKind::kReduce, tensor, op, std::nullopt, dst);
  if (route.route == Route::kOneRound) {
    // Each host's share crosses once, check included: the all-reduce, of which dst keeps the result.
    return hierarchical_all_reduce_in_one_round(tensor, op, header, *comm.hierarchy(), comm);
  }
  comm.begin(header, error);
  if (tensor.numel() == 0) {
    comm.settle_header();
    return;
  }
  at::Tensor work = working_copy(tensor);
  at::Tensor flat = work.view(-1);
  if (route.route == Route::kHostSteps) {
    comm.settle_header();
    comm.hierarchy()->form->reduce(flat, dst, op, comm);
  } else {
    Schedule schedule = reduce_schedule(flat, op, n, comm.rank(), dst);
    run_schedule(comm, schedule);
    if (comm.rank() == dst) finish_reduction_(flat, op, n);
  }
  write_back(tensor, work);
}

at::Tensor gather(const at::Tensor& tensor, int dst, Communicator& comm) {
  if (staged(tensor, comm)) return gather(to_host(tensor), dst, comm).to(tensor.device());
  const int n = comm.size();
  at::Tensor gathered;
  std::vector<at::Tensor> rows;
  if (comm.rank() == dst && tensor.defined()) {
    std::vector<int64_t> shape{n};
    shape.insert(shape.end(), tensor.sizes().begin(), tensor.sizes().end());
    gathered = at::empty(shape, tensor.options());
    for (int peer = 0; peer < n; ++peer) rows.push_back(gathered[peer]);
  } else {
    gathered = at::empty({0}, tensor.defined() ? tensor.options() : at::TensorOptions());
  }
  gather_into(rows, tensor, dst, comm);
  return gathered;
}

void gather_into(std::vector<at::Tensor>& outputs, const at::Tensor& tensor, int dst, Communicator& comm) {
  const int n = comm.size();
  std::string error = tensor_error(tensor, comm.what(), std::nullopt);
  if (error.empty()) error = root_error(dst, n, comm.what(), "dst");
  if (error.empty() && comm.rank() == dst) {
    bool matching = static_cast<int>(outputs.size()) == n;
    for (const auto& out : outputs) {
      matching = matching && out.defined() && out.numel() == tensor.numel() &&
                 out.scalar_type() == tensor.scalar_type() && out.device() == tensor.device();
    }
    if (!matching) {
      error = c10::str("ddpkit.", comm.what(), ": on dst the outputs must be ", n, " tensors of ", tensor.numel(),
                       " elements, dtype ", tensor.scalar_type(), " and device ", tensor.device());
    }
  }
  const RouteChoice route = choose_route({CollectiveKind::kGather}, comm, error);
  TORCH_INTERNAL_ASSERT(route.route == Route::kSchedule);
  comm.begin(make_header(CollectiveKind::kGather, tensor, std::nullopt, std::nullopt, dst), error);
  Round round;
  // Received into contiguous stand-ins where an output is not contiguous, copied over after.
  std::vector<std::pair<at::Tensor, at::Tensor>> copy_back;
  if (comm.rank() == dst) {
    for (int peer = 0; peer < n; ++peer) {
      at::Tensor out = outputs[peer];
      if (peer == dst) continue;
      at::Tensor target = out.is_contiguous() ? out : at::empty(out.sizes(), out.options());
      if (!target.is_same(out)) copy_back.emplace_back(out, target);
      round.recvs.push_back({target, peer});
    }
  } else {
    round.sends.push_back({tensor, dst});
  }
  Schedule schedule{round};
  run_schedule(comm, schedule);
  for (auto& [out, target] : copy_back) out.copy_(target);
  if (comm.rank() == dst) outputs[dst].copy_(tensor.view(outputs[dst].sizes()));
}

void scatter_(at::Tensor& output, const at::Tensor& chunks, int src, Communicator& comm) {
  if (staged(output, comm)) {
    // Chunks on another device than the output stay where they are, for scatter_'s own check to reject.
    const at::Tensor host_chunks = chunks.defined() && chunks.device() == output.device() ? to_host(chunks) : chunks;
    return on_host_copy(output, [&](at::Tensor& host) { scatter_(host, host_chunks, src, comm); });
  }
  const int n = comm.size();
  std::vector<at::Tensor> rows;
  std::string error;
  if (comm.rank() == src && output.defined()) {
    std::vector<int64_t> expected{n};
    expected.insert(expected.end(), output.sizes().begin(), output.sizes().end());
    if (!chunks.defined() || chunks.sizes() != c10::IntArrayRef(expected) ||
        chunks.scalar_type() != output.scalar_type() || chunks.device() != output.device()) {
      error = c10::str("ddpkit.", comm.what(), ": on src the chunks must have shape ", c10::IntArrayRef(expected),
                       ", dtype ", output.scalar_type(), " and device ", output.device());
    } else {
      const at::Tensor contiguous = chunks.contiguous();
      for (int peer = 0; peer < n; ++peer) rows.push_back(contiguous[peer]);
    }
  }
  scatter_from(output, rows, src, comm, error);
}

void scatter_from(at::Tensor& output, const std::vector<at::Tensor>& inputs, int src, Communicator& comm,
                  std::string error) {
  const int n = comm.size();
  if (error.empty()) error = tensor_error(output, comm.what(), std::nullopt);
  if (error.empty()) error = root_error(src, n, comm.what(), "src");
  if (error.empty() && comm.rank() == src) {
    bool matching = static_cast<int>(inputs.size()) == n;
    for (const auto& in : inputs) {
      matching = matching && in.defined() && in.numel() == output.numel() && in.scalar_type() == output.scalar_type() &&
                 in.device() == output.device();
    }
    if (!matching) {
      error = c10::str("ddpkit.", comm.what(), ": on src the inputs must be ", n, " tensors of ", output.numel(),
                       " elements, dtype ", output.scalar_type(), " and device ", output.device());
    }
  }
  const RouteChoice route = choose_route({CollectiveKind::kScatter}, comm, error);
  TORCH_INTERNAL_ASSERT(route.route == Route::kSchedule);
  comm.begin(make_header(CollectiveKind::kScatter, output, std::nullopt, std::nullopt, src), error);
  Round round;
  if (comm.rank() == src) {
    for (int peer = 0; peer < n; ++peer) {
      if (peer != src) round.sends.push_back({inputs[peer].contiguous(), peer});
    }
  } else {
    round.recvs.push_back({output, src});
  }
  Schedule schedule{round};
  run_schedule(comm, schedule);
  if (comm.rank() == src) output.copy_(inputs[src].reshape(output.sizes()));
}

void all_gather_into_tensor_(at::Tensor& output, const at::Tensor& input, Algorithm algorithm, Communicator& comm) {
  if (staged(output, comm)) {
    const at::Tensor host_input = input.device() == output.device() ? to_host(input) : input;
    return on_host_copy(output, [&](at::Tensor& host) { all_gather_into_tensor_(host, host_input, algorithm, comm); });
  }
  const int n = comm.size();
  const int r = comm.rank();
  std::string error = gather_scatter_error(output, input, n, r, /*gather=*/true, std::nullopt, comm.what());
  const int64_t bytes = bytes_of(input, error);
  const RouteChoice route = choose_route({CollectiveKind::kAllGather, algorithm, bytes, bytes}, comm, error);
  const CollectiveHeader header = make_header(CollectiveKind::kAllGather, input, std::nullopt, algorithm, -1);
  if (route.route == Route::kTransportCollective) {
    const bool accepted = error.empty();  // a rank that rejected its arguments moves nothing
    comm.run_direct(header, error, [&](DirectCollectives& direct) {
      direct.all_gather(accepted ? output : at::Tensor(), accepted ? input : at::Tensor(), comm.what());
    });
    return;
  }
  if (route.route == Route::kOneRound) {
    return hierarchical_all_gather_in_one_round(output, input, header, *comm.hierarchy(), comm);
  }
  comm.begin(header, error);
  if (route.route == Route::kHostSteps) {
    comm.settle_header();
    if (input.numel() > 0) comm.hierarchy()->form->all_gather(output, input, comm);
    return;
  }
  const int64_t m = input.numel();
  at::Tensor flat = output.view(-1);
  if (m > 0 && !is_own_block(output, input, r)) slice(flat, r * m, (r + 1) * m).copy_(input.reshape(-1));
  if (n == 1 || m == 0) {
    comm.settle_header();
    return;
  }
  Schedule schedule = route.algorithm == Algorithm::kHalvingDoubling ? doubling_all_gather_schedule(flat, m, n, r)
                                                                     : ring_all_gather_schedule(flat, m, n, r);
  // All receives may be posted up front (Note [Ring receives up front] holds for both).
  run_schedule(comm, schedule, schedule.size());
}

void reduce_scatter_tensor_(at::Tensor& output, const at::Tensor& input, ReduceOp op, Algorithm algorithm,
                            Communicator& comm) {
  if (staged(output, comm)) {
    const at::Tensor host_input = input.device() == output.device() ? to_host(input) : input;
    return on_host_copy(output,
                        [&](at::Tensor& host) { reduce_scatter_tensor_(host, host_input, op, algorithm, comm); });
  }
  const int n = comm.size();
  const int r = comm.rank();
  std::string error = gather_scatter_error(output, input, n, r, /*gather=*/false, op, comm.what());
  const RouteChoice route = choose_route(
      {CollectiveKind::kReduceScatter, algorithm, bytes_of(input, error), working_bytes_of(input, error), op}, comm,
      error);
  const CollectiveHeader header = make_header(CollectiveKind::kReduceScatter, output, op, algorithm, -1);
  // float16/bfloat16 are reduced in float32, like every reduction (collectives/collectives.h).
  const bool narrow_float =
      error.empty() && (output.scalar_type() == at::kHalf || output.scalar_type() == at::kBFloat16);
  if (route.route == Route::kTransportCollective) {
    const bool accepted = error.empty();  // a rank that rejected its arguments moves nothing
    const at::Tensor work_in = !accepted ? at::Tensor() : narrow_float ? input.to(at::kFloat) : input;
    at::Tensor work_out = !accepted      ? at::Tensor()
                          : narrow_float ? at::empty(output.sizes(), output.options().dtype(at::kFloat))
                                         : output;
    comm.run_direct(header, error,
                    [&](DirectCollectives& direct) { direct.reduce_scatter(work_out, work_in, op, comm.what()); });
    write_back(output, work_out);
    return;
  }
  if (route.route == Route::kOneRound) {
    // The one-round all-reduce of a copy of the whole input, of which this rank keeps its block.
    const at::Tensor whole = input.reshape(-1).to(working_dtype(input), false, /*copy=*/true);
    hierarchical_all_reduce_in_one_round(whole, op, header, *comm.hierarchy(), comm);
    output.view(-1).copy_(whole.narrow(0, r * output.numel(), output.numel()));
    return;
  }
  if (route.route == Route::kHostSteps && comm.check_rides_in_front_of_steps()) {
    // The check rides in front of the first frames of the steps across hosts (Note [A check in front
    // of the swap] in checks/cross_host_check.h), or crosses alone where they cannot carry it.
    comm.begin_in_front_of_steps(header, error);
    if (output.numel() > 0) comm.hierarchy()->form->reduce_scatter(output, input, op, comm);
    comm.settle_header();
    return;
  }
  comm.begin(header, error);
  if (route.route == Route::kHostSteps) {
    comm.settle_header();
    if (output.numel() > 0) comm.hierarchy()->form->reduce_scatter(output, input, op, comm);
    return;
  }
  const int64_t m = output.numel();
  if (m == 0) {
    comm.settle_header();
    return;
  }
  // A private working copy: the input stays unchanged and the partial sums accumulate here.
  at::Tensor acc = narrow_float ? input.reshape(-1).to(at::kFloat) : input.reshape(-1).clone();
  auto block = [&](int b) { return slice(acc, ((b % n + n) % n) * m, ((b % n + n) % n + 1) * m); };
  if (n > 1) {
    Schedule schedule = route.algorithm == Algorithm::kHalvingDoubling
                            ? halving_reduce_scatter_schedule(acc, m, op, n, r)
                            : ring_reduce_scatter_schedule(acc, m, op, n, r);
    run_schedule(comm, schedule);
  } else {
    comm.settle_header();
  }
  at::Tensor mine = block(r);
  finish_reduction_(mine, op, n);
  output.view(-1).copy_(mine);
}

void all_to_all_(std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& inputs, Communicator& comm) {
  const int n = comm.size();
  const int r = comm.rank();
  std::string error;
  if (static_cast<int>(outputs.size()) != n || static_cast<int>(inputs.size()) != n) {
    error = c10::str("ddpkit.", comm.what(), ": expected ", n, " input and output tensors (one per rank), got ",
                     inputs.size(), " and ", outputs.size());
  }
  for (size_t j = 0; error.empty() && j < inputs.size(); ++j) {
    error = tensor_error(inputs[j], comm.what(), std::nullopt);
    if (error.empty()) error = tensor_error(outputs[j], comm.what(), std::nullopt);
    if (error.empty() &&
        (inputs[j].scalar_type() != inputs[0].scalar_type() || outputs[j].scalar_type() != inputs[0].scalar_type())) {
      error = c10::str("ddpkit.", comm.what(), ": every input and output must have one dtype, got ",
                       inputs[j].scalar_type(), " and ", outputs[j].scalar_type(), " beside ", inputs[0].scalar_type());
    }
    if (error.empty() && j == static_cast<size_t>(r) && outputs[j].numel() != inputs[j].numel()) {
      error = c10::str("ddpkit.", comm.what(), ": this rank sends itself ", inputs[j].numel(), " elements but expects ",
                       outputs[j].numel(), " from itself (split sizes that disagree)");
    }
    if (error.empty() && inputs[j].device() != comm.device_type()) {
      error = c10::str("ddpkit.", comm.what(), ": expected ", c10::DeviceTypeName(comm.device_type(), true),
                       " tensors, got ", inputs[j].device());
    }
  }
  CollectiveHeader header;
  header.kind = static_cast<int64_t>(CollectiveKind::kAllToAll);
  header.numel = n;  // the sizes of the pairs differ legitimately; the count of tensors does not
  header.dtype = error.empty() && !inputs.empty() ? static_cast<int64_t>(inputs[0].scalar_type()) : -1;
  const RouteChoice route = choose_route({CollectiveKind::kAllToAll}, comm, error);
  TORCH_INTERNAL_ASSERT(route.route == Route::kSchedule);
  comm.begin(header, error);
  if (outputs[r].numel() > 0) outputs[r].copy_(inputs[r]);
  Round round;
  for (int peer = 0; peer < n; ++peer) {
    if (peer == r) continue;
    round.sends.push_back({inputs[peer], peer});
    round.recvs.push_back({outputs[peer], peer});
  }
  Schedule schedule{round};
  run_schedule(comm, schedule);
}

void barrier(Communicator& comm) {
  CollectiveHeader header;
  header.kind = static_cast<int64_t>(CollectiveKind::kBarrier);
  std::string error;
  const RouteChoice route = choose_route({CollectiveKind::kBarrier}, comm, error);
  if (route.route == Route::kOneRound) {
    // A step of every host's shared memory, then a round through a center among the ranks of each
    // local rank, which completes only once every host's step has (Note [One round across hosts]).
    comm.begin(header);
    return;
  }
  if (route.route == Route::kTransportCollective) {
    comm.run_direct(header, {}, [&](DirectCollectives& direct) { direct.barrier(comm.what()); });
    return;
  }
  comm.begin(header);
  if (comm.size() == 1) {
    comm.settle_header();
    return;
  }
  // Everyone reports to rank 0, which answers everyone once all have reported.
  at::Tensor token = at::zeros({comm.size()}, at::kByte);
  Round in, out;
  in.tag = 0;
  out.tag = 1;
  for (int peer = 1; peer < comm.size(); ++peer) {
    if (comm.rank() == 0) {
      in.recvs.push_back({token.narrow(0, peer, 1), peer});
      out.sends.push_back({token.narrow(0, 0, 1), peer});
    }
  }
  if (comm.rank() != 0) {
    in.sends.push_back({token.narrow(0, 0, 1), 0});
    out.recvs.push_back({token.narrow(0, 1, 1), 0});
  }
  Schedule schedule{in, out};
  run_schedule(comm, schedule);
}

void reject(CollectiveKind kind, const std::string& error, Communicator& comm) {
  TORCH_INTERNAL_ASSERT(!error.empty());
  CollectiveHeader header;
  header.kind = static_cast<int64_t>(kind);
  comm.begin(header, error);
  comm.settle_header();
  TORCH_INTERNAL_ASSERT(false, "a rejected collective returned");
}

void meta_collective(CollectiveKind kind, const at::Tensor& tensor, std::optional<ReduceOp> op,
                     std::optional<Algorithm> algorithm, int root, Communicator& comm, std::string error) {
  const std::string_view what = comm.what();
  if (error.empty() && root != -1)
    error = root_error(root, comm.size(), what,
                       kind == CollectiveKind::kGather || kind == CollectiveKind::kReduce ? "dst" : "src");
  CollectiveHeader header = make_header(kind, tensor, op, algorithm, root);
  header.meta = 1;
  comm.begin(header, error);
  comm.settle_header();
}

}  // namespace ddpkit::comm
