#include "comm/shm/setup.h"

#include "comm/core/communicator.h"
#include "comm/topology/setup_messages.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <random>

namespace ddpkit::comm {
namespace {

using namespace setup_messages;
using namespace shm_detail;

constexpr uint64_t kSegmentMagic = 0x31306d6873706464;  // "ddpshm01"

// A host leader's offer of its segment to the other ranks of its host.
struct Offer {
  int64_t status;  // kOk, or kFailed (the leader could not create it)
  int64_t failure;
  int64_t failed_rank;
  int64_t error_number;
  int64_t pid;  // of the leader
  int64_t fd;   // the leader's descriptor of the segment
  int64_t bytes;
  uint64_t nonce[2];
  SegmentSettings settings;
};

// A rank's answer to its leader, a leader's report to rank 0, and rank 0's verdict to every rank.
struct Answer {
  int64_t status;
  int64_t failure;
  int64_t failed_rank;
  int64_t error_number;
};

// The first failure of a set-up step, as far as this rank knows it: a setup_messages::Failure, the
// errno it came with, and the group's rank it happened on.
struct HostFailure {
  int64_t failure = kNoFailure;
  int64_t error_number = 0;
  int64_t rank = -1;
};

// One rank's part in making its host's segment (step 1 of Note [Shared-memory segment]).
struct HostSetUp {
  Communicator& setup;
  std::vector<int> ranks;    // the group's rank of each of the host's ranks
  int local_rank;            // this rank's index among them
  SegmentSettings settings;  // what this rank offers when it is the host's leader
  HostFailure failed;        // the host's first failure, as far as this rank knows it
  std::unique_ptr<SegmentMemory> memory;

  int size() const { return static_cast<int>(ranks.size()); }
  int group_rank() const { return ranks[local_rank]; }
};

// On the host's leader: creates the segment and offers it to the host's other ranks; records the
// host's first failure.
void offer_to_host(HostSetUp& host) {
  // Settings that give no layout fail the set-up as a segment that could not be made does: told to the
  // host's ranks and through rank 0 to the group, so that none waits for an offer that never comes.
  const SegmentLayout layout{host.size(), host.settings};
  const bool settings_ok = layout.valid();
  const size_t bytes = settings_ok ? layout.bytes() : 0;
  std::random_device random;
  uint64_t nonce[2];
  for (uint64_t& word : nonce) word = (static_cast<uint64_t>(random()) << 32) ^ random();
  const int fd = settings_ok ? memfd_create("ddpkit", MFD_CLOEXEC) : -1;
  int error_number = settings_ok && fd < 0 ? errno : 0;
  if (fd >= 0 && (fchmod(fd, 0600) != 0 || ftruncate(fd, static_cast<off_t>(bytes)) != 0)) error_number = errno;
  if (error_number == 0) {
    try {
      host.memory = std::make_unique<SegmentMemory>(fd, layout);
    } catch (const c10::Error&) {
      error_number = errno != 0 ? errno : EINVAL;
    }
  }
  struct CloseAtExit {
    int fd;
    ~CloseAtExit() {
      if (fd >= 0) close(fd);
    }
  } close_at_exit{fd};  // the mapping keeps the memory; the descriptor is only for the host's open
  Offer offer{};
  if (!settings_ok || error_number != 0) {
    const setup_messages::Failure failure = settings_ok ? kCreateFailed : kBadSettings;
    host.failed = {failure, error_number, host.group_rank()};
    offer.status = kFailed;
    offer.failure = failure;
    offer.failed_rank = host.group_rank();
    offer.error_number = error_number;
    tell(host.setup, host.ranks, message_of(offer), kOfferRound, -1);
    return;
  }
  SegmentHeader& shared = host.memory->header();
  shared.magic = kSegmentMagic;
  shared.nonce[0] = nonce[0];
  shared.nonce[1] = nonce[1];
  shared.bytes = static_cast<int64_t>(bytes);
  shared.size = host.size();
  shared.settings = layout.settings;
  offer.status = kOk;
  offer.pid = getpid();
  offer.fd = fd;
  offer.bytes = static_cast<int64_t>(bytes);
  offer.nonce[0] = nonce[0];
  offer.nonce[1] = nonce[1];
  offer.settings = layout.settings;
  const at::Tensor offer_message = message_of(offer);
  std::vector<at::Tensor> acks(host.size());
  MessageList messages;
  try {
    for (int local = 1; local < host.size(); ++local) {
      acks[local] = at::empty({static_cast<int64_t>(sizeof(Answer))}, at::kByte);
      messages.push_back(host.setup.irecv(acks[local], host.ranks[local], kAckRound));
      messages.push_back(host.setup.isend(offer_message, host.ranks[local], kOfferRound));
    }
    host.setup.wait(messages);
  } catch (const c10::Error&) {
    abort_all(messages);
    host.failed = {kPeerFailed, 0, host.setup.failed_peer()};
    return;
  }
  for (int local = 1; local < host.size() && host.failed.failure == kNoFailure; ++local) {
    const Answer ack = value_of<Answer>(acks[local]);
    if (ack.status != kOk) host.failed = {ack.failure, ack.error_number, host.ranks[local]};
  }
}

// Why the segment a leader offered cannot be this rank's (kNoFailure: it maps it); maps it into
// `host.memory` on success.
HostFailure open_offer(HostSetUp& host, const Offer& offer) {
  const SegmentLayout layout{host.size(), offer.settings};
  HostFailure mine{kNoFailure, 0, host.group_rank()};
  if (!layout.valid() || static_cast<int64_t>(layout.bytes()) != offer.bytes) {
    mine.failure = kWrongSize;
    return mine;
  }
  const std::string path = c10::str("/proc/", offer.pid, "/fd/", offer.fd);
  const int fd = open(path.c_str(), O_RDWR | O_CLOEXEC);
  struct stat info{};
  if (fd < 0 || fstat(fd, &info) != 0) {
    mine.failure = kOpenFailed;
    mine.error_number = errno;
  } else if (!S_ISREG(info.st_mode)) {
    mine.failure = kNotRegularFile;
  } else if (info.st_uid != geteuid()) {
    mine.failure = kWrongOwner;
  } else if ((info.st_mode & 07777) != 0600) {
    mine.failure = kWrongMode;
  } else if (info.st_size != offer.bytes) {
    mine.failure = kWrongSize;
  } else {
    try {
      host.memory = std::make_unique<SegmentMemory>(fd, layout);
    } catch (const c10::Error&) {
      mine.failure = kMapFailed;
    }
    if (mine.failure == kNoFailure) {
      const SegmentHeader& shared = host.memory->header();
      const bool matches = shared.magic == kSegmentMagic && shared.nonce[0] == offer.nonce[0] &&
                           shared.nonce[1] == offer.nonce[1] && shared.bytes == offer.bytes &&
                           shared.size == host.size() && shared.settings.slot_bytes == layout.settings.slot_bytes &&
                           shared.settings.whole_bytes == layout.settings.whole_bytes &&
                           shared.settings.chunk_bytes == layout.settings.chunk_bytes;
      if (!matches) mine.failure = kWrongHeader;
    }
  }
  if (fd >= 0) close(fd);  // the mapping keeps the memory
  if (mine.failure != kNoFailure) host.memory.reset();
  return mine;
}

// On the host's other ranks: opens, verifies and maps `leader`'s segment and answers.
void accept_from_leader(HostSetUp& host, int leader) {
  at::Tensor offer_message = at::empty({static_cast<int64_t>(sizeof(Offer))}, at::kByte);
  MessageList answer{host.setup.irecv(offer_message, leader, kOfferRound)};
  MessageList none;
  const Offer offer = wait_for_answer<Offer>(host.setup, answer, none, offer_message);
  if (offer.status != kOk) {  // the leader could not create it and says so
    host.failed = {offer.failure, offer.error_number, offer.failed_rank};
    return;
  }
  const HostFailure mine = open_offer(host, offer);
  MessageList sent{host.setup.isend(message_of(Answer{mine.failure == kNoFailure ? kOk : kFailed, mine.failure,
                                                      host.group_rank(), mine.error_number}),
                                    leader, kAckRound)};
  host.setup.wait(sent);
  if (mine.failure != kNoFailure) host.failed = mine;
}

// Step 3: every leader reports its host to rank 0, whose verdict every rank takes, so the group
// agrees. Raises alike on every rank unless every host's segment was made.
void agree_on_segments(Communicator& setup, const Topology& topology, const HostFailure& failed) {
  const int rank = setup.rank();
  const int size = setup.size();
  const int leader = topology.local_ranks().front();
  Answer verdict{kOk, kNoFailure, -1, 0};
  if (failed.failure != kNoFailure) verdict = Answer{kFailed, failed.failure, failed.rank, failed.error_number};
  if (rank == 0) {
    std::vector<int> leaders;
    for (const auto& host : topology.hosts) {
      if (host.size() > 1 && host.front() != 0) leaders.push_back(host.front());
    }
    std::vector<at::Tensor> reports(leaders.size());
    MessageList messages;
    try {
      for (size_t i = 0; i < leaders.size(); ++i) {
        reports[i] = at::empty({static_cast<int64_t>(sizeof(Answer))}, at::kByte);
        messages.push_back(setup.irecv(reports[i], leaders[i], kReportRound));
      }
      setup.wait(messages);
    } catch (...) {
      abort_all(messages);
      const int gone = setup.failed_peer();
      tell(setup, all_ranks(size), message_of(Answer{kFailed, kPeerFailed, gone, 0}), kVerdictRound, gone);
      throw;
    }
    for (size_t i = 0; i < leaders.size() && verdict.status == kOk; ++i) {
      const Answer report = value_of<Answer>(reports[i]);
      if (report.status != kOk) verdict = report;
    }
    tell(setup, all_ranks(size), message_of(verdict), kVerdictRound, -1);
  } else {
    at::Tensor verdict_message = at::empty({static_cast<int64_t>(sizeof(Answer))}, at::kByte);
    MessageList answer{setup.irecv(verdict_message, 0, kVerdictRound)};
    MessageList sent;
    if (rank == leader && topology.local_size() > 1) {
      sent.push_back(setup.isend(message_of(verdict), 0, kReportRound));
    }
    const Answer reported = wait_for_answer<Answer>(setup, answer, sent, verdict_message);
    TORCH_CHECK(failed.failure == kNoFailure || failed.rank != rank, Words(setup).prefix, ": ",
                describe_failure(failed.failure, failed.error_number), Words::kHint);
    if (reported.status != kOk) verdict = reported;
  }
  TORCH_CHECK(verdict.status == kOk, Words(setup).relayed(verdict.failed_rank, verdict.failure, verdict.error_number),
              rank == 0 ? "" : " (rank 0 reported it)");
}

}  // namespace

SegmentOptions default_segment_options(int size, bool spinning) {
  return SegmentOptions{default_segment_settings(size, spinning), std::chrono::milliseconds(kSleepMillis), spinning};
}

std::shared_ptr<ShmSegment> set_up_segment(Communicator& setup, const Discovery& group,
                                           std::chrono::milliseconds timeout, const SegmentOptions& options) {
  const int rank = setup.rank();
  const Topology& topology = group.topology;
  const std::vector<int>& local = topology.local_ranks();
  HostSetUp host{setup, local, topology.local_rank(), options.settings, {}, nullptr};
  // 1 and 2. The host's segment, made by its leader and offered to the other ranks of its host.
  if (host.size() > 1) {
    if (rank == local.front()) {
      offer_to_host(host);
    } else {
      accept_from_leader(host, local.front());
    }
    if (host.failed.failure != kNoFailure) host.memory.reset();
  }
  agree_on_segments(setup, topology, host.failed);
  if (!host.memory) return nullptr;
  SegmentRanks ranks;
  ranks.rank = host.local_rank;
  ranks.group_ranks = local;
  for (int r : local) ranks.pids.push_back(static_cast<int>(group.pids[r]));
  ranks.group_size = setup.size();
  ranks.group = std::string(setup.group());
  ranks.timeout = timeout;
  return std::make_shared<ShmSegment>(std::move(host.memory), std::move(ranks), options.spinning,
                                      options.liveness_period);
}

}  // namespace ddpkit::comm
