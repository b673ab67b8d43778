#pragma once
// Which ranks of a group share a host, and its discovery (Note [Topology]).

#include <cstdint>
#include <string>
#include <vector>

namespace ddpkit::comm {

class Communicator;

// Note [Topology]
// A group's set-up (Note [Group set-up]) starts with discovery, over the group's own messages, never
// through the store: every rank sends rank 0 a hello (its pid, effective uid, host identity and
// kernel), and rank 0 answers every rank with the plan (each rank's host, pid and how many of the
// group's ranks share its kernel, and a fresh nonce). The host identity is the hostname, boot id,
// the device of /dev/shm and the pid namespace, so that two containers or network namespaces with a
// private /dev/shm on one kernel are told apart. The answer is the same on every rank, per group, so
// subgroups and 2-D meshes get their own (torchrun's LOCAL_RANK and LOCAL_WORLD_SIZE describe the
// launch, not a group). Ranks of different users on one host count as different hosts: they cannot
// share memory. Hosts are numbered by their lowest rank; a rank's local rank is its index among its
// host's ranks. A rank that dies or stops before its hello is reported by rank 0's process-group
// wait, naming it, and rank 0 relays that to the others (tests/test_hardening.py, die_at_hello).
struct Topology {
  std::vector<std::vector<int>> hosts;  // per host, its ranks in rank order
  std::vector<int> host_of;             // per rank, its host
  int rank = 0;

  // From each rank's host key (equal keys: one host), as seen by `rank`.
  static Topology from_keys(const std::vector<int64_t>& keys, int rank);

  int host() const { return host_of[rank]; }
  const std::vector<int>& local_ranks() const { return hosts[host()]; }
  int local_rank() const { return local_rank_of(rank); }
  // `r`'s index among its host's ranks.
  int local_rank_of(int r) const;
  int local_size() const { return static_cast<int>(local_ranks().size()); }
  // Every rank on one host.
  bool single_host() const { return hosts.size() == 1; }
  // More than one host: hierarchical collectives apply (Note [Hierarchical collectives]; with one rank
  // on every host, only their steps across hosts run).
  bool hierarchical() const;
  // Every host holds the same number of ranks.
  bool uniform() const;
  // With equal hosts (uniform()), the rank at local-major position p = j·H + i of the H hosts: local
  // rank j of host i. The hierarchical all-gather and reduce-scatter hold the ranks' blocks in this
  // order, so that the step across hosts moves one contiguous run of H blocks per local rank and the
  // step inside the host the L runs.
  int local_major_rank(int position) const {
    const int count = static_cast<int>(hosts.size());
    return hosts[position % count][position / count];
  }
};

// What a group's discovery learnt (Note [Topology]): the topology, and what the segments' set-up
// needs to know of every rank.
struct Discovery {
  Topology topology;
  std::vector<int64_t> pids;       // per rank: its pid, in the pid namespace its host's ranks share
  std::vector<int64_t> on_kernel;  // per rank: how many of the group's ranks run on its kernel
  uint64_t nonce = 0;              // fresh per set-up, alike on every rank: names what the group makes together
};

// This process's host identity (Note [Topology]): processes with the same one can share a segment
// (same kernel boot, same /dev/shm, same pid namespace, so that the pids published for the liveness
// check mean the same process to every rank).
std::string host_identity();

// Collective over the ranks of `setup`'s group (a communicator made for the group's set-up:
// Communicator::use_for_setup), each rank naming its host by `identity` (host_identity(), or what
// the part factory says: Note [Test seam]). Throws on every rank, naming the rank, when a rank died
// or stopped answering.
Discovery discover_topology(Communicator& setup, const std::string& identity);

// Whether the kernel that rank `rank` runs on has `threads` CPUs for each of the group's ranks on
// it, the simulated hosts' included (they share its CPUs): what decides whether shared-memory waits
// spin (1: Note [Waiting on shared memory]) and whether the links send on a thread (2: Note [A
// thread for sending]).
bool cpus_for_each_rank(const Discovery& group, int rank, int threads);

}  // namespace ddpkit::comm
