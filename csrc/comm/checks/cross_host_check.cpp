#include "comm/checks/cross_host_check.h"

#include "comm/core/communicator.h"

#include <algorithm>
#include <cstring>
#include <vector>

namespace ddpkit::comm {
namespace {

// Each rank's words in the check across hosts (Note [Hierarchical collectives]): its own header,
// its host's culprit (-1: none) with the culprit's header and its host's first header, so that
// every rank of every host can name it, then the rank its host lost (-1: none).
constexpr int64_t kCheckWords = 3 * kHeaderWords + 2;
constexpr int64_t kLostRankWord = 3 * kHeaderWords + 1;  // the last of them

// The rank this host lost when a step of its shared memory failed: the rank its transport saw fail,
// else this one (its own step gave up).
int64_t lost_rank(DirectCollectives* local, const Communicator& comm) {
  const int failed = local != nullptr ? local->failed_rank() : -1;
  return failed >= 0 ? failed : comm.rank();
}

// This rank's part of the check: one step over its host's shared memory, and its words.
struct HostCheck {
  CollectiveHeader stamped;
  std::string host_error;  // the host's step failed (a rank died or gave up): its ranks still tell their partners
  at::Tensor words;        // kCheckWords int64
};

HostCheck check_host(const CollectiveHeader& header, const std::string& error, const Hierarchy& h, Communicator& comm) {
  DirectCollectives* local = h.host();
  HostCheck check{comm.stamp(header, error), {}, at::zeros({kCheckWords}, at::kLong)};
  std::vector<CollectiveHeader> host{check.stamped};
  int64_t lost = -1;
  if (local != nullptr) {
    try {
      host = local->exchange_headers(check.stamped, comm.what());
    } catch (const std::exception& e) {
      check.host_error = without_backtrace(e);
      lost = lost_rank(local, comm);
      host = {check.stamped};
    }
  }
  int culprit = -1;  // the first of the host's headers that differs from its first (or was rejected)
  for (size_t i = 0; i < host.size() && culprit < 0; ++i) {
    if (host[i].magic != kHeaderMagic || !describe_mismatch(0, host[i], host[0], comm.what()).empty()) {
      culprit = static_cast<int>(i);
    }
  }
  int64_t* out = check.words.data_ptr<int64_t>();
  std::memcpy(out, &check.stamped, sizeof(CollectiveHeader));
  out[kHeaderWords] = culprit < 0 ? -1 : (local != nullptr ? local->group_rank(culprit) : comm.rank());
  if (culprit >= 0) {
    std::memcpy(out + kHeaderWords + 1, &host[culprit], sizeof(CollectiveHeader));
    std::memcpy(out + 2 * kHeaderWords + 1, &host[0], sizeof(CollectiveHeader));
  }
  out[kLostRankWord] = lost;
  return check;
}

// Raises, alike on every rank, unless every host's words (`words_of(j)` for cross rank j, null where
// they never came) say that all agree.
template <class WordsOf>
void verify_hosts(const HostCheck& check, const std::string& error, WordsOf words_of, const Hierarchy& h,
                  Communicator& comm) {
  TORCH_CHECK(check.host_error.empty(), check.host_error);
  TORCH_CHECK(error.empty(), error);  // this rank's own rejection, before anyone else's
  auto header_at = [](const int64_t* at) {
    CollectiveHeader value;
    std::memcpy(static_cast<void*>(&value), at, sizeof(CollectiveHeader));
    return value;
  };
  for (int j = 0; j < h.cross->size(); ++j) {  // a rank lost on another host first
    const int64_t* theirs = words_of(j);
    if (theirs == nullptr) continue;
    const int64_t lost = theirs[kLostRankWord];
    TORCH_CHECK(lost < 0, "ddpkit.", comm.what(), " (", comm.where(), "): rank ", lost,
                " failed on its host: the process died or its transport gave up (rank ", h.cross->group_ranks()[j],
                " reported it)");
  }
  for (int j = 0; j < h.cross->size(); ++j) {  // then a culprit on some host: its host saw how it differs
    const int64_t* theirs = words_of(j);
    if (theirs == nullptr || theirs[kHeaderWords] < 0) continue;
    const int rank = static_cast<int>(theirs[kHeaderWords]);
    const CollectiveHeader bad = header_at(theirs + kHeaderWords + 1);
    TORCH_CHECK(bad.magic == kHeaderMagic, "ddpkit.", comm.what(), ": rank ", rank,
                " rejected its arguments (its own error says why)");
    const int host_first = h.topology.hosts[h.topology.host_of[rank]].front();
    TORCH_CHECK(false, describe_mismatch(rank, bad, header_at(theirs + 2 * kHeaderWords + 1), comm.what(), host_first));
  }
  for (int j = 0; j < h.cross->size(); ++j) {  // else the hosts' own headers, against this rank's
    const int64_t* theirs = words_of(j);
    if (theirs == nullptr) continue;
    const std::string mismatch =
        describe_mismatch(h.cross->group_ranks()[j], header_at(theirs), check.stamped, comm.what(), comm.rank());
    TORCH_CHECK(mismatch.empty(), mismatch);
  }
}

// Each rank's check words as bytes, the start of every frame of a check (Note [A check in front of
// the swap]).
constexpr int64_t kCheckBytes = kCheckWords * static_cast<int64_t>(sizeof(int64_t));
// The center's answer: its own words, then kAnswerMark, its status and, after a failure, the group's
// rank that failed, then every partner's words, then the reply's payload.
constexpr int64_t kAnswerMark = 0x64646b616e737772;  // "ddkanswr"
constexpr int64_t kReplyOk = 0;
constexpr int64_t kReplyPartnerFailed = 1;
constexpr int64_t kAnswerPrefixBytes = kCheckBytes + 3 * static_cast<int64_t>(sizeof(int64_t));
// The words in front of a swap's frame, padded with zeros to a multiple of 64 bytes past where an
// answer's mark would be: a swap's frame never carries the mark.
constexpr int64_t kFrontBytes = (kCheckBytes + static_cast<int64_t>(sizeof(int64_t)) + 63) / 64 * 64;

// An answer's prefix after the center's words, or null where `frame` (`received` bytes) is not an
// answer (the center runs a swap with its check in front).
const int64_t* answer_prefix(const at::Tensor& frame, int64_t received) {
  if (received < kAnswerPrefixBytes) return nullptr;
  const auto* prefix = reinterpret_cast<const int64_t*>(static_cast<const char*>(frame.data_ptr()) + kCheckBytes);
  return prefix[0] == kAnswerMark ? prefix + 1 : nullptr;
}

// Runs `verify`, raising its error as a CheckVerdict: the links are in step.
template <class Verify>
void as_verdict(Verify verify) {
  try {
    verify();
  } catch (const CheckVerdict&) {
    throw;
  } catch (const c10::Error& e) {
    throw CheckVerdict(e);
  }
}

}  // namespace

struct CrossHostCheck::Front {
  HostCheck check;
  std::string error;    // this rank's own rejection
  at::Tensor words;     // kFrontBytes: check.words, then zeros
  at::Tensor partners;  // kLong, each partner's kCheckWords as agree() recorded them
  std::vector<char> recorded;
  int missing = 0;  // partners whose words are not recorded yet
  bool pending = false;
};

CrossHostCheck::CrossHostCheck(const Hierarchy& h) : h_(h) {}
CrossHostCheck::~CrossHostCheck() = default;

bool CrossHostCheck::all_to_all() const { return h_.cross->size() > 2 && h_.cross->long_paths(); }

bool CrossHostCheck::rides_in_front_of_steps() const {
  return h_.cross != nullptr && h_.host() == nullptr && (h_.cross->size() == 2 || all_to_all());
}

void CrossHostCheck::begin_front(Communicator& comm, const CollectiveHeader& header, const std::string& local_error) {
  const int partners = h_.cross->size();
  if (!front_) {
    front_ = std::make_unique<Front>();
    front_->words = at::zeros({kFrontBytes}, at::kByte);
  }
  Front& front = *front_;
  front.check = check_host(header, local_error, h_, comm);
  front.error = local_error;
  std::memcpy(front.words.data_ptr(), front.check.words.data_ptr(), kCheckBytes);
  front.partners = at::zeros({partners * kCheckWords}, at::kLong);
  front.recorded.assign(partners, 0);
  front.missing = partners - 1;
  front.pending = true;
}

void CrossHostCheck::start_in_front_of_steps(Communicator& comm, const CollectiveHeader& header,
                                             const std::string& local_error) {
  TORCH_INTERNAL_ASSERT(rides_in_front_of_steps());
  begin_front(comm, header, local_error);
  // A rank that rejected its arguments runs no steps: its words cross now, and it raises with its partners.
  if (!local_error.empty()) cross_alone(comm);
}

CheckInFront* CrossHostCheck::in_front() { return front_ && front_->pending ? this : nullptr; }

void CrossHostCheck::settle(Communicator& comm) {
  if (front_ && front_->pending) cross_alone(comm);
}

const at::Tensor& CrossHostCheck::words() const { return front_->words; }

int64_t CrossHostCheck::minimum() const { return kCheckBytes; }

void CrossHostCheck::verify_front(Communicator& comm) const {
  const Front& front = *front_;
  const int self = h_.cross->rank();
  auto words_of = [&](int j) -> const int64_t* {
    if (j == self) return front.check.words.data_ptr<int64_t>();
    return front.recorded[j] ? front.partners.data_ptr<int64_t>() + j * kCheckWords : nullptr;
  };
  verify_hosts(front.check, front.error, words_of, h_, comm);
}

bool CrossHostCheck::agree(Communicator& comm, int peer, const void* frame) {
  Front& front = *front_;
  if (!front.recorded[peer]) {
    std::memcpy(front.partners.data_ptr<int64_t>() + peer * kCheckWords, frame, kCheckBytes);
    front.recorded[peer] = 1;
    --front.missing;
  }
  if (front.missing > 0) return false;
  try {
    verify_front(comm);
  } catch (const c10::Error&) {
    return false;
  }
  return true;
}

void CrossHostCheck::conclude(Communicator& comm, bool whole) {
  front_->pending = false;
  TORCH_INTERNAL_ASSERT(front_->missing == 0, "a check in front concluded before every partner's words were in");
  as_verdict([&] {
    verify_front(comm);
    TORCH_CHECK(whole, "ddpkit.", comm.what(), " (", comm.where(),
                "): a frame across hosts did not hold the bytes its words promised");
  });
}

std::vector<at::Tensor> CrossHostCheck::exchange_words(Communicator& comm, const at::Tensor& payload) {
  const int partners = h_.cross->size();
  const int self = h_.cross->rank();
  at::Tensor sent = at::empty({kFrontBytes + payload.numel()}, at::kByte);
  sent.narrow(0, 0, kFrontBytes).copy_(front_->words);
  if (payload.numel() > 0) sent.narrow(0, kFrontBytes, payload.numel()).copy_(payload);
  std::vector<at::Tensor> frames(partners);
  std::vector<Links::Send> sends;
  std::vector<Links::Recv> recvs;
  for (int j = 0; j < partners; ++j) {
    if (j == self) continue;
    frames[j] = at::empty({kFrontBytes + kOneRoundMaxBytes}, at::kByte);
    sends.push_back({j, sent.data_ptr(), sent.numel()});
    recvs.push_back({j, frames[j].data_ptr(), frames[j].numel()});
    recvs.back().minimum = kCheckBytes;
    recvs.back().drain = true;  // a partner's steps with their check in front: its words tell
  }
  on_hosts(h_, OnFailure::kKeepLinks, [&] {
    across_hosts(h_, comm, [&] { h_.cross->links().exchange(comm.sequence(), std::move(sends), recvs); });
  });
  std::vector<at::Tensor> payloads(partners);
  bool whole = true;
  for (const Links::Recv& recv : recvs) {
    agree(comm, recv.peer, frames[recv.peer].data_ptr());
    // A frame of another kind (a center's, or a step's data, drained) never agrees: its payload is
    // never read.
    const int64_t kept = std::min(recv.received, recv.capacity);
    const int64_t words = std::min(kept, kFrontBytes);
    whole = whole && recv.received <= recv.capacity && kept >= kFrontBytes;
    payloads[recv.peer] = frames[recv.peer].narrow(0, words, kept - words);
  }
  conclude(comm, whole);
  payloads[self] = payload;
  return payloads;
}

void CrossHostCheck::cross_alone(Communicator& comm) { exchange_words(comm, at::empty({0}, at::kByte)); }

at::Tensor CrossHostCheck::start_among_all(Communicator& comm, const CollectiveHeader& header, const std::string& error,
                                           const RideAlong* ride) {
  begin_front(comm, header, error);
  Front& front = *front_;
  HostCheck& check = front.check;
  const bool host_agrees = check.host_error.empty() && check.words.data_ptr<int64_t>()[kHeaderWords] < 0;
  at::Tensor payload = at::empty({0}, at::kByte);
  if (host_agrees && ride != nullptr) {
    try {
      payload = ride->payload().contiguous();
    } catch (const std::exception& e) {
      // As in the round through the center: the partners still get this rank's words, naming the lost rank.
      check.host_error = without_backtrace(e);
      check.words.data_ptr<int64_t>()[kLostRankWord] = lost_rank(h_.host(), comm);
      std::memcpy(front.words.data_ptr(), check.words.data_ptr(), kCheckBytes);
      payload = at::empty({0}, at::kByte);
    }
  }
  TORCH_INTERNAL_ASSERT(payload.scalar_type() == at::kByte && payload.numel() <= kOneRoundMaxBytes);
  const std::vector<at::Tensor> payloads = exchange_words(comm, payload);  // raises unless all agree
  return ride != nullptr ? ride->reply(payloads) : at::empty({0}, at::kByte);
}

void CrossHostCheck::reject_unchecked(std::string_view what) {
  if (DirectCollectives* host = h_.host()) host->reject_unchecked(what);
}

at::Tensor CrossHostCheck::start(Communicator& comm, const CollectiveHeader& header, const std::string& error,
                                 const RideAlong* ride) {
  const Hierarchy& h = h_;
  if (front_) front_->pending = false;  // a check in front that a failure left behind
  if (all_to_all()) return start_among_all(comm, header, error, ride);
  constexpr int center = 0;  // the same for every collective: ranks that disagree on it still meet
  HostCheck check = check_host(header, error, h, comm);
  const bool host_agrees = check.host_error.empty() && check.words.data_ptr<int64_t>()[kHeaderWords] < 0;
  at::Tensor payload = at::empty({0}, at::kByte);
  if (host_agrees) {
    try {
      if (ride != nullptr) payload = ride->payload().contiguous();  // sent from its memory as it is
    } catch (const std::exception& e) {
      // A rank of this host failed during its step: the partners still get this rank's words, which
      // name the lost rank, so that every rank of every host raises now rather than at the timeout.
      check.host_error = without_backtrace(e);
      check.words.data_ptr<int64_t>()[kLostRankWord] = lost_rank(h.host(), comm);
    }
  }
  TORCH_INTERNAL_ASSERT(payload.scalar_type() == at::kByte && payload.numel() <= kOneRoundMaxBytes);
  const int partners = h.cross->size();
  at::Tensor words = at::empty({partners * kCheckWords}, at::kLong);
  auto words_of = [&](int j) { return static_cast<const int64_t*>(words.data_ptr<int64_t>()) + j * kCheckWords; };
  std::memcpy(words.data_ptr<int64_t>() + h.cross->rank() * kCheckWords, check.words.data_ptr(), kCheckBytes);
  at::Tensor reply;
  bool answered_alone = false;  // the center's frame was a swap's, not an answer
  Links& links = h.cross->links();
  on_hosts(h, OnFailure::kKeepLinks, [&] {
    across_hosts(h, comm, [&] {
      if (h.cross->rank() != center) {
        at::Tensor answer = at::empty({kAnswerPrefixBytes + partners * (kCheckBytes + kOneRoundMaxBytes)}, at::kByte);
        std::vector<Links::Recv> recvs{{center, answer.data_ptr(), answer.numel()}};
        recvs[0].minimum = kCheckBytes;
        recvs[0].drain = true;
        links.exchange(comm.sequence(),
                       {{center, check.words.data_ptr(), kCheckBytes, payload.data_ptr(), payload.numel()}}, recvs);
        const int64_t* prefix = answer_prefix(answer, recvs[0].received);
        if (prefix == nullptr) {
          // The center runs a swap with its check in front (Note [A check in front of the swap]): its
          // words alone say how the two calls differ.
          std::fill_n(words.data_ptr<int64_t>(), partners * kCheckWords, int64_t{0});
          std::memcpy(words.data_ptr<int64_t>() + center * kCheckWords, answer.data_ptr(), kCheckBytes);
          std::memcpy(words.data_ptr<int64_t>() + h.cross->rank() * kCheckWords, check.words.data_ptr(), kCheckBytes);
          answered_alone = true;
          return;
        }
        TORCH_CHECK(prefix[0] == kReplyOk, "rank ", prefix[1], " failed or died during the check (rank ",
                    h.cross->group_ranks()[center], " reported it)");
        TORCH_CHECK(
            recvs[0].received >= kAnswerPrefixBytes + partners * kCheckBytes && recvs[0].received <= answer.numel(),
            "rank ", h.cross->group_ranks()[center], " sent an answer of ", recvs[0].received, " bytes");
        std::memcpy(words.data_ptr(), static_cast<const char*>(answer.data_ptr()) + kAnswerPrefixBytes,
                    partners * kCheckBytes);
        reply = answer.narrow(0, kAnswerPrefixBytes + partners * kCheckBytes,
                              recvs[0].received - kAnswerPrefixBytes - partners * kCheckBytes);
        return;
      }
      std::vector<at::Tensor> payloads(partners);
      std::vector<Links::Recv> recvs;
      for (int j = 0; j < partners; ++j) {
        if (j == center) continue;
        payloads[j] = at::empty({kCheckBytes + kOneRoundMaxBytes}, at::kByte);
        recvs.push_back({j, payloads[j].data_ptr(), payloads[j].numel()});
        recvs.back().minimum = kCheckBytes;
        recvs.back().drain = true;  // a partner's swap with its check in front: its words tell
      }
      try {
        links.exchange(comm.sequence(), {}, recvs);
      } catch (const std::exception&) {
        // Best effort: the partners still waiting learn at once which rank failed, not at the timeout.
        // The links are broken from here on, so this goes to each partner over its own socket.
        const int failed = links.failed_peer();
        at::Tensor failure = at::empty({kAnswerPrefixBytes}, at::kByte);
        std::memcpy(failure.data_ptr(), check.words.data_ptr(), kCheckBytes);
        const int64_t status[3] = {kAnswerMark, kReplyPartnerFailed, failed >= 0 ? h.cross->group_ranks()[failed] : -1};
        std::memcpy(static_cast<char*>(failure.data_ptr()) + kCheckBytes, status, sizeof(status));
        for (int j = 0; j < partners; ++j) {
          if (j == center || j == failed) continue;
          links.send_last_words(comm.sequence(), j, failure.data_ptr(), failure.numel());
        }
        links.shut_down();
        throw;
      }
      for (const Links::Recv& recv : recvs) {
        std::memcpy(words.data_ptr<int64_t>() + recv.peer * kCheckWords, payloads[recv.peer].data_ptr(), kCheckBytes);
        // A drained frame (a swap's) never agrees: its payload is never read.
        const int64_t kept = std::min(recv.received, recv.capacity);
        payloads[recv.peer] = payloads[recv.peer].narrow(0, kCheckBytes, kept - kCheckBytes);
      }
      payloads[center] = payload;
      bool agree = true;
      try {
        verify_hosts(check, error, words_of, h, comm);
      } catch (const c10::Error&) {
        agree = false;  // raised below, on every rank alike
      }
      const at::Tensor out = agree && ride != nullptr ? ride->reply(payloads) : at::empty({0}, at::kByte);
      TORCH_INTERNAL_ASSERT(out.scalar_type() == at::kByte && out.numel() <= partners * kOneRoundMaxBytes &&
                            out.is_contiguous());
      const int64_t status[3] = {kAnswerMark, kReplyOk, -1};
      reply = out;
      std::vector<Links::Send> sends;
      at::Tensor head = at::empty({kAnswerPrefixBytes + partners * kCheckBytes}, at::kByte);
      std::memcpy(head.data_ptr(), check.words.data_ptr(), kCheckBytes);
      std::memcpy(static_cast<char*>(head.data_ptr()) + kCheckBytes, status, sizeof(status));
      std::memcpy(static_cast<char*>(head.data_ptr()) + kAnswerPrefixBytes, words.data_ptr(), partners * kCheckBytes);
      for (int j = 0; j < partners; ++j) {
        if (j != center) sends.push_back({j, head.data_ptr(), head.numel(), out.data_ptr(), out.numel()});
      }
      std::vector<Links::Recv> none;
      links.exchange(comm.sequence(), std::move(sends), none);
    });
  });
  if (answered_alone) {
    verify_hosts(
        check, error,
        [&](int j) -> const int64_t* { return j == center || j == h.cross->rank() ? words_of(j) : nullptr; }, h, comm);
    TORCH_CHECK(false, "ddpkit.", comm.what(), " (", comm.where(), "): rank ", h.cross->group_ranks()[center],
                " answered the check with a frame of another collective");
  }
  verify_hosts(check, error, words_of, h, comm);
  return reply;
}

}  // namespace ddpkit::comm
