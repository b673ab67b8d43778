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
// One name per CollectiveKind, in enum order from kAllReduce (as the Python API spells them). A kind
// serves several calls (all_gather and its coalesced variants run as kAllGather): errors name the call
// (Communicator::what()), and a kind's name appears in them only where the ranks' kinds differ.
inline constexpr std::array<std::string_view, 9> kCollectiveNames = {
    "all_reduce", "broadcast", "reduce", "gather", "scatter", "all_gather_into_tensor", "reduce_scatter_tensor",
    "barrier",    "all_to_all"};
// The name of `kind`, or "unknown collective" for a value outside the enum (a corrupt header).
std::string_view collective_name(CollectiveKind kind);
// Parses a name of kCollectiveNames; TORCH_CHECK-fails otherwise.
CollectiveKind parse_collective_kind(std::string_view name);

// Identical on all ranks for a well-formed program. Plain data: it travels as its own bytes, in a
// message (process-group transport) or in a shared-memory slot; every field is compared by name
// through kHeaderFields, never by position.
struct CollectiveHeader {
  int64_t magic = 0;     // kHeaderMagic, or kRejectedMagic when this rank rejected its arguments
  int64_t sequence = 0;  // the group's sequence number of the collective (Note [Tags]), 23 bits
  int64_t kind = 0;      // CollectiveKind
  int64_t numel = 0;
  int64_t dtype = 0;       // c10::ScalarType
  int64_t op = -1;         // ReduceOp, or -1 where there is none
  int64_t algorithm = -1;  // Algorithm, or -1 where there is none
  int64_t root = -1;       // src/dst rank, or -1
  int64_t meta = 0;  // 1 when this rank's tensors are meta tensors: a check with no data (Note [Collective checks])
  int64_t wire = 0;  // WireFormat: how the data crosses hosts (Note [Compressed crossing])
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
  int64_t CollectiveHeader::* member;
};
// The fields compared across ranks, in the order mismatches are reported.
constexpr std::array<HeaderField, 9> kHeaderFields = {{
    {"sequence", &CollectiveHeader::sequence},
    {"collective", &CollectiveHeader::kind},
    {"tensor", &CollectiveHeader::meta},
    {"elements", &CollectiveHeader::numel},
    {"dtype", &CollectiveHeader::dtype},
    {"op", &CollectiveHeader::op},
    {"algorithm", &CollectiveHeader::algorithm},
    {"root", &CollectiveHeader::root},
    {"cross_host_dtype", &CollectiveHeader::wire},
}};

// How rank `rank`'s header differs from rank `reference_rank`'s, in the words of an error ("" when
// they agree). `what` names the collective ("all_reduce").
std::string describe_mismatch(int rank, const CollectiveHeader& theirs, const CollectiveHeader& reference,
                              std::string_view what, int reference_rank = 0);

// The first difference among the headers of ranks 0..size-1, in the words of an error: "" when all
// agree; "rank 2 rejected its arguments ..." when a header carries kRejectedMagic. `group_ranks`
// (when given) is the group's rank of each, for the error's words.
std::string describe_headers(const CollectiveHeader* headers, int size, std::string_view what,
                             const int* group_ranks = nullptr);

}  // namespace ddpkit::comm
