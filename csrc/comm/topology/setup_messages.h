#pragma once
// The messages of a group's set-up (Note [Group set-up]): its round tags, statuses, failures and how
// they are worded, shared by topology discovery (topology/topology.h) and the segment's set-up (shm/setup.h).

#include "comm/core/communicator.h"

#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace ddpkit::comm::setup_messages {

// Round tags of the set-up's messages, inside the collective that runs it (Note [Tags]); one table,
// so that no two steps share a round.
constexpr int kReportRound = 248;   // segment: a host's leader reports its host to rank 0
constexpr int kPlanRound = 249;     // discovery: rank 0's plan
constexpr int kHelloRound = 250;    // discovery: every rank's hello
constexpr int kOfferRound = 251;    // segment: a leader's offer to its host
constexpr int kAckRound = 252;      // segment: a rank's answer to its leader
constexpr int kVerdictRound = 253;  // segment: rank 0's verdict

// A set-up message's status: its sender went on, or gave up (the message then says why: a Failure).
enum Status : int64_t { kOk = 1, kFailed = 3 };
// Why a rank could not take part; one table, so that every rank words a failure alike.
enum Failure : int64_t {
  kNoFailure = 0,
  kCreateFailed,
  kOpenFailed,
  kNotRegularFile,
  kWrongOwner,
  kWrongMode,
  kWrongSize,
  kMapFailed,
  kWrongHeader,
  kPeerFailed,
  kBadSettings,
};

// `failure` (with the errno it came with, 0: none) in the words of an error.
std::string describe_failure(int64_t failure, int64_t error_number);

// How a set-up's errors start and end on this rank: "ddpkit.<what> (<where>)" and a hint.
struct Words {
  explicit Words(const Communicator& setup);
  // "<prefix>: rank <failed_rank> failed: <failure><hint>": a failure relayed from another rank.
  std::string relayed(int64_t failed_rank, int64_t failure, int64_t error_number) const;
  std::string prefix;
  static constexpr const char* kHint = "; set DDPKIT_TRANSPORT=process_group to run without shared memory";
};

// `value`'s bytes, then `extra_bytes` of zeros, as a message.
template <class T>
at::Tensor message_of(const T& value, size_t extra_bytes = 0) {
  at::Tensor bytes = at::zeros({static_cast<int64_t>(sizeof(T) + extra_bytes)}, at::kByte);
  std::memcpy(bytes.data_ptr(), &value, sizeof(T));
  return bytes;
}

template <class T>
T value_of(const at::Tensor& bytes) {
  TORCH_INTERNAL_ASSERT(bytes.numel() >= static_cast<int64_t>(sizeof(T)));
  T value;
  std::memcpy(&value, bytes.data_ptr(), sizeof(T));
  return value;
}

// Waits for an `answer` (received into `message`), then, when it says its sender went on (it
// took this rank's message first), for this rank's `sent` message; when the sender gave up
// (kFailed), `sent` may never be taken, so it is aborted instead.
template <class T>
T wait_for_answer(Communicator& setup, MessageList& answer, MessageList& sent, const at::Tensor& message) {
  try {
    setup.wait(answer);
  } catch (...) {
    abort_all(sent);
    throw;
  }
  const T value = value_of<T>(message);
  if (value.status == kFailed) {
    abort_all(sent);
  } else {
    setup.wait(sent);
  }
  return value;
}

// Sends `message` to every rank of `ranks` but `skip`, as best it can (a rank it cannot reach fails
// on its own), so that none waits out the group's timeout for a set-up that failed.
void tell(Communicator& setup, const std::vector<int>& ranks, const at::Tensor& message, int round, int skip);

// 0, 1, ..., size - 1.
std::vector<int> all_ranks(int size);

}  // namespace ddpkit::comm::setup_messages
