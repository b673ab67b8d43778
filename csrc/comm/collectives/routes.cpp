#include "comm/collectives/routes.h"

#include <bit>

namespace ddpkit::comm {
namespace {

// True when `bytes` of data may ride in the collective check's messages (Note [Check seam]): checks
// on, this rank's arguments accepted, and a check that carries data (the round across equal hosts),
// that much of it. An empty tensor rides too, where the check can carry data at all.
bool fits_one_round(int64_t bytes, const std::string& error, const Communicator& comm) {
  const int64_t capacity = comm.ride_along_bytes();
  return is_checked() && error.empty() && capacity > 0 && bytes <= capacity;
}

// Note [Algorithms a rank can run]
// Every collective that takes an algorithm validates it here, and only here: the all-reduce takes
// every algorithm of Note [All-reduce algorithms] (the recursive ones fold a world size that is not
// a power of two), the all-gather and the reduce-scatter those of Note [All-gather and
// reduce-scatter], 'halving_doubling' only on a power-of-two world size. 'direct' needs the
// transport's direct collectives and 'hierarchical' a group spanning hosts, except on a group of one
// rank, which moves nothing whatever it is asked to run (test_block_collective_errors.py's
// test_an_algorithm_is_validated_alike_by_every_collective). An algorithm this rank cannot run sets
// `error` (when it holds none yet), so that the rank rejects its arguments in the collective check
// like any other bad argument and its peers learn it (Note [Collective checks]); the rank then takes
// kAuto's route, which meets its peers' first step whatever they chose.
Algorithm validate_algorithm(CollectiveKind kind, Algorithm algorithm, const Communicator& comm, std::string& error) {
  const std::string_view what = comm.what();
  const bool blocks = kind == CollectiveKind::kAllGather || kind == CollectiveKind::kReduceScatter;
  const bool one_rank = comm.size() == 1;
  std::string problem;
  if (blocks && algorithm != Algorithm::kAuto && algorithm != Algorithm::kRing && algorithm != Algorithm::kDirect &&
      algorithm != Algorithm::kHalvingDoubling && algorithm != Algorithm::kHierarchical) {
    problem = c10::str("ddpkit.", what,
                       ": algorithm must be 'auto', 'ring', 'halving_doubling', 'direct' or 'hierarchical', got '",
                       algorithm_name(algorithm), "'");
  } else if (algorithm == Algorithm::kDirect && !comm.has_direct() && !one_rank) {
    problem = c10::str("ddpkit.", what,
                       ": algorithm 'direct' needs the shared-memory transport (every rank on this host, CPU tensors)");
  } else if (algorithm == Algorithm::kHierarchical && comm.hierarchy() == nullptr && !one_rank) {
    problem = c10::str("ddpkit.", what,
                       ": algorithm 'hierarchical' needs a group spanning hosts, and CPU "
                       "tensors over transport 'auto'");
  } else if (blocks && algorithm == Algorithm::kHalvingDoubling &&
             !std::has_single_bit(static_cast<unsigned>(comm.size()))) {
    problem = c10::str("ddpkit.", what, ": algorithm 'halving_doubling' needs a power-of-two world size, got ",
                       comm.size(), "; use 'ring'");
  }
  if (problem.empty()) return algorithm;
  if (error.empty()) error = std::move(problem);
  return Algorithm::kAuto;
}

// What kAuto runs for the all-gather and the reduce-scatter (Note [All-gather and reduce-scatter]).
Algorithm automatic_block_algorithm(const Communicator& comm) {
  return comm.has_direct()             ? Algorithm::kDirect
         : comm.hierarchy() != nullptr ? Algorithm::kHierarchical
                                       : Algorithm::kRing;
}

// kAllReduce's route: the algorithm asked for where this rank can run it, else kAuto's choice
// (Note [Choosing an algorithm]).
RouteChoice route_all_reduce(const RouteQuery& query, const Communicator& comm, std::string& error) {
  Algorithm algorithm = validate_algorithm(CollectiveKind::kAllReduce, query.algorithm, comm, error);
  const int n = comm.size();
  if (algorithm == Algorithm::kAuto) {
    const int64_t bytes = error.empty() ? query.bytes : 0;
    algorithm =
        choose_algorithm(bytes, n, comm.device_type(), comm.has_direct(), comm.hierarchy() != nullptr, query.op);
  }
  if (n == 1) return {Route::kSchedule, algorithm};
  switch (algorithm) {
    case Algorithm::kDirect: return {Route::kTransportCollective, algorithm};
    case Algorithm::kHierarchical:
      return {fits_one_round(query.working_bytes, error, comm) ? Route::kOneRound : Route::kHostSteps, algorithm};
    case Algorithm::kProcessGroup: return {Route::kBackendCollective, algorithm};
    default: return {Route::kSchedule, algorithm};
  }
}

// kAllGather's and kReduceScatter's route.
RouteChoice route_blocks(const RouteQuery& query, const Communicator& comm, std::string& error) {
  Algorithm algorithm = validate_algorithm(query.kind, query.algorithm, comm, error);
  if (algorithm == Algorithm::kAuto) algorithm = automatic_block_algorithm(comm);
  if (comm.size() > 1 && algorithm == Algorithm::kDirect) return {Route::kTransportCollective, algorithm};
  if (comm.size() > 1 && algorithm == Algorithm::kHierarchical) {
    const int64_t bytes = query.kind == CollectiveKind::kAllGather ? query.bytes : query.working_bytes;
    return {fits_one_round(bytes, error, comm) ? Route::kOneRound : Route::kHostSteps, algorithm};
  }
  return {Route::kSchedule, algorithm};
}

// A collective with a root or none of its own algorithm (broadcast, reduce): across hosts
// hierarchically, small ones in one round, else ddpkit's schedule on the transport.
RouteChoice route_across_hosts_or_flat(int64_t one_round_bytes, const Communicator& comm, const std::string& error) {
  if (comm.hierarchy() == nullptr || comm.size() == 1) return {Route::kSchedule, Algorithm::kAuto};
  const bool one_round = fits_one_round(one_round_bytes, error, comm);
  return {one_round ? Route::kOneRound : Route::kHostSteps, Algorithm::kHierarchical};
}

}  // namespace

RouteChoice choose_route(const RouteQuery& query, const Communicator& comm, std::string& error) {
  const int n = comm.size();
  switch (query.kind) {
    case CollectiveKind::kAllReduce: return route_all_reduce(query, comm, error);
    case CollectiveKind::kBroadcast: return route_across_hosts_or_flat(query.bytes, comm, error);
    case CollectiveKind::kReduce: return route_across_hosts_or_flat(query.working_bytes, comm, error);
    case CollectiveKind::kAllGather:
    case CollectiveKind::kReduceScatter: return route_blocks(query, comm, error);
    case CollectiveKind::kBarrier:
      // With checks on, a check that carries data (the round across equal hosts) is a barrier in
      // itself (Note [One round across hosts]); so is one step of the direct collectives, checked or not.
      if (n > 1 && is_checked() && comm.ride_along_bytes() > 0) return {Route::kOneRound, Algorithm::kHierarchical};
      if (comm.has_direct()) return {Route::kTransportCollective, Algorithm::kDirect};
      return {Route::kSchedule, Algorithm::kAuto};
    case CollectiveKind::kGather:
    case CollectiveKind::kScatter:
    case CollectiveKind::kAllToAll:
      // No algorithm of their own, and nothing of the hierarchy's: a flat schedule on the transport,
      // over shared memory or the process group alike.
      return {Route::kSchedule, Algorithm::kAuto};
  }
  TORCH_INTERNAL_ASSERT(false, "unknown collective ", static_cast<int64_t>(query.kind));
}

}  // namespace ddpkit::comm
