#pragma once
// How a group's set-up makes the parts the test suite faults (Note [Test seam]).

#include "comm/core/transport.h"
#include "comm/links/links.h"
#include "comm/links/socket_links.h"
#include "comm/shm/setup.h"

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

namespace ddpkit::comm {

// Note [Test seam]
// A group's set-up (Note [Group set-up]) makes, through one PartFactory, each part a test needs to
// fail at a chosen moment: the host identity discovery announces, the transport that carries the
// set-up's messages, this rank's segment options, the host's transport over its segment, and the
// socket links across hosts. The release library's factory makes them as they are. A testing build
// (the CMake option DDPKIT_TESTING, which compiles csrc/testing/) installs at load a subclass whose
// parts are decorators of the same interfaces (Transport, DirectCollectives, Links) or the same
// parts made otherwise, and those inject the faults a test arms with DDPKIT_TEST_FAULT and split
// one machine into the hosts of DDPKIT_TEST_HOSTS (csrc/testing/faults.h lists them). So no
// release source includes a testing header, names a fault or branches on a test, and the release
// library carries no test hook (scripts/check_release_strings.sh builds it and looks).
class PartFactory {
 public:
  virtual ~PartFactory() = default;

  // This process's host identity (host_identity(), Note [Topology]).
  virtual std::string host_identity() const;
  // The transport that carries the set-up (Note [Group set-up]) of the group whose rank is `rank`:
  // `messages` (the group's CPU process-group transport) itself.
  virtual std::shared_ptr<Transport> setup_transport(std::shared_ptr<Transport> messages, int rank) const;
  // Rank `rank`'s options for its host's segment, on a host of `size` ranks whose waits spin or not:
  // default_segment_options.
  virtual SegmentOptions segment_options(int size, bool spinning, int rank) const;
  // The transport of this host's ranks over `segment`: a ShmTransport.
  virtual std::shared_ptr<Transport> host_transport(std::shared_ptr<ShmSegment> segment) const;
  // The links across hosts among `group_ranks` (this rank at `rank`), over their subgroup `backend`,
  // their threads as `threading` says (Note [Threads of the links]): SocketLinks::connect's.
  virtual std::shared_ptr<Links> links(c10d::Backend& backend, int rank, std::vector<int> group_ranks,
                                       std::chrono::milliseconds timeout, LinkThreading threading) const;
};

// The factory every group's set-up uses.
const PartFactory& part_factory();

// Makes `factory` the one every later set-up uses (a testing build's, as it loads).
void install_part_factory(std::unique_ptr<PartFactory> factory);

}  // namespace ddpkit::comm
