#include "comm/wire_format.h"

#include <c10/util/Exception.h>

#include <string>

namespace ddpkit::comm {

WireFormat parse_wire_format(std::string_view name) {
  for (const WireFormatName& known : kWireFormats) {
    if (known.name == name) return known.format;
  }
  std::string expected;
  for (const WireFormatName& known : kWireFormats) expected += c10::str(expected.empty() ? "" : ", ", known.name);
  TORCH_CHECK(false, "ddpkit: unknown wire format '", name, "' for the bytes that cross hosts; expected one of ",
              expected);
}

std::string_view wire_format_name(WireFormat format) {
  for (const WireFormatName& known : kWireFormats) {
    if (known.format == format) return known.name;
  }
  TORCH_INTERNAL_ASSERT(false, "unknown wire format ", static_cast<int>(format));
}

std::vector<std::string> wire_format_names() {
  std::vector<std::string> names;
  for (const WireFormatName& known : kWireFormats) names.emplace_back(known.name);
  return names;
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
