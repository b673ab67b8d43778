#pragma once
// Point-to-point messaging for one collective of a process group, over the transport its engine
// chose (Note [Collective engine]): the group's own send/recv, or shared memory on one host.

#include <ATen/ATen.h>
#include "comm/core/collective_check.h"
#include "comm/core/counters.h"
#include "comm/core/header.h"
#include "comm/core/transport.h"
#include "comm/core/wire_format.h"
#include "comm/reduction/reduce_op.h"
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace ddpkit::comm {

// Note [Vocabulary]
// The comm layer's nouns, each in one sense only (gloo's allreduce.cc says its chunk and segment once:
// this is that paragraph for the whole layer). Each names the type or name it stands for.
// A call:
//  collective      one call every rank of a group makes alike (all_reduce, broadcast, ...), numbered in
//                  program order by its engine (Note [Tags]); its kind is a CollectiveKind.
//  header          what a rank believes its collective is: kind, elements, dtype, op, algorithm, root
//                  (CollectiveHeader).
//  check           the comparison of every rank's header before any payload moves (CollectiveCheck, Note
//                  [Collective checks]); a verdict is the root's answer to it (RootVerdictCheck). An
//                  argument check is one rank's own validation of its arguments (core/arguments.h),
//                  whose rejection the check carries to every rank.
//  algorithm       what a caller picks by name: a schedule ('ring', 'star', ...), the transport's own
//                  collectives ('direct'), the hierarchy ('hierarchical'), the backend's own all-reduce
//                  ('process_group') or 'auto' (Algorithm, kAlgorithmNames). Never a path the layer chose.
//  route           the path a call takes, chosen once per call from its algorithm and what its
//                  communicator can do (Route, Note [Routes]): Route::kTransportCollective, Route::kOneRound,
//                  Route::kHostSteps, Route::kBackendCollective or Route::kSchedule.
//  schedule        a collective as rounds of point-to-point messages on one Communicator, which knows
//                  nothing of hosts (schedules/schedules.h); a round is the messages every rank sends and
//                  receives before the next (a schedule's rounds, the check's one round across hosts).
//  step            one stage every rank taking part in a collective takes alike: a step of the direct
//                  collectives (one use of the shared-memory slots), a step inside a host or across hosts
//                  of a hierarchical collective, a ring step.
// What carries it:
//  engine          a group's one entry point, which numbers its collectives and runs them one at a time
//                  (Engine, Note [Collective engine]).
//  backend         the process group's c10d::Backend (gloo, NCCL): its send/recv and its own collectives.
//  transport       how one collective's messages move, asked for what it can do, never what it is
//                  (Transport, TransportKind): the backend's send/recv (SendRecvTransport, named
//                  "process_group") or the host's shared memory (ShmTransport, "shm").
//  direct collectives  the collectives a transport runs itself, without messages (DirectCollectives).
//  lane            what a collective runs on, chosen once per device and transport: a backend, a
//                  transport, a check and whether the hierarchy is offered (GroupState::Lane, Note [Lanes]).
//  communicator    one collective's view of its lane: rank, size, sequence number, messages (Communicator).
//  message         one tagged point-to-point send or receive of a contiguous tensor (Message).
// Across hosts:
//  host            the ranks that share a kernel and a /dev/shm (Topology, Note [Topology]); a rank's
//                  local rank is its index among its host's ranks, a host's leader its lowest rank.
//  hierarchy       what a group spanning hosts holds for its collectives across them (Hierarchy).
//  form            the data steps of a hierarchical collective, chosen once for the shape of the hosts:
//                  equal or unequal (HierarchicalForm: EqualHostsForm, UnequalHostsForm).
//  cross subgroup  the ranks that cross hosts together, one per host: the ranks of one local rank, or
//                  the hosts' leaders; each is the others' partner, and its center the one that answers
//                  the check's one round (Note [One round across hosts]).
//  steps across hosts  the steps of a cross subgroup (CrossHostSteps, Hierarchy::cross): the swap between
//                  two hosts (SwapSteps), the ring among more (RingSteps).
//  links           the TCP connections of a cross subgroup (Links, SocketLinks, Note [Socket links]).
//  frame           what the links carry, one at a time per peer and direction: a collective's sequence
//                  number and its bytes (Links::Send, Links::Recv); a part is what the receiver reduces at
//                  a time (kLinkPartBytes), a window the buffer a large frame lands in round and round
//                  (kLinkWindowBytes, Note [Receiving windows]).
//  exchange        one call that moves a collective's frames to and from its peers at once
//                  (Links::exchange).
//  wire format     what the bytes that cross hosts carry: exact, or rounded to bfloat16 or float16
//                  (WireFormat, Note [Compressed crossing]).
// Splitting a vector (Note [Splitting among ranks]): a block is one rank's contiguous share of a vector
// (the all-gather's, the reduce-scatter's, a ring step's); a run is consecutive blocks.
// Inside a host's segment, the words of Note [Shared-memory vocabulary] (shm/layout.h): segment, slot,
// step, chunk, slice, channel.

// Note [Tags]
// Every ddpkit collective takes the next sequence number of its process group when it is *issued*
// (on the issuing thread, in program order, which is identical on all ranks; Note [Collective
// engine]) and tags each of its messages with (sequence, round). Messages of two collectives
// therefore never match each other, whatever the transport. A call is numbered before anything of
// it can fail on one rank alone: arguments a rank rejects (a bad op, algorithm or transport name, a
// tensor the collective cannot take, a meta tensor among real ones, the backend's and
// SyncBatchNorm's own argument checks) are rejected inside the numbered collective (Note
// [Collective checks]), so every rank raises and the next calls pair.
//
// What the numbers cannot see: a rank that skips a collective, or issues an extra one, still
// numbers its next call as its peers number their current one. When the two calls differ in any
// header field (collective, elements, dtype, op, algorithm, root, meta or not), the check raises on
// every rank, naming the difference. Two calls that agree in every field pair as if they were one
// (as in gloo and NCCL, which check nothing): no header can tell them apart without naming the
// program's call site. The last call left unpaired then waits for a peer that never comes and
// fails at the group's timeout, naming the ranks it waited for.

// Note [Collective checks]
// torch's TORCH_DISTRIBUTED_DEBUG does not fingerprint point-to-point traffic, so ddpkit does its
// own: in checked mode (the default) every rank sends a small header (kind, numel, dtype, op,
// algorithm, root, meta) to rank 0, which compares them and sends every rank a verdict: agreement,
// or the first rank that differs from rank 0 and how. No rank sends any payload before it holds the
// verdict (settle_header), so a disagreement never moves data: every rank raises the same error and
// the receives posted meanwhile (Note [Pre-posted receives]) are aborted safely, leaving the group
// usable. A rank that rejects its own arguments still sends a header marked "rejected" (reject() in
// collectives/collectives.h), and a root that loses a peer while collecting headers still tells the others, so
// they fail at once instead of at the timeout. Two one-way messages per rank, rather than messages to
// and from every peer: on an oversubscribed CPU the number of messages and of busy threads is what
// costs (Note [Choosing an algorithm]). See set_checked().
// On shared memory no message is needed: every direct collective (the all-reduce, the all-gather, the
// reduce-scatter, the barrier) carries each rank's header in the slot of its first step and every
// rank compares all of them after the first barrier (Note [Direct all-reduce]); every other
// collective over shared memory takes one step of the same protocol with the header alone
// (DirectCollectives::barrier) before its first message. So the check costs a few
// loads, and a direct all-reduce called against a broadcast is caught like any other mismatch.
// Meta tensors (the collectives' Meta kernels) take part in the check alone, marked "meta": all
// ranks meta agree and move nothing; meta against real data raises everywhere.
// With checks off, nothing is compared and a rank that rejects its arguments raises alone; its
// peers wait for it, so over shared memory its transport stops there (reject_unchecked: its next
// collective would otherwise take its peers' current step) and they learn it from the segment.
// Headers are the plain struct CollectiveHeader (core/header.h), compared field by field by name. Every
// error of the check names the call each rank's communicator serves (Communicator::what(): "ddpkit.
// all_gather: ranks called mismatched collectives: ..."), never the kind of collective its header
// carries, which several calls share (all_gather, its coalesced variants and all_gather_into_tensor are
// all kAllGather); the header's kind is named only where the ranks' kinds differ.
// These are the implementations of one interface, CollectiveCheck, that the engine picks per group
// and transport (Note [Check seam] in core/collective_check.h).

// Note [Pre-posted receives]
// Gloo's point-to-point is a rendezvous: a send leaves at once only if the receiver's "ready"
// notice has already arrived, otherwise it waits for a round trip through both event loops.
// run_schedule() therefore posts round k+1's receives before waiting for round k. That is safe when
// round k+1's receive buffers are not touched by round k, or when they are only read by a round-k
// send to the very peer whose round-k+1 message lands there (that peer sends only after it has
// received ours). Every schedule in schedules/schedules.cpp keeps to this; NCCL, whose grouped sends and
// receives would deadlock with a look-ahead, runs round by round.
//
// Note [Ring receives up front]
// The ring goes further and posts all 2(n-1) receives before its first send, so that every send
// finds its receiver ready. Safe: rank r-1 sends its step-t message only after rank r has posted its
// own step-t send (the chain of step-t messages runs around the ring back to r), so a step-t
// message lands in r's step-t buffer when r has reached step t; reduce-scatter steps receive into
// scratch chunks of their own, all-gather steps into chunks r no longer touches after step t.

// Turns checked mode (Note [Collective checks]) on or off for this process; on by default.
// All ranks must agree: a checked rank waits for headers an unchecked peer never sends.
void set_checked(bool checked);
// Checked mode for the collective running on this thread: the process's setting, or the one its
// collective was issued under (ScopedChecks).
bool is_checked();

// While alive, is_checked() on this thread answers `checked`: the engine's thread runs each queued
// collective under the setting of the moment it was issued, so that a rank that changes the setting
// while its asynchronous collectives are queued still runs them as its peers do.
class ScopedChecks {
 public:
  explicit ScopedChecks(bool checked);
  ~ScopedChecks();
  ScopedChecks(const ScopedChecks&) = delete;
  ScopedChecks& operator=(const ScopedChecks&) = delete;

 private:
  int previous_;
};

// One posted point-to-point message: its work and the peer at the other end (for error messages).
struct Message {
  c10::intrusive_ptr<c10d::Work> work;
  int peer = -1;  // -1: a group of messages (NCCL coalescing), no single peer
  bool is_send = false;
};
using MessageList = std::vector<Message>;

struct Hierarchy;  // hierarchy/hierarchy.h

class Communicator {
 public:
  // Made by the group's Engine for one collective: `backend` is the group's backend for `device_type`
  // (the group's own collectives), `transport` carries the collective (its messages, and its direct
  // collectives where it has them), `sequence` is the collective's number (Note [Tags]), `group` the
  // group's name for errors, `what` the name of the call the collective serves, as its caller knows
  // it ("all_gather" for torch's list variant, which the check compares as an all_gather_into_tensor):
  // every error of the collective starts with it, the collective check's included (Note [Collective
  // checks]). Both must outlive the communicator.
  // `check` (owned by the engine, outliving the communicator) is the group's collective check for
  // this transport (Note [Check seam]); null on communicators that run no checked collective (a
  // transport's set-up, the steps across hosts of a hierarchical collective).
  Communicator(int rank, int size, c10::DeviceType device_type, c10::intrusive_ptr<c10d::Backend> backend,
               std::shared_ptr<Transport> transport, uint64_t sequence, std::string_view group, std::string_view what,
               CollectiveCheck* check = nullptr);

  int rank() const { return rank_; }
  // "rank 0 of 4 in group '1'": where an error happened.
  std::string where() const;
  std::string_view group() const { return group_; }
  // The call this collective serves, as its errors name it ("all_gather"): never the kind of
  // collective the check compares (CollectiveHeader::kind), which several calls share.
  std::string_view what() const { return what_; }
  int size() const { return size_; }
  uint64_t sequence() const { return sequence_; }
  c10::DeviceType device_type() const { return device_type_; }
  // The transport's name (a name of kTransportNames).
  std::string_view transport_name() const { return transport_->name(); }
  // True when the transport runs collectives itself, without messages (Transport::direct()).
  bool has_direct() const { return transport_->direct() != nullptr; }
  // The group's hierarchy when this collective may take the hierarchical path (Note [Hierarchical
  // collectives]): CPU tensors of a group spanning hosts; else null.
  const Hierarchy* hierarchy() const { return hierarchy_; }
  void use_hierarchy(const Hierarchy* hierarchy) { hierarchy_ = hierarchy; }
  // The group's backend for this communicator's device.
  const c10::intrusive_ptr<c10d::Backend>& backend() const { return backend_; }
  // The format this collective's data crosses hosts in (Note [Compressed crossing]): kExact unless
  // its caller asked for another; stamped into its headers, so that ranks that disagree raise.
  WireFormat wire_format() const { return wire_format_; }
  void set_wire_format(WireFormat format) { wire_format_ = format; }
  // The most bytes of data that may ride in this collective's check (CollectiveCheck::ride_along_bytes).
  int64_t ride_along_bytes() const { return check_ != nullptr ? check_->ride_along_bytes() : 0; }

  // `header` as this rank sends it: its magic (rejected when `local_error` is non-empty) and this
  // collective's sequence number (its low 23 bits, as in the tags). The one place headers are stamped.
  CollectiveHeader stamp(const CollectiveHeader& header, const std::string& local_error) const;

  // Runs this collective on the transport's direct collectives (has_direct()), the collective check
  // riding in their first step (begin_in_direct_step), then calls `run(direct)`; `run` passes what()
  // on, so that the transport's errors name the call, and undefined tensors where `local_error` is
  // non-empty (this rank rejected its arguments: the first step raises it on every rank).
  template <class Run>
  void run_direct(const CollectiveHeader& header, const std::string& local_error, Run&& run) {
    DirectCollectives* direct = transport_->direct();
    TORCH_INTERNAL_ASSERT(direct != nullptr, "run_direct on a transport without direct collectives");
    begin_in_direct_step(header, local_error);
    run(*direct);
  }

  // Makes this communicator carry the one-time set-up of a transport (Note [Shared-memory
  // segment]): `what` names it in errors, and its messages stay out of the counters, which count
  // what collectives send.
  void use_for_setup(std::string_view what) {
    what_ = what;
    counted_ = false;
  }
  // The peer of the last message whose wait failed, or -1.
  int failed_peer() const { return failed_peer_; }

  // Binds this communicator to the collective described by `header` (counts it); in checked
  // mode starts the collective check (Note [Collective checks], through the check of Note [Check
  // seam]), which settle_header() completes.
  // A non-empty `local_error` means this rank rejected its own arguments: it still takes part in
  // the check, so that its peers fail at once naming it, then throws `local_error`.
  // `exchange_header=false` skips the check (for the group's own collectives, which torch checks).
  // `ride`: data riding in the check's messages (only where ride_along_bytes() covers them); returns
  // the reply's payload, else an empty tensor.
  at::Tensor begin(const CollectiveHeader& header, const std::string& local_error = {}, bool exchange_header = true,
                   const RideAlong* ride = nullptr);

  // The group's own all-reduce (kSum/kMean as a sum, kMax, kMin) of `tensor`, asynchronous.
  c10::intrusive_ptr<c10d::Work> process_group_all_reduce(at::Tensor& tensor, ReduceOp op);

  // Asynchronous send/recv of a contiguous tensor in round `round` (< kVerdictRound; the two rounds
  // above are the checks', here or on a cross-host communicator of the same collective) of the current
  // collective. The tensor must stay alive and untouched until the returned work is waited on.
  Message isend(const at::Tensor& tensor, int dst, int round);
  Message irecv(const at::Tensor& tensor, int src, int round);

  // Whether begin_in_front_of_steps() may serve this collective: checked, and a check that can ride
  // in front of the steps across hosts (CollectiveCheck::rides_in_front_of_steps).
  bool check_rides_in_front_of_steps() const {
    return size_ > 1 && is_checked() && check_ != nullptr && check_->rides_in_front_of_steps();
  }
  // begin() for a collective whose data cross hosts: the check rides in front of the first frames of
  // the steps across hosts (check_in_front()), or crosses alone in settle_header() where no frame
  // carried it. Only where check_rides_in_front_of_steps().
  void begin_in_front_of_steps(const CollectiveHeader& header, const std::string& local_error);
  // The check the steps' first frames are to carry in front of their data (begin_in_front_of_steps),
  // or null.
  CheckInFront* check_in_front() const { return check_ != nullptr ? check_->in_front() : nullptr; }

  // begin() for a collective that runs on the transport's direct collectives: in checked mode the
  // check rides in the first step of the direct collective that follows (Note [Check seam]).
  void begin_in_direct_step(const CollectiveHeader& header, const std::string& local_error);

  // Completes the check begin() started (Note [Collective checks]); a no-op when there is none in
  // flight. Call it before the first send of the collective. On failure the
  // caller must abort the receives it posted meanwhile (no peer will ever match them).
  void settle_header();

  // Waits for `messages`. On a failure (a peer that died, the group's timeout) it aborts the
  // rest of `messages`, so that nothing waits out a second timeout, and throws an error naming the
  // collective and the peer.
  // `timeout` (default: the backend's own) bounds each message's wait.
  void wait(MessageList& messages, std::chrono::milliseconds timeout = ::kNoTimeout);

  // Transport::posts_ahead(): receives can be posted rounds ahead (Note [Pre-posted receives]); when
  // false, each round's sends and receives go through start_group()/end_group().
  bool independent_messages() const { return independent_messages_; }
  void start_group();
  // Ends a group started by start_group(): the returned message stands for all of it.
  Message end_group();

  static constexpr int kHeaderRound = 255;   // round tag of the headers (Note [Collective checks])
  static constexpr int kVerdictRound = 254;  // and of the root's verdicts
  static constexpr int kCheckRoot = 0;

 private:
  int tag(int round) const;
  // An unchecked collective's start: raises `local_error` if there is one. Nobody learns of this
  // rank's rejection, so its peers wait for it; over shared memory its next collective would take
  // their current one's step: the check stops that memory first.
  void begin_unchecked(const std::string& local_error);
  // Raises the error of a message to or from `failed.peer` that failed for `cause`, naming that peer
  // and the `silent` ones still awaited; records the peer for failed_peer().
  [[noreturn]] void fail(const Message& failed, const std::exception& cause, const std::vector<int>& silent);

  int rank_ = 0;
  int size_ = 1;
  c10::DeviceType device_type_;
  c10::intrusive_ptr<c10d::Backend> backend_;
  std::shared_ptr<Transport> transport_;
  CollectiveCheck* check_ = nullptr;
  bool independent_messages_ = true;
  const Hierarchy* hierarchy_ = nullptr;
  bool counted_ = true;
  uint64_t sequence_ = 0;
  std::string_view group_;
  std::string_view what_;
  int failed_peer_ = -1;  // the peer of the last message whose wait failed
  WireFormat wire_format_ = WireFormat::kExact;
};

// Aborts every message in `messages` (a failed peer will never complete them) and clears the list.
void abort_all(MessageList& messages);

}  // namespace ddpkit::comm
