#pragma once
// Which way a collective's data go (Note [Routes]).

#include "comm/core/algorithm.h"
#include "comm/core/communicator.h"
#include "comm/core/header.h"
#include "comm/reduction/reduce_op.h"

#include <cstdint>
#include <string>

namespace ddpkit::comm {

// Note [Routes]
// Every public collective of collectives/collectives.h asks choose_route() once, with its kind and arguments,
// which route serves it on this communicator, then runs that route; no route decides again. What a
// route may take is what the communicator can do: its transport's direct collectives (shared
// memory), its group's hierarchy (a group spanning hosts, Note [Hierarchical collectives]), else
// the transport's messages. The collectives without an algorithm of their own and without a form
// across hosts (gather, scatter, all_to_all) always get kSchedule. A rank whose arguments, or
// asked-for algorithm (validated in one place: Note [Algorithms a rank can run] in collectives/routes.cpp), it
// cannot serve takes the route kAuto would take, so that it meets its peers' first step, with
// `error` naming why, and raises there with them (Note [Collective checks]).
// A route is the path a call takes, in words of its own; the algorithm its caller picked maps onto it
// (Note [Vocabulary]): 'direct' to kTransportCollective, 'hierarchical' to kOneRound or kHostSteps,
// 'process_group' to kBackendCollective, the schedules of Note [All-reduce algorithms] to kSchedule.
enum class Route {
  kTransportCollective,  // the transport's direct collectives; the check rides in their first step (run_direct)
  kOneRound,             // across equal hosts, the data riding in the check's round (Note [One round across hosts])
  kHostSteps,            // the check, then the steps inside each host and across them (Note [Hierarchical collectives])
  kBackendCollective,    // the check (skipped where asked for by name: the baseline), then the backend's own all-reduce
  kSchedule,             // the check, then a flat message schedule (Note [All-reduce algorithms]) on the transport
};

// What a collective asks choose_route() about.
struct RouteQuery {
  CollectiveKind kind;
  Algorithm algorithm = Algorithm::kAuto;  // as the caller asked for it
  int64_t bytes = 0;                       // its data as they are (0 where this rank rejected its arguments)
  int64_t working_bytes = 0;               // its data in the dtype it is reduced in (working_dtype)
  ReduceOp op = ReduceOp::kSum;
};

struct RouteChoice {
  Route route;
  // The schedule kSchedule runs where the collective has a choice of them, else what the route
  // stands for (kAuto where nothing is chosen).
  Algorithm algorithm;
};

// The route of `query` on `comm`. An algorithm this rank cannot run sets `error` (when it holds none
// yet) and takes kAuto's route. A group of one rank always gets kSchedule, which moves nothing.
RouteChoice choose_route(const RouteQuery& query, const Communicator& comm, std::string& error);

}  // namespace ddpkit::comm
