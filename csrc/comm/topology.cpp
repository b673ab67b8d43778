#include "comm/topology.h"

#include <algorithm>
#include <map>

namespace ddpkit::comm {

Topology Topology::from_keys(const std::vector<int64_t>& keys, int rank) {
  Topology topology;
  topology.rank = rank;
  topology.host_of.resize(keys.size());
  std::map<int64_t, int> host_of_key;
  for (size_t r = 0; r < keys.size(); ++r) {
    auto [it, fresh] = host_of_key.emplace(keys[r], static_cast<int>(topology.hosts.size()));
    if (fresh) topology.hosts.emplace_back();
    topology.hosts[it->second].push_back(static_cast<int>(r));
    topology.host_of[r] = it->second;
  }
  return topology;
}

int Topology::local_rank_of(int r) const {
  const auto& local = hosts[host_of[r]];
  return static_cast<int>(std::find(local.begin(), local.end(), r) - local.begin());
}

bool Topology::hierarchical() const { return hosts.size() > 1; }

bool Topology::uniform() const {
  return std::all_of(hosts.begin(), hosts.end(),
                     [&](const std::vector<int>& host) { return host.size() == hosts.front().size(); });
}

}  // namespace ddpkit::comm
