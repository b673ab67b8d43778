#pragma once
// Which ranks of a group share a host (Note [Topology]).

#include <cstdint>
#include <vector>

namespace ddpkit::comm {

// Note [Topology]
// A group's first collective that may use shared memory sets it up (Note [Shared-memory segment]),
// and that set-up learns, from the host identity every rank sends rank 0 over the group's own
// messages, which ranks share a host: the same answer on every rank, per group, so subgroups and
// 2-D meshes get their own (torchrun's LOCAL_RANK and LOCAL_WORLD_SIZE describe the launch, not a
// group). Ranks of different users on one host count as different hosts: they cannot share memory.
// Hosts are numbered by their lowest rank; a rank's local rank is its index among its host's ranks.
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
};

}  // namespace ddpkit::comm
