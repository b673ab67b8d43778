#pragma once
// The header of a collective: what a rank believes the collective is (Note [Collective checks]).

#include <ATen/ATen.h>

#include <array>
#include <cstdint>
#include <string>
#include <string_view>

namespace ddpkit::comm {

enum class CollectiveKind : int64_t {
  kAllReduce = 1,
  kBroadcast = 2,
  kReduce = 3,
  kGather = 4,
  kScatter = 5,
  kAllGather = 6,
  kReduceScatter = 7,
  kBarrier = 8,
  kAllToAll = 9,
};
std::string_view collective_name(CollectiveKind kind);

// Identical on all ranks for a well-formed program. Plain data: it travels as its own bytes, in a
// message (process-group transport) or in a shared-memory slot; every field is compared by name
// through kHeaderFields, never by position.
struct CollectiveHeader {
  int64_t magic = 0;      // kHeaderMagic, or kRejectedMagic when this rank rejected its arguments
  int64_t sequence = 0;   // the group's sequence number of the collective (Note [Tags]), 23 bits
  int64_t kind = 0;       // CollectiveKind
  int64_t numel = 0;
  int64_t dtype = 0;      // c10::ScalarType
  int64_t op = -1;        // ReduceOp, or -1 where there is none
  int64_t algorithm = -1; // Algorithm, or -1 where there is none
  int64_t root = -1;      // src/dst rank, or -1
};
static_assert(std::is_trivially_copyable_v<CollectiveHeader>);
constexpr int64_t kHeaderWords = sizeof(CollectiveHeader) / sizeof(int64_t);

// The header op of a reduction ddpkit hands to gloo (Note [The ddpkit backend]): kDelegatedOp plus
// torch's c10d::ReduceOp code, so that such a call still meets its peers' headers and a mismatch
// with it is reported like any other.
constexpr int64_t kDelegatedOp = 100;

constexpr int64_t kHeaderMagic = 0x64647070;    // "ddpp"
constexpr int64_t kRejectedMagic = 0x64647078;  // this rank rejected its own arguments

struct HeaderField {
  const char* name;
  int64_t CollectiveHeader::*member;
};
// The fields compared across ranks, in the order mismatches are reported.
constexpr std::array<HeaderField, 7> kHeaderFields = {{
    {"sequence", &CollectiveHeader::sequence},
    {"collective", &CollectiveHeader::kind},
    {"elements", &CollectiveHeader::numel},
    {"dtype", &CollectiveHeader::dtype},
    {"op", &CollectiveHeader::op},
    {"algorithm", &CollectiveHeader::algorithm},
    {"root", &CollectiveHeader::root},
}};

// How rank `rank`'s header differs from rank 0's, in the words of an error ("" when they agree).
// `what` names the collective ("all_reduce").
std::string describe_mismatch(int rank, const CollectiveHeader& theirs, const CollectiveHeader& reference,
                              std::string_view what);

// The first difference among the headers of ranks 0..size-1, in the words of an error: "" when all
// agree; "rank 2 rejected its arguments ..." when a header carries kRejectedMagic.
std::string describe_headers(const CollectiveHeader* headers, int size, std::string_view what);

}  // namespace ddpkit::comm
