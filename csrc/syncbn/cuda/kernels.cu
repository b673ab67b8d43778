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
      affine_rows_kernel<pass, scalar_t, acc_t><<<dim3(grid_x, grid_y), block, 0, stream>>>(
          xp, dyp, op, shape.outer, shape.channels, args);
    } else {
      const int lanes_log2 = std::min(ceil_log2(shape.inner), ceil_log2(kThreads));
      const int64_t planes = shape.outer * shape.channels;
      const int64_t grid_x = ceil_div(planes, kThreads >> lanes_log2);
      affine_planar_kernel<pass, scalar_t, acc_t><<<grid_x, kThreads, 0, stream>>>(
          xp, dyp, op, planes, shape.channels, shape.inner, lanes_log2, args);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

}  // namespace

LocalMoments local_moments(const LocalInput& in) {
  const at::Tensor& x = in.x;
  const c10::cuda::CUDAGuard device_guard(x.device());
  const int64_t channels = in.channels(), count = in.count();
  const auto doubles = x.options().dtype(at::kDouble);
  if (count == 0) return {at::zeros({channels}, doubles), at::zeros({channels}, doubles)};
  LocalMoments out{at::empty({channels}, doubles), at::empty({channels}, doubles)};
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const cpu::Shape& shape = in.shape;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "ddpkit_syncbn_cuda_moments", [&] {
    using acc_t = at::acc_type<scalar_t, /*is_cuda=*/true>;
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    int64_t splits = 1;
    at::Tensor partial;
    if (shape.channels_inner) {
      const dim3 block = rows_block(channels);
      const int64_t grid_x = ceil_div(channels, block.x);
      splits = reduction_splits(grid_x, block.y, shape.outer);
      partial = workspace(x, splits * channels * static_cast<int64_t>(sizeof(Welford<acc_t>)));
      moments_rows_kernel<scalar_t, acc_t><<<dim3(grid_x, splits), block, 0, stream>>>(
          xp, shape.outer, channels, reinterpret_cast<Welford<acc_t>*>(partial.mutable_data_ptr()));
    } else {
      splits = reduction_splits(channels, kThreads, count);
      partial = workspace(x, splits * channels * static_cast<int64_t>(sizeof(Welford<acc_t>)));
      auto* p = reinterpret_cast<Welford<acc_t>*>(partial.mutable_data_ptr());
      const dim3 grid(channels, splits);
      if (count < (int64_t{1} << 31)) {
        moments_planar_kernel<scalar_t, acc_t, uint32_t><<<grid, kThreads, 0, stream>>>(
            xp, shape.outer, channels, shape.inner, p);
      } else {
        moments_planar_kernel<scalar_t, acc_t, uint64_t><<<grid, kThreads, 0, stream>>>(
            xp, shape.outer, channels, shape.inner, p);
      }
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    moments_finish_kernel<scalar_t, acc_t><<<ceil_div(channels, kThreads), kThreads, 0, stream>>>(
        reinterpret_cast<const Welford<acc_t>*>(partial.const_data_ptr()), splits, channels, xp,
        shape.channels_inner ? 1 : shape.inner, out.mean.mutable_data_ptr<double>(), out.m2.mutable_data_ptr<double>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

at::Tensor normalize(const LocalInput& in, const at::Tensor& mean, const at::Tensor& invstd, const at::Tensor& weight,
                     const at::Tensor& bias) {
  const c10::cuda::CUDAGuard device_guard(in.x.device());
  const at::Tensor m = mean.contiguous(), s = invstd.contiguous();
  const at::Tensor w = contiguous_or_undefined(weight), b = contiguous_or_undefined(bias);
  const PassArgs args{m.const_data_ptr<double>(), s.const_data_ptr<double>(), param(w), param(b), nullptr, 0.0};
  return affine_pass<Pass::kNormalize>(in, at::Tensor(), args);
}

at::Tensor grad_sums(const LocalInput& in, const at::Tensor& dy, const at::Tensor& mean) {
  const at::Tensor& x = in.x;
  const c10::cuda::CUDAGuard device_guard(x.device());
  const int64_t channels = in.channels(), count = in.count();
  const auto doubles = x.options().dtype(at::kDouble);
  if (count == 0) return at::zeros({2 * channels}, doubles);
  at::Tensor sums = at::empty({2 * channels}, doubles);
  const at::Tensor m = mean.contiguous();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const cpu::Shape& shape = in.shape;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "ddpkit_syncbn_cuda_grad_sums", [&] {
    using acc_t = at::acc_type<scalar_t, /*is_cuda=*/true>;
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    const scalar_t* dyp = dy.const_data_ptr<scalar_t>();
    const double* mp = m.const_data_ptr<double>();
    int64_t splits = 1;
    at::Tensor partial;
    if (shape.channels_inner) {
      const dim3 block = rows_block(channels);
      const int64_t grid_x = ceil_div(channels, block.x);
      splits = reduction_splits(grid_x, block.y, shape.outer);
      partial = workspace(x, splits * channels * static_cast<int64_t>(sizeof(GradSums<acc_t>)));
      grad_sums_rows_kernel<scalar_t, acc_t><<<dim3(grid_x, splits), block, 0, stream>>>(
          xp, dyp, mp, shape.outer, channels, reinterpret_cast<GradSums<acc_t>*>(partial.mutable_data_ptr()));
    } else {
      splits = reduction_splits(channels, kThreads, count);
      partial = workspace(x, splits * channels * static_cast<int64_t>(sizeof(GradSums<acc_t>)));
      auto* p = reinterpret_cast<GradSums<acc_t>*>(partial.mutable_data_ptr());
      const dim3 grid(channels, splits);
      if (count < (int64_t{1} << 31)) {
        grad_sums_planar_kernel<scalar_t, acc_t, uint32_t><<<grid, kThreads, 0, stream>>>(
            xp, dyp, mp, shape.outer, channels, shape.inner, p);
      } else {
        grad_sums_planar_kernel<scalar_t, acc_t, uint64_t><<<grid, kThreads, 0, stream>>>(
            xp, dyp, mp, shape.outer, channels, shape.inner, p);
      }
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    grad_sums_finish_kernel<acc_t><<<ceil_div(channels, kThreads), kThreads, 0, stream>>>(
        reinterpret_cast<const GradSums<acc_t>*>(partial.const_data_ptr()), splits, channels, mp,
        sums.mutable_data_ptr<double>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return sums;
}

at::Tensor grad_input_training(const LocalInput& in, const at::Tensor& dy, const at::Tensor& mean,
                               const at::Tensor& invstd, const at::Tensor& weight, const at::Tensor& sums,
                               double count) {
  const c10::cuda::CUDAGuard device_guard(in.x.device());
  const at::Tensor m = mean.contiguous(), s = invstd.contiguous(), g = sums.contiguous();
  const at::Tensor w = contiguous_or_undefined(weight);
  const PassArgs args{m.const_data_ptr<double>(), s.const_data_ptr<double>(), param(w), Param{nullptr, ParamType::kNone},
                      g.const_data_ptr<double>(), count > 0 ? 1.0 / count : 0.0};
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

const ElementKernels& element_kernels() {
  static const ElementKernels table{c10::kCUDA, &local_moments, &normalize, &grad_sums, &grad_input_training,
                                    &grad_input_eval};
  return table;
}

}  // namespace ddpkit::syncbn::cuda
