#include "comm/engine/group_setup.h"

#include "comm/checks/cross_host_check.h"
#include "comm/checks/root_verdict.h"
#include "comm/checks/slot_check.h"
#include "comm/engine/part_factory.h"
#include "comm/hierarchy/equal_hosts.h"
#include "comm/hierarchy/unequal_hosts.h"
#include "comm/links/socket_links.h"
#include "comm/shm/setup.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <algorithm>
#include <exception>
#include <vector>

namespace ddpkit::comm {
namespace {

// The subgroup of `parent` (the group's CPU backend, of `size` ranks) over `ranks` (this rank among
// them) for the steps across hosts, made with its own store connection (split clones the store).
c10::intrusive_ptr<c10d::Backend> split_backend(const c10::intrusive_ptr<c10d::Backend>& parent, int size,
                                                const std::vector<int>& ranks,
                                                const c10::intrusive_ptr<c10d::Store>& group_store, uint64_t nonce,
                                                int index) {
  // gloo's split takes the parent's options (its devices, so GLOO_SOCKET_IFNAME's interface, and its
  // timeout) and writes the subgroup's ranks into them; the parent keeps its own.
  c10::intrusive_ptr<c10d::Backend::Options> options = parent->getBackendOptions();
  const std::vector<uint64_t> parent_ranks = options->global_ranks_in_group;
  if (options->global_ranks_in_group.empty()) {
    // A gloo backend made outside init_process_group/new_group (the "ddpkit" backend's inner one)
    // has no ranks recorded, and split reads one per member: they are the group's own.
    for (int r = 0; r < size; ++r) options->global_ranks_in_group.push_back(static_cast<uint64_t>(r));
  }
  auto store = c10::make_intrusive<c10d::PrefixStore>(c10::str("ddpkit/cross/", nonce, "/", index, "/"), group_store);
  c10::intrusive_ptr<c10d::Backend> cross = parent->split(store, ranks, options);
  options->global_ranks_in_group = parent_ranks;
  return cross;
}

// The steps across hosts among the group's ranks `cross` (this rank among them; Note [Steps across
// hosts]), over a subgroup split from `cpu`, with the socket links between every pair of them.
std::unique_ptr<CrossHostSteps> connect_across_hosts(const std::vector<int>& cross, Hierarchy& hierarchy,
                                                     const c10::intrusive_ptr<c10d::Backend>& cpu, int size,
                                                     const c10::intrusive_ptr<c10d::Store>& store,
                                                     const Discovery& discovery, std::chrono::milliseconds timeout,
                                                     int rank) {
  const uint64_t nonce = discovery.nonce;
  const int index = hierarchy.topology.uniform() ? hierarchy.topology.local_rank() : 0;
  c10::intrusive_ptr<c10d::Backend> subgroup = split_backend(cpu, size, cross, store, nonce, index);
  TORCH_INTERNAL_ASSERT(subgroup, "splitting the group's backend gave no subgroup");
  const int cross_rank = static_cast<int>(std::find(cross.begin(), cross.end(), rank) - cross.begin());
  // Note [Threads of the links]: a receiving thread where each rank has 3 CPUs, a sending one with 2.
  LinkThreading threading;
  if (cpus_for_each_rank(discovery, rank, 2)) threading = {kLinkThreadBytes, cpus_for_each_rank(discovery, rank, 3)};
  std::shared_ptr<Links> links = part_factory().links(*subgroup, cross_rank, cross, timeout, threading);
  // The capability table of Note [Steps across hosts]: two hosts swap over their link, more run a
  // ring over their links.
  if (cross.size() == 2) return std::make_unique<SwapSteps>(cross_rank, cross, links, hierarchy.scratch);
  return std::make_unique<RingSteps>(cross_rank, cross, links, subgroup, hierarchy.scratch);
}

}  // namespace

GroupSetUp set_up_group(Communicator& setup, const c10::intrusive_ptr<c10d::Backend>& cpu,
                        const std::function<c10::intrusive_ptr<c10d::Store>()>& store,
                        std::chrono::milliseconds timeout, std::string_view what) {
  GroupSetUp group;
  // Over the group's own messages, as part of this collective: discovery (Note [Topology]), then
  // this host's segment (Note [Shared-memory segment]).
  const PartFactory& parts = part_factory();
  const Discovery discovery = discover_topology(setup, parts.host_identity());
  group.topology = discovery.topology;
  const SegmentOptions options =
      parts.segment_options(group.topology.local_size(), cpus_for_each_rank(discovery, setup.rank(), 1), setup.rank());
  if (std::shared_ptr<ShmSegment> segment = set_up_segment(setup, discovery, timeout, options)) {
    group.shm = parts.host_transport(std::move(segment));
    group.shm_check = std::make_unique<SlotCheck>(*group.shm->direct());
  }
  const Topology& topology = group.topology;
  // Every rank of the group must agree on whether it is hierarchical: the cross subgroups come from
  // splitting the group's gloo backend, possible on every rank or on none.
  if (!topology.hierarchical() || !cpu->supportsSplitting() || !store) return group;
  // Note [Hierarchical collectives]: the ranks this rank crosses hosts with.
  auto hierarchy = std::make_unique<Hierarchy>();
  hierarchy->topology = topology;
  hierarchy->local = group.shm;
  // Note [Hierarchical collectives]: the form of the data steps, for the hosts' shape, once.
  const bool equal_hosts = topology.uniform();
  if (equal_hosts) {
    hierarchy->form = std::make_unique<EqualHostsForm>(*hierarchy);
  } else {
    hierarchy->form = std::make_unique<UnequalHostsForm>(*hierarchy);
  }
  std::vector<int> cross;
  if (equal_hosts) {
    for (const auto& host : topology.hosts) cross.push_back(host[topology.local_rank()]);
  } else if (topology.local_rank() == 0) {
    for (const auto& host : topology.hosts) cross.push_back(host.front());
  }
  std::exception_ptr failure;
  try {
    if (!cross.empty()) {
      hierarchy->cross =
          connect_across_hosts(cross, *hierarchy, cpu, setup.size(), store(), discovery, timeout, setup.rank());
    }
  } catch (...) {
    failure = std::current_exception();
  }
  // The cross subgroups set up apart (each learns only of its own failures), and the ranks that
  // cross no hosts (the leaders' form) set up none: the whole group learns whether all did, so that
  // every rank raises, and the next collective sets up again on every rank, instead of some ranks
  // going on to wait for the others' steps.
  // With it, whether any link crosses a long path (CrossHostSteps::long_paths), so that every rank
  // takes the same steps across hosts.
  at::Tensor flags_of_ranks = at::zeros({2, setup.size()}, at::kLong);
  at::Tensor failed = flags_of_ranks[0];
  failed[setup.rank()] = failure ? 1 : 0;
  if (!failure && hierarchy->cross)
    flags_of_ranks[1][setup.rank()] = hierarchy->cross->links().crosses_long_paths() ? 1 : 0;
  std::vector<at::Tensor> flags{flags_of_ranks};
  try {
    cpu->allreduce(flags)->wait();
  } catch (...) {
    if (failure) std::rethrow_exception(failure);  // this rank's own reason first (a peer that died)
    throw;
  }
  if (failure) std::rethrow_exception(failure);
  std::vector<int> failed_ranks;
  for (int r = 0; r < setup.size(); ++r) {
    if (failed[r].item<int64_t>() != 0) failed_ranks.push_back(r);
  }
  TORCH_CHECK(failed_ranks.empty(), "ddpkit.", what, " (", setup.where(), "): rank ",
              c10::Join(", rank ", failed_ranks),
              " could not set up its steps across hosts (its error says why); the next collective sets them up again");
  // Note [Check seam]: across equal hosts every collective of the group takes the round across
  // hosts, whatever path its data take; across unequal ones the root's verdict over the process
  // group, which stops the host's shared memory where a rank rejects its arguments unchecked.
  if (hierarchy->cross) hierarchy->cross->set_long_paths(flags_of_ranks[1].sum().item<int64_t>() > 0);
  if (equal_hosts) {
    group.hierarchy_check = std::make_unique<CrossHostCheck>(*hierarchy);
  } else {
    group.hierarchy_check = std::make_unique<RootVerdictCheck>(hierarchy->host());
  }
  group.hierarchy = std::move(hierarchy);
  return group;
}

}  // namespace ddpkit::comm
