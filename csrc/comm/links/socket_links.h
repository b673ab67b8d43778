#pragma once
// ddpkit's own TCP connections between the ranks that cross hosts together (Note [Socket links]).

#include "comm/links/links.h"
#include "comm/links/send_buffers.h"
#include "comm/links/socket_io.h"

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <sys/socket.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace ddpkit::comm {

class LinkThread;

// Note [Socket links]
// The check across hosts (Note [One round across hosts]) is a ping-pong of a few hundred bytes. Over
// gloo's send/recv it took longer than over a plain TCP connection blocking on the caller's thread,
// and it slowed gloo's own next all-reduce (gloo's pairs hand late sends to their device thread),
// which the plain connection left alone (a ping-pong probe between two simulated hosts decided it;
// bench_multihost.py's small all-reduces across hosts measure what it serves). So the ranks of a
// cross subgroup (Hierarchy::cross) keep one TCP connection per pair for the check's round and for
// the data steps across hosts: the swap between two hosts, the ring among more (Note [A ring across
// hosts]; broadcast and reduce among three hosts or more stay on the gloo subgroup's messages).
//  - Set-up, a collective of the cross subgroup: every rank listens on the address gloo uses (the
//    first interface of GLOO_SOCKET_IFNAME, else its hostname's address, preferring one that is
//    neither loopback nor link-local), and the ranks all-gather their address, port and a fresh
//    random token over the subgroup's gloo backend, never through the store; a rank that cannot
//    listen says so there, and every rank raises. Each rank connects to every lower rank and
//    introduces itself with that rank's token; an acceptor closes any connection that does not name
//    its token and a rank it still expects, and answers the others, so every link is known good when
//    set-up returns. The three steps (announce, connect_to_lower_ranks, accept_higher_ranks in
//    links/socket_setup.h) share one LinkSetUp, which owns every descriptor until the links take it.
//  - Messages are frames: a magic word, the collective's sequence number and the length, then the
//    bytes. A receive names its smallest and largest size; a frame outside them, another sequence
//    number or another magic breaks the links rather than be misread.
//  - exchange() moves a collective's frames all at once (non-blocking sockets, one poll loop; a
//    large exchange's sends and receives in loops of their own on the links' threads: Note [Threads
//    of the links]), so two ranks that both send never wait on each other's buffers. A peer that
//    dies closes its end, which the poll sees at once; a peer that stops is given up at the group's
//    timeout. Either failure breaks the links: the link to the failed peer, and every link a frame
//    stopped halfway on, is shut down, so that those peers raise at once too, and every later
//    exchange raises at once (shutting the rest down), as gloo's pairs do. A rank whose own step
//    fails elsewhere in a collective's data steps (a rank of its host lost) breaks its links too
//    (break_off): it is alive, so its partners on other hosts would otherwise wait for its frames
//    until the timeout.
//
// Note [News of a failure]
// On a ring the rank that sees a peer die is its neighbour; the others would see only that neighbour
// hang up, and name it. So a rank that gives up over a peer's failure (closed, a failed send or
// receive, the timeout) first finishes any frame it had sent halfway to another peer (its data
// never depends on the step's incoming frame, so it is the true frame) and then sends every other
// peer a news frame naming the failed rank, each within a second, before it shuts the failed link.
// A rank that reads news where it expected a frame gives up naming that rank ("rank 1 failed or died
// (rank 2 reported it)") and passes the news on; so does a rank whose send to the messenger breaks
// because the messenger hung up, where the news waits unread on that stream (a ring step receives
// from another peer). A frame it could not finish in time is cut off as before, and that peer names
// the messenger. tests/test_multihost.py's ring-step kill checks that
// every host names the killed rank.

// Note [Threads of the links]
// A frame's bytes cost CPU on both hosts: the kernel copies them out of the sender and into the
// receiver, and on the simulated hosts the sending CPU also carries them through the bridge to the
// receiver's socket. With one thread doing a ring step's sending, receiving and reducing, that
// thread is the step's bound wherever a rank has cores to spare (bench_multihost.py's largest points
// on a machine with more cores than ranks: the rank's thread busy nearly all the step, against gloo,
// whose pairs hand their I/O to a device thread). So an exchange that sends LinkThreading::from_bytes or more
// (one part, kLinkPartBytes, by default) and also receives hands its sends to the links' sending
// thread, and, where the set-up says so, its receives to their receiving thread (LinkThread, in
// links/link_thread.h); the caller's thread moves what is left, reports data to on_data (so reductions
// and decodings stay the caller's) and keeps the exchange's deadline and every way of giving up,
// stopping the threads' jobs first, so that the frames' progress is its own again (Note [News of a
// failure]). A smaller exchange stays on the caller's thread, where waking a thread would cost
// about what it overlaps. The group's set-up (cpus_for_each_rank in topology/topology.h) gives each
// rank on a kernel with 3 CPUs per rank both threads, with 2 the sending one (the busiest thread's
// CPU per call that bench_multihost.py reports shows how the work splits between them), and with
// fewer none: simulated hosts sharing a small machine's CPUs, as this repository's CI runs them,
// where the threads would share the rank's CPU and only add switches. bench_multihost.py's
// ddpkit_links_* candidates time each choice in the same run.
inline constexpr int64_t kLinkThreadBytes = kLinkPartBytes;

// What a large exchange moves on the links' threads (Note [Threads of the links]).
struct LinkThreading {
  int64_t from_bytes = 0;  // exchanges that send this much or more, and receive; 0: none
  bool receives = false;   // the receives too, not only the sends
};

// Where a rank listens for its links (Note [Socket links]): a socket on the address gloo uses, and
// the fresh token a connecting rank must name; or why it could not listen, which the set-up tells
// every rank instead of an address.
class LinkListener {
 public:
  // Listens on this rank's link address. A failure is kept (error()), not thrown: the rank still
  // joins the set-up's exchange of addresses, so that every rank learns it.
  static LinkListener open();
  // A listener that could not listen, for `why`.
  static LinkListener failed(std::string why);

  LinkListener(LinkListener&& other) noexcept;
  LinkListener& operator=(LinkListener&& other) = delete;
  LinkListener(const LinkListener&) = delete;
  ~LinkListener();

  const sockaddr_storage& address() const { return address_; }
  uint64_t token() const { return token_; }
  // Why it could not listen; "" when it listens.
  const std::string& error() const { return error_; }
  int fd() const { return fd_; }
  // DDPKIT_LINK_SEND_BUFFER's bytes where it is set (Note [Send buffers]): every link's send buffer.
  std::optional<int> send_buffer_setting() const { return send_buffer_setting_; }

 private:
  LinkListener() = default;

  int fd_ = -1;
  sockaddr_storage address_{};
  uint64_t token_ = 0;
  std::optional<int> send_buffer_setting_;
  std::string error_;
};

// The words a connecting rank opens its link with: the acceptor's token and its own index.
struct LinkHello {
  static constexpr uint64_t kMagic = 0x64646b68656c6c6fULL;  // "ddkhello"
  uint64_t magic;
  uint64_t token;
  uint64_t rank;
};

// The Links of Note [Socket links].
class SocketLinks final : public Links {
 public:
  // Connects rank `rank` of `backend` (a gloo backend of the ranks `group_ranks` of the caller's
  // group, in order), listening on `listener`, to every other of its ranks, as Note [Socket links]
  // describes; raises, naming the rank and its address, when a link cannot be made within
  // `timeout`, which also bounds every later exchange, or when a rank could not listen. Peers are
  // indices of `group_ranks`; errors name the group's ranks. Large exchanges move on the links'
  // threads as `threading` says (Note [Threads of the links]).
  static std::unique_ptr<SocketLinks> connect(c10d::Backend& backend, int rank, std::vector<int> group_ranks,
                                              std::chrono::milliseconds timeout, LinkListener listener,
                                              LinkThreading threading);
  ~SocketLinks() override;
  SocketLinks(const SocketLinks&) = delete;
  SocketLinks& operator=(const SocketLinks&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return static_cast<int>(fds_.size()); }
  void exchange(uint64_t sequence, std::vector<Send> sends, std::vector<Recv>& recvs) override;
  void shut_down() noexcept override;
  void break_off(const std::string& why) noexcept override;
  void send_last_words(uint64_t sequence, int peer, const void* data, int64_t bytes) noexcept override;
  int failed_peer() const override { return failed_peer_; }
  bool crosses_long_paths() const override;

  // How many connections the set-up closed unanswered: strays that named no token of this rank's,
  // or no rank it still expected.
  int refused() const { return refused_; }

 private:
  class Exchange;  // one exchange() (links/socket_exchange.cpp)

  SocketLinks(int rank, std::vector<socket_io::Fd> fds, std::vector<int> group_ranks, std::chrono::milliseconds timeout,
              int refused, LinkThreading threading, std::optional<int> send_buffer_setting);
  [[noreturn]] void fail(int peer, const std::string& why, const std::vector<int>& cut_off);

  int rank_;
  std::vector<socket_io::Fd> fds_;  // by peer, owned to the links' end; none for this rank
  std::vector<int> group_ranks_;    // by peer
  SendBuffers send_buffers_;        // Note [Send buffers]; gone before the descriptors close
  std::chrono::milliseconds timeout_;
  int refused_;
  int failed_peer_ = -1;
  std::string broken_;  // why the links broke; empty while they work
  // The thread in `slot`, made as `name` the first time; null when it cannot be made.
  static LinkThread* thread(std::unique_ptr<LinkThread>& slot, const char* name) noexcept;

  LinkThreading threading_;                     // Note [Threads of the links]
  std::unique_ptr<LinkThread> send_thread_;     // made by the first exchange that sends on it
  std::unique_ptr<LinkThread> receive_thread_;  // made by the first exchange that receives on it
};

}  // namespace ddpkit::comm
