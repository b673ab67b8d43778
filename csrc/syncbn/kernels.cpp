#include "syncbn/kernels.h"

#include <ATen/Dispatch.h>
#include <ATen/Version.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <vector>

namespace ddpkit::syncbn {

// ---------------------------------------------------------------------------------------------
// CPU capability selection (Note [CPU capabilities] in syncbn/cpu/kernels.h)

namespace cpu {
#ifdef DDPKIT_CPU_DEFAULT
namespace DEFAULT {
const KernelTable& kernel_table();
}
#endif
#ifdef DDPKIT_CPU_AVX2
namespace AVX2 {
const KernelTable& kernel_table();
}
#endif
#ifdef DDPKIT_CPU_AVX512
namespace AVX512 {
const KernelTable& kernel_table();
}
#endif

namespace {
struct Choice {
  const KernelTable* table;
  const char* name;
};

Choice choose() {
  // torch's own choice for this machine and ATEN_CPU_CAPABILITY: "DEFAULT", "AVX2", "AVX512", ...
  const std::string capability = at::get_cpu_capability();
#ifdef DDPKIT_CPU_AVX512
  if (capability == "AVX512") return {&AVX512::kernel_table(), "AVX512"};
#endif
#ifdef DDPKIT_CPU_AVX2
  if (capability == "AVX512" || capability == "AVX2") return {&AVX2::kernel_table(), "AVX2"};
#endif
  return {&DEFAULT::kernel_table(), "DEFAULT"};
}

const Choice& chosen() {
  static const Choice choice = choose();
  return choice;
}
}  // namespace

const KernelTable& kernel_table() { return *chosen().table; }
const char* kernel_capability() { return chosen().name; }
}  // namespace cpu

namespace {

std::atomic<bool> native_cpu_kernels{true};

bool native(const at::Tensor& t) { return t.is_cpu() && native_cpu_kernels.load(std::memory_order_relaxed); }

// Note [Backend element kernels]: the table of the innermost live ElementKernelsGuard on this thread.
thread_local const ElementKernels* guarded_kernels = nullptr;

const ElementKernels* backend_kernels(const at::Tensor& t) {
  const ElementKernels* k = guarded_kernels;
  return k != nullptr && t.device().type() == k->device ? k : nullptr;
}

at::ScalarType acc_dtype(at::ScalarType dtype) { return dtype == at::kDouble ? at::kDouble : at::kFloat; }

// The dimensions a per-channel reduction runs over: all but dim 1.
std::vector<int64_t> reduce_dims(const at::Tensor& x) {
  std::vector<int64_t> dims{0};
  for (int64_t d = 2; d < x.dim(); ++d) dims.push_back(d);
  return dims;
}

// A [C] tensor viewed as [1, C, 1, ...] to broadcast against an input of `ndim` dimensions.
at::Tensor per_channel(const at::Tensor& v, int64_t ndim) {
  std::vector<int64_t> shape(ndim, 1);
  shape[1] = v.numel();
  return v.view(shape);
}

at::Tensor new_doubles(const at::Tensor& like, int64_t n) { return at::empty({n}, like.options().dtype(at::kDouble)); }

// The values of a CPU tensor of C elements (any floating dtype) as float64; `fill` if undefined.
std::vector<double> to_doubles(const at::Tensor& t, int64_t n, double fill) {
  std::vector<double> out(n, fill);
  if (!t.defined()) return out;
  const at::Tensor c = t.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, c.scalar_type(), "ddpkit_syncbn_to_doubles", [&] {
    const scalar_t* p = c.const_data_ptr<scalar_t>();
    for (int64_t i = 0; i < n; ++i) out[i] = static_cast<double>(p[i]);
  });
  return out;
}

// Runs `fn.template operator()<acc>()` with the element arithmetic type of `dtype`.
template <typename F>
void with_acc_type(at::ScalarType dtype, F&& fn) {
  if (dtype == at::kDouble) {
    fn.template operator()<double>();
  } else {
    fn.template operator()<float>();
  }
}

}  // namespace

ElementKernelsGuard::ElementKernelsGuard(const ElementKernels& kernels) : previous_(guarded_kernels) {
  guarded_kernels = &kernels;
}

ElementKernelsGuard::~ElementKernelsGuard() { guarded_kernels = previous_; }

void set_native_cpu_kernels(bool enabled) { native_cpu_kernels.store(enabled); }

std::string cpu_kernels_name() {
  return native_cpu_kernels.load() ? std::string("cpu-") + cpu::kernel_capability() : std::string("aten");
}

LocalInput prepare_input(const at::Tensor& input) {
  TORCH_INTERNAL_ASSERT(input.dim() >= 2);
  const int64_t n = input.size(0), c = input.size(1);
  int64_t spatial = 1;
  for (int64_t d = 2; d < input.dim(); ++d) spatial *= input.size(d);
  const auto rows = [&](at::Tensor x, at::MemoryFormat format) {
    return LocalInput{std::move(x), format, cpu::Shape{true, n * spatial, c, 1}};
  };
  if (input.dim() == 2 || spatial == 1) return rows(input.contiguous(), at::MemoryFormat::Contiguous);
  if (input.is_contiguous()) return LocalInput{input, at::MemoryFormat::Contiguous, cpu::Shape{false, n, c, spatial}};
  if (input.dim() == 4 && input.is_contiguous(at::MemoryFormat::ChannelsLast)) {
    return rows(input, at::MemoryFormat::ChannelsLast);
  }
  if (input.dim() == 5 && input.is_contiguous(at::MemoryFormat::ChannelsLast3d)) {
    return rows(input, at::MemoryFormat::ChannelsLast3d);
  }
  return LocalInput{input.contiguous(), at::MemoryFormat::Contiguous, cpu::Shape{false, n, c, spatial}};
}

at::Tensor match_layout(const LocalInput& in, const at::Tensor& t) { return t.contiguous(in.format); }

// ---------------------------------------------------------------------------------------------
// The parts of the passes on CPU and on devices without kernels of their own

namespace {

// Per-channel mean and centred sum of squares Σ(x - mean)² of this rank's values, float64 [C]
// each (Note [Stable moments]); zeros for an empty input.
struct LocalMoments {
  at::Tensor mean;
  at::Tensor m2;
};

LocalMoments local_moments(const LocalInput& in) {
  const int64_t channels = in.channels();
  if (native(in.x)) {
    LocalMoments out{new_doubles(in.x, channels), new_doubles(in.x, channels)};
    cpu::kernel_table().moments(in.x.scalar_type(), in.x.const_data_ptr(), in.shape,
                                out.mean.mutable_data_ptr<double>(), out.m2.mutable_data_ptr<double>());
    return out;
  }
  if (in.count() == 0)
    return {at::zeros({channels}, in.x.options().dtype(at::kDouble)),
            at::zeros({channels}, in.x.options().dtype(at::kDouble))};
  const at::Tensor xf = in.x.to(acc_dtype(in.x.scalar_type()));
  auto [var, mean] = at::var_mean(xf, reduce_dims(xf), /*correction=*/0, /*keepdim=*/false);
  return {mean.to(at::kDouble), var.to(at::kDouble) * static_cast<double>(in.count())};
}

// [n·mean | M2 + n·mean² | n], float64 [2C + 1] (Note [One all-reduce per pass]).
at::Tensor pack_moments(const LocalMoments& moments, int64_t count) {
  const int64_t channels = moments.mean.numel();
  const double n = static_cast<double>(count);
  if (native(moments.mean)) {
    at::Tensor packed = new_doubles(moments.mean, 2 * channels + 1);
    double* p = packed.mutable_data_ptr<double>();
    const double* mean = moments.mean.const_data_ptr<double>();
    const double* m2 = moments.m2.const_data_ptr<double>();
    for (int64_t c = 0; c < channels; ++c) {
      p[c] = n * mean[c];
      p[channels + c] = m2[c] + n * mean[c] * mean[c];
    }
    p[2 * channels] = n;
    return packed;
  }
  return at::cat(
      {moments.mean * n, moments.m2 + moments.mean * moments.mean * n, at::full({1}, n, moments.mean.options())});
}

// Mean, biased var and invstd from a summed pack_moments buffer.
BatchStats summed_stats(const at::Tensor& packed, double eps) {
  const int64_t channels = (packed.numel() - 1) / 2;
  if (native(packed)) {
    const double* p = packed.const_data_ptr<double>();
    const double n = p[2 * channels];
    BatchStats stats{new_doubles(packed, channels), new_doubles(packed, channels), new_doubles(packed, channels), n};
    double* mean = stats.mean.mutable_data_ptr<double>();
    double* var = stats.var.mutable_data_ptr<double>();
    double* invstd = stats.invstd.mutable_data_ptr<double>();
    for (int64_t c = 0; c < channels; ++c) {
      mean[c] = n > 0 ? p[c] / n : 0.0;
      var[c] = n > 0 ? std::max(0.0, p[channels + c] / n - mean[c] * mean[c]) : 0.0;
      invstd[c] = 1.0 / std::sqrt(var[c] + eps);
    }
    return stats;
  }
  const double n = packed[2 * channels].item<double>();
  const double inv_n = n > 0 ? 1.0 / n : 0.0;
  const at::Tensor mean = packed.narrow(0, 0, channels) * inv_n;
  const at::Tensor var = (packed.narrow(0, channels, channels) * inv_n - mean * mean).clamp_min(0.0);
  return BatchStats{mean, var, (var + eps).rsqrt(), n};
}

// Mean, biased var = M2/count and invstd from one rank's moments.
BatchStats stats_from_moments(const LocalMoments& moments, int64_t count, double eps) {
  const int64_t channels = moments.mean.numel();
  const double n = static_cast<double>(count);
  const double inv_n = n > 0 ? 1.0 / n : 0.0;
  if (native(moments.mean)) {
    BatchStats stats{moments.mean, new_doubles(moments.mean, channels), new_doubles(moments.mean, channels), n};
    const double* m2 = moments.m2.const_data_ptr<double>();
    double* var = stats.var.mutable_data_ptr<double>();
    double* invstd = stats.invstd.mutable_data_ptr<double>();
    for (int64_t c = 0; c < channels; ++c) {
      var[c] = m2[c] * inv_n;
      invstd[c] = 1.0 / std::sqrt(var[c] + eps);
    }
    return stats;
  }
  const at::Tensor var = moments.m2 * inv_n;
  return BatchStats{moments.mean, var, (var + eps).rsqrt(), n};
}

// This rank's [Σ dy | Σ dy·(x - mean)] per channel, float64 [2C].
at::Tensor grad_sums(const LocalInput& in, const at::Tensor& dy, const at::Tensor& mean) {
  const int64_t channels = in.channels();
  const at::ScalarType dtype = in.x.scalar_type();
  if (native(in.x)) {
    at::Tensor sums = new_doubles(in.x, 2 * channels);
    double* s = sums.mutable_data_ptr<double>();
    const double* m = mean.const_data_ptr<double>();
    with_acc_type(dtype, [&]<typename acc>() {
      std::vector<acc> center(channels);
      for (int64_t c = 0; c < channels; ++c) center[c] = static_cast<acc>(m[c]);
      cpu::kernel_table().grad_sums(dtype, in.x.const_data_ptr(), dy.const_data_ptr(), in.shape, center.data(), s,
                                    s + channels);
      // Σ dy·(x - mean) = Σ dy·(x - center) - (mean - center)·Σ dy (Note [Centred arithmetic])
      for (int64_t c = 0; c < channels; ++c) s[channels + c] -= (m[c] - static_cast<double>(center[c])) * s[c];
    });
    return sums;
  }
  const at::ScalarType acc = acc_dtype(dtype);
  const int64_t nd = in.x.dim();
  const std::vector<int64_t> dims = reduce_dims(in.x);
  const at::Tensor center = mean.to(acc);
  const at::Tensor dyf = dy.to(acc);
  const at::Tensor sum_dy = dyf.sum(dims).to(at::kDouble);
  const at::Tensor sum_dy_xc = (dyf * (in.x.to(acc) - per_channel(center, nd))).sum(dims).to(at::kDouble);
  return at::cat({sum_dy, sum_dy_xc - (mean - center.to(at::kDouble)) * sum_dy});
}

// grad_weight = invstd·Σ dy·(x - mean), grad_bias = Σ dy from local sums, in `dtype`.
std::pair<at::Tensor, at::Tensor> affine_grads(const at::Tensor& local_sums, const at::Tensor& invstd,
                                               at::ScalarType dtype, bool want_weight, bool want_bias) {
  const int64_t channels = invstd.numel();
  at::Tensor grad_weight, grad_bias;
  if (native(local_sums)) {
    const double* s = local_sums.const_data_ptr<double>();
    const double* is = invstd.const_data_ptr<double>();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "ddpkit_syncbn_affine_grads", [&] {
      if (want_weight) {
        grad_weight = at::empty({channels}, local_sums.options().dtype(dtype));
        scalar_t* gw = grad_weight.mutable_data_ptr<scalar_t>();
        for (int64_t c = 0; c < channels; ++c) gw[c] = static_cast<scalar_t>(is[c] * s[channels + c]);
      }
      if (want_bias) {
        grad_bias = at::empty({channels}, local_sums.options().dtype(dtype));
        scalar_t* gb = grad_bias.mutable_data_ptr<scalar_t>();
        for (int64_t c = 0; c < channels; ++c) gb[c] = static_cast<scalar_t>(s[c]);
      }
    });
    return {grad_weight, grad_bias};
  }
  // Fresh tensors: the caller all-reduces local_sums in place afterwards.
  if (want_weight) grad_weight = (local_sums.narrow(0, channels, channels) * invstd).to(dtype);
  if (want_bias) grad_bias = local_sums.narrow(0, 0, channels).to(dtype, /*non_blocking=*/false, /*copy=*/true);
  return {grad_weight, grad_bias};
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// The passes

void update_running_stats(const RunningStats& running, const BatchStats& stats) {
  if (!running.applies(stats.count)) return;
  const at::Tensor& running_mean = running.mean;
  const at::Tensor& running_var = running.var;
  const double momentum = running.momentum;
  const double unbias = stats.count / (stats.count - 1);
  if (native(running_mean) && running_mean.is_contiguous() && running_var.is_contiguous()) {
    const int64_t channels = running_mean.numel();
    const double* mean = stats.mean.const_data_ptr<double>();
    const double* var = stats.var.const_data_ptr<double>();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, running_mean.scalar_type(), "ddpkit_syncbn_running", [&] {
      scalar_t* rm = running_mean.mutable_data_ptr<scalar_t>();
      scalar_t* rv = running_var.mutable_data_ptr<scalar_t>();
      for (int64_t c = 0; c < channels; ++c) {
        rm[c] = static_cast<scalar_t>((1 - momentum) * static_cast<double>(rm[c]) + momentum * mean[c]);
        rv[c] = static_cast<scalar_t>((1 - momentum) * static_cast<double>(rv[c]) + momentum * var[c] * unbias);
      }
    });
    return;
  }
  running_mean.copy_(running_mean.to(at::kDouble) * (1 - momentum) + stats.mean * momentum);
  running_var.copy_(running_var.to(at::kDouble) * (1 - momentum) + stats.var * (momentum * unbias));
}

BatchStats local_batch_stats(const LocalInput& in, double eps, const RunningStats& running) {
  if (const ElementKernels* k = backend_kernels(in.x)) return k->local_batch_stats(in, eps, running);
  BatchStats stats = stats_from_moments(local_moments(in), in.count(), eps);
  update_running_stats(running, stats);
  return stats;
}

at::Tensor packed_moments(const LocalInput& in) {
  if (const ElementKernels* k = backend_kernels(in.x)) return k->packed_moments(in);
  return pack_moments(local_moments(in), in.count());
}

BatchStats stats_from_packed(const at::Tensor& packed, double eps, const RunningStats& running) {
  if (const ElementKernels* k = backend_kernels(packed)) return k->stats_from_packed(packed, eps, running);
  BatchStats stats = summed_stats(packed, eps);
  update_running_stats(running, stats);
  return stats;
}

BatchStats stats_from_running(const at::Tensor& running_mean, const at::Tensor& running_var, double eps) {
  return BatchStats{running_mean.to(at::kDouble, /*non_blocking=*/false, /*copy=*/true), at::Tensor(),
                    (running_var.to(at::kDouble) + eps).rsqrt(), 0.0};
}

at::Tensor normalize(const LocalInput& in, const at::Tensor& mean, const at::Tensor& invstd, const at::Tensor& weight,
                     const at::Tensor& bias) {
  if (const ElementKernels* k = backend_kernels(in.x)) return k->normalize(in, mean, invstd, weight, bias);
  const int64_t channels = in.channels();
  const at::ScalarType dtype = in.x.scalar_type();
  if (native(in.x)) {
    at::Tensor y = at::empty_like(in.x);
    const double* m = mean.const_data_ptr<double>();
    const double* s = invstd.const_data_ptr<double>();
    const std::vector<double> w = to_doubles(weight, channels, 1.0), b = to_doubles(bias, channels, 0.0);
    with_acc_type(dtype, [&]<typename acc>() {
      std::vector<acc> k(3 * channels);  // center | scale | offset
      for (int64_t c = 0; c < channels; ++c) {
        const acc center = static_cast<acc>(m[c]);
        const double scale = w[c] * s[c];
        k[c] = center;
        k[channels + c] = static_cast<acc>(scale);
        k[2 * channels + c] = static_cast<acc>(b[c] - (m[c] - static_cast<double>(center)) * scale);
      }
      cpu::kernel_table().normalize(dtype, in.x.const_data_ptr(), y.mutable_data_ptr(), in.shape, k.data());
    });
    return y;
  }
  const at::ScalarType acc = acc_dtype(dtype);
  const int64_t nd = in.x.dim();
  const at::Tensor center = mean.to(acc);
  const at::Tensor scale = weight.defined() ? invstd * weight.to(at::kDouble) : invstd;
  at::Tensor offset = (center.to(at::kDouble) - mean) * scale;
  if (bias.defined()) offset = offset + bias.to(at::kDouble);
  const at::Tensor y = at::addcmul(per_channel(offset.to(acc), nd), in.x.to(acc) - per_channel(center, nd),
                                   per_channel(scale.to(acc), nd));
  return y.to(dtype);
}

LocalGradSums local_grad_sums(const LocalInput& in, const at::Tensor& dy, const at::Tensor& mean,
                              const at::Tensor& invstd, at::ScalarType dtype, bool want_weight, bool want_bias) {
  if (const ElementKernels* k = backend_kernels(in.x)) {
    return k->local_grad_sums(in, dy, mean, invstd, dtype, want_weight, want_bias);
  }
  LocalGradSums out{grad_sums(in, dy, mean), at::Tensor(), at::Tensor()};
  if (want_weight || want_bias) {
    std::tie(out.grad_weight, out.grad_bias) = affine_grads(out.sums, invstd, dtype, want_weight, want_bias);
  }
  return out;
}

at::Tensor grad_input_training(const LocalInput& in, const at::Tensor& dy, const at::Tensor& mean,
                               const at::Tensor& invstd, const at::Tensor& weight, const at::Tensor& sums,
                               double count) {
  if (const ElementKernels* k = backend_kernels(in.x)) {
    return k->grad_input_training(in, dy, mean, invstd, weight, sums, count);
  }
  const int64_t channels = in.channels();
  const at::ScalarType dtype = in.x.scalar_type();
  // dx = k·dy + q·(x - mean) + r with k = w·invstd, q = -k·invstd²·Σdy(x-mean)/N, r = -k·Σdy/N, and
  // x - mean = (x - center) - (mean - center) (Note [Centred arithmetic]).
  const double inv_count = count > 0 ? 1.0 / count : 0.0;
  if (native(in.x)) {
    at::Tensor dx = at::empty_like(in.x);
    const double* m = mean.const_data_ptr<double>();
    const double* s = invstd.const_data_ptr<double>();
    const double* g = sums.const_data_ptr<double>();
    const std::vector<double> w = to_doubles(weight, channels, 1.0);
    with_acc_type(dtype, [&]<typename acc>() {
      std::vector<acc> k(4 * channels);  // center | k | q | r
      for (int64_t c = 0; c < channels; ++c) {
        const acc center = static_cast<acc>(m[c]);
        const double kc = w[c] * s[c];
        const double q = -kc * s[c] * s[c] * g[channels + c] * inv_count;
        k[c] = center;
        k[channels + c] = static_cast<acc>(kc);
        k[2 * channels + c] = static_cast<acc>(q);
        k[3 * channels + c] = static_cast<acc>(-kc * g[c] * inv_count - q * (m[c] - static_cast<double>(center)));
      }
      cpu::kernel_table().grad_input(dtype, in.x.const_data_ptr(), dy.const_data_ptr(), dx.mutable_data_ptr(), in.shape,
                                     k.data());
    });
    return dx;
  }
  const at::ScalarType acc = acc_dtype(dtype);
  const int64_t nd = in.x.dim();
  const at::Tensor center = mean.to(acc);
  const at::Tensor k = weight.defined() ? invstd * weight.to(at::kDouble) : invstd;
  const at::Tensor q = -k * invstd * invstd * sums.narrow(0, channels, channels) * inv_count;
  const at::Tensor r = -k * sums.narrow(0, 0, channels) * inv_count - q * (mean - center.to(at::kDouble));
  const at::Tensor dx = at::addcmul(at::addcmul(per_channel(r.to(acc), nd), dy.to(acc), per_channel(k.to(acc), nd)),
                                    in.x.to(acc) - per_channel(center, nd), per_channel(q.to(acc), nd));
  return dx.to(dtype);
}

at::Tensor grad_input_eval(const LocalInput& in, const at::Tensor& dy, const at::Tensor& invstd,
                           const at::Tensor& weight) {
  if (const ElementKernels* k = backend_kernels(in.x)) return k->grad_input_eval(in, dy, invstd, weight);
  const int64_t channels = in.channels();
  const at::ScalarType dtype = in.x.scalar_type();
  if (native(in.x)) {
    at::Tensor dx = at::empty_like(in.x);
    const double* s = invstd.const_data_ptr<double>();
    const std::vector<double> w = to_doubles(weight, channels, 1.0);
    with_acc_type(dtype, [&]<typename acc>() {
      std::vector<acc> k(4 * channels, acc(0));  // center | k | q | r, only k is non-zero
      for (int64_t c = 0; c < channels; ++c) k[channels + c] = static_cast<acc>(w[c] * s[c]);
      cpu::kernel_table().grad_input(dtype, nullptr, dy.const_data_ptr(), dx.mutable_data_ptr(), in.shape, k.data());
    });
    return dx;
  }
  const at::Tensor k = weight.defined() ? invstd * weight.to(at::kDouble) : invstd;
  const at::ScalarType acc = acc_dtype(dtype);
  return (dy.to(acc) * per_channel(k.to(acc), in.x.dim())).to(dtype);
}

}  // namespace ddpkit::syncbn
