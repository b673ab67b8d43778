#include "ddp/bucket_assignment.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <unordered_map>

namespace ddpkit::ddp {

std::vector<int64_t> assign_buckets(const std::vector<int64_t>& sizes_bytes, const std::vector<int64_t>& kinds,
                                    const std::vector<bool>& included, int64_t cap_bytes, int64_t first_cap_bytes) {
  TORCH_CHECK(sizes_bytes.size() == kinds.size() && kinds.size() == included.size(),
              "assign_buckets: sizes, kinds and included must have the same length");
  TORCH_CHECK(cap_bytes > 0 && first_cap_bytes > 0, "assign_buckets: bucket caps must be positive, got ", cap_bytes,
              " and ", first_cap_bytes);
  struct OpenBucket {
    int64_t index;
    int64_t bytes;
    int64_t cap;
  };
  std::vector<int64_t> bucket_of(sizes_bytes.size(), -1);
  std::unordered_map<int64_t, OpenBucket> open;  // kind -> its bucket being filled
  std::unordered_map<int64_t, bool> kind_seen;
  int64_t next_index = 0;
  for (size_t k = sizes_bytes.size(); k-- > 0;) {
    if (!included[k]) continue;
    TORCH_CHECK(sizes_bytes[k] >= 0, "assign_buckets: negative size for parameter ", k);
    auto it = open.find(kinds[k]);
    if (it == open.end()) {
      const bool first_of_kind = !kind_seen[kinds[k]];
      kind_seen[kinds[k]] = true;
      it = open.emplace(kinds[k], OpenBucket{next_index++, 0, first_of_kind ? first_cap_bytes : cap_bytes}).first;
    }
    bucket_of[k] = it->second.index;
    it->second.bytes += sizes_bytes[k];
    if (it->second.bytes >= it->second.cap) open.erase(it);
  }
  return bucket_of;
}

std::vector<std::vector<size_t>> bucket_slots(const std::vector<int64_t>& bucket_of_param) {
  int64_t bucket_count = 0;
  for (int64_t b : bucket_of_param) bucket_count = std::max(bucket_count, b + 1);
  std::vector<std::vector<size_t>> slots(static_cast<size_t>(bucket_count));
  for (size_t i = bucket_of_param.size(); i-- > 0;) {
    if (bucket_of_param[i] >= 0) slots[bucket_of_param[i]].push_back(i);
  }
  for (size_t b = 0; b < slots.size(); ++b) TORCH_CHECK(!slots[b].empty(), "bucket ", b, " has no parameters");
  return slots;
}

}  // namespace ddpkit::ddp
