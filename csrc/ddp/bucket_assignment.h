#pragma once
// Which flat bucket each parameter's gradient travels in. A pure function: no tensors, no state.

#include <cstdint>
#include <vector>

namespace ddpkit::ddp {

// Note [Bucket assignment]
// Gradients become ready roughly in reverse registration order during backward, so parameters are
// visited from last to first and packed into buckets in that order: bucket 0 holds the last
// parameters and is the first one that can be launched. A bucket takes parameters until its size
// reaches its cap, then closes (so it may overshoot by its last parameter, as torch DDP's do):
// `first_cap_bytes` for the first bucket of each kind, so communication
// starts early in backward, `cap_bytes` for the others (torch DDP: 1 MiB, then 25 MiB).
// Parameters of different kinds (dtype and device, encoded by the caller as `kinds[i]`) never
// share a bucket; each kind fills its own open bucket. Buckets are numbered in the order they are
// opened, which is the order the reducer launches them.

// Returns, for each parameter i (sizes_bytes[i] bytes, of kind kinds[i]), the index of its bucket,
// or -1 where `included[i]` is false (frozen parameters). All vectors have the same length; caps
// must be positive.
std::vector<int64_t> assign_buckets(const std::vector<int64_t>& sizes_bytes, const std::vector<int64_t>& kinds,
                                    const std::vector<bool>& included, int64_t cap_bytes, int64_t first_cap_bytes);

// The parameters of each bucket in slot order (last parameter first, as assign_buckets visited them),
// from assign_buckets()' result: what lays a bucket out as a flat buffer, for the reducer's gradients
// and ShardedParameters' parameters alike. Fails where a bucket index below the largest has no parameter.
std::vector<std::vector<size_t>> bucket_slots(const std::vector<int64_t>& bucket_of_param);

}  // namespace ddpkit::ddp
