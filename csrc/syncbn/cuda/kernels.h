#pragma once
// SyncBatchNorm's passes for CUDA tensors (compiled only in CUDA builds; see the CUDA block of
// CMakeLists.txt). Each function has the contract of the pass of the same name in
// syncbn/kernels.h — same arguments, float64 [C] / [2C] statistics and sums on the input's device,
// outputs in the input's dtype and memory format — and runs hand-written kernels
// (syncbn/cuda/kernels.cuh) on torch's current CUDA stream of the input's device, asynchronously.
// They do local math only; the ops in syncbn/syncbn.h put them around their one all-reduce per
// pass (Note [Backend element kernels] in syncbn/kernels.h).

#include "syncbn/kernels.h"

namespace ddpkit::syncbn::cuda {

BatchStats local_batch_stats(const LocalInput& in, double eps, const RunningStats& running);
at::Tensor packed_moments(const LocalInput& in);
BatchStats stats_from_packed(const at::Tensor& packed, double eps, const RunningStats& running);
at::Tensor normalize(const LocalInput& in, const at::Tensor& mean, const at::Tensor& invstd, const at::Tensor& weight,
                     const at::Tensor& bias);
LocalGradSums local_grad_sums(const LocalInput& in, const at::Tensor& dy, const at::Tensor& mean,
                              const at::Tensor& invstd, at::ScalarType dtype, bool want_weight, bool want_bias);
at::Tensor grad_input_training(const LocalInput& in, const at::Tensor& dy, const at::Tensor& mean,
                               const at::Tensor& invstd, const at::Tensor& weight, const at::Tensor& sums,
                               double count);
at::Tensor grad_input_eval(const LocalInput& in, const at::Tensor& dy, const at::Tensor& invstd,
                           const at::Tensor& weight);

// The seven functions above as the CUDA table of Note [Backend element kernels].
const ElementKernels& element_kernels();

}  // namespace ddpkit::syncbn::cuda
