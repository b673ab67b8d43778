#include "backend/backend.h"

#include "comm/call_timeout.h"
#include "comm/collectives.h"

#include <algorithm>
#include <cctype>
#include <optional>

namespace ddpkit::backend {
namespace {

// ddpkit's own reduction for torch's `op` on `tensor`, or nullopt when the op or the dtype is one
// ddpkit does not reduce (then gloo does; Note [The ddpkit backend]).
std::optional<comm::ReduceOp> own_reduction(const c10d::ReduceOp& op, const at::Tensor& tensor) {
  if (!tensor.defined() || tensor.layout() != at::kStrided) return std::nullopt;
  switch (tensor.scalar_type()) {
    case at::kFloat:
    case at::kDouble:
    case at::kHalf:
    case at::kBFloat16:
    case at::kInt:
    case at::kLong: break;
    default: return std::nullopt;
  }
  switch (op.op_) {
    case c10d::ReduceOp::SUM: return comm::ReduceOp::kSum;
    case c10d::ReduceOp::AVG: return comm::ReduceOp::kMean;
    case c10d::ReduceOp::MAX: return comm::ReduceOp::kMax;
    case c10d::ReduceOp::MIN: return comm::ReduceOp::kMin;
    default: return std::nullopt;
  }
}

// The header of a collective handed to gloo: what its peers compare it with (Note [Collective checks]).
comm::CollectiveHeader delegated_header(comm::CollectiveKind kind, const at::Tensor& tensor,
                                        std::optional<c10d::ReduceOp> op, int64_t root = -1) {
  comm::CollectiveHeader header;
  header.kind = static_cast<int64_t>(kind);
  header.numel = tensor.defined() ? (tensor.is_sparse() ? -1 : tensor.numel()) : 0;
  header.dtype = tensor.defined() ? static_cast<int64_t>(tensor.scalar_type()) : -1;
  header.op = op ? comm::kDelegatedOp + static_cast<int64_t>(op->op_) : -1;
  header.root = root;
  return header;
}

int64_t total_numel(const std::vector<at::Tensor>& tensors) {
  int64_t total = 0;
  for (const auto& t : tensors) total += t.numel();
  return total;
}

// torch's Python API passes exactly one tensor per rank; the multi-tensor forms are gone from it.
void check_single(const std::vector<at::Tensor>& tensors, std::string_view what) {
  TORCH_CHECK(tensors.size() == 1, "ddpkit backend: ", what, " takes one tensor per rank, got ", tensors.size());
}

void check_cpu(const at::Tensor& tensor, std::string_view what) {
  TORCH_CHECK(!tensor.defined() || tensor.device().is_cpu(), "ddpkit backend: ", what, " got a tensor on ",
              tensor.device(),
              "; the ddpkit backend carries CPU tensors: use backend=\"cpu:ddpkit,cuda:nccl\" for CUDA tensors");
}

void check_cpu(const std::vector<at::Tensor>& tensors, std::string_view what) {
  for (const auto& t : tensors) check_cpu(t, what);
}

// Why `checks` (a function of TORCH_CHECKs on this rank's arguments) fails, or "" when it passes.
// The backend never raises before a collective is numbered: a rank whose arguments fail rejects them
// inside the collective (Backend::reject), so that every rank raises and the next calls pair.
template <class Checks>
std::string error_of(Checks&& checks) {
  try {
    checks();
    return {};
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
}

// TORCH_CHECKs that `list` (an all-gather's outputs, a reduce-scatter's inputs) holds one tensor per
// rank of a group of `n`, each with `single`'s dtype and number of elements.
void check_output_list(const std::vector<at::Tensor>& list, const at::Tensor& single, int n, std::string_view what) {
  TORCH_CHECK(static_cast<int>(list.size()) == n, "ddpkit backend: ", what,
              " takes a list of one tensor per rank of the group (", n, "), got ", list.size());
  for (size_t i = 0; i < list.size(); ++i) {
    TORCH_CHECK(list[i].numel() == single.numel() && list[i].scalar_type() == single.scalar_type(),
                "ddpkit backend: ", what, "'s tensor ", i, " of the list has ", list[i].numel(), " elements of ",
                list[i].scalar_type(), ", expected ", single.numel(), " of ", single.scalar_type());
  }
}

// Runs `body` on `tensor`, or, where it is not contiguous, on a contiguous copy whose result is then
// copied back: the element-wise collectives (all-reduce, broadcast, reduce) take any layout, as gloo's
// do for a channels_last or transposed tensor (ZeroRedundancyOptimizer broadcasts parameters as they
// are), and their result does not depend on it; so do the outputs of scatter and reduce_scatter.
template <class Body>
void on_contiguous(at::Tensor& tensor, Body&& body) {
  if (tensor.is_contiguous()) return body(tensor);
  at::Tensor work = tensor.contiguous();
  body(work);
  tensor.copy_(work);
}

// The concatenation of `tensors`, flattened, as one contiguous vector (empty when there are none).
at::Tensor flat_cat(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> flat;
  flat.reserve(tensors.size());
  for (const auto& t : tensors) flat.push_back(t.reshape(-1));
  return at::cat(flat);
}

}  // namespace

Backend::Backend(c10::intrusive_ptr<c10d::Store> store, int rank, int size, std::chrono::milliseconds timeout,
                 c10::intrusive_ptr<c10d::Backend> gloo, c10::intrusive_ptr<c10d::Backend> gloo_p2p)
    : c10d::Backend(rank, size),
      store_(std::move(store)),
      gloo_(std::move(gloo)),
      gloo_p2p_(std::move(gloo_p2p)),
      options_(c10::make_intrusive<Options>("ddpkit", timeout)),
      transport_(comm::parse_transport("auto")) {
  for (const auto& inner : {gloo_, gloo_p2p_}) {
    TORCH_CHECK(inner, "ddpkit backend: needs two inner gloo backends");
    TORCH_CHECK(inner->getRank() == rank && inner->getSize() == size, "ddpkit backend: an inner gloo backend has rank ",
                inner->getRank(), " of ", inner->getSize(), ", expected ", rank, " of ", size);
  }
}

std::shared_ptr<comm::Engine> Backend::engine() {
  std::lock_guard<std::mutex> lock(engine_mutex_);
  if (!engine_) {
    comm::EngineGroup group;
    group.name = getGroupUid().empty() ? std::string("ddpkit") : getGroupUid();
    group.rank = getRank();
    group.size = getSize();
    group.store = [store = store_]() { return store; };
    group.backend = [gloo = gloo_](c10::DeviceType device) {
      TORCH_CHECK(device == c10::kCPU, "ddpkit backend: carries CPU tensors only, got ",
                  c10::DeviceTypeName(device, /*lower_case=*/true),
                  " tensors; use backend=\"cpu:ddpkit,cuda:nccl\" for a group with CUDA tensors");
      return gloo;
    };
    engine_ = comm::Engine::create(std::move(group));
  }
  return engine_;
}

c10::intrusive_ptr<c10d::Work> Backend::launch(c10d::OpType type, bool async, std::vector<at::Tensor> outputs,
                                               comm::Engine::Body body) {
  collectives_launched_.fetch_add(1);
  auto engine = this->engine();
  std::string what = c10d::opTypeToString(type);  // "ALLREDUCE": errors say "ddpkit.allreduce"
  std::transform(what.begin(), what.end(), what.begin(), [](unsigned char c) { return std::tolower(c); });
  if (async) return engine->submit(c10::kCPU, transport_, what, std::move(body), type, std::move(outputs));
  engine->run(c10::kCPU, transport_, what, body);
  auto work = c10::make_intrusive<comm::CollectiveWork>(getRank(), type, std::move(outputs));
  work->complete(nullptr);
  return work;
}

c10::intrusive_ptr<c10d::Work> Backend::reject(c10d::OpType type, bool async, comm::CollectiveKind kind,
                                               std::string error) {
  return launch(type, async, {},
                [kind, error = std::move(error)](comm::Communicator& comm) { comm::reject(kind, error, comm); });
}

c10::intrusive_ptr<c10d::Work> Backend::delegate(c10d::OpType type, bool async, std::vector<at::Tensor> outputs,
                                                 comm::CollectiveHeader header,
                                                 std::function<c10::intrusive_ptr<c10d::Work>()> op) {
  header.algorithm = static_cast<int64_t>(comm::Algorithm::kProcessGroup);
  return launch(type, async, std::move(outputs), [header, op = std::move(op)](comm::Communicator& comm) {
    comm.begin(header);
    comm.settle_header();
    op()->wait();
  });
}

c10::intrusive_ptr<c10d::Work> Backend::allreduce(std::vector<at::Tensor>& tensors,
                                                  const c10d::AllreduceOptions& opts) {
  const std::string error = error_of([&] {
    check_single(tensors, "all_reduce");
    check_cpu(tensors, "all_reduce");
  });
  if (!error.empty()) return reject(c10d::OpType::ALLREDUCE, opts.asyncOp, comm::CollectiveKind::kAllReduce, error);
  at::Tensor tensor = tensors[0];
  const auto op = own_reduction(opts.reduceOp, tensor);
  if (!op) {
    return delegate(c10d::OpType::ALLREDUCE, opts.asyncOp, tensors,
                    delegated_header(comm::CollectiveKind::kAllReduce, tensor, opts.reduceOp),
                    [gloo = gloo_, tensors, opts]() mutable { return gloo->allreduce(tensors, opts); });
  }
  return launch(c10d::OpType::ALLREDUCE, opts.asyncOp, tensors, [tensor, op](comm::Communicator& comm) mutable {
    on_contiguous(tensor, [&](at::Tensor& t) { comm::all_reduce_(t, *op, comm::Algorithm::kAuto, comm); });
  });
}

c10::intrusive_ptr<c10d::Work> Backend::allreduce_sparse(std::vector<at::Tensor>& tensors,
                                                         const c10d::AllreduceOptions& opts) {
  return delegate(
      c10d::OpType::ALLREDUCE, opts.asyncOp, tensors,
      delegated_header(comm::CollectiveKind::kAllReduce, tensors.empty() ? at::Tensor() : tensors[0], opts.reduceOp),
      [gloo = gloo_, tensors, opts]() mutable { return gloo->allreduce_sparse(tensors, opts); });
}

c10::intrusive_ptr<c10d::Work> Backend::allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                            const c10d::AllreduceCoalescedOptions& opts) {
  const std::string error = error_of([&] { check_cpu(tensors, "all_reduce_coalesced"); });
  if (!error.empty()) {
    return reject(c10d::OpType::ALLREDUCE_COALESCED, opts.asyncOp, comm::CollectiveKind::kAllReduce, error);
  }
  bool own = !tensors.empty();
  for (const auto& t : tensors) {
    own = own && own_reduction(opts.reduceOp, t) && t.scalar_type() == tensors[0].scalar_type();
  }
  if (!own) {
    auto header =
        delegated_header(comm::CollectiveKind::kAllReduce, tensors.empty() ? at::Tensor() : tensors[0], opts.reduceOp);
    header.numel = total_numel(tensors);
    return delegate(c10d::OpType::ALLREDUCE_COALESCED, opts.asyncOp, tensors, header,
                    [gloo = gloo_, tensors, opts]() mutable { return gloo->allreduce_coalesced(tensors, opts); });
  }
  const comm::ReduceOp op = *own_reduction(opts.reduceOp, tensors[0]);
  // One collective over the concatenation: one message schedule for all of them.
  return launch(c10d::OpType::ALLREDUCE_COALESCED, opts.asyncOp, tensors,
                [tensors, op](comm::Communicator& comm) mutable {
                  at::Tensor flat = flat_cat(tensors);
                  comm::all_reduce_(flat, op, comm::Algorithm::kAuto, comm);
                  int64_t offset = 0;
                  for (auto& t : tensors) {
                    t.copy_(flat.narrow(0, offset, t.numel()).view_as(t));
                    offset += t.numel();
                  }
                });
}

c10::intrusive_ptr<c10d::Work> Backend::broadcast(std::vector<at::Tensor>& tensors,
                                                  const c10d::BroadcastOptions& opts) {
  const std::string error = error_of([&] {
    check_single(tensors, "broadcast");
    check_cpu(tensors, "broadcast");
    TORCH_CHECK(opts.rootTensor == 0, "ddpkit backend: broadcast takes rootTensor 0, got ", opts.rootTensor);
  });
  if (!error.empty()) return reject(c10d::OpType::BROADCAST, opts.asyncOp, comm::CollectiveKind::kBroadcast, error);
  at::Tensor tensor = tensors[0];
  const int root = static_cast<int>(opts.rootRank);
  return launch(c10d::OpType::BROADCAST, opts.asyncOp, tensors, [tensor, root](comm::Communicator& comm) mutable {
    on_contiguous(tensor, [&](at::Tensor& t) { comm::broadcast_(t, root, comm); });
  });
}

c10::intrusive_ptr<c10d::Work> Backend::reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) {
  const std::string error = error_of([&] {
    check_single(tensors, "reduce");
    check_cpu(tensors, "reduce");
  });
  if (!error.empty()) return reject(c10d::OpType::REDUCE, opts.asyncOp, comm::CollectiveKind::kReduce, error);
  at::Tensor tensor = tensors[0];
  const auto op = own_reduction(opts.reduceOp, tensor);
  if (!op) {
    return delegate(c10d::OpType::REDUCE, opts.asyncOp, tensors,
                    delegated_header(comm::CollectiveKind::kReduce, tensor, opts.reduceOp, opts.rootRank),
                    [gloo = gloo_, tensors, opts]() mutable { return gloo->reduce(tensors, opts); });
  }
  const int root = static_cast<int>(opts.rootRank);
  return launch(c10d::OpType::REDUCE, opts.asyncOp, tensors, [tensor, root, op](comm::Communicator& comm) mutable {
    on_contiguous(tensor, [&](at::Tensor& t) { comm::reduce_(t, root, *op, comm); });
  });
}

c10::intrusive_ptr<c10d::Work> Backend::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                  std::vector<at::Tensor>& inputs, const c10d::AllgatherOptions& opts) {
  const std::string error = error_of([&] {
    check_single(inputs, "all_gather");
    check_cpu(inputs, "all_gather");
    TORCH_CHECK(outputs.size() == 1, "ddpkit backend: all_gather takes one output list per rank, got ", outputs.size());
    check_cpu(outputs[0], "all_gather");
    check_output_list(outputs[0], inputs[0], getSize(), "all_gather");
  });
  if (!error.empty()) return reject(c10d::OpType::ALLGATHER, opts.asyncOp, comm::CollectiveKind::kAllGather, error);
  const at::Tensor input = inputs[0].contiguous();
  std::vector<at::Tensor> targets = outputs[0];
  const int n = getSize();
  return launch(c10d::OpType::ALLGATHER, opts.asyncOp, targets, [input, targets, n](comm::Communicator& comm) {
    // One all-gather into a contiguous buffer, then copied out to the list.
    at::Tensor gathered = at::empty({n * input.numel()}, input.options());
    comm::all_gather_into_tensor_(gathered, input, comm::Algorithm::kAuto, comm);
    for (int i = 0; i < n; ++i) {
      at::Tensor target = targets[i];
      target.copy_(gathered.narrow(0, i * input.numel(), input.numel()).view(target.sizes()));
    }
  });
}

c10::intrusive_ptr<c10d::Work> Backend::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                        const c10d::AllgatherOptions& opts) {
  const std::string error = error_of([&] {
    check_cpu(output, "all_gather_into_tensor");
    check_cpu(input, "all_gather_into_tensor");
  });
  if (!error.empty()) {
    return reject(c10d::OpType::_ALLGATHER_BASE, opts.asyncOp, comm::CollectiveKind::kAllGather, error);
  }
  at::Tensor out = output;
  const at::Tensor in = input;
  return launch(c10d::OpType::_ALLGATHER_BASE, opts.asyncOp, {output}, [out, in](comm::Communicator& comm) mutable {
    comm::all_gather_into_tensor_(out, in, comm::Algorithm::kAuto, comm);
  });
}

c10::intrusive_ptr<c10d::Work> Backend::allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                            std::vector<at::Tensor>& inputs,
                                                            const c10d::AllgatherOptions& opts) {
  // gloo checks the lists too, but on this rank alone, before its collective starts: its peers would
  // then wait for it until the timeout. Rejected here, every rank raises.
  const std::string error = error_of([&] {
    check_cpu(inputs, "all_gather_coalesced");
    TORCH_CHECK(!inputs.empty(), "ddpkit backend: all_gather_coalesced needs at least one input tensor");
    TORCH_CHECK(static_cast<int>(outputs.size()) == getSize(),
                "ddpkit backend: all_gather_coalesced takes one output "
                "list per rank of the group (",
                getSize(), "), got ", outputs.size());
    for (const auto& list : outputs) {
      check_cpu(list, "all_gather_coalesced");
      TORCH_CHECK(list.size() == inputs.size(),
                  "ddpkit backend: all_gather_coalesced takes output lists as long as "
                  "the input list (",
                  inputs.size(), "), got one of ", list.size());
      for (size_t i = 0; i < inputs.size(); ++i) {
        TORCH_CHECK(list[i].sizes() == inputs[i].sizes() && list[i].scalar_type() == inputs[i].scalar_type(),
                    "ddpkit backend: all_gather_coalesced's output ", i, " has shape ", list[i].sizes(), " and dtype ",
                    list[i].scalar_type(), " where its input has ", inputs[i].sizes(), " and ",
                    inputs[i].scalar_type());
      }
    }
  });
  if (!error.empty()) {
    return reject(c10d::OpType::ALLGATHER_COALESCED, opts.asyncOp, comm::CollectiveKind::kAllGather, error);
  }
  std::vector<at::Tensor> results;
  for (const auto& list : outputs) results.insert(results.end(), list.begin(), list.end());
  auto header =
      delegated_header(comm::CollectiveKind::kAllGather, inputs.empty() ? at::Tensor() : inputs[0], std::nullopt);
  header.numel = total_numel(inputs);
  return delegate(
      c10d::OpType::ALLGATHER_COALESCED, opts.asyncOp, results, header,
      [gloo = gloo_, outputs, inputs, opts]() mutable { return gloo->allgather_coalesced(outputs, inputs, opts); });
}

c10::intrusive_ptr<c10d::Work> Backend::allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                        std::vector<at::Tensor>& inputs,
                                                                        const c10d::AllgatherOptions& opts) {
  const std::string error = error_of([&] {
    check_cpu(outputs, "all_gather_into_tensor_coalesced");
    check_cpu(inputs, "all_gather_into_tensor_coalesced");
    TORCH_CHECK(outputs.size() == inputs.size(), "ddpkit backend: all_gather_into_tensor_coalesced got ", inputs.size(),
                " inputs and ", outputs.size(), " outputs");
    for (size_t i = 0; i < inputs.size(); ++i) {
      TORCH_CHECK(
          outputs[i].scalar_type() == inputs[i].scalar_type() && outputs[i].numel() == inputs[i].numel() * getSize(),
          "ddpkit backend: all_gather_into_tensor_coalesced's output ", i, " has ", outputs[i].numel(), " elements of ",
          outputs[i].scalar_type(), ", expected world size times its input's ", inputs[i].numel(), " of ",
          inputs[i].scalar_type());
    }
  });
  if (!error.empty()) return reject(c10d::OpType::COALESCED, opts.asyncOp, comm::CollectiveKind::kAllGather, error);
  bool one_dtype = true;
  for (const auto& input : inputs) one_dtype = one_dtype && input.scalar_type() == inputs[0].scalar_type();
  if (!one_dtype) {  // gathered side by side only in one dtype; gloo gathers each
    auto header = delegated_header(comm::CollectiveKind::kAllGather, inputs[0], std::nullopt);
    header.numel = total_numel(inputs);
    return delegate(c10d::OpType::COALESCED, opts.asyncOp, outputs, header,
                    [gloo = gloo_, outputs, inputs, opts]() mutable {
                      return gloo->allgather_into_tensor_coalesced(outputs, inputs, opts);
                    });
  }
  const int n = getSize();
  return launch(c10d::OpType::COALESCED, opts.asyncOp, outputs, [outputs, inputs, n](comm::Communicator& comm) mutable {
    // All inputs side by side, gathered at once: row i of `gathered` is rank i's concatenation.
    at::Tensor flat = inputs.empty() ? at::empty({0}) : flat_cat(inputs);
    at::Tensor gathered = at::empty({n * flat.numel()}, flat.options());
    comm::all_gather_into_tensor_(gathered, flat, comm::Algorithm::kAuto, comm);
    at::Tensor rows = gathered.view({n, flat.numel()});
    int64_t offset = 0;
    for (size_t i = 0; i < inputs.size(); ++i) {
      const int64_t m = inputs[i].numel();
      // Each output holds the ranks' blocks one after the other in its own (row-major) order, whatever its strides.
      outputs[i].copy_(rows.narrow(1, offset, m).reshape(outputs[i].sizes()));
      offset += m;
    }
  });
}

c10::intrusive_ptr<c10d::Work> Backend::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                               std::vector<at::Tensor>& inputs, const c10d::GatherOptions& opts) {
  const int root = static_cast<int>(opts.rootRank);
  // A bad list on the root is rejected inside the collective (gather_into), so every rank raises.
  std::vector<at::Tensor> targets = getRank() == root && outputs.size() == 1 ? outputs[0] : std::vector<at::Tensor>();
  const std::string error = error_of([&] {
    check_single(inputs, "gather");
    check_cpu(inputs, "gather");
    check_cpu(targets, "gather");
  });
  if (!error.empty()) return reject(c10d::OpType::GATHER, opts.asyncOp, comm::CollectiveKind::kGather, error);
  const at::Tensor input = inputs[0].contiguous();
  return launch(c10d::OpType::GATHER, opts.asyncOp, targets, [input, targets, root](comm::Communicator& comm) mutable {
    comm::gather_into(targets, input, root, comm);
  });
}

c10::intrusive_ptr<c10d::Work> Backend::scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ScatterOptions& opts) {
  const int root = static_cast<int>(opts.rootRank);
  // A bad list on the root is rejected inside the collective (scatter_from), so every rank raises.
  std::vector<at::Tensor> sources = getRank() == root && inputs.size() == 1 ? inputs[0] : std::vector<at::Tensor>();
  const std::string error = error_of([&] {
    check_single(outputs, "scatter");
    check_cpu(outputs, "scatter");
    check_cpu(sources, "scatter");
  });
  if (!error.empty()) return reject(c10d::OpType::SCATTER, opts.asyncOp, comm::CollectiveKind::kScatter, error);
  at::Tensor output = outputs[0];
  return launch(c10d::OpType::SCATTER, opts.asyncOp, outputs,
                [output, sources, root](comm::Communicator& comm) mutable {
                  on_contiguous(output, [&](at::Tensor& target) { comm::scatter_from(target, sources, root, comm); });
                });
}

c10::intrusive_ptr<c10d::Work> Backend::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                       std::vector<std::vector<at::Tensor>>& inputs,
                                                       const c10d::ReduceScatterOptions& opts) {
  const std::string error = error_of([&] {
    check_single(outputs, "reduce_scatter");
    check_cpu(outputs, "reduce_scatter");
    TORCH_CHECK(inputs.size() == 1, "ddpkit backend: reduce_scatter takes one input list per rank, got ",
                inputs.size());
    check_cpu(inputs[0], "reduce_scatter");
    // Also for a reduction delegated to gloo, which checks the list on this rank alone.
    check_output_list(inputs[0], outputs[0], getSize(), "reduce_scatter");
  });
  if (!error.empty()) {
    return reject(c10d::OpType::REDUCE_SCATTER, opts.asyncOp, comm::CollectiveKind::kReduceScatter, error);
  }
  const auto op = own_reduction(opts.reduceOp, outputs[0]);
  if (!op) {
    return delegate(
        c10d::OpType::REDUCE_SCATTER, opts.asyncOp, outputs,
        delegated_header(comm::CollectiveKind::kReduceScatter, outputs[0], opts.reduceOp),
        [gloo = gloo_, outputs, inputs, opts]() mutable { return gloo->reduce_scatter(outputs, inputs, opts); });
  }
  at::Tensor output = outputs[0];
  std::vector<at::Tensor> sources = inputs[0];
  return launch(c10d::OpType::REDUCE_SCATTER, opts.asyncOp, outputs,
                [output, sources, op](comm::Communicator& comm) mutable {
                  const at::Tensor input = flat_cat(sources);
                  on_contiguous(output, [&](at::Tensor& target) {
                    comm::reduce_scatter_tensor_(target, input, *op, comm::Algorithm::kAuto, comm);
                  });
                });
}

c10::intrusive_ptr<c10d::Work> Backend::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                             const c10d::ReduceScatterOptions& opts) {
  const std::string error = error_of([&] {
    check_cpu(output, "reduce_scatter_tensor");
    check_cpu(input, "reduce_scatter_tensor");
  });
  if (!error.empty()) {
    return reject(c10d::OpType::_REDUCE_SCATTER_BASE, opts.asyncOp, comm::CollectiveKind::kReduceScatter, error);
  }
  const auto op = own_reduction(opts.reduceOp, output);
  if (!op) {
    // gloo checks these on this rank alone, once its peers are inside its collective: checked here,
    // a wrong input raises on every rank, as on ddpkit's own path.
    const std::string bad = error_of([&] {
      TORCH_CHECK(input.scalar_type() == output.scalar_type() && input.numel() == output.numel() * getSize(),
                  "ddpkit backend: reduce_scatter_tensor's input has ", input.numel(), " elements of ",
                  input.scalar_type(), ", expected world size times the output's ", output.numel(), " of ",
                  output.scalar_type());
      TORCH_CHECK(input.is_contiguous() && output.is_contiguous(),
                  "ddpkit backend: reduce_scatter_tensor takes contiguous tensors");
    });
    if (!bad.empty())
      return reject(c10d::OpType::_REDUCE_SCATTER_BASE, opts.asyncOp, comm::CollectiveKind::kReduceScatter, bad);
    // Flat, so that every shape ddpkit's own path takes (an input stacked as [n, *output.shape]) goes
    // to gloo, which compares the shapes' first dimensions.
    return delegate(c10d::OpType::_REDUCE_SCATTER_BASE, opts.asyncOp, {output},
                    delegated_header(comm::CollectiveKind::kReduceScatter, output, opts.reduceOp),
                    [gloo = gloo_, output = output.view(-1), input = input.view(-1), opts]() mutable {
                      return gloo->_reduce_scatter_base(output, input, opts);
                    });
  }
  at::Tensor out = output;
  const at::Tensor in = input;
  return launch(c10d::OpType::_REDUCE_SCATTER_BASE, opts.asyncOp, {output},
                [out, in, op](comm::Communicator& comm) mutable {
                  comm::reduce_scatter_tensor_(out, in, *op, comm::Algorithm::kAuto, comm);
                });
}

c10::intrusive_ptr<c10d::Work> Backend::reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                        std::vector<at::Tensor>& inputs,
                                                                        const c10d::ReduceScatterOptions& opts) {
  const int n = getSize();
  const std::string error = error_of([&] {
    check_cpu(outputs, "reduce_scatter_tensor_coalesced");
    check_cpu(inputs, "reduce_scatter_tensor_coalesced");
    TORCH_CHECK(outputs.size() == inputs.size() && !outputs.empty(),
                "ddpkit backend: reduce_scatter_tensor_coalesced got ", inputs.size(), " inputs and ", outputs.size(),
                " outputs");
    for (size_t i = 0; i < inputs.size(); ++i) {
      TORCH_CHECK(inputs[i].scalar_type() == outputs[i].scalar_type() && inputs[i].numel() == outputs[i].numel() * n,
                  "ddpkit backend: reduce_scatter_tensor_coalesced's input ", i, " has ", inputs[i].numel(),
                  " elements of ", inputs[i].scalar_type(), ", expected world size times its output's ",
                  outputs[i].numel(), " of ", outputs[i].scalar_type());
    }
  });
  if (!error.empty()) return reject(c10d::OpType::COALESCED, opts.asyncOp, comm::CollectiveKind::kReduceScatter, error);
  bool own = true;
  for (const auto& output : outputs) {
    own = own && own_reduction(opts.reduceOp, output) && output.scalar_type() == outputs[0].scalar_type();
  }
  if (!own) {  // an op or a dtype ddpkit does not reduce, or several dtypes: gloo reduces each
    auto header = delegated_header(comm::CollectiveKind::kReduceScatter, outputs[0], opts.reduceOp);
    header.numel = total_numel(outputs);
    return delegate(c10d::OpType::COALESCED, opts.asyncOp, outputs, header,
                    [gloo = gloo_, outputs, inputs, opts]() mutable {
                      return gloo->reduce_scatter_tensor_coalesced(outputs, inputs, opts);
                    });
  }
  const comm::ReduceOp op = *own_reduction(opts.reduceOp, outputs[0]);
  return launch(c10d::OpType::COALESCED, opts.asyncOp, outputs,
                [outputs, inputs, op, n](comm::Communicator& comm) mutable {
                  // Block r of the combined input is every input's block r side by side.
                  std::vector<at::Tensor> columns;
                  int64_t total = 0;
                  for (size_t i = 0; i < inputs.size(); ++i) {
                    columns.push_back(inputs[i].reshape({n, outputs[i].numel()}));
                    total += outputs[i].numel();
                  }
                  at::Tensor combined = at::cat(columns, 1).reshape(-1);
                  at::Tensor reduced = at::empty({total}, combined.options());
                  comm::reduce_scatter_tensor_(reduced, combined, op, comm::Algorithm::kAuto, comm);
                  int64_t offset = 0;
                  for (auto& out : outputs) {
                    out.copy_(reduced.narrow(0, offset, out.numel()).view(out.sizes()));
                    offset += out.numel();
                  }
                });
}

c10::intrusive_ptr<c10d::Work> Backend::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                      std::vector<int64_t>& output_split_sizes,
                                                      std::vector<int64_t>& input_split_sizes,
                                                      const c10d::AllToAllOptions& opts) {
  const int n = getSize();
  // Rows of dim 0 per rank: the given split sizes, or equal parts.
  auto pieces = [n](const at::Tensor& t, const std::vector<int64_t>& splits, std::string_view which) {
    const int64_t rows = t.dim() == 0 ? 1 : t.size(0);
    const int64_t row_numel = rows == 0 ? 0 : t.numel() / rows;
    std::vector<int64_t> sizes = splits;
    if (sizes.empty()) {
      TORCH_CHECK(rows % n == 0, "ddpkit backend: all_to_all_single's ", which, " has ", rows,
                  " rows, not divisible by the world size ", n, "; pass split sizes");
      sizes.assign(n, rows / n);
    }
    TORCH_CHECK(static_cast<int>(sizes.size()) == n, "ddpkit backend: all_to_all_single's ", which,
                " split sizes must have one entry per rank (", n, "), got ", sizes.size());
    std::vector<at::Tensor> parts;
    at::Tensor flat = t.reshape(-1);
    int64_t offset = 0;
    for (int64_t s : sizes) {
      parts.push_back(flat.narrow(0, offset * row_numel, s * row_numel));
      offset += s;
    }
    TORCH_CHECK(offset == rows, "ddpkit backend: all_to_all_single's ", which, " split sizes add up to ", offset,
                ", the tensor has ", rows, " rows");
    return parts;
  };
  std::vector<at::Tensor> outs, ins;
  const std::string error = error_of([&] {
    check_cpu(output, "all_to_all_single");
    check_cpu(input, "all_to_all_single");
    TORCH_CHECK(output.is_contiguous() && input.is_contiguous(),
                "ddpkit backend: all_to_all_single needs contiguous tensors");
    outs = pieces(output, output_split_sizes, "output");
    ins = pieces(input, input_split_sizes, "input");
  });
  if (!error.empty()) return reject(c10d::OpType::ALLTOALL_BASE, opts.asyncOp, comm::CollectiveKind::kAllToAll, error);
  return launch(c10d::OpType::ALLTOALL_BASE, opts.asyncOp, {output},
                [outs, ins](comm::Communicator& comm) mutable { comm::all_to_all_(outs, ins, comm); });
}

c10::intrusive_ptr<c10d::Work> Backend::alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                                 const c10d::AllToAllOptions& opts) {
  const std::string error = error_of([&] {
    check_cpu(outputs, "all_to_all");
    check_cpu(inputs, "all_to_all");
  });
  if (!error.empty()) return reject(c10d::OpType::ALLTOALL, opts.asyncOp, comm::CollectiveKind::kAllToAll, error);
  std::vector<at::Tensor> targets = outputs;
  std::vector<at::Tensor> sources = inputs;
  return launch(c10d::OpType::ALLTOALL, opts.asyncOp, outputs, [targets, sources](comm::Communicator& comm) mutable {
    // Messages need contiguous tensors: work on contiguous stand-ins and copy back where needed.
    std::vector<at::Tensor> outs, ins;
    for (const auto& t : targets)
      outs.push_back(t.is_contiguous() ? t : at::empty_like(t, at::MemoryFormat::Contiguous));
    for (const auto& t : sources) ins.push_back(t.contiguous());
    comm::all_to_all_(outs, ins, comm);
    for (size_t i = 0; i < targets.size(); ++i) {
      if (!outs[i].is_same(targets[i])) targets[i].copy_(outs[i]);
    }
  });
}

c10::intrusive_ptr<c10d::Work> Backend::barrier(const c10d::BarrierOptions& opts) {
  // Its own timeout, where the caller gave one (Note [A call's timeout]); c10d marks none with kUnsetTimeout.
  std::optional<std::chrono::milliseconds> timeout;
  if (opts.timeout != c10d::kUnsetTimeout) timeout = opts.timeout;
  return launch(c10d::OpType::BARRIER, opts.asyncOp, {}, [timeout](comm::Communicator& comm) {
    const comm::ScopedCallTimeout scoped(timeout);
    comm::barrier(comm);
  });
}

void Backend::monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) {
  gloo_p2p_->monitoredBarrier(opts, wait_all_ranks);
}

c10::intrusive_ptr<c10d::Work> Backend::send(std::vector<at::Tensor>& tensors, int dst_rank, int tag) {
  return gloo_p2p_->send(tensors, dst_rank, tag);
}

c10::intrusive_ptr<c10d::Work> Backend::recv(std::vector<at::Tensor>& tensors, int src_rank, int tag) {
  return gloo_p2p_->recv(tensors, src_rank, tag);
}

c10::intrusive_ptr<c10d::Work> Backend::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  return gloo_p2p_->recvAnysource(tensors, tag);
}

}  // namespace ddpkit::backend
