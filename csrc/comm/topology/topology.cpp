#include "comm/topology/topology.h"

#include "comm/core/communicator.h"
#include "comm/topology/setup_messages.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <thread>

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

// ---- Discovery (Note [Topology]) ----

namespace {

using namespace setup_messages;

constexpr size_t kIdentityBytes = 512;
constexpr size_t kKernelBytes = 64;  // a boot id is 36 characters

std::string read_first_line(const char* path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

}  // namespace

std::string host_identity() {
  char hostname[256] = {0};
  gethostname(hostname, sizeof(hostname) - 1);
  struct stat shm{};
  stat("/dev/shm", &shm);
  struct stat pid_ns{};
  stat("/proc/self/ns/pid", &pid_ns);
  return c10::str(hostname, "|", read_first_line("/proc/sys/kernel/random/boot_id"), "|", shm.st_dev, ":", shm.st_ino,
                  "|", pid_ns.st_ino);
}

namespace {

struct Hello {
  int64_t pid;
  int64_t euid;
  char identity[kIdentityBytes];
  char kernel[kKernelBytes];  // the kernel's boot id: ranks with the same one share its CPUs
};

// Rank 0's answer to the hellos.
struct Plan {
  int64_t status;  // kOk, or kFailed with the three fields below
  int64_t failure;
  int64_t failed_rank;
  int64_t error_number;
  uint64_t nonce;
  // followed by one int64 host (its lowest rank), one int64 pid and one int64 count of the group's
  // ranks on its kernel per rank
};

}  // namespace

Discovery discover_topology(Communicator& setup, const std::string& identity) {
  const int rank = setup.rank();
  const int size = setup.size();
  Hello mine{};
  mine.pid = getpid();
  mine.euid = static_cast<int64_t>(geteuid());
  std::memcpy(mine.identity, identity.data(), std::min(identity.size(), kIdentityBytes - 1));
  const std::string kernel = read_first_line("/proc/sys/kernel/random/boot_id");
  std::memcpy(mine.kernel, kernel.data(), std::min(kernel.size(), kKernelBytes - 1));
  const size_t plan_extra = 24 * static_cast<size_t>(size);

  at::Tensor plan_message;
  if (rank == 0) {
    std::vector<at::Tensor> hellos(size);
    MessageList messages;
    try {
      for (int peer = 1; peer < size; ++peer) {
        hellos[peer] = at::empty({static_cast<int64_t>(sizeof(Hello))}, at::kByte);
        messages.push_back(setup.irecv(hellos[peer], peer, kHelloRound));
      }
      setup.wait(messages);
    } catch (...) {
      abort_all(messages);
      const int failed = setup.failed_peer();
      tell(setup, all_ranks(size), message_of(Plan{kFailed, kPeerFailed, failed, 0, 0}, plan_extra), kPlanRound,
           failed);
      throw;
    }
    std::random_device random;
    Plan plan{kOk, kNoFailure, -1, 0, (static_cast<uint64_t>(random()) << 32) ^ random()};
    plan_message = message_of(plan, plan_extra);
    auto* hosts = reinterpret_cast<int64_t*>(plan_message.data_ptr<uint8_t>() + sizeof(Plan));
    int64_t* pids = hosts + size;
    int64_t* on_kernel = pids + size;
    for (int r = 0; r < size; ++r) {
      const Hello hello = r == 0 ? mine : value_of<Hello>(hellos[r]);
      pids[r] = hello.pid;
      on_kernel[r] = 0;
      for (int other = 0; other < size; ++other) {
        const Hello theirs = other == 0 ? mine : value_of<Hello>(hellos[other]);
        on_kernel[r] += std::memcmp(theirs.kernel, hello.kernel, kKernelBytes) == 0 ? 1 : 0;
      }
      hosts[r] = r;
      for (int earlier = 0; earlier < r; ++earlier) {  // the host is its lowest rank with the same identity
        const Hello other = earlier == 0 ? mine : value_of<Hello>(hellos[earlier]);
        if (other.euid == hello.euid && std::memcmp(other.identity, hello.identity, kIdentityBytes) == 0) {
          hosts[r] = earlier;
          break;
        }
      }
    }
    for (int peer = 1; peer < size; ++peer) messages.push_back(setup.isend(plan_message, peer, kPlanRound));
    setup.wait(messages);
  } else {
    plan_message = at::empty({static_cast<int64_t>(sizeof(Plan) + plan_extra)}, at::kByte);
    MessageList answer{setup.irecv(plan_message, 0, kPlanRound)};
    MessageList sent{setup.isend(message_of(mine), 0, kHelloRound)};
    const Plan plan = wait_for_answer<Plan>(setup, answer, sent, plan_message);
    TORCH_CHECK(plan.status == kOk, Words(setup).relayed(plan.failed_rank, plan.failure, plan.error_number),
                " (rank 0 reported it)");
  }
  const auto* host_keys = reinterpret_cast<const int64_t*>(plan_message.data_ptr<uint8_t>() + sizeof(Plan));
  Discovery discovery;
  discovery.topology = Topology::from_keys(std::vector<int64_t>(host_keys, host_keys + size), rank);
  discovery.pids.assign(host_keys + size, host_keys + 2 * size);
  discovery.on_kernel.assign(host_keys + 2 * size, host_keys + 3 * size);
  discovery.nonce = value_of<Plan>(plan_message).nonce;
  return discovery;
}

bool cpus_for_each_rank(const Discovery& group, int rank, int threads) {
  return threads * group.on_kernel[rank] <= static_cast<int64_t>(std::max(1u, std::thread::hardware_concurrency()));
}

}  // namespace ddpkit::comm
