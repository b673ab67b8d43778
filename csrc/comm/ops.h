#pragma once
// Kernels of the ddpkit::<collective> custom ops (schemas in register.cpp). Each resolves the
// process group from its name, reserves the group's next sequence on the calling thread and runs
// the collective synchronously (torch.ops calls release the GIL while a kernel runs).

#include <ATen/ATen.h>

#include <string>
#include <vector>

namespace ddpkit::comm {

at::Tensor& all_reduce_op(at::Tensor& tensor, std::string_view op, std::string_view algorithm,
                          const std::string& group_name);
at::Tensor& broadcast_op(at::Tensor& tensor, int64_t src, const std::string& group_name);
at::Tensor& reduce_op(at::Tensor& tensor, int64_t dst, std::string_view op, const std::string& group_name);
at::Tensor gather_op(const at::Tensor& tensor, int64_t dst, const std::string& group_name);
at::Tensor& scatter_op(at::Tensor& output, const std::optional<at::Tensor>& chunks, int64_t src,
                       const std::string& group_name);

void set_collective_checks_op(bool enabled);
bool collective_checks_enabled_op();
// [collectives, messages sent, bytes sent] since the last reset, for this process.
std::vector<int64_t> comm_counters_op();
void reset_comm_counters_op();
std::string choose_algorithm_op(int64_t bytes, int64_t world_size);

}  // namespace ddpkit::comm
