// The testing build's PartFactory (Note [Test seam] in comm/engine/part_factory.h): the release library's
// parts, or decorators of their interfaces that inject the faults of faults.h.

#include "comm/engine/part_factory.h"
#include "comm/links/socket_links.h"
#include "comm/shm/channels.h"
#include "comm/topology/setup_messages.h"
#include "comm/topology/topology.h"
#include "testing/faults.h"

#include <c10/util/Exception.h>

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <utility>

namespace ddpkit::testing {
namespace {

using namespace ddpkit::comm;

// ---- The set-up's messages: die_at_hello, die_at_offer, die_at_map, die_at_verdict ----

// The set-up's transport, which kills this process as it sends a message of `round`.
class DyingSetUpTransport final : public Transport {
 public:
  DyingSetUpTransport(std::shared_ptr<Transport> inner, int round) : inner_(std::move(inner)), round_(round) {}
  std::string_view name() const override { return inner_->name(); }
  c10::intrusive_ptr<c10d::Work> send(const at::Tensor& tensor, int dst, int tag) override {
    if ((tag & 0xFF) == round_) die();  // Note [Tags]: a tag's low 8 bits are its round
    return inner_->send(tensor, dst, tag);
  }
  c10::intrusive_ptr<c10d::Work> recv(const at::Tensor& tensor, int src, int tag) override {
    return inner_->recv(tensor, src, tag);
  }
  DirectCollectives* direct() override { return inner_->direct(); }
  bool posts_ahead() const override { return inner_->posts_ahead(); }

 private:
  std::shared_ptr<Transport> inner_;
  int round_;
};

// ---- The host's transport: die_in_host_step, die_in_host_data_step, corrupt_chunk ----

// The host's direct collectives, which kill this process as an all-reduce (`all_reduce`) or a
// reduce-scatter (else) starts.
class DyingDirect final : public DirectCollectives {
 public:
  DyingDirect(DirectCollectives& inner, bool in_all_reduce) : inner_(inner), in_all_reduce_(in_all_reduce) {}
  std::vector<CollectiveHeader> exchange_headers(const CollectiveHeader& header, std::string_view what) override {
    return inner_.exchange_headers(header, what);
  }
  void carry_check(const CollectiveHeader& header, std::string_view local_error) override {
    inner_.carry_check(header, local_error);
  }
  int group_rank(int rank) const override { return inner_.group_rank(rank); }
  int failed_rank() const override { return inner_.failed_rank(); }
  void all_reduce(const at::Tensor& flat, ReduceOp op, std::string_view what) override {
    if (in_all_reduce_) die();
    inner_.all_reduce(flat, op, what);
  }
  void all_gather(const at::Tensor& output, const at::Tensor& input, std::string_view what) override {
    inner_.all_gather(output, input, what);
  }
  void reduce_scatter(const at::Tensor& output, const at::Tensor& input, ReduceOp op, std::string_view what) override {
    if (!in_all_reduce_) die();
    inner_.reduce_scatter(output, input, op, what);
  }
  void broadcast(const at::Tensor& tensor, int root, std::string_view what) override {
    inner_.broadcast(tensor, root, what);
  }
  void barrier(std::string_view what) override { inner_.barrier(what); }
  void reject_unchecked(std::string_view what) override { inner_.reject_unchecked(what); }
  void abandon(const std::string& why) override { inner_.abandon(why); }

 private:
  DirectCollectives& inner_;
  const bool in_all_reduce_;
};

// Puts a chunk of `tag`'s message to `dst` (of `tensor`'s bytes) that claims to lie at offset 2^46
// into this rank's channel to `dst`, as a forged segment would hold. Only before this rank's first
// message: the channel is then empty, and no thread of this rank writes it.
void forge_chunk(const ShmSegment& segment, const at::Tensor& tensor, int dst, int tag) {
  const SegmentMemory& memory = segment.memory();
  Channel& channel = memory.channel(segment.rank(), dst);
  const uint64_t head = channel.head.load(std::memory_order_relaxed);
  TORCH_INTERNAL_ASSERT(head == channel.tail.load(std::memory_order_acquire), "corrupt_chunk: the channel is in use");
  const int64_t total = tensor.numel() * static_cast<int64_t>(tensor.element_size());
  const int64_t length = std::min(memory.chunk_bytes(), total);
  char* chunk = memory.chunk(channel, head);
  *reinterpret_cast<ChunkHeader*>(chunk) = ChunkHeader{tag, total, int64_t{1} << 46, length};
  if (length > 0) std::memcpy(chunk + shm_detail::kChunkHeaderBytes, tensor.data_ptr(), length);
  channel.head.store(head + 1, std::memory_order_release);
  memory.control(dst).doorbell.bump();
}

// The host's transport with the faults armed for this rank.
class FaultyHostTransport final : public Transport {
 public:
  FaultyHostTransport(std::shared_ptr<ShmSegment> segment, bool corrupt, const char* dying_in)
      : segment_(segment), inner_(std::make_shared<ShmTransport>(std::move(segment))), corrupt_(corrupt) {
    if (dying_in != nullptr) {
      dying_ = std::make_unique<DyingDirect>(*inner_->direct(), std::string_view(dying_in) == "all_reduce");
    }
  }
  std::string_view name() const override { return inner_->name(); }
  c10::intrusive_ptr<c10d::Work> send(const at::Tensor& tensor, int dst, int tag) override {
    if (std::exchange(corrupt_, false)) forge_chunk(*segment_, tensor, dst, tag);
    return inner_->send(tensor, dst, tag);
  }
  c10::intrusive_ptr<c10d::Work> recv(const at::Tensor& tensor, int src, int tag) override {
    return inner_->recv(tensor, src, tag);
  }
  DirectCollectives* direct() override { return dying_ ? dying_.get() : inner_->direct(); }
  bool posts_ahead() const override { return inner_->posts_ahead(); }

 private:
  std::shared_ptr<ShmSegment> segment_;
  std::shared_ptr<ShmTransport> inner_;
  bool corrupt_;
  std::unique_ptr<DyingDirect> dying_;
};

// ---- The links across hosts: links_cannot_listen, stray_links, stale_link_frame, die_in_ring_step ----

// Links whose first frame sent carries the previous collective's sequence number.
class StaleFrameLinks final : public Links {
 public:
  explicit StaleFrameLinks(std::shared_ptr<Links> inner) : inner_(std::move(inner)) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  void exchange(uint64_t sequence, std::vector<Send> sends, std::vector<Recv>& recvs) override {
    if (sends.empty() || !std::exchange(stale_pending_, false))
      return inner_->exchange(sequence, std::move(sends), recvs);
    std::vector<Recv> none;
    inner_->exchange(sequence - 1, std::move(sends), none);  // as a frame of an abandoned collective would arrive
    inner_->exchange(sequence, {}, recvs);
  }
  void shut_down() noexcept override { inner_->shut_down(); }
  void break_off(const std::string& why) noexcept override { inner_->break_off(why); }
  void send_last_words(uint64_t sequence, int peer, const void* data, int64_t bytes) noexcept override {
    inner_->send_last_words(sequence, peer, data, bytes);
  }
  int failed_peer() const override { return inner_->failed_peer(); }

 private:
  std::shared_ptr<Links> inner_;
  bool stale_pending_ = true;
};

// Links whose rank SIGKILLs itself as it starts its second exchange of a ring's data (a frame of
// more than kRingFrameBytes: the check's round carries less) in its first collective that has one:
// its partners have finished the ring's first step with it and wait for its next frame.
class DyingInRingLinks final : public Links {
 public:
  static constexpr int64_t kRingFrameBytes = 64 * 1024;

  explicit DyingInRingLinks(std::shared_ptr<Links> inner) : inner_(std::move(inner)) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  // The ring's steps are one exchange's frames (Note [A streaming ring]): the first step ends as the
  // first frame from the left is reported whole.
  void exchange(uint64_t sequence, std::vector<Send> sends, std::vector<Recv>& recvs) override {
    const bool data = std::any_of(sends.begin(), sends.end(), [](const Send& send) {
      return send.first_bytes + send.second_bytes > kRingFrameBytes;
    });
    if (data && !armed_ && recvs.size() > 1 && recvs.front().on_data) {
      armed_ = true;
      Recv& first = recvs.front();
      first.on_data = [report = std::move(first.on_data), whole = first.capacity](int64_t bytes) {
        report(bytes);
        if (bytes == whole) die();
      };
    }
    inner_->exchange(sequence, std::move(sends), recvs);
  }
  void shut_down() noexcept override { inner_->shut_down(); }
  void break_off(const std::string& why) noexcept override { inner_->break_off(why); }
  void send_last_words(uint64_t sequence, int peer, const void* data, int64_t bytes) noexcept override {
    inner_->send_last_words(sequence, peer, data, bytes);
  }
  int failed_peer() const override { return inner_->failed_peer(); }

 private:
  std::shared_ptr<Links> inner_;
  bool armed_ = false;  // the first collective with a ring's data was seen
};

// A connection to `listener`'s address: what stray_links queues before any rank can connect.
int connect_to(const LinkListener& listener) {
  const sockaddr_storage& address = listener.address();
  const int fd = ::socket(address.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const socklen_t length = address.ss_family == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6);
  TORCH_CHECK(fd >= 0 && ::connect(fd, reinterpret_cast<const sockaddr*>(&address), length) == 0,
              "stray_links: the stray connection failed: ", std::strerror(errno));
  return fd;
}

void send_all(int fd, const void* data, size_t bytes) {
  TORCH_CHECK(::send(fd, data, bytes, MSG_NOSIGNAL) == static_cast<ssize_t>(bytes),
              "stray_links: a stray's send failed");
}

// ---- The factory ----

int64_t env_bytes(const char* name, int64_t fallback) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') return fallback;
  const int64_t parsed = std::atoll(value);
  if (parsed < 4096) return -1;  // no layout: the set-up fails on every rank (SegmentLayout::valid)
  return static_cast<int64_t>(shm_detail::round_up(static_cast<size_t>(parsed), shm_detail::kLine));
}

// DDPKIT_LINK_THREADS in place of the set-up's `chosen` (Note [Threads of the links]): "caller"
// moves every frame on the caller's thread, "send" every exchange's sends on the sending thread,
// "both" its receives on the receiving thread too, whatever the machine's CPUs.
LinkThreading threading(LinkThreading chosen) {
  const char* value = std::getenv("DDPKIT_LINK_THREADS");
  if (value == nullptr || *value == '\0') return chosen;
  const std::string_view name(value);
  TORCH_CHECK(name == "caller" || name == "send" || name == "both", "DDPKIT_LINK_THREADS=", name,
              " is not one of caller, send, both");
  return name == "caller" ? LinkThreading{} : LinkThreading{1, name == "both"};
}

class FaultyParts final : public PartFactory {
 public:
  std::string host_identity() const override { return PartFactory::host_identity() + test_host(); }

  std::shared_ptr<Transport> setup_transport(std::shared_ptr<Transport> messages, int rank) const override {
    using namespace setup_messages;
    const std::pair<const char*, int> faults[] = {{"die_at_hello", kHelloRound},
                                                  {"die_at_offer", kOfferRound},
                                                  {"die_at_map", kAckRound},
                                                  {"die_at_verdict", kVerdictRound}};
    for (const auto& [fault, round] : faults) {
      if (fault_armed(fault, rank)) return std::make_shared<DyingSetUpTransport>(std::move(messages), round);
    }
    return messages;
  }

  SegmentOptions segment_options(int size, bool spinning, int rank) const override {
    SegmentOptions options = PartFactory::segment_options(size, spinning, rank);
    SegmentSettings& settings = options.settings;
    settings.slot_bytes = env_bytes("DDPKIT_SHM_SLOT_BYTES", settings.slot_bytes);
    settings.whole_bytes = env_bytes("DDPKIT_SHM_WHOLE_BYTES", settings.whole_bytes);
    settings.chunk_bytes = env_bytes("DDPKIT_SHM_CHUNK_BYTES", settings.chunk_bytes);
    if (fault_armed("no_liveness_poll", rank)) options.liveness_period = kNoLivenessPoll;
    return options;
  }

  std::shared_ptr<Transport> host_transport(std::shared_ptr<ShmSegment> segment) const override {
    const int rank = segment->group_ranks()[segment->rank()];
    const bool corrupt = fault_armed("corrupt_chunk", rank);
    const char* dying_in = fault_armed("die_in_host_step", rank)        ? "all_reduce"
                           : fault_armed("die_in_host_data_step", rank) ? "reduce_scatter"
                                                                        : nullptr;
    if (!corrupt && dying_in == nullptr) return PartFactory::host_transport(std::move(segment));
    return std::make_shared<FaultyHostTransport>(std::move(segment), corrupt, dying_in);
  }

  std::shared_ptr<Links> links(c10d::Backend& backend, int rank, std::vector<int> group_ranks,
                               std::chrono::milliseconds timeout, LinkThreading chosen) const override {
    const LinkThreading threading = testing::threading(chosen);
    const int me = group_ranks[rank];
    const int size = static_cast<int>(group_ranks.size());
    if (fault_armed("links_cannot_listen", me)) {
      return SocketLinks::connect(backend, rank, std::move(group_ranks), timeout,
                                  LinkListener::failed("the test fault links_cannot_listen"), threading);
    }
    LinkListener listener = LinkListener::open();
    // stray_links: connections that are not a rank's, queued before any rank can connect (every rank
    // connects after the set-up's all-gather): one names the rank this one expects first with a
    // wrong token, one sends junk and hangs up. Set-up must refuse both and still link every rank.
    const bool strays = fault_armed("stray_links", me) && rank + 1 < size && listener.error().empty();
    int forged = -1;
    if (strays) {
      forged = connect_to(listener);
      const LinkHello hello{LinkHello::kMagic, listener.token() + 1, static_cast<uint64_t>(rank + 1)};
      send_all(forged, &hello, sizeof(hello));
      const int junk = connect_to(listener);
      send_all(junk, "junk", 4);
      ::close(junk);
    }
    std::unique_ptr<SocketLinks> made;
    try {
      made = SocketLinks::connect(backend, rank, std::move(group_ranks), timeout, std::move(listener), threading);
    } catch (...) {
      if (forged >= 0) ::close(forged);
      throw;
    }
    if (forged >= 0) ::close(forged);
    TORCH_CHECK(!strays || made->refused() == 2, "stray_links: set-up refused ", made->refused(), " of its 2 strays");
    if (fault_armed("stale_link_frame", me)) return std::make_shared<StaleFrameLinks>(std::move(made));
    if (fault_armed("die_in_ring_step", me)) return std::make_shared<DyingInRingLinks>(std::move(made));
    return made;
  }
};

[[maybe_unused]] const bool installed = [] {
  install_part_factory(std::make_unique<FaultyParts>());
  return true;
}();

}  // namespace
}  // namespace ddpkit::testing
