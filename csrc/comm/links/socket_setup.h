#pragma once
// The set-up of the socket links in three steps over one resources struct, as NCCL's shm.cc sets a
// transport up, connects it and frees it (Note [Socket links]): internal to the links, whose
// SocketLinks::connect (socket_setup.cpp) runs them.

#include "comm/links/socket_io.h"
#include "comm/links/socket_links.h"

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <sys/socket.h>

#include <chrono>
#include <cstdint>
#include <utility>
#include <vector>

namespace ddpkit::comm {

// What one set-up of the links of rank `rank` among `group_ranks` holds, from its first step to the
// SocketLinks it makes: its listener, every rank's address and token, and the links made so far, each
// descriptor owned here until the links take it (and closed, with the listener, wherever a step raises).
struct LinkSetUp {
  LinkSetUp(int rank, std::vector<int> group_ranks, LinkListener listener)
      : rank(rank), group_ranks(std::move(group_ranks)), listener(std::move(listener)) {}

  int rank;
  std::vector<int> group_ranks;  // the caller's group's rank of every peer, for errors
  LinkListener listener;
  socket_io::Clock::time_point deadline{};  // set by announce(), once every rank is present
  std::vector<sockaddr_storage> addresses;  // by peer, where it listens
  std::vector<uint64_t> tokens;             // by peer, the token a connecting rank must name
  std::vector<socket_io::Fd> links;         // by peer; empty until connected or accepted
  int refused = 0;                          // connections accept_higher_ranks() closed unanswered

  int size() const { return static_cast<int>(group_ranks.size()); }
};

// Step 1, a collective of `backend` (the gloo backend of the ranks `group_ranks`): every rank's
// address and token to every rank, all-gathered. A rank that could not listen still takes part,
// announcing no address, so that every rank raises now, naming it, rather than at the group's timeout.
// From its return every rank is present: the links get the whole `timeout`, whoever came late.
void announce(c10d::Backend& backend, LinkSetUp& setup, std::chrono::milliseconds timeout);

// Step 2: connects to every lower rank, introducing itself with that rank's token, and waits for its
// answer; raises, naming the rank and its address, by the deadline.
void connect_to_lower_ranks(LinkSetUp& setup);

// Step 3: accepts every higher rank, closing unanswered whatever does not name this rank's token and
// a rank still expected (counted in `refused`), and answers the others; raises by the deadline.
void accept_higher_ranks(LinkSetUp& setup);

}  // namespace ddpkit::comm
