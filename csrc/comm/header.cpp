#include "comm/header.h"

#include "comm/collectives.h"
#include "comm/reduce_op.h"

namespace ddpkit::comm {

std::string_view collective_name(CollectiveKind kind) {
  switch (kind) {
    case CollectiveKind::kAllReduce: return "all_reduce";
    case CollectiveKind::kBroadcast: return "broadcast";
    case CollectiveKind::kReduce: return "reduce";
    case CollectiveKind::kGather: return "gather";
    case CollectiveKind::kScatter: return "scatter";
    case CollectiveKind::kAllGather: return "all_gather_into_tensor";
    case CollectiveKind::kReduceScatter: return "reduce_scatter_tensor";
    case CollectiveKind::kBarrier: return "barrier";
    case CollectiveKind::kAllToAll: return "all_to_all";
  }
  return "unknown collective";
}

namespace {

std::string field_value(const HeaderField& field, int64_t value) {
  if (field.member == &CollectiveHeader::kind) return std::string(collective_name(static_cast<CollectiveKind>(value)));
  if (field.member == &CollectiveHeader::dtype) {
    return value < 0 ? std::string("none") : std::string(c10::toString(static_cast<c10::ScalarType>(value)));
  }
  if (field.member == &CollectiveHeader::op && value >= kDelegatedOp) {
    static constexpr const char* kTorchOps[] = {"sum", "avg", "product", "min", "max", "band", "bor", "bxor", "premul_sum"};
    const int64_t code = value - kDelegatedOp;
    return c10::str(code < 9 ? kTorchOps[code] : "op " + std::to_string(code), " (gloo)");
  }
  if (field.member == &CollectiveHeader::op && value >= 0) return std::string(reduce_op_name(static_cast<ReduceOp>(value)));
  if (field.member == &CollectiveHeader::algorithm && value >= 0) {
    return std::string(algorithm_name(static_cast<Algorithm>(value)));
  }
  return std::to_string(value);
}

}  // namespace

std::string describe_mismatch(int rank, const CollectiveHeader& theirs, const CollectiveHeader& reference,
                              std::string_view what) {
  for (const HeaderField& field : kHeaderFields) {
    const int64_t value = theirs.*field.member;
    const int64_t expected = reference.*field.member;
    if (value == expected) continue;
    return c10::str("ddpkit.", what, ": ranks called mismatched collectives: rank ", rank, " passed ", field.name, " ",
                    field_value(field, value), ", rank 0 passed ", field.name, " ", field_value(field, expected));
  }
  return {};
}

std::string describe_headers(const CollectiveHeader* headers, int size, std::string_view what) {
  for (int peer = 0; peer < size; ++peer) {
    if (headers[peer].magic != kHeaderMagic) {
      return c10::str("ddpkit.", what, ": rank ", peer, " rejected its arguments (its own error says why)");
    }
  }
  for (int peer = 1; peer < size; ++peer) {
    std::string error = describe_mismatch(peer, headers[peer], headers[0], what);
    if (!error.empty()) return error;
  }
  return {};
}

}  // namespace ddpkit::comm
