#include "comm/core/header.h"

#include "comm/core/wire_format.h"

#include "comm/core/algorithm.h"
#include "comm/reduction/reduce_op.h"

namespace ddpkit::comm {

std::string_view collective_name(CollectiveKind kind) {
  const int64_t index = static_cast<int64_t>(kind) - static_cast<int64_t>(CollectiveKind::kAllReduce);
  if (index < 0 || index >= static_cast<int64_t>(kCollectiveNames.size())) return "unknown collective";
  return kCollectiveNames[static_cast<size_t>(index)];
}

CollectiveKind parse_collective_kind(std::string_view name) {
  for (size_t i = 0; i < kCollectiveNames.size(); ++i) {
    if (kCollectiveNames[i] == name) {
      return static_cast<CollectiveKind>(static_cast<int64_t>(CollectiveKind::kAllReduce) + static_cast<int64_t>(i));
    }
  }
  TORCH_CHECK(false, "ddpkit: unknown collective '", name, "'");
}

namespace {

// A header field's value in the words of an error. Headers may come from a peer's slot, so any
// value outside its enum is named as such rather than trusted.
std::string field_value(const HeaderField& field, int64_t value) {
  if (field.member == &CollectiveHeader::kind) return std::string(collective_name(static_cast<CollectiveKind>(value)));
  if (field.member == &CollectiveHeader::meta) return value != 0 ? "on the meta device (no data)" : "with data";
  if (field.member == &CollectiveHeader::dtype) {
    if (value < 0) return "none";
    if (value >= static_cast<int64_t>(c10::ScalarType::NumOptions)) return c10::str("invalid dtype ", value);
    return std::string(c10::toString(static_cast<c10::ScalarType>(value)));
  }
  if (field.member == &CollectiveHeader::op && value >= kDelegatedOp) {
    static constexpr const char* kTorchOps[] = {"sum",  "avg", "product", "min",       "max",
                                                "band", "bor", "bxor",    "premul_sum"};
    const int64_t code = value - kDelegatedOp;
    return c10::str(code < 9 ? kTorchOps[code] : "op " + std::to_string(code), " (gloo)");
  }
  if (field.member == &CollectiveHeader::op && value >= 0) {
    if (value >= static_cast<int64_t>(kReduceOpNames.size())) return c10::str("invalid op ", value);
    return std::string(reduce_op_name(static_cast<ReduceOp>(value)));
  }
  if (field.member == &CollectiveHeader::wire) {
    if (value < 0 || value >= static_cast<int64_t>(kWireFormatNames.size()))
      return c10::str("invalid wire format ", value);
    return std::string(wire_format_name(static_cast<WireFormat>(value)));
  }
  if (field.member == &CollectiveHeader::algorithm && value >= 0) {
    if (value >= static_cast<int64_t>(kAlgorithmNames.size())) return c10::str("invalid algorithm ", value);
    return std::string(algorithm_name(static_cast<Algorithm>(value)));
  }
  return std::to_string(value);
}

}  // namespace

std::string describe_mismatch(int rank, const CollectiveHeader& theirs, const CollectiveHeader& reference,
                              std::string_view what, int reference_rank) {
  for (const HeaderField& field : kHeaderFields) {
    const int64_t value = theirs.*field.member;
    const int64_t expected = reference.*field.member;
    if (value == expected) continue;
    return c10::str("ddpkit.", what, ": ranks called mismatched collectives: rank ", rank, " passed ", field.name, " ",
                    field_value(field, value), ", rank ", reference_rank, " passed ", field.name, " ",
                    field_value(field, expected));
  }
  return {};
}

std::string describe_headers(const CollectiveHeader* headers, int size, std::string_view what, const int* group_ranks) {
  auto rank_of = [&](int peer) { return group_ranks != nullptr ? group_ranks[peer] : peer; };
  for (int peer = 0; peer < size; ++peer) {
    if (headers[peer].magic != kHeaderMagic) {
      return c10::str("ddpkit.", what, ": rank ", rank_of(peer), " rejected its arguments (its own error says why)");
    }
  }
  for (int peer = 1; peer < size; ++peer) {
    std::string error = describe_mismatch(rank_of(peer), headers[peer], headers[0], what, rank_of(0));
    if (!error.empty()) return error;
  }
  return {};
}

}  // namespace ddpkit::comm
