#pragma once
// The argument checks of ddpkit's collectives, and the working copies of their tensors. A check
// returns the reason a rank rejects its arguments, or "": a rejection is carried into the
// collective check (Note [Collective checks]) rather than thrown, so that every rank raises.

#include "comm/core/algorithm.h"
#include "comm/core/header.h"
#include "comm/reduction/reduce_op.h"

#include <ATen/ATen.h>

#include <optional>
#include <string>
#include <string_view>

namespace ddpkit::comm {

// Elements [begin, end) of the 1-D `flat`.
inline at::Tensor slice(const at::Tensor& flat, int64_t begin, int64_t end) {
  return flat.narrow(0, begin, end - begin);
}

// True when `part` is exactly block `rank` of `whole` (contiguous, the same dtype): the in-place
// calls of all_gather_into_tensor_ and reduce_scatter_tensor_ (collectives/collectives.h), as torch's backends.
bool is_own_block(const at::Tensor& whole, const at::Tensor& part, int rank);

// Every reason below starts "ddpkit.<what>: ", `what` being the call the collective serves
// (Communicator::what()), not the collective's kind.

// The reason `tensor` cannot take part in a ddpkit collective, or "" when it can. Collectives that
// only move data (no `op`) take any dtype; reductions take the dtypes of collectives/collectives.h.
std::string tensor_error(const at::Tensor& tensor, std::string_view what, std::optional<ReduceOp> op);

// The reason `root` (named `role`: "src", "dst") is not a rank of a group of `size`, or "".
std::string root_error(int root, int size, std::string_view what, std::string_view role);

// The reason `output`/`input` cannot take part in an all-gather (`gather` true) or reduce-scatter of
// `n` ranks as rank `rank`, or "" when they can.
std::string gather_scatter_error(const at::Tensor& output, const at::Tensor& input, int n, int rank, bool gather,
                                 std::optional<ReduceOp> op, std::string_view what);

// This rank's header of a collective on `tensor` (undefined: a rank that rejected it), before
// Communicator::stamp.
CollectiveHeader make_header(CollectiveKind kind, const at::Tensor& tensor, std::optional<ReduceOp> op,
                             std::optional<Algorithm> algorithm, int root);

// The dtype a reduction of `tensor` runs in: float16/bfloat16 in float32, the rest as they are.
at::ScalarType working_dtype(const at::Tensor& tensor);
inline size_t working_element_size(const at::Tensor& tensor) { return c10::elementSize(working_dtype(tensor)); }

// `tensor` itself, or its float32 copy for float16/bfloat16 (reduced in float32, written back once).
at::Tensor working_copy(const at::Tensor& tensor);

// Writes `work` (a working_copy of `tensor`) back into `tensor`; nothing when they are one.
inline void write_back(at::Tensor& tensor, const at::Tensor& work) {
  if (!work.is_same(tensor)) tensor.copy_(work);
}

}  // namespace ddpkit::comm
