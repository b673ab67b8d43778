#include "comm/links/send_buffers.h"

#include <c10/util/Exception.h>

#include <ifaddrs.h>
#include <linux/ethtool.h>
#include <linux/sockios.h>
#include <linux/tcp.h>
#include <net/if.h>
#include <netinet/in.h>
#include <sys/ioctl.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>

namespace ddpkit::comm {
namespace {

// Every live SendBuffers in the order they were made, for live_link_paths(); never freed, so that
// no exit order can reach a destroyed list.
std::mutex registry_mutex;
std::vector<const SendBuffers*>& registry() {
  static auto* live = new std::vector<const SendBuffers*>();
  return *live;
}

LinkSample sample(int fd) {
  LinkSample sample;
  sample.at = std::chrono::steady_clock::now();
  tcp_info info{};  // a kernel older than these headers leaves the fields it lacks at zero
  socklen_t length = sizeof(info);
  if (::getsockopt(fd, IPPROTO_TCP, TCP_INFO, &info, &length) == 0) {
    sample.bytes_acked = static_cast<int64_t>(info.tcpi_bytes_acked);
    sample.min_round_trip_us = info.tcpi_min_rtt != 0 ? info.tcpi_min_rtt : info.tcpi_rtt;
  }
  return sample;
}

bool same_address(const sockaddr* interface, const sockaddr_storage& local) {
  if (interface == nullptr || interface->sa_family != local.ss_family) return false;
  if (local.ss_family == AF_INET) {
    return reinterpret_cast<const sockaddr_in*>(interface)->sin_addr.s_addr ==
           reinterpret_cast<const sockaddr_in&>(local).sin_addr.s_addr;
  }
  return local.ss_family == AF_INET6 &&
         std::memcmp(&reinterpret_cast<const sockaddr_in6*>(interface)->sin6_addr,
                     &reinterpret_cast<const sockaddr_in6&>(local).sin6_addr, sizeof(in6_addr)) == 0;
}

// The speed of the interface whose address the link leaves from, as the driver tells it; else
// kAssumedLinkBitsPerS (a loopback, an interface whose driver tells none).
int64_t interface_bits_per_s(int fd) {
  sockaddr_storage local{};
  socklen_t length = sizeof(local);
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &length) != 0) return kAssumedLinkBitsPerS;
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return kAssumedLinkBitsPerS;
  int64_t bits_per_s = kAssumedLinkBitsPerS;
  for (const ifaddrs* entry = list; entry != nullptr; entry = entry->ifa_next) {
    if (!same_address(entry->ifa_addr, local)) continue;
    ifreq request{};
    std::strncpy(request.ifr_name, entry->ifa_name, IFNAMSIZ - 1);
    ethtool_cmd command{};
    command.cmd = ETHTOOL_GSET;
    request.ifr_data = reinterpret_cast<char*>(&command);
    if (::ioctl(fd, SIOCETHTOOL, &request) == 0) {
      const uint32_t megabits = ethtool_cmd_speed(&command);
      if (megabits != 0 && megabits != static_cast<uint32_t>(SPEED_UNKNOWN)) bits_per_s = int64_t{megabits} * 1'000'000;
    }
    break;
  }
  ::freeifaddrs(list);
  return bits_per_s;
}

// net.core.wmem_max: the kernel caps every request there.
int send_buffer_cap() {
  std::ifstream file("/proc/sys/net/core/wmem_max");
  int64_t cap = 0;
  if (!(file >> cap) || cap <= 0) return std::numeric_limits<int>::max() / 2;
  return static_cast<int>(std::min<int64_t>(cap, std::numeric_limits<int>::max() / 2));
}

bool ask_send_buffer(int fd, int bytes) { return ::setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &bytes, sizeof(bytes)) == 0; }

int booked_send_buffer(int fd) {
  int bytes = 0;
  socklen_t length = sizeof(bytes);
  return ::getsockopt(fd, SOL_SOCKET, SO_SNDBUF, &bytes, &length) == 0 ? bytes : -1;
}

}  // namespace

SendBufferChoice choose_send_buffer(int64_t round_trip_us, int64_t bits_per_s) {
  // In bytes: rate x round trip, without overflow up to a terabit across ten seconds.
  const double path_bytes = static_cast<double>(bits_per_s) / 8 * static_cast<double>(round_trip_us) / 1e6;
  return path_bytes <= kLinkSendBufferBytes ? SendBufferChoice::kShortPath : SendBufferChoice::kLongPath;
}

bool held_back_by_buffer(const LinkSample& before, const LinkSample& after, int64_t requested_bytes) {
  const double elapsed_us = std::chrono::duration<double, std::micro>(after.at - before.at).count();
  if (elapsed_us <= 0 || after.min_round_trip_us <= 0 || requested_bytes <= 0) return false;
  const double delivered_per_us = static_cast<double>(after.bytes_acked - before.bytes_acked) / elapsed_us;
  return delivered_per_us * static_cast<double>(after.min_round_trip_us) >= 0.75 * static_cast<double>(requested_bytes);
}

std::optional<int> link_send_buffer_setting() {
  const char* value = std::getenv("DDPKIT_LINK_SEND_BUFFER");
  if (value == nullptr || *value == '\0') return std::nullopt;
  char* end = nullptr;
  errno = 0;
  const long long bytes = std::strtoll(value, &end, 10);
  TORCH_CHECK(*end == '\0' && errno == 0 && bytes >= 0 && bytes <= std::numeric_limits<int>::max() / 2,
              "DDPKIT_LINK_SEND_BUFFER=", value, " is not a number of bytes (0: the kernel's own sizing)");
  return static_cast<int>(bytes);
}

SendBuffers::SendBuffers(const std::vector<socket_io::Fd>& fds, const std::vector<int>& group_ranks,
                         std::optional<int> setting)
    : cap_bytes_(send_buffer_cap()), paths_(fds.size()), before_(fds.size()) {
  for (const socket_io::Fd& fd : fds) fds_.push_back(fd.get());
  for (size_t peer = 0; peer < fds_.size(); ++peer) {
    if (fds_[peer] < 0) continue;
    LinkPath& path = paths_[peer];
    path.peer_rank = group_ranks[peer];
    path.round_trip_us = sample(fds_[peer]).min_round_trip_us;
    path.bits_per_s = interface_bits_per_s(fds_[peer]);
    if (setting.has_value()) {
      path.choice = SendBufferChoice::kSetting;
      path.requested_bytes = *setting;
    } else {
      path.choice = choose_send_buffer(path.round_trip_us, path.bits_per_s);
      path.requested_bytes = path.choice == SendBufferChoice::kShortPath ? kLinkSendBufferBytes : 0;
    }
    if (path.requested_bytes > 0) {
      TORCH_CHECK(ask_send_buffer(fds_[peer], static_cast<int>(path.requested_bytes)),
                  "SO_SNDBUF: ", std::strerror(errno));
    }
  }
  std::lock_guard<std::mutex> lock(registry_mutex);
  registry().push_back(this);
}

SendBuffers::~SendBuffers() {
  std::lock_guard<std::mutex> lock(registry_mutex);
  registry().erase(std::find(registry().begin(), registry().end(), this));
}

void SendBuffers::before_exchange(const std::vector<Links::Send>& sends) {
  for (std::optional<LinkSample>& sample : before_) sample.reset();  // an exchange that raised left its own
  for (const Links::Send& send : sends) {
    const LinkPath& path = paths_[send.peer];  // this thread alone writes it
    const bool growable = path.choice == SendBufferChoice::kShortPath || path.choice == SendBufferChoice::kGrown;
    if (growable && path.requested_bytes < cap_bytes_ &&
        send.first_bytes + send.second_bytes >= kLinkGrowthCheckBytes) {
      before_[send.peer] = sample(fds_[send.peer]);
    }
  }
}

void SendBuffers::after_exchange() {
  for (size_t peer = 0; peer < before_.size(); ++peer) {
    if (!before_[peer].has_value()) continue;
    const LinkSample before = *before_[peer];
    before_[peer].reset();
    if (!held_back_by_buffer(before, sample(fds_[peer]), paths_[peer].requested_bytes)) continue;
    const int64_t grown = std::min<int64_t>(2 * paths_[peer].requested_bytes, cap_bytes_);
    if (!ask_send_buffer(fds_[peer], static_cast<int>(grown))) continue;  // a link that broke meanwhile
    std::lock_guard<std::mutex> lock(mutex_);
    paths_[peer].requested_bytes = grown;
    paths_[peer].choice = SendBufferChoice::kGrown;
    ++paths_[peer].grown;
  }
}

std::vector<LinkPath> SendBuffers::paths() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<LinkPath> paths;
  for (size_t peer = 0; peer < paths_.size(); ++peer) {
    if (fds_[peer] < 0) continue;
    paths.push_back(paths_[peer]);
    paths.back().booked_bytes = booked_send_buffer(fds_[peer]);
  }
  return paths;
}

std::vector<LinkPath> live_link_paths() {
  std::lock_guard<std::mutex> lock(registry_mutex);
  std::vector<LinkPath> paths;
  for (const SendBuffers* buffers : registry()) {
    for (const LinkPath& path : buffers->paths()) paths.push_back(path);
  }
  return paths;
}

}  // namespace ddpkit::comm
