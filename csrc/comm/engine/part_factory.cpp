#include "comm/engine/part_factory.h"

#include "comm/links/socket_links.h"
#include "comm/shm/channels.h"
#include "comm/topology/topology.h"

#include <atomic>

namespace ddpkit::comm {
namespace {

// Never destroyed: set-ups may still run when static destructors would.
std::atomic<const PartFactory*>& installed() {
  static std::atomic<const PartFactory*> factory{new PartFactory()};
  return factory;
}

}  // namespace

std::string PartFactory::host_identity() const { return comm::host_identity(); }

std::shared_ptr<Transport> PartFactory::setup_transport(std::shared_ptr<Transport> messages, int /*rank*/) const {
  return messages;
}

SegmentOptions PartFactory::segment_options(int size, bool spinning, int /*rank*/) const {
  return default_segment_options(size, spinning);
}

std::shared_ptr<Transport> PartFactory::host_transport(std::shared_ptr<ShmSegment> segment) const {
  return std::make_shared<ShmTransport>(std::move(segment));
}

std::shared_ptr<Links> PartFactory::links(c10d::Backend& backend, int rank, std::vector<int> group_ranks,
                                          std::chrono::milliseconds timeout, LinkThreading threading) const {
  return SocketLinks::connect(backend, rank, std::move(group_ranks), timeout, LinkListener::open(), threading);
}

const PartFactory& part_factory() { return *installed().load(std::memory_order_acquire); }

void install_part_factory(std::unique_ptr<PartFactory> factory) {
  installed().store(factory.release(), std::memory_order_release);  // the one it replaces may be in use: kept
}

}  // namespace ddpkit::comm
