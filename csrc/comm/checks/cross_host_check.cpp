#include "comm/checks/cross_host_check.h"

#include "comm/core/communicator.h"

#include <cstring>

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

// Each rank's check words as bytes, the start of its message in a round across hosts.
constexpr int64_t kCheckBytes = kCheckWords * static_cast<int64_t>(sizeof(int64_t));
// The center's reply starts with its status and, after a failure, the group's rank that failed.
constexpr int64_t kReplyOk = 0;
constexpr int64_t kReplyPartnerFailed = 1;
constexpr int64_t kReplyPrefixBytes = 2 * static_cast<int64_t>(sizeof(int64_t));

}  // namespace

void CrossHostCheck::reject_unchecked(std::string_view what) {
  if (DirectCollectives* host = h_.host()) host->reject_unchecked(what);
}

at::Tensor CrossHostCheck::start(Communicator& comm, const CollectiveHeader& header, const std::string& error,
                                 const RideAlong* ride) {
  const Hierarchy& h = h_;
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
  Links& links = h.cross->links();
  on_hosts(h, OnFailure::kKeepLinks, [&] {
    across_hosts(h, comm, [&] {
      if (h.cross->rank() != center) {
        at::Tensor answer = at::empty({kReplyPrefixBytes + partners * (kCheckBytes + kOneRoundMaxBytes)}, at::kByte);
        std::vector<Links::Recv> recvs{{center, answer.data_ptr(), answer.numel()}};
        recvs[0].minimum = kReplyPrefixBytes;
        links.exchange(comm.sequence(),
                       {{center, check.words.data_ptr(), kCheckBytes, payload.data_ptr(), payload.numel()}}, recvs);
        const auto* prefix = static_cast<const int64_t*>(answer.data_ptr());
        TORCH_CHECK(prefix[0] == kReplyOk, "rank ", prefix[1], " failed or died during the check (rank ",
                    h.cross->group_ranks()[center], " reported it)");
        TORCH_CHECK(recvs[0].received >= kReplyPrefixBytes + partners * kCheckBytes, "rank ",
                    h.cross->group_ranks()[center], " sent a short answer");
        std::memcpy(words.data_ptr(), static_cast<const char*>(answer.data_ptr()) + kReplyPrefixBytes,
                    partners * kCheckBytes);
        reply = answer.narrow(0, kReplyPrefixBytes + partners * kCheckBytes,
                              recvs[0].received - kReplyPrefixBytes - partners * kCheckBytes);
        return;
      }
      std::vector<at::Tensor> payloads(partners);
      std::vector<Links::Recv> recvs;
      for (int j = 0; j < partners; ++j) {
        if (j == center) continue;
        payloads[j] = at::empty({kCheckBytes + kOneRoundMaxBytes}, at::kByte);
        recvs.push_back({j, payloads[j].data_ptr(), payloads[j].numel()});
        recvs.back().minimum = kCheckBytes;
      }
      try {
        links.exchange(comm.sequence(), {}, recvs);
      } catch (const std::exception&) {
        // Best effort: the partners still waiting learn at once which rank failed, not at the timeout.
        // The links are broken from here on, so this goes to each partner over its own socket.
        const int failed = links.failed_peer();
        const int64_t failure[2] = {kReplyPartnerFailed, failed >= 0 ? h.cross->group_ranks()[failed] : -1};
        for (int j = 0; j < partners; ++j) {
          if (j == center || j == failed) continue;
          links.send_last_words(comm.sequence(), j, failure, sizeof(failure));
        }
        links.shut_down();
        throw;
      }
      for (const Links::Recv& recv : recvs) {
        std::memcpy(words.data_ptr<int64_t>() + recv.peer * kCheckWords, payloads[recv.peer].data_ptr(), kCheckBytes);
        payloads[recv.peer] = payloads[recv.peer].narrow(0, kCheckBytes, recv.received - kCheckBytes);
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
      const int64_t prefix[2] = {kReplyOk, -1};
      reply = out;
      std::vector<Links::Send> sends;
      at::Tensor head = at::empty({kReplyPrefixBytes + partners * kCheckBytes}, at::kByte);
      std::memcpy(head.data_ptr(), prefix, kReplyPrefixBytes);
      std::memcpy(static_cast<char*>(head.data_ptr()) + kReplyPrefixBytes, words.data_ptr(), partners * kCheckBytes);
      for (int j = 0; j < partners; ++j) {
        if (j != center) sends.push_back({j, head.data_ptr(), head.numel(), out.data_ptr(), out.numel()});
      }
      std::vector<Links::Recv> none;
      links.exchange(comm.sequence(), std::move(sends), none);
    });
  });
  verify_hosts(check, error, words_of, h, comm);
  return reply;
}

}  // namespace ddpkit::comm
