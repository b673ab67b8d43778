#pragma once
// Each link's send buffer, chosen from the path it crosses (Note [Send buffers]).

#include "comm/links/links.h"
#include "comm/links/socket_io.h"

#include <array>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string_view>
#include <vector>

namespace ddpkit::comm {

// Note [Send buffers]
// A link's send buffer bounds the bytes it has in flight, so a link carries at most about its buffer
// per round trip. But a sender allowed megabytes ahead of its receiver sends bytes that leave the
// CPUs' caches before the receiver copies them out, where the two share them (the simulated hosts of
// the tests and benchmarks: a perf profile of a large ring all-reduce had the kernel's receive copy,
// and its time with interrupts held off, grow with the buffer). So each link chooses from its path:
//  - At set-up, once the hello and its answer have crossed, the link reads the smallest round trip
//    TCP measured on it (TCP_INFO) and the speed of the interface it leaves by (kAssumedLinkBitsPerS
//    where the interface tells none). Where that rate times that round trip fits in
//    kLinkSendBufferBytes, the small buffer holds the whole path and the link asks for it: a short
//    path. Elsewhere it leaves the buffer to the kernel's autotuning, which grows it with the
//    congestion window to what the path holds: a long path. The buffer is asked for only once the
//    path is known, since asking fixes it for good.
//  - A short path that proves longer (an interface that tells no speed, or a slower one than its
//    path runs at) would stay capped, so an exchange that sends a peer kLinkGrowthCheckBytes or more
//    checks that link afterwards: where what the link delivered over the exchange, times its
//    smallest round trip, came to most of its buffer, the buffer held the path's bytes in flight and
//    held the link back, and it doubles, up to the kernel's cap (net.core.wmem_max). That the sender
//    waited on a full buffer (TCP_INFO's sndbuf_limited) does not tell it apart: the simulated
//    hosts' links wait on theirs too, at a round trip of microseconds.
//  - DDPKIT_LINK_SEND_BUFFER (bytes, read at the links' set-up) overrides both: that buffer on every
//    link, never grown; 0 leaves every link to the kernel's sizing.
// bench_multihost.py times the choices: on unshaped links its ddpkit_kernel_buffers and
// ddpkit_send_buffer_<KiB> candidates against the default, on delayed ones (--links 1gbit-10ms) the
// same beside gloo. tests/test_link_options.py checks each choice on delayed and undelayed simulated
// hosts; comm_counters()["links"] shows what each link chose and why (LinkPath).
inline constexpr int kLinkSendBufferBytes = 256 << 10;
// The rate taken for a path whose interface tells no speed (a loopback, a tunnel, many virtual NICs).
inline constexpr int64_t kAssumedLinkBitsPerS = 10'000'000'000;
// An exchange that sends a peer this much or more checks whether the link's buffer held it back.
inline constexpr int64_t kLinkGrowthCheckBytes = 4 * int64_t{kLinkSendBufferBytes};

// Why a link has the send buffer it has (Note [Send buffers]). One table: kSendBufferChoiceNames.
enum class SendBufferChoice : uint8_t { kShortPath, kLongPath, kGrown, kSetting };
inline constexpr std::array<std::string_view, 4> kSendBufferChoiceNames = {"short path", "long path", "grown",
                                                                           "DDPKIT_LINK_SEND_BUFFER"};

// The set-up's choice for a path of `round_trip_us` across an interface of `bits_per_s`:
// kShortPath where the small buffer holds rate x round trip, else kLongPath.
SendBufferChoice choose_send_buffer(int64_t round_trip_us, int64_t bits_per_s);

// What TCP_INFO tells of a link at one moment.
struct LinkSample {
  int64_t bytes_acked = 0;
  int64_t min_round_trip_us = 0;
  std::chrono::steady_clock::time_point at{};
};

// Whether a link that asked for `requested_bytes` was held back by that buffer between `before` and
// `after`: what it delivered meanwhile, times its smallest round trip, came to most of the buffer.
bool held_back_by_buffer(const LinkSample& before, const LinkSample& after, int64_t requested_bytes);

// What one link chose, and why.
struct LinkPath {
  int peer_rank = -1;           // the group's rank at the other end
  int64_t round_trip_us = 0;    // the smallest TCP had measured at set-up
  int64_t bits_per_s = 0;       // the interface's speed, or kAssumedLinkBitsPerS
  int64_t requested_bytes = 0;  // the send buffer asked for; 0: the kernel's sizing
  int64_t booked_bytes = 0;     // SO_SNDBUF as the kernel tells it now (twice the request, capped)
  int grown = 0;                // how many times it doubled
  SendBufferChoice choice = SendBufferChoice::kShortPath;
};

// The send buffers of one set of links (SocketLinks): chosen when every link is made, then grown
// around large exchanges. Every live one is listed by live_link_paths().
class SendBuffers {
 public:
  // Measures each link of `fds` (by peer; none for this rank), whose other ends are `group_ranks`,
  // and asks for its buffer; `setting` is DDPKIT_LINK_SEND_BUFFER's bytes where it is set. The
  // descriptors stay their owner's and must outlive this.
  SendBuffers(const std::vector<socket_io::Fd>& fds, const std::vector<int>& group_ranks, std::optional<int> setting);
  ~SendBuffers();
  SendBuffers(const SendBuffers&) = delete;
  SendBuffers& operator=(const SendBuffers&) = delete;

  // Around one exchange: samples the links it sends kLinkGrowthCheckBytes or more, then grows those
  // whose buffer held them back. after_exchange() only when the exchange succeeded.
  void before_exchange(const std::vector<Links::Send>& sends);
  void after_exchange();

  std::vector<LinkPath> paths() const;

 private:
  std::vector<int> fds_;      // by peer; -1 for this rank
  int cap_bytes_;             // net.core.wmem_max: the most a request gets
  mutable std::mutex mutex_;  // paths_ against live_link_paths()
  std::vector<LinkPath> paths_;
  std::vector<std::optional<LinkSample>> before_;  // by peer, for the exchange under way
};

// Every live link's LinkPath in this process, of every group, in the order the links were made.
std::vector<LinkPath> live_link_paths();

// DDPKIT_LINK_SEND_BUFFER's bytes, if set; raises on a value that is not a number of bytes.
std::optional<int> link_send_buffer_setting();

}  // namespace ddpkit::comm
