#pragma once
// SyncBatchNorm's per-element passes on CPU: raw pointers in, per-channel float64 sums out. No
// communication, no tensor allocation, no error checking (the callers in syncbn/kernels.cpp have
// validated shapes and dtypes). Each pass is parallelised with at::parallel_for over the calling
// thread's intra-op pool and returns when it is done.
//
// Element dtypes: float32, float64, float16, bfloat16. The arithmetic type `acc_t` is float64 for
// float64 elements and float32 otherwise; per-channel constants are arrays of acc_t.

#include <c10/core/ScalarType.h>

#include <cstdint>

namespace ddpkit::syncbn::cpu {

// Note [CPU layouts]
// Two memory layouts cover every input the kernels read:
//  - channels-inner: `outer` rows of `channels` contiguous elements (row r, channel c at
//    r * channels + c). A 2-D (N, C) input and channels_last 4-D/5-D inputs are this layout, with
//    N (times the spatial size) rows. Vector lanes run across channels; passes are split by rows.
//  - planar: `outer` = N groups of `channels` planes of `inner` contiguous elements (sample n,
//    channel c, position s at (n * channels + c) * inner + s), the default (N, C, *spatial)
//    contiguous layout. Vector lanes run along a plane; passes are split by channels or planes.
// Everything else is copied into one of these by the caller.
struct Shape {
  bool channels_inner = false;
  int64_t outer = 0;
  int64_t channels = 0;
  int64_t inner = 1;                               // 1 for channels-inner
  int64_t count() const { return outer * inner; }  // values per channel
};

// Note [Stable moments]
// The forward statistics must stay accurate for inputs whose mean is large against their spread
// (1e4 + N(0,1) in float32: a float32 sum of squares has no correct digit left). The kernels cut
// each channel into blocks of at most a few thousand values that stay in L1/L2: a first pass
// sums a block in acc_t, giving a centre c; a second pass over the cached block accumulates
// d1 = Σ(x - c) and d2 = Σ(x - c)², so the block mean c + d1/n and centred sum d2 - d1²/n are exact
// up to rounding of values of the size of the spread, even where c itself is rounded. Blocks are
// then merged in float64 with Chan's pairwise formula. Memory is read once; the second pass hits
// the cache.

struct KernelTable {
  // mean[c], m2[c] = mean and centred sum of squares Σ(x - mean)² of channel c (Note [Stable
  // moments]); zeros for an empty input. mean and m2 hold `channels` float64 each.
  void (*moments)(c10::ScalarType dtype, const void* x, const Shape& shape, double* mean, double* m2);

  // y = (x - center[c]) * scale[c] + offset[c]. `constants` holds 3 * channels acc_t values:
  // center, scale, offset. y has x's shape and layout.
  void (*normalize)(c10::ScalarType dtype, const void* x, void* y, const Shape& shape, const void* constants);

  // sum_dy[c] = Σ dy and sum_dy_xc[c] = Σ dy · (x - center[c]) in float64; `center` holds
  // `channels` acc_t values. dy has x's shape and layout.
  void (*grad_sums)(c10::ScalarType dtype, const void* x, const void* dy, const Shape& shape, const void* center,
                    double* sum_dy, double* sum_dy_xc);

  // dx = dy * k[c] + (x - center[c]) * q[c] + r[c]. `constants` holds 4 * channels acc_t values:
  // center, k, q, r. With x == nullptr the (x - center) term is dropped (q must then be 0) and
  // x is never read.
  void (*grad_input)(c10::ScalarType dtype, const void* x, const void* dy, void* dx, const Shape& shape,
                     const void* constants);
};

// Note [CPU capabilities]
// kernels_impl.cpp is compiled once per instruction set torch dispatches to (DEFAULT and, on x86-64,
// AVX2 and AVX512), each copy in its own namespace named by CPU_CAPABILITY, as torch does for its own
// kernels. kernel_table() returns the copy for the capability torch itself chose on this machine
// (at::get_cpu_capability(), which honours ATEN_CPU_CAPABILITY), so both are compared on equal
// terms. The capability objects are linked after the rest of the extension and in the order
// DEFAULT, AVX2, AVX512: an inline function from a common header that several copies instantiate
// resolves to the first, baseline, definition, so no AVX512 code runs on a machine without it.
const KernelTable& kernel_table();

// "DEFAULT", "AVX2" or "AVX512": the capability kernel_table() runs.
const char* kernel_capability();

}  // namespace ddpkit::syncbn::cpu
