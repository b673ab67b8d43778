#pragma once
// Test-only fault injection: DDPKIT_TEST_FAULT=<fault>:<rank> makes that rank fail at a chosen point
// that no test could otherwise hit at the right moment. Read once per process.
//  die_at_hello, die_at_offer, die_at_map, die_at_verdict: the rank SIGKILLs itself at that step of
//    the shared-memory set-up (Note [Shared-memory segment]): before sending its hello; rank 0 after
//    creating the segment, before offering it; after mapping it, before answering; rank 0 after the
//    answers, before the verdict.
//  die_in_host_step: the rank SIGKILLs itself in a small all-reduce across equal hosts, after the
//    check's step inside its host and before the host's all-reduce (Note [One round across hosts]).
//  die_in_host_data_step: the rank SIGKILLs itself in a large all-reduce across equal hosts, after
//    the collective check and before the reduce-scatter inside its host (Note [Hierarchical
//    collectives]).
//  corrupt_chunk: the rank's first shared-memory message chunk claims to lie at offset 2^46 of its
//    message (Note [Shared-memory messages]), as a forged or corrupted segment would.
//  stray_links: at the set-up of the socket links (Note [Socket links]), before any rank can connect,
//    the rank connects to its own listener twice: once naming the rank it expects with a wrong token,
//    once sending junk; set-up then checks that it rejected both.
//  links_cannot_listen: the rank fails to listen at the set-up of the socket links.
//  stale_link_frame: the rank's first frame over the socket links carries the previous collective's
//    sequence number, as a frame of an abandoned collective would.
//  no_liveness_poll: the rank's shared-memory waits never run their periodic check (of the peers'
//    liveness and of the timeout): only the peer watch (Note [Prompt death notice]) or a peer's
//    progress ends them.
// DDPKIT_TEST_HOSTS=<label of rank 0>,<label of rank 1>,... splits one machine into hosts for the
// tests (Note [Topology]): processes whose RANK (torchrun's) has different labels count as different
// hosts, in every group. The tests of real
// hosts use network and mount namespaces instead (tests/test_multihost.py).

//
// All of it exists only in a testing build (the CMake option DDPKIT_TESTING, which scripts/setup.sh
// turns on for the test suite and the benchmarks). The call sites use the macros below, which a
// release build (`pip install .`) reduces to constants, so that no fault point, fault name or test
// variable reaches the shipped library (scripts/check_release_strings.sh builds one and checks).

#include <string>

#ifdef DDPKIT_TESTING

#include <string_view>

namespace ddpkit::testing {

// True when DDPKIT_TEST_FAULT names `fault` for `rank`.
bool fault_armed(std::string_view fault, int rank);

// SIGKILLs this process when DDPKIT_TEST_FAULT names `fault` for `rank`.
void die_if_fault_armed(std::string_view fault, int rank);

// This process's label in DDPKIT_TEST_HOSTS (by its RANK), or "" when either is unset.
std::string test_host();

}  // namespace ddpkit::testing

#define DDPKIT_FAULT_ARMED(fault, rank) (::ddpkit::testing::fault_armed((fault), (rank)))
#define DDPKIT_DIE_IF_FAULT_ARMED(fault, rank) (::ddpkit::testing::die_if_fault_armed((fault), (rank)))
#define DDPKIT_TEST_HOST() (::ddpkit::testing::test_host())

#else

#define DDPKIT_FAULT_ARMED(fault, rank) false
#define DDPKIT_DIE_IF_FAULT_ARMED(fault, rank) ((void)0)
#define DDPKIT_TEST_HOST() std::string()

#endif
