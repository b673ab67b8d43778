#pragma once
// How the ranks of a group agree on each collective before any payload moves (Note [Collective
// checks] in core/communicator.h): one interface, an implementation per way the group's ranks can meet.

#include "comm/core/header.h"

#include <ATen/ATen.h>
#include <c10/util/FunctionRef.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace ddpkit::comm {

class Communicator;

// Data riding in the check's messages (Note [One round across hosts] in checks/cross_host_check.h), so that
// a small collective meets its peers once, check included. `payload` returns this rank's bytes (at
// most the check's ride_along_bytes()); it is called only where this rank's host agreed, so it may
// take a step of the host's shared memory. `reply`, on the rank that answers, once every message is
// in and all agree, returns the answer's bytes from every rank's payload (in the check's order, each
// a receive buffer the caller narrows to the agreed size).
struct RideAlong {
  c10::function_ref<at::Tensor()> payload;
  c10::function_ref<at::Tensor(const std::vector<at::Tensor>&)> reply;
};

// The check riding in front of the frames of the first step across hosts (Note [A check in front of
// the swap] in checks/cross_host_check.h): what those steps (hierarchy/cross_host_steps.h) need of it.
// They send words() at the front of their frame to every partner, receive every partner's frame with
// Links::Recv::drain and at least minimum() bytes, use none of its data unless agree() said so, and
// call conclude() once every frame is in.
class CheckInFront {
 public:
  virtual ~CheckInFront() = default;
  // This rank's words, as bytes: the front of its frames (a multiple of 64 bytes, so that the data
  // after them stay aligned).
  virtual const at::Tensor& words() const = 0;
  // The fewest bytes a frame the check may meet holds: a partner's words.
  virtual int64_t minimum() const = 0;
  // Records the words of partner `peer` (its index among the ranks that cross hosts together), the
  // first minimum() bytes of its frame at `frame`: true once every partner's words are in and all
  // agree with this rank's, so that the data after them may be used. Never raises.
  virtual bool agree(Communicator& comm, int peer, const void* frame) = 0;
  // Once every partner's frame is in (`whole`: each held the bytes expected of it, its drained tail
  // included): raises a CheckVerdict, alike on every rank, unless all agreed and all were whole.
  // Completes the check.
  virtual void conclude(Communicator& comm, bool whole) = 0;
};

// The error of a check raised inside a collective's data steps (CheckInFront::conclude): the links
// are still in step, so the steps' handling of failures lets it pass unchanged (on_hosts in
// hierarchy/hierarchy.h), and the group stays usable.
class CheckVerdict : public c10::Error {
 public:
  explicit CheckVerdict(const c10::Error& error) : c10::Error(error) {}
};

// Note [Check seam]
// The collective check has one interface and three implementations, one per way a group's ranks
// meet; the Engine makes those a transport of the group needs with it, once (the CPU's at the
// group's set-up, another device's at its first collective), and hands each collective's
// Communicator the one its transport and hierarchy call for:
//  - RootVerdictCheck (checks/root_verdict.h): every rank's header to rank 0 over the transport's messages, its
//    verdict back (the process group's send/recv);
//  - SlotCheck (checks/slot_check.h): the header in the first step of the shared-memory direct collectives:
//    the direct collective's own (start_in_direct_step), or one step of its own;
//  - CrossHostCheck (checks/cross_host_check.h): a step of each host's shared memory, then one round across
//    hosts through a center, or among every partner on long paths, either of which can carry data
//    (ride_along_bytes()); between hosts of one rank each, it may ride in front of the first frames
//    of the steps across hosts instead (rides_in_front_of_steps()).
// Communicator::begin (and run_direct) counts and names the collective, handles checks off and
// groups of one rank, then calls start() (start_in_direct_step()); settle() completes what start()
// left in flight. A check never moves payload.
class CollectiveCheck {
 public:
  virtual ~CollectiveCheck() = default;

  // Capability: the most bytes of data that may ride in the check's messages (0: none).
  virtual int64_t ride_along_bytes() const { return 0; }

  // Starts the check of this rank's `header` (not yet stamped) for `comm`'s collective; `local_error`
  // non-empty: this rank rejected its arguments, and raises it once its peers can learn it. Raises
  // alike on every rank unless all agree. With `ride` (only where ride_along_bytes() covers it), its
  // data travel along and the reply's payload is returned (a receive buffer the caller narrows);
  // otherwise an empty tensor.
  virtual at::Tensor start(Communicator& comm, const CollectiveHeader& header, const std::string& local_error,
                           const RideAlong* ride) = 0;

  // Capability: the check rides in the first step of the transport's direct collectives.
  virtual bool rides_in_direct_steps() const { return false; }
  // Starts the check (as start(), no data riding) so that the first step of the direct collective
  // that follows carries it: that collective raises alike on every rank unless all agree, before any
  // payload moves. Only where rides_in_direct_steps().
  virtual void start_in_direct_step(Communicator& /*comm*/, const CollectiveHeader& /*header*/,
                                    const std::string& /*local_error*/) {
    TORCH_INTERNAL_ASSERT(false, "this collective check cannot ride in a direct step");
  }

  // Capability: the check may ride in front of the first frames of the steps across hosts that follow
  // it (Note [A check in front of the swap] in checks/cross_host_check.h).
  virtual bool rides_in_front_of_steps() const { return false; }
  // Starts the check (as start(), no data riding) so that the first frames of the steps across hosts
  // that follow carry it (in_front() until then): nothing moves here unless this rank rejected its
  // arguments, which it raises at once with its partners. Only where rides_in_front_of_steps().
  virtual void start_in_front_of_steps(Communicator& /*comm*/, const CollectiveHeader& /*header*/,
                                       const std::string& /*local_error*/) {
    TORCH_INTERNAL_ASSERT(false, "this collective check cannot ride in front of a swap");
  }
  // The check start_in_front_of_steps() started while no frame has carried it yet, else null.
  virtual CheckInFront* in_front() { return nullptr; }

  // Completes a check start() left in flight (a no-op where start() completed it), or one riding in
  // front of steps whose frames did not carry it (its words then cross alone). Raises as start().
  virtual void settle(Communicator& /*comm*/) {}

  // Checks off: this rank rejected the arguments of `what`, so its peers never learn it and wait;
  // stops what they would otherwise pair wrongly with (the host's shared memory), if anything.
  virtual void reject_unchecked(std::string_view what) = 0;
};

}  // namespace ddpkit::comm
