#pragma once
// SyncBatchNorm's element passes on CUDA, as device code only: raw pointers in, per-channel
// partial results out. No ATen, no allocation, no error checking, no communication: the launchers
// in syncbn/cuda/kernels.cu validate nothing either (syncbn/syncbn.cpp has), pick grid sizes, own
// the workspaces and launch on torch's current stream.
//
// Element dtypes: float, double, c10::Half, c10::BFloat16 (any type with static_cast to and from
// acc_t on the device). acc_t, the arithmetic type, is double for double elements and float
// otherwise; per-channel results are merged in double at the end and stored as the contracts in
// syncbn/kernels.h ask: the saved statistics and the backward's sums in acc_t (Note [Saved
// statistics]), the forward's all-reduce buffer in double.
//
// Layouts: the two of Note [CPU layouts] (syncbn/cpu/kernels.h), nothing else:
//  - planar: `outer` = N groups of `channels` planes of `inner` contiguous elements;
//  - channels-inner: `outer` rows of `channels` contiguous elements (2-D and channels_last inputs).

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cuda_runtime.h>

#include <cstdint>

namespace ddpkit::syncbn::cuda {

constexpr int kThreads = 256;  // every kernel runs blocks of 256 threads
constexpr int kWarp = 32;

// Note [CUDA moments]
// Per-channel mean and centred sum of squares, accurate for inputs whose mean is large against
// their spread (Note [Stable moments] in syncbn/cpu/kernels.h; 1e4 + N(0,1) in float32):
//  1. every value is shifted by its channel's first value K (x - K is exact for values near K,
//     Sterbenz), so the float32 accumulators only ever hold numbers of the size of the spread;
//  2. each thread runs Welford's update in acc_t over its values;
//  3. a block merges its threads with Chan's formula (warp shuffles, then shared memory) and
//     writes one partial (n, mean, M2) per channel and split of the channel's values;
//  4. a finishing kernel merges a channel's partials in double and adds K back in double.
// The mean therefore keeps float64 precision on top of the shifted float32 sums, and M2 is the
// centred sum the contract asks for (never Σx² - N·mean²).
template <typename acc_t>
struct Welford {
  acc_t n;
  acc_t mean;
  acc_t m2;
};

template <typename acc_t>
__device__ __forceinline__ void welford_add(Welford<acc_t>& w, acc_t x) {
  w.n += acc_t(1);
  const acc_t delta = x - w.mean;
  w.mean += delta / w.n;
  w.m2 += delta * (x - w.mean);
}

template <typename T>
__device__ __forceinline__ Welford<T> welford_merge(const Welford<T>& a, const Welford<T>& b) {
  if (b.n == T(0)) return a;
  if (a.n == T(0)) return b;
  const T n = a.n + b.n;
  const T delta = b.mean - a.mean;
  const T b_share = b.n / n;
  return Welford<T>{n, a.mean + delta * b_share, a.m2 + b.m2 + delta * delta * a.n * b_share};
}

template <typename acc_t>
__device__ __forceinline__ Welford<acc_t> welford_shfl_down(const Welford<acc_t>& w, int offset) {
  return Welford<acc_t>{__shfl_down_sync(0xffffffffu, w.n, offset), __shfl_down_sync(0xffffffffu, w.mean, offset),
                        __shfl_down_sync(0xffffffffu, w.m2, offset)};
}

// Adds V values d to w: their own mean and centred sum of squares, then Chan's merge, so that a
// vector of values costs one division instead of V (V a power of two: the mean's 1/V is exact).
template <int V, typename acc_t>
__device__ __forceinline__ void welford_add_values(Welford<acc_t>& w, const acc_t (&d)[V]) {
  if constexpr (V == 1) {
    welford_add(w, d[0]);
  } else {
    acc_t sum = acc_t(0);
#pragma unroll
    for (int j = 0; j < V; ++j) sum += d[j];
    const acc_t mean = sum * (acc_t(1) / acc_t(V));
    acc_t m2 = acc_t(0);
#pragma unroll
    for (int j = 0; j < V; ++j) m2 += (d[j] - mean) * (d[j] - mean);
    w = welford_merge(w, Welford<acc_t>{acc_t(V), mean, m2});
  }
}

// Sums of the backward reduction: Σ dy and Σ dy·(x - center) of one thread, block or split.
template <typename acc_t>
struct GradSums {
  acc_t dy;
  acc_t dy_xc;
};

template <typename T>
__device__ __forceinline__ GradSums<T> sums_merge(const GradSums<T>& a, const GradSums<T>& b) {
  return GradSums<T>{a.dy + b.dy, a.dy_xc + b.dy_xc};
}

template <typename acc_t>
__device__ __forceinline__ GradSums<acc_t> sums_shfl_down(const GradSums<acc_t>& s, int offset) {
  return GradSums<acc_t>{__shfl_down_sync(0xffffffffu, s.dy, offset), __shfl_down_sync(0xffffffffu, s.dy_xc, offset)};
}

struct WelfordOps {
  template <typename acc_t>
  __device__ static Welford<acc_t> merge(const Welford<acc_t>& a, const Welford<acc_t>& b) {
    return welford_merge(a, b);
  }
  template <typename acc_t>
  __device__ static Welford<acc_t> shfl_down(const Welford<acc_t>& w, int offset) {
    return welford_shfl_down(w, offset);
  }
};

struct SumsOps {
  template <typename acc_t>
  __device__ static GradSums<acc_t> merge(const GradSums<acc_t>& a, const GradSums<acc_t>& b) {
    return sums_merge(a, b);
  }
  template <typename acc_t>
  __device__ static GradSums<acc_t> shfl_down(const GradSums<acc_t>& s, int offset) {
    return sums_shfl_down(s, offset);
  }
};

// Merges the values of all kBlock threads of a 1-D block (kBlock a multiple of kWarp, at most
// kWarp²); the result is valid in thread 0.
template <typename Ops, typename V, int kBlock = kThreads>
__device__ __forceinline__ V block_merge_1d(V v) {
  static_assert(kBlock % kWarp == 0 && kBlock <= kWarp * kWarp);
  __shared__ V warps[kBlock / kWarp];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset /= 2) v = Ops::merge(v, Ops::shfl_down(v, offset));
  if (lane == 0) warps[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = warps[lane < kBlock / kWarp ? lane : 0];
    if (lane >= kBlock / kWarp) v = V{};
#pragma unroll
    for (int offset = kWarp / 2; offset > 0; offset /= 2) v = Ops::merge(v, Ops::shfl_down(v, offset));
  }
  return v;
}

// Merges the values of a 2-D block over threadIdx.y (blockDim.y a power of two); the result for
// column threadIdx.x is valid in the threads of row 0.
template <typename Ops, typename V>
__device__ __forceinline__ V block_merge_rows(V v) {
  __shared__ V cells[kThreads];
  const int tx = threadIdx.x, ty = threadIdx.y, bx = blockDim.x;
  cells[ty * bx + tx] = v;
  __syncthreads();
  for (int stride = blockDim.y / 2; stride > 0; stride /= 2) {
    if (ty < stride) cells[ty * bx + tx] = Ops::merge(cells[ty * bx + tx], cells[(ty + stride) * bx + tx]);
    __syncthreads();
  }
  return cells[tx];
}

// --- per-channel tensors in the parameter dtype -------------------------------------------------

// A [C] tensor of dtype float, double, half or bfloat16: weight and bias (read), running estimates
// (read and written) and the weight and bias gradients (written). kNone: the tensor is absent;
// loads give `fill`, stores do nothing.
enum class ParamType : int { kNone = 0, kFloat = 1, kDouble = 2, kHalf = 3, kBFloat16 = 4 };

struct Param {
  const void* data;
  ParamType type;
};

struct MutableParam {
  void* data;
  ParamType type;
};

__device__ __forceinline__ double load_param(const void* data, ParamType type, int64_t c, double fill) {
  switch (type) {
    case ParamType::kFloat: return static_cast<double>(static_cast<const float*>(data)[c]);
    case ParamType::kDouble: return static_cast<const double*>(data)[c];
    case ParamType::kHalf: return static_cast<double>(static_cast<float>(static_cast<const c10::Half*>(data)[c]));
    case ParamType::kBFloat16:
      return static_cast<double>(static_cast<float>(static_cast<const c10::BFloat16*>(data)[c]));
    case ParamType::kNone: break;
  }
  return fill;
}

__device__ __forceinline__ double load_param(const Param& p, int64_t c, double fill) {
  return load_param(p.data, p.type, c, fill);
}

// Rounds v to the tensor's dtype as the CPU code does (static_cast from double).
__device__ __forceinline__ void store_param(const MutableParam& p, int64_t c, double v) {
  switch (p.type) {
    case ParamType::kFloat: static_cast<float*>(p.data)[c] = static_cast<float>(v); break;
    case ParamType::kDouble: static_cast<double*>(p.data)[c] = v; break;
    case ParamType::kHalf: static_cast<c10::Half*>(p.data)[c] = static_cast<c10::Half>(v); break;
    case ParamType::kBFloat16: static_cast<c10::BFloat16*>(p.data)[c] = static_cast<c10::BFloat16>(v); break;
    case ParamType::kNone: break;
  }
}

// --- statistics (forward) ---------------------------------------------------------------------

// Note [Reduction sinks]
// A reduction kernel ends with one merged value per channel and split of the channel's values, and
// hands it to its sink. With several splits the sink stores it as a partial, and a finishing kernel
// merges a channel's partials; with a single split (reduction_splits in kernels.cu gives one to a
// batch of fewer than 16 block rows: 128 rows of 32 or more channels) the merged value is already
// the channel's whole, and the sink finishes it in the
// same kernel: one launch and no workspace less per pass. For a single split the finishing kernel
// would do the same float64 math on the same value (merging with an empty Welford, or adding to
// 0.0, is exact), so fusing changes no bit. tests/test_cuda.py runs both routes against float64
// BatchNorm (test_both_reduction_routes_match_float64_batch_norm) and checks which one a shape takes.

// Stores a moments kernel's merged value as the partial of (split, c).
template <typename acc_t>
struct StoreMoments {
  Welford<acc_t>* partial;
  int64_t channels;
  __device__ __forceinline__ void operator()(int64_t c, int64_t split, const Welford<acc_t>& w, acc_t) const {
    partial[split * channels + c] = w;
  }
};

// Finishes channel c from its only partial: `finish(c, moments, K)`, the moments still shifted by K.
template <typename Finish>
struct FinishMoments {
  Finish finish;
  template <typename acc_t>
  __device__ __forceinline__ void operator()(int64_t c, int64_t, const Welford<acc_t>& w, acc_t shift) const {
    finish(c, Welford<double>{static_cast<double>(w.n), static_cast<double>(w.mean), static_cast<double>(w.m2)},
           static_cast<double>(shift));
  }
};

// Planar: block (channel c = blockIdx.x, split = blockIdx.y) runs over the channel's values t =
// n·inner + s for t ≡ split·kThreads + threadIdx.x (mod gridDim.y·kThreads). index_t: uint32_t when
// a channel has fewer than 2^32 values (a cheaper division), else uint64_t.
template <typename scalar_t, typename acc_t, typename index_t, typename Sink>
__global__ void __launch_bounds__(kThreads)
    moments_planar_kernel(const scalar_t* __restrict__ x, index_t n_outer, index_t channels, index_t inner, Sink sink) {
  const index_t c = blockIdx.x;
  const index_t count = n_outer * inner;
  const acc_t shift = static_cast<acc_t>(x[static_cast<int64_t>(c) * inner]);
  Welford<acc_t> w{acc_t(0), acc_t(0), acc_t(0)};
  const index_t stride = static_cast<index_t>(gridDim.y) * kThreads;
  for (index_t t = static_cast<index_t>(blockIdx.y) * kThreads + threadIdx.x; t < count; t += stride) {
    const index_t n = t / inner;
    const index_t s = t - n * inner;
    const int64_t offset = (static_cast<int64_t>(n) * channels + c) * static_cast<int64_t>(inner) + s;
    welford_add(w, static_cast<acc_t>(x[offset]) - shift);
  }
  w = block_merge_1d<WelfordOps>(w);
  if (threadIdx.x == 0) sink(c, blockIdx.y, w, shift);
}

// Channels-inner: block (blockDim.x channels from blockIdx.x·blockDim.x, blockDim.y rows at a time)
// runs over rows r ≡ blockIdx.y·blockDim.y + threadIdx.y (mod gridDim.y·blockDim.y); a warp reads
// whole runs of consecutive channels of a row.
template <typename scalar_t, typename acc_t, typename Sink>
__global__ void __launch_bounds__(kThreads)
    moments_rows_kernel(const scalar_t* __restrict__ x, int64_t rows, int64_t channels, Sink sink) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const bool valid = c < channels;
  const acc_t shift = valid ? static_cast<acc_t>(x[c]) : acc_t(0);
  Welford<acc_t> w{acc_t(0), acc_t(0), acc_t(0)};
  if (valid) {
    const int64_t stride = static_cast<int64_t>(gridDim.y) * blockDim.y;
    for (int64_t r = static_cast<int64_t>(blockIdx.y) * blockDim.y + threadIdx.y; r < rows; r += stride) {
      welford_add(w, static_cast<acc_t>(x[r * channels + c]) - shift);
    }
  }
  w = block_merge_rows<WelfordOps>(w);
  if (threadIdx.y == 0 && valid) sink(c, blockIdx.y, w, shift);
}

// Where a forward's statistics go: the saved statistics mean - K and invstd (acc_t [C]), the
// unshifted mean and biased var in double (null: not wanted; update_running_stats reads them for
// running estimates the kernels cannot update in place), and the running estimates to update
// (kNone: none), with the factors of the update.
template <typename acc_t>
struct StatsOut {
  acc_t* mean;
  acc_t* invstd;
  double* unshifted_mean;
  double* var;
  MutableParam running_mean;
  MutableParam running_var;
  double momentum;
  double unbias;  // N/(N - 1)
};

// The per-channel end of a forward's statistics, as the CPU code computes it, from the channel's
// shift K and its mean - K and biased var in double.
template <typename acc_t>
__device__ __forceinline__ void store_stats(const StatsOut<acc_t>& out, int64_t c, double shift, double shifted_mean,
                                            double var, double eps) {
  const double mean = shift + shifted_mean;
  out.mean[c] = static_cast<acc_t>(shifted_mean);
  out.invstd[c] = static_cast<acc_t>(1.0 / sqrt(var + eps));
  if (out.unshifted_mean != nullptr) out.unshifted_mean[c] = mean;
  if (out.var != nullptr) out.var[c] = var;
  if (out.running_mean.type != ParamType::kNone) {
    const double m = out.momentum;
    store_param(out.running_mean, c,
                (1 - m) * load_param(out.running_mean.data, out.running_mean.type, c, 0.0) + m * mean);
    store_param(out.running_var, c,
                (1 - m) * load_param(out.running_var.data, out.running_var.type, c, 0.0) + m * var * out.unbias);
  }
}

// Statistics of this rank's values alone: var = M2·inv_count.
template <typename acc_t>
struct LocalStats {
  double inv_count;
  double eps;
  StatsOut<acc_t> out;
  __device__ __forceinline__ void operator()(int64_t c, const Welford<double>& shifted, double shift) const {
    store_stats(out, c, shift, shifted.mean, shifted.m2 * inv_count, eps);
  }
};

// This rank's all-reduce buffer [count·mean | M2 + count·mean² | count] (Note [One all-reduce per
// pass] in syncbn/kernels.h).
struct PackedMoments {
  int64_t channels;
  double count;
  double* packed;
  __device__ __forceinline__ void operator()(int64_t c, const Welford<double>& shifted, double shift) const {
    const double mean = shift + shifted.mean;
    if (c == 0) packed[2 * channels] = count;
    packed[c] = count * mean;
    packed[channels + c] = shifted.m2 + count * mean * mean;
  }
};

// Merges each channel's `splits` partials in double (none for an empty input) and finishes them
// with the shift the partial kernels used, K = x[c · shift_stride] (inner for planar, 1 for rows;
// 0 when x is null, for an empty input).
template <typename scalar_t, typename acc_t, typename Finish>
__global__ void moments_finish_kernel(const Welford<acc_t>* __restrict__ partial, int64_t splits, int64_t channels,
                                      const scalar_t* __restrict__ x, int64_t shift_stride, Finish finish) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= channels) return;
  Welford<double> total{0.0, 0.0, 0.0};
  for (int64_t k = 0; k < splits; ++k) {
    const Welford<acc_t>& p = partial[k * channels + c];
    total = welford_merge(
        total, Welford<double>{static_cast<double>(p.n), static_cast<double>(p.mean), static_cast<double>(p.m2)});
  }
  finish(c, total, x == nullptr ? 0.0 : static_cast<double>(static_cast<acc_t>(x[c * shift_stride])));
}

// Statistics from the summed buffer of a group of `count` values per channel, saved against this
// rank's shifts K = x[c · shift_stride] (0 when x is null: this rank's input is empty).
template <typename scalar_t, typename acc_t>
__global__ void packed_stats_kernel(const double* __restrict__ packed, int64_t channels, double count, double eps,
                                    const scalar_t* __restrict__ x, int64_t shift_stride, StatsOut<acc_t> out) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= channels) return;
  const double mean = count > 0 ? packed[c] / count : 0.0;
  const double var = count > 0 ? fmax(0.0, packed[channels + c] / count - mean * mean) : 0.0;
  const double shift = x == nullptr ? 0.0 : static_cast<double>(static_cast<acc_t>(x[c * shift_stride]));
  store_stats(out, c, shift, mean - shift, var, eps);
}

// --- backward reduction -----------------------------------------------------------------------

// Stores a grad-sums kernel's merged value as the partial of (split, c).
template <typename acc_t>
struct StoreSums {
  GradSums<acc_t>* partial;
  int64_t channels;
  __device__ __forceinline__ void operator()(int64_t c, int64_t split, const GradSums<acc_t>& s) const {
    partial[split * channels + c] = s;
  }
};

// The centre of Note [Centred arithmetic] for channel c: center = (acc_t) mean and the rounding left
// over, offset = mean - center in double, from the channel's shift K and its saved mean - K.
template <typename acc_t>
struct Centre {
  acc_t center;
  double offset;
};

template <typename acc_t>
__device__ __forceinline__ Centre<acc_t> centre(acc_t shift, acc_t saved_mean) {
  const double mean = static_cast<double>(shift) + static_cast<double>(saved_mean);
  const acc_t center = static_cast<acc_t>(mean);
  return Centre<acc_t>{center, mean - static_cast<double>(center)};
}

// out[c] = Σ dy, out[C + c] = Σ dy·(x - center) - (mean - center)·Σ dy of channel c, computed in
// double and stored in acc_t (Note [Centred arithmetic] in syncbn/kernels.h): the [2C] layout of
// the backward's sums. From them, grad_weight[c] = invstd[c]·out[C + c] and grad_bias[c] = out[c]
// where wanted. The channel's shift K is x[c · shift_stride] (0 when x is null: an empty input).
template <typename scalar_t, typename acc_t>
struct FinishSums {
  int64_t channels;
  const acc_t* mean;  // saved: mean - K
  const acc_t* invstd;
  const scalar_t* x;
  int64_t shift_stride;
  acc_t* out;
  MutableParam grad_weight;
  MutableParam grad_bias;
  __device__ __forceinline__ void finish(int64_t c, double dy, double dy_xc) const {
    const acc_t shift = x == nullptr ? acc_t(0) : static_cast<acc_t>(x[c * shift_stride]);
    const double centred = dy_xc - centre(shift, mean[c]).offset * dy;
    out[c] = static_cast<acc_t>(dy);
    out[channels + c] = static_cast<acc_t>(centred);
    store_param(grad_weight, c, static_cast<double>(invstd[c]) * centred);
    store_param(grad_bias, c, dy);
  }
  // As a sink (Note [Reduction sinks]): the channel's only partial is its whole.
  __device__ __forceinline__ void operator()(int64_t c, int64_t, const GradSums<acc_t>& s) const {
    finish(c, static_cast<double>(s.dy), static_cast<double>(s.dy_xc));
  }
};

// Σ dy and Σ dy·(x - center), center = (acc_t) mean (Note [Centred arithmetic]), in the layouts and
// splits of the moments kernels. mean: the saved mean - K.
template <typename scalar_t, typename acc_t, typename index_t, typename Sink>
__global__ void __launch_bounds__(kThreads)
    grad_sums_planar_kernel(const scalar_t* __restrict__ x, const scalar_t* __restrict__ dy,
                            const acc_t* __restrict__ mean, index_t n_outer, index_t channels, index_t inner,
                            Sink sink) {
  const index_t c = blockIdx.x;
  const index_t count = n_outer * inner;
  const acc_t center = centre(static_cast<acc_t>(x[static_cast<int64_t>(c) * inner]), mean[c]).center;
  GradSums<acc_t> sums{acc_t(0), acc_t(0)};
  const index_t stride = static_cast<index_t>(gridDim.y) * kThreads;
  for (index_t t = static_cast<index_t>(blockIdx.y) * kThreads + threadIdx.x; t < count; t += stride) {
    const index_t n = t / inner;
    const index_t s = t - n * inner;
    const int64_t offset = (static_cast<int64_t>(n) * channels + c) * static_cast<int64_t>(inner) + s;
    const acc_t g = static_cast<acc_t>(dy[offset]);
    sums.dy += g;
    sums.dy_xc += g * (static_cast<acc_t>(x[offset]) - center);
  }
  sums = block_merge_1d<SumsOps>(sums);
  if (threadIdx.x == 0) sink(c, blockIdx.y, sums);
}

template <typename scalar_t, typename acc_t, typename Sink>
__global__ void __launch_bounds__(kThreads)
    grad_sums_rows_kernel(const scalar_t* __restrict__ x, const scalar_t* __restrict__ dy,
                          const acc_t* __restrict__ mean, int64_t rows, int64_t channels, Sink sink) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const bool valid = c < channels;
  const acc_t center = valid ? centre(static_cast<acc_t>(x[c]), mean[c]).center : acc_t(0);
  GradSums<acc_t> sums{acc_t(0), acc_t(0)};
  if (valid) {
    const int64_t stride = static_cast<int64_t>(gridDim.y) * blockDim.y;
    for (int64_t r = static_cast<int64_t>(blockIdx.y) * blockDim.y + threadIdx.y; r < rows; r += stride) {
      const int64_t offset = r * channels + c;
      const acc_t g = static_cast<acc_t>(dy[offset]);
      sums.dy += g;
      sums.dy_xc += g * (static_cast<acc_t>(x[offset]) - center);
    }
  }
  sums = block_merge_rows<SumsOps>(sums);
  if (threadIdx.y == 0 && valid) sink(c, blockIdx.y, sums);
}

// Merges each channel's `splits` partials in double (none for an empty input) and finishes them.
template <typename scalar_t, typename acc_t>
__global__ void grad_sums_finish_kernel(const GradSums<acc_t>* __restrict__ partial, int64_t splits,
                                        FinishSums<scalar_t, acc_t> finish) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= finish.channels) return;
  double dy = 0.0, dy_xc = 0.0;
  for (int64_t k = 0; k < splits; ++k) {
    dy += static_cast<double>(partial[k * finish.channels + c].dy);
    dy_xc += static_cast<double>(partial[k * finish.channels + c].dy_xc);
  }
  finish.finish(c, dy, dy_xc);
}

// --- element-wise passes ----------------------------------------------------------------------

// out = k·dy + q·(x - center) + r per channel (the grad_input form of syncbn/cpu/kernels.h), with
// the channel's constants computed in double from the saved statistics (s = invstd) and the centre
// of Note [Centred arithmetic] (center, and offset = mean - center):
//  - kNormalize:     k = 0, q = w·s, r = b - offset·q; dy is not read.
//  - kGradTraining:  k = w·s, q = -k·s²·Σdy(x-mean)/N, r = -k·Σdy/N - q·offset.
//  - kGradEval:      k = w·s, q = r = 0; x is not read.
enum class Pass : int { kNormalize = 0, kGradTraining = 1, kGradEval = 2 };

template <typename acc_t>
struct PassArgs {
  const acc_t* mean;  // [C], saved: mean - K; unused by kGradEval
  const acc_t* invstd;
  Param weight;
  Param bias;         // kNormalize only
  const acc_t* sums;  // [2C] global [Σ dy | Σ dy·(x - mean)]; kGradTraining only
  double inv_count;   // 1/N (0 for an empty group); kGradTraining only
};

template <typename acc_t>
struct Affine {
  acc_t center, k, q, r;
};

// The constants of channel c, whose shift K is `shift` (ignored by kGradEval).
template <Pass pass, typename acc_t>
__device__ __forceinline__ Affine<acc_t> channel_affine(const PassArgs<acc_t>& a, int64_t c, int64_t channels,
                                                        acc_t shift) {
  const double s = static_cast<double>(a.invstd[c]);
  const double w = load_param(a.weight, c, 1.0);
  if constexpr (pass == Pass::kGradEval) {
    return Affine<acc_t>{acc_t(0), static_cast<acc_t>(w * s), acc_t(0), acc_t(0)};
  } else {
    const Centre<acc_t> m = centre(shift, a.mean[c]);
    if constexpr (pass == Pass::kNormalize) {
      const double scale = w * s;
      return Affine<acc_t>{m.center, acc_t(0), static_cast<acc_t>(scale),
                           static_cast<acc_t>(load_param(a.bias, c, 0.0) - m.offset * scale)};
    } else {
      const double k = w * s;
      const double q = -k * s * s * static_cast<double>(a.sums[channels + c]) * a.inv_count;
      return Affine<acc_t>{m.center, static_cast<acc_t>(k), static_cast<acc_t>(q),
                           static_cast<acc_t>(-k * static_cast<double>(a.sums[c]) * a.inv_count - q * m.offset)};
    }
  }
}

template <Pass pass, typename scalar_t, typename acc_t>
__device__ __forceinline__ scalar_t apply_affine(const Affine<acc_t>& f, const scalar_t* __restrict__ x,
                                                 const scalar_t* __restrict__ dy, int64_t i) {
  if constexpr (pass == Pass::kNormalize) {
    return static_cast<scalar_t>((static_cast<acc_t>(x[i]) - f.center) * f.q + f.r);
  } else if constexpr (pass == Pass::kGradEval) {
    return static_cast<scalar_t>(static_cast<acc_t>(dy[i]) * f.k);
  } else {
    return static_cast<scalar_t>(static_cast<acc_t>(dy[i]) * f.k + (static_cast<acc_t>(x[i]) - f.center) * f.q + f.r);
  }
}

// Planar: each group of 2^lanes_log2 threads owns one plane p = n·C + c (kThreads >> lanes_log2
// planes per block) and walks its `inner` elements; the channel's constants are computed once.
template <Pass pass, typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kThreads)
    affine_planar_kernel(const scalar_t* __restrict__ x, const scalar_t* __restrict__ dy, scalar_t* __restrict__ out,
                         int64_t planes, int64_t channels, int64_t inner, int lanes_log2, PassArgs<acc_t> args) {
  const int lanes = 1 << lanes_log2;
  const int64_t p = static_cast<int64_t>(blockIdx.x) * (kThreads >> lanes_log2) + (threadIdx.x >> lanes_log2);
  if (p >= planes) return;
  const int64_t c = p % channels;
  const acc_t shift = pass == Pass::kGradEval ? acc_t(0) : static_cast<acc_t>(x[c * inner]);
  const Affine<acc_t> f = channel_affine<pass, acc_t>(args, c, channels, shift);
  const int64_t base = p * inner;
  for (int64_t s = threadIdx.x & (lanes - 1); s < inner; s += lanes) {
    out[base + s] = apply_affine<pass>(f, x, dy, base + s);
  }
}

// Channels-inner: thread column threadIdx.x owns channel blockIdx.x·blockDim.x + threadIdx.x and
// walks rows r ≡ blockIdx.y·blockDim.y + threadIdx.y (mod gridDim.y·blockDim.y).
template <Pass pass, typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kThreads)
    affine_rows_kernel(const scalar_t* __restrict__ x, const scalar_t* __restrict__ dy, scalar_t* __restrict__ out,
                       int64_t rows, int64_t channels, PassArgs<acc_t> args) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= channels) return;
  const acc_t shift = pass == Pass::kGradEval ? acc_t(0) : static_cast<acc_t>(x[c]);
  const Affine<acc_t> f = channel_affine<pass, acc_t>(args, c, channels, shift);
  const int64_t stride = static_cast<int64_t>(gridDim.y) * blockDim.y;
  for (int64_t r = static_cast<int64_t>(blockIdx.y) * blockDim.y + threadIdx.y; r < rows; r += stride) {
    out[r * channels + c] = apply_affine<pass>(f, x, dy, r * channels + c);
  }
}

// --- one block per channel (no group) --------------------------------------------------------

// Note [One block per channel]
// Without a group nothing is communicated between a pass's reduction and its element-wise half, so
// where the device has at least one channel per multiprocessor to run (one_block_per_channel in
// kernels.cu: planar inputs of that many channels) one block of kFusedThreads owns a whole channel:
// it reduces the channel's values, finishes its statistics (forward) or sums (backward) itself, and
// then makes the element-wise pass over the same values, which it has just read and finds in the
// cache. One launch per pass instead of two or three, x read from memory once where the channel's
// values stay in L2 between the halves, and the backward's sums kept in the block: no [2C] tensor
// and no partials, so a layer holds only its saved statistics between the passes (bench_syncbn.py's
// memory columns, and scripts/gpu_profile.py's conv shape, where the two-kernel forward read x
// twice). Each thread accumulates in acc_t over the values it reads, V consecutive values of a
// plane at a time (one 16-byte load where the plane's length and the pointers allow); the block
// merges the threads' results in double. The forward runs Welford's update on vectors of values
// shifted by K (Note [CUDA moments]), one division per vector.
constexpr int kFusedThreads = 512;

// V consecutive elements, aligned for one load or store of sizeof(T)·V bytes.
template <typename T, int V>
struct alignas(sizeof(T) * V) Vec {
  T v[V];
};

// Calls f(i) for the elements [i, i + V) of channel c of a planar input (n_outer planes of `inner`,
// inner % V == 0) that belong to this thread of a kFusedThreads block. The thread's position
// advances by kFusedThreads vectors with a carry instead of a division per step.
template <int V, typename F>
__device__ __forceinline__ void for_channel_values(int64_t n_outer, int64_t channels, int64_t inner, int64_t c, F&& f) {
  const int64_t vectors = inner / V;  // per plane
  const int64_t total = n_outer * vectors;
  const int64_t dn = kFusedThreads / vectors, dv = kFusedThreads % vectors;
  int64_t n = threadIdx.x / vectors, v = threadIdx.x % vectors;
  for (int64_t t = threadIdx.x; t < total; t += kFusedThreads) {
    f((n * channels + c) * inner + v * V);
    v += dv;
    n += dn;
    if (v >= vectors) {
      v -= vectors;
      ++n;
    }
  }
}

// Forward: statistics of channel c = blockIdx.x over this rank's values into `out`, then y = (x -
// K)·q + r with kNormalize's constants from the saved values. The input is not empty.
template <typename scalar_t, typename acc_t, int V>
__global__ void __launch_bounds__(kFusedThreads)
    fused_forward_planar_kernel(const scalar_t* __restrict__ x, scalar_t* __restrict__ y, int64_t n_outer,
                                int64_t channels, int64_t inner, double eps, StatsOut<acc_t> out, Param weight,
                                Param bias) {
  using Values = Vec<scalar_t, V>;
  const int64_t c = blockIdx.x;
  const acc_t shift = static_cast<acc_t>(x[c * inner]);
  Welford<acc_t> w{acc_t(0), acc_t(0), acc_t(0)};
  for_channel_values<V>(n_outer, channels, inner, c, [&](int64_t i) {
    const Values a = *reinterpret_cast<const Values*>(x + i);
    acc_t d[V];
#pragma unroll
    for (int j = 0; j < V; ++j) d[j] = static_cast<acc_t>(a.v[j]) - shift;
    welford_add_values<V>(w, d);
  });
  const Welford<double> merged = block_merge_1d<WelfordOps, Welford<double>, kFusedThreads>(
      Welford<double>{static_cast<double>(w.n), static_cast<double>(w.mean), static_cast<double>(w.m2)});
  __shared__ Affine<acc_t> constants;
  if (threadIdx.x == 0) {
    store_stats(out, c, static_cast<double>(shift), merged.mean, merged.m2 / static_cast<double>(n_outer * inner), eps);
    const Centre<acc_t> m = centre(shift, out.mean[c]);
    const double scale = load_param(weight, c, 1.0) * static_cast<double>(out.invstd[c]);
    constants = Affine<acc_t>{m.center, acc_t(0), static_cast<acc_t>(scale),
                              static_cast<acc_t>(load_param(bias, c, 0.0) - m.offset * scale)};
  }
  __syncthreads();
  const Affine<acc_t> f = constants;
  for_channel_values<V>(n_outer, channels, inner, c, [&](int64_t i) {
    const Values a = *reinterpret_cast<const Values*>(x + i);
    Values b;
#pragma unroll
    for (int j = 0; j < V; ++j) b.v[j] = static_cast<scalar_t>((static_cast<acc_t>(a.v[j]) - f.center) * f.q + f.r);
    *reinterpret_cast<Values*>(y + i) = b;
  });
}

// Training backward of channel c = blockIdx.x: Σ dy and Σ dy·(x - mean) over this rank's values,
// the weight and bias gradients from them (kNone: not wanted), then, unless dx is null, dx =
// k·dy + q·(x - K) + r with kGradTraining's constants and N = this rank's count. mean, invstd: the
// saved statistics. The input is not empty.
template <typename scalar_t, typename acc_t, int V>
__global__ void __launch_bounds__(kFusedThreads)
    fused_backward_planar_kernel(const scalar_t* __restrict__ x, const scalar_t* __restrict__ dy,
                                 scalar_t* __restrict__ dx, int64_t n_outer, int64_t channels, int64_t inner,
                                 const acc_t* __restrict__ mean, const acc_t* __restrict__ invstd, Param weight,
                                 MutableParam grad_weight, MutableParam grad_bias) {
  using Values = Vec<scalar_t, V>;
  const int64_t c = blockIdx.x;
  const Centre<acc_t> m = centre(static_cast<acc_t>(x[c * inner]), mean[c]);
  acc_t g1 = acc_t(0), g2 = acc_t(0);
  for_channel_values<V>(n_outer, channels, inner, c, [&](int64_t i) {
    const Values a = *reinterpret_cast<const Values*>(x + i);
    const Values g = *reinterpret_cast<const Values*>(dy + i);
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const acc_t gj = static_cast<acc_t>(g.v[j]);
      g1 += gj;
      g2 += gj * (static_cast<acc_t>(a.v[j]) - m.center);
    }
  });
  const GradSums<double> sums = block_merge_1d<SumsOps, GradSums<double>, kFusedThreads>(
      GradSums<double>{static_cast<double>(g1), static_cast<double>(g2)});
  __shared__ Affine<acc_t> constants;
  if (threadIdx.x == 0) {
    const double s = static_cast<double>(invstd[c]);
    const double centred = sums.dy_xc - m.offset * sums.dy;  // Σ dy·(x - mean)
    store_param(grad_weight, c, s * centred);
    store_param(grad_bias, c, sums.dy);
    const double inv_count = 1.0 / static_cast<double>(n_outer * inner);
    const double k = load_param(weight, c, 1.0) * s;
    const double q = -k * s * s * centred * inv_count;
    constants = Affine<acc_t>{m.center, static_cast<acc_t>(k), static_cast<acc_t>(q),
                              static_cast<acc_t>(-k * sums.dy * inv_count - q * m.offset)};
  }
  if (dx == nullptr) return;  // the same for every thread of the grid
  __syncthreads();
  const Affine<acc_t> f = constants;
  for_channel_values<V>(n_outer, channels, inner, c, [&](int64_t i) {
    const Values a = *reinterpret_cast<const Values*>(x + i);
    const Values g = *reinterpret_cast<const Values*>(dy + i);
    Values b;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      b.v[j] =
          static_cast<scalar_t>(static_cast<acc_t>(g.v[j]) * f.k + (static_cast<acc_t>(a.v[j]) - f.center) * f.q + f.r);
    }
    *reinterpret_cast<Values*>(dx + i) = b;
  });
}

}  // namespace ddpkit::syncbn::cuda
