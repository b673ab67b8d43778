#pragma once
// The collective check across equal hosts, and the data that may ride in its one round (Note [One
// round across hosts]).

#include "comm/core/collective_check.h"
#include "comm/core/header.h"
#include "comm/hierarchy/hierarchy.h"

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <vector>
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
// others which rank failed. Among three hosts or more whose paths are long (CrossHostSteps::long_paths) the round
// goes among every partner instead: each sends every other its words and data at once and computes the
// center's answer itself from all of them, in host order (the same bits everywhere), one crossing of the
// path instead of two; a failed partner is then named by the links' own news (Note [News of a failure]).

// Note [A check in front of the swap]
// Between hosts of one rank each, a collective whose data cross in one exchange with every partner
// (the swap between two hosts, the first of two shots among more on long paths: the all-reduce and
// the reduce-scatter, Note [Steps across hosts] in hierarchy/cross_host_steps.h) does not wait for its
// check: each rank sends its words at the front of that exchange's frames, its data right behind
// them, and judges its partners' words as soon as they are in, before it uses any of the data after
// them. Every rank holds every rank's words, so all reach the same verdict without an answer, and the
// data cross hosts once, check included, on a path of any length. Where the steps' frames cannot carry
// them (the ring, a compressed crossing, an empty tensor), the words cross alone first, to every
// partner. Every other collective takes the check's round (the small ones riding in it), which meets
// the same partners: between two hosts through the center, among more every partner. Every frame of
// a check (a step's front, a message to the center, the center's answer) starts with its sender's
// words and is received drained (Links::Recv::drain), so that a rank in front of the steps and one in
// the round, or two calls of different sizes, still read each other's words, raise alike and leave
// the stream in step: the group stays usable. The center's answer carries a mark after its words, so
// that a partner in the round tells it from a swap's frame. What a one-way check gives up: a rank that refuses its partner's
// frame itself (not of this collective, or cut short) breaks the links, and its partner, which may
// have had this rank's frame whole, finishes its collective and learns of it at the next one, which
// raises at once. bench_multihost.py's delayed two-host points time it;
// tests/test_multihost.py's check-in-front tests pin the verdicts and the stream.

// Up to this many bytes of payload ride in the one round of the check across hosts.
constexpr int64_t kOneRoundMaxBytes = 64 * 1024;

// The check across equal hosts (Note [One round across hosts]): this rank's step of its host's shared
// memory, then the round through cross rank 0 as the center, complete when start() returns. Data up
// to kOneRoundMaxBytes may ride along (Note [Check seam]).
// Between two hosts of one rank each it may ride in front of a swap's frames instead (Note [A check
// in front of the swap]).
class CrossHostCheck final : public CollectiveCheck, private CheckInFront {
 public:
  // `h` (equal hosts, this rank crossing them with its partners) outlives the check.
  explicit CrossHostCheck(const Hierarchy& h);
  ~CrossHostCheck() override;
  int64_t ride_along_bytes() const override { return kOneRoundMaxBytes; }
  at::Tensor start(Communicator& comm, const CollectiveHeader& header, const std::string& local_error,
                   const RideAlong* ride) override;
  bool rides_in_front_of_steps() const override;
  void start_in_front_of_steps(Communicator& comm, const CollectiveHeader& header,
                               const std::string& local_error) override;
  CheckInFront* in_front() override;
  void settle(Communicator& comm) override;
  void reject_unchecked(std::string_view what) override;

 private:
  // CheckInFront, for the steps that carry this check.
  const at::Tensor& words() const override;
  int64_t minimum() const override;
  bool agree(Communicator& comm, int peer, const void* frame) override;
  void conclude(Communicator& comm, bool whole) override;

  // Whether the round is among every partner rather than through a center: three partners or more
  // on long paths (Note [A check in front of the swap]).
  bool all_to_all() const;
  // This rank's words for `header` (its host's step first), a check in front pending.
  void begin_front(Communicator& comm, const CollectiveHeader& header, const std::string& local_error);
  // The round among every partner: start() where all_to_all().
  at::Tensor start_among_all(Communicator& comm, const CollectiveHeader& header, const std::string& error,
                             const RideAlong* ride);
  // Raises (a c10::Error) unless the words recorded so far agree with this rank's.
  void verify_front(Communicator& comm) const;
  // This rank's words in front of `payload` to every partner and theirs back, then the verdict (a
  // CheckVerdict unless all agree); every partner's payload (this rank's own at its index).
  std::vector<at::Tensor> exchange_words(Communicator& comm, const at::Tensor& payload);
  // The words in front crossing alone (no step carried them), then the verdict.
  void cross_alone(Communicator& comm);

  struct Front;  // the check in front of a swap, from its start to its verdict
  const Hierarchy& h_;
  std::unique_ptr<Front> front_;
};

}  // namespace ddpkit::comm
