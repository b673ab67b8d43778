#pragma once
// What the bytes that cross hosts carry (Note [Compressed crossing]).

#include "comm/reduction/reduce_op.h"

#include <ATen/ATen.h>

#include <array>
#include <cstdint>
#include <functional>
#include <string_view>

namespace ddpkit::comm {

// Note [Compressed crossing]
// Across hosts the link, not the CPU, bounds a large all-reduce (bench_multihost.py's shaped links:
// ddpkit and gloo both fill them), so the only way past it is to send fewer bytes.
// Opt-in, a float32 sum or mean may cross hosts as bfloat16 or float16: half the bytes on every
// link, while the steps inside a host (shared memory) keep full precision. What is rounded where:
//  - between two hosts (the swap), each host rounds its own contribution once and both add the two
//    rounded blocks in host order;
//  - on the ring, each partial result is rounded as it leaves a rank, and the finished block once
//    more for the all-gather (its owner keeps the rounded value too).
// So every rank ends with the same bits, and an element's error is at most one rounding per host
// of a partial sum no larger than the sum of the ranks' magnitudes: relative 2^-8 each in bfloat16
// (8 significant bits), 2^-11 in float16, whose narrower range makes bfloat16 the safer choice for
// gradients (tests/test_compressed_crossing.py checks that bound against a float64 reference). Other
// dtypes and ops, tensors small enough to cross in the check's round (Note [One round across
// hosts]), and tensors that never cross hosts ignore the setting: they travel exact.
enum class WireFormat : int { kExact = 0, kBFloat16 = 1, kFloat16 = 2 };

// One name per WireFormat, in enum order (Python: ddpkit.comm.WIRE_FORMATS).
inline constexpr std::array<std::string_view, 3> kWireFormatNames = {"exact", "bfloat16", "float16"};

// The format of `name`; a caller error naming the formats otherwise.
WireFormat parse_wire_format(std::string_view name);
std::string_view wire_format_name(WireFormat format);

// Whether `tensor` reduced with `op` crosses hosts in `format` (not exact): float32 sums and means.
bool compresses(WireFormat format, const at::Tensor& tensor, ReduceOp op);

// The dtype a compressing format puts on the wire.
at::ScalarType wire_dtype(WireFormat format);

// Links::Send's prepare for `frame` (the wire's dtype) written from `source` (as long) as the frame
// goes out, so that the rounding overlaps the transfer: the swap's and the ring's outgoing frames.
// The function keeps how far it has encoded: the exchange calls the one it was given.
std::function<void(int64_t)> encode_as_sent(const at::Tensor& frame, const at::Tensor& source);

}  // namespace ddpkit::comm
