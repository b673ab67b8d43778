#include "comm/links/socket_setup.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <utility>

namespace ddpkit::comm {
namespace {

using namespace socket_io;

constexpr uint64_t kRecordMagic = 0x64646b6c696e6b31ULL;  // "ddklink1"
constexpr uint64_t kAckMagic = 0x64646b61636b6564ULL;     // "ddkacked"

// GLOO_SOCKET_IFNAME, else the first address its hostname resolves to (gloo's own rule). Port 0.
sockaddr_storage link_address() {
  sockaddr_storage address{};
  const char* names = std::getenv("GLOO_SOCKET_IFNAME");
  if (names != nullptr && names[0] != '\0') {
    const std::string interface = std::string(names).substr(0, std::string(names).find(','));
    ifaddrs* list = nullptr;
    TORCH_CHECK(::getifaddrs(&list) == 0, "getifaddrs failed: ", errno_text());
    // Its IPv4 address, else a routable IPv6 one (a link-local address needs a scope its peers lack).
    bool found = false;
    for (const int family : {AF_INET, AF_INET6}) {
      for (ifaddrs* entry = list; entry != nullptr && !found; entry = entry->ifa_next) {
        if (entry->ifa_addr == nullptr || interface != entry->ifa_name || entry->ifa_addr->sa_family != family) {
          continue;
        }
        if (family == AF_INET6 &&
            IN6_IS_ADDR_LINKLOCAL(&reinterpret_cast<const sockaddr_in6*>(entry->ifa_addr)->sin6_addr)) {
          continue;
        }
        std::memcpy(&address, entry->ifa_addr, family == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6));
        found = true;
      }
    }
    ::freeifaddrs(list);
    TORCH_CHECK(found, "GLOO_SOCKET_IFNAME names interface '", interface,
                "', which has no IPv4 or routable IPv6 address here");
    return address;
  }
  char hostname[256] = {};
  TORCH_CHECK(::gethostname(hostname, sizeof(hostname) - 1) == 0, "gethostname failed: ", errno_text());
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const int status = ::getaddrinfo(hostname, nullptr, &hints, &found);
  TORCH_CHECK(status == 0 && found != nullptr, "the hostname '", hostname, "' does not resolve (", gai_strerror(status),
              "); set GLOO_SOCKET_IFNAME to the interface that joins the hosts");
  // The first address that is neither loopback (Debian's /etc/hosts maps the hostname to 127.0.1.1)
  // nor link-local, else the first: every rank on one machine (DDPKIT_TEST_HOSTS) reaches that too.
  const addrinfo* chosen = found;
  for (const addrinfo* entry = found; entry != nullptr; entry = entry->ai_next) {
    const bool usable = (entry->ai_family == AF_INET &&
                         (ntohl(reinterpret_cast<const sockaddr_in*>(entry->ai_addr)->sin_addr.s_addr) >> 24) != 127) ||
                        (entry->ai_family == AF_INET6 &&
                         !IN6_IS_ADDR_LOOPBACK(&reinterpret_cast<const sockaddr_in6*>(entry->ai_addr)->sin6_addr) &&
                         !IN6_IS_ADDR_LINKLOCAL(&reinterpret_cast<const sockaddr_in6*>(entry->ai_addr)->sin6_addr));
    if (usable) {
      chosen = entry;
      break;
    }
  }
  std::memcpy(&address, chosen->ai_addr, chosen->ai_addrlen);
  ::freeaddrinfo(found);
  return address;
}

socklen_t address_length(const sockaddr_storage& address) {
  return address.ss_family == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6);
}

uint16_t& port_of(sockaddr_storage& address) {
  return address.ss_family == AF_INET ? reinterpret_cast<sockaddr_in&>(address).sin_port
                                      : reinterpret_cast<sockaddr_in6&>(address).sin6_port;
}

std::string address_text(sockaddr_storage address) {
  char host[INET6_ADDRSTRLEN] = {};
  const void* raw = address.ss_family == AF_INET
                        ? static_cast<const void*>(&reinterpret_cast<sockaddr_in&>(address).sin_addr)
                        : static_cast<const void*>(&reinterpret_cast<sockaddr_in6&>(address).sin6_addr);
  ::inet_ntop(address.ss_family, raw, host, sizeof(host));
  return c10::str(host, ":", ntohs(port_of(address)));
}

// A link's socket options: no Nagle delay (frames go out whole). Its send buffer waits for its
// round trip (SendBuffers, Note [Send buffers]).
void set_link_options(int fd) {
  const int one = 1;
  TORCH_CHECK(::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one)) == 0, "TCP_NODELAY: ", errno_text());
}

// What every rank tells the others at set-up: where it listens and the token a connector must name.
struct Record {
  uint64_t magic;
  uint64_t token;
  uint16_t family;
  uint16_t port;  // network order; 0: this rank could not listen (its own error says why)
  uint8_t address[16];
  uint8_t padding[4];
};
static_assert(sizeof(Record) == 40);

struct Ack {
  uint64_t magic;
  uint64_t rank;  // the acceptor's
};

}  // namespace

LinkListener LinkListener::open() {
  LinkListener listener;
  std::random_device random;
  listener.token_ = (static_cast<uint64_t>(random()) << 32) ^ random();
  try {
    listener.send_buffer_setting_ = link_send_buffer_setting();
    sockaddr_storage& mine = listener.address_;
    mine = link_address();
    listener.fd_ = ::socket(mine.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    TORCH_CHECK(listener.fd_ >= 0, "socket failed: ", errno_text());
    TORCH_CHECK(::bind(listener.fd_, reinterpret_cast<sockaddr*>(&mine), address_length(mine)) == 0,
                "cannot listen on ", address_text(mine), ": ", errno_text());
    TORCH_CHECK(::listen(listener.fd_, SOMAXCONN) == 0, "listen failed: ", errno_text());
    socklen_t length = sizeof(mine);
    TORCH_CHECK(::getsockname(listener.fd_, reinterpret_cast<sockaddr*>(&mine), &length) == 0,
                "getsockname failed: ", errno_text());
  } catch (const c10::Error& e) {
    listener.error_ = e.what_without_backtrace();
  }
  return listener;
}

LinkListener LinkListener::failed(std::string why) {
  LinkListener listener;
  listener.error_ = std::move(why);
  return listener;
}

LinkListener::LinkListener(LinkListener&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)),
      address_(other.address_),
      token_(other.token_),
      send_buffer_setting_(other.send_buffer_setting_),
      error_(std::move(other.error_)) {}

LinkListener::~LinkListener() {
  if (fd_ >= 0) ::close(fd_);
}

void announce(c10d::Backend& backend, LinkSetUp& setup, std::chrono::milliseconds timeout) {
  const int size = setup.size();
  TORCH_INTERNAL_ASSERT(setup.rank >= 0 && setup.rank < size);
  const std::string& local_error = setup.listener.error();
  sockaddr_storage mine = setup.listener.address();
  Record record{};
  record.magic = kRecordMagic;
  record.token = setup.listener.token();
  if (local_error.empty()) {
    record.family = mine.ss_family;
    record.port = port_of(mine);
    if (mine.ss_family == AF_INET) {
      std::memcpy(record.address, &reinterpret_cast<sockaddr_in&>(mine).sin_addr, 4);
    } else {
      std::memcpy(record.address, &reinterpret_cast<sockaddr_in6&>(mine).sin6_addr, 16);
    }
  }
  at::Tensor input = at::empty({static_cast<int64_t>(sizeof(Record))}, at::kByte);
  std::memcpy(input.data_ptr(), &record, sizeof(Record));
  std::vector<std::vector<at::Tensor>> outputs(1);
  for (int r = 0; r < size; ++r) outputs[0].push_back(at::empty_like(input));
  std::vector<at::Tensor> inputs{input};
  backend.allgather(outputs, inputs)->wait();
  TORCH_CHECK(local_error.empty(), local_error);
  setup.deadline = Clock::now() + timeout;

  setup.addresses.assign(size, sockaddr_storage{});
  setup.tokens.assign(size, 0);
  setup.links.clear();
  setup.links.resize(size);
  for (int r = 0; r < size; ++r) {
    Record theirs{};
    std::memcpy(&theirs, outputs[0][r].data_ptr(), sizeof(Record));
    TORCH_CHECK(
        theirs.magic == kRecordMagic && (theirs.family == AF_INET || theirs.family == AF_INET6) && theirs.port != 0,
        "rank ", setup.group_ranks[r], " could not listen for the links across hosts (its own error says why)");
    sockaddr_storage& address = setup.addresses[r];
    address.ss_family = theirs.family;
    port_of(address) = theirs.port;
    if (theirs.family == AF_INET) {
      std::memcpy(&reinterpret_cast<sockaddr_in&>(address).sin_addr, theirs.address, 4);
    } else {
      std::memcpy(&reinterpret_cast<sockaddr_in6&>(address).sin6_addr, theirs.address, 16);
    }
    setup.tokens[r] = theirs.token;
  }
}

void connect_to_lower_ranks(LinkSetUp& setup) {
  // Every lower rank accepts once its own connections are made (rank 0 at once).
  for (int peer = 0; peer < setup.rank; ++peer) {
    sockaddr_storage& address = setup.addresses[peer];
    const std::string whom =
        c10::str("rank ", setup.group_ranks[peer], " (links across hosts, at ", address_text(address), ")");
    Fd fd(::socket(address.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    TORCH_CHECK(fd.get() >= 0, "socket failed: ", errno_text());
    if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&address), address_length(address)) != 0) {
      TORCH_CHECK(errno == EINPROGRESS, "cannot connect to ", whom, ": ", errno_text());
      TORCH_CHECK(wait_for(fd.get(), POLLOUT, setup.deadline), "timed out connecting to ", whom);
      int error = 0;
      socklen_t error_length = sizeof(error);
      TORCH_CHECK(::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &error, &error_length) == 0,
                  "getsockopt failed: ", errno_text());
      TORCH_CHECK(error == 0, "cannot connect to ", whom, ": ", std::strerror(error));
    }
    set_link_options(fd.get());
    const LinkHello hello{LinkHello::kMagic, setup.tokens[peer], static_cast<uint64_t>(setup.rank)};
    write_all(fd.get(), &hello, sizeof(hello), setup.deadline, whom);
    Ack ack{};
    read_all(fd.get(), &ack, sizeof(ack), setup.deadline, whom);
    TORCH_CHECK(ack.magic == kAckMagic && ack.rank == static_cast<uint64_t>(peer), whom, " answered with a wrong ack");
    setup.links[peer] = std::move(fd);
  }
}

void accept_higher_ranks(LinkSetUp& setup) {
  const int rank = setup.rank, size = setup.size();
  const int listening = setup.listener.fd();
  for (int expected = size - 1 - rank; expected > 0;) {
    TORCH_CHECK(wait_for(listening, POLLIN, setup.deadline), "timed out waiting for ", expected,
                " higher rank(s) of the links across hosts to connect to ", address_text(setup.listener.address()));
    Fd fd(::accept4(listening, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
    if (fd.get() < 0) {
      TORCH_CHECK(errno == ECONNABORTED || errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK,
                  "accepting the links across hosts failed: ", errno_text());
      continue;
    }
    LinkHello hello{};
    try {
      // A stray connection may send nothing: it gets a few seconds, never past the deadline.
      read_all(fd.get(), &hello, sizeof(hello), std::min(setup.deadline, Clock::now() + std::chrono::seconds(10)),
               "a connecting rank");
    } catch (const c10::Error&) {
      ++setup.refused;
      continue;
    }
    const bool wanted = hello.magic == LinkHello::kMagic && hello.token == setup.listener.token() &&
                        hello.rank > static_cast<uint64_t>(rank) && hello.rank < static_cast<uint64_t>(size) &&
                        setup.links[hello.rank].get() < 0;
    if (!wanted) {
      ++setup.refused;
      continue;
    }
    set_link_options(fd.get());
    const Ack ack{kAckMagic, static_cast<uint64_t>(rank)};
    write_all(fd.get(), &ack, sizeof(ack), setup.deadline,
              c10::str("rank ", setup.group_ranks[hello.rank], " (links across hosts)"));
    setup.links[hello.rank] = std::move(fd);
    --expected;
  }
}

// The three steps, then the links: every descriptor passes from the set-up to them.
std::unique_ptr<SocketLinks> SocketLinks::connect(c10d::Backend& backend, int rank, std::vector<int> group_ranks,
                                                  std::chrono::milliseconds timeout, LinkListener listener,
                                                  LinkThreading threading) {
  LinkSetUp setup(rank, std::move(group_ranks), std::move(listener));
  announce(backend, setup, timeout);
  connect_to_lower_ranks(setup);
  accept_higher_ranks(setup);
  // Every link made: from here on non-blocking (exchange() polls), owned by the links to their end.
  for (int peer = 0; peer < setup.size(); ++peer) {
    if (peer == rank) continue;
    const int fd = setup.links[peer].get();
    const int flags = ::fcntl(fd, F_GETFL);
    TORCH_CHECK(flags >= 0 && ::fcntl(fd, F_SETFL, flags | O_NONBLOCK) == 0, "fcntl failed: ", errno_text());
  }
  return std::unique_ptr<SocketLinks>(new SocketLinks(rank, std::move(setup.links), std::move(setup.group_ranks),
                                                      timeout, setup.refused, threading,
                                                      setup.listener.send_buffer_setting()));
}

}  // namespace ddpkit::comm
