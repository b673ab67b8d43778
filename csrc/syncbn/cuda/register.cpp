// The CUDA-key kernels of ddpkit::sync_batch_norm and ddpkit::sync_batch_norm_backward (schemas
// in csrc/register.cpp), compiled only in CUDA builds (the CUDA block of CMakeLists.txt).
//
// register.cpp registers both ops under CompositeExplicitAutograd, a kernel for every backend. A
// kernel registered for the CUDA key itself takes precedence for CUDA tensors: when the
// dispatcher computes an operator's table, a backend key's own kernel comes before the
// CompositeExplicitAutograd one, which only fills keys that have none. The Autograd kernel is
// unchanged: it redispatches below autograd, which now lands here for CUDA tensors. Other devices,
// and CUDA builds without these objects, keep the ATen-generic code.
//
// These kernels run the very ops of syncbn/syncbn.h (validation, per-channel float64 math, one
// all-reduce per pass) with the CUDA element passes installed (Note [Backend element kernels] in
// syncbn/kernels.h), on the input's device.

#include "syncbn/cuda/kernels.h"
#include "syncbn/syncbn.h"

#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

namespace ddpkit::syncbn::cuda {
namespace {

// The input's device, when it is a CUDA one (a CPU input beside CUDA parameters also lands here;
// the op then rejects it, naming both devices).
std::optional<c10::Device> cuda_device(const at::Tensor& input) {
  return input.is_cuda() ? std::optional<c10::Device>(input.device()) : std::nullopt;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, int64_t> sync_batch_norm_cuda(
    const at::Tensor& input, const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& running_mean, const std::optional<at::Tensor>& running_var, bool training,
    double momentum, double eps, std::string_view algorithm, std::optional<std::string_view> group_name) {
  const c10::cuda::OptionalCUDAGuard device_guard(cuda_device(input));
  const ElementKernelsGuard kernels(element_kernels());
  return sync_batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps, algorithm,
                         group_name);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> sync_batch_norm_backward_cuda(
    const at::Tensor& grad_output, const at::Tensor& input, const std::optional<at::Tensor>& weight,
    const at::Tensor& mean, const at::Tensor& invstd, bool training, int64_t count, std::string_view algorithm,
    std::optional<std::string_view> group_name, std::array<bool, 3> output_mask) {
  const c10::cuda::OptionalCUDAGuard device_guard(cuda_device(input));
  const ElementKernelsGuard kernels(element_kernels());
  return sync_batch_norm_backward(grad_output, input, weight, mean, invstd, training, count, algorithm, group_name,
                                  output_mask);
}

}  // namespace
}  // namespace ddpkit::syncbn::cuda

TORCH_LIBRARY_IMPL(ddpkit, CUDA, m) {
  m.impl("sync_batch_norm", &ddpkit::syncbn::cuda::sync_batch_norm_cuda);
  m.impl("sync_batch_norm_backward", &ddpkit::syncbn::cuda::sync_batch_norm_backward_cuda);
}
