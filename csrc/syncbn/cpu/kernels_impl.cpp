// The passes of syncbn/cpu/kernels.h for one CPU capability. This file is compiled once per
// capability with CPU_CAPABILITY set to its name (Note [CPU capabilities]); at::vec::Vectorized
// then has the width of that instruction set (the default build uses the portable 32-byte one).

#include "syncbn/cpu/kernels.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <vector>

#ifndef CPU_CAPABILITY
#error "kernels_impl.cpp is compiled once per CPU capability with -DCPU_CAPABILITY=<name> (see CMakeLists.txt)"
#endif

namespace ddpkit::syncbn::cpu::CPU_CAPABILITY {
namespace {

using at::vec::Vectorized;

// Values per block of Note [Stable moments]: 16 KiB of float32, in L1 for the second pass.
constexpr int64_t kBlock = 4096;
// Elements below which a pass stays on the calling thread (ATen's own GRAIN_SIZE).
constexpr int64_t kGrain = 32768;
// Channel vectors processed together in channels-inner passes: independent accumulators for the
// adder's latency, and few enough to stay in registers.
constexpr int kTileSteps = 4;

int64_t divup(int64_t a, int64_t b) { return (a + b - 1) / b; }

// One step of a pass loads kStep elements as kPieces vectors of acc_t: float32 and float64 in
// place, float16 and bfloat16 widened to two float32 vectors.
template <typename scalar_t>
struct Io {
  using acc_t = scalar_t;
  using Vec = Vectorized<acc_t>;
  static constexpr int kPieces = 1;
  static constexpr int64_t kStep = Vec::size();
  static void load(const scalar_t* p, Vec* v) { v[0] = Vec::loadu(p); }
  static void store(scalar_t* p, const Vec* v) { v[0].store(p); }
};

template <typename scalar_t>
struct ReducedIo {
  using acc_t = float;
  using Vec = Vectorized<float>;
  static constexpr int kPieces = 2;
  static constexpr int64_t kStep = Vectorized<scalar_t>::size();
  static_assert(kStep == kPieces * Vec::size());
  static void load(const scalar_t* p, Vec* v) {
    auto [low, high] = at::vec::convert_to_float<scalar_t>(Vectorized<scalar_t>::loadu(p));
    v[0] = low;
    v[1] = high;
  }
  static void store(scalar_t* p, const Vec* v) { at::vec::convert_from_float<scalar_t>(v[0], v[1]).store(p); }
};
template <>
struct Io<c10::Half> : ReducedIo<c10::Half> {};
template <>
struct Io<c10::BFloat16> : ReducedIo<c10::BFloat16> {};

template <typename scalar_t>
using acc_t = typename Io<scalar_t>::acc_t;

template <typename T>
T horizontal_sum(const Vectorized<T>& v) {
  return at::vec::vec_reduce_all<T>([](Vectorized<T>& a, Vectorized<T>& b) { return a + b; }, v);
}

// Count, mean and centred sum of squares of one channel, merged block by block (Chan et al.).
struct Moments {
  double n = 0, mean = 0, m2 = 0;

  void merge(double n_b, double mean_b, double m2_b) {
    if (n_b == 0) return;
    const double total = n + n_b;
    const double delta = mean_b - mean;
    mean += delta * (n_b / total);
    m2 += m2_b + delta * delta * (n * n_b / total);
    n = total;
  }

  // A block of n_b values with d1 = Σ(x - c), d2 = Σ(x - c)² around its centre c.
  void merge_block(double n_b, double c, double d1, double d2) {
    merge(n_b, c + d1 / n_b, std::max(0.0, d2 - d1 * d1 / n_b));
  }
};

// The same merge for `width` channels that share the count `n` (channels-inner blocks).
template <typename acc>
void merge_blocks(double n, double n_b, int64_t width, const acc* center, const acc* d1, const acc* d2, double* mean,
                  double* m2) {
  const double total = n + n_b;
  for (int64_t i = 0; i < width; ++i) {
    const double block_mean = center[i] + d1[i] / n_b;
    const double block_m2 = std::max(0.0, static_cast<double>(d2[i]) - static_cast<double>(d1[i]) * d1[i] / n_b);
    const double delta = block_mean - mean[i];
    mean[i] += delta * (n_b / total);
    m2[i] += block_m2 + delta * delta * (n * n_b / total);
  }
}

// ---------------------------------------------------------------------------------------------
// Planar passes: runs of contiguous values of one channel.

template <typename scalar_t>
acc_t<scalar_t> run_sum(const scalar_t* p, int64_t len) {
  using IO = Io<scalar_t>;
  using Vec = typename IO::Vec;
  Vec sum[2 * IO::kPieces];
  for (auto& s : sum) s = Vec(0);
  Vec v[IO::kPieces];
  int64_t i = 0;
  for (; i + 2 * IO::kStep <= len; i += 2 * IO::kStep) {
    IO::load(p + i, v);
    for (int j = 0; j < IO::kPieces; ++j) sum[j] += v[j];
    IO::load(p + i + IO::kStep, v);
    for (int j = 0; j < IO::kPieces; ++j) sum[IO::kPieces + j] += v[j];
  }
  for (; i + IO::kStep <= len; i += IO::kStep) {
    IO::load(p + i, v);
    for (int j = 0; j < IO::kPieces; ++j) sum[j] += v[j];
  }
  acc_t<scalar_t> total = 0;
  for (const auto& s : sum) total += horizontal_sum(s);
  for (; i < len; ++i) total += static_cast<acc_t<scalar_t>>(p[i]);
  return total;
}

// d1 += Σ(x - c), d2 += Σ(x - c)² over p[0, len).
template <typename scalar_t>
void run_deviations(const scalar_t* p, int64_t len, acc_t<scalar_t> c, acc_t<scalar_t>& d1, acc_t<scalar_t>& d2) {
  using IO = Io<scalar_t>;
  using Vec = typename IO::Vec;
  const Vec center(c);
  Vec s1[IO::kPieces], s2[IO::kPieces];
  for (int j = 0; j < IO::kPieces; ++j) s1[j] = s2[j] = Vec(0);
  Vec v[IO::kPieces];
  int64_t i = 0;
  for (; i + IO::kStep <= len; i += IO::kStep) {
    IO::load(p + i, v);
    for (int j = 0; j < IO::kPieces; ++j) {
      const Vec d = v[j] - center;
      s1[j] += d;
      s2[j] = at::vec::fmadd(d, d, s2[j]);
    }
  }
  for (int j = 0; j < IO::kPieces; ++j) {
    d1 += horizontal_sum(s1[j]);
    d2 += horizontal_sum(s2[j]);
  }
  for (; i < len; ++i) {
    const acc_t<scalar_t> d = static_cast<acc_t<scalar_t>>(p[i]) - c;
    d1 += d;
    d2 += d * d;
  }
}

// Channel by channel (parallel over channels); a block is a piece of one plane when planes are
// large, else several whole planes of the channel.
template <typename scalar_t>
void planar_moments(const scalar_t* x, const Shape& s, double* mean, double* m2) {
  using acc = acc_t<scalar_t>;
  const int64_t channels = s.channels, inner = s.inner, outer = s.outer;
  const int64_t run = std::min(inner, kBlock);
  const int64_t planes_per_block = std::max<int64_t>(1, kBlock / inner);
  at::parallel_for(0, channels, std::max<int64_t>(1, kGrain / s.count()), [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      Moments moments;
      for (int64_t n0 = 0; n0 < outer; n0 += planes_per_block) {
        const int64_t n1 = std::min(outer, n0 + planes_per_block);
        for (int64_t begin = 0; begin < inner; begin += run) {
          const int64_t len = std::min(run, inner - begin);
          acc sum = 0;
          for (int64_t n = n0; n < n1; ++n) sum += run_sum(x + (n * channels + c) * inner + begin, len);
          const double count = static_cast<double>((n1 - n0) * len);
          const acc center = static_cast<acc>(sum / count);
          acc d1 = 0, d2 = 0;
          for (int64_t n = n0; n < n1; ++n) run_deviations(x + (n * channels + c) * inner + begin, len, center, d1, d2);
          moments.merge_block(count, center, d1, d2);
        }
      }
      mean[c] = moments.mean;
      m2[c] = moments.m2;
    }
  });
}

// Σ dy and Σ dy · (x - c) over a run, in acc_t.
template <typename scalar_t>
void run_grad_sums(const scalar_t* x, const scalar_t* dy, int64_t len, acc_t<scalar_t> c, acc_t<scalar_t>& sum_dy,
                   acc_t<scalar_t>& sum_dy_xc) {
  using IO = Io<scalar_t>;
  using Vec = typename IO::Vec;
  const Vec center(c);
  Vec a[IO::kPieces], b[IO::kPieces];
  for (int j = 0; j < IO::kPieces; ++j) a[j] = b[j] = Vec(0);
  Vec vx[IO::kPieces], vdy[IO::kPieces];
  int64_t i = 0;
  for (; i + IO::kStep <= len; i += IO::kStep) {
    IO::load(x + i, vx);
    IO::load(dy + i, vdy);
    for (int j = 0; j < IO::kPieces; ++j) {
      a[j] += vdy[j];
      b[j] = at::vec::fmadd(vdy[j], vx[j] - center, b[j]);
    }
  }
  for (int j = 0; j < IO::kPieces; ++j) {
    sum_dy += horizontal_sum(a[j]);
    sum_dy_xc += horizontal_sum(b[j]);
  }
  for (; i < len; ++i) {
    const acc_t<scalar_t> g = static_cast<acc_t<scalar_t>>(dy[i]);
    sum_dy += g;
    sum_dy_xc += g * (static_cast<acc_t<scalar_t>>(x[i]) - c);
  }
}

template <typename scalar_t>
void planar_grad_sums(const scalar_t* x, const scalar_t* dy, const Shape& s, const acc_t<scalar_t>* center,
                      double* sum_dy, double* sum_dy_xc) {
  using acc = acc_t<scalar_t>;
  const int64_t channels = s.channels, inner = s.inner;
  at::parallel_for(0, channels, std::max<int64_t>(1, kGrain / s.count()), [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      double total_dy = 0, total_dy_xc = 0;
      for (int64_t n = 0; n < s.outer; ++n) {
        const int64_t base = (n * channels + c) * inner;
        for (int64_t begin = 0; begin < inner; begin += kBlock) {
          acc a = 0, b = 0;
          run_grad_sums(x + base + begin, dy + base + begin, std::min(kBlock, inner - begin), center[c], a, b);
          total_dy += a;
          total_dy_xc += b;
        }
      }
      sum_dy[c] = total_dy;
      sum_dy_xc[c] = total_dy_xc;
    }
  });
}

// out = a * k + (x - center) * q + r on a run of one channel; the terms a pass does not have are
// compiled out (see affine below).
template <typename scalar_t, bool kHasX, bool kHasA>
void run_affine(const scalar_t* x, const scalar_t* a, scalar_t* out, int64_t len, acc_t<scalar_t> center,
                acc_t<scalar_t> k, acc_t<scalar_t> q, acc_t<scalar_t> r) {
  using IO = Io<scalar_t>;
  using Vec = typename IO::Vec;
  using acc = acc_t<scalar_t>;
  const Vec vc(center), vk(k), vq(q), vr(r);
  Vec vx[IO::kPieces], va[IO::kPieces];
  int64_t i = 0;
  for (; i + IO::kStep <= len; i += IO::kStep) {
    if constexpr (kHasX) IO::load(x + i, vx);
    if constexpr (kHasA) IO::load(a + i, va);
    for (int j = 0; j < IO::kPieces; ++j) {
      Vec y = vr;
      if constexpr (kHasX) y = at::vec::fmadd(vx[j] - vc, vq, y);
      if constexpr (kHasA) y = at::vec::fmadd(va[j], vk, y);
      vx[j] = y;
    }
    IO::store(out + i, vx);
  }
  for (; i < len; ++i) {
    acc y = r;
    if constexpr (kHasX) y = std::fma(static_cast<acc>(x[i]) - center, q, y);
    if constexpr (kHasA) y = std::fma(static_cast<acc>(a[i]), k, y);
    out[i] = static_cast<scalar_t>(y);
  }
}

// ---------------------------------------------------------------------------------------------
// Channels-inner passes: rows of `channels` values, vector lanes across channels.

// Moments of channels [c0, c0 + T * kStep) over rows [r0, r1): centre, d1, d2 per channel.
template <int T, typename scalar_t>
void tile_moments(const scalar_t* x, int64_t channels, int64_t r0, int64_t r1, int64_t c0, acc_t<scalar_t>* center,
                  acc_t<scalar_t>* d1, acc_t<scalar_t>* d2) {
  using IO = Io<scalar_t>;
  using Vec = typename IO::Vec;
  constexpr int kVecs = T * IO::kPieces;
  Vec c[kVecs], s1[kVecs], s2[kVecs], v[IO::kPieces];
  for (int i = 0; i < kVecs; ++i) c[i] = s1[i] = s2[i] = Vec(0);
  for (int64_t r = r0; r < r1; ++r) {
    const scalar_t* row = x + r * channels + c0;
    for (int t = 0; t < T; ++t) {
      IO::load(row + t * IO::kStep, v);
      for (int j = 0; j < IO::kPieces; ++j) c[t * IO::kPieces + j] += v[j];
    }
  }
  const Vec inv_len(acc_t<scalar_t>(1) / static_cast<acc_t<scalar_t>>(r1 - r0));
  for (auto& ci : c) ci = ci * inv_len;
  for (int64_t r = r0; r < r1; ++r) {
    const scalar_t* row = x + r * channels + c0;
    for (int t = 0; t < T; ++t) {
      IO::load(row + t * IO::kStep, v);
      for (int j = 0; j < IO::kPieces; ++j) {
        const int i = t * IO::kPieces + j;
        const Vec d = v[j] - c[i];
        s1[i] += d;
        s2[i] = at::vec::fmadd(d, d, s2[i]);
      }
    }
  }
  for (int i = 0; i < kVecs; ++i) {
    c[i].store(center + i * Vec::size());
    s1[i].store(d1 + i * Vec::size());
    s2[i].store(d2 + i * Vec::size());
  }
}

// Rows per block of a channels-inner pass: about kBlock values per channel tile, and at least
// one block per thread, so that a batch of few wide rows still spreads over the threads.
int64_t rows_per_block(int64_t rows, int64_t channels, int64_t tile, int threads) {
  return std::max<int64_t>(1, std::min(kBlock / std::min(channels, tile), divup(rows, threads)));
}

// Rows are cut into blocks (rows_per_block); threads take contiguous ranges of blocks and keep
// their own per-channel moments, merged at the end.
template <typename scalar_t>
void rows_moments(const scalar_t* x, const Shape& s, double* mean, double* m2) {
  using IO = Io<scalar_t>;
  using acc = acc_t<scalar_t>;
  const int64_t channels = s.channels, rows = s.outer;
  constexpr int64_t kTile = kTileSteps * IO::kStep;
  const int threads = at::get_num_threads();
  const int64_t block_rows = rows_per_block(rows, channels, kTile, threads);
  const int64_t blocks = divup(rows, block_rows);
  std::vector<double> slot_n(threads, 0.0);
  std::vector<double> slots(static_cast<size_t>(threads) * 2 * channels, 0.0);
  at::parallel_for(0, blocks, std::max<int64_t>(1, kGrain / (block_rows * channels)), [&](int64_t b0, int64_t b1) {
    const int tid = at::get_thread_num();
    double* t_mean = slots.data() + static_cast<size_t>(tid) * 2 * channels;
    double* t_m2 = t_mean + channels;
    double& t_n = slot_n[tid];
    acc center[kTile], d1[kTile], d2[kTile];
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t r0 = b * block_rows, r1 = std::min(rows, r0 + block_rows);
      const double len = static_cast<double>(r1 - r0);
      int64_t c = 0;
      for (; c + kTile <= channels; c += kTile) {
        tile_moments<kTileSteps>(x, channels, r0, r1, c, center, d1, d2);
        merge_blocks(t_n, len, kTile, center, d1, d2, t_mean + c, t_m2 + c);
      }
      for (; c + IO::kStep <= channels; c += IO::kStep) {
        tile_moments<1>(x, channels, r0, r1, c, center, d1, d2);
        merge_blocks(t_n, len, IO::kStep, center, d1, d2, t_mean + c, t_m2 + c);
      }
      for (; c < channels; ++c) {
        acc sum = 0;
        for (int64_t r = r0; r < r1; ++r) sum += static_cast<acc>(x[r * channels + c]);
        center[0] = static_cast<acc>(sum / len);
        d1[0] = d2[0] = 0;
        for (int64_t r = r0; r < r1; ++r) {
          const acc d = static_cast<acc>(x[r * channels + c]) - center[0];
          d1[0] += d;
          d2[0] += d * d;
        }
        merge_blocks(t_n, len, 1, center, d1, d2, t_mean + c, t_m2 + c);
      }
      t_n += len;
    }
  });
  std::fill(mean, mean + channels, 0.0);
  std::fill(m2, m2 + channels, 0.0);
  double n = 0;
  for (int t = 0; t < threads; ++t) {
    const double n_t = slot_n[t];
    if (n_t == 0) continue;
    const double total = n + n_t;
    const double* t_mean = slots.data() + static_cast<size_t>(t) * 2 * channels;
    const double* t_m2 = t_mean + channels;
    for (int64_t c = 0; c < channels; ++c) {
      const double delta = t_mean[c] - mean[c];
      mean[c] += delta * (n_t / total);
      m2[c] += t_m2[c] + delta * delta * (n * n_t / total);
    }
    n = total;
  }
}

template <int T, typename scalar_t>
void tile_grad_sums(const scalar_t* x, const scalar_t* dy, int64_t channels, int64_t r0, int64_t r1, int64_t c0,
                    const acc_t<scalar_t>* center, double* sum_dy, double* sum_dy_xc) {
  using IO = Io<scalar_t>;
  using Vec = typename IO::Vec;
  constexpr int kVecs = T * IO::kPieces;
  Vec c[kVecs], a[kVecs], b[kVecs], vx[IO::kPieces], vdy[IO::kPieces];
  for (int i = 0; i < kVecs; ++i) {
    c[i] = Vec::loadu(center + c0 + i * Vec::size());
    a[i] = b[i] = Vec(0);
  }
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t offset = r * channels + c0;
    for (int t = 0; t < T; ++t) {
      IO::load(x + offset + t * IO::kStep, vx);
      IO::load(dy + offset + t * IO::kStep, vdy);
      for (int j = 0; j < IO::kPieces; ++j) {
        const int i = t * IO::kPieces + j;
        a[i] += vdy[j];
        b[i] = at::vec::fmadd(vdy[j], vx[j] - c[i], b[i]);
      }
    }
  }
  acc_t<scalar_t> a_out[Vec::size()], b_out[Vec::size()];
  for (int i = 0; i < kVecs; ++i) {
    a[i].store(a_out);
    b[i].store(b_out);
    for (int64_t l = 0; l < Vec::size(); ++l) {
      sum_dy[c0 + i * Vec::size() + l] += a_out[l];
      sum_dy_xc[c0 + i * Vec::size() + l] += b_out[l];
    }
  }
}

template <typename scalar_t>
void rows_grad_sums(const scalar_t* x, const scalar_t* dy, const Shape& s, const acc_t<scalar_t>* center,
                    double* sum_dy, double* sum_dy_xc) {
  using IO = Io<scalar_t>;
  using acc = acc_t<scalar_t>;
  const int64_t channels = s.channels, rows = s.outer;
  constexpr int64_t kTile = kTileSteps * IO::kStep;
  const int threads = at::get_num_threads();
  const int64_t block_rows = rows_per_block(rows, channels, kTile, threads);
  const int64_t blocks = divup(rows, block_rows);
  std::vector<double> slots(static_cast<size_t>(threads) * 2 * channels, 0.0);
  at::parallel_for(0, blocks, std::max<int64_t>(1, kGrain / (block_rows * channels)), [&](int64_t b0, int64_t b1) {
    double* t_dy = slots.data() + static_cast<size_t>(at::get_thread_num()) * 2 * channels;
    double* t_dy_xc = t_dy + channels;
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t r0 = b * block_rows, r1 = std::min(rows, r0 + block_rows);
      int64_t c = 0;
      for (; c + kTile <= channels; c += kTile)
        tile_grad_sums<kTileSteps>(x, dy, channels, r0, r1, c, center, t_dy, t_dy_xc);
      for (; c + IO::kStep <= channels; c += IO::kStep)
        tile_grad_sums<1>(x, dy, channels, r0, r1, c, center, t_dy, t_dy_xc);
      for (; c < channels; ++c) {
        acc a = 0, bsum = 0;
        for (int64_t r = r0; r < r1; ++r) {
          const acc g = static_cast<acc>(dy[r * channels + c]);
          a += g;
          bsum += g * (static_cast<acc>(x[r * channels + c]) - center[c]);
        }
        t_dy[c] += a;
        t_dy_xc[c] += bsum;
      }
    }
  });
  std::copy(slots.begin(), slots.begin() + channels, sum_dy);
  std::copy(slots.begin() + channels, slots.begin() + 2 * channels, sum_dy_xc);
  for (int t = 1; t < threads; ++t) {
    const double* t_dy = slots.data() + static_cast<size_t>(t) * 2 * channels;
    for (int64_t c = 0; c < channels; ++c) {
      sum_dy[c] += t_dy[c];
      sum_dy_xc[c] += t_dy[channels + c];
    }
  }
}

// out = a * k[c] + (x - center[c]) * q[c] + r[c] over rows; per-channel constants are vector loads.
template <typename scalar_t, bool kHasX, bool kHasA>
void rows_affine(const scalar_t* x, const scalar_t* a, scalar_t* out, const Shape& s, const acc_t<scalar_t>* center,
                 const acc_t<scalar_t>* k, const acc_t<scalar_t>* q, const acc_t<scalar_t>* r) {
  using IO = Io<scalar_t>;
  using Vec = typename IO::Vec;
  using acc = acc_t<scalar_t>;
  const int64_t channels = s.channels;
  at::parallel_for(0, s.outer, std::max<int64_t>(1, kGrain / channels), [&](int64_t r0, int64_t r1) {
    Vec vx[IO::kPieces], va[IO::kPieces];
    for (int64_t row = r0; row < r1; ++row) {
      const int64_t base = row * channels;
      int64_t c = 0;
      for (; c + IO::kStep <= channels; c += IO::kStep) {
        if constexpr (kHasX) IO::load(x + base + c, vx);
        if constexpr (kHasA) IO::load(a + base + c, va);
        for (int j = 0; j < IO::kPieces; ++j) {
          const int64_t o = c + j * Vec::size();
          Vec y = Vec::loadu(r + o);
          if constexpr (kHasX) y = at::vec::fmadd(vx[j] - Vec::loadu(center + o), Vec::loadu(q + o), y);
          if constexpr (kHasA) y = at::vec::fmadd(va[j], Vec::loadu(k + o), y);
          vx[j] = y;
        }
        IO::store(out + base + c, vx);
      }
      for (; c < channels; ++c) {
        acc y = r[c];
        if constexpr (kHasX) y = std::fma(static_cast<acc>(x[base + c]) - center[c], q[c], y);
        if constexpr (kHasA) y = std::fma(static_cast<acc>(a[base + c]), k[c], y);
        out[base + c] = static_cast<scalar_t>(y);
      }
    }
  });
}

template <typename scalar_t, bool kHasX, bool kHasA>
void planar_affine(const scalar_t* x, const scalar_t* a, scalar_t* out, const Shape& s, const acc_t<scalar_t>* center,
                   const acc_t<scalar_t>* k, const acc_t<scalar_t>* q, const acc_t<scalar_t>* r) {
  const int64_t channels = s.channels, inner = s.inner;
  at::parallel_for(0, s.outer * channels, std::max<int64_t>(1, kGrain / inner), [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t c = p % channels;
      const int64_t base = p * inner;
      run_affine<scalar_t, kHasX, kHasA>(kHasX ? x + base : nullptr, kHasA ? a + base : nullptr, out + base, inner,
                                         kHasX ? center[c] : 0, kHasA ? k[c] : 0, kHasX ? q[c] : 0, r[c]);
    }
  });
}

// out = a * k + (x - center) * q + r per channel, in either layout. Normalisation is the case
// without `a` (q = scale, r = offset); the input gradient has both, or only `a` in eval mode.
template <typename scalar_t, bool kHasX, bool kHasA>
void affine(const scalar_t* x, const scalar_t* a, scalar_t* out, const Shape& s, const acc_t<scalar_t>* center,
            const acc_t<scalar_t>* k, const acc_t<scalar_t>* q, const acc_t<scalar_t>* r) {
  if (s.channels_inner) {
    rows_affine<scalar_t, kHasX, kHasA>(x, a, out, s, center, k, q, r);
  } else {
    planar_affine<scalar_t, kHasX, kHasA>(x, a, out, s, center, k, q, r);
  }
}

// ---------------------------------------------------------------------------------------------
// The table's entries.

void moments(c10::ScalarType dtype, const void* x, const Shape& s, double* mean, double* m2) {
  if (s.count() == 0) {
    std::fill(mean, mean + s.channels, 0.0);
    std::fill(m2, m2 + s.channels, 0.0);
    return;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "ddpkit_syncbn_moments", [&] {
    const auto* p = static_cast<const scalar_t*>(x);
    if (s.channels_inner) {
      rows_moments(p, s, mean, m2);
    } else {
      planar_moments(p, s, mean, m2);
    }
  });
}

void normalize(c10::ScalarType dtype, const void* x, void* y, const Shape& s, const void* constants) {
  if (s.count() == 0) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "ddpkit_syncbn_normalize", [&] {
    const auto* k = static_cast<const acc_t<scalar_t>*>(constants);
    const int64_t c = s.channels;
    // y = (x - center) * scale + offset: the affine pass with q = scale, r = offset and no `a`.
    affine<scalar_t, true, false>(static_cast<const scalar_t*>(x), nullptr, static_cast<scalar_t*>(y), s, k, nullptr,
                                  k + c, k + 2 * c);
  });
}

void grad_sums(c10::ScalarType dtype, const void* x, const void* dy, const Shape& s, const void* center, double* sum_dy,
               double* sum_dy_xc) {
  if (s.count() == 0) {
    std::fill(sum_dy, sum_dy + s.channels, 0.0);
    std::fill(sum_dy_xc, sum_dy_xc + s.channels, 0.0);
    return;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "ddpkit_syncbn_grad_sums", [&] {
    const auto* px = static_cast<const scalar_t*>(x);
    const auto* pdy = static_cast<const scalar_t*>(dy);
    const auto* pc = static_cast<const acc_t<scalar_t>*>(center);
    if (s.channels_inner) {
      rows_grad_sums(px, pdy, s, pc, sum_dy, sum_dy_xc);
    } else {
      planar_grad_sums(px, pdy, s, pc, sum_dy, sum_dy_xc);
    }
  });
}

void grad_input(c10::ScalarType dtype, const void* x, const void* dy, void* dx, const Shape& s, const void* constants) {
  if (s.count() == 0) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "ddpkit_syncbn_grad_input", [&] {
    const auto* k = static_cast<const acc_t<scalar_t>*>(constants);
    const int64_t c = s.channels;
    const auto* pdy = static_cast<const scalar_t*>(dy);
    auto* pdx = static_cast<scalar_t*>(dx);
    if (x != nullptr) {
      affine<scalar_t, true, true>(static_cast<const scalar_t*>(x), pdy, pdx, s, k, k + c, k + 2 * c, k + 3 * c);
    } else {
      affine<scalar_t, false, true>(nullptr, pdy, pdx, s, k, k + c, k + 2 * c, k + 3 * c);
    }
  });
}

}  // namespace

const KernelTable& kernel_table() {
  static const KernelTable table{&moments, &normalize, &grad_sums, &grad_input};
  return table;
}

}  // namespace ddpkit::syncbn::cpu::CPU_CAPABILITY
