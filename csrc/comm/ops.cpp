#include "comm/ops.h"

#include "comm/collectives.h"
#include "comm/engine.h"

namespace ddpkit::comm {

at::Tensor& all_reduce_op(at::Tensor& tensor, std::string_view op, std::string_view algorithm,
                          const std::string& group_name, std::string_view transport) {
  const ReduceOp reduce_op = parse_reduce_op(op);
  const Algorithm parsed = parse_algorithm(algorithm);
  Engine::of(group_name)->run(tensor.device().type(), parse_transport(transport),
                              [&](Communicator& comm) { all_reduce_(tensor, reduce_op, parsed, comm); });
  return tensor;
}

at::Tensor& broadcast_op(at::Tensor& tensor, int64_t src, const std::string& group_name, std::string_view transport) {
  Engine::of(group_name)->run(tensor.device().type(), parse_transport(transport),
                              [&](Communicator& comm) { broadcast_(tensor, static_cast<int>(src), comm); });
  return tensor;
}

at::Tensor& reduce_op(at::Tensor& tensor, int64_t dst, std::string_view op, const std::string& group_name,
                      std::string_view transport) {
  const ReduceOp reduce_op = parse_reduce_op(op);
  Engine::of(group_name)->run(tensor.device().type(), parse_transport(transport),
                              [&](Communicator& comm) { reduce_(tensor, static_cast<int>(dst), reduce_op, comm); });
  return tensor;
}

at::Tensor gather_op(const at::Tensor& tensor, int64_t dst, const std::string& group_name, std::string_view transport) {
  at::Tensor gathered;
  Engine::of(group_name)->run(tensor.device().type(), parse_transport(transport),
                              [&](Communicator& comm) { gathered = gather(tensor, static_cast<int>(dst), comm); });
  return gathered;
}

at::Tensor& scatter_op(at::Tensor& output, const std::optional<at::Tensor>& chunks, int64_t src,
                       const std::string& group_name, std::string_view transport) {
  Engine::of(group_name)->run(output.device().type(), parse_transport(transport), [&](Communicator& comm) {
    scatter_(output, chunks.value_or(at::Tensor()), static_cast<int>(src), comm);
  });
  return output;
}

at::Tensor& all_gather_into_tensor_op(at::Tensor& output, const at::Tensor& input, std::string_view algorithm,
                                      const std::string& group_name, std::string_view transport) {
  const Algorithm parsed = parse_algorithm(algorithm);
  Engine::of(group_name)->run(output.device().type(), parse_transport(transport),
                              [&](Communicator& comm) { all_gather_into_tensor_(output, input, parsed, comm); });
  return output;
}

at::Tensor& reduce_scatter_tensor_op(at::Tensor& output, const at::Tensor& input, std::string_view op,
                                     std::string_view algorithm, const std::string& group_name,
                                     std::string_view transport) {
  const ReduceOp reduce_op = parse_reduce_op(op);
  const Algorithm parsed = parse_algorithm(algorithm);
  Engine::of(group_name)->run(output.device().type(), parse_transport(transport), [&](Communicator& comm) {
    reduce_scatter_tensor_(output, input, reduce_op, parsed, comm);
  });
  return output;
}

void barrier_op(const std::string& group_name, std::string_view transport) {
  Engine::of(group_name)->run(c10::kCPU, parse_transport(transport), [&](Communicator& comm) { barrier(comm); });
}

void set_collective_checks_op(bool enabled) { set_checked(enabled); }
bool collective_checks_enabled_op() { return is_checked(); }

std::vector<int64_t> comm_counters_op() {
  const CommCounters c = counters();
  return {c.collectives, c.messages_sent, c.bytes_sent, c.peak_buffered_bytes};
}

void reset_comm_counters_op() { reset_counters(); }

std::string choose_algorithm_op(int64_t bytes, int64_t world_size, bool shared_memory) {
  TORCH_CHECK(world_size >= 1, "ddpkit.choose_algorithm: world_size must be >= 1, got ", world_size);
  return std::string(algorithm_name(choose_algorithm(bytes, static_cast<int>(world_size), c10::kCPU, shared_memory)));
}

std::vector<std::string> algorithms_op() {
  std::vector<std::string> names;
  for (Algorithm a : {Algorithm::kRing, Algorithm::kButterfly, Algorithm::kStar, Algorithm::kGatherScatter,
                      Algorithm::kRecursiveDoubling, Algorithm::kHalvingDoubling, Algorithm::kDirect, Algorithm::kAuto,
                      Algorithm::kProcessGroup}) {
    names.emplace_back(algorithm_name(a));
  }
  return names;
}

std::vector<std::string> transports_op() {
  return {std::string(transport_name(TransportKind::kAuto)), std::string(transport_name(TransportKind::kShm)),
          std::string(transport_name(TransportKind::kProcessGroup))};
}

std::string resolved_transport_op(const std::string& group_name, std::string_view transport) {
  TransportKind resolved = TransportKind::kProcessGroup;
  auto engine = Engine::of(group_name);
  // Resolving may set up the segment, which is collective: it runs in the group's order.
  engine->run(c10::kCPU, parse_transport(transport),
              [&](Communicator& comm) { resolved = comm.shm() ? TransportKind::kShm : TransportKind::kProcessGroup; });
  return std::string(transport_name(resolved));
}

}  // namespace ddpkit::comm
