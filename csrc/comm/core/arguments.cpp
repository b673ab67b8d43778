#include "comm/core/arguments.h"

namespace ddpkit::comm {

bool is_own_block(const at::Tensor& whole, const at::Tensor& part, int rank) {
  const auto element = static_cast<intptr_t>(whole.element_size());
  return static_cast<const char*>(part.data_ptr()) ==
         static_cast<const char*>(whole.data_ptr()) + static_cast<intptr_t>(rank) * part.numel() * element;
}

std::string tensor_error(const at::Tensor& tensor, std::string_view what, std::optional<ReduceOp> op) {
  if (!tensor.defined()) return c10::str("ddpkit.", what, ": expected a tensor, got None");
  if (tensor.layout() != at::kStrided) {
    return c10::str("ddpkit.", what, ": expected a dense tensor, got layout ", tensor.layout());
  }
  if (!tensor.is_contiguous()) {
    return c10::str("ddpkit.", what, ": expected a contiguous tensor (strides ", tensor.strides(), " for shape ",
                    tensor.sizes(), "); call .contiguous() first");
  }
  if (!op) return {};
  const auto dtype = tensor.scalar_type();
  const bool floating = dtype == at::kFloat || dtype == at::kDouble || dtype == at::kHalf || dtype == at::kBFloat16;
  const bool integral = dtype == at::kInt || dtype == at::kLong;
  if (!floating && !integral) {
    return c10::str("ddpkit.", what, ": unsupported dtype ", dtype,
                    "; supported: float32, float64, float16, bfloat16, int32, int64");
  }
  if (integral && op == ReduceOp::kMean) {
    return c10::str("ddpkit.", what, ": op 'mean' needs a floating-point tensor, got ", dtype);
  }
  return {};
}

std::string root_error(int root, int size, std::string_view what, std::string_view role) {
  if (root >= 0 && root < size) return {};
  return c10::str("ddpkit.", what, ": ", role, "=", root, " is not a rank of this group (size ", size, ")");
}

CollectiveHeader make_header(CollectiveKind kind, const at::Tensor& tensor, std::optional<ReduceOp> op,
                             std::optional<Algorithm> algorithm, int root) {
  CollectiveHeader header;
  header.kind = static_cast<int64_t>(kind);
  header.numel = tensor.defined() ? tensor.numel() : -1;
  header.dtype = tensor.defined() ? static_cast<int64_t>(tensor.scalar_type()) : -1;
  header.op = op ? static_cast<int64_t>(*op) : -1;
  header.algorithm = algorithm ? static_cast<int64_t>(*algorithm) : -1;
  header.root = root;
  return header;
}

at::ScalarType working_dtype(const at::Tensor& tensor) {
  const auto dtype = tensor.scalar_type();
  return dtype == at::kHalf || dtype == at::kBFloat16 ? at::kFloat : dtype;
}

at::Tensor working_copy(const at::Tensor& tensor) {
  const auto dtype = tensor.scalar_type();
  if (dtype == at::kHalf || dtype == at::kBFloat16) return tensor.to(at::kFloat);
  return tensor;
}

std::string gather_scatter_error(const at::Tensor& output, const at::Tensor& input, int n, int rank, bool gather,
                                 std::optional<ReduceOp> op, std::string_view what) {
  std::string error = tensor_error(output, what, op);
  if (error.empty()) error = tensor_error(input, what, op);
  if (!error.empty()) return error;
  const at::Tensor& whole = gather ? output : input;
  const at::Tensor& part = gather ? input : output;
  if (whole.numel() != part.numel() * n) {
    return c10::str("ddpkit.", what, ": the ", gather ? "output" : "input", " must have world size (", n,
                    ") times the elements of the ", gather ? "input" : "output", " (", part.numel(), "), got ",
                    whole.numel());
  }
  if (output.scalar_type() != input.scalar_type() || output.device() != input.device()) {
    return c10::str("ddpkit.", what, ": input and output must have the same dtype and device, got ",
                    input.scalar_type(), " on ", input.device(), " and ", output.scalar_type(), " on ",
                    output.device());
  }
  if (output.numel() > 0 && output.is_alias_of(input) && !is_own_block(whole, part, rank)) {
    return c10::str("ddpkit.", what, ": output and input must not share memory, except ",
                    gather ? "an input that is this rank's block of the output"
                           : "an output that is this rank's block of the input",
                    " (block ", rank, ")");
  }
  return {};
}

}  // namespace ddpkit::comm
