#pragma once
// Kernels of the ddpkit::sync_batch_norm and ddpkit::sync_batch_norm_backward ops (schemas in
// register.cpp) and the autograd kernel that ties them together.
//
// Communication: a training-mode forward with a group all-reduces exactly once (Note [One
// all-reduce per pass] in syncbn/kernels.h); its backward all-reduces exactly once when the input
// needs a gradient. Nothing else communicates: eval mode, `group_name` = None (a rank on its own)
// and weight/bias-only backward passes use local values only. Every rank of the group must make
// the same calls with the same `training`, `algorithm` and channel count; ranks may hold
// different batch sizes, empty ones included. A rank that rejects its own arguments takes part in
// the pass's all-reduce as a rank that rejects (Note [Collective checks]), so that every rank of the
// group raises at once, then raises its own error; errors that depend on the global batch (a single
// value per channel) are raised after the all-reduce, on every rank alike.
//
// Both ops run synchronously on the calling thread; the all-reduce waits for all ranks.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <array>
#include <optional>
#include <string_view>
#include <tuple>

namespace ddpkit::syncbn {

// Batch normalisation of `input` (N, C, *) over all values of each channel, on this rank or, with
// `group_name`, across every rank of that torch.distributed group.
//  - training: statistics of the (global) batch; when running_mean/running_var are given they
//    are updated in place with `momentum` and the unbiased variance, unless the batch is empty.
//    Raises ValueError when the batch holds a single value per channel.
//  - !training: statistics from running_mean/running_var (required); no communication.
// input: float32, float64, float16 or bfloat16, any layout (channels_last is kept); weight, bias,
// running_mean, running_var: [C] in the parameter dtype (the input's, or float32 for a
// float16/bfloat16 input), or None. `algorithm`: a ddpkit all-reduce algorithm
// (comm/collectives/collectives.h), parsed even where nothing is communicated.
// Returns (output in input's dtype, shape and memory format; the statistics saved for the
// backward, mean - K and invstd, [C] in the arithmetic dtype: Note [Saved statistics] in
// syncbn/kernels.h; the number of values per channel the statistics are over).
std::tuple<at::Tensor, at::Tensor, at::Tensor, int64_t> sync_batch_norm(
    const at::Tensor& input, const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& running_mean, const std::optional<at::Tensor>& running_var, bool training,
    double momentum, double eps, std::string_view algorithm, std::optional<std::string_view> group_name);

// ddpkit::sync_batch_norm through the dispatcher (every dispatch key, autograd included): what the
// autograd kernel calls below autograd, and SyncBatchNorm's eager binding (csrc/python.cpp).
const c10::TypedOperatorHandle<decltype(sync_batch_norm)>& sync_batch_norm_op();

// Gradients of sync_batch_norm given grad_output, the forward's input, weight, and its returned
// mean, invstd and count, with the forward's training, algorithm and group_name. output_mask
// selects (grad_input, grad_weight, grad_bias); unselected ones are undefined. grad_weight and
// grad_bias are this rank's local sums (Σ dy·x̂, Σ dy), as for torch's SyncBatchNorm: a data-parallel
// gradient average then yields the global batch's gradient. grad_input uses the group's sums and
// needs the backward's one all-reduce (training mode with a group only).
std::tuple<at::Tensor, at::Tensor, at::Tensor> sync_batch_norm_backward(
    const at::Tensor& grad_output, const at::Tensor& input, const std::optional<at::Tensor>& weight,
    const at::Tensor& mean, const at::Tensor& invstd, bool training, int64_t count, std::string_view algorithm,
    std::optional<std::string_view> group_name, std::array<bool, 3> output_mask);

// The Autograd-key kernel of ddpkit::sync_batch_norm: runs the op below autograd and records a
// node whose backward calls ddpkit::sync_batch_norm_backward (Note [SyncBatchNorm's autograd node],
// syncbn.cpp). Only the output is differentiable, once (the backward op has no derivative of its
// own).
std::tuple<at::Tensor, at::Tensor, at::Tensor, int64_t> sync_batch_norm_autograd(
    const at::Tensor& input, const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& running_mean, const std::optional<at::Tensor>& running_var, bool training,
    double momentum, double eps, std::string_view algorithm, std::optional<std::string_view> group_name);

// See set_native_cpu_kernels and cpu_kernels_name in syncbn/kernels.h.
void set_syncbn_native_cpu_kernels_op(bool enabled);
std::string syncbn_cpu_kernels_op();

}  // namespace ddpkit::syncbn
