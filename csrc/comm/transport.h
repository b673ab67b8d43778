#pragma once
// How a Communicator moves the bytes of its point-to-point messages.

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <string_view>

namespace ddpkit::comm {

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
