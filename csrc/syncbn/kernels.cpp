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

at::Tensor channel_shifts(const LocalInput& in) {
  const int64_t channels = in.channels();
  if (in.count() == 0) return at::zeros({channels}, in.x.options().dtype(at::kDouble));
  if (native(in.x)) {
    at::Tensor shifts = at::empty({channels}, in.x.options().dtype(at::kDouble));
    double* k = shifts.mutable_data_ptr<double>();
    // x[0, c, 0, ...]: row 0 of the channels-inner layout, the first value of plane c in the planar one.
    const int64_t stride = in.shape.channels_inner ? 1 : in.shape.inner;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, in.x.scalar_type(), "ddpkit_syncbn_shifts", [&] {
      const scalar_t* x = in.x.const_data_ptr<scalar_t>();
      for (int64_t c = 0; c < channels; ++c) k[c] = static_cast<double>(x[c * stride]);
    });
    return shifts;
  }
  at::Tensor first = in.x.select(0, 0);
  while (first.dim() > 1) first = first.select(1, 0);
  return first.to(at::kDouble);
}

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

// Mean and biased var, float64 [C] each, from a summed pack_moments buffer.
std::pair<at::Tensor, at::Tensor> summed_moments(const at::Tensor& packed) {
  const int64_t channels = (packed.numel() - 1) / 2;
  if (native(packed)) {
    const double* p = packed.const_data_ptr<double>();
    const double n = p[2 * channels];
    at::Tensor mean = new_doubles(packed, channels), var = new_doubles(packed, channels);
    double* m = mean.mutable_data_ptr<double>();
    double* v = var.mutable_data_ptr<double>();
    for (int64_t c = 0; c < channels; ++c) {
      m[c] = n > 0 ? p[c] / n : 0.0;
      v[c] = n > 0 ? std::max(0.0, p[channels + c] / n - m[c] * m[c]) : 0.0;
    }
    return {mean, var};
  }
  const double n = packed[2 * channels].item<double>();
  const double inv_n = n > 0 ? 1.0 / n : 0.0;
  const at::Tensor mean = packed.narrow(0, 0, channels) * inv_n;
  return {mean, (packed.narrow(0, channels, channels) * inv_n - mean * mean).clamp_min(0.0)};
}

// The saved statistics of `in` (Note [Saved statistics]) from its group's float64 mean and biased
// var: mean - K and 1/sqrt(var + eps) in the arithmetic dtype.
BatchStats saved_stats(const LocalInput& in, const at::Tensor& mean, const at::Tensor& var, double eps, double count) {
  const int64_t channels = in.channels();
  const at::Tensor shifts = channel_shifts(in);
  const at::ScalarType acc = acc_dtype(in.x.scalar_type());
  if (native(in.x)) {
    BatchStats stats{at::empty({channels}, in.x.options().dtype(acc)), at::empty({channels}, in.x.options().dtype(acc)),
                     count};
    const double* m = mean.const_data_ptr<double>();
    const double* v = var.const_data_ptr<double>();
    const double* k = shifts.const_data_ptr<double>();
    with_acc_type(in.x.scalar_type(), [&]<typename acc_t>() {
      acc_t* saved_mean = stats.mean.mutable_data_ptr<acc_t>();
      acc_t* invstd = stats.invstd.mutable_data_ptr<acc_t>();
      for (int64_t c = 0; c < channels; ++c) {
        saved_mean[c] = static_cast<acc_t>(m[c] - k[c]);
        invstd[c] = static_cast<acc_t>(1.0 / std::sqrt(v[c] + eps));
      }
    });
    return stats;
  }
  return BatchStats{(mean - shifts).to(acc), (var + eps).rsqrt().to(acc), count};
}

// The centres of Note [Centred arithmetic] for a CPU input: center[c] = (acc_t) mean[c] and the
// rounding left over, offset[c] = mean[c] - center[c] in double, with mean = K + (mean - K) from the
// saved statistics.
template <typename acc_t>
struct Centres {
  std::vector<acc_t> center;
  std::vector<double> offset;
};

template <typename acc_t>
Centres<acc_t> centres(const LocalInput& in, const at::Tensor& saved_mean) {
  const int64_t channels = in.channels();
  Centres<acc_t> out{std::vector<acc_t>(channels), std::vector<double>(channels)};
  const acc_t* m = saved_mean.const_data_ptr<acc_t>();
  const int64_t stride = in.shape.channels_inner ? 1 : in.shape.inner;  // x[0, c, 0, ...] as channel_shifts
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, in.x.scalar_type(), "ddpkit_syncbn_centres", [&] {
    const scalar_t* x = in.count() == 0 ? nullptr : in.x.const_data_ptr<scalar_t>();
    for (int64_t c = 0; c < channels; ++c) {
      const double mean = (x == nullptr ? 0.0 : static_cast<double>(x[c * stride])) + static_cast<double>(m[c]);
      out.center[c] = static_cast<acc_t>(mean);
      out.offset[c] = mean - static_cast<double>(out.center[c]);
    }
  });
  return out;
}

// The same for any device, as tensors: center (acc dtype) and offset (float64), [C] each.
std::pair<at::Tensor, at::Tensor> centre_tensors(const LocalInput& in, const at::Tensor& saved_mean) {
  const at::Tensor mean = channel_shifts(in) + saved_mean.to(at::kDouble);
  const at::Tensor center = mean.to(acc_dtype(in.x.scalar_type()));
  return {center, mean - center.to(at::kDouble)};
}

// This rank's [Σ dy | Σ dy·(x - mean)] per channel, [2C] in the arithmetic dtype.
at::Tensor grad_sums(const LocalInput& in, const at::Tensor& dy, const at::Tensor& mean) {
  const int64_t channels = in.channels();
  const at::ScalarType dtype = in.x.scalar_type();
  const at::ScalarType acc = acc_dtype(dtype);
  if (native(in.x)) {
    at::Tensor sums = at::empty({2 * channels}, in.x.options().dtype(acc));
    with_acc_type(dtype, [&]<typename acc_t>() {
      const Centres<acc_t> centre = centres<acc_t>(in, mean);
      std::vector<double> s(2 * channels);
      cpu::kernel_table().grad_sums(dtype, in.x.const_data_ptr(), dy.const_data_ptr(), in.shape, centre.center.data(),
                                    s.data(), s.data() + channels);
      // Σ dy·(x - mean) = Σ dy·(x - center) - (mean - center)·Σ dy (Note [Centred arithmetic])
      acc_t* out = sums.mutable_data_ptr<acc_t>();
      for (int64_t c = 0; c < channels; ++c) {
        out[c] = static_cast<acc_t>(s[c]);
        out[channels + c] = static_cast<acc_t>(s[channels + c] - centre.offset[c] * s[c]);
      }
    });
    return sums;
  }
  const int64_t nd = in.x.dim();
  const std::vector<int64_t> dims = reduce_dims(in.x);
  const auto [center, offset] = centre_tensors(in, mean);
  const at::Tensor dyf = dy.to(acc);
  const at::Tensor sum_dy = dyf.sum(dims).to(at::kDouble);
  const at::Tensor sum_dy_xc = (dyf * (in.x.to(acc) - per_channel(center, nd))).sum(dims).to(at::kDouble);
  return at::cat({sum_dy, sum_dy_xc - offset * sum_dy}).to(acc);
}

// grad_weight = invstd·Σ dy·(x - mean), grad_bias = Σ dy from local sums, in `dtype`.
std::pair<at::Tensor, at::Tensor> affine_grads(const at::Tensor& local_sums, const at::Tensor& invstd,
                                               at::ScalarType dtype, bool want_weight, bool want_bias) {
  const int64_t channels = invstd.numel();
  at::Tensor grad_weight, grad_bias;
  if (native(local_sums)) {
    with_acc_type(local_sums.scalar_type(), [&]<typename acc_t>() {
      const acc_t* s = local_sums.const_data_ptr<acc_t>();
      const acc_t* is = invstd.const_data_ptr<acc_t>();
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "ddpkit_syncbn_affine_grads", [&] {
        if (want_weight) {
          grad_weight = at::empty({channels}, local_sums.options().dtype(dtype));
          scalar_t* gw = grad_weight.mutable_data_ptr<scalar_t>();
          for (int64_t c = 0; c < channels; ++c) {
            gw[c] = static_cast<scalar_t>(static_cast<double>(is[c]) * static_cast<double>(s[channels + c]));
          }
        }
        if (want_bias) {
          grad_bias = at::empty({channels}, local_sums.options().dtype(dtype));
          scalar_t* gb = grad_bias.mutable_data_ptr<scalar_t>();
          for (int64_t c = 0; c < channels; ++c) gb[c] = static_cast<scalar_t>(static_cast<double>(s[c]));
        }
      });
    });
    return {grad_weight, grad_bias};
  }
  // Fresh tensors: the caller all-reduces local_sums in place afterwards.
  if (want_weight) grad_weight = (local_sums.narrow(0, channels, channels).to(at::kDouble) * invstd).to(dtype);
  if (want_bias) grad_bias = local_sums.narrow(0, 0, channels).to(dtype, /*non_blocking=*/false, /*copy=*/true);
  return {grad_weight, grad_bias};
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// The passes

void update_running_stats(const RunningStats& running, const at::Tensor& mean, const at::Tensor& var, double count) {
  if (!running.applies(count)) return;
  const at::Tensor& running_mean = running.mean;
  const at::Tensor& running_var = running.var;
  const double momentum = running.momentum;
  const double unbias = count / (count - 1);
  if (native(running_mean) && running_mean.is_contiguous() && running_var.is_contiguous()) {
    const int64_t channels = running_mean.numel();
    const double* m = mean.const_data_ptr<double>();
    const double* v = var.const_data_ptr<double>();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, running_mean.scalar_type(), "ddpkit_syncbn_running", [&] {
      scalar_t* rm = running_mean.mutable_data_ptr<scalar_t>();
      scalar_t* rv = running_var.mutable_data_ptr<scalar_t>();
      for (int64_t c = 0; c < channels; ++c) {
        rm[c] = static_cast<scalar_t>((1 - momentum) * static_cast<double>(rm[c]) + momentum * m[c]);
        rv[c] = static_cast<scalar_t>((1 - momentum) * static_cast<double>(rv[c]) + momentum * v[c] * unbias);
      }
    });
    return;
  }
  running_mean.copy_(running_mean.to(at::kDouble) * (1 - momentum) + mean * momentum);
  running_var.copy_(running_var.to(at::kDouble) * (1 - momentum) + var * (momentum * unbias));
}

BatchStats local_batch_stats(const LocalInput& in, double eps, const RunningStats& running) {
  if (const ElementKernels* k = backend_kernels(in.x)) return k->local_batch_stats(in, eps, running);
  LocalMoments moments = local_moments(in);
  const double count = static_cast<double>(in.count());
  at::Tensor& var = moments.m2;  // M2 / count, in place
  const double inv_count = count > 0 ? 1.0 / count : 0.0;
  if (native(in.x)) {
    double* v = var.mutable_data_ptr<double>();
    for (int64_t c = 0; c < in.channels(); ++c) v[c] *= inv_count;
  } else {
    var.mul_(inv_count);
  }
  update_running_stats(running, moments.mean, var, count);
  return saved_stats(in, moments.mean, var, eps, count);
}

at::Tensor packed_moments(const LocalInput& in) {
  if (const ElementKernels* k = backend_kernels(in.x)) return k->packed_moments(in);
  return pack_moments(local_moments(in), in.count());
}

BatchStats stats_from_packed(const LocalInput& in, const at::Tensor& packed, double eps, const RunningStats& running) {
  if (const ElementKernels* k = backend_kernels(in.x)) return k->stats_from_packed(in, packed, eps, running);
  const auto [mean, var] = summed_moments(packed);
  const double count =
      native(packed) ? packed.const_data_ptr<double>()[packed.numel() - 1] : packed[packed.numel() - 1].item<double>();
  update_running_stats(running, mean, var, count);
  return saved_stats(in, mean, var, eps, count);
}

BatchStats stats_from_running(const LocalInput& in, const at::Tensor& running_mean, const at::Tensor& running_var,
                              double eps) {
  const at::ScalarType acc = acc_dtype(in.x.scalar_type());
  return BatchStats{(running_mean.to(at::kDouble) - channel_shifts(in)).to(acc),
                    (running_var.to(at::kDouble) + eps).rsqrt().to(acc), 0.0};
}

at::Tensor normalize(const LocalInput& in, const at::Tensor& mean, const at::Tensor& invstd, const at::Tensor& weight,
                     const at::Tensor& bias) {
  if (const ElementKernels* k = backend_kernels(in.x)) return k->normalize(in, mean, invstd, weight, bias);
  const int64_t channels = in.channels();
  const at::ScalarType dtype = in.x.scalar_type();
  if (native(in.x)) {
    at::Tensor y = at::empty_like(in.x);
    const std::vector<double> w = to_doubles(weight, channels, 1.0), b = to_doubles(bias, channels, 0.0);
    with_acc_type(dtype, [&]<typename acc_t>() {
      const acc_t* s = invstd.const_data_ptr<acc_t>();
      const Centres<acc_t> centre = centres<acc_t>(in, mean);
      std::vector<acc_t> k(3 * channels);  // center | scale | offset
      for (int64_t c = 0; c < channels; ++c) {
        const double scale = w[c] * static_cast<double>(s[c]);
        k[c] = centre.center[c];
        k[channels + c] = static_cast<acc_t>(scale);
        k[2 * channels + c] = static_cast<acc_t>(b[c] - centre.offset[c] * scale);
      }
      cpu::kernel_table().normalize(dtype, in.x.const_data_ptr(), y.mutable_data_ptr(), in.shape, k.data());
    });
    return y;
  }
  const at::ScalarType acc = acc_dtype(dtype);
  const int64_t nd = in.x.dim();
  const auto [center, centre_offset] = centre_tensors(in, mean);
  const at::Tensor scale = weight.defined() ? invstd.to(at::kDouble) * weight.to(at::kDouble) : invstd.to(at::kDouble);
  at::Tensor offset = -centre_offset * scale;
  if (bias.defined()) offset = offset + bias.to(at::kDouble);
  const at::Tensor y = at::addcmul(per_channel(offset.to(acc), nd), in.x.to(acc) - per_channel(center, nd),
                                   per_channel(scale.to(acc), nd));
  return y.to(dtype);
}

Normalized normalize_local(const LocalInput& in, double eps, const RunningStats& running, const at::Tensor& weight,
                           const at::Tensor& bias) {
  if (const ElementKernels* k = backend_kernels(in.x)) return k->normalize_local(in, eps, running, weight, bias);
  BatchStats stats = local_batch_stats(in, eps, running);
  at::Tensor output = normalize(in, stats.mean, stats.invstd, weight, bias);
  return Normalized{std::move(output), std::move(stats)};
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
    const std::vector<double> w = to_doubles(weight, channels, 1.0);
    with_acc_type(dtype, [&]<typename acc_t>() {
      const acc_t* s = invstd.const_data_ptr<acc_t>();
      const acc_t* g = sums.const_data_ptr<acc_t>();
      const Centres<acc_t> centre = centres<acc_t>(in, mean);
      std::vector<acc_t> k(4 * channels);  // center | k | q | r
      for (int64_t c = 0; c < channels; ++c) {
        const double sc = static_cast<double>(s[c]);
        const double kc = w[c] * sc;
        const double q = -kc * sc * sc * static_cast<double>(g[channels + c]) * inv_count;
        k[c] = centre.center[c];
        k[channels + c] = static_cast<acc_t>(kc);
        k[2 * channels + c] = static_cast<acc_t>(q);
        k[3 * channels + c] = static_cast<acc_t>(-kc * static_cast<double>(g[c]) * inv_count - q * centre.offset[c]);
      }
      cpu::kernel_table().grad_input(dtype, in.x.const_data_ptr(), dy.const_data_ptr(), dx.mutable_data_ptr(), in.shape,
                                     k.data());
    });
    return dx;
  }
  const at::ScalarType acc = acc_dtype(dtype);
  const int64_t nd = in.x.dim();
  const auto [center, offset] = centre_tensors(in, mean);
  const at::Tensor s = invstd.to(at::kDouble), g = sums.to(at::kDouble);
  const at::Tensor k = weight.defined() ? s * weight.to(at::kDouble) : s;
  const at::Tensor q = -k * s * s * g.narrow(0, channels, channels) * inv_count;
  const at::Tensor r = -k * g.narrow(0, 0, channels) * inv_count - q * offset;
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
    const std::vector<double> w = to_doubles(weight, channels, 1.0);
    with_acc_type(dtype, [&]<typename acc_t>() {
      const acc_t* s = invstd.const_data_ptr<acc_t>();
      std::vector<acc_t> k(4 * channels, acc_t(0));  // center | k | q | r, only k is non-zero
      for (int64_t c = 0; c < channels; ++c) k[channels + c] = static_cast<acc_t>(w[c] * static_cast<double>(s[c]));
      cpu::kernel_table().grad_input(dtype, nullptr, dy.const_data_ptr(), dx.mutable_data_ptr(), in.shape, k.data());
    });
    return dx;
  }
  const at::Tensor k = weight.defined() ? invstd.to(at::kDouble) * weight.to(at::kDouble) : invstd.to(at::kDouble);
  const at::ScalarType acc = acc_dtype(dtype);
  return (dy.to(acc) * per_channel(k.to(acc), in.x.dim())).to(dtype);
}

std::array<at::Tensor, 3> backward_local(const LocalInput& in, const at::Tensor& dy, const at::Tensor& mean,
                                         const at::Tensor& invstd, const at::Tensor& weight, at::ScalarType dtype,
                                         std::array<bool, 3> output_mask) {
  if (const ElementKernels* k = backend_kernels(in.x)) {
    return k->backward_local(in, dy, mean, invstd, weight, dtype, output_mask);
  }
  const auto [want_input, want_weight, want_bias] = output_mask;
  LocalGradSums local = local_grad_sums(in, dy, mean, invstd, dtype, want_weight, want_bias);
  at::Tensor grad_input;
  if (want_input) {
    grad_input = grad_input_training(in, dy, mean, invstd, weight, local.sums, static_cast<double>(in.count()));
  }
  return {grad_input, local.grad_weight, local.grad_bias};
}

}  // namespace ddpkit::syncbn
