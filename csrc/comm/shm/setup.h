#pragma once
// How the ranks of a group on one host come to share a segment (Note [Shared-memory segment]).

#include "comm/shm/segment.h"
#include "comm/topology/topology.h"

#include <chrono>
#include <memory>

namespace ddpkit::comm {

class Communicator;

// Note [Shared-memory segment]
// One segment per host that holds more than one rank of a group, made by a collective of the group
// that runs over the group's own point-to-point messages (the process group's connections), never
// through the store, after discovery has told every rank the group's hosts and pids (Note [Topology]):
//  1. each host's leader (its lowest rank) creates an anonymous memfd of the layout's size (mode
//     0600, never a name in /dev/shm), writes a header with a fresh 128-bit nonce into it and sends
//     the host's other ranks its pid, the fd's number, the layout and the nonce;
//  2. each of them opens /proc/<leader's pid>/fd/<fd>, requires a regular file of its own uid, mode
//     0600 and the exact size, maps it, requires the header's magic, layout and nonce, and answers;
//  3. every leader reports its host to rank 0, which sends every rank the verdict (every rank mapped
//     its segment, or which rank failed and why); the leaders have closed their fds: from then on the
//     memory lives only in the mappings.
// A rank that dies or stops at any step is reported by its peers' process-group waits (its
// connection closes, or the group's timeout expires), naming it; rank 0 relays a failure it sees to
// the others, so no rank waits out the timeout for a peer that is gone. Nothing is ever left in
// /dev/shm: the memfd has no name, and the kernel frees it with its last mapping or descriptor.
//
// Threat model. The store is a TCP server that any local user can read and write, so nothing about
// the segment travels through it. A local user of another uid cannot open the segment (it has no
// name, and the kernel lets only processes of the ranks' uid, or root, open /proc/<pid>/fd), cannot
// make a rank map memory of theirs (a rank maps only the descriptor its host's leader named over the
// process group, and only when its owner, mode, size, header and nonce are those the leader set), and so can
// neither read a payload nor write one. They can still deny service as for any torch.distributed
// job: disturb the store's own keys or its port, or exhaust memory. A process of the ranks' own uid
// (or root) can read and write their memory anyway (ptrace), so it is outside this model. Every
// offset and length read from the segment (chunk headers, channel counters, peers' headers) is
// checked against the layout before use, so even a corrupted segment raises, naming the peer whose
// data is bad, instead of writing outside a buffer. Where everything lies in it: Note [Segment layout].

// What a rank brings to its host's segment: the settings it offers when it is the host's leader
// (the others take the leader's), and how often its sleeping waits check their peers
// (SegmentWaits).
struct SegmentOptions {
  SegmentSettings settings;
  std::chrono::milliseconds liveness_period;
  bool spinning;  // whether the rank's waits spin (Note [Waiting on shared memory])
};

// default_segment_settings(size, spinning), a liveness period of kSleepMillis, and `spinning`.
SegmentOptions default_segment_options(int size, bool spinning);

// Collective over the ranks of `setup`'s group (Note [Shared-memory segment]): `setup` is a
// Communicator of the process-group transport for the collective being run, whose messages carry
// the set-up, and `group` what discovery learnt of its ranks. Returns this rank's host's segment,
// or null when this rank is alone on its host. Throws on every rank, naming the rank and the
// reason, when a rank could not create, open, verify or map its host's segment or died during
// set-up. `timeout` bounds every later wait on the segment (the set-up's own waits are the process
// group's, bounded by the group's timeout). `options` are this rank's.
std::shared_ptr<ShmSegment> set_up_segment(Communicator& setup, const Discovery& group,
                                           std::chrono::milliseconds timeout, const SegmentOptions& options);

}  // namespace ddpkit::comm
