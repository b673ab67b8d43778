#include "comm/core/wire_format.h"

#include <c10/util/Exception.h>

#include <string>

namespace ddpkit::comm {

WireFormat parse_wire_format(std::string_view name) {
  for (size_t i = 0; i < kWireFormatNames.size(); ++i) {
    if (kWireFormatNames[i] == name) return static_cast<WireFormat>(i);
  }
  std::string expected;
  for (std::string_view known : kWireFormatNames) expected += c10::str(expected.empty() ? "" : ", ", known);
  TORCH_CHECK(false, "ddpkit: unknown wire format '", name, "' for the bytes that cross hosts; expected one of ",
              expected);
}

std::string_view wire_format_name(WireFormat format) {
  const auto index = static_cast<size_t>(format);
  TORCH_INTERNAL_ASSERT(index < kWireFormatNames.size(), "unknown wire format ", index);
  return kWireFormatNames[index];
}

bool compresses(WireFormat format, const at::Tensor& tensor, ReduceOp op) {
  return format != WireFormat::kExact && tensor.scalar_type() == at::kFloat && accumulating_op(op) == ReduceOp::kSum;
}

at::ScalarType wire_dtype(WireFormat format) {
  TORCH_INTERNAL_ASSERT(format != WireFormat::kExact);
  return format == WireFormat::kBFloat16 ? at::kBFloat16 : at::kHalf;
}

std::function<void(int64_t)> encode_as_sent(const at::Tensor& frame, const at::Tensor& source) {
  TORCH_INTERNAL_ASSERT(frame.numel() == source.numel() && frame.is_contiguous());
  return [frame, source, encoded = int64_t{0}](int64_t bytes) mutable {
    const int64_t upto = bytes / frame.element_size();
    frame.narrow(0, encoded, upto - encoded).copy_(source.narrow(0, encoded, upto - encoded));
    encoded = upto;
  };
}

}  // namespace ddpkit::comm
