#pragma once
// The collective check across equal hosts, and the data that may ride in its one round (Note [One
// round across hosts]).

#include "comm/core/collective_check.h"
#include "comm/core/header.h"
#include "comm/hierarchy/hierarchy.h"

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <string_view>

namespace ddpkit::comm {

// Note [One round across hosts]
// The check across equal hosts is one round through a center, the first of the ranks of this rank's local rank (its
// partners), for every collective (so ranks that disagree on the collective, its root or its size always pick the
// same center): every other partner sends the center one message holding its words (its header, its host's culprit
// with that culprit's header, the rank its host lost); once all are in, the center answers each with every partner's
// words, so every rank compares every host's headers after two one-way messages. The round runs over the partners'
// socket links (Note [Socket links]), not gloo's send/recv, for the reasons of that Note. Up to kOneRoundMaxBytes of
// data ride in the same messages, after the words, so that a small collective crosses hosts once, check included:
// for the all-reduce each partner sends its host's result (the host's all-reduce runs between the check's step and
// the round) and the center answers with the hosts' results reduced in host order (the same bits everywhere); the
// reduce and the reduce-scatter take that all-reduce on a copy; for the broadcast the root sends its tensor and the
// center answers with it; for the all-gather each partner sends its block and the center answers with all of them.
// The steps inside each host follow. Messages carry only the data their sender has, and every receive is posted at
// the largest size a message may have (words plus kOneRoundMaxBytes, or a reply's partners·(words plus
// kOneRoundMaxBytes)), so calls that disagree (another size, another collective, one on each side of the threshold)
// still meet in this round, and raise, instead of overflowing a receive. A center that loses a partner tells the
// others which rank failed.

// Up to this many bytes of payload ride in the one round of the check across hosts.
constexpr int64_t kOneRoundMaxBytes = 64 * 1024;

// The check across equal hosts (Note [One round across hosts]): this rank's step of its host's shared
// memory, then the round through cross rank 0 as the center, complete when start() returns. Data up
// to kOneRoundMaxBytes may ride along (Note [Check seam]).
class CrossHostCheck final : public CollectiveCheck {
 public:
  // `h` (equal hosts, this rank crossing them with its partners) outlives the check.
  explicit CrossHostCheck(const Hierarchy& h) : h_(h) {}
  int64_t ride_along_bytes() const override { return kOneRoundMaxBytes; }
  at::Tensor start(Communicator& comm, const CollectiveHeader& header, const std::string& local_error,
                   const RideAlong* ride) override;
  void reject_unchecked(std::string_view what) override;

 private:
  const Hierarchy& h_;
};

}  // namespace ddpkit::comm
