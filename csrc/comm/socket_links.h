#pragma once
// ddpkit's own TCP connections between the ranks that cross hosts together (Note [Socket links]).

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <chrono>
#include <functional>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace ddpkit::comm {

// Note [Socket links]
// The check across hosts (Note [One round across hosts]) is a ping-pong of a few hundred bytes. Over
// gloo's send/recv it took several times as long as over a plain TCP connection blocking on the
// caller's thread, and it slowed gloo's own next all-reduce (gloo's pairs hand late sends to their
// device thread), where the plain connection left it as fast as alone (a ping-pong probe between
// two simulated hosts; bench_multihost.py's small all-reduces across hosts are what it serves). So the ranks of a
// cross subgroup (Hierarchy::cross) keep one TCP connection per pair for the check's round, and
// between two hosts for every step across hosts too (Note [Hierarchical collectives]); among more
// hosts the data steps stay on gloo.
//  - Set-up, a collective of the cross subgroup: every rank listens on the address gloo uses (the
//    first interface of GLOO_SOCKET_IFNAME, else its hostname's address, preferring one that is
//    neither loopback nor link-local), and the ranks all-gather their address, port and a fresh
//    random token over the subgroup's gloo backend, never through the store; a rank that cannot
//    listen says so there, and every rank raises. Each rank connects to every lower rank and
//    introduces itself with that rank's token; an acceptor closes any connection that does not name
//    its token and a rank it still expects, and answers the others, so every link is known good when
//    set-up returns.
//  - Messages are frames: a magic word, the collective's sequence number and the length, then the
//    bytes. A receive names its smallest and largest size; a frame outside them, another sequence
//    number or another magic breaks the links rather than be misread.
//  - exchange() moves a collective's frames all at once (non-blocking sockets, one poll loop), so
//    two ranks that both send never wait on each other's buffers. A peer that dies closes its end,
//    which the poll sees at once; a peer that stops is given up at the group's timeout. Either
//    failure breaks the links: the link to the failed peer, and every link a frame stopped halfway
//    on, is shut down, so that those peers raise at once too, and every later exchange raises at
//    once (shutting the rest down), as gloo's pairs do. A rank whose own step fails elsewhere in a
//    collective's data steps (a rank of its host lost) breaks its links too (break_off): it is alive,
//    so its partners on other hosts would otherwise wait for its frames until the timeout.
class SocketLinks {
 public:
  // One frame to send: `first` then `second` (either may be empty), as one message. With `prepare`,
  // the frame's data is written as it goes out: exchange() calls prepare(n) before it sends data
  // byte n - 1, n growing by `prepare_step` bytes at a time (or to the frame's end), so that the
  // caller fills the next part of `first` (a compressed crossing encodes it) while earlier parts
  // are on their way; `second` must be empty.
  struct Send {
    int peer;
    const void* first;
    int64_t first_bytes;
    const void* second = nullptr;
    int64_t second_bytes = 0;
    std::function<void(int64_t)> prepare = nullptr;
    int64_t prepare_step = 0;
  };
  // One frame to receive into `data`, at most `capacity` bytes; exchange() sets `received`. With
  // `on_data`, exchange() calls it with a count of bytes each time another `step` of them (or the
  // rest of the frame) is ready, so that the caller works on the first part while the rest is on
  // its way: ready means received, and, where the exchange also sends this peer a frame, sent as
  // far (frame data bytes), so that the caller may overwrite what it sent up to there.
  struct Recv {
    int peer;
    void* data;
    int64_t capacity;
    int64_t received = 0;
    std::function<void(int64_t)> on_data = nullptr;
    int64_t step = 0;
    int64_t minimum = 0;  // a shorter frame breaks the links, as a longer one than `capacity` does
  };

  // Connects rank `rank` of `backend` (a gloo backend of the ranks `group_ranks` of the caller's
  // group, in order) to every other of its ranks, as Note [Socket links] describes; raises, naming
  // the rank and its address, when a link cannot be made within `timeout`, which also bounds every
  // later exchange. Peers are indices of `group_ranks`; errors name the group's ranks.
  static std::unique_ptr<SocketLinks> connect(c10d::Backend& backend, int rank, std::vector<int> group_ranks,
                                              std::chrono::milliseconds timeout);
  ~SocketLinks();
  SocketLinks(const SocketLinks&) = delete;
  SocketLinks& operator=(const SocketLinks&) = delete;

  // Sends every frame of `sends` and receives every frame of `recvs`, all at once, as part of the
  // collective numbered `sequence`; returns once all are done. Raises (and breaks the links) when a
  // peer closed its connection, the timeout expired, or a frame was not the one expected; then
  // failed_peer() names the peer.
  void exchange(uint64_t sequence, std::vector<Send> sends, std::vector<Recv>& recvs);

  // Shuts every link down, so that no peer waits for this rank (after a failure).
  void shut_down() noexcept;

  // Breaks the links over a failure of this rank's own in a collective (`why`): shuts every one down,
  // so that a partner waiting for this rank's frames raises at once, and every later exchange raises
  // naming `why` (unless the links had already broken).
  void break_off(const std::string& why) noexcept;

  // After exchange() raised: best effort, sends `peer` one frame of `bytes` (a center's news of which
  // rank failed, Note [One round across hosts]) over its own connection, which may still work;
  // gives up after a second and never raises.
  void send_last_words(uint64_t sequence, int peer, const void* data, int64_t bytes) noexcept;

  // The peer (an index of group_ranks) of the exchange that broke the links, or -1.
  int failed_peer() const { return failed_peer_; }
  int rank() const { return rank_; }
  int size() const { return static_cast<int>(fds_.size()); }

 private:
  SocketLinks(int rank, std::vector<int> fds, std::vector<int> group_ranks, std::chrono::milliseconds timeout)
      : rank_(rank), fds_(std::move(fds)), group_ranks_(std::move(group_ranks)), timeout_(timeout) {}
  [[noreturn]] void fail(int peer, const std::string& why, const std::vector<int>& cut_off);

  int rank_;
  std::vector<int> fds_;          // by peer; -1 for this rank
  std::vector<int> group_ranks_;  // by peer
  std::chrono::milliseconds timeout_;
  int failed_peer_ = -1;
  std::string broken_;  // why the links broke; empty while they work
#ifdef DDPKIT_TESTING
  bool stale_frame_pending_ = true;  // testing/faults.h: stale_link_frame
#endif
};

}  // namespace ddpkit::comm
