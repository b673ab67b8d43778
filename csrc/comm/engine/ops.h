#pragma once
// Kernels of the ddpkit::<collective> custom ops (schemas in register.cpp). Each parses its string
// arguments and runs the collective synchronously through its group's Engine (Note [Collective
// engine]); torch.ops calls release the GIL while a kernel runs. `transport` is "auto" | "shm" |
// "process_group" (parse_transport).

#include <ATen/ATen.h>

#include <string>
#include <vector>

namespace ddpkit::comm {

// `wire`: how the data crosses hosts, a name of kWireFormatNames (Note [Compressed crossing]).
at::Tensor& all_reduce_op(at::Tensor& tensor, std::string_view op, std::string_view algorithm,
                          const std::string& group_name, std::string_view transport, std::string_view wire);
at::Tensor& broadcast_op(at::Tensor& tensor, int64_t src, const std::string& group_name, std::string_view transport);
at::Tensor& reduce_op(at::Tensor& tensor, int64_t dst, std::string_view op, const std::string& group_name,
                      std::string_view transport);
at::Tensor gather_op(const at::Tensor& tensor, int64_t dst, const std::string& group_name, std::string_view transport);
at::Tensor& scatter_op(at::Tensor& output, const std::optional<at::Tensor>& chunks, int64_t src,
                       const std::string& group_name, std::string_view transport);

at::Tensor& all_gather_into_tensor_op(at::Tensor& output, const at::Tensor& input, std::string_view algorithm,
                                      const std::string& group_name, std::string_view transport);
at::Tensor& reduce_scatter_tensor_op(at::Tensor& output, const at::Tensor& input, std::string_view op,
                                     std::string_view algorithm, const std::string& group_name,
                                     std::string_view transport, std::string_view wire);
void barrier_op(const std::string& group_name, std::string_view transport);
// The collective `collective` (a name of kCollectiveNames) with meta tensors: its check alone, no
// data (comm::meta_collective). `op` and `algorithm` are "" where the collective has none.
void meta_collective_op(std::string_view collective, const at::Tensor& tensor, std::string_view op,
                        std::string_view algorithm, int64_t root, const std::string& group_name,
                        std::string_view transport);

void set_collective_checks_op(bool enabled);
bool collective_checks_enabled_op();
// [collectives, messages sent, bytes sent, peak buffered bytes] since the last reset, for this process.
std::vector<int64_t> comm_counters_op();
void reset_comm_counters_op();
// Every live link across hosts of this process (Note [Send buffers]), kLinkPathFields numbers each
// in that order; the choice is an index of kSendBufferChoiceNames (send_buffer_choices_op).
inline constexpr int kLinkPathFields = 7;  // peer, round trip (us), rate (bit/s), asked, booked, grown, choice
std::vector<int64_t> link_paths_op();
std::vector<std::string> send_buffer_choices_op();
// The set-up's choice for a path of `round_trip_us` across an interface of `bits_per_s` (a name of
// kSendBufferChoiceNames): what the links decide, for the tests.
std::string choose_send_buffer_op(int64_t round_trip_us, int64_t bits_per_s);
// The names of kWireFormatNames, in enum order (Note [Compressed crossing]).
std::vector<std::string> wire_formats_op();
std::string choose_algorithm_op(int64_t bytes, int64_t world_size, bool shared_memory, bool hierarchical,
                                std::string_view op);
// The names the string arguments accept, from the C++ enums' name tables (Python reads them here).
std::vector<std::string> algorithms_op();
std::vector<std::string> transports_op();
std::vector<std::string> reduce_ops_op();
std::vector<std::string> collectives_op();
// Each rank's host (Note [Topology]), hosts numbered by their lowest rank (a collective: every rank
// calls it).
std::vector<int64_t> topology_op(const std::string& group_name);
// What `transport` resolves to for CPU tensors of the group (a collective: every rank calls it).
std::string resolved_transport_op(const std::string& group_name, std::string_view transport);

}  // namespace ddpkit::comm
