#include "comm/shm.h"
#include "comm/communicator.h"
#include "comm/faults.h"

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>
#include <thread>
#include <unordered_map>

namespace ddpkit::comm {
namespace {

constexpr size_t kLine = 128;               // two cache lines: no false sharing with the adjacent-line prefetcher
constexpr int64_t kChannelSlots = 4;
constexpr auto kSpinMicros = std::chrono::microseconds(30);
constexpr int kLivenessMillis = 50;
constexpr size_t kSlotHeaderBytes = kLine;  // a CollectiveHeader, padded
// Small enough that a chunk is still in cache when peers reduce it and when it is copied out (a 2-vCPU
// EPYC VM, 16M floats at n=2: 256 KiB slots ran 11 ms, 1 MiB 29 ms, 4 MiB 33 ms); the extra steps
// cost a barrier each, about a microsecond when the ranks have cores.
constexpr int64_t kSlotBytes = 256 << 10;
constexpr int64_t kDirectWholeBytes = 128 << 10;  // Note [Direct all-reduce]; DDPKIT_SHM_WHOLE_BYTES overrides
static_assert(sizeof(CollectiveHeader) <= kSlotHeaderBytes);

size_t round_up(size_t x, size_t to) { return (x + to - 1) / to * to; }

int64_t env_bytes(const char* name, int64_t fallback) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') return fallback;
  const int64_t parsed = std::atoll(value);
  TORCH_CHECK(parsed >= 4096, "ddpkit: ", name, "=", value, " must be at least 4096 bytes");
  return static_cast<int64_t>(round_up(static_cast<size_t>(parsed), kLine));
}

// True when the 32-bit counter `value` has reached `target` (counters wrap).
bool reached(uint32_t value, uint32_t target) { return static_cast<int32_t>(value - target) >= 0; }

void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

void futex_wait(std::atomic<uint32_t>* word, uint32_t expected, int millis) {
  timespec timeout{millis / 1000, (millis % 1000) * 1000000L};
  // Not FUTEX_PRIVATE_FLAG: the word is shared between processes.
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &timeout, nullptr, 0);
}

void futex_wake_all(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

std::string read_first_line(const char* path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

// Processes that can share a segment: same kernel boot, same /dev/shm, same pid namespace (so that
// the pids published for the liveness check mean the same process to every rank).
std::string host_identity() {
  char hostname[256] = {0};
  gethostname(hostname, sizeof(hostname) - 1);
  struct stat shm {};
  stat("/dev/shm", &shm);
  struct stat pid_ns {};
  stat("/proc/self/ns/pid", &pid_ns);
  return c10::str(hostname, "|", read_first_line("/proc/sys/kernel/random/boot_id"), "|", shm.st_dev, ":", shm.st_ino,
                  "|", pid_ns.st_ino);
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

// Balanced split of `numel` elements into `parts` slices (the same rule as the ring's chunks).
int64_t slice_start(int64_t numel, int64_t parts, int64_t i) { return i * (numel / parts) + std::min(i, numel % parts); }

// out[i] = src[0][i] op src[1][i] op ... op src[n-1][i] (then / n for kMean), in the order given, so
// the bits depend only on the inputs and that order. `out` may be src[0], no other source. Blocks
// keep `out` in L1 across the passes; `also` (when not null) receives a copy of each finished block
// from L1, which costs only its writes.
template <class T>
void reduce_sources(T* out, const std::vector<const char*>& sources, int64_t offset_elems, int64_t count, ReduceOp op,
                    T* also) {
  constexpr int64_t kBlock = 4096 / sizeof(T) * 4;
  const int n = static_cast<int>(sources.size());
  for (int64_t b = 0; b < count; b += kBlock) {
    const int64_t m = std::min(kBlock, count - b);
    T* o = out + b;
    const T* s0 = reinterpret_cast<const T*>(sources[0]) + offset_elems + b;
    if (n == 1) {
      if (o != s0) std::memmove(o, s0, m * sizeof(T));
    }
    for (int j = 1; j < n; ++j) {
      const T* a = j == 1 ? s0 : o;
      const T* s = reinterpret_cast<const T*>(sources[j]) + offset_elems + b;
      switch (op) {
        case ReduceOp::kSum:
        case ReduceOp::kMean:
          for (int64_t i = 0; i < m; ++i) o[i] = a[i] + s[i];
          break;
        case ReduceOp::kMax:
          for (int64_t i = 0; i < m; ++i) o[i] = reduce_value(a[i], s[i], ReduceOp::kMax);
          break;
        case ReduceOp::kMin:
          for (int64_t i = 0; i < m; ++i) o[i] = reduce_value(a[i], s[i], ReduceOp::kMin);
          break;
      }
    }
    if (op == ReduceOp::kMean) {
      if constexpr (std::is_floating_point_v<T>) {
        const T divisor = static_cast<T>(n);
        for (int64_t i = 0; i < m; ++i) o[i] = o[i] / divisor;
      }
    }
    if (also != nullptr) std::memcpy(also + b, o, m * sizeof(T));
  }
}

void reduce_sources(at::ScalarType dtype, char* out, const std::vector<const char*>& sources, int64_t offset_elems,
                    int64_t count, ReduceOp op, char* also = nullptr) {
  switch (dtype) {
    case at::kFloat:
      return reduce_sources(reinterpret_cast<float*>(out), sources, offset_elems, count, op, reinterpret_cast<float*>(also));
    case at::kDouble:
      return reduce_sources(reinterpret_cast<double*>(out), sources, offset_elems, count, op,
                            reinterpret_cast<double*>(also));
    case at::kInt:
      return reduce_sources(reinterpret_cast<int32_t*>(out), sources, offset_elems, count, op,
                            reinterpret_cast<int32_t*>(also));
    case at::kLong:
      return reduce_sources(reinterpret_cast<int64_t*>(out), sources, offset_elems, count, op,
                            reinterpret_cast<int64_t*>(also));
    default: TORCH_INTERNAL_ASSERT(false, "the direct all-reduce reduces float32/64 and int32/64, got ", dtype);
  }
}

struct ChunkHeader {
  int64_t tag;
  int64_t total;   // bytes of the whole message
  int64_t offset;  // of this chunk in the message
  int64_t length;  // of this chunk
};
constexpr size_t kChunkHeaderBytes = 64;
static_assert(sizeof(ChunkHeader) <= kChunkHeaderBytes);

}  // namespace

struct ShmSegment::RankControl {
  alignas(kLine) Signal arrived;  // steps whose slot this rank has filled (Note [Direct all-reduce])
  alignas(kLine) Signal reduced;  // steps whose slice this rank has reduced
  alignas(kLine) Signal doorbell; // bumped when a chunk arrives for this rank, or one it sent was taken
};

struct ShmSegment::Channel {
  alignas(kLine) std::atomic<uint64_t> head;  // chunks written by the sender
  alignas(kLine) std::atomic<uint64_t> tail;  // chunks taken by the receiver
  alignas(kLine) char chunks[1];              // kChannelSlots x (ChunkHeader + chunk bytes)
};

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

constexpr uint64_t kSegmentMagic = 0x31306d6873706464;  // "ddpshm01"
// Round tags of the set-up's messages, inside the collective that sets the segment up (Note [Tags]).
constexpr int kHelloRound = 250;
constexpr int kOfferRound = 251;
constexpr int kAckRound = 252;
constexpr int kVerdictRound = 253;
constexpr size_t kIdentityBytes = 512;
constexpr size_t kBrokenWhyBytes = 512;

enum SetupStatus : int64_t { kSetupOk = 1, kNotShared = 2, kSetupFailed = 3 };
// Why a rank could not take part; one table, so that every rank words a failure alike.
enum SetupFailure : int64_t {
  kNoFailure = 0,
  kCreateFailed,
  kOpenFailed,
  kNotRegularFile,
  kWrongOwner,
  kWrongMode,
  kWrongSize,
  kMapFailed,
  kWrongHeader,
  kPeerFailed,
};

std::string describe_failure(int64_t failure, int64_t error_number) {
  const std::string errno_text = error_number != 0 ? c10::str(": ", std::strerror(static_cast<int>(error_number))) : "";
  switch (failure) {
    case kCreateFailed: return c10::str("creating the segment (memfd_create, ftruncate, mmap) failed", errno_text);
    case kOpenFailed: return c10::str("opening rank 0's segment through /proc failed", errno_text);
    case kNotRegularFile: return "the descriptor rank 0 named is not a regular file";
    case kWrongOwner: return "the segment is not owned by this rank's user";
    case kWrongMode: return "the segment's mode is not 0600";
    case kWrongSize: return "the segment does not have the size rank 0 announced";
    case kMapFailed: return c10::str("mapping the segment failed", errno_text);
    case kWrongHeader: return "the segment's header (magic, layout or nonce) is not the one rank 0 announced";
    case kPeerFailed: return "it died or stopped answering during the set-up";
  }
  return c10::str("unknown failure ", failure);
}

struct Hello {
  int64_t pid;
  int64_t euid;
  char identity[kIdentityBytes];
};

struct Offer {
  int64_t status;  // SetupStatus
  int64_t failure;  // SetupFailure, with status kSetupFailed
  int64_t failed_rank;
  int64_t error_number;
  int64_t pid;     // of rank 0
  int64_t fd;      // rank 0's descriptor of the segment
  int64_t bytes;
  uint64_t nonce[2];
  int64_t slot_bytes;
  int64_t whole_bytes;
  int64_t chunk_bytes;
  // followed by one int64 pid per rank
};

struct Answer {  // a rank's acknowledgement to rank 0, and rank 0's verdict to every rank
  int64_t status;
  int64_t failure;
  int64_t failed_rank;
  int64_t error_number;
};

template <class T>
at::Tensor message_of(const T& value, size_t extra_bytes = 0) {
  at::Tensor bytes = at::zeros({static_cast<int64_t>(sizeof(T) + extra_bytes)}, at::kByte);
  std::memcpy(bytes.data_ptr(), &value, sizeof(T));
  return bytes;
}

template <class T>
T value_of(const at::Tensor& bytes) {
  TORCH_INTERNAL_ASSERT(bytes.numel() >= static_cast<int64_t>(sizeof(T)));
  T value;
  std::memcpy(&value, bytes.data_ptr(), sizeof(T));
  return value;
}

// A set-up failure of this rank: what it tells rank 0, and the error it raises itself.
struct LocalFailure {
  int64_t failure = kNoFailure;
  int64_t error_number = 0;
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

// What fixes the segment's layout: decided by rank 0 (its environment) and sent to every rank.
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

std::shared_ptr<ShmSegment> ShmSegment::create(Communicator& setup, std::chrono::milliseconds timeout) {
  const int rank = setup.rank();
  const int size = setup.size();
  const std::string identity = host_identity();
  Hello mine{};
  mine.pid = getpid();
  mine.euid = static_cast<int64_t>(geteuid());
  std::memcpy(mine.identity, identity.data(), std::min(identity.size(), kIdentityBytes - 1));
  const auto what = [&] { return c10::str("ddpkit.", setup.what(), " (", setup.where(), ")"); };
  const std::string hint = "; set DDPKIT_TRANSPORT=process_group to run without shared memory";
  const int64_t offer_bytes = static_cast<int64_t>(sizeof(Offer)) + 8 * size;

  std::shared_ptr<ShmSegment> segment(new ShmSegment());
  segment->rank_ = rank;
  segment->size_ = size;
  segment->group_ = setup.group();
  segment->timeout_ = timeout;
  segment->spin_ = size <= static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));

  if (rank != 0) {
    faults::die_if_armed("die_at_hello", rank);
    MessageList messages;
    at::Tensor offer_message = at::empty({offer_bytes}, at::kByte);
    messages.push_back(setup.irecv(offer_message, 0, kOfferRound));
    messages.push_back(setup.isend(message_of(mine), 0, kHelloRound));
    setup.wait(messages);
    const Offer offer = value_of<Offer>(offer_message);
    if (offer.status == kNotShared) return nullptr;
    TORCH_CHECK(offer.status == kSetupOk, what(), ": rank ", offer.failed_rank, " failed: ",
                describe_failure(offer.failure, offer.error_number), " (rank 0 reported it)", hint);
    const int64_t* pids = reinterpret_cast<const int64_t*>(offer_message.data_ptr<uint8_t>() + sizeof(Offer));
    segment->pids_.assign(pids, pids + size);
    const Layout layout{size, offer.slot_bytes, offer.whole_bytes, offer.chunk_bytes};
    LocalFailure failed;
    if (!layout.valid() || static_cast<int64_t>(layout.bytes()) != offer.bytes) {
      failed.failure = kWrongSize;
    } else {
      const std::string path = c10::str("/proc/", offer.pid, "/fd/", offer.fd);
      const int fd = open(path.c_str(), O_RDWR | O_CLOEXEC);
      struct stat info {};
      if (fd < 0) {
        failed = {kOpenFailed, errno};
      } else if (fstat(fd, &info) != 0) {
        failed = {kOpenFailed, errno};
      } else if (!S_ISREG(info.st_mode)) {
        failed.failure = kNotRegularFile;
      } else if (info.st_uid != geteuid()) {
        failed.failure = kWrongOwner;
      } else if ((info.st_mode & 07777) != 0600) {
        failed.failure = kWrongMode;
      } else if (info.st_size != offer.bytes) {
        failed.failure = kWrongSize;
      } else {
        try {
          segment->map(fd, static_cast<size_t>(offer.bytes), layout);
        } catch (const c10::Error&) {
          failed.failure = kMapFailed;
        }
        if (failed.failure == kNoFailure) {
          const SegmentHeader& header = segment->header();
          const bool matches = header.magic == kSegmentMagic && header.nonce[0] == offer.nonce[0] &&
                               header.nonce[1] == offer.nonce[1] && header.bytes == offer.bytes &&
                               header.size == size && header.slot_bytes == layout.slot_bytes &&
                               header.whole_bytes == layout.whole_bytes && header.chunk_bytes == layout.chunk_bytes;
          if (!matches) failed.failure = kWrongHeader;
        }
      }
      if (fd >= 0) close(fd);  // the mapping keeps the memory
    }
    if (failed.failure != kNoFailure && segment->base_ != nullptr) {
      munmap(segment->base_, segment->bytes_);
      segment->base_ = nullptr;
    }
    const bool ok = failed.failure == kNoFailure;
    faults::die_if_armed("die_at_map", rank);
    at::Tensor verdict_message = at::empty({static_cast<int64_t>(sizeof(Answer))}, at::kByte);
    messages.push_back(setup.irecv(verdict_message, 0, kVerdictRound));
    messages.push_back(setup.isend(
        message_of(Answer{ok ? kSetupOk : kSetupFailed, failed.failure, rank, failed.error_number}), 0, kAckRound));
    setup.wait(messages);
    TORCH_CHECK(ok, what(), ": ", describe_failure(failed.failure, failed.error_number), hint);
    const Answer verdict = value_of<Answer>(verdict_message);
    TORCH_CHECK(verdict.status == kSetupOk, what(), ": rank ", verdict.failed_rank, " failed: ",
                describe_failure(verdict.failure, verdict.error_number), " (rank 0 reported it)", hint);
    return segment;
  }

  // Rank 0. Tells every peer but `skip` that `failed_rank` failed, as best it can (a peer it cannot
  // reach fails on its own), so that none waits out the group's timeout.
  auto tell_failure = [&](auto&& make_message, int round, int skip) {
    for (int peer = 1; peer < size; ++peer) {
      if (peer == skip) continue;
      MessageList one;
      try {
        one.push_back(setup.isend(make_message(), peer, round));
        setup.wait(one);
      } catch (const std::exception&) {
      }
    }
  };
  auto failed_offer = [&](int64_t failure, int64_t failed_rank, int64_t error_number) {
    Offer offer{};
    offer.status = kSetupFailed;
    offer.failure = failure;
    offer.failed_rank = failed_rank;
    offer.error_number = error_number;
    return message_of(offer, 8 * static_cast<size_t>(size));
  };

  std::vector<at::Tensor> hellos(size);
  MessageList messages;
  try {
    for (int peer = 1; peer < size; ++peer) {
      hellos[peer] = at::empty({static_cast<int64_t>(sizeof(Hello))}, at::kByte);
      messages.push_back(setup.irecv(hellos[peer], peer, kHelloRound));
    }
    setup.wait(messages);
  } catch (...) {
    abort_all(messages);
    const int failed = setup.failed_peer();
    tell_failure([&] { return failed_offer(kPeerFailed, failed, 0); }, kOfferRound, failed);
    throw;
  }
  std::vector<int64_t> pids(size);
  pids[0] = mine.pid;
  bool shared = true;
  for (int peer = 1; peer < size; ++peer) {
    const Hello hello = value_of<Hello>(hellos[peer]);
    pids[peer] = hello.pid;
    shared = shared && hello.euid == mine.euid &&
             std::memcmp(hello.identity, mine.identity, kIdentityBytes) == 0;
  }
  if (!shared) {
    Offer offer{};
    offer.status = kNotShared;
    tell_failure([&] { return message_of(offer, 8 * static_cast<size_t>(size)); }, kOfferRound, -1);
    return nullptr;
  }
  segment->pids_.assign(pids.begin(), pids.end());

  // Note [Direct all-reduce]: two slots per rank; Note [Shared-memory messages]: kChannelSlots
  // chunks per ordered pair, shrinking with the world size, so the whole segment stays bounded.
  const Layout layout{size, env_bytes("DDPKIT_SHM_SLOT_BYTES", kSlotBytes),
                      env_bytes("DDPKIT_SHM_WHOLE_BYTES", kDirectWholeBytes),
                      env_bytes("DDPKIT_SHM_CHUNK_BYTES",
                                std::clamp<int64_t>(round_up((1 << 20) / std::max(1, size - 1), kLine), 64 << 10,
                                                    512 << 10))};
  TORCH_CHECK(layout.valid(), what(), ": the DDPKIT_SHM_* sizes give an invalid layout");
  const size_t bytes = layout.bytes();
  std::random_device random;
  uint64_t nonce[2];
  for (uint64_t& word : nonce) word = (static_cast<uint64_t>(random()) << 32) ^ random();
  const int fd = memfd_create("ddpkit", MFD_CLOEXEC);
  int error_number = fd < 0 ? errno : 0;
  if (fd >= 0 && (fchmod(fd, 0600) != 0 || ftruncate(fd, static_cast<off_t>(bytes)) != 0)) error_number = errno;
  if (error_number == 0) {
    try {
      segment->map(fd, bytes, layout);
    } catch (const c10::Error&) {
      error_number = errno != 0 ? errno : EINVAL;
    }
  }
  struct CloseAtExit {
    int fd;
    ~CloseAtExit() {
      if (fd >= 0) close(fd);
    }
  } close_at_exit{fd};  // the mapping keeps the memory; the descriptor is only for the peers' open
  if (error_number != 0) {
    tell_failure([&] { return failed_offer(kCreateFailed, 0, error_number); }, kOfferRound, -1);
    TORCH_CHECK(false, what(), ": ", describe_failure(kCreateFailed, error_number), hint);
  }
  SegmentHeader& header = segment->header();
  header.magic = kSegmentMagic;
  header.nonce[0] = nonce[0];
  header.nonce[1] = nonce[1];
  header.bytes = static_cast<int64_t>(bytes);
  header.size = size;
  header.slot_bytes = layout.slot_bytes;
  header.whole_bytes = layout.whole_bytes;
  header.chunk_bytes = layout.chunk_bytes;

  Offer offer{};
  offer.status = kSetupOk;
  offer.pid = mine.pid;
  offer.fd = fd;
  offer.bytes = static_cast<int64_t>(bytes);
  offer.nonce[0] = nonce[0];
  offer.nonce[1] = nonce[1];
  offer.slot_bytes = layout.slot_bytes;
  offer.whole_bytes = layout.whole_bytes;
  offer.chunk_bytes = layout.chunk_bytes;
  faults::die_if_armed("die_at_offer", rank);
  at::Tensor offer_message = message_of(offer, 8 * static_cast<size_t>(size));
  std::memcpy(offer_message.data_ptr<uint8_t>() + sizeof(Offer), pids.data(), 8 * static_cast<size_t>(size));
  std::vector<at::Tensor> acks(size);
  try {
    for (int peer = 1; peer < size; ++peer) {
      acks[peer] = at::empty({static_cast<int64_t>(sizeof(Answer))}, at::kByte);
      messages.push_back(setup.irecv(acks[peer], peer, kAckRound));
      messages.push_back(setup.isend(offer_message, peer, kOfferRound));
    }
    setup.wait(messages);
  } catch (...) {
    abort_all(messages);
    const int failed = setup.failed_peer();
    tell_failure([&] { return message_of(Answer{kSetupFailed, kPeerFailed, failed, 0}); }, kVerdictRound, failed);
    throw;
  }
  Answer verdict{kSetupOk, kNoFailure, -1, 0};
  for (int peer = 1; peer < size && verdict.status == kSetupOk; ++peer) {
    const Answer ack = value_of<Answer>(acks[peer]);
    if (ack.status != kSetupOk) verdict = Answer{kSetupFailed, ack.failure, peer, ack.error_number};
  }
  faults::die_if_armed("die_at_verdict", rank);
  at::Tensor verdict_message = message_of(verdict);
  for (int peer = 1; peer < size; ++peer) messages.push_back(setup.isend(verdict_message, peer, kVerdictRound));
  setup.wait(messages);
  TORCH_CHECK(verdict.status == kSetupOk, what(), ": rank ", verdict.failed_rank, " failed: ",
              describe_failure(verdict.failure, verdict.error_number), hint);
  return segment;
}

void ShmSegment::map(int fd, size_t bytes, const Layout& layout) {
  errno = 0;
  void* address = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int error = errno;
  TORCH_CHECK(address != MAP_FAILED, "ddpkit: mapping the shared-memory segment (", bytes, " bytes) failed: ",
              std::strerror(error));
  base_ = static_cast<char*>(address);
  bytes_ = bytes;
  slot_bytes_ = layout.slot_bytes;
  whole_bytes_ = layout.whole_bytes;
  chunk_bytes_ = layout.chunk_bytes;
  channel_slots_ = kChannelSlots;
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
  if (base_ != nullptr) munmap(base_, bytes_);
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
  // Every peer stops too, at its next collective or within a liveness period of its current wait,
  // and says why (peer_failure).
  SegmentHeader& shared = header();
  int32_t none = 0;
  if (shared.broken_by.compare_exchange_strong(none, -(rank_ + 1))) {
    const size_t length = std::min(why.size(), kBrokenWhyBytes - 1);
    std::memcpy(shared.broken_why, why.data(), length);
    shared.broken_why[length] = '\0';
    shared.broken_by.store(rank_ + 1, std::memory_order_release);
  }
}

std::string ShmSegment::peer_failure() const {
  const int32_t by = header().broken_by.load(std::memory_order_acquire);
  const int rank = by > 0 ? by - 1 : -by - 1;
  if (by == 0 || rank == rank_ || rank < 0 || rank >= size_) return {};
  if (by < 0) return c10::str("rank ", rank, "'s shared-memory transport failed");
  char why[kBrokenWhyBytes];
  std::memcpy(why, header().broken_why, kBrokenWhyBytes);
  why[kBrokenWhyBytes - 1] = '\0';  // whatever the segment holds, read no further
  return c10::str("rank ", rank, " gave up: ", why);
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
  TORCH_CHECK(false, "ddpkit.", what, " (", where(),
              "): this process group's shared-memory transport failed (", why,
              "); destroy the group and create a new one");
}

std::string ShmSegment::where() const { return c10::str("rank ", rank_, " of ", size_, " in group '", group_, "'"); }

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
  return c10::str("rank ", peer, " (pid ", pids_[peer], note, ")");
}

std::string ShmSegment::describe_awaited(const WaitContext& context) const {
  std::vector<int> missing;
  if (context.awaited == WaitContext::Awaited::kPeer) {
    if (context.peer >= 0) missing.push_back(context.peer);
  } else {
    for (int peer = 0; peer < size_; ++peer) {
      if (peer == rank_) continue;
      const Signal& counter = context.awaited == WaitContext::Awaited::kArrived ? control(peer).arrived : control(peer).reduced;
      if (!reached(counter.value.load(std::memory_order_acquire), context.step)) missing.push_back(peer);
    }
  }
  if (missing.empty()) return "the peers";
  std::string text;
  for (size_t i = 0; i < missing.size(); ++i) {
    text += (i == 0 ? "" : i + 1 == missing.size() ? " and " : ", ") + describe_rank(missing[i]);
  }
  return text;
}

void ShmSegment::check_peers(const WaitContext& context) const {
  for (int peer = 0; peer < size_; ++peer) {
    if (peer == rank_ || process_alive(pids_[peer])) continue;
    const int dead = blame(peer);
    const std::string why = c10::str("rank ", dead, " (pid ", pids_[dead], ") failed: the process died");
    mark_broken(why);
    TORCH_CHECK(false, "ddpkit.", context.what, " (", where(), "): ", why,
                " during the collective (shared-memory transport)");
  }
  const std::string given_up = peer_failure();
  if (!given_up.empty()) {
    const std::string awaited = describe_awaited(context);
    mark_broken(given_up);
    TORCH_CHECK(false, "ddpkit.", context.what, " (", where(), "): waiting for ", awaited,
                " failed: ", given_up, "; destroy the group and create a new one");
  }
  check_usable(context.what);
  if (std::chrono::steady_clock::now() > context.deadline) {
    const std::string awaited = describe_awaited(context);
    mark_broken(c10::str("no progress within the group's timeout (", timeout_.count(), " ms) waiting for ", awaited));
    TORCH_CHECK(false, "ddpkit.", context.what, " (", where(), "): waiting for ", awaited,
                " failed: no progress within the group's timeout (", timeout_.count(),
                " ms); they stopped calling this collective or called another one");
  }
}

template <class Ready>
void ShmSegment::wait_for(Signal& signal, Ready ready, const WaitContext& context) const {
  if (ready()) return;
  // Note [Waiting on shared memory]
  if (spin_) {
    const auto spin_until = std::chrono::steady_clock::now() + kSpinMicros;
    for (int i = 1;; ++i) {
      cpu_relax();
      if (ready()) return;
      if ((i & 63) == 0 && std::chrono::steady_clock::now() > spin_until) break;
    }
  }
  auto next_check = std::chrono::steady_clock::now() + std::chrono::milliseconds(kLivenessMillis);
  for (;;) {
    const uint32_t observed = signal.value.load(std::memory_order_seq_cst);
    if (ready()) return;
    signal.sleepers.fetch_add(1, std::memory_order_seq_cst);
    if (signal.value.load(std::memory_order_seq_cst) == observed) futex_wait(&signal.value, observed, kLivenessMillis);
    signal.sleepers.fetch_sub(1, std::memory_order_seq_cst);
    if (ready()) return;
    const auto now = std::chrono::steady_clock::now();
    if (now >= next_check) {
      check_peers(context);
      next_check = now + std::chrono::milliseconds(kLivenessMillis);
    }
  }
}

// Note [Direct all-reduce]
// The all-reduce that shared memory makes possible: no messages, every rank reads its peers' data
// where they published it. Per chunk of at most slot_bytes():
//  1. each rank copies its chunk into its own slot (with its header, for the first chunk) and posts
//     `arrived`; it waits for every peer's `arrived` (with the check: compares all headers);
//  2. small chunks (n·bytes <= kDirectWholeBytes): every rank reduces the whole chunk from all
//     slots straight into its tensor, in rank order: one barrier, identical bits everywhere;
//     larger ones: rank r reduces its 1/n slice r from its own tensor and the peers' slots into its
//     tensor, writing each finished block also into its slot's slice r, posts `reduced`, and copies
//     every slice j from rank j's slot once j has posted it. Step 1 then copies in only the slices
//     the peers reduce. Per rank: (n-1)/n of the chunk copied in, one reduce pass over 1/n of it
//     from n sources, (n-1)/n copied out. At n=2 that is 4 chunk-sized memory passes per rank
//     against the whole-chunk path's 5; it costs a second barrier per chunk, which only matters
//     for small chunks: the whole path is kept up to n·bytes = 128 KiB (measured on the 2-vCPU VM,
//     16M floats: n=2 8.2 ms sliced vs 12.1 ms whole, n=4 31 vs 52 ms; 100k-1M no worse).
// Each step alternates between the rank's two slots; a rank writes slot s again only two steps
// later, after passing the next step's barrier, i.e. after every peer has finished reading it.
// Every rank takes the same number of steps per collective (the numel is checked on the first), so
// the step counters stay equal on all ranks, also after a mismatch has been reported.
void ShmSegment::all_reduce(at::Tensor& flat, ReduceOp op, const CollectiveHeader& header,
                            const std::string& local_error, bool checked) {
  constexpr std::string_view kWhat = "all_reduce";
  check_usable(kWhat);
  const bool rejected = !local_error.empty();
  if (rejected && !checked) reject_unchecked(kWhat);
  TORCH_CHECK(checked || !rejected, local_error);
  const WaitContext context{this, std::chrono::steady_clock::now() + timeout_, kWhat};
  const at::ScalarType dtype = rejected ? at::kByte : flat.scalar_type();
  const int64_t element = rejected ? 1 : static_cast<int64_t>(flat.element_size());
  const int64_t numel = rejected ? 0 : flat.numel();
  char* const data = rejected || numel == 0 ? nullptr : static_cast<char*>(flat.data_ptr());
  const int64_t chunk_elems = slot_bytes_ / element;
  const int64_t chunks = std::max<int64_t>(1, (numel + chunk_elems - 1) / chunk_elems);
  std::vector<const char*> sources(size_);
  for (int64_t c = 0; c < chunks; ++c) {
    const uint32_t target = ++step_;
    const int set = static_cast<int>(target & 1);
    const int64_t begin = c * chunk_elems;
    const int64_t count = std::min(chunk_elems, numel - begin);
    const bool whole = count * element * size_ <= whole_bytes_;
    const int64_t start = slice_start(count, size_, rank_);
    const int64_t length = slice_start(count, size_, rank_ + 1) - start;
    char* const chunk = data == nullptr ? nullptr : data + begin * element;
    char* mine = slot(rank_, set);
    if (c == 0) slot_header(rank_, set) = header;
    if (count > 0 && whole) {
      std::memcpy(mine, chunk, count * element);
    } else if (count > 0) {
      // Only the slices the peers reduce: this rank reads its own slice from its tensor (below).
      std::memcpy(mine, chunk, start * element);
      std::memcpy(mine + (start + length) * element, chunk + (start + length) * element,
                  (count - start - length) * element);
    }
    arrive_and_wait(target, context);
    if (c == 0 && checked) compare_headers(set, local_error, kWhat);
    if (count == 0) continue;
    for (int peer = 0; peer < size_; ++peer) sources[peer] = slot(peer, set);
    if (whole) {
      reduce_sources(dtype, chunk, sources, 0, count, op);
      // Not waited on here, but kept current so that a later sliced step never compares a stale,
      // wrapped-around counter.
      control(rank_).reduced.value.store(target, std::memory_order_release);
      continue;
    }
    // This rank's slice, reduced by this rank alone (so every rank gets the same bits), in place in
    // its tensor, which comes first among the sources (`out` may only alias the first), and copied
    // block by block from L1 into its slot for the peers.
    sources[rank_] = chunk;
    std::rotate(sources.begin(), sources.begin() + rank_, sources.begin() + rank_ + 1);
    reduce_sources(dtype, chunk + start * element, sources, start, length, op, mine + start * element);
    std::rotate(sources.begin(), sources.begin() + 1, sources.begin() + rank_ + 1);
    control(rank_).reduced.post(target);
    WaitContext reductions = context;
    reductions.awaited = WaitContext::Awaited::kReduced;
    reductions.step = target;
    for (int peer = 0; peer < size_; ++peer) {
      if (peer == rank_) continue;
      Signal& reduced = control(peer).reduced;
      wait_for(reduced, [&] { return reached(reduced.value.load(std::memory_order_acquire), target); }, reductions);
      const int64_t their_start = slice_start(count, size_, peer);
      const int64_t their_length = slice_start(count, size_, peer + 1) - their_start;
      std::memcpy(chunk + their_start * element, sources[peer] + their_start * element, their_length * element);
    }
  }
}

void ShmSegment::all_gather(const at::Tensor& output, const at::Tensor& input, const CollectiveHeader& header,
                            const std::string& local_error, bool checked) {
  constexpr std::string_view kWhat = "all_gather_into_tensor";
  check_usable(kWhat);
  const bool rejected = !local_error.empty();
  if (rejected && !checked) reject_unchecked(kWhat);
  TORCH_CHECK(checked || !rejected, local_error);
  const WaitContext context{this, std::chrono::steady_clock::now() + timeout_, kWhat};
  const int64_t bytes = rejected ? 0 : static_cast<int64_t>(input.numel() * input.element_size());
  const char* const in = bytes == 0 ? nullptr : static_cast<const char*>(input.data_ptr());
  char* const out = bytes == 0 ? nullptr : static_cast<char*>(output.data_ptr());
  const int64_t steps = std::max<int64_t>(1, (bytes + slot_bytes_ - 1) / slot_bytes_);
  for (int64_t c = 0; c < steps; ++c) {
    const uint32_t target = ++step_;
    const int set = static_cast<int>(target & 1);
    const int64_t begin = c * slot_bytes_;
    const int64_t length = std::min(slot_bytes_, bytes - begin);
    if (c == 0) slot_header(rank_, set) = header;
    if (length > 0) std::memcpy(slot(rank_, set), in + begin, length);
    arrive_and_wait(target, context);
    if (c == 0 && checked) compare_headers(set, local_error, kWhat);
    if (length <= 0) continue;
    for (int peer = 0; peer < size_; ++peer) {
      char* to = out + peer * bytes + begin;
      const char* from = peer == rank_ ? in + begin : slot(peer, set);
      if (to != from) std::memcpy(to, from, length);  // in place, this rank's block is already there
    }
  }
}

void ShmSegment::reduce_scatter(const at::Tensor& output, const at::Tensor& input, ReduceOp op,
                                const CollectiveHeader& header, const std::string& local_error, bool checked) {
  constexpr std::string_view kWhat = "reduce_scatter_tensor";
  check_usable(kWhat);
  const bool rejected = !local_error.empty();
  if (rejected && !checked) reject_unchecked(kWhat);
  TORCH_CHECK(checked || !rejected, local_error);
  const WaitContext context{this, std::chrono::steady_clock::now() + timeout_, kWhat};
  const at::ScalarType dtype = rejected ? at::kByte : output.scalar_type();
  const int64_t element = rejected ? 1 : static_cast<int64_t>(output.element_size());
  const int64_t block = rejected ? 0 : output.numel();  // elements per rank
  const char* const in = block == 0 ? nullptr : static_cast<const char*>(input.data_ptr());
  char* const out = block == 0 ? nullptr : static_cast<char*>(output.data_ptr());
  // Each step carries a piece of every block: n pieces of `piece` elements per slot, cache-line aligned.
  const int64_t piece = std::max<int64_t>(1, (slot_bytes_ / size_) / static_cast<int64_t>(kLine) * static_cast<int64_t>(kLine) / element);
  const int64_t steps = std::max<int64_t>(1, (block + piece - 1) / piece);
  std::vector<const char*> sources(size_);
  for (int64_t c = 0; c < steps; ++c) {
    const uint32_t target = ++step_;
    const int set = static_cast<int>(target & 1);
    const int64_t begin = c * piece;
    const int64_t count = std::min(piece, block - begin);
    char* const mine = slot(rank_, set);
    if (c == 0) slot_header(rank_, set) = header;
    for (int peer = 0; count > 0 && peer < size_; ++peer) {
      if (peer == rank_) continue;  // this rank's own block is read from its input below
      std::memcpy(mine + peer * piece * element, in + (peer * block + begin) * element, count * element);
    }
    arrive_and_wait(target, context);
    if (c == 0 && checked) compare_headers(set, local_error, kWhat);
    if (count <= 0) continue;
    // This rank's own piece first: the output may be that very piece (in place), and reduce_sources
    // lets `out` alias only its first source.
    sources[0] = in + (rank_ * block + begin) * element;
    for (int peer = 0, next = 1; peer < size_; ++peer) {
      if (peer != rank_) sources[next++] = slot(peer, set) + rank_ * piece * element;
    }
    reduce_sources(dtype, out + begin * element, sources, 0, count, op);
  }
}

void ShmSegment::arrive_and_wait(uint32_t target, const WaitContext& context) {
  control(rank_).arrived.post(target);
  WaitContext arrivals = context;
  arrivals.awaited = WaitContext::Awaited::kArrived;
  arrivals.step = target;
  for (int peer = 0; peer < size_; ++peer) {
    if (peer == rank_) continue;
    Signal& arrived = control(peer).arrived;
    wait_for(arrived, [&] { return reached(arrived.value.load(std::memory_order_acquire), target); }, arrivals);
  }
}

void ShmSegment::compare_headers(int set, const std::string& local_error, std::string_view what) const {
  std::vector<CollectiveHeader> headers(size_);
  for (int peer = 0; peer < size_; ++peer) headers[peer] = slot_header(peer, set);
  const std::string error = describe_headers(headers.data(), size_, what);
  TORCH_CHECK(local_error.empty(), local_error);
  TORCH_CHECK(error.empty(), error);
}

void ShmSegment::check_header(const CollectiveHeader& header, const std::string& local_error, std::string_view what) {
  check_usable(what);
  const WaitContext context{this, std::chrono::steady_clock::now() + timeout_, what};
  const uint32_t target = ++step_;
  const int set = static_cast<int>(target & 1);
  slot_header(rank_, set) = header;
  arrive_and_wait(target, context);
  compare_headers(set, local_error, what);
}

// ---- Point-to-point messages (Note [Shared-memory messages]) ----

class ShmTransport::Message final : public c10d::Work {
 public:
  Message(ShmTransport* transport, bool is_send, int peer, int tag, const at::Tensor& tensor)
      : c10d::Work(-1, is_send ? c10d::OpType::SEND : c10d::OpType::RECV),
        transport_(transport),
        is_send_(is_send),
        peer_(peer),
        tag_(tag),
        tensor_(tensor),
        data_(static_cast<char*>(tensor.data_ptr())),
        total_(static_cast<int64_t>(tensor.numel() * tensor.element_size())) {}

  bool wait(std::chrono::milliseconds /*timeout*/) override {
    transport_->wait_for_message(*this, "collective");
    return true;
  }
  bool isCompleted() override {
    std::lock_guard<std::mutex> lock(transport_->mutex_);
    transport_->progress_locked();
    return done_;
  }
  bool isSuccess() const override { return done_ && error_.empty(); }
  void abort() override { transport_->abort_message(*this); }

  ShmTransport* transport_;
  const bool is_send_;
  const int peer_;
  const int tag_;
  at::Tensor tensor_;
  char* const data_;
  const int64_t total_;
  int64_t moved_ = 0;  // bytes copied into (send) or out of (receive) shared memory
  bool done_ = false;  // guarded by the transport's mutex
  std::string error_;
};

ShmTransport::ShmTransport(std::shared_ptr<ShmSegment> segment)
    : segment_(std::move(segment)),
      sends_(segment_->size()),
      recvs_(segment_->size()),
      unexpected_(segment_->size()),
      corrupt_next_chunk_(faults::armed("corrupt_chunk", segment_->rank())) {}

ShmTransport::~ShmTransport() = default;

c10::intrusive_ptr<c10d::Work> ShmTransport::send(const at::Tensor& tensor, int dst, int tag) {
  segment_->check_usable("collective");
  TORCH_INTERNAL_ASSERT(tensor.is_contiguous() && tensor.device().is_cpu());
  TORCH_INTERNAL_ASSERT(dst >= 0 && dst < segment_->size() && dst != segment_->rank());
  auto message = c10::make_intrusive<Message>(this, true, dst, tag, tensor);
  std::lock_guard<std::mutex> lock(mutex_);
  sends_[dst].push_back(message);
  progress_locked();
  return message;
}

c10::intrusive_ptr<c10d::Work> ShmTransport::recv(const at::Tensor& tensor, int src, int tag) {
  segment_->check_usable("collective");
  TORCH_INTERNAL_ASSERT(tensor.is_contiguous() && tensor.device().is_cpu());
  TORCH_INTERNAL_ASSERT(src >= 0 && src < segment_->size() && src != segment_->rank());
  auto message = c10::make_intrusive<Message>(this, false, src, tag, tensor);
  std::lock_guard<std::mutex> lock(mutex_);
  bool complete = false;
  auto found = unexpected_[src].find(tag);
  if (found != unexpected_[src].end()) {
    const Unexpected& early = found->second;
    if (early.total != message->total_) {
      message->error_ = c10::str("rank ", src, " sent ", early.total, " bytes, this rank expected ", message->total_);
      complete = true;
    } else {
      std::memcpy(message->data_, early.bytes.data(), early.bytes.size());
      message->moved_ = early.received;
      complete = early.received == early.total;
    }
    buffered_bytes_ -= static_cast<int64_t>(early.bytes.size());
    unexpected_[src].erase(found);
  }
  if (complete) {
    message->done_ = true;
  } else {
    recvs_[src].push_back(message);
  }
  progress_locked();
  return message;
}

void ShmTransport::corrupt(int peer, const std::string& what) const {
  const std::string why = c10::str("rank ", peer, "'s channel holds inconsistent data (", what, ")");
  segment_->mark_broken(why);
  C10_THROW_ERROR(Error, c10::str("ddpkit (", segment_->where(), "): the shared-memory transport failed: ", why,
                                  "; destroy the group and create a new one"));
}

bool ShmTransport::progress_locked() {
  ShmSegment& segment = *segment_;
  const int me = segment.rank();
  const int64_t chunk_bytes = segment.channel_chunk_bytes();
  const size_t chunk_stride = kChunkHeaderBytes + chunk_bytes;
  bool moved_any = false;
  for (int dst = 0; dst < segment.size(); ++dst) {
    auto& queue = sends_[dst];
    if (queue.empty()) continue;
    ShmSegment::Channel& channel = segment.channel(me, dst);
    uint64_t head = channel.head.load(std::memory_order_relaxed);
    bool pushed = false;
    while (!queue.empty()) {
      Message& message = *queue.front();
      const uint64_t tail = channel.tail.load(std::memory_order_acquire);
      if (head - tail > static_cast<uint64_t>(kChannelSlots)) {
        corrupt(dst, c10::str("its receive counter ", tail, " is not within ", kChannelSlots, " chunks of ", head));
      }
      if (head - tail == static_cast<uint64_t>(kChannelSlots)) break;
      char* chunk = channel.chunks + (head % kChannelSlots) * chunk_stride;
      const int64_t length = std::min(chunk_bytes, message.total_ - message.moved_);
      *reinterpret_cast<ChunkHeader*>(chunk) = ChunkHeader{message.tag_, message.total_, message.moved_, length};
      if (corrupt_next_chunk_) {  // faults.h: corrupt_chunk
        reinterpret_cast<ChunkHeader*>(chunk)->offset = int64_t{1} << 46;
        corrupt_next_chunk_ = false;
      }
      if (length > 0) std::memcpy(chunk + kChunkHeaderBytes, message.data_ + message.moved_, length);
      channel.head.store(++head, std::memory_order_release);
      message.moved_ += length;
      pushed = true;
      if (message.moved_ == message.total_) {
        message.done_ = true;
        queue.pop_front();
      }
    }
    if (pushed) {
      segment.control(dst).doorbell.bump();
      moved_any = true;
    }
  }
  for (int src = 0; src < segment.size(); ++src) {
    if (src == me) continue;
    ShmSegment::Channel& channel = segment.channel(src, me);
    uint64_t tail = channel.tail.load(std::memory_order_relaxed);
    bool took = false;
    for (;;) {
      const uint64_t head = channel.head.load(std::memory_order_acquire);
      if (head - tail > static_cast<uint64_t>(kChannelSlots)) {
        corrupt(src, c10::str("its send counter ", head, " is not within ", kChannelSlots, " chunks of ", tail));
      }
      if (head == tail) break;
      const char* chunk = channel.chunks + (tail % kChannelSlots) * chunk_stride;
      const ChunkHeader header = *reinterpret_cast<const ChunkHeader*>(chunk);
      // Note [Shared-memory segment]: nothing read from the segment is used unchecked.
      if (header.total < 0 || header.offset < 0 || header.length < 0 || header.length > chunk_bytes ||
          header.offset > header.total - header.length) {
        corrupt(src, c10::str("a chunk of ", header.length, " bytes at offset ", header.offset, " of a ", header.total,
                              "-byte message"));
      }
      auto& posted = recvs_[src];
      auto match = std::find_if(posted.begin(), posted.end(),
                                [&](const c10::intrusive_ptr<Message>& m) { return m->tag_ == header.tag; });
      if (match != posted.end()) {
        Message& message = **match;
        if (header.total != message.total_) {
          message.error_ = c10::str("rank ", src, " sent ", header.total, " bytes, this rank expected ", message.total_);
        } else if (header.offset != message.moved_) {
          corrupt(src, c10::str("a chunk at offset ", header.offset, " where offset ", message.moved_, " comes next"));
        } else if (header.length > 0) {
          std::memcpy(message.data_ + header.offset, chunk + kChunkHeaderBytes, header.length);
        }
        message.moved_ += header.length;
        if (!message.error_.empty() || message.moved_ == message.total_) {
          message.done_ = true;
          posted.erase(match);
        }
      } else if (posted.empty()) {
        break;  // stays in the channel until its receive is posted (Note [Shared-memory messages])
      } else {
        // A posted receive waits behind this chunk: move it aside so the channel does not block.
        Unexpected& early = unexpected_[src][static_cast<int>(header.tag)];
        if (early.bytes.empty() && header.total > 0) {
          early.total = header.total;
          early.bytes.resize(static_cast<size_t>(header.total));
          buffered_bytes_ += header.total;
          note_buffered_bytes(buffered_bytes_);
        }
        if (header.total != early.total || header.offset != early.received) {
          corrupt(src, c10::str("a chunk at offset ", header.offset, " of a ", header.total, "-byte message where offset ",
                                early.received, " of a ", early.total, "-byte one comes next"));
        }
        if (header.length > 0) std::memcpy(early.bytes.data() + header.offset, chunk + kChunkHeaderBytes, header.length);
        early.received += header.length;
      }
      channel.tail.store(++tail, std::memory_order_release);
      took = true;
    }
    if (took) {
      segment.control(src).doorbell.bump();
      moved_any = true;
    }
  }
  return moved_any;
}

void ShmTransport::wait_for_message(Message& message, std::string_view what) {
  WaitContext context{segment_.get(), std::chrono::steady_clock::now() + segment_->timeout(), what};
  context.peer = message.peer_;
  segment_->wait_for(
      segment_->control(segment_->rank()).doorbell,
      [&] {
        std::lock_guard<std::mutex> lock(mutex_);
        progress_locked();
        return message.done_;
      },
      context);
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(message.error_.empty(), message.error_);
}

void ShmTransport::abort_message(Message& message) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (message.done_) return;
  auto drop = [&](auto& list) {
    for (auto it = list.begin(); it != list.end(); ++it) {
      if (it->get() == &message) {
        list.erase(it);
        return;
      }
    }
  };
  if (message.is_send_) drop(sends_[message.peer_]); else drop(recvs_[message.peer_]);
  if (message.moved_ > 0) segment_->mark_broken("a message was aborted half-way");
  message.error_ = "aborted";
  message.done_ = true;
}

}  // namespace ddpkit::comm
