#include "comm/engine/ops.h"

#include "comm/collectives/collectives.h"
#include "comm/core/counters.h"
#include "comm/core/wire_format.h"
#include "comm/engine/engine.h"
#include "comm/links/send_buffers.h"

#include <algorithm>
#include <array>

namespace ddpkit::comm {
namespace {

// `text` parsed by `parse`, or `fallback` when it cannot be, with why in `error` (the first reason
// kept). A rank never raises before its collective is numbered: it rejects its arguments inside
// the collective instead, so that every rank raises and the next calls pair (Note [Collective checks]).
template <class T>
T parse_or_note(T (*parse)(std::string_view), std::string_view text, T fallback, std::string& error) {
  try {
    return parse(text);
  } catch (const c10::Error& e) {
    if (error.empty()) error = e.what_without_backtrace();
    return fallback;
  }
}

// Runs `collective` as the group's next `kind` over `transport` (an unparseable name means "auto"
// and a rejection); a rank holding an `error` rejects its arguments in the collective instead.
template <class Collective>
void run_collective(const std::string& group_name, c10::DeviceType device, std::string_view transport,
                    CollectiveKind kind, std::string error, Collective&& collective) {
  const TransportKind parsed = parse_or_note(parse_transport, transport, TransportKind::kAuto, error);
  Engine::of(group_name)->run(device, parsed, collective_name(kind), [&](Communicator& comm) {
    if (!error.empty()) reject(kind, error, comm);
    collective(comm);
  });
}

}  // namespace

at::Tensor& all_reduce_op(at::Tensor& tensor, std::string_view op, std::string_view algorithm,
                          const std::string& group_name, std::string_view transport, std::string_view wire) {
  std::string error;
  const ReduceOp reduce_op = parse_or_note(parse_reduce_op, op, ReduceOp::kSum, error);
  const Algorithm parsed = parse_or_note(parse_algorithm, algorithm, Algorithm::kAuto, error);
  const WireFormat format = parse_or_note(parse_wire_format, wire, WireFormat::kExact, error);
  run_collective(group_name, tensor.device().type(), transport, CollectiveKind::kAllReduce, error,
                 [&](Communicator& comm) {
                   comm.set_wire_format(format);
                   all_reduce_(tensor, reduce_op, parsed, comm);
                 });
  return tensor;
}

at::Tensor& broadcast_op(at::Tensor& tensor, int64_t src, const std::string& group_name, std::string_view transport) {
  run_collective(group_name, tensor.device().type(), transport, CollectiveKind::kBroadcast, {},
                 [&](Communicator& comm) { broadcast_(tensor, static_cast<int>(src), comm); });
  return tensor;
}

at::Tensor& reduce_op(at::Tensor& tensor, int64_t dst, std::string_view op, const std::string& group_name,
                      std::string_view transport) {
  std::string error;
  const ReduceOp reduce_op = parse_or_note(parse_reduce_op, op, ReduceOp::kSum, error);
  run_collective(group_name, tensor.device().type(), transport, CollectiveKind::kReduce, error,
                 [&](Communicator& comm) { reduce_(tensor, static_cast<int>(dst), reduce_op, comm); });
  return tensor;
}

at::Tensor gather_op(const at::Tensor& tensor, int64_t dst, const std::string& group_name, std::string_view transport) {
  at::Tensor gathered;
  run_collective(group_name, tensor.device().type(), transport, CollectiveKind::kGather, {},
                 [&](Communicator& comm) { gathered = gather(tensor, static_cast<int>(dst), comm); });
  return gathered;
}

at::Tensor& scatter_op(at::Tensor& output, const std::optional<at::Tensor>& chunks, int64_t src,
                       const std::string& group_name, std::string_view transport) {
  run_collective(group_name, output.device().type(), transport, CollectiveKind::kScatter, {}, [&](Communicator& comm) {
    scatter_(output, chunks.value_or(at::Tensor()), static_cast<int>(src), comm);
  });
  return output;
}

at::Tensor& all_gather_into_tensor_op(at::Tensor& output, const at::Tensor& input, std::string_view algorithm,
                                      const std::string& group_name, std::string_view transport) {
  std::string error;
  const Algorithm parsed = parse_or_note(parse_algorithm, algorithm, Algorithm::kAuto, error);
  run_collective(group_name, output.device().type(), transport, CollectiveKind::kAllGather, error,
                 [&](Communicator& comm) { all_gather_into_tensor_(output, input, parsed, comm); });
  return output;
}

at::Tensor& reduce_scatter_tensor_op(at::Tensor& output, const at::Tensor& input, std::string_view op,
                                     std::string_view algorithm, const std::string& group_name,
                                     std::string_view transport, std::string_view wire) {
  std::string error;
  const ReduceOp reduce_op = parse_or_note(parse_reduce_op, op, ReduceOp::kSum, error);
  const Algorithm parsed = parse_or_note(parse_algorithm, algorithm, Algorithm::kAuto, error);
  const WireFormat format = parse_or_note(parse_wire_format, wire, WireFormat::kExact, error);
  run_collective(group_name, output.device().type(), transport, CollectiveKind::kReduceScatter, error,
                 [&](Communicator& comm) {
                   comm.set_wire_format(format);
                   reduce_scatter_tensor_(output, input, reduce_op, parsed, comm);
                 });
  return output;
}

void barrier_op(const std::string& group_name, std::string_view transport) {
  run_collective(group_name, c10::kCPU, transport, CollectiveKind::kBarrier, {},
                 [&](Communicator& comm) { barrier(comm); });
}

void meta_collective_op(std::string_view collective, const at::Tensor& tensor, std::string_view op,
                        std::string_view algorithm, int64_t root, const std::string& group_name,
                        std::string_view transport) {
  const CollectiveKind kind = parse_collective_kind(collective);
  std::string error;
  std::optional<ReduceOp> reduce_op;
  std::optional<Algorithm> parsed;
  if (!op.empty()) reduce_op = parse_or_note(parse_reduce_op, op, ReduceOp::kSum, error);
  if (!algorithm.empty()) parsed = parse_or_note(parse_algorithm, algorithm, Algorithm::kAuto, error);
  // The transport a CPU tensor would take, so that the check meets its peers' real collective.
  run_collective(group_name, c10::kCPU, transport, kind, {}, [&](Communicator& comm) {
    meta_collective(kind, tensor, reduce_op, parsed, static_cast<int>(root), comm, error);
  });
}

void set_collective_checks_op(bool enabled) { set_checked(enabled); }
bool collective_checks_enabled_op() { return is_checked(); }

std::vector<int64_t> comm_counters_op() {
  const CommCounters c = counters();
  return {c.collectives, c.messages_sent, c.bytes_sent, c.peak_buffered_bytes};
}

void reset_comm_counters_op() { reset_counters(); }

std::vector<int64_t> link_paths_op() {
  std::vector<int64_t> flat;
  for (const LinkPath& path : live_link_paths()) {
    flat.insert(flat.end(), {path.peer_rank, path.round_trip_us, path.bits_per_s, path.requested_bytes,
                             path.booked_bytes, path.grown, static_cast<int64_t>(path.choice)});
  }
  return flat;
}

std::string choose_send_buffer_op(int64_t round_trip_us, int64_t bits_per_s) {
  TORCH_CHECK(round_trip_us >= 0 && bits_per_s > 0, "ddpkit.comm.choose_send_buffer: a round trip of ", round_trip_us,
              " us and a rate of ", bits_per_s, " bit/s: the round trip must be >= 0 and the rate > 0");
  return std::string(kSendBufferChoiceNames[static_cast<size_t>(choose_send_buffer(round_trip_us, bits_per_s))]);
}

std::string choose_algorithm_op(int64_t bytes, int64_t world_size, bool shared_memory, bool hierarchical,
                                std::string_view op) {
  TORCH_CHECK(world_size >= 1, "ddpkit.choose_algorithm: world_size must be >= 1, got ", world_size);
  return std::string(algorithm_name(choose_algorithm(bytes, static_cast<int>(world_size), c10::kCPU, shared_memory,
                                                     hierarchical, parse_reduce_op(op))));
}

namespace {

template <size_t N>
std::vector<std::string> names_of(const std::array<std::string_view, N>& table) {
  return std::vector<std::string>(table.begin(), table.end());
}

}  // namespace

std::vector<std::string> algorithms_op() { return names_of(kAlgorithmNames); }
std::vector<std::string> transports_op() { return names_of(kTransportNames); }
std::vector<std::string> reduce_ops_op() { return names_of(kReduceOpNames); }
std::vector<std::string> collectives_op() { return names_of(kCollectiveNames); }
std::vector<std::string> wire_formats_op() { return names_of(kWireFormatNames); }
std::vector<std::string> send_buffer_choices_op() { return names_of(kSendBufferChoiceNames); }

std::vector<int64_t> topology_op(const std::string& group_name) {
  const Topology topology = Engine::of(group_name)->topology();
  return std::vector<int64_t>(topology.host_of.begin(), topology.host_of.end());
}

std::string resolved_transport_op(const std::string& group_name, std::string_view transport) {
  TransportKind resolved = TransportKind::kSendRecv;
  // Resolving may set up the segment, which is collective: it runs in the group's order.
  run_collective(group_name, c10::kCPU, transport, CollectiveKind::kBarrier, {},
                 [&](Communicator& comm) { resolved = parse_transport(comm.transport_name()); });
  return std::string(transport_name(resolved));
}

}  // namespace ddpkit::comm
