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

// Blocks of kThreads that fill every multiprocessor of the current device once (queried once per
// device; plain runtime calls, so that this file needs no ATen/cuda header, hence no cuBLAS or
// cuSPARSE header).
int64_t resident_blocks() {
  static std::array<std::atomic<int64_t>, C10_COMPILE_TIME_MAX_GPUS> cache{};
  const c10::DeviceIndex device = c10::cuda::current_device();
  int64_t blocks = cache[device].load(std::memory_order_relaxed);
  if (blocks == 0) {
    int multiprocessors = 0, threads = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, device));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&threads, cudaDevAttrMaxThreadsPerMultiProcessor, device));
    blocks = static_cast<int64_t>(multiprocessors) * std::max(1, threads / kThreads);
    cache[device].store(blocks, std::memory_order_relaxed);
  }
  return blocks;
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

// Runs the element-wise pass `pass` over in's layout: out = k·dy + q·(x - center) + r.
template <Pass pass>
at::Tensor affine_pass(const LocalInput& in, const at::Tensor& dy, const PassArgs& args) {
  const at::Tensor& x = in.x;
  at::Tensor out = at::empty_like(x);
  if (out.numel() == 0) return out;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const cpu::Shape& shape = in.shape;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "ddpkit_syncbn_cuda_affine", [&] {
    using acc_t = at::acc_type<scalar_t, /*is_cuda=*/true>;
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

// Where stats of `count` values per channel go, with the running update of RunningStats' rule. The
// kernels write contiguous running estimates in place; others are left to update_running_stats.
struct StatsTarget {
  BatchStats stats;
  StatsOut out;
  bool update_afterwards = false;
};

StatsTarget stats_target(const at::Tensor& like, int64_t channels, double count, const RunningStats& running) {
  const auto doubles = like.options().dtype(at::kDouble);
  StatsTarget t;
  t.stats = BatchStats{at::empty({channels}, doubles), at::Tensor(), at::empty({channels}, doubles), count};
  t.out = StatsOut{t.stats.mean.mutable_data_ptr<double>(),   nullptr,
                   t.stats.invstd.mutable_data_ptr<double>(), MutableParam{nullptr, ParamType::kNone},
                   MutableParam{nullptr, ParamType::kNone},   running.momentum,
                   count > 1 ? count / (count - 1) : 0.0};
  if (running.applies(count)) {
    if (running.mean.is_contiguous() && running.var.is_contiguous()) {
      t.out.running_mean = mutable_param(running.mean);
      t.out.running_var = mutable_param(running.var);
    } else {
      // update_running_stats needs the batch variance; no caller reads it otherwise, so the
      // kernels skip it and save a [C] float64 allocation per forward.
      t.update_afterwards = true;
      t.stats.var = at::empty({channels}, doubles);
      t.out.var = t.stats.var.mutable_data_ptr<double>();
    }
  }
  return t;
}

// The passes of syncbn/kernels.h, each with the contract of the pass of the same name there.

BatchStats local_batch_stats(const LocalInput& in, double eps, const RunningStats& running) {
  const c10::cuda::CUDAGuard device_guard(in.x.device());
  const int64_t channels = in.channels();
  const double count = static_cast<double>(in.count());
  StatsTarget t = stats_target(in.x, channels, count, running);
  run_moments(in, LocalStats{count > 0 ? 1.0 / count : 0.0, eps, t.out});
  if (t.update_afterwards) update_running_stats(running, t.stats);
  return t.stats;
}

at::Tensor packed_moments(const LocalInput& in) {
  const c10::cuda::CUDAGuard device_guard(in.x.device());
  const int64_t channels = in.channels();
  at::Tensor packed = at::empty({2 * channels + 1}, in.x.options().dtype(at::kDouble));
  run_moments(in, PackedMoments{channels, static_cast<double>(in.count()), packed.mutable_data_ptr<double>()});
  return packed;
}

BatchStats stats_from_packed(const at::Tensor& packed, double eps, const RunningStats& running) {
  const c10::cuda::CUDAGuard device_guard(packed.device());
  const int64_t channels = (packed.numel() - 1) / 2;
  const at::Tensor p = packed.contiguous();
  // The host needs the group's count (the op returns it and raises on a single value); reading it
  // waits for the all-reduce that produced `packed`.
  const double count = p[2 * channels].item<double>();
  StatsTarget t = stats_target(p, channels, count, running);
  packed_stats_kernel<<<ceil_div(channels, kThreads), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      p.const_data_ptr<double>(), channels, count, eps, t.out);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (t.update_afterwards) update_running_stats(running, t.stats);
  return t.stats;
}

at::Tensor normalize(const LocalInput& in, const at::Tensor& mean, const at::Tensor& invstd, const at::Tensor& weight,
                     const at::Tensor& bias) {
  const c10::cuda::CUDAGuard device_guard(in.x.device());
  const at::Tensor m = mean.contiguous(), s = invstd.contiguous();
  const at::Tensor w = contiguous_or_undefined(weight), b = contiguous_or_undefined(bias);
  const PassArgs args{m.const_data_ptr<double>(), s.const_data_ptr<double>(), param(w), param(b), nullptr, 0.0};
  return affine_pass<Pass::kNormalize>(in, at::Tensor(), args);
}

LocalGradSums local_grad_sums(const LocalInput& in, const at::Tensor& dy, const at::Tensor& mean,
                              const at::Tensor& invstd, at::ScalarType dtype, bool want_weight, bool want_bias) {
  const at::Tensor& x = in.x;
  const c10::cuda::CUDAGuard device_guard(x.device());
  const int64_t channels = in.channels();
  LocalGradSums result{at::empty({2 * channels}, x.options().dtype(at::kDouble)), at::Tensor(), at::Tensor()};
  if (want_weight) result.grad_weight = at::empty({channels}, x.options().dtype(dtype));
  if (want_bias) result.grad_bias = at::empty({channels}, x.options().dtype(dtype));
  const at::Tensor m = mean.contiguous(), s = invstd.contiguous();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const cpu::Shape& shape = in.shape;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "ddpkit_syncbn_cuda_grad_sums", [&] {
    using acc_t = at::acc_type<scalar_t, /*is_cuda=*/true>;
    const double* mp = m.const_data_ptr<double>();
    const FinishSums<acc_t> finish{channels,
                                   mp,
                                   s.const_data_ptr<double>(),
                                   result.sums.mutable_data_ptr<double>(),
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
    grad_sums_finish_kernel<acc_t><<<ceil_div(channels, kThreads), kThreads, 0, stream>>>(p, splits, finish);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return result;
}

at::Tensor grad_input_training(const LocalInput& in, const at::Tensor& dy, const at::Tensor& mean,
                               const at::Tensor& invstd, const at::Tensor& weight, const at::Tensor& sums,
                               double count) {
  const c10::cuda::CUDAGuard device_guard(in.x.device());
  const at::Tensor m = mean.contiguous(), s = invstd.contiguous(), g = sums.contiguous();
  const at::Tensor w = contiguous_or_undefined(weight);
  const PassArgs args{m.const_data_ptr<double>(),       s.const_data_ptr<double>(), param(w),
                      Param{nullptr, ParamType::kNone}, g.const_data_ptr<double>(), count > 0 ? 1.0 / count : 0.0};
  return affine_pass<Pass::kGradTraining>(in, dy, args);
}

at::Tensor grad_input_eval(const LocalInput& in, const at::Tensor& dy, const at::Tensor& invstd,
                           const at::Tensor& weight) {
  const c10::cuda::CUDAGuard device_guard(in.x.device());
  const at::Tensor s = invstd.contiguous();
  const at::Tensor w = contiguous_or_undefined(weight);
  const PassArgs args{nullptr, s.const_data_ptr<double>(), param(w), Param{nullptr, ParamType::kNone}, nullptr, 0.0};
  return affine_pass<Pass::kGradEval>(in, dy, args);
}

}  // namespace

const ElementKernels& element_kernels() {
  static const ElementKernels table{c10::kCUDA, &local_batch_stats, &packed_moments,      &stats_from_packed,
                                    &normalize, &local_grad_sums,   &grad_input_training, &grad_input_eval};
  return table;
}

}  // namespace ddpkit::syncbn::cuda
