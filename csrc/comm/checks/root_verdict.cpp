#include "comm/checks/root_verdict.h"

#include "comm/core/call_timeout.h"

#include <algorithm>
#include <cstring>

namespace ddpkit::comm {
namespace {

constexpr int64_t kVerdictMagic = 0x64647076;
constexpr int64_t kVerdictRejected = 1;
constexpr int64_t kVerdictMismatch = 2;
constexpr int64_t kVerdictPeerFailed = 3;
// A verdict: [magic, status, rank, then the headers of rank 0 and of `rank`] (status kVerdictMismatch).
constexpr int64_t kVerdictWords = 3 + 2 * kHeaderWords;
constexpr int kCheckRoot = Communicator::kCheckRoot;

}  // namespace

at::Tensor RootVerdictCheck::start(Communicator& comm, const CollectiveHeader& header, const std::string& local_error,
                                   const RideAlong* ride) {
  TORCH_INTERNAL_ASSERT(ride == nullptr, "the root verdict carries no data");
  messages_.clear();  // what an earlier collective that failed left here is its own
  local_error_ = local_error;
  const int size = comm.size();
  const bool independent = comm.independent_messages();
  CollectiveHeader words = comm.stamp(header, local_error);
  const auto device_options = at::TensorOptions().dtype(at::kLong).device(comm.device_type());
  at::Tensor mine = at::from_blob(&words, {kHeaderWords}, at::kLong).to(device_options, false, true);
  if (!independent) comm.start_group();
  if (comm.rank() == kCheckRoot) {
    headers_ = at::empty({size, kHeaderWords}, device_options);
    headers_[kCheckRoot].copy_(mine);
    for (int peer = 0; peer < size; ++peer) {
      if (peer != kCheckRoot) messages_.push_back(comm.irecv(headers_[peer], peer, Communicator::kHeaderRound));
    }
  } else {
    headers_ = mine;
    verdict_ = at::empty({kVerdictWords}, device_options);
    messages_.push_back(comm.isend(mine, kCheckRoot, Communicator::kHeaderRound));
    // Posted now, so that the root's verdict finds it ready (Note [Pre-posted receives]).
    if (independent) messages_.push_back(comm.irecv(verdict_, kCheckRoot, Communicator::kVerdictRound));
  }
  if (!independent) {
    messages_.clear();
    messages_.push_back(comm.end_group());
  }
  pending_ = true;
  if (!local_error.empty()) settle(comm);
  return {};
}

void RootVerdictCheck::settle(Communicator& comm) {
  if (!pending_) return;
  pending_ = false;
  const bool independent = comm.independent_messages();
  at::Tensor verdict;
  if (comm.rank() == kCheckRoot) {
    try {
      comm.wait(messages_);
    } catch (...) {
      send_failure_verdict(comm);
      throw;
    }
    verdict = make_verdict(comm).to(headers_.device());
    if (!independent) comm.start_group();
    for (int peer = 0; peer < comm.size(); ++peer) {
      if (peer != kCheckRoot) messages_.push_back(comm.isend(verdict, peer, Communicator::kVerdictRound));
    }
    if (!independent) {
      messages_.clear();
      messages_.push_back(comm.end_group());
    }
    comm.wait(messages_);  // a verdict send left pending would outlive its buffer
  } else {
    // Longer than the root's own wait for the headers, so that when a rank never sends its header the
    // root's verdict naming it arrives here before this wait times out knowing nothing.
    std::chrono::milliseconds verdict_timeout = ::kNoTimeout;
    try {
      const auto group_timeout = call_timeout_or(comm.backend()->getBackendOptions()->timeout);
      verdict_timeout = group_timeout + std::max(std::chrono::milliseconds(2000), group_timeout / 4);
    } catch (const std::exception&) {
    }
    try {
      comm.wait(messages_, verdict_timeout);
      if (!independent) {
        comm.start_group();
        comm.irecv(verdict_, kCheckRoot, Communicator::kVerdictRound);
        messages_.push_back(comm.end_group());
        comm.wait(messages_);
      }
    } catch (const c10::Error& e) {
      // gloo closes every connection of a group whose wait timed out, so a root that waited in vain
      // for some rank's header cannot send its verdict naming it: say where that name is.
      TORCH_CHECK(false, e.what_without_backtrace(), "; rank ", kCheckRoot,
                  " gathers every rank's header for the collective check: when it gives up, its own error names "
                  "the rank it waited for");
    }
    verdict = verdict_;
  }
  TORCH_CHECK(local_error_.empty(), local_error_);
  const std::string error = describe_verdict(comm, verdict.cpu());
  TORCH_CHECK(error.empty(), error);
}

void RootVerdictCheck::send_failure_verdict(Communicator& comm) {
  // Best effort: a peer we cannot reach fails on its own, through its broken connection.
  const int failed = comm.failed_peer();
  at::Tensor verdict = at::zeros({kVerdictWords}, at::kLong);
  verdict[0] = kVerdictMagic;
  verdict[1] = kVerdictPeerFailed;
  verdict[2] = failed;
  verdict = verdict.to(comm.device_type());
  for (int peer = 0; peer < comm.size(); ++peer) {
    if (peer == kCheckRoot || peer == failed) continue;
    MessageList one;
    try {
      one.push_back(comm.isend(verdict, peer, Communicator::kVerdictRound));
      comm.wait(one);
    } catch (const std::exception&) {
    }
  }
}

at::Tensor RootVerdictCheck::make_verdict(const Communicator& comm) const {
  at::Tensor verdict = at::zeros({kVerdictWords}, at::kLong);
  int64_t* out = verdict.data_ptr<int64_t>();
  out[0] = kVerdictMagic;
  at::Tensor all = headers_.cpu().contiguous();
  const auto* headers = reinterpret_cast<const CollectiveHeader*>(all.data_ptr<int64_t>());
  for (int peer = 0; peer < comm.size(); ++peer) {
    if (headers[peer].magic != kHeaderMagic) {
      out[1] = kVerdictRejected;
      out[2] = peer;
      return verdict;
    }
  }
  for (int peer = 1; peer < comm.size(); ++peer) {
    if (describe_mismatch(peer, headers[peer], headers[0], comm.what()).empty()) continue;
    out[1] = kVerdictMismatch;
    out[2] = peer;
    std::memcpy(out + 3, &headers[0], sizeof(CollectiveHeader));
    std::memcpy(out + 3 + kHeaderWords, &headers[peer], sizeof(CollectiveHeader));
    return verdict;
  }
  return verdict;
}

std::string RootVerdictCheck::describe_verdict(const Communicator& comm, const at::Tensor& verdict) const {
  const int64_t* v = verdict.data_ptr<int64_t>();
  TORCH_INTERNAL_ASSERT(v[0] == kVerdictMagic, "ddpkit: malformed collective verdict");
  if (v[1] == kVerdictRejected) {
    return c10::str("ddpkit.", comm.what(), ": rank ", v[2], " rejected its arguments (its own error says why)");
  }
  if (v[1] == kVerdictPeerFailed) {
    return c10::str("ddpkit.", comm.what(), " (", comm.where(), "): rank ", v[2],
                    " failed or died during the collective check (rank 0 reported it)");
  }
  if (v[1] == kVerdictMismatch) {
    CollectiveHeader reference, theirs;
    std::memcpy(static_cast<void*>(&reference), v + 3, sizeof(CollectiveHeader));
    std::memcpy(static_cast<void*>(&theirs), v + 3 + kHeaderWords, sizeof(CollectiveHeader));
    return describe_mismatch(static_cast<int>(v[2]), theirs, reference, comm.what());
  }
  return {};
}

}  // namespace ddpkit::comm
