#pragma once
// SyncBatchNorm's local math: everything one rank computes from its own tensors, without any
// communication. The ops in syncbn/syncbn.h put these around the single all-reduce of each pass.
//
// Every function takes tensors on one device and returns new tensors there. CPU tensors run the
// vectorised passes of syncbn/cpu/kernels.h and plain loops for the per-channel math (unless
// set_native_cpu_kernels(false)); every other device runs device-generic code made of ATen
// reductions and element-wise ops only (no batch-norm internals), so the same ops serve any device;
// a backend with kernels of its own (CUDA) replaces the passes (Note [Backend element kernels]).
//
// Dtypes: the input is float32, float64, float16 or bfloat16; weight, bias and running statistics
// have the "parameter dtype", the input's, or float32 for a float16/bfloat16 input. Element
// arithmetic runs in the "arithmetic dtype", float64 for float64 inputs and float32 otherwise, and
// the statistics a forward saves for its backward (mean, invstd) and the backward's sums are [C] /
// [2C] tensors of that dtype (Note [Saved statistics]). The all-reduce buffer of the forward is
// float64 (Note [One all-reduce per pass]).

#include "syncbn/cpu/kernels.h"

#include <ATen/ATen.h>

#include <array>
#include <string>

namespace ddpkit::syncbn {

// Note [Centred arithmetic]
// y = (x - mean) * invstd * w + b cannot be evaluated as x * scale + (b - mean * scale) in float32
// when |mean| is large against the spread: mean * scale loses what x - mean keeps. The element
// passes use center = (float) mean and write y = (x - center) * scale + offset with
// offset = b - (mean - center) * scale computed in float64: x - center is exact for x near the mean
// (Sterbenz), and the rounding of the mean is carried by the small per-channel term. The input
// gradient and Σ dy·(x - mean) use the same centre. The mean comes from the saved statistics as
// K + (mean - K) in float64 (Note [Saved statistics]). A centre near the mean, rather than K itself,
// keeps the float32 accumulators of Σ dy·(x - center) small (tests/test_syncbn.py:
// test_kernels_split_across_threads' weight gradient).

// Note [Saved statistics]
// A forward saves, per channel, the mean as mean - K and invstd, both in the arithmetic dtype
// (float32 for float32/float16/bfloat16 inputs, as torch's batch norm saves them), so that a
// layer holds no more per channel between its passes than torch's. K, the channel's shift, is
// the input's first value of the channel on this rank, x[0, c, 0, ...] (0 when this rank's input
// is empty): every pass that reads x can read it again, so K itself is never stored, and the
// mean of an input such as 1e4 + N(0, 1) keeps float32's precision relative to its spread, where
// a float32 mean would be off by half an ulp of 1e4 (tests/test_syncbn.py and tests/test_cuda.py:
// test_large_mean_inputs against float64 BatchNorm). The backward's sums ([Σ dy | Σ dy·(x - mean)],
// [2C]) are in the arithmetic dtype too, the kernels' accumulator type.

// An input seen in one of the two layouts of Note [CPU layouts] (syncbn/cpu/kernels.h).
struct LocalInput {
  at::Tensor x;             // the input itself, or its contiguous copy when its strides fit neither layout
  at::MemoryFormat format;  // x's memory format; outputs and gradients are made in it
  cpu::Shape shape;
  int64_t channels() const { return shape.channels; }
  int64_t count() const { return shape.count(); }  // values per channel on this rank
};

// Chooses the layout: channels-inner for (N, C), for inputs with one value per plane and for
// channels_last 4-D / channels_last_3d 5-D inputs; planar for contiguous (N, C, *) inputs; a
// contiguous copy, planar, for anything else. input.dim() >= 2.
LocalInput prepare_input(const at::Tensor& input);

// `t`, shaped like the input (grad_output), in x's memory format: `t` itself when it has it.
at::Tensor match_layout(const LocalInput& in, const at::Tensor& t);

// --- the passes of a step --------------------------------------------------------------------

// Note [One all-reduce per pass]
// Forward: each rank packs [n·mean_r | M2_r + n·mean_r² | n] (float64, 2C + 1) and one SUM
// all-reduce yields Σ n·mean_r = N·mean and Σ (M2_r + n·mean_r²) = Σ x², hence the global mean and
// biased variance Σx²/N - mean², with the global count N alongside, so that ranks of any batch
// size, empty ones included, contribute exactly their share. Each rank's mean_r and M2_r
// (= Σ(x - mean_r)², the centred sum of squares) are accurate (Note [Stable moments]); in float64
// the final difference keeps about 16 - 2·log10(|mean|/std) digits, 8 for inputs of mean 1e4 and
// unit spread. A rank alone (no group) keeps M2 itself: var = M2/n. Backward: [Σ dy | Σ dy·(x -
// mean)] (2C, in the arithmetic dtype) are sums already, reduced once. Both buffers are bitwise identical on all
// ranks afterwards, so every rank computes the same statistics and takes the same decisions (e.g.
// raising when the group has a single value per channel).

// Channel shifts K (Note [Saved statistics]): float64 [C] on the input's device, zeros for an
// empty input.
at::Tensor channel_shifts(const LocalInput& in);

// The statistics a forward saves (Note [Saved statistics]): mean - K and invstd, [C] tensors of the
// arithmetic dtype on the input's device; `count` the number of values per channel they are over
// (read on the host).
struct BatchStats {
  at::Tensor mean;  // shifted: mean - K
  at::Tensor invstd;
  double count = 0;
};

// The running estimates a training pass updates in place, as torch's batch norm does:
// mean <- (1 - momentum)·mean + momentum·batch mean, var likewise with the unbiased batch variance
// var·N/(N - 1). Only when both are defined and the batch has N > 1 values per channel (applies).
struct RunningStats {
  at::Tensor mean;
  at::Tensor var;
  double momentum = 0;
  bool applies(double count) const { return mean.defined() && var.defined() && count > 1; }
};

// RunningStats' update with the batch's mean and biased variance (float64 [C], unshifted) over
// `count` values where it applies, by plain loops on CPU and ATen ops elsewhere: the passes below
// call it, and a backend's kernel leaves it the estimates it cannot write in place.
void update_running_stats(const RunningStats& running, const at::Tensor& mean, const at::Tensor& var, double count);

// Forward, no group: the statistics of this rank's values alone, mean, biased var = M2/n and
// invstd = 1/sqrt(var + eps); an empty input gives mean 0 and var 0. Updates `running`.
BatchStats local_batch_stats(const LocalInput& in, double eps, const RunningStats& running);

// Forward, with a group: this rank's share of the all-reduce buffer, float64 [2C + 1].
at::Tensor packed_moments(const LocalInput& in);

// Forward, with a group: the statistics from the summed buffer of packed_moments (all ranks'
// values), shifted by this rank's `in`; a group with no values at all gives mean 0 and var 0.
// Updates `running`.
BatchStats stats_from_packed(const LocalInput& in, const at::Tensor& packed, double eps, const RunningStats& running);

// Eval mode: mean = running_mean, invstd = 1/sqrt(running_var + eps), saved as a forward saves them.
BatchStats stats_from_running(const LocalInput& in, const at::Tensor& running_mean, const at::Tensor& running_var,
                              double eps);

// y = (x - mean) * invstd * weight + bias in x's dtype and memory format (Note [Centred
// arithmetic]). mean, invstd: saved statistics of `in` (Note [Saved statistics]); weight, bias:
// parameter dtype [C] or undefined (1, 0).
at::Tensor normalize(const LocalInput& in, const at::Tensor& mean, const at::Tensor& invstd, const at::Tensor& weight,
                     const at::Tensor& bias);

// Forward, no group: local_batch_stats, then normalize, as one pass (a backend may fuse them: Note
// [One block per channel] in syncbn/cuda/kernels.cuh).
struct Normalized {
  at::Tensor output;
  BatchStats stats;
};
Normalized normalize_local(const LocalInput& in, double eps, const RunningStats& running, const at::Tensor& weight,
                           const at::Tensor& bias);

// Backward: this rank's [Σ dy | Σ dy·(x - mean)] per channel, [2C] in the arithmetic dtype (the
// all-reduce buffer), and from these local sums its weight and bias gradients, grad_weight = invstd·Σ dy·(x -
// mean) and grad_bias = Σ dy in `dtype`, tensors of their own (undefined where not wanted). dy:
// shaped like the input, in its memory format (match_layout).
struct LocalGradSums {
  at::Tensor sums;
  at::Tensor grad_weight;
  at::Tensor grad_bias;
};
LocalGradSums local_grad_sums(const LocalInput& in, const at::Tensor& dy, const at::Tensor& mean,
                              const at::Tensor& invstd, at::ScalarType dtype, bool want_weight, bool want_bias);

// Training-mode input gradient from the global sums ([2C], as local_grad_sums', summed over the
// group) and the global count N: w·invstd·(dy - Σdy/N - (x - mean)·invstd²·Σdy(x - mean)/N).
at::Tensor grad_input_training(const LocalInput& in, const at::Tensor& dy, const at::Tensor& mean,
                               const at::Tensor& invstd, const at::Tensor& weight, const at::Tensor& sums,
                               double count);

// Eval-mode input gradient, where mean and invstd are constants: w·invstd·dy. x is not read.
at::Tensor grad_input_eval(const LocalInput& in, const at::Tensor& dy, const at::Tensor& invstd,
                           const at::Tensor& weight);

// Training-mode backward, no group: local_grad_sums, then (where want_input) grad_input_training
// with the local sums and count = in.count(), as one pass (a backend may fuse them). Returns
// [grad_input, grad_weight, grad_bias], undefined where not wanted.
std::array<at::Tensor, 3> backward_local(const LocalInput& in, const at::Tensor& dy, const at::Tensor& mean,
                                         const at::Tensor& invstd, const at::Tensor& weight, at::ScalarType dtype,
                                         std::array<bool, 3> output_mask);

// --- backend kernels --------------------------------------------------------------------------

// Note [Backend element kernels]
// A backend with hand-written kernels (CUDA: syncbn/cuda/, compiled only when torch has CUDA and
// nvcc is found) supplies them as an ElementKernels table. Its dispatch-key kernels of
// ddpkit::sync_batch_norm and ddpkit::sync_batch_norm_backward (TORCH_LIBRARY_IMPL(ddpkit, CUDA, m)
// in syncbn/cuda/register.cpp, which the dispatcher prefers to the CompositeExplicitAutograd ones
// for tensors of that backend) install an ElementKernelsGuard on the calling thread and run the
// ops of syncbn/syncbn.h, so validation and the one all-reduce per pass stay in one place; while
// the guard lives, the passes above (all but channel_shifts and stats_from_running) run the table's functions for
// tensors on `device`. Other devices, and every call outside a guard, run the code above. Each
// function has the contract of the pass it replaces. A pass is the unit because a kernel launch
// costs more than a small layer's arithmetic: on a GPU each pass is one or two launches, with its
// per-channel math (statistics, running estimates, weight and bias gradients) fused into them.
struct ElementKernels {
  c10::DeviceType device;
  BatchStats (*local_batch_stats)(const LocalInput& in, double eps, const RunningStats& running);
  at::Tensor (*packed_moments)(const LocalInput& in);
  BatchStats (*stats_from_packed)(const LocalInput& in, const at::Tensor& packed, double eps,
                                  const RunningStats& running);
  at::Tensor (*normalize)(const LocalInput& in, const at::Tensor& mean, const at::Tensor& invstd,
                          const at::Tensor& weight, const at::Tensor& bias);
  LocalGradSums (*local_grad_sums)(const LocalInput& in, const at::Tensor& dy, const at::Tensor& mean,
                                   const at::Tensor& invstd, at::ScalarType dtype, bool want_weight, bool want_bias);
  at::Tensor (*grad_input_training)(const LocalInput& in, const at::Tensor& dy, const at::Tensor& mean,
                                    const at::Tensor& invstd, const at::Tensor& weight, const at::Tensor& sums,
                                    double count);
  at::Tensor (*grad_input_eval)(const LocalInput& in, const at::Tensor& dy, const at::Tensor& invstd,
                                const at::Tensor& weight);
  Normalized (*normalize_local)(const LocalInput& in, double eps, const RunningStats& running, const at::Tensor& weight,
                                const at::Tensor& bias);
  std::array<at::Tensor, 3> (*backward_local)(const LocalInput& in, const at::Tensor& dy, const at::Tensor& mean,
                                              const at::Tensor& invstd, const at::Tensor& weight, at::ScalarType dtype,
                                              std::array<bool, 3> output_mask);
};

// Makes `kernels` serve this thread's element passes until destroyed (nests; restores the previous).
class ElementKernelsGuard {
 public:
  explicit ElementKernelsGuard(const ElementKernels& kernels);
  ~ElementKernelsGuard();
  ElementKernelsGuard(const ElementKernelsGuard&) = delete;
  ElementKernelsGuard& operator=(const ElementKernelsGuard&) = delete;

 private:
  const ElementKernels* previous_;
};

// --- kernel selection -----------------------------------------------------------------------

// Whether CPU tensors run the native kernels (the default) or the device-generic code, for tests
// and benchmarks that compare the two. Process-wide; takes effect at the next call.
void set_native_cpu_kernels(bool enabled);
// "cpu-<capability>" (the CPU kernels' instruction set) or "aten" (the device-generic code).
std::string cpu_kernels_name();

}  // namespace ddpkit::syncbn
