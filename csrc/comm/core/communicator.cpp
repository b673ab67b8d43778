#include "comm/core/communicator.h"

#include "comm/core/call_timeout.h"

#include <algorithm>
#include <cstring>

#include <atomic>
#include <exception>
#include <mutex>
#include <unordered_map>

namespace ddpkit::comm {
namespace {

std::atomic<bool> checked{true};

// The setting a collective run by the engine's thread was issued under (ScopedChecks); -1: none.
thread_local int issued_checked = -1;

}  // namespace

void set_checked(bool value) { checked.store(value); }
bool is_checked() { return issued_checked >= 0 ? issued_checked == 1 : checked.load(); }

ScopedChecks::ScopedChecks(bool checked) : previous_(issued_checked) { issued_checked = checked ? 1 : 0; }
ScopedChecks::~ScopedChecks() { issued_checked = previous_; }

Communicator::Communicator(int rank, int size, c10::DeviceType device_type, c10::intrusive_ptr<c10d::Backend> backend,
                           std::shared_ptr<Transport> transport, uint64_t sequence, std::string_view group,
                           std::string_view what, CollectiveCheck* check)
    : rank_(rank),
      size_(size),
      device_type_(device_type),
      backend_(std::move(backend)),
      transport_(std::move(transport)),
      check_(check),
      sequence_(sequence),
      group_(group),
      what_(what) {
  independent_messages_ = transport_->posts_ahead();
}

std::string Communicator::where() const { return c10::str("rank ", rank_, " of ", size_, " in group '", group_, "'"); }

int Communicator::tag(int round) const {
  // Gloo wants a non-negative int32: 23 bits of sequence, 8 of round. Rounds past 253 wrap (the
  // rounds of one collective are ordered by their waits); 254 and 255 carry the check.
  TORCH_INTERNAL_ASSERT(round >= 0 && round <= kHeaderRound);
  const uint64_t round_bits =
      round >= kVerdictRound ? static_cast<uint64_t>(round) : static_cast<uint64_t>(round % kVerdictRound);
  return static_cast<int>(((sequence_ & 0x7FFFFF) << 8) | round_bits);
}

CollectiveHeader Communicator::stamp(const CollectiveHeader& header, const std::string& local_error) const {
  CollectiveHeader stamped = header;
  stamped.magic = local_error.empty() ? kHeaderMagic : kRejectedMagic;
  stamped.sequence = static_cast<int64_t>(sequence_ & 0x7FFFFF);
  stamped.wire = static_cast<int64_t>(wire_format_);
  return stamped;
}

at::Tensor Communicator::begin(const CollectiveHeader& header, const std::string& local_error, bool exchange_header,
                               const RideAlong* ride) {
  note_collective();
  if (size_ == 1 || !exchange_header) {
    TORCH_CHECK(local_error.empty(), local_error);
    return {};
  }
  if (!is_checked()) {
    begin_unchecked(local_error);
    return {};
  }
  TORCH_INTERNAL_ASSERT(check_ != nullptr, "a collective on a communicator without a check");
  TORCH_INTERNAL_ASSERT(ride == nullptr || ride_along_bytes() > 0, "the check cannot carry data");
  return check_->start(*this, header, local_error, ride);
}

void Communicator::begin_unchecked(const std::string& local_error) {
  if (!local_error.empty() && check_ != nullptr) check_->reject_unchecked(what_);
  TORCH_CHECK(local_error.empty(), local_error);
}

void Communicator::begin_in_direct_step(const CollectiveHeader& header, const std::string& local_error) {
  note_collective();
  if (!is_checked()) {
    begin_unchecked(local_error);
    return;
  }
  TORCH_INTERNAL_ASSERT(check_ != nullptr && check_->rides_in_direct_steps(),
                        "a direct collective on a communicator whose check cannot ride in it");
  check_->start_in_direct_step(*this, header, local_error);
}

void Communicator::begin_in_front_of_steps(const CollectiveHeader& header, const std::string& local_error) {
  TORCH_INTERNAL_ASSERT(check_rides_in_front_of_steps(), "a check that cannot ride in front of a swap");
  note_collective();
  check_->start_in_front_of_steps(*this, header, local_error);
}

void Communicator::settle_header() {
  if (check_ != nullptr) check_->settle(*this);
}

Message Communicator::isend(const at::Tensor& tensor, int dst, int round) {
  TORCH_INTERNAL_ASSERT(tensor.is_contiguous());
  if (counted_) {
    note_message_sent(tensor.numel() * tensor.element_size());
  }
  try {
    return Message{transport_->send(tensor, dst, tag(round)), dst, true};
  } catch (const std::exception& e) {  // gloo refuses a message to a peer whose connection closed
    fail(Message{{}, dst, true}, e, {});
  }
}

Message Communicator::irecv(const at::Tensor& tensor, int src, int round) {
  TORCH_INTERNAL_ASSERT(tensor.is_contiguous());
  try {
    return Message{transport_->recv(tensor, src, tag(round)), src, false};
  } catch (const std::exception& e) {
    fail(Message{{}, src, false}, e, {});
  }
}

void Communicator::wait(MessageList& messages, std::chrono::milliseconds timeout) {
  for (size_t i = 0; i < messages.size(); ++i) {
    try {
      // The running collective's own timeout (Note [A call's timeout]) bounds what the group's would.
      if (messages[i].work) messages[i].work->wait(timeout == ::kNoTimeout ? call_timeout_or(::kNoTimeout) : timeout);
    } catch (const std::exception& e) {
      const Message failed = messages[i];
      messages.erase(messages.begin(), messages.begin() + static_cast<std::ptrdiff_t>(i) + 1);
      // Whoever else has not answered by now is named too: a timeout is seldom one rank's alone.
      std::vector<int> silent;
      for (auto& other : messages) {
        if (other.work && !other.is_send && other.peer >= 0 && other.peer != failed.peer &&
            !other.work->isCompleted() && std::find(silent.begin(), silent.end(), other.peer) == silent.end()) {
          silent.push_back(other.peer);
        }
      }
      abort_all(messages);
      fail(failed, e, silent);
    }
  }
  messages.clear();
}

void Communicator::fail(const Message& failed, const std::exception& cause, const std::vector<int>& silent) {
  failed_peer_ = failed.peer;
  std::string peer = failed.peer < 0 ? std::string("a peer") : c10::str("rank ", failed.peer);
  if (!silent.empty()) {
    peer += silent.size() == 1 ? " (rank" : " (ranks";
    for (size_t k = 0; k < silent.size(); ++k) peer += c10::str(k == 0 ? " " : ", ", silent[k]);
    peer += " had not answered yet)";
  }
  // The cause without the C++ backtrace c10::Error carries: it ends up in a Python message.
  const auto* error = dynamic_cast<const c10::Error*>(&cause);
  const std::string text = error != nullptr ? error->what_without_backtrace() : cause.what();
  C10_THROW_ERROR(Error, c10::str("ddpkit.", what_, " (", where(),
                                  "): ", failed.is_send ? "sending to " : "receiving from ", peer, " failed: ", text,
                                  " (a peer that died, stopped calling this collective or sent another size ends a "
                                  "message this way, as does the group's timeout)"));
}

c10::intrusive_ptr<c10d::Work> Communicator::process_group_all_reduce(at::Tensor& tensor, ReduceOp op) {
  c10d::AllreduceOptions options;
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kMean: options.reduceOp = c10d::ReduceOp::SUM; break;
    case ReduceOp::kMax: options.reduceOp = c10d::ReduceOp::MAX; break;
    case ReduceOp::kMin: options.reduceOp = c10d::ReduceOp::MIN; break;
  }
  std::vector<at::Tensor> tensors{tensor};
  return backend_->allreduce(tensors, options);
}

void Communicator::start_group() { backend_->startCoalescing(); }

Message Communicator::end_group() { return Message{backend_->endCoalescing(), -1, false}; }

void abort_all(MessageList& messages) {
  for (auto& message : messages) {
    if (message.work) message.work->abort();
  }
  messages.clear();
}

}  // namespace ddpkit::comm
