#include "backend/backend.h"

#include "comm/collectives/collectives.h"
#include "comm/core/call_timeout.h"
#include "comm/core/fork_guard.h"

#include <optional>

namespace ddpkit::backend {

// One operation of the backend. `name` is torch.distributed's public name for it: the one every
// error of the call starts with ("ddpkit.all_reduce: ..."), the engine's errors included.
struct Operation {
  c10d::OpType type;
  comm::CollectiveKind kind;  // what its collective check compares (Note [Collective checks])
  std::string_view name;
};

// A call of an operation: what launch(), delegate() and reject() need of it.
struct Backend::Call {
  const Operation& op;
  bool async;
};

namespace {

using c10d::OpType;
using comm::CollectiveKind;

constexpr Operation kBroadcast{OpType::BROADCAST, CollectiveKind::kBroadcast, "broadcast"};
constexpr Operation kAllReduce{OpType::ALLREDUCE, CollectiveKind::kAllReduce, "all_reduce"};
constexpr Operation kAllReduceCoalesced{OpType::ALLREDUCE_COALESCED, CollectiveKind::kAllReduce,
                                        "all_reduce_coalesced"};
constexpr Operation kReduce{OpType::REDUCE, CollectiveKind::kReduce, "reduce"};
constexpr Operation kAllGather{OpType::ALLGATHER, CollectiveKind::kAllGather, "all_gather"};
constexpr Operation kAllGatherIntoTensor{OpType::_ALLGATHER_BASE, CollectiveKind::kAllGather, "all_gather_into_tensor"};
constexpr Operation kAllGatherCoalesced{OpType::ALLGATHER_COALESCED, CollectiveKind::kAllGather,
                                        "all_gather_coalesced"};
constexpr Operation kAllGatherIntoTensorCoalesced{OpType::COALESCED, CollectiveKind::kAllGather,
                                                  "all_gather_into_tensor_coalesced"};
constexpr Operation kGather{OpType::GATHER, CollectiveKind::kGather, "gather"};
constexpr Operation kScatter{OpType::SCATTER, CollectiveKind::kScatter, "scatter"};
constexpr Operation kReduceScatter{OpType::REDUCE_SCATTER, CollectiveKind::kReduceScatter, "reduce_scatter"};
constexpr Operation kReduceScatterTensor{OpType::_REDUCE_SCATTER_BASE, CollectiveKind::kReduceScatter,
                                         "reduce_scatter_tensor"};
constexpr Operation kReduceScatterTensorCoalesced{OpType::COALESCED, CollectiveKind::kReduceScatter,
                                                  "reduce_scatter_tensor_coalesced"};
constexpr Operation kAllToAllSingle{OpType::ALLTOALL_BASE, CollectiveKind::kAllToAll, "all_to_all_single"};
constexpr Operation kAllToAll{OpType::ALLTOALL, CollectiveKind::kAllToAll, "all_to_all"};
constexpr Operation kBarrier{OpType::BARRIER, CollectiveKind::kBarrier, "barrier"};

// ---- Validators: each TORCH_CHECKs one property of a caller's arguments, in an error that starts
// with the operation's name `op` ("ddpkit.all_gather: ..."), as gloo's ProcessGroupGloo words its own.

// torch's Python API passes exactly one tensor per rank; the multi-tensor forms are gone from it.
void check_single_tensor(std::string_view op, const std::vector<at::Tensor>& tensors) {
  TORCH_CHECK(tensors.size() == 1, "ddpkit.", op, ": takes one tensor per rank, got ", tensors.size());
}

// The same of the lists of a list form (an all-gather's outputs, a reduce-scatter's inputs).
void check_single_list(std::string_view op, const std::vector<std::vector<at::Tensor>>& lists, std::string_view which) {
  TORCH_CHECK(lists.size() == 1, "ddpkit.", op, ": takes one ", which, " list per rank, got ", lists.size());
}

void check_cpu(std::string_view op, const at::Tensor& tensor) {
  TORCH_CHECK(!tensor.defined() || tensor.device().is_cpu(), "ddpkit.", op, ": got a tensor on ", tensor.device(),
              "; the ddpkit backend carries CPU tensors: use backend=\"cpu:ddpkit,cuda:nccl\" for CUDA tensors");
}

void check_cpu(std::string_view op, const std::vector<at::Tensor>& tensors) {
  for (const auto& t : tensors) check_cpu(op, t);
}

void check_contiguous(std::string_view op, const at::Tensor& a, const at::Tensor& b) {
  TORCH_CHECK(a.is_contiguous() && b.is_contiguous(), "ddpkit.", op, ": takes contiguous tensors");
}

void check_root_tensor(std::string_view op, int64_t root_tensor) {
  TORCH_CHECK(root_tensor == 0, "ddpkit.", op, ": takes rootTensor 0, got ", root_tensor);
}

// `list` holds one tensor per rank of a group of `n`, each with `single`'s dtype and number of elements.
void check_list_per_rank(std::string_view op, const std::vector<at::Tensor>& list, const at::Tensor& single, int n) {
  TORCH_CHECK(static_cast<int>(list.size()) == n, "ddpkit.", op, ": takes a list of one tensor per rank of the group (",
              n, "), got ", list.size());
  for (size_t i = 0; i < list.size(); ++i) {
    TORCH_CHECK(list[i].numel() == single.numel() && list[i].scalar_type() == single.scalar_type(), "ddpkit.", op,
                ": tensor ", i, " of the list has ", list[i].numel(), " elements of ", list[i].scalar_type(),
                ", expected ", single.numel(), " of ", single.scalar_type());
  }
}

// `whole` (named `whole_name`) holds world size (`n`) times the elements of `part`, in its dtype.
void check_world_size_times(std::string_view op, const at::Tensor& whole, std::string_view whole_name,
                            const at::Tensor& part, std::string_view part_name, int n) {
  TORCH_CHECK(whole.scalar_type() == part.scalar_type() && whole.numel() == part.numel() * n, "ddpkit.", op, ": ",
              whole_name, " has ", whole.numel(), " elements of ", whole.scalar_type(), ", expected world size times ",
              part_name, "'s ", part.numel(), " of ", part.scalar_type());
}

// Coalesced forms: `outputs` and `inputs` pair up, one output per input.
void check_paired(std::string_view op, const std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& inputs) {
  TORCH_CHECK(outputs.size() == inputs.size(), "ddpkit.", op, ": got ", inputs.size(), " inputs and ", outputs.size(),
              " outputs");
}

// all_gather_coalesced's output lists: one per rank of a group of `n`, each shaped as `inputs`.
void check_lists_like(std::string_view op, const std::vector<std::vector<at::Tensor>>& lists,
                      const std::vector<at::Tensor>& inputs, int n) {
  TORCH_CHECK(static_cast<int>(lists.size()) == n, "ddpkit.", op, ": takes one output list per rank of the group (", n,
              "), got ", lists.size());
  for (const auto& list : lists) {
    check_cpu(op, list);
    TORCH_CHECK(list.size() == inputs.size(), "ddpkit.", op, ": takes output lists as long as the input list (",
                inputs.size(), "), got one of ", list.size());
    for (size_t i = 0; i < inputs.size(); ++i) {
      TORCH_CHECK(list[i].sizes() == inputs[i].sizes() && list[i].scalar_type() == inputs[i].scalar_type(), "ddpkit.",
                  op, ": output ", i, " has shape ", list[i].sizes(), " and dtype ", list[i].scalar_type(),
                  " where its input has ", inputs[i].sizes(), " and ", inputs[i].scalar_type());
    }
  }
}

// all_to_all_single's `which` tensor ("input" or "output") cut into one block of rows of dim 0 per
// rank of a group of `n`: the given split sizes, or equal parts.
std::vector<at::Tensor> split_rows(std::string_view op, const at::Tensor& t, const std::vector<int64_t>& splits, int n,
                                   std::string_view which) {
  const int64_t rows = t.dim() == 0 ? 1 : t.size(0);
  const int64_t row_numel = rows == 0 ? 0 : t.numel() / rows;
  std::vector<int64_t> sizes = splits;
  if (sizes.empty()) {
    TORCH_CHECK(rows % n == 0, "ddpkit.", op, ": the ", which, " has ", rows, " rows, not divisible by the world size ",
                n, "; pass split sizes");
    sizes.assign(n, rows / n);
  }
  TORCH_CHECK(static_cast<int>(sizes.size()) == n, "ddpkit.", op, ": the ", which,
              " split sizes must have one entry per rank (", n, "), got ", sizes.size());
  std::vector<at::Tensor> parts;
  at::Tensor flat = t.reshape(-1);
  int64_t offset = 0;
  for (int64_t s : sizes) {
    parts.push_back(flat.narrow(0, offset * row_numel, s * row_numel));
    offset += s;
  }
  TORCH_CHECK(offset == rows, "ddpkit.", op, ": the ", which, " split sizes add up to ", offset, ", the tensor has ",
              rows, " rows");
  return parts;
}

// ---- What the stages share

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

// ddpkit's own reduction of every tensor of a coalesced call, or nullopt when one of them is not
// ddpkit's (own_reduction) or their dtypes differ: gloo then reduces each.
std::optional<comm::ReduceOp> own_reduction(const c10d::ReduceOp& op, const std::vector<at::Tensor>& tensors) {
  if (tensors.empty()) return std::nullopt;
  for (const auto& t : tensors) {
    if (!own_reduction(op, t) || t.scalar_type() != tensors[0].scalar_type()) return std::nullopt;
  }
  return own_reduction(op, tensors[0]);
}

int64_t total_numel(const std::vector<at::Tensor>& tensors) {
  int64_t total = 0;
  for (const auto& t : tensors) total += t.numel();
  return total;
}

// The header of a collective handed to gloo: what its peers compare it with (Note [Collective checks]).
comm::CollectiveHeader delegated_header(const Operation& op, const at::Tensor& tensor,
                                        std::optional<c10d::ReduceOp> reduction, int64_t root = -1) {
  comm::CollectiveHeader header;
  header.kind = static_cast<int64_t>(op.kind);
  header.numel = tensor.defined() ? (tensor.is_sparse() ? -1 : tensor.numel()) : 0;
  header.dtype = tensor.defined() ? static_cast<int64_t>(tensor.scalar_type()) : -1;
  header.op = reduction ? comm::kDelegatedOp + static_cast<int64_t>(reduction->op_) : -1;
  header.root = root;
  return header;
}

// The same of a coalesced call: it counts the elements of all of `tensors`.
comm::CollectiveHeader delegated_header(const Operation& op, const std::vector<at::Tensor>& tensors,
                                        std::optional<c10d::ReduceOp> reduction) {
  comm::CollectiveHeader header = delegated_header(op, tensors.empty() ? at::Tensor() : tensors[0], reduction);
  header.numel = total_numel(tensors);
  return header;
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
                 c10::intrusive_ptr<c10d::Backend> gloo, c10::intrusive_ptr<c10d::Backend> gloo_p2p,
                 comm::WireFormat cross_host)
    : c10d::Backend(rank, size),
      fork_generation_(comm::fork_generation()),
      store_(std::move(store)),
      gloo_(std::move(gloo)),
      gloo_p2p_(std::move(gloo_p2p)),
      options_(c10::make_intrusive<Options>("ddpkit", timeout)),
      transport_(comm::parse_transport("auto")),
      cross_host_(cross_host) {
  for (const auto& inner : {gloo_, gloo_p2p_}) {
    TORCH_CHECK(inner, "ddpkit backend: needs two inner gloo backends");
    TORCH_CHECK(inner->getRank() == rank && inner->getSize() == size, "ddpkit backend: an inner gloo backend has rank ",
                inner->getRank(), " of ", inner->getSize(), ", expected ", rank, " of ", size);
  }
}

Backend::~Backend() {
  if (comm::fork_generation() == fork_generation_) return;
  gloo_.release();  // leaked on purpose: Note [Forked children]
  gloo_p2p_.release();
}

c10d::Backend& Backend::point_to_point(std::string_view op) {
  comm::check_not_forked(fork_generation_, op, getRank());
  return *gloo_p2p_;
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

template <class Validate, class Run>
c10::intrusive_ptr<c10d::Work> Backend::collective(Call call, Validate&& validate, Run&& run) {
  // The backend never raises before a collective is numbered: a rank whose arguments fail rejects
  // them inside the collective (comm::reject), so that every rank raises and the next calls pair.
  std::string error;
  try {
    validate(call.op.name);
  } catch (const c10::Error& e) {
    error = e.what_without_backtrace();
  }
  if (!error.empty()) {
    return launch(call, {}, [kind = call.op.kind, error = std::move(error)](comm::Communicator& comm) {
      comm::reject(kind, error, comm);
    });
  }
  return run();
}

c10::intrusive_ptr<c10d::Work> Backend::launch(Call call, std::vector<at::Tensor> outputs, comm::Engine::Body body) {
  collectives_launched_.fetch_add(1);
  auto engine = this->engine();
  if (call.async) {
    return engine->submit(c10::kCPU, transport_, call.op.name, std::move(body), call.op.type, std::move(outputs));
  }
  engine->run(c10::kCPU, transport_, call.op.name, body);
  auto work = c10::make_intrusive<comm::CollectiveWork>(getRank(), call.op.type, std::move(outputs));
  work->complete(nullptr);
  return work;
}

c10::intrusive_ptr<c10d::Work> Backend::delegate(Call call, std::vector<at::Tensor> outputs,
                                                 comm::CollectiveHeader header,
                                                 std::function<c10::intrusive_ptr<c10d::Work>()> op) {
  header.algorithm = static_cast<int64_t>(comm::Algorithm::kProcessGroup);
  return launch(call, std::move(outputs), [header, op = std::move(op)](comm::Communicator& comm) {
    comm.begin(header);
    comm.settle_header();
    op()->wait();
  });
}

c10::intrusive_ptr<c10d::Work> Backend::allreduce(std::vector<at::Tensor>& tensors,
                                                  const c10d::AllreduceOptions& opts) {
  const Call call{kAllReduce, opts.asyncOp};
  return collective(
      call,
      [&](std::string_view op) {
        check_single_tensor(op, tensors);
        check_cpu(op, tensors);
      },
      [&] {
        at::Tensor tensor = tensors[0];
        const auto reduction = own_reduction(opts.reduceOp, tensor);
        if (!reduction) {
          return delegate(call, tensors, delegated_header(call.op, tensor, opts.reduceOp),
                          [gloo = gloo_, tensors, opts]() mutable { return gloo->allreduce(tensors, opts); });
        }
        return launch(call, tensors, [tensor, reduction, wire = cross_host_](comm::Communicator& comm) mutable {
          comm.set_wire_format(wire);
          on_contiguous(tensor, [&](at::Tensor& t) { comm::all_reduce_(t, *reduction, comm::Algorithm::kAuto, comm); });
        });
      });
}

c10::intrusive_ptr<c10d::Work> Backend::allreduce_sparse(std::vector<at::Tensor>& tensors,
                                                         const c10d::AllreduceOptions& opts) {
  // dist.all_reduce of a sparse tensor: gloo's, with gloo's checks.
  const Call call{kAllReduce, opts.asyncOp};
  return delegate(call, tensors, delegated_header(call.op, tensors.empty() ? at::Tensor() : tensors[0], opts.reduceOp),
                  [gloo = gloo_, tensors, opts]() mutable { return gloo->allreduce_sparse(tensors, opts); });
}

c10::intrusive_ptr<c10d::Work> Backend::allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                            const c10d::AllreduceCoalescedOptions& opts) {
  const Call call{kAllReduceCoalesced, opts.asyncOp};
  return collective(
      call, [&](std::string_view op) { check_cpu(op, tensors); },
      [&] {
        const auto reduction = own_reduction(opts.reduceOp, tensors);
        if (!reduction) {
          return delegate(call, tensors, delegated_header(call.op, tensors, opts.reduceOp),
                          [gloo = gloo_, tensors, opts]() mutable { return gloo->allreduce_coalesced(tensors, opts); });
        }
        // One collective over the concatenation: one message schedule for all of them.
        return launch(call, tensors, [tensors, op = *reduction](comm::Communicator& comm) mutable {
          at::Tensor flat = flat_cat(tensors);
          comm::all_reduce_(flat, op, comm::Algorithm::kAuto, comm);
          int64_t offset = 0;
          for (auto& t : tensors) {
            t.copy_(flat.narrow(0, offset, t.numel()).view_as(t));
            offset += t.numel();
          }
        });
      });
}

c10::intrusive_ptr<c10d::Work> Backend::broadcast(std::vector<at::Tensor>& tensors,
                                                  const c10d::BroadcastOptions& opts) {
  const Call call{kBroadcast, opts.asyncOp};
  return collective(
      call,
      [&](std::string_view op) {
        check_single_tensor(op, tensors);
        check_cpu(op, tensors);
        check_root_tensor(op, opts.rootTensor);
      },
      [&] {
        return launch(call, tensors,
                      [tensor = tensors[0], root = static_cast<int>(opts.rootRank)](comm::Communicator& comm) mutable {
                        on_contiguous(tensor, [&](at::Tensor& t) { comm::broadcast_(t, root, comm); });
                      });
      });
}

c10::intrusive_ptr<c10d::Work> Backend::reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) {
  const Call call{kReduce, opts.asyncOp};
  return collective(
      call,
      [&](std::string_view op) {
        check_single_tensor(op, tensors);
        check_cpu(op, tensors);
      },
      [&] {
        at::Tensor tensor = tensors[0];
        const auto reduction = own_reduction(opts.reduceOp, tensor);
        if (!reduction) {
          return delegate(call, tensors, delegated_header(call.op, tensor, opts.reduceOp, opts.rootRank),
                          [gloo = gloo_, tensors, opts]() mutable { return gloo->reduce(tensors, opts); });
        }
        const int root = static_cast<int>(opts.rootRank);
        return launch(call, tensors, [tensor, root, reduction](comm::Communicator& comm) mutable {
          on_contiguous(tensor, [&](at::Tensor& t) { comm::reduce_(t, root, *reduction, comm); });
        });
      });
}

c10::intrusive_ptr<c10d::Work> Backend::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                  std::vector<at::Tensor>& inputs, const c10d::AllgatherOptions& opts) {
  const Call call{kAllGather, opts.asyncOp};
  const int n = getSize();
  return collective(
      call,
      [&](std::string_view op) {
        check_single_tensor(op, inputs);
        check_cpu(op, inputs);
        check_single_list(op, outputs, "output");
        check_cpu(op, outputs[0]);
        check_list_per_rank(op, outputs[0], inputs[0], n);
      },
      [&] {
        const at::Tensor input = inputs[0].contiguous();
        std::vector<at::Tensor> targets = outputs[0];
        return launch(call, targets, [input, targets, n](comm::Communicator& comm) {
          // One all-gather into a contiguous buffer, then copied out to the list.
          at::Tensor gathered = at::empty({n * input.numel()}, input.options());
          comm::all_gather_into_tensor_(gathered, input, comm::Algorithm::kAuto, comm);
          for (int i = 0; i < n; ++i) {
            at::Tensor target = targets[i];
            target.copy_(gathered.narrow(0, i * input.numel(), input.numel()).view(target.sizes()));
          }
        });
      });
}

c10::intrusive_ptr<c10d::Work> Backend::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                        const c10d::AllgatherOptions& opts) {
  const Call call{kAllGatherIntoTensor, opts.asyncOp};
  return collective(
      call,
      [&](std::string_view op) {
        check_cpu(op, output);
        check_cpu(op, input);
      },
      [&] {
        return launch(call, {output}, [out = output, in = input](comm::Communicator& comm) mutable {
          comm::all_gather_into_tensor_(out, in, comm::Algorithm::kAuto, comm);
        });
      });
}

c10::intrusive_ptr<c10d::Work> Backend::allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                            std::vector<at::Tensor>& inputs,
                                                            const c10d::AllgatherOptions& opts) {
  const Call call{kAllGatherCoalesced, opts.asyncOp};
  // gloo checks the lists too, but on this rank alone, before its collective starts: its peers would
  // then wait for it until the timeout. Rejected here, every rank raises.
  return collective(
      call,
      [&](std::string_view op) {
        check_cpu(op, inputs);
        TORCH_CHECK(!inputs.empty(), "ddpkit.", op, ": needs at least one input tensor");
        check_lists_like(op, outputs, inputs, getSize());
      },
      [&] {
        std::vector<at::Tensor> results;
        for (const auto& list : outputs) results.insert(results.end(), list.begin(), list.end());
        return delegate(call, results, delegated_header(call.op, inputs, std::nullopt),
                        [gloo = gloo_, outputs, inputs, opts]() mutable {
                          return gloo->allgather_coalesced(outputs, inputs, opts);
                        });
      });
}

c10::intrusive_ptr<c10d::Work> Backend::allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                        std::vector<at::Tensor>& inputs,
                                                                        const c10d::AllgatherOptions& opts) {
  const Call call{kAllGatherIntoTensorCoalesced, opts.asyncOp};
  const int n = getSize();
  return collective(
      call,
      [&](std::string_view op) {
        check_cpu(op, outputs);
        check_cpu(op, inputs);
        check_paired(op, outputs, inputs);
        for (size_t i = 0; i < inputs.size(); ++i) {
          check_world_size_times(op, outputs[i], c10::str("output ", i), inputs[i], c10::str("input ", i), n);
        }
      },
      [&] {
        bool one_dtype = true;
        for (const auto& input : inputs) one_dtype = one_dtype && input.scalar_type() == inputs[0].scalar_type();
        if (!one_dtype) {  // gathered side by side only in one dtype; gloo gathers each
          return delegate(call, outputs, delegated_header(call.op, inputs, std::nullopt),
                          [gloo = gloo_, outputs, inputs, opts]() mutable {
                            return gloo->allgather_into_tensor_coalesced(outputs, inputs, opts);
                          });
        }
        return launch(call, outputs, [outputs, inputs, n](comm::Communicator& comm) mutable {
          // All inputs side by side, gathered at once: row i of `gathered` is rank i's concatenation.
          at::Tensor flat = inputs.empty() ? at::empty({0}) : flat_cat(inputs);
          at::Tensor gathered = at::empty({n * flat.numel()}, flat.options());
          comm::all_gather_into_tensor_(gathered, flat, comm::Algorithm::kAuto, comm);
          at::Tensor rows = gathered.view({n, flat.numel()});
          int64_t offset = 0;
          for (size_t i = 0; i < inputs.size(); ++i) {
            const int64_t m = inputs[i].numel();
            // Each output holds the ranks' blocks one after the other in its own (row-major) order,
            // whatever its strides.
            outputs[i].copy_(rows.narrow(1, offset, m).reshape(outputs[i].sizes()));
            offset += m;
          }
        });
      });
}

c10::intrusive_ptr<c10d::Work> Backend::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                               std::vector<at::Tensor>& inputs, const c10d::GatherOptions& opts) {
  const Call call{kGather, opts.asyncOp};
  const int root = static_cast<int>(opts.rootRank);
  // A bad list on the root is rejected inside the collective (gather_into), so every rank raises.
  std::vector<at::Tensor> targets = getRank() == root && outputs.size() == 1 ? outputs[0] : std::vector<at::Tensor>();
  return collective(
      call,
      [&](std::string_view op) {
        check_single_tensor(op, inputs);
        check_cpu(op, inputs);
        check_cpu(op, targets);
      },
      [&] {
        return launch(call, targets, [input = inputs[0].contiguous(), targets, root](comm::Communicator& comm) mutable {
          comm::gather_into(targets, input, root, comm);
        });
      });
}

c10::intrusive_ptr<c10d::Work> Backend::scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ScatterOptions& opts) {
  const Call call{kScatter, opts.asyncOp};
  const int root = static_cast<int>(opts.rootRank);
  // A bad list on the root is rejected inside the collective (scatter_from), so every rank raises.
  std::vector<at::Tensor> sources = getRank() == root && inputs.size() == 1 ? inputs[0] : std::vector<at::Tensor>();
  return collective(
      call,
      [&](std::string_view op) {
        check_single_tensor(op, outputs);
        check_cpu(op, outputs);
        check_cpu(op, sources);
      },
      [&] {
        return launch(call, outputs, [output = outputs[0], sources, root](comm::Communicator& comm) mutable {
          on_contiguous(output, [&](at::Tensor& target) { comm::scatter_from(target, sources, root, comm); });
        });
      });
}

c10::intrusive_ptr<c10d::Work> Backend::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                       std::vector<std::vector<at::Tensor>>& inputs,
                                                       const c10d::ReduceScatterOptions& opts) {
  const Call call{kReduceScatter, opts.asyncOp};
  return collective(
      call,
      [&](std::string_view op) {
        check_single_tensor(op, outputs);
        check_cpu(op, outputs);
        check_single_list(op, inputs, "input");
        check_cpu(op, inputs[0]);
        // Also for a reduction delegated to gloo, which checks the list on this rank alone.
        check_list_per_rank(op, inputs[0], outputs[0], getSize());
      },
      [&] {
        const auto reduction = own_reduction(opts.reduceOp, outputs[0]);
        if (!reduction) {
          return delegate(
              call, outputs, delegated_header(call.op, outputs[0], opts.reduceOp),
              [gloo = gloo_, outputs, inputs, opts]() mutable { return gloo->reduce_scatter(outputs, inputs, opts); });
        }
        return launch(call, outputs,
                      [output = outputs[0], sources = inputs[0], reduction](comm::Communicator& comm) mutable {
                        const at::Tensor input = flat_cat(sources);
                        on_contiguous(output, [&](at::Tensor& target) {
                          comm::reduce_scatter_tensor_(target, input, *reduction, comm::Algorithm::kAuto, comm);
                        });
                      });
      });
}

c10::intrusive_ptr<c10d::Work> Backend::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                             const c10d::ReduceScatterOptions& opts) {
  const Call call{kReduceScatterTensor, opts.asyncOp};
  const auto reduction = own_reduction(opts.reduceOp, output);
  return collective(
      call,
      [&](std::string_view op) {
        check_cpu(op, output);
        check_cpu(op, input);
        if (!reduction) {
          // gloo checks these on this rank alone, once its peers are inside its collective: checked
          // here, a wrong input raises on every rank, as on ddpkit's own path.
          check_world_size_times(op, input, "the input", output, "the output", getSize());
          check_contiguous(op, input, output);
        }
      },
      [&] {
        if (!reduction) {
          // Flat, so that every shape ddpkit's own path takes (an input stacked as [n, *output.shape])
          // goes to gloo, which compares the shapes' first dimensions.
          return delegate(call, {output}, delegated_header(call.op, output, opts.reduceOp),
                          [gloo = gloo_, output = output.view(-1), input = input.view(-1), opts]() mutable {
                            return gloo->_reduce_scatter_base(output, input, opts);
                          });
        }
        return launch(call, {output},
                      [out = output, in = input, reduction, wire = cross_host_](comm::Communicator& comm) mutable {
                        comm.set_wire_format(wire);
                        comm::reduce_scatter_tensor_(out, in, *reduction, comm::Algorithm::kAuto, comm);
                      });
      });
}

c10::intrusive_ptr<c10d::Work> Backend::reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                        std::vector<at::Tensor>& inputs,
                                                                        const c10d::ReduceScatterOptions& opts) {
  const Call call{kReduceScatterTensorCoalesced, opts.asyncOp};
  const int n = getSize();
  return collective(
      call,
      [&](std::string_view op) {
        check_cpu(op, outputs);
        check_cpu(op, inputs);
        check_paired(op, outputs, inputs);
        TORCH_CHECK(!outputs.empty(), "ddpkit.", op, ": needs at least one output tensor");
        for (size_t i = 0; i < inputs.size(); ++i) {
          check_world_size_times(op, inputs[i], c10::str("input ", i), outputs[i], c10::str("output ", i), n);
        }
      },
      [&] {
        const auto reduction = own_reduction(opts.reduceOp, outputs);
        if (!reduction) {  // an op or a dtype ddpkit does not reduce, or several dtypes: gloo reduces each
          return delegate(call, outputs, delegated_header(call.op, outputs, opts.reduceOp),
                          [gloo = gloo_, outputs, inputs, opts]() mutable {
                            return gloo->reduce_scatter_tensor_coalesced(outputs, inputs, opts);
                          });
        }
        return launch(call, outputs, [outputs, inputs, op = *reduction, n](comm::Communicator& comm) mutable {
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
      });
}

c10::intrusive_ptr<c10d::Work> Backend::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                      std::vector<int64_t>& output_split_sizes,
                                                      std::vector<int64_t>& input_split_sizes,
                                                      const c10d::AllToAllOptions& opts) {
  const Call call{kAllToAllSingle, opts.asyncOp};
  std::vector<at::Tensor> outs, ins;
  return collective(
      call,
      [&](std::string_view op) {
        check_cpu(op, output);
        check_cpu(op, input);
        check_contiguous(op, output, input);
        outs = split_rows(op, output, output_split_sizes, getSize(), "output");
        ins = split_rows(op, input, input_split_sizes, getSize(), "input");
      },
      [&] {
        return launch(call, {output},
                      [outs, ins](comm::Communicator& comm) mutable { comm::all_to_all_(outs, ins, comm); });
      });
}

c10::intrusive_ptr<c10d::Work> Backend::alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                                 const c10d::AllToAllOptions& opts) {
  const Call call{kAllToAll, opts.asyncOp};
  return collective(
      call,
      [&](std::string_view op) {
        check_cpu(op, outputs);
        check_cpu(op, inputs);
      },
      [&] {
        return launch(call, outputs, [targets = outputs, sources = inputs](comm::Communicator& comm) mutable {
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
      });
}

c10::intrusive_ptr<c10d::Work> Backend::barrier(const c10d::BarrierOptions& opts) {
  // No arguments to validate. Its own timeout, where the caller gave one (Note [A call's timeout]);
  // c10d marks none with kUnsetTimeout.
  std::optional<std::chrono::milliseconds> timeout;
  if (opts.timeout != c10d::kUnsetTimeout) timeout = opts.timeout;
  return launch(Call{kBarrier, opts.asyncOp}, {}, [timeout](comm::Communicator& comm) {
    const comm::ScopedCallTimeout scoped(timeout);
    comm::barrier(comm);
  });
}

void Backend::monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) {
  point_to_point("monitored_barrier").monitoredBarrier(opts, wait_all_ranks);
}

c10::intrusive_ptr<c10d::Work> Backend::send(std::vector<at::Tensor>& tensors, int dst_rank, int tag) {
  return point_to_point("send").send(tensors, dst_rank, tag);
}

c10::intrusive_ptr<c10d::Work> Backend::recv(std::vector<at::Tensor>& tensors, int src_rank, int tag) {
  return point_to_point("recv").recv(tensors, src_rank, tag);
}

c10::intrusive_ptr<c10d::Work> Backend::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  return point_to_point("recv").recvAnysource(tensors, tag);
}

}  // namespace ddpkit::backend
