// Every ddpkit custom op: one TORCH_LIBRARY with the schemas, then one TORCH_LIBRARY_IMPL per
// dispatch key. Importing ddpkit._C (this module) runs these registrations; Python reaches the ops
// as torch.ops.ddpkit.<name> through thin wrappers in python/ddpkit/.

#include <torch/library.h>

#include <torch/custom_class.h>

#include "comm/engine/ops.h"
#include "ddp/bucket_assignment.h"
#include "ddp/reducer.h"
#include "fsdp/fully_sharded.h"
#include "sharding/shard_layout.h"
#include "sharding/sharded_parameters.h"
#include "syncbn/syncbn.h"

namespace {

std::vector<int64_t> assign_buckets_op(std::vector<int64_t> sizes_bytes, std::vector<int64_t> kinds, int64_t cap_bytes,
                                       int64_t first_cap_bytes, std::optional<c10::List<bool>> included) {
  std::vector<bool> keep(kinds.size(), true);
  if (included) {
    TORCH_CHECK(included->size() == kinds.size(),
                "assign_buckets: sizes, kinds and included must have the same length");
    for (size_t i = 0; i < keep.size(); ++i) keep[i] = included->get(i);
  }
  for (int64_t kind : kinds)
    TORCH_CHECK(kind >= 0, "assign_buckets: kinds must be >= 0, got ", kind,
                "; leave a parameter out with included[i] = False");
  return ddpkit::ddp::assign_buckets(sizes_bytes, kinds, keep, cap_bytes, first_cap_bytes);
}

std::vector<int64_t> shard_range_op(int64_t total, int64_t world_size, int64_t rank) {
  const auto range = ddpkit::sharding::shard_range(total, world_size, rank);
  return {range.begin, range.end};
}

// Each piece as four integers in a row (param, param_offset, length, shard_offset): a schema's lists hold
// no tuples.
std::vector<int64_t> shard_pieces_op(std::vector<int64_t> numels, int64_t world_size, int64_t rank) {
  std::vector<int64_t> out;
  for (const auto& piece : ddpkit::sharding::shard_pieces(numels, world_size, rank)) {
    out.insert(out.end(), {piece.param, piece.param_offset, piece.length, piece.shard_offset});
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(ddpkit, m) {
  // Collectives from point-to-point messages (csrc/comm). `group_name` is a torch.distributed
  // group's .group_name; the tensor's device picks the group's backend.
  // `transport`: "auto" (shared memory when every rank is on this host and the tensor is on CPU,
  // else the group's own send/recv), "shm" or "process_group"; see comm/engine/engine.h. `wire`: how the
  // data crosses hosts, "exact", "bfloat16" or "float16" (Note [Compressed crossing]).
  m.def(
      "all_reduce_(Tensor(a!) tensor, str op, str algorithm, str group_name, str transport=\"auto\", "
      "str wire=\"exact\") -> Tensor(a!)");
  m.def("broadcast_(Tensor(a!) tensor, int src, str group_name, str transport=\"auto\") -> Tensor(a!)");
  m.def("reduce_(Tensor(a!) tensor, int dst, str op, str group_name, str transport=\"auto\") -> Tensor(a!)");
  m.def("gather(Tensor tensor, int dst, str group_name, str transport=\"auto\") -> Tensor");
  m.def("scatter_(Tensor(a!) output, Tensor? chunks, int src, str group_name, str transport=\"auto\") -> Tensor(a!)");
  m.def(
      "all_gather_into_tensor_(Tensor(a!) output, Tensor input, str algorithm, str group_name, "
      "str transport=\"auto\") -> Tensor(a!)");
  m.def(
      "reduce_scatter_tensor_(Tensor(a!) output, Tensor input, str op, str algorithm, str group_name, "
      "str transport=\"auto\", str wire=\"exact\") -> Tensor(a!)");
  m.def("barrier(str group_name, str transport=\"auto\") -> ()", &ddpkit::comm::barrier_op);
  // The collective check of `collective` for meta tensors (no data): what the collectives' fake
  // kernels run for real meta tensors, so that a meta tensor on one rank raises on every rank.
  m.def(
      "meta_collective(str collective, Tensor tensor, str op, str algorithm, int root, str group_name, "
      "str transport=\"auto\") -> ()");
  m.def("set_collective_checks(bool enabled) -> ()", &ddpkit::comm::set_collective_checks_op);
  m.def("collective_checks_enabled() -> bool", &ddpkit::comm::collective_checks_enabled_op);
  m.def("comm_counters() -> int[]", &ddpkit::comm::comm_counters_op);
  m.def("reset_comm_counters() -> ()", &ddpkit::comm::reset_comm_counters_op);
  m.def("link_paths() -> int[]", &ddpkit::comm::link_paths_op);
  m.def("send_buffer_choices() -> str[]", &ddpkit::comm::send_buffer_choices_op);
  m.def("choose_send_buffer(int round_trip_us, int bits_per_s) -> str", &ddpkit::comm::choose_send_buffer_op);
  m.def(
      "choose_algorithm(int bytes, int world_size, bool shared_memory=False, bool hierarchical=False, "
      "str op=\"sum\") -> str",
      &ddpkit::comm::choose_algorithm_op);
  m.def("algorithms() -> str[]", &ddpkit::comm::algorithms_op);
  m.def("wire_formats() -> str[]", &ddpkit::comm::wire_formats_op);
  m.def("transports() -> str[]", &ddpkit::comm::transports_op);
  m.def("reduce_ops() -> str[]", &ddpkit::comm::reduce_ops_op);
  m.def("collectives() -> str[]", &ddpkit::comm::collectives_op);
  m.def("resolved_transport(str group_name, str transport=\"auto\") -> str", &ddpkit::comm::resolved_transport_op);
  m.def("topology(str group_name) -> int[]", &ddpkit::comm::topology_op);

  // Gradient bucketing DDP (csrc/ddp): the pure bucket assignment and the reducer.
  m.def("grad_sync_modes() -> str[]", &ddpkit::ddp::grad_sync_modes);
  m.def("gradient_sharding_modes() -> str[]", &ddpkit::ddp::gradient_sharding_modes);
  // Bucket index per parameter, -1 where included[i] is False (Note [Bucket assignment]).
  m.def(
      "assign_buckets(int[] sizes_bytes, int[] kinds, int cap_bytes, int first_cap_bytes, bool[]? included=None) "
      "-> int[]",
      &assign_buckets_op);
  m.class_<ddpkit::ddp::Reducer>("Reducer")
      .def(torch::init<std::vector<at::Tensor>, std::vector<int64_t>, std::optional<std::string>, std::string,
                       std::string, bool, std::string>(),
           "See csrc/ddp/reducer.h",
           {torch::arg("parameters"), torch::arg("bucket_of_param"), torch::arg("group_name"),
            torch::arg("algorithm") = "auto", torch::arg("grad_sync") = "bucketed",
            torch::arg("gradient_as_bucket_view") = true, torch::arg("shard") = "none"})
      .def("prepare_for_forward", &ddpkit::ddp::Reducer::prepare_for_forward)
      .def("set_sync", &ddpkit::ddp::Reducer::set_sync)
      .def("sync_enabled", &ddpkit::ddp::Reducer::sync_enabled)
      .def("finalize", &ddpkit::ddp::Reducer::finalize)
      .def("buckets", &ddpkit::ddp::Reducer::buckets)
      .def("gradient_shards", &ddpkit::ddp::Reducer::gradient_shards)
      .def("stats", &ddpkit::ddp::Reducer::stats);

  // The shard layout of sharded data parallelism (csrc/sharding, Note [Shard layout]).
  m.def("shard_size(int total, int world_size) -> int", &ddpkit::sharding::shard_size);
  m.def("shard_range(int total, int world_size, int rank) -> int[]", &shard_range_op);
  m.def("shard_pieces(int[] numels, int world_size, int rank) -> int[]", &shard_pieces_op);
  m.class_<ddpkit::sharding::ShardedParameters>("ShardedParameters")
      .def(torch::init<std::vector<at::Tensor>, std::vector<int64_t>, std::string>(),
           "See csrc/sharding/sharded_parameters.h",
           {torch::arg("parameters"), torch::arg("bucket_of_param"), torch::arg("group_name")})
      .def("buffers", &ddpkit::sharding::ShardedParameters::buffers)
      .def("shards", &ddpkit::sharding::ShardedParameters::shards)
      .def("pieces", &ddpkit::sharding::ShardedParameters::pieces)
      .def("offsets", &ddpkit::sharding::ShardedParameters::offsets)
      .def("gather", &ddpkit::sharding::ShardedParameters::gather)
      .def("wait", &ddpkit::sharding::ShardedParameters::wait)
      .def("wait_all", &ddpkit::sharding::ShardedParameters::wait_all)
      .def("pending", &ddpkit::sharding::ShardedParameters::pending)
      .def("world_size", &ddpkit::sharding::ShardedParameters::world_size)
      .def("rank", &ddpkit::sharding::ShardedParameters::rank);

  // ZeRO-3 (csrc/fsdp): the native state of ddpkit.FullyShardedDataParallel (fully_sharded.h).
  m.class_<ddpkit::fsdp::FullyShardedState>("FullyShardedState")
      .def(torch::init<std::string, std::optional<at::ScalarType>, std::string>(), "See csrc/fsdp/fully_sharded.h",
           {torch::arg("group_name"), torch::arg("compute_dtype"), torch::arg("wire") = "exact"})
      .def("add_unit", &ddpkit::fsdp::FullyShardedState::add_unit)
      .def("master_views", &ddpkit::fsdp::FullyShardedState::master_views)
      .def("compute_views", &ddpkit::fsdp::FullyShardedState::compute_views)
      .def("master", &ddpkit::fsdp::FullyShardedState::master)
      .def("layout", &ddpkit::fsdp::FullyShardedState::layout)
      .def("pieces", &ddpkit::fsdp::FullyShardedState::pieces)
      .def("attach", &ddpkit::fsdp::FullyShardedState::attach)
      .def("begin_forward", &ddpkit::fsdp::FullyShardedState::begin_forward)
      .def("pre_forward", &ddpkit::fsdp::FullyShardedState::pre_forward)
      .def("post_forward", &ddpkit::fsdp::FullyShardedState::post_forward)
      .def("end_forward", &ddpkit::fsdp::FullyShardedState::end_forward)
      .def("pre_backward", &ddpkit::fsdp::FullyShardedState::pre_backward)
      .def("set_sync", &ddpkit::fsdp::FullyShardedState::set_sync)
      .def("sync_enabled", &ddpkit::fsdp::FullyShardedState::sync_enabled)
      .def("finalize", &ddpkit::fsdp::FullyShardedState::finalize)
      .def("stats", &ddpkit::fsdp::FullyShardedState::stats);

  // SyncBatchNorm (csrc/syncbn). `group_name` None: this rank's batch alone, no communication.
  // Returns (output, mean, invstd, values per channel); see syncbn/syncbn.h.
  m.def(
      "sync_batch_norm(Tensor input, Tensor? weight, Tensor? bias, Tensor(a!)? running_mean, "
      "Tensor(b!)? running_var, bool training, float momentum, float eps, str algorithm, str? group_name) "
      "-> (Tensor, Tensor, Tensor, int)");
  m.def(
      "sync_batch_norm_backward(Tensor grad_output, Tensor input, Tensor? weight, Tensor mean, Tensor invstd, "
      "bool training, int count, str algorithm, str? group_name, bool[3] output_mask) -> (Tensor, Tensor, Tensor)");
  m.def("set_syncbn_native_cpu_kernels(bool enabled) -> ()", &ddpkit::syncbn::set_syncbn_native_cpu_kernels_op);
  m.def("syncbn_cpu_kernels() -> str", &ddpkit::syncbn::syncbn_cpu_kernels_op);
}

// Collectives only move and add tensors through ATen and the process group: one kernel for every
// device (gloo on CPU, NCCL on CUDA).
TORCH_LIBRARY_IMPL(ddpkit, CompositeExplicitAutograd, m) {
  m.impl("all_reduce_", &ddpkit::comm::all_reduce_op);
  m.impl("broadcast_", &ddpkit::comm::broadcast_op);
  m.impl("reduce_", &ddpkit::comm::reduce_op);
  m.impl("gather", &ddpkit::comm::gather_op);
  m.impl("scatter_", &ddpkit::comm::scatter_op);
  m.impl("all_gather_into_tensor_", &ddpkit::comm::all_gather_into_tensor_op);
  m.impl("reduce_scatter_tensor_", &ddpkit::comm::reduce_scatter_tensor_op);
  m.impl("meta_collective", &ddpkit::comm::meta_collective_op);
  // CPU tensors run the vectorised kernels, other devices ATen-generic code (syncbn/kernels.h).
  m.impl("sync_batch_norm", &ddpkit::syncbn::sync_batch_norm);
  m.impl("sync_batch_norm_backward", &ddpkit::syncbn::sync_batch_norm_backward);
}

// sync_batch_norm's hand-written backward (sync_batch_norm_backward is not differentiable).
TORCH_LIBRARY_IMPL(ddpkit, Autograd, m) { m.impl("sync_batch_norm", &ddpkit::syncbn::sync_batch_norm_autograd); }
