#pragma once
// How a Communicator moves a collective's bytes: a transport's point-to-point messages, and what
// else it can do. A collective asks its transport for a capability, never which transport it is
// (NCCL's struct ncclTransport is the model).

#include "comm/core/header.h"
#include "comm/reduction/reduce_op.h"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <array>
#include <string>
#include <string_view>
#include <vector>

namespace ddpkit::comm {

// Which transport a collective asks for (Note [Collective engine] in engine/engine.h).
enum class TransportKind : int64_t {
  kAuto = 0,      // shared memory when every rank is on this host and the tensor is on CPU
  kShm = 1,       // shared memory, or an error when the ranks are not all on this host
  kSendRecv = 2,  // the backend's own send/recv (gloo, NCCL): named "process_group"
};
// One name per TransportKind, in enum order (what the Python API and DDPKIT_TRANSPORT accept, and
// what Transport::name() returns).
inline constexpr std::array<std::string_view, 3> kTransportNames = {"auto", "shm", "process_group"};

// Parses a name of kTransportNames; TORCH_CHECK-fails otherwise.
inline TransportKind parse_transport(std::string_view name) {
  for (size_t i = 0; i < kTransportNames.size(); ++i) {
    if (kTransportNames[i] == name) return static_cast<TransportKind>(i);
  }
  TORCH_CHECK(false, "ddpkit: unknown transport '", name, "'; expected one of auto, shm, process_group");
}

inline std::string_view transport_name(TransportKind kind) {
  const auto index = static_cast<size_t>(kind);
  TORCH_INTERNAL_ASSERT(index < kTransportNames.size(), "unknown transport ", index);
  return kTransportNames[index];
}

// The collectives a transport runs itself, with no messages: every rank publishes its data where its
// peers read it in place (shared memory). Each call is one collective of the group, synchronous,
// one at a time (the engine's order), taking the same number of steps on every rank. The collective
// check rides in a collective's first step when the group's check armed it (carry_check, Note [Check
// seam]); a step of a larger collective after its check carries none. A rank that rejected its
// arguments passes undefined tensors and still takes the first step, whose check then raises on every
// rank. `what` is the call the collective serves (Communicator::what()): every error starts with it,
// for a direct collective serves calls of other names too (an all_gather runs on all_gather below).
class DirectCollectives {
 public:
  virtual ~DirectCollectives() = default;
  // One step carrying `header` alone; returns every rank's header (in rank order), compared by the
  // caller (the check across hosts); also a barrier.
  virtual std::vector<CollectiveHeader> exchange_headers(const CollectiveHeader& header, std::string_view what) = 0;
  // Arms the collective check for the next collective's first step: `header` is this rank's,
  // stamped (magic, sequence); that step compares every rank's header and raises the same error on
  // every rank, this rank's `local_error` (non-empty: it rejected its arguments) first, before any
  // tensor is touched. `local_error` is read there: it must live until that collective returns (the
  // caller of Communicator::run_direct holds it).
  virtual void carry_check(const CollectiveHeader& header, std::string_view local_error) = 0;
  // The group's rank of this transport's rank `rank` (they differ where it spans a host of a larger group).
  virtual int group_rank(int rank) const = 0;
  // After a failure: the group's rank that died or gave up first, as far as this transport knows; -1.
  virtual int failed_rank() const = 0;
  // In place on `flat` (contiguous; float32/float64/int32/int64): every rank ends with the same bits.
  // Here and in reduce_scatter a kMean is whole: divided by this transport's size (a step of a
  // larger collective passes accumulating_op(op), Note [One reduction family]).
  virtual void all_reduce(const at::Tensor& flat, ReduceOp op, std::string_view what) = 0;
  // torch's all_gather_into_tensor: `input` is rank i's block i of `output` everywhere.
  virtual void all_gather(const at::Tensor& output, const at::Tensor& input, std::string_view what) = 0;
  // torch's reduce_scatter_tensor: `output` receives op over the ranks' block `rank` of `input`.
  virtual void reduce_scatter(const at::Tensor& output, const at::Tensor& input, ReduceOp op,
                              std::string_view what) = 0;
  // Copies `tensor` (contiguous, any dtype) of rank `root` into `tensor` of every rank.
  virtual void broadcast(const at::Tensor& tensor, int root, std::string_view what) = 0;
  // One step, no data: returns when every rank has taken it.
  virtual void barrier(std::string_view what) = 0;
  // This rank rejected the arguments of a `what` with checks off, so its peers never learn it and
  // wait: stops the transport on this rank and, through it, on theirs (no call may pair wrongly).
  virtual void reject_unchecked(std::string_view what) = 0;
  // This rank gives up the current collective for `why` (a failure elsewhere, such as across hosts):
  // stops the transport on this rank and, through it, on its peers, who report `why`.
  virtual void abandon(const std::string& why) = 0;
};

// Tagged, asynchronous point-to-point messages of contiguous tensors between the ranks of one group,
// and the transport's capabilities. send/recv return at once; the tensor must stay alive and
// untouched until the returned Work's wait() returns. wait() throws (naming the peer's fate where it
// knows it) when the peer died or the group's timeout expired; abort() gives up a message that will
// never complete. Messages between two ranks match by tag; a tag is used by at most one message in
// flight per direction.
class Transport {
 public:
  virtual ~Transport() = default;
  // A name of kTransportNames.
  virtual std::string_view name() const = 0;
  virtual c10::intrusive_ptr<c10d::Work> send(const at::Tensor& tensor, int dst, int tag) = 0;
  virtual c10::intrusive_ptr<c10d::Work> recv(const at::Tensor& tensor, int src, int tag) = 0;

  // Capabilities.
  // The collectives it runs without messages, or null.
  virtual DirectCollectives* direct() { return nullptr; }
  // True when its sends and receives complete independently of each other, so that receives can be
  // posted rounds ahead (Note [Pre-posted receives]); false where each round's sends and receives
  // must be grouped (NCCL), through start_group()/end_group() on the backend.
  virtual bool posts_ahead() const { return true; }
};

// The process group's own send/recv for `device` tensors: across hosts, CUDA tensors (NCCL), and
// wherever only the point-to-point calls of torch.distributed may carry the data.
class SendRecvTransport final : public Transport {
 public:
  SendRecvTransport(c10::intrusive_ptr<c10d::Backend> backend, c10::DeviceType device)
      : backend_(std::move(backend)), posts_ahead_(device == c10::kCPU || !backend_->supportsCoalescing()) {}
  std::string_view name() const override { return transport_name(TransportKind::kSendRecv); }
  c10::intrusive_ptr<c10d::Work> send(const at::Tensor& tensor, int dst, int tag) override {
    std::vector<at::Tensor> tensors{tensor};
    return backend_->send(tensors, dst, tag);
  }
  c10::intrusive_ptr<c10d::Work> recv(const at::Tensor& tensor, int src, int tag) override {
    std::vector<at::Tensor> tensors{tensor};
    return backend_->recv(tensors, src, tag);
  }
  bool posts_ahead() const override { return posts_ahead_; }

 private:
  c10::intrusive_ptr<c10d::Backend> backend_;
  bool posts_ahead_;
};

}  // namespace ddpkit::comm
