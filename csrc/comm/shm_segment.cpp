#include "comm/shm_segment.h"

#include "comm/communicator.h"
#include "comm/setup_messages.h"
#include "testing/faults.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <fstream>
#include <random>
#include <thread>

namespace ddpkit::comm {

using namespace shm_detail;

void shm_detail::cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

namespace {
thread_local std::chrono::microseconds spin_budget_of_this_thread = shm_detail::kCallerSpinMicros;
}  // namespace

std::chrono::microseconds shm_detail::spin_budget() { return spin_budget_of_this_thread; }

void spin_briefly_on_this_thread() { spin_budget_of_this_thread = shm_detail::kSpinMicros; }

void shm_detail::futex_wait(std::atomic<uint32_t>* word, uint32_t expected, int millis) {
  timespec timeout{millis / 1000, (millis % 1000) * 1000000L};
  // Not FUTEX_PRIVATE_FLAG: the word is shared between processes.
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &timeout, nullptr, 0);
}

namespace {

// Small enough that a chunk is still in cache when peers reduce it and when it is copied out: 256
// KiB slots ran 16M floats at n=2 in under half the time of 1 and 4 MiB ones (bench_allreduce.py with
// DDPKIT_SHM_SLOT_BYTES); the extra steps cost a barrier each, about a microsecond when the ranks
// have cores.
constexpr int64_t kSlotBytes = 256 << 10;
// Note [Direct all-reduce]; DDPKIT_SHM_WHOLE_BYTES overrides both.
constexpr int64_t kDirectWholeBytes = 128 << 10;
constexpr int64_t kDirectWholeBytesSpinning = 2 << 10;

size_t round_up(size_t x, size_t to) { return (x + to - 1) / to * to; }

int64_t env_bytes(const char* name, int64_t fallback) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') return fallback;
  const int64_t parsed = std::atoll(value);
  TORCH_CHECK(parsed >= 4096, "ddpkit: ", name, "=", value, " must be at least 4096 bytes");
  return static_cast<int64_t>(round_up(static_cast<size_t>(parsed), kLine));
}

void futex_wake_all(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

// The state letter of /proc/<pid>/stat ('R', 'S', 'T' for stopped, 'Z' for a zombie, ...), or 'X'
// when there is no such process.
char process_state(int pid) {
  std::ifstream stat_file(c10::str("/proc/", pid, "/stat"));
  if (!stat_file) return 'X';
  std::string content;
  std::getline(stat_file, content);
  const size_t paren = content.rfind(')');
  if (paren == std::string::npos || paren + 2 >= content.size()) return 'X';
  return content[paren + 2];
}

// A pid whose process has exited (or is a zombie waiting to be reaped) is dead.
bool process_alive(int pid) {
  const char state = process_state(pid);
  return state != 'Z' && state != 'X';
}

}  // namespace

void Signal::post(uint32_t v) {
  value.store(v, std::memory_order_seq_cst);
  if (sleepers.load(std::memory_order_seq_cst) != 0) futex_wake_all(&value);
}

void Signal::bump() {
  value.fetch_add(1, std::memory_order_seq_cst);
  if (sleepers.load(std::memory_order_seq_cst) != 0) futex_wake_all(&value);
}

// ---- Set-up (Note [Shared-memory segment]) ----

namespace {

using namespace setup_messages;

constexpr uint64_t kSegmentMagic = 0x31306d6873706464;  // "ddpshm01"
constexpr size_t kBrokenWhyBytes = 512;

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
  int64_t slot_bytes;
  int64_t whole_bytes;
  int64_t chunk_bytes;
};

// A rank's answer to its leader, a leader's report to rank 0, and rank 0's verdict to every rank.
struct Answer {
  int64_t status;
  int64_t failure;
  int64_t failed_rank;
  int64_t error_number;
};

}  // namespace

struct ShmSegment::SegmentHeader {
  uint64_t magic;
  uint64_t nonce[2];
  int64_t bytes;
  int64_t size;
  int64_t slot_bytes;
  int64_t whole_bytes;
  int64_t chunk_bytes;
  // 1 + the first rank any rank found dead (Note [Waiting on shared memory]); 0 while none has.
  alignas(kLine) std::atomic<int32_t> first_dead;
  // The first rank whose transport failed (mark_broken): 0 while none has, -(rank + 1) while it
  // writes broken_why, rank + 1 once it has.
  std::atomic<int32_t> broken_by;
  char broken_why[kBrokenWhyBytes];  // its reason, NUL-terminated
};

// What fixes the segment's layout: decided by the leader (its environment) and sent to its host.
struct ShmSegment::Layout {
  int64_t size;
  int64_t slot_bytes;
  int64_t whole_bytes;
  int64_t chunk_bytes;

  size_t header_bytes() const { return round_up(sizeof(SegmentHeader), kLine); }
  size_t controls_offset() const { return header_bytes(); }
  size_t slots_offset() const {
    return round_up(controls_offset() + round_up(sizeof(RankControl), kLine) * static_cast<size_t>(size), 4096);
  }
  size_t slot_stride() const { return round_up(kSlotHeaderBytes + static_cast<size_t>(slot_bytes), 4096); }
  size_t channels_offset() const { return slots_offset() + slot_stride() * 2 * static_cast<size_t>(size); }
  size_t channel_stride() const {
    return round_up(offsetof(Channel, chunks) + kChannelSlots * (kChunkHeaderBytes + static_cast<size_t>(chunk_bytes)),
                    4096);
  }
  size_t bytes() const { return channels_offset() + channel_stride() * static_cast<size_t>(size * size); }
  bool valid() const {
    return size >= 1 && size <= (1 << 16) && slot_bytes >= 4096 && slot_bytes <= (1LL << 30) && whole_bytes >= 0 &&
           chunk_bytes >= 4096 && chunk_bytes <= (1LL << 30) && slot_bytes % kLine == 0 && chunk_bytes % kLine == 0;
  }
};

std::shared_ptr<ShmSegment> ShmSegment::set_up(Communicator& setup, const Discovery& group,
                                               std::chrono::milliseconds timeout) {
  const int rank = setup.rank();
  const int size = setup.size();
  const Words words(setup);
  const Topology& topology = group.topology;
  const std::vector<int>& local = topology.local_ranks();
  const int leader = local.front();
  const int local_size = static_cast<int>(local.size());

  // 1. The host's segment, made by its leader and offered to the other ranks of its host.
  HostFailure failed;  // this host's first failure, as far as this rank knows it
  std::shared_ptr<ShmSegment> segment;
  if (local_size > 1) {
    segment.reset(new ShmSegment());
    segment->rank_ = topology.local_rank();
    segment->size_ = local_size;
    segment->ranks_ = local;
    segment->group_rank_ = rank;
    segment->group_size_ = size;
    segment->group_ = setup.group();
    segment->timeout_ = timeout;
    // Note [Waiting on shared memory]: the CPUs are the kernel's, shared by every rank on it, also
    // by those of other hosts that a container or namespace of this machine simulates.
    segment->spin_ = group.on_kernel[rank] <= static_cast<int64_t>(std::max(1u, std::thread::hardware_concurrency()));
    for (int r : local) segment->pids_.push_back(static_cast<int>(group.pids[r]));
    if (rank == leader) {
      segment->offer_to_host(setup, failed);
    } else {
      segment->accept_from_leader(setup, leader, failed);
    }
    if (failed.failure != kNoFailure) segment.reset();
  }

  // 2. Every leader reports its host to rank 0, whose verdict every rank takes: the group agrees.
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
    DDPKIT_DIE_IF_FAULT_ARMED("die_at_verdict", rank);
    tell(setup, all_ranks(size), message_of(verdict), kVerdictRound, -1);
  } else {
    at::Tensor verdict_message = at::empty({static_cast<int64_t>(sizeof(Answer))}, at::kByte);
    MessageList answer{setup.irecv(verdict_message, 0, kVerdictRound)};
    MessageList sent;
    if (rank == leader && local_size > 1) sent.push_back(setup.isend(message_of(verdict), 0, kReportRound));
    const Answer reported = wait_for_answer<Answer>(setup, answer, sent, verdict_message);
    TORCH_CHECK(failed.failure == kNoFailure || failed.rank != rank, words.prefix, ": ",
                describe_failure(failed.failure, failed.error_number), Words::kHint);
    if (reported.status != kOk) verdict = reported;
  }
  TORCH_CHECK(verdict.status == kOk, words.relayed(verdict.failed_rank, verdict.failure, verdict.error_number),
              rank == 0 ? "" : " (rank 0 reported it)");
  if (segment) segment->watch_peers();
  return segment;
}

void ShmSegment::offer_to_host(Communicator& setup, HostFailure& failed) {
  // Note [Direct all-reduce]: two slots per rank; Note [Shared-memory messages]: kChannelSlots
  // chunks per ordered pair, shrinking with the host's ranks, so the whole segment stays bounded.
  // Settings that give no layout fail the set-up as a segment that could not be made does: told to the
  // host's ranks and through rank 0 to the group, so that none waits for an offer that never comes.
  bool settings_ok = true;
  int64_t slot_bytes = 0, whole_bytes = 0, chunk_bytes = 0;
  try {
    slot_bytes = env_bytes("DDPKIT_SHM_SLOT_BYTES", kSlotBytes);
    whole_bytes = env_bytes("DDPKIT_SHM_WHOLE_BYTES", spin_ ? kDirectWholeBytesSpinning : kDirectWholeBytes);
    chunk_bytes =
        env_bytes("DDPKIT_SHM_CHUNK_BYTES",
                  std::clamp<int64_t>(round_up((1 << 20) / std::max(1, size_ - 1), kLine), 64 << 10, 512 << 10));
  } catch (const c10::Error&) {
    settings_ok = false;
  }
  const Layout layout{size_, slot_bytes, whole_bytes, chunk_bytes};
  settings_ok = settings_ok && layout.valid();
  const size_t bytes = settings_ok ? layout.bytes() : 0;
  std::random_device random;
  uint64_t nonce[2];
  for (uint64_t& word : nonce) word = (static_cast<uint64_t>(random()) << 32) ^ random();
  const int fd = settings_ok ? memfd_create("ddpkit", MFD_CLOEXEC) : -1;
  int error_number = settings_ok && fd < 0 ? errno : 0;
  if (fd >= 0 && (fchmod(fd, 0600) != 0 || ftruncate(fd, static_cast<off_t>(bytes)) != 0)) error_number = errno;
  if (error_number == 0) {
    try {
      map(fd, bytes, layout);
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
    const Failure failure = settings_ok ? kCreateFailed : kBadSettings;
    failed = {failure, error_number, ranks_[rank_]};
    offer.status = kFailed;
    offer.failure = failure;
    offer.failed_rank = ranks_[rank_];
    offer.error_number = error_number;
    tell(setup, ranks_, message_of(offer), kOfferRound, -1);
    return;
  }
  SegmentHeader& shared = header();
  shared.magic = kSegmentMagic;
  shared.nonce[0] = nonce[0];
  shared.nonce[1] = nonce[1];
  shared.bytes = static_cast<int64_t>(bytes);
  shared.size = size_;
  shared.slot_bytes = layout.slot_bytes;
  shared.whole_bytes = layout.whole_bytes;
  shared.chunk_bytes = layout.chunk_bytes;
  offer.status = kOk;
  offer.pid = getpid();
  offer.fd = fd;
  offer.bytes = static_cast<int64_t>(bytes);
  offer.nonce[0] = nonce[0];
  offer.nonce[1] = nonce[1];
  offer.slot_bytes = layout.slot_bytes;
  offer.whole_bytes = layout.whole_bytes;
  offer.chunk_bytes = layout.chunk_bytes;
  DDPKIT_DIE_IF_FAULT_ARMED("die_at_offer", group_rank_);
  const at::Tensor offer_message = message_of(offer);
  std::vector<at::Tensor> acks(size_);
  MessageList messages;
  try {
    for (int local = 1; local < size_; ++local) {
      acks[local] = at::empty({static_cast<int64_t>(sizeof(Answer))}, at::kByte);
      messages.push_back(setup.irecv(acks[local], ranks_[local], kAckRound));
      messages.push_back(setup.isend(offer_message, ranks_[local], kOfferRound));
    }
    setup.wait(messages);
  } catch (const c10::Error&) {
    abort_all(messages);
    failed = {kPeerFailed, 0, setup.failed_peer()};
    return;
  }
  for (int local = 1; local < size_ && failed.failure == kNoFailure; ++local) {
    const Answer ack = value_of<Answer>(acks[local]);
    if (ack.status != kOk) failed = {ack.failure, ack.error_number, ranks_[local]};
  }
}

void ShmSegment::accept_from_leader(Communicator& setup, int leader, HostFailure& failed) {
  at::Tensor offer_message = at::empty({static_cast<int64_t>(sizeof(Offer))}, at::kByte);
  MessageList answer{setup.irecv(offer_message, leader, kOfferRound)};
  MessageList none;
  const Offer offer = wait_for_answer<Offer>(setup, answer, none, offer_message);
  if (offer.status != kOk) {  // the leader could not create it and says so
    failed = {offer.failure, offer.error_number, offer.failed_rank};
    return;
  }
  const Layout layout{size_, offer.slot_bytes, offer.whole_bytes, offer.chunk_bytes};
  HostFailure mine{kNoFailure, 0, group_rank_};
  if (!layout.valid() || static_cast<int64_t>(layout.bytes()) != offer.bytes) {
    mine.failure = kWrongSize;
  } else {
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
        map(fd, static_cast<size_t>(offer.bytes), layout);
      } catch (const c10::Error&) {
        mine.failure = kMapFailed;
      }
      if (mine.failure == kNoFailure) {
        const SegmentHeader& shared = header();
        const bool matches = shared.magic == kSegmentMagic && shared.nonce[0] == offer.nonce[0] &&
                             shared.nonce[1] == offer.nonce[1] && shared.bytes == offer.bytes && shared.size == size_ &&
                             shared.slot_bytes == layout.slot_bytes && shared.whole_bytes == layout.whole_bytes &&
                             shared.chunk_bytes == layout.chunk_bytes;
        if (!matches) mine.failure = kWrongHeader;
      }
    }
    if (fd >= 0) close(fd);  // the mapping keeps the memory
  }
  if (mine.failure != kNoFailure && base_ != nullptr) {
    munmap(base_, bytes_);
    base_ = nullptr;
  }
  DDPKIT_DIE_IF_FAULT_ARMED("die_at_map", group_rank_);
  MessageList sent{setup.isend(
      message_of(Answer{mine.failure == kNoFailure ? kOk : kFailed, mine.failure, group_rank_, mine.error_number}),
      leader, kAckRound)};
  setup.wait(sent);
  if (mine.failure != kNoFailure) failed = mine;
}

void ShmSegment::map(int fd, size_t bytes, const Layout& layout) {
  errno = 0;
  void* address = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int error = errno;
  TORCH_CHECK(address != MAP_FAILED, "ddpkit: mapping the shared-memory segment (", bytes,
              " bytes) failed: ", std::strerror(error));
  base_ = static_cast<char*>(address);
  bytes_ = bytes;
  slot_bytes_ = layout.slot_bytes;
  whole_bytes_ = layout.whole_bytes;
  chunk_bytes_ = layout.chunk_bytes;
  header_offset_ = 0;
  controls_offset_ = layout.controls_offset();
  slots_offset_ = layout.slots_offset();
  slot_stride_ = layout.slot_stride();
  channels_offset_ = layout.channels_offset();
  channel_stride_ = layout.channel_stride();
}

ShmSegment::SegmentHeader& ShmSegment::header() const {
  return *reinterpret_cast<SegmentHeader*>(base_ + header_offset_);
}

ShmSegment::~ShmSegment() {
  watch_.reset();  // its thread wakes words of the mapping
  if (base_ != nullptr) munmap(base_, bytes_);
}

// Note [Prompt death notice]
void ShmSegment::watch_peers() {
  poll_liveness_ = !DDPKIT_FAULT_ARMED("no_liveness_poll", group_rank_);
  watch_ = std::make_unique<PeerWatch>(pids_, rank_, [this](int) {
    exits_.fetch_add(1, std::memory_order_seq_cst);
    wake_all_sleepers();
  });
}

bool ShmSegment::alarmed(uint32_t& seen) const {
  const uint32_t exits = exits_.load(std::memory_order_seq_cst);
  const bool exited = exits != seen;
  seen = exits;
  return exited || broken_flag_.load(std::memory_order_acquire) ||
         header().broken_by.load(std::memory_order_acquire) != 0;
}

void ShmSegment::wake_all_sleepers() const {
  for (int r = 0; r < size_; ++r) {
    RankControl& c = control(r);
    for (Signal* signal : {&c.arrived, &c.reduced, &c.doorbell}) futex_wake_all(&signal->value);
  }
}

bool ShmSegment::awaits_a_rank_on_this_cpu(const WaitContext& context) const {
  const int cpu = sched_getcpu();
  if (cpu < 0) return false;
  const int32_t mark = cpu + 1;  // RankControl::cpu's encoding: 0 until the rank first waits
  control(rank_).cpu.store(mark, std::memory_order_relaxed);
  int awaited = -1;
  if (context.awaited == WaitContext::Awaited::kPeer) {
    awaited = context.peer;
  } else {
    for (int peer = 0; awaited < 0 && peer < size_; ++peer) {
      const Signal& counter =
          context.awaited == WaitContext::Awaited::kArrived ? control(peer).arrived : control(peer).reduced;
      if (peer != rank_ && !reached(counter.value.load(std::memory_order_acquire), context.step)) awaited = peer;
    }
  }
  return awaited >= 0 && awaited < size_ && awaited != rank_ &&
         control(awaited).cpu.load(std::memory_order_relaxed) == mark;
}

ShmSegment::RankControl& ShmSegment::control(int rank) const {
  return *reinterpret_cast<RankControl*>(base_ + controls_offset_ + round_up(sizeof(RankControl), kLine) * rank);
}

ShmSegment::Channel& ShmSegment::channel(int src, int dst) const {
  return *reinterpret_cast<Channel*>(base_ + channels_offset_ + channel_stride_ * (src * size_ + dst));
}

CollectiveHeader& ShmSegment::slot_header(int rank, int set) const {
  return *reinterpret_cast<CollectiveHeader*>(base_ + slots_offset_ + slot_stride_ * (2 * rank + set));
}

char* ShmSegment::slot(int rank, int set) const {
  return base_ + slots_offset_ + slot_stride_ * (2 * rank + set) + kSlotHeaderBytes;
}

void ShmSegment::mark_broken(const std::string& why) const {
  {
    std::lock_guard<std::mutex> lock(broken_mutex_);
    if (broken_.empty()) broken_ = why;
  }
  broken_flag_.store(true, std::memory_order_release);
  // Every peer stops too, at its next collective or at once in its current wait (woken below), and
  // says why (peer_failure).
  SegmentHeader& shared = header();
  int32_t none = 0;
  if (shared.broken_by.compare_exchange_strong(none, -(rank_ + 1))) {
    const size_t length = std::min(why.size(), kBrokenWhyBytes - 1);
    std::memcpy(shared.broken_why, why.data(), length);
    shared.broken_why[length] = '\0';
    shared.broken_by.store(rank_ + 1, std::memory_order_release);
  }
  wake_all_sleepers();  // its waits and its peers' stop now, not at their next liveness check
}

int ShmSegment::failed_group_rank() const {
  const int dead = header().first_dead.load(std::memory_order_acquire) - 1;
  if (dead >= 0 && dead < size_) return ranks_[dead];
  const int32_t by = header().broken_by.load(std::memory_order_acquire);
  const int gave_up = by > 0 ? by - 1 : -by - 1;
  return by != 0 && gave_up < size_ ? ranks_[gave_up] : -1;
}

std::string ShmSegment::peer_failure() const {
  const int32_t by = header().broken_by.load(std::memory_order_acquire);
  const int rank = by > 0 ? by - 1 : -by - 1;
  if (by == 0 || rank == rank_ || rank < 0 || rank >= size_) return {};
  if (by < 0) return c10::str("rank ", ranks_[rank], "'s shared-memory transport failed");
  char why[kBrokenWhyBytes];
  std::memcpy(why, header().broken_why, kBrokenWhyBytes);
  why[kBrokenWhyBytes - 1] = '\0';  // whatever the segment holds, read no further
  return c10::str("rank ", ranks_[rank], " gave up: ", why);
}

void ShmSegment::reject_unchecked(std::string_view what) const {
  mark_broken(c10::str("this rank rejected the arguments of a ", what,
                       " with collective checks off, so its peers could not learn it and wait for it"));
}

void ShmSegment::check_usable(std::string_view what) const {
  if (!broken_flag_.load(std::memory_order_acquire) && header().broken_by.load(std::memory_order_acquire) == 0) return;
  std::string why;
  {
    std::lock_guard<std::mutex> lock(broken_mutex_);
    why = broken_;
  }
  if (why.empty()) why = peer_failure();
  if (why.empty()) return;  // this rank's own failure, still being recorded by another of its threads
  TORCH_CHECK(false, "ddpkit.", what, " (", where(), "): this process group's shared-memory transport failed (", why,
              "); destroy the group and create a new one");
}

std::string ShmSegment::where() const {
  return c10::str("rank ", group_rank_, " of ", group_size_, " in group '", group_, "'");
}

int ShmSegment::blame(int peer) const {
  std::atomic<int32_t>& first_dead = header().first_dead;
  int32_t expected = 0;
  if (first_dead.compare_exchange_strong(expected, peer + 1)) return peer;
  const int blamed = expected - 1;
  return blamed >= 0 && blamed < size_ ? blamed : peer;  // a value out of range is not trusted
}

std::string ShmSegment::describe_rank(int peer) const {
  const char state = process_state(pids_[peer]);
  const char* note = state == 'T' || state == 't' ? ", stopped" : state == 'Z' || state == 'X' ? ", dead" : "";
  return c10::str("rank ", ranks_[peer], " (pid ", pids_[peer], note, ")");
}

std::vector<int> ShmSegment::awaited_peers(const WaitContext& context) const {
  std::vector<int> missing;
  if (context.awaited == WaitContext::Awaited::kPeer) {
    if (context.peer >= 0 && context.peer < size_ && context.peer != rank_) missing.push_back(context.peer);
    return missing;
  }
  for (int peer = 0; peer < size_; ++peer) {
    if (peer == rank_) continue;
    const Signal& counter =
        context.awaited == WaitContext::Awaited::kArrived ? control(peer).arrived : control(peer).reduced;
    if (!reached(counter.value.load(std::memory_order_acquire), context.step)) missing.push_back(peer);
  }
  return missing;
}

std::string ShmSegment::describe_awaited(const WaitContext& context) const {
  const std::vector<int> missing = awaited_peers(context);
  if (missing.empty()) return "the peers";
  std::string text;
  for (size_t i = 0; i < missing.size(); ++i) {
    text += (i == 0 ? "" : i + 1 == missing.size() ? " and " : ", ") + describe_rank(missing[i]);
  }
  return text;
}

void ShmSegment::check_peers(const WaitContext& context, const std::function<bool()>& ready) const {
  // Note [Only an awaited peer is blamed]
  for (const int peer : awaited_peers(context)) {
    if (process_alive(pids_[peer])) continue;
    // It may have posted what this wait lacks just before it exited: it failed only if that is missing.
    if (ready()) return;
    const int dead = blame(peer);
    const std::string why = c10::str("rank ", ranks_[dead], " (pid ", pids_[dead], ") failed: the process died");
    mark_broken(why);
    TORCH_CHECK(false, "ddpkit.", context.what, " (", where(), "): ", why,
                " during the collective (shared-memory transport)");
  }
  const std::string given_up = peer_failure();
  if (!given_up.empty()) {
    const std::string awaited = describe_awaited(context);
    mark_broken(given_up);
    TORCH_CHECK(false, "ddpkit.", context.what, " (", where(), "): waiting for ", awaited, " failed: ", given_up,
                "; destroy the group and create a new one");
  }
  check_usable(context.what);
  if (std::chrono::steady_clock::now() > context.deadline) {
    const std::string awaited = describe_awaited(context);
    mark_broken(c10::str("no progress within the timeout (", timeout().count(), " ms) waiting for ", awaited));
    TORCH_CHECK(false, "ddpkit.", context.what, " (", where(), "): waiting for ", awaited,
                " failed: no progress within the timeout (", timeout().count(),
                " ms); they stopped calling this collective or called another one");
  }
}

}  // namespace ddpkit::comm
