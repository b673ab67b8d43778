#pragma once
// How a Communicator moves the bytes of its point-to-point messages.

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <array>
#include <string_view>

namespace ddpkit::comm {

// Which transport a collective asks for (Note [Collective engine] in engine.h).
enum class TransportKind : int64_t {
  kAuto = 0,          // shared memory when every rank is on this host and the tensor is on CPU
  kShm = 1,           // shared memory, or an error when the ranks are not all on this host
  kProcessGroup = 2,  // the group's own send/recv (gloo, NCCL)
};
// One name per TransportKind, in enum order (what the Python API and DDPKIT_TRANSPORT accept).
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

// Tagged, asynchronous point-to-point messages of contiguous tensors between the ranks of one group.
// send/recv return at once; the tensor must stay alive and untouched until the returned Work's
// wait() returns. wait() throws (naming the peer's fate where it knows it) when the peer died or
// the group's timeout expired; abort() gives up a message that will never complete. Messages
// between two ranks match by tag; a tag is used by at most one message in flight per direction.
class Transport {
 public:
  virtual ~Transport() = default;
  virtual std::string_view name() const = 0;
  virtual c10::intrusive_ptr<c10d::Work> send(const at::Tensor& tensor, int dst, int tag) = 0;
  virtual c10::intrusive_ptr<c10d::Work> recv(const at::Tensor& tensor, int src, int tag) = 0;
};

// The process group's own send/recv: across hosts, CUDA tensors (NCCL), and wherever only the
// point-to-point calls of torch.distributed may carry the data.
class ProcessGroupTransport final : public Transport {
 public:
  explicit ProcessGroupTransport(c10::intrusive_ptr<c10d::Backend> backend) : backend_(std::move(backend)) {}
  std::string_view name() const override { return "process_group"; }
  c10::intrusive_ptr<c10d::Work> send(const at::Tensor& tensor, int dst, int tag) override {
    std::vector<at::Tensor> tensors{tensor};
    return backend_->send(tensors, dst, tag);
  }
  c10::intrusive_ptr<c10d::Work> recv(const at::Tensor& tensor, int src, int tag) override {
    std::vector<at::Tensor> tensors{tensor};
    return backend_->recv(tensors, src, tag);
  }

 private:
  c10::intrusive_ptr<c10d::Backend> backend_;
};

}  // namespace ddpkit::comm
