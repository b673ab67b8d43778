#pragma once
// Test-only fault injection, compiled into a testing build only (the CMake option DDPKIT_TESTING):
// DDPKIT_TEST_FAULT=<fault>:<rank> makes that rank of the group (its rank in the group being set up)
// fail at a point that no test could otherwise hit at the right moment. Read once per process. The
// faults live in the parts a testing build's PartFactory makes (fault_parts.cpp, Note [Test seam] in
// comm/engine/part_factory.h), decorators of the interfaces the release library's parts implement:
//  die_at_hello, die_at_offer, die_at_map, die_at_verdict: the rank SIGKILLs itself as it sends, over
//    the transport that carries the group's set-up (Note [Shared-memory segment]), its hello; its
//    offer of the host's segment (a leader, after creating it); its answer to its leader (after
//    mapping the segment); the verdict (rank 0, after its host leaders' answers).
//  die_in_host_step: the rank SIGKILLs itself as its host's direct all-reduce starts: in a small
//    all-reduce across equal hosts, after the check's step inside its host (Note [One round across
//    hosts]).
//  die_in_host_data_step: the rank SIGKILLs itself as its host's direct reduce-scatter starts: in a
//    large all-reduce across equal hosts, after the collective check (Note [Hierarchical collectives]).
//  corrupt_chunk: before the rank's first shared-memory message, a chunk claiming to lie at offset
//    2^46 of that message is put in its channel (Note [Shared-memory messages]), as a forged or
//    corrupted segment would hold.
//  stray_links: at the set-up of the socket links (Note [Socket links]), before any rank can connect,
//    the rank connects to its own listener twice: once naming the rank it expects with a wrong token,
//    once sending junk; set-up then checks that it refused both.
//  links_cannot_listen: the rank fails to listen at the set-up of the socket links.
//  stale_link_frame: the rank's first frame over the socket links carries the previous collective's
//    sequence number, as a frame of an abandoned collective would.
//  die_in_ring_step: the rank SIGKILLs itself as it starts the second step of the ring across hosts
//    (Note [A ring across hosts]) in its first collective that runs one: once the first frame from
//    its left neighbour is reported whole.
//  no_liveness_poll: the rank's shared-memory waits never run their periodic check (of the peers'
//    liveness and of the timeout): only the peer watch (Note [Prompt death notice]) or a peer's
//    progress ends them.
// DDPKIT_TEST_HOSTS=<label of rank 0>,<label of rank 1>,... splits one machine into hosts for the
// tests (Note [Topology]): processes whose RANK (torchrun's) has different labels count as different
// hosts, in every group. The tests of real hosts use network and mount namespaces instead
// (tests/test_multihost.py).
// DDPKIT_SHM_SLOT_BYTES, DDPKIT_SHM_WHOLE_BYTES and DDPKIT_SHM_CHUNK_BYTES set a host leader's
// segment settings (SegmentSettings), so that the tests run many steps on small tensors and the
// benchmarks can move the thresholds; a value below 4096 gives no layout. DDPKIT_LINK_THREADS
// (caller | send | both) sets which of every exchange's directions the socket links move on their
// threads (Note [Threads of the links]).
// No release source includes this header: scripts/check_release_strings.sh builds the release
// library and checks that none of these names is in it.

#include <string>
#include <string_view>

namespace ddpkit::testing {

// True when DDPKIT_TEST_FAULT names `fault` for `rank`.
bool fault_armed(std::string_view fault, int rank);

// SIGKILLs this process.
[[noreturn]] void die();

// This process's label in DDPKIT_TEST_HOSTS (by its RANK), or "" when either is unset.
std::string test_host();

}  // namespace ddpkit::testing
