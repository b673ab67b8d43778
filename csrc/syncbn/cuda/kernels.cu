// Launchers of SyncBatchNorm's CUDA element passes (syncbn/cuda/kernels.h): grid sizes,
// workspaces, dtype dispatch. The device code is in syncbn/cuda/kernels.cuh.

#include "syncbn/cuda/kernels.h"

#include "syncbn/cuda/kernels.cuh"

#include <ATen/AccumulateType.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <initializer_list>

namespace ddpkit::syncbn::cuda {
namespace {

constexpr int64_t kMaxGridY = 65535;
// A reduction split gets at least this many values per thread, so that the partials of a
// channel stay few against its values.
constexpr int64_t kMinValuesPerThread = 8;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The smallest l with 2^l >= v (v >= 1).
int ceil_log2(int64_t v) {
  int l = 0;
  while ((int64_t{1} << l) < v) ++l;
  return l;
}

// The current device's multiprocessors, and how many blocks of kThreads fill every one of them once
// (queried once per device; plain runtime calls, so that this file needs no ATen/cuda header, hence
// no cuBLAS or cuSPARSE header).
struct DeviceShape {
  int64_t multiprocessors;
  int64_t resident_blocks;
};

DeviceShape device_shape() {
  static std::array<std::atomic<int64_t>, C10_COMPILE_TIME_MAX_GPUS> cache{};  // multiprocessors, 0: not yet
  static std::array<std::atomic<int64_t>, C10_COMPILE_TIME_MAX_GPUS> blocks_cache{};
  const c10::DeviceIndex device = c10::cuda::current_device();
  int64_t blocks = blocks_cache[device].load(std::memory_order_acquire);
  if (blocks == 0) {
    int multiprocessors = 0, threads = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, device));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&threads, cudaDevAttrMaxThreadsPerMultiProcessor, device));
    cache[device].store(multiprocessors, std::memory_order_relaxed);
    blocks = static_cast<int64_t>(multiprocessors) * std::max(1, threads / kThreads);
    blocks_cache[device].store(blocks, std::memory_order_release);
  }
  return DeviceShape{cache[device].load(std::memory_order_relaxed), blocks};
}

int64_t resident_blocks() { return device_shape().resident_blocks; }

// Whether a pass without a group runs one block per channel (Note [One block per channel]): a
// non-empty planar input with at least as many channels as the device has multiprocessors.
bool one_block_per_channel(const LocalInput& in) {
  return !in.shape.channels_inner && in.count() > 0 && in.channels() >= device_shape().multiprocessors;
}

// The vector width of the one-block-per-channel kernels for these pointers: 16 bytes of elements
// where the planes' length and every pointer allow, else 1.
template <typename scalar_t>
int vector_width(int64_t inner, std::initializer_list<const void*> pointers) {
  constexpr int wide = static_cast<int>(16 / sizeof(scalar_t));
  if (inner % wide != 0) return 1;
  for (const void* p : pointers) {
    if (p != nullptr && reinterpret_cast<std::uintptr_t>(p) % 16 != 0) return 1;
  }
  return wide;
}

// Thread block for the channels-inner layout: up to 32 consecutive channels across x (one warp
// reads a contiguous run of a row), the rest of the kThreads threads across rows.
dim3 rows_block(int64_t channels) {
  const int bx = 1 << std::min(5, ceil_log2(channels));
  return dim3(bx, kThreads / bx);
}

// How many splits of each channel's values the reduction runs in parallel: enough blocks to fill
// the device, no split with fewer than kMinValuesPerThread values per thread.
int64_t reduction_splits(int64_t blocks_per_split, int64_t values_per_block_step, int64_t values) {
  const int64_t wanted = ceil_div(resident_blocks(), blocks_per_split);
  const int64_t most = std::max<int64_t>(1, values / (values_per_block_step * kMinValuesPerThread));
  return std::clamp<int64_t>(std::min(wanted, most), 1, kMaxGridY);
}

// How many splits of each channel's values a reduction over in's layout runs (the moments and the
// grad sums share one grid).
int64_t splits_per_channel(const cpu::Shape& shape, int64_t channels, int64_t count) {
  if (shape.channels_inner) {
    const dim3 block = rows_block(channels);
    return reduction_splits(ceil_div(channels, block.x), block.y, shape.outer);
  }
  return reduction_splits(channels, kThreads, count);
}

Param param(const at::Tensor& t) {
  if (!t.defined()) return Param{nullptr, ParamType::kNone};
  switch (t.scalar_type()) {
    case at::kFloat: return Param{t.const_data_ptr(), ParamType::kFloat};
    case at::kDouble: return Param{t.const_data_ptr(), ParamType::kDouble};
    case at::kHalf: return Param{t.const_data_ptr(), ParamType::kHalf};
    case at::kBFloat16: return Param{t.const_data_ptr(), ParamType::kBFloat16};
    default: TORCH_CHECK(false, "ddpkit.sync_batch_norm (CUDA): unsupported parameter dtype ", t.scalar_type());
  }
}

// A tensor a kernel writes per channel: `t` itself (contiguous), or kNone when undefined.
MutableParam mutable_param(const at::Tensor& t) {
  if (!t.defined()) return MutableParam{nullptr, ParamType::kNone};
  TORCH_INTERNAL_ASSERT(t.is_contiguous());
  const Param p = param(t);
  return MutableParam{t.data_ptr(), p.type};
}

at::Tensor contiguous_or_undefined(const at::Tensor& t) { return t.defined() ? t.contiguous() : t; }

at::Tensor workspace(const at::Tensor& like, int64_t bytes) {
  return at::empty({bytes}, like.options().dtype(at::kByte));
}

// The arguments of an element-wise pass: the saved statistics, weight and bias, and for
// kGradTraining the global sums and count.
struct PassTensors {
  at::Tensor mean, invstd;
  at::Tensor weight, bias;
  at::Tensor sums;
  double inv_count = 0.0;
  template <typename acc_t>
  PassArgs<acc_t> args() const {
    auto data = [](const at::Tensor& t) { return t.defined() ? t.const_data_ptr<acc_t>() : nullptr; };
    return PassArgs<acc_t>{data(mean), data(invstd), param(weight), param(bias), data(sums), inv_count};
  }
};

// Runs the element-wise pass `pass` over in's layout: out = k·dy + q·(x - K) + r.
template <Pass pass>
at::Tensor affine_pass(const LocalInput& in, const at::Tensor& dy, const PassTensors& tensors) {
  const at::Tensor& x = in.x;
  at::Tensor out = at::empty_like(x);
  if (out.numel() == 0) return out;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const cpu::Shape& shape = in.shape;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "ddpkit_syncbn_cuda_affine", [&] {
    using acc_t = at::acc_type<scalar_t, /*is_cuda=*/true>;
    const PassArgs<acc_t> args = tensors.args<acc_t>();
    const scalar_t* xp = pass == Pass::kGradEval ? nullptr : x.const_data_ptr<scalar_t>();
    const scalar_t* dyp = pass == Pass::kNormalize ? nullptr : dy.const_data_ptr<scalar_t>();
    scalar_t* op = out.mutable_data_ptr<scalar_t>();
    if (shape.channels_inner) {
      const dim3 block = rows_block(shape.channels);
      const int64_t grid_x = ceil_div(shape.channels, block.x);
      const int64_t grid_y = std::clamp<int64_t>(
          std::min(ceil_div(shape.outer, block.y), ceil_div(4 * resident_blocks(), grid_x)), 1, kMaxGridY);
      affine_rows_kernel<pass, scalar_t, acc_t>
          <<<dim3(grid_x, grid_y), block, 0, stream>>>(xp, dyp, op, shape.outer, shape.channels, args);
    } else {
      const int lanes_log2 = std::min(ceil_log2(shape.inner), ceil_log2(kThreads));
      const int64_t planes = shape.outer * shape.channels;
      const int64_t grid_x = ceil_div(planes, kThreads >> lanes_log2);
      affine_planar_kernel<pass, scalar_t, acc_t>
          <<<grid_x, kThreads, 0, stream>>>(xp, dyp, op, planes, shape.channels, shape.inner, lanes_log2, args);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

// Runs the moments reduction over in's layout and ends it with `finish(c, moments)` per channel
// (LocalStats or PackedMoments): in the reduction kernel itself when each channel has one split,
// else in a finishing kernel over the partials (Note [Reduction sinks]). An empty input runs only
// the finishing kernel, over no partials.
template <typename Finish>
void run_moments(const LocalInput& in, const Finish& finish) {
  const at::Tensor& x = in.x;
  const int64_t channels = in.channels();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const cpu::Shape& shape = in.shape;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "ddpkit_syncbn_cuda_moments", [&] {
    using acc_t = at::acc_type<scalar_t, /*is_cuda=*/true>;
    const scalar_t* xp = in.count() == 0 ? nullptr : x.const_data_ptr<scalar_t>();
    // Launches the reduction with `sink` on a grid of `splits` splits per channel.
    auto reduce = [&](int64_t splits, auto sink) {
      if (shape.channels_inner) {
        const dim3 block = rows_block(channels);
        moments_rows_kernel<scalar_t, acc_t>
            <<<dim3(ceil_div(channels, block.x), splits), block, 0, stream>>>(xp, shape.outer, channels, sink);
      } else if (in.count() < (int64_t{1} << 31)) {
        moments_planar_kernel<scalar_t, acc_t, uint32_t>
            <<<dim3(channels, splits), kThreads, 0, stream>>>(xp, shape.outer, channels, shape.inner, sink);
      } else {
        moments_planar_kernel<scalar_t, acc_t, uint64_t>
            <<<dim3(channels, splits), kThreads, 0, stream>>>(xp, shape.outer, channels, shape.inner, sink);
      }
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    const int64_t splits = xp == nullptr ? 0 : splits_per_channel(shape, channels, in.count());
    if (splits == 1) {
      reduce(1, FinishMoments<Finish>{finish});
      return;
    }
    const at::Tensor partial = workspace(x, splits * channels * static_cast<int64_t>(sizeof(Welford<acc_t>)));
    auto* p = reinterpret_cast<Welford<acc_t>*>(partial.mutable_data_ptr());
    if (splits > 0) reduce(splits, StoreMoments<acc_t>{p, channels});
    moments_finish_kernel<scalar_t, acc_t><<<ceil_div(channels, kThreads), kThreads, 0, stream>>>(
        p, splits, channels, xp, shape.channels_inner ? int64_t{1} : shape.inner, finish);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

// Where the statistics of `count` values per channel go: the saved statistics, and the running
// update of RunningStats' rule. The kernels write contiguous running estimates in place; others are
// left to update_running_stats, with the unshifted mean and var the kernels then also write.
struct StatsTarget {
  BatchStats stats;
  RunningStats running;
  at::Tensor unshifted_mean, var;  // defined only when update_afterwards
  bool in_place = false;
  bool update_afterwards() const { return unshifted_mean.defined(); }

  template <typename acc_t>
  StatsOut<acc_t> out() const {
    const double count = stats.count;
    auto doubles = [](const at::Tensor& t) { return t.defined() ? t.mutable_data_ptr<double>() : nullptr; };
    return StatsOut<acc_t>{stats.mean.mutable_data_ptr<acc_t>(),
                           stats.invstd.mutable_data_ptr<acc_t>(),
                           doubles(unshifted_mean),
                           doubles(var),
                           in_place ? mutable_param(running.mean) : MutableParam{nullptr, ParamType::kNone},
                           in_place ? mutable_param(running.var) : MutableParam{nullptr, ParamType::kNone},
                           running.momentum,
                           count > 1 ? count / (count - 1) : 0.0};
  }
  void finish() const {
    if (update_afterwards()) update_running_stats(running, unshifted_mean, var, stats.count);
  }
};

StatsTarget stats_target(const LocalInput& in, double count, const RunningStats& running) {
  const int64_t channels = in.channels();
  const auto arithmetic = in.x.options().dtype(in.x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat);
  StatsTarget t;
  t.stats = BatchStats{at::empty({channels}, arithmetic), at::empty({channels}, arithmetic), count};
  t.running = running;
  if (running.applies(count)) {
    if (running.mean.is_contiguous() && running.var.is_contiguous()) {
      t.in_place = true;
    } else {
      const auto doubles = in.x.options().dtype(at::kDouble);
      t.unshifted_mean = at::empty({channels}, doubles);
      t.var = at::empty({channels}, doubles);
    }
  }
  return t;
}

// The passes of syncbn/kernels.h, each with the contract of the pass of the same name there.

BatchStats local_batch_stats(const LocalInput& in, double eps, const RunningStats& running) {
  const c10::cuda::CUDAGuard device_guard(in.x.device());
  const double count = static_cast<double>(in.count());
  const StatsTarget t = stats_target(in, count, running);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, in.x.scalar_type(), "ddpkit_syncbn_cuda_local_stats", [&] {
    using acc_t = at::acc_type<scalar_t, /*is_cuda=*/true>;
    run_moments(in, LocalStats<acc_t>{count > 0 ? 1.0 / count : 0.0, eps, t.out<acc_t>()});
  });
  t.finish();
  return t.stats;
}

at::Tensor packed_moments(const LocalInput& in) {
  const c10::cuda::CUDAGuard device_guard(in.x.device());
  const int64_t channels = in.channels();
  at::Tensor packed = at::empty({2 * channels + 1}, in.x.options().dtype(at::kDouble));
  run_moments(in, PackedMoments{channels, static_cast<double>(in.count()), packed.mutable_data_ptr<double>()});
  return packed;
}

BatchStats stats_from_packed(const LocalInput& in, const at::Tensor& packed, double eps, const RunningStats& running) {
  const c10::cuda::CUDAGuard device_guard(packed.device());
  const int64_t channels = in.channels();
  const at::Tensor p = packed.contiguous();
  // The host needs the group's count (the op returns it and raises on a single value); reading it
  // waits for the all-reduce that produced `packed`.
  const double count = p[2 * channels].item<double>();
  const StatsTarget t = stats_target(in, count, running);
  const cpu::Shape& shape = in.shape;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, in.x.scalar_type(), "ddpkit_syncbn_cuda_packed_stats", [&] {
    using acc_t = at::acc_type<scalar_t, /*is_cuda=*/true>;
    const scalar_t* xp = in.count() == 0 ? nullptr : in.x.const_data_ptr<scalar_t>();
    packed_stats_kernel<scalar_t, acc_t>
        <<<ceil_div(channels, kThreads), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
            p.const_data_ptr<double>(), channels, count, eps, xp, shape.channels_inner ? int64_t{1} : shape.inner,
            t.out<acc_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  t.finish();
  return t.stats;
}

at::Tensor normalize(const LocalInput& in, const at::Tensor& mean, const at::Tensor& invstd, const at::Tensor& weight,
                     const at::Tensor& bias) {
  const c10::cuda::CUDAGuard device_guard(in.x.device());
  PassTensors tensors{mean.contiguous(), invstd.contiguous(), contiguous_or_undefined(weight),
                      contiguous_or_undefined(bias)};
  return affine_pass<Pass::kNormalize>(in, at::Tensor(), tensors);
}

Normalized normalize_local(const LocalInput& in, double eps, const RunningStats& running, const at::Tensor& weight,
                           const at::Tensor& bias) {
  const c10::cuda::CUDAGuard device_guard(in.x.device());
  const double count = static_cast<double>(in.count());
  const bool running_in_place =
      !running.applies(count) || (running.mean.is_contiguous() && running.var.is_contiguous());
  if (!one_block_per_channel(in) || !running_in_place) {
    BatchStats stats = cuda::local_batch_stats(in, eps, running);
    at::Tensor output = cuda::normalize(in, stats.mean, stats.invstd, weight, bias);
    return Normalized{std::move(output), std::move(stats)};
  }
  // Note [One block per channel]
  const StatsTarget t = stats_target(in, count, running);
  const at::Tensor w = contiguous_or_undefined(weight), b = contiguous_or_undefined(bias);
  at::Tensor y = at::empty_like(in.x);
  const cpu::Shape& shape = in.shape;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, in.x.scalar_type(), "ddpkit_syncbn_cuda_fused_fw", [&] {
    using acc_t = at::acc_type<scalar_t, /*is_cuda=*/true>;
    const scalar_t* xp = in.x.const_data_ptr<scalar_t>();
    scalar_t* yp = y.mutable_data_ptr<scalar_t>();
    auto launch = [&]<int V>() {
      fused_forward_planar_kernel<scalar_t, acc_t, V>
          <<<in.channels(), kFusedThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
              xp, yp, shape.outer, shape.channels, shape.inner, eps, t.out<acc_t>(), param(w), param(b));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    if (vector_width<scalar_t>(shape.inner, {xp, yp}) > 1) {
      launch.template operator()<static_cast<int>(16 / sizeof(scalar_t))>();
    } else {
      launch.template operator()<1>();
    }
  });
  return Normalized{std::move(y), t.stats};
}

LocalGradSums local_grad_sums(const LocalInput& in, const at::Tensor& dy, const at::Tensor& mean,
                              const at::Tensor& invstd, at::ScalarType dtype, bool want_weight, bool want_bias) {
  const at::Tensor& x = in.x;
  const c10::cuda::CUDAGuard device_guard(x.device());
  const int64_t channels = in.channels();
  const auto arithmetic = x.options().dtype(x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat);
  LocalGradSums result{at::empty({2 * channels}, arithmetic), at::Tensor(), at::Tensor()};
  if (want_weight) result.grad_weight = at::empty({channels}, x.options().dtype(dtype));
  if (want_bias) result.grad_bias = at::empty({channels}, x.options().dtype(dtype));
  const at::Tensor m = mean.contiguous(), s = invstd.contiguous();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const cpu::Shape& shape = in.shape;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "ddpkit_syncbn_cuda_grad_sums", [&] {
    using acc_t = at::acc_type<scalar_t, /*is_cuda=*/true>;
    const acc_t* mp = m.const_data_ptr<acc_t>();
    const FinishSums<scalar_t, acc_t> finish{channels,
                                             mp,
                                             s.const_data_ptr<acc_t>(),
                                             in.count() == 0 ? nullptr : x.const_data_ptr<scalar_t>(),
                                             shape.channels_inner ? int64_t{1} : shape.inner,
                                             result.sums.mutable_data_ptr<acc_t>(),
                                             mutable_param(result.grad_weight),
                                             mutable_param(result.grad_bias)};
    // Launches the reduction with `sink` on a grid of `splits` splits per channel (Note [Reduction sinks]).
    auto reduce = [&](int64_t splits, auto sink) {
      const scalar_t* xp = x.const_data_ptr<scalar_t>();
      const scalar_t* dyp = dy.const_data_ptr<scalar_t>();
      if (shape.channels_inner) {
        const dim3 block = rows_block(channels);
        grad_sums_rows_kernel<scalar_t, acc_t>
            <<<dim3(ceil_div(channels, block.x), splits), block, 0, stream>>>(xp, dyp, mp, shape.outer, channels, sink);
      } else if (in.count() < (int64_t{1} << 31)) {
        grad_sums_planar_kernel<scalar_t, acc_t, uint32_t>
            <<<dim3(channels, splits), kThreads, 0, stream>>>(xp, dyp, mp, shape.outer, channels, shape.inner, sink);
      } else {
        grad_sums_planar_kernel<scalar_t, acc_t, uint64_t>
            <<<dim3(channels, splits), kThreads, 0, stream>>>(xp, dyp, mp, shape.outer, channels, shape.inner, sink);
      }
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    const int64_t splits = in.count() == 0 ? 0 : splits_per_channel(shape, channels, in.count());
    if (splits == 1) {
      reduce(1, finish);
      return;
    }
    const at::Tensor partial = workspace(x, splits * channels * static_cast<int64_t>(sizeof(GradSums<acc_t>)));
    auto* p = reinterpret_cast<GradSums<acc_t>*>(partial.mutable_data_ptr());
    if (splits > 0) reduce(splits, StoreSums<acc_t>{p, channels});
    grad_sums_finish_kernel<scalar_t, acc_t><<<ceil_div(channels, kThreads), kThreads, 0, stream>>>(p, splits, finish);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return result;
}

at::Tensor grad_input_training(const LocalInput& in, const at::Tensor& dy, const at::Tensor& mean,
                               const at::Tensor& invstd, const at::Tensor& weight, const at::Tensor& sums,
                               double count) {
  const c10::cuda::CUDAGuard device_guard(in.x.device());
  PassTensors tensors{mean.contiguous(), invstd.contiguous(), contiguous_or_undefined(weight),
                      at::Tensor(),      sums.contiguous(),   count > 0 ? 1.0 / count : 0.0};
  return affine_pass<Pass::kGradTraining>(in, dy, tensors);
}

at::Tensor grad_input_eval(const LocalInput& in, const at::Tensor& dy, const at::Tensor& invstd,
                           const at::Tensor& weight) {
  const c10::cuda::CUDAGuard device_guard(in.x.device());
  PassTensors tensors{at::Tensor(), invstd.contiguous(), contiguous_or_undefined(weight)};
  return affine_pass<Pass::kGradEval>(in, dy, tensors);
}

std::array<at::Tensor, 3> backward_local(const LocalInput& in, const at::Tensor& dy, const at::Tensor& mean,
                                         const at::Tensor& invstd, const at::Tensor& weight, at::ScalarType dtype,
                                         std::array<bool, 3> output_mask) {
  const c10::cuda::CUDAGuard device_guard(in.x.device());
  const auto [want_input, want_weight, want_bias] = output_mask;
  if (!one_block_per_channel(in)) {
    LocalGradSums local = cuda::local_grad_sums(in, dy, mean, invstd, dtype, want_weight, want_bias);
    at::Tensor grad_input;
    if (want_input) {
      grad_input = cuda::grad_input_training(in, dy, mean, invstd, weight, local.sums, static_cast<double>(in.count()));
    }
    return {grad_input, local.grad_weight, local.grad_bias};
  }
  // Note [One block per channel]
  const int64_t channels = in.channels();
  at::Tensor grad_input, grad_weight, grad_bias;
  if (want_input) grad_input = at::empty_like(in.x);
  if (want_weight) grad_weight = at::empty({channels}, in.x.options().dtype(dtype));
  if (want_bias) grad_bias = at::empty({channels}, in.x.options().dtype(dtype));
  const at::Tensor m = mean.contiguous(), s = invstd.contiguous(), w = contiguous_or_undefined(weight);
  const cpu::Shape& shape = in.shape;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, in.x.scalar_type(), "ddpkit_syncbn_cuda_fused_bw", [&] {
    using acc_t = at::acc_type<scalar_t, /*is_cuda=*/true>;
    const scalar_t* xp = in.x.const_data_ptr<scalar_t>();
    const scalar_t* dyp = dy.const_data_ptr<scalar_t>();
    scalar_t* dxp = want_input ? grad_input.mutable_data_ptr<scalar_t>() : nullptr;
    auto launch = [&]<int V>() {
      fused_backward_planar_kernel<scalar_t, acc_t, V>
          <<<channels, kFusedThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
              xp, dyp, dxp, shape.outer, shape.channels, shape.inner, m.const_data_ptr<acc_t>(),
              s.const_data_ptr<acc_t>(), param(w), mutable_param(grad_weight), mutable_param(grad_bias));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    if (vector_width<scalar_t>(shape.inner, {xp, dyp, dxp}) > 1) {
      launch.template operator()<static_cast<int>(16 / sizeof(scalar_t))>();
    } else {
      launch.template operator()<1>();
    }
  });
  return {grad_input, grad_weight, grad_bias};
}

}  // namespace

const ElementKernels& element_kernels() {
  static const ElementKernels table{c10::kCUDA,       &local_batch_stats, &packed_moments,      &stats_from_packed,
                                    &normalize,       &local_grad_sums,   &grad_input_training, &grad_input_eval,
                                    &normalize_local, &backward_local};
  return table;
}

}  // namespace ddpkit::syncbn::cuda
