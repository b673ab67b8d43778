#include "comm/ops.h"

#include "comm/collectives.h"
#include "comm/communicator.h"

namespace ddpkit::comm {

at::Tensor& all_reduce_op(at::Tensor& tensor, std::string_view op, std::string_view algorithm,
                          const std::string& group_name) {
  const ReduceOp reduce_op = parse_reduce_op(op);
  const Algorithm parsed = parse_algorithm(algorithm);
  Communicator comm(group_name, tensor.device().type());
  all_reduce_(tensor, reduce_op, parsed, comm, comm.next_sequence());
  return tensor;
}

at::Tensor& broadcast_op(at::Tensor& tensor, int64_t src, const std::string& group_name) {
  Communicator comm(group_name, tensor.device().type());
  broadcast_(tensor, static_cast<int>(src), comm, comm.next_sequence());
  return tensor;
}

at::Tensor& reduce_op(at::Tensor& tensor, int64_t dst, std::string_view op, const std::string& group_name) {
  const ReduceOp reduce_op = parse_reduce_op(op);
  Communicator comm(group_name, tensor.device().type());
  reduce_(tensor, static_cast<int>(dst), reduce_op, comm, comm.next_sequence());
  return tensor;
}

at::Tensor gather_op(const at::Tensor& tensor, int64_t dst, const std::string& group_name) {
  Communicator comm(group_name, tensor.device().type());
  return gather(tensor, static_cast<int>(dst), comm, comm.next_sequence());
}

at::Tensor& scatter_op(at::Tensor& output, const std::optional<at::Tensor>& chunks, int64_t src,
                       const std::string& group_name) {
  Communicator comm(group_name, output.device().type());
  scatter_(output, chunks.value_or(at::Tensor()), static_cast<int>(src), comm, comm.next_sequence());
  return output;
}

void set_collective_checks_op(bool enabled) { set_checked(enabled); }
bool collective_checks_enabled_op() { return is_checked(); }

std::vector<int64_t> comm_counters_op() {
  const CommCounters c = counters();
  return {c.collectives, c.messages_sent, c.bytes_sent};
}

void reset_comm_counters_op() { reset_counters(); }

std::string choose_algorithm_op(int64_t bytes, int64_t world_size) {
  TORCH_CHECK(world_size >= 1, "ddpkit.choose_algorithm: world_size must be >= 1, got ", world_size);
  return std::string(algorithm_name(choose_algorithm(bytes, static_cast<int>(world_size))));
}

}  // namespace ddpkit::comm
