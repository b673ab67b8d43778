#pragma once
// SyncBatchNorm's passes for CUDA tensors (compiled only in CUDA builds; see the CUDA block of
// CMakeLists.txt), as a table. Each of its functions has the contract of the pass of the same name
// in syncbn/kernels.h — same arguments, float64 [C] / [2C] statistics and sums on the input's device,
// outputs in the input's dtype and memory format — and runs hand-written kernels
// (syncbn/cuda/kernels.cuh) on torch's current CUDA stream of the input's device, asynchronously.
// They do local math only; the ops in syncbn/syncbn.h put them around their one all-reduce per
// pass (Note [Backend element kernels] in syncbn/kernels.h).

#include "syncbn/kernels.h"

namespace ddpkit::syncbn::cuda {

// The CUDA passes (syncbn/cuda/kernels.cu) as the table of Note [Backend element kernels].
const ElementKernels& element_kernels();

}  // namespace ddpkit::syncbn::cuda
