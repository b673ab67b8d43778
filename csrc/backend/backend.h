#pragma once
// The "ddpkit" torch.distributed backend: init_process_group(backend="ddpkit") runs torch's own
// collectives (dist.all_reduce, DistributedDataParallel, ZeroRedundancyOptimizer, ...) on ddpkit's
// collective engine. Registered from Python on `import ddpkit` (python/ddpkit/backend.py).

#include "comm/core/wire_format.h"
#include "comm/engine/engine.h"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

namespace ddpkit::backend {

// Note [The ddpkit backend]
// Each operation torch hands the backend becomes one collective of the group's comm::Engine (Note
// [Collective engine]), so it gets the engine's transport choice (shared memory when every rank is
// on this host, else point-to-point messages over an inner gloo backend), algorithm choice
// ("auto"), sequence numbers and collective checks (a mismatched call raises on every rank).
//  - asyncOp=false (dist.all_reduce(t) without async_op) runs the collective on the calling thread
//    and returns a completed Work: no thread hand-off. asyncOp=true (async_op=True, and torch DDP's
//    bucket all-reduces during backward) queues it for the engine's thread; the Work completes
//    when it ran, and its future holds the output tensors (what DDP's communication hooks read).
//  - Every operation has one name, torch.distributed's public one (all_reduce, all_gather_into_tensor,
//    all_to_all_single, ...; the Operation table of backend.cpp maps c10d's overrides to them), and
//    every error of a call starts with it ("ddpkit.all_reduce: ..."), the engine's included.
//  - Every override takes the same stages, as gloo's do: the operation's named validators
//    (check_single_tensor, check_cpu, ...), whose failure rejects the call on every rank; then
//    ddpkit's own collective on the engine, or gloo's.
//  - Implemented over the engine: all_reduce and all_reduce_coalesced (sum, avg, max, min of
//    float32, float64, float16, bfloat16, int32, int64), broadcast, reduce (same ops and dtypes),
//    all_gather, all_gather_into_tensor, all_gather_into_tensor_coalesced, gather, scatter,
//    reduce_scatter, reduce_scatter_tensor, reduce_scatter_tensor_coalesced (same ops and dtypes),
//    all_to_all, all_to_all_single, barrier. Collectives that only move bytes take any dtype.
//  - Delegated to the inner gloo backend, still in the engine's order and after the same collective
//    check (its header carries gloo's op, kDelegatedOp): reductions with an op or a dtype ddpkit
//    does not reduce (PRODUCT, BAND, BOR, BXOR, PREMUL_SUM; bool, uint8, int8, int16, sparse
//    tensors; the coalesced forms also for several dtypes at once), all_gather_coalesced,
//    all_gather_into_tensor_coalesced of several dtypes. Errors for what gloo cannot do either are
//    gloo's.
//  - Delegated directly to a second gloo backend, outside the engine (they are not collectives, so
//    they take no sequence number, and their tags are the program's): send, recv, recvAnysource,
//    monitoredBarrier.
//  - CPU tensors only (register_backend(..., devices=["cpu"])): use "cpu:ddpkit,cuda:nccl" for a
//    group that also carries CUDA tensors.
class Backend final : public c10d::Backend, public comm::EngineBackend {
 public:
  // What torch.distributed hands a backend creator (`store` already carries the group's prefix),
  // and two gloo backends of the same ranks, each on a store prefix of its own: `gloo` carries the
  // engine's messages across hosts and the delegated collectives, `gloo_p2p` the program's own
  // send/recv, whose tags would otherwise meet the engine's (Note [Tags]). `cross_host` is how the
  // sums and means of allreduce and _reduce_scatter_base (reduce_scatter_tensor) cross hosts; the
  // list and coalesced forms stay exact (Note [Compressed crossing]:
  // ddpkit.Options(cross_host_dtype=...) through init_process_group's pg_options).
  Backend(c10::intrusive_ptr<c10d::Store> store, int rank, int size, std::chrono::milliseconds timeout,
          c10::intrusive_ptr<c10d::Backend> gloo, c10::intrusive_ptr<c10d::Backend> gloo_p2p,
          comm::WireFormat cross_host = comm::WireFormat::kExact);
  // In a forked child, leaves the inner gloo backends undestroyed: their threads are the parent's
  // (Note [Forked children] in comm/core/fork_guard.cpp).
  ~Backend() override;

  const std::string getBackendName() const override { return "ddpkit"; }
  // How this group's sums and means cross hosts (ddpkit.Options' cross_host_dtype): what ddpkit's own
  // wrappers on the group (FullyShardedDataParallel) reduce across hosts with by default.
  comm::WireFormat cross_host_wire() const { return cross_host_; }
  c10::intrusive_ptr<Options> getBackendOptions() override { return options_; }
  // The group's engine, made on first use (the group's name is known by then).
  std::shared_ptr<comm::Engine> engine() override;

  // torch's sequence numbers (what TORCH_DISTRIBUTED_DEBUG=INFO/DETAIL's ProcessGroupWrapper reads):
  // the collectives this backend has launched since the last reset, alike on every rank of a
  // well-formed program, as gloo counts them.
  void setSequenceNumberForGroup() override { collectives_launched_.store(0); }
  uint64_t getSequenceNumberForGroup() override { return collectives_launched_.load(); }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_sparse(std::vector<at::Tensor>& tensors,
                                                  const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                     const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_split_sizes,
                                               std::vector<int64_t>& input_split_sizes,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst_rank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src_rank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;

 private:
  struct Call;  // an Operation (backend.cpp's table) and whether the caller asked for async_op
  // The stages every collective takes (Note [The ddpkit backend]): `validate(name)` runs the
  // operation's validators on the caller's arguments; a rank whose arguments fail runs the group's
  // next collective as a rejection (comm::reject), so that every rank raises and the next calls pair;
  // else `run()` launches the collective on the engine or delegates it to gloo.
  template <class Validate, class Run>
  c10::intrusive_ptr<c10d::Work> collective(Call call, Validate&& validate, Run&& run);
  // Runs `body` as the group's next collective: on this thread when the call is not async (returning
  // a completed Work), else on the engine's thread. `outputs` become the Work's result.
  c10::intrusive_ptr<c10d::Work> launch(Call call, std::vector<at::Tensor> outputs, comm::Engine::Body body);
  // Runs the inner gloo backend's operation `op` as the group's next collective, after the
  // collective check of `header` (Note [The ddpkit backend]).
  c10::intrusive_ptr<c10d::Work> delegate(Call call, std::vector<at::Tensor> outputs, comm::CollectiveHeader header,
                                          std::function<c10::intrusive_ptr<c10d::Work>()> op);

  // The send/recv backend, in the process that made it; raises, naming `op`, in a forked child.
  c10d::Backend& point_to_point(std::string_view op);

  const uint64_t fork_generation_;  // the process that made it (Note [Forked children])
  c10::intrusive_ptr<c10d::Store> store_;
  c10::intrusive_ptr<c10d::Backend> gloo_;
  c10::intrusive_ptr<c10d::Backend> gloo_p2p_;
  c10::intrusive_ptr<Options> options_;
  comm::TransportKind transport_;
  comm::WireFormat cross_host_;
  std::mutex engine_mutex_;
  std::shared_ptr<comm::Engine> engine_;
  std::atomic<uint64_t> collectives_launched_{0};
};

}  // namespace ddpkit::backend
