#include "ddp/reducer.h"

#include "ddp/bucket_assignment.h"
#include "sharding/shard_layout.h"

#include <torch/csrc/autograd/engine.h>

#include <algorithm>
#include <chrono>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>

namespace ddpkit::ddp {
namespace {

constexpr SyncMode kModes[] = {SyncMode::kBucketed, SyncMode::kPerParameter, SyncMode::kGatherScatter};
constexpr std::string_view kModeNames[] = {"bucketed", "per_parameter", "gather_scatter"};
constexpr Sharding kShardings[] = {Sharding::kNone, Sharding::kOptimizer, Sharding::kGradients};
constexpr std::string_view kShardingNames[] = {"none", "optimizer", "gradients"};

SyncMode parse_mode(const std::string& mode) {
  for (size_t i = 0; i < std::size(kModes); ++i) {
    if (mode == kModeNames[i]) return kModes[i];
  }
  TORCH_CHECK(false, "ddpkit.DistributedDataParallel: unknown grad_sync '", mode, "'; expected one of ",
              c10::Join(", ", grad_sync_modes()));
}

Sharding parse_sharding(const std::string& shard) {
  for (size_t i = 0; i < std::size(kShardings); ++i) {
    if (shard == kShardingNames[i]) return kShardings[i];
  }
  TORCH_CHECK(false, "ddpkit.DistributedDataParallel: unknown gradient sharding '", shard, "'; expected one of ",
              c10::Join(", ", gradient_sharding_modes()));
}

bool same_memory(const at::Tensor& a, const at::Tensor& b) {
  return a.data_ptr() == b.data_ptr() && a.sizes() == b.sizes() && a.strides() == b.strides();
}

}  // namespace

std::vector<std::string> grad_sync_modes() { return {std::begin(kModeNames), std::end(kModeNames)}; }

std::vector<std::string> gradient_sharding_modes() { return {std::begin(kShardingNames), std::end(kShardingNames)}; }

Reducer::Reducer(std::vector<at::Tensor> params, std::vector<int64_t> bucket_of_param,
                 std::optional<std::string> group_name, std::string algorithm, std::string mode,
                 bool gradient_as_bucket_view, std::string shard)
    : params_(std::move(params)),
      algorithm_(comm::parse_algorithm(algorithm)),
      mode_(parse_mode(mode)),
      gradient_as_bucket_view_(gradient_as_bucket_view),
      sharding_(parse_sharding(shard)) {
  TORCH_CHECK(params_.size() == bucket_of_param.size(), "Reducer: one bucket index per parameter expected");
  if (sharding_ != Sharding::kNone) {  // Note [Sharded gradients]
    TORCH_CHECK(group_name, "ddpkit.DistributedDataParallel: sharded gradients need a process group");
    TORCH_CHECK(mode_ == SyncMode::kBucketed, "ddpkit.DistributedDataParallel: sharded gradients take grad_sync='",
                kModeNames[0], "', got '", mode, "'");
    static constexpr comm::Algorithm kReduceScatters[] = {comm::Algorithm::kAuto, comm::Algorithm::kRing,
                                                          comm::Algorithm::kHalvingDoubling, comm::Algorithm::kDirect,
                                                          comm::Algorithm::kHierarchical};
    TORCH_CHECK(
        std::find(std::begin(kReduceScatters), std::end(kReduceScatters), algorithm_) != std::end(kReduceScatters),
        "ddpkit.DistributedDataParallel: sharded gradients are reduce-scattered, which algorithm '", algorithm,
        "' does not do (auto, ring, halving_doubling, direct and hierarchical do)");
  }
  if (group_name) {
    engine_ = comm::Engine::of(*group_name);
    world_size_ = engine_->size();
    rank_ = engine_->rank();
  }
  scale_ = at::scalar_tensor(1.0 / world_size_, at::TensorOptions().dtype(at::kDouble));
  slots_.resize(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    if (bucket_of_param[i] < 0) continue;
    TORCH_CHECK(params_[i].requires_grad(), "Reducer: parameter ", i, " does not require grad");
    slots_[i].included = true;
  }
  if (mode_ == SyncMode::kBucketed) build_buckets(bucket_of_param);

  for (size_t i = 0; i < params_.size(); ++i) {
    if (!slots_[i].included) continue;
    auto accumulator = torch::autograd::impl::grad_accumulator(params_[i]);
    TORCH_CHECK(accumulator, "Reducer: parameter ", i, " is not a leaf that requires grad");
    auto key = accumulator->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
        [this, i](const torch::autograd::variable_list& outputs, const torch::autograd::variable_list&) {
          mark_ready(i);
          return outputs;
        }));
    hooks_.emplace_back(std::move(accumulator), key);
  }
}

void Reducer::build_buckets(const std::vector<int64_t>& bucket_of_param) {
  // Slots in the order assign_buckets() visited them: last parameter first (Note [Bucket assignment]).
  const auto slots = bucket_slots(bucket_of_param);
  buckets_.resize(slots.size());
  for (size_t b = 0; b < buckets_.size(); ++b) {
    auto& bucket = buckets_[b];
    bucket.params = slots[b];
    const at::Tensor& first = params_[bucket.params.front()];
    for (size_t i : bucket.params) {
      TORCH_CHECK(params_[i].scalar_type() == first.scalar_type() && params_[i].device() == first.device(),
                  "Reducer: bucket ", b, " mixes dtypes or devices");
      bucket.offsets.push_back(static_cast<size_t>(bucket.numel));
      bucket.lengths.push_back(static_cast<size_t>(params_[i].numel()));
      slots_[i].bucket = static_cast<int64_t>(b);
      bucket.numel += params_[i].numel();
    }
    // Note [Sharded gradients]: padded to N·S, this rank's block of S is its shard.
    const int64_t shard = sharding::shard_size(bucket.numel, world_size_);
    const int64_t padded = sharding_ == Sharding::kNone ? bucket.numel : world_size_ * shard;
    if (sharding_ == Sharding::kGradients) {
      bucket.grad_shard = at::zeros({shard}, first.options());
      transfer_bytes_ = std::max(transfer_bytes_, padded * static_cast<int64_t>(first.element_size()));
      continue;  // its slots are laid out in a transfer buffer when its first gradient arrives
    }
    bucket.flat = at::zeros({padded}, first.options());
    if (sharding_ == Sharding::kOptimizer) bucket.grad_shard = bucket.flat.narrow(0, rank_ * shard, shard);
    lay_out_slots(b);
    for (size_t i : bucket.params) {
      at::Tensor& grad = params_[i].mutable_grad();
      if (gradient_as_bucket_view_ && grad.defined()) {  // Note [Gradient as bucket view]
        slots_[i].view.copy_(grad);
        grad = slots_[i].view;
      }
    }
  }
}

void Reducer::lay_out_slots(size_t index) {
  Bucket& bucket = buckets_[index];
  for (size_t k = 0; k < bucket.params.size(); ++k) {
    const at::Tensor& param = params_[bucket.params[k]];
    slots_[bucket.params[k]].view =
        bucket.flat.narrow(0, static_cast<int64_t>(bucket.offsets[k]), param.numel()).view(param.sizes());
  }
}

void Reducer::take_transfer_buffer(size_t index) {
  // Note [Sharded gradients]: a buffer whose reduce-scatter has finished is free again.
  if (transfer_pool_.empty()) {
    for (auto& other : buckets_) {
      if (other.transfer.defined() && other.work && other.work->isCompleted()) give_back_transfer_buffer(other);
    }
  }
  Bucket& bucket = buckets_[index];
  const at::Tensor& first = params_[bucket.params.front()];
  auto usable = std::find_if(transfer_pool_.begin(), transfer_pool_.end(),
                             [&](const at::Tensor& buffer) { return buffer.device() == first.device(); });
  if (usable == transfer_pool_.end()) {
    bucket.transfer = at::empty({transfer_bytes_}, first.options().dtype(at::kByte));
    ++transfer_buffers_;
  } else {
    bucket.transfer = std::move(*usable);
    transfer_pool_.erase(usable);
  }
  const int64_t padded = world_size_ * bucket.grad_shard.numel();
  bucket.flat =
      bucket.transfer.narrow(0, 0, padded * static_cast<int64_t>(first.element_size())).view(first.scalar_type());
  bucket.flat.narrow(0, bucket.numel, padded - bucket.numel).zero_();  // the padding (Note [Shard layout])
  lay_out_slots(index);
}

void Reducer::give_back_transfer_buffer(Bucket& bucket) {
  transfer_pool_.push_back(std::move(bucket.transfer));
  bucket.transfer = at::Tensor();
  bucket.flat = at::Tensor();
  for (size_t i : bucket.params) slots_[i].view = at::Tensor();
}

void Reducer::give_back_transfer_buffers() {
  for (auto& bucket : buckets_) {
    if (bucket.transfer.defined()) give_back_transfer_buffer(bucket);
  }
}

Reducer::~Reducer() {
  for (auto& [node, key] : hooks_) node->del_post_hook(key);
  // A bucket still queued on the engine writes into buckets_: wait for it (errors were reported, or
  // will be, by the backward that launched it). A hook's future is not waited for: its callbacks
  // may need the GIL, which the Python code destroying this reducer may hold, and they keep
  // the tensors they write to alive themselves.
  for (auto& bucket : buckets_) {
    if (!bucket.work) continue;
    try {
      bucket.work->wait();
    } catch (const std::exception&) {
    }
  }
}

void Reducer::prepare_for_forward() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (in_backward_) abandon_unfinished_backward();
  if (mode_ != SyncMode::kBucketed || !gradient_as_bucket_view_ || sharding_ == Sharding::kGradients) return;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!slots_[i].included || !params_[i].requires_grad()) continue;  // Note [Frozen after wrapping]
    at::Tensor& grad = params_[i].mutable_grad();
    if (grad.defined()) continue;
    slots_[i].view.zero_();
    grad = slots_[i].view;
  }
}

void Reducer::abandon_unfinished_backward() {
  // Note [A backward that raised]
  std::string errors;
  for (auto& bucket : buckets_) {
    auto work = std::move(bucket.work);
    auto hook_result = std::move(bucket.hook_result);
    try {
      // Its all-reduce (or the hook's) writes into the bucket, which the next backward refills.
      if (work) work->wait();
      if (hook_result) {
        hook_result->wait();
        hook_result->value();  // raises what the hook's future failed with
      }
    } catch (const std::exception& e) {
      errors += c10::str("; a bucket's ", work ? "all-reduce" : "communication hook", " failed: ", e.what());
    }
  }
  in_backward_ = false;
  give_back_transfer_buffers();
  TORCH_WARN(
      "ddpkit.DistributedDataParallel: the previous backward raised before its gradients were "
      "synchronised, so they hold this rank's own, unaveraged values: zero them before the next "
      "optimizer step",
      errors);
}

void Reducer::register_comm_hook(std::unique_ptr<c10d::CommHookInterface> hook) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(hook, "Reducer::register_comm_hook: no hook");
  TORCH_CHECK(!comm_hook_, "ddpkit.DistributedDataParallel: register_comm_hook can only be called once");
  TORCH_CHECK(mode_ == SyncMode::kBucketed,
              "ddpkit.DistributedDataParallel: a communication hook takes grad_sync='bucketed', got '",
              kModeNames[static_cast<size_t>(mode_)], "'");
  TORCH_CHECK(!in_backward_, "ddpkit.DistributedDataParallel: register_comm_hook during backward");
  TORCH_CHECK(sharding_ == Sharding::kNone,
              "ddpkit.DistributedDataParallel: a communication hook replaces each bucket's all-reduce, and with "
              "a ShardedOptimizer the buckets are reduce-scattered instead (Note [Sharded gradients]): use one or "
              "the other");
  comm_hook_ = std::move(hook);
}

void Reducer::set_sync(bool enabled) {
  std::lock_guard<std::mutex> lock(mutex_);
  sync_enabled_ = enabled;
}

bool Reducer::sync_enabled() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return sync_enabled_;
}

void Reducer::mark_ready(size_t index) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!sync_enabled_) return;
  if (!in_backward_) start_iteration();
  if (mode_ != SyncMode::kBucketed) return;
  Slot& slot = slots_[index];
  TORCH_CHECK(!slot.ready, "ddpkit.DistributedDataParallel: parameter ", index,
              " received its gradient twice in one backward (reentrant backward or a second backward before "
              "the first finished synchronising are not supported)");
  copy_into_slot(index);
  slot.ready = true;
  if (--buckets_[slot.bucket].pending == 0) launch_ready_buckets();
}

void Reducer::start_iteration() {
  TORCH_CHECK(engine_ || comm_hook_,
              "ddpkit.DistributedDataParallel: built without a process group, it synchronises gradients only "
              "through a communication hook: call register_comm_hook before the first backward");
  in_backward_ = true;
  next_launch_ = 0;
  for (auto& slot : slots_) slot.ready = false;
  for (auto& bucket : buckets_) bucket.pending = bucket.params.size();
  // Runs on the autograd engine when this backward has finished (Note [Overlap]).
  torch::autograd::Engine::get_default_engine().queue_callback([this] { finalize(); });
}

void Reducer::copy_into_slot(size_t index) {
  Slot& slot = slots_[index];
  if (sharding_ == Sharding::kGradients && !buckets_[slot.bucket].flat.defined()) {
    take_transfer_buffer(static_cast<size_t>(slot.bucket));
  }
  at::Tensor& grad = params_[index].mutable_grad();
  if (!params_[index].requires_grad()) {  // Note [Frozen after wrapping]: it contributes zeros
    if (grad.defined() && same_memory(grad, slot.view)) grad = grad.clone();
    slot.view.zero_();
  } else if (!grad.defined()) {
    slot.view.zero_();
  } else if (same_memory(grad, slot.view)) {
    if (!comm_hook_) slot.view.mul_(scale_);  // Note [Communication hooks]: the hook averages
  } else {
    // detach(): under backward(create_graph=True) the gradient carries a graph of its own, which the
    // averaged gradient does not keep (nor does torch's DDP's).
    if (comm_hook_) {
      slot.view.copy_(grad.detach());
    } else {
      at::mul_out(slot.view, grad.detach(), scale_);
    }
    if (sharding_ == Sharding::kGradients) {
      grad = at::Tensor();  // Note [Sharded gradients]: the bucket is the gradient's last stop here
    } else if (gradient_as_bucket_view_) {
      grad = slot.view;
    }
  }
}

void Reducer::launch_ready_buckets() {
  while (next_launch_ < buckets_.size() && buckets_[next_launch_].pending == 0) {
    launch(next_launch_++);
  }
}

void Reducer::launch(size_t index) {
  Bucket& bucket = buckets_[index];
  ++collectives_;
  if (comm_hook_) {  // Note [Communication hooks]
    std::vector<c10::IntArrayRef> sizes;
    std::vector<at::Tensor> parameters;
    for (size_t i : bucket.params) {
      sizes.push_back(params_[i].sizes());
      parameters.push_back(params_[i]);
    }
    c10d::GradBucket grad_bucket(index, buckets_.size(), bucket.flat, bucket.offsets, bucket.lengths, std::move(sizes),
                                 std::move(parameters), std::nullopt);
    bucket.hook_result = comm_hook_->runHook(grad_bucket);
    TORCH_CHECK(bucket.hook_result, "ddpkit.DistributedDataParallel: the communication hook returned no future");
    return;
  }
  // Note [Overlap]: queued on the group's engine, which runs it while backward goes on.
  at::Tensor flat = bucket.flat;
  const comm::Algorithm algorithm = algorithm_;
  if (sharding_ != Sharding::kNone) {  // Note [Sharded gradients]
    at::Tensor shard = bucket.grad_shard;
    bucket.work = engine_->submit(flat.device().type(), comm::TransportKind::kAuto, "reduce_scatter",
                                  [flat, shard, algorithm](comm::Communicator& comm) mutable {
                                    comm::reduce_scatter_tensor_(shard, flat, comm::ReduceOp::kSum, algorithm, comm);
                                  });
    return;
  }
  bucket.work = engine_->submit(flat.device().type(), comm::TransportKind::kAuto, "all_reduce",
                                [flat, algorithm](comm::Communicator& comm) mutable {
                                  comm::all_reduce_(flat, comm::ReduceOp::kSum, algorithm, comm);
                                });
}

void Reducer::finalize() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!in_backward_) return;
  in_backward_ = false;  // even if waiting fails below: the next backward starts afresh
  launched_during_backward_ += static_cast<int64_t>(next_launch_);
  const auto started = std::chrono::steady_clock::now();
  if (mode_ == SyncMode::kBucketed) {
    finish_bucketed();
  } else {
    finish_per_parameter();
  }
  last_wait_us_ =
      std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - started).count();
  wait_us_ += last_wait_us_;
  ++synced_backwards_;
}

void Reducer::finish_bucketed() {
  // Note [Unused parameters]
  for (size_t i = 0; i < slots_.size(); ++i) {
    Slot& slot = slots_[i];
    if (!slot.included || slot.ready) continue;
    copy_into_slot(i);
    slot.ready = true;
    --buckets_[slot.bucket].pending;
  }
  // Every bucket launched is waited for even after a launch or a wait failed (Note [Communication
  // hooks]), then the first failure raises.
  std::exception_ptr failure;
  try {
    launch_ready_buckets();
    TORCH_INTERNAL_ASSERT(next_launch_ == buckets_.size(), "every bucket must be launched by now");
  } catch (...) {
    failure = std::current_exception();
  }
  for (size_t b = 0; b < buckets_.size(); ++b) {
    try {
      wait_for_bucket(b);
    } catch (...) {
      if (!failure) failure = std::current_exception();
    }
  }
  give_back_transfer_buffers();
  if (failure) std::rethrow_exception(failure);
  for (size_t i = 0; i < slots_.size(); ++i) {
    Slot& slot = slots_[i];
    if (!slot.included || !params_[i].requires_grad()) continue;  // Note [Frozen after wrapping]
    at::Tensor& grad = params_[i].mutable_grad();
    if (sharding_ != Sharding::kNone) {  // Note [Sharded gradients]: only the shards hold averages
      grad = at::Tensor();
      continue;
    }
    if (gradient_as_bucket_view_ || !grad.defined()) {
      if (!grad.defined() || !same_memory(grad, slot.view)) {
        grad = gradient_as_bucket_view_ ? slot.view : slot.view.clone();
      }
    } else {
      grad.copy_(slot.view);
    }
  }
}

void Reducer::wait_for_bucket(size_t index) {
  Bucket& bucket = buckets_[index];
  auto work = std::move(bucket.work);
  if (work) work->wait();
  auto hook_result = std::move(bucket.hook_result);
  if (!hook_result) return;
  hook_result->wait();
  const at::Tensor result = comm_hook_->parseHookResult(hook_result->value());
  TORCH_CHECK(result.defined() && result.numel() == bucket.flat.numel(),
              "ddpkit.DistributedDataParallel: the communication hook's future for bucket ", index, " holds ",
              result.defined() ? c10::str("a tensor of ", result.numel(), " elements") : std::string("no tensor"),
              "; the bucket has ", bucket.flat.numel());
  if (!same_memory(result, bucket.flat)) bucket.flat.copy_(result.reshape({-1}));
}

void Reducer::finish_per_parameter() {
  const comm::Algorithm algorithm = mode_ == SyncMode::kGatherScatter ? comm::Algorithm::kGatherScatter : algorithm_;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!slots_[i].included) continue;
    // Every rank issues the same collectives: a frozen parameter's (Note [Frozen after wrapping]) is
    // an all-reduce of zeros that leaves its gradient alone.
    const bool frozen = !params_[i].requires_grad();
    at::Tensor& grad = params_[i].mutable_grad();
    if (!grad.defined() && !frozen) grad = at::zeros_like(params_[i]);
    at::Tensor contiguous =
        frozen ? at::zeros_like(params_[i], at::MemoryFormat::Contiguous) : grad.detach().contiguous();
    engine_->run(contiguous.device().type(), comm::TransportKind::kAuto, "all_reduce", [&](comm::Communicator& comm) {
      comm::all_reduce_(contiguous, comm::ReduceOp::kMean, algorithm, comm);
    });
    if (!frozen && !same_memory(contiguous, grad)) grad.copy_(contiguous);
    ++collectives_;
  }
}

std::vector<at::Tensor> Reducer::buckets() const {
  std::vector<at::Tensor> out;
  for (const auto& bucket : buckets_) {
    if (bucket.flat.defined()) out.push_back(bucket.flat);
  }
  return out;
}

std::vector<at::Tensor> Reducer::gradient_shards() const {
  std::vector<at::Tensor> out;
  for (const auto& bucket : buckets_) {
    if (bucket.grad_shard.defined()) out.push_back(bucket.grad_shard);
  }
  return out;
}

c10::Dict<std::string, int64_t> Reducer::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  c10::Dict<std::string, int64_t> out;
  out.insert("synced_backwards", synced_backwards_);
  out.insert("collectives", collectives_);
  out.insert("launched_during_backward", launched_during_backward_);
  out.insert("buckets", static_cast<int64_t>(buckets_.size()));
  out.insert("wait_us", wait_us_);
  out.insert("last_wait_us", last_wait_us_);
  out.insert("transfer_buffers", transfer_buffers_);
  out.insert("transfer_bytes", transfer_buffers_ * transfer_bytes_);
  return out;
}

}  // namespace ddpkit::ddp
