// ddpkit_tun_delay: the wide-area link of ddpkit.testing's simulated hosts, where the kernel has no
// netem. A program of its own, built only by a testing build (CMakeLists.txt), never part of the
// library: HostPool runs it inside its router namespace, whose policy routes send every packet
// between two hosts into the TUN device TUN. Each packet read from there is held DELAY_US
// microseconds and then written back, and the kernel forwards it to its host by the main table.
//
//     ddpkit_tun_delay TUN DELAY_US
//
// Prints "ready" once the device exists. Each line on stdin sets a new delay in microseconds for
// the packets read from then on, answered by "ok" (a test's link that grows longer after its
// connections were made); it ends when stdin closes, or with its parent.
//
// Why native: the router carries every host's links at once, on the CPUs the hosts share, so each
// packet must cost it little; a Python delayer (../shared/tools/tun_delay.py) pays the interpreter per
// packet. bench_multihost.py's "of link" column for gloo at 4x1 on 1gbit-10ms says whether this one
// keeps up (docs/multihost.md, "Wide-area links"). Two choices keep it cheap: the device takes the kernel's segmentation offloads, so a read
// or a write moves a TCP burst of up to 64 KiB rather than one MTU-sized packet; and since every
// packet waits the same time, the held packets are a FIFO in one ring of bytes, read into in place.
// It asks for a real-time priority (SCHED_FIFO) where it may: a router forwards whatever the hosts'
// processes do, so a packet's delay and a handshake's round trip stay what was asked for even while
// the hosts, which share this machine's CPUs, keep them busy.

#include <fcntl.h>
#include <linux/if.h>
#include <linux/if_tun.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

// The largest packet the device hands over: a segmentation-offload burst and its virtio header.
constexpr size_t kMaxPacket = 128 << 10;
// Held bytes at most: a packet that finds the ring full is dropped, as a router's full queue
// drops. 64 MiB is half a second of four 1 Gbit/s links, well past any delay the tests set.
constexpr size_t kRingBytes = 64 << 20;

int64_t now_ns() {
  timespec now{};
  clock_gettime(CLOCK_MONOTONIC, &now);
  return int64_t{now.tv_sec} * 1'000'000'000 + now.tv_nsec;
}

[[noreturn]] void die(const std::string& what) {
  std::fprintf(stderr, "ddpkit_tun_delay: %s: %s\n", what.c_str(), std::strerror(errno));
  std::exit(1);
}

// One held packet in the ring: when it is due, its length, then its bytes (padded to 8).
struct Held {
  int64_t due_ns;
  uint64_t length;  // kWrap: the rest of the ring is unused, the next packet is at its start
};
constexpr uint64_t kWrap = ~uint64_t{0};

size_t padded(size_t bytes) { return (bytes + 7) & ~size_t{7}; }

// A FIFO of held packets in one ring of bytes, written in place by read().
class Ring {
 public:
  Ring() : bytes_(kRingBytes) {}
  bool empty() const { return head_ == tail_; }
  const Held& front() { return *at(head_); }
  const char* front_data() { return reinterpret_cast<const char*>(at(head_) + 1); }
  void pop() {
    head_ += sizeof(Held) + padded(at(head_)->length);
    skip_wrap_at_head();
  }
  // Room for a packet of kMaxPacket at the tail, contiguous; null when the ring is full.
  char* reserve() {
    const size_t need = sizeof(Held) + kMaxPacket;
    size_t offset = tail_ % kRingBytes;
    if (offset + need > kRingBytes) {  // wrap: mark the rest of the ring unused
      if (free_bytes() < kRingBytes - offset + need) return nullptr;
      if (kRingBytes - offset >= sizeof(Held)) at(tail_)->length = kWrap;
      tail_ += kRingBytes - offset;
      skip_wrap_at_head();
      offset = 0;
    }
    if (free_bytes() < need) return nullptr;
    return reinterpret_cast<char*>(at(tail_) + 1);
  }
  // Keeps the packet just read into reserve()'s room.
  void commit(int64_t due_ns, size_t length) {
    *at(tail_) = Held{due_ns, length};
    tail_ += sizeof(Held) + padded(length);
  }

 private:
  Held* at(uint64_t position) { return reinterpret_cast<Held*>(bytes_.data() + position % kRingBytes); }
  size_t free_bytes() const { return kRingBytes - (tail_ - head_); }
  void skip_wrap_at_head() {
    const size_t offset = head_ % kRingBytes;
    if (head_ != tail_ && (kRingBytes - offset < sizeof(Held) || at(head_)->length == kWrap)) {
      head_ += kRingBytes - offset;
    }
  }

  std::vector<char> bytes_;
  uint64_t head_ = 0;  // positions count bytes ever used; the ring's offset is modulo its size
  uint64_t tail_ = 0;
};

// Parses a delay in microseconds; -1 if `text` is not one.
int64_t parse_delay_us(const char* text) {
  char* end = nullptr;
  errno = 0;
  const long long value = std::strtoll(text, &end, 10);
  while (*end == '\n' || *end == ' ') ++end;
  return end == text || *end != '\0' || errno != 0 || value < 0 ? -1 : value;
}

int open_tun(const char* name) {
  const int fd = ::open("/dev/net/tun", O_RDWR | O_CLOEXEC);
  if (fd < 0) die("open /dev/net/tun");
  ifreq request{};
  std::strncpy(request.ifr_name, name, IFNAMSIZ - 1);
  request.ifr_flags = IFF_TUN | IFF_NO_PI | IFF_VNET_HDR;
  if (::ioctl(fd, TUNSETIFF, &request) != 0) die(std::string("TUNSETIFF ") + name);
  // Checksums and TCP segmentation stay the kernel's to do, after the delay (or never: the
  // receiving host's veth takes a burst whole). Without them the kernel segments before the device.
  const unsigned offloads = TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6;
  if (::ioctl(fd, TUNSETOFFLOAD, offloads) != 0 && ::ioctl(fd, TUNSETOFFLOAD, 0u) != 0) die("TUNSETOFFLOAD");
  if (::fcntl(fd, F_SETFL, O_NONBLOCK) != 0) die("fcntl");
  return fd;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: ddpkit_tun_delay TUN DELAY_US\n");
    return 2;
  }
  const int64_t delay_us = parse_delay_us(argv[2]);
  if (delay_us < 0) {
    std::fprintf(stderr, "ddpkit_tun_delay: DELAY_US is a number of microseconds, got %s\n", argv[2]);
    return 2;
  }
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() == 1) return 1;  // the parent is already gone
  // Best effort: without it, the delays stretch while the hosts keep the CPUs busy.
  const sched_param priority{10};
  (void)::sched_setscheduler(0, SCHED_FIFO, &priority);
  const int fd = open_tun(argv[1]);
  std::printf("ready\n");
  std::fflush(stdout);

  int64_t delay_ns = delay_us * 1000;
  std::string line;
  Ring ring;
  std::vector<char> dropped(kMaxPacket);
  for (;;) {
    // Hand back what is due, then wait for the next packet or the next due time, whichever first.
    int64_t now = now_ns();
    while (!ring.empty() && ring.front().due_ns <= now) {
      const Held& held = ring.front();
      (void)!::write(fd, ring.front_data(), held.length);  // a failed write is a dropped packet
      ring.pop();
    }
    timespec wait{};
    const timespec* timeout = nullptr;
    if (!ring.empty()) {
      const int64_t left = ring.front().due_ns - now;
      wait = timespec{static_cast<time_t>(left / 1'000'000'000), static_cast<long>(left % 1'000'000'000)};
      timeout = &wait;
    }
    pollfd ready[2] = {{fd, POLLIN, 0}, {STDIN_FILENO, POLLIN, 0}};
    if (::ppoll(ready, 2, timeout, nullptr) < 0 && errno != EINTR) die("ppoll");
    if (ready[1].revents != 0) {  // a new delay, or stdin closed
      char text[64];
      const ssize_t length = ::read(STDIN_FILENO, text, sizeof(text));
      if (length <= 0) return 0;
      line.append(text, static_cast<size_t>(length));
      for (size_t newline; (newline = line.find('\n')) != std::string::npos; line.erase(0, newline + 1)) {
        const int64_t delay = parse_delay_us(line.substr(0, newline).c_str());
        if (delay >= 0) delay_ns = delay * 1000;
        std::printf(delay >= 0 ? "ok\n" : "not a delay in microseconds\n");
        std::fflush(stdout);
      }
    }
    if ((ready[0].revents & POLLIN) == 0) continue;
    // Read what waits, but not so long that a due packet waits behind a burst.
    for (int reads = 0; reads < 64; ++reads) {
      char* room = ring.reserve();
      const ssize_t length = ::read(fd, room != nullptr ? room : dropped.data(), kMaxPacket);
      if (length < 0) {
        if (errno == EAGAIN || errno == EINTR) break;
        die("read");
      }
      if (room != nullptr) ring.commit(now_ns() + delay_ns, static_cast<size_t>(length));
    }
  }
}
