#include "fsdp/fully_sharded.h"

#include "comm/collectives/collectives.h"

#include <ATen/core/LegacyTypeDispatch.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>

#include <algorithm>
#include <exception>

namespace ddpkit::fsdp {
namespace {

constexpr const char* kWho = "ddpkit.FullyShardedDataParallel";

}  // namespace

FullyShardedState::FullyShardedState(std::string group_name, std::optional<at::ScalarType> compute_dtype,
                                     std::string wire)
    : engine_(comm::Engine::of(group_name)), compute_dtype_(compute_dtype), wire_(comm::parse_wire_format(wire)) {
  world_size_ = engine_->size();
  scale_ = 1.0 / world_size_;
  if (compute_dtype_) {
    TORCH_CHECK(at::isFloatingType(*compute_dtype_), kWho, ": compute_dtype must be a floating dtype, got ",
                *compute_dtype_);
  }
}

FullyShardedState::~FullyShardedState() {
  for (auto& [node, key] : hooks_) node->del_post_hook(key);
  // Collectives still queued write into the units' buffers: wait for them (their errors were, or
  // will be, reported by the call that queued them).
  for (auto& unit : units_) {
    for (auto* work : {&unit.gather_work, &unit.reduce_work}) {
      if (!*work) continue;
      try {
        (*work)->wait();
      } catch (const std::exception&) {
      }
    }
  }
  cache_->close();
}

FullyShardedState::Unit& FullyShardedState::unit(int64_t u) {
  TORCH_CHECK(u >= 0 && u < static_cast<int64_t>(units_.size()), kWho, ": no unit ", u);
  return units_[u];
}

const FullyShardedState::Unit& FullyShardedState::unit(int64_t u) const {
  TORCH_CHECK(u >= 0 && u < static_cast<int64_t>(units_.size()), kWho, ": no unit ", u);
  return units_[u];
}

int64_t FullyShardedState::add_unit(std::vector<at::Tensor> params, bool sharded, bool keep) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(sharded || replicated_ < 0, kWho, ": one replicated unit at most");
  TORCH_CHECK(!in_backward_ && forward_order_.empty(), kWho, ": units are added before the first forward");
  const at::ScalarType dtype = params.empty() ? at::kFloat : params.front().scalar_type();
  Unit unit;
  unit.keep = keep;
  unit.buffers = std::make_unique<UnitBuffers>(params, sharded, engine_->rank(), world_size_,
                                               compute_dtype_.value_or(dtype), cache_);
  at::Tensor packed = unit.buffers->packed();
  engine_->run(c10::kCPU, comm::TransportKind::kAuto, "broadcast",
               [&](comm::Communicator& comm) { comm::broadcast_(packed, 0, comm); });
  unit.buffers->adopt();
  unit.buffers->allocate_compute();  // for the Python parameters over compute_views (attach releases it)
  if (!sharded) replicated_ = static_cast<int64_t>(units_.size());
  units_.push_back(std::move(unit));
  in_forward_order_.push_back(false);
  return static_cast<int64_t>(units_.size()) - 1;
}

std::vector<at::Tensor> FullyShardedState::master_views(int64_t u) const { return unit(u).buffers->master_views(); }
std::vector<at::Tensor> FullyShardedState::compute_views(int64_t u) const { return unit(u).buffers->compute_views(); }
at::Tensor FullyShardedState::master(int64_t u) const { return unit(u).buffers->master(); }

std::vector<int64_t> FullyShardedState::layout(int64_t u) const {
  const UnitBuffers& buffers = *unit(u).buffers;
  return {buffers.total(), buffers.shard_size()};
}

std::vector<int64_t> FullyShardedState::pieces(int64_t u) const {
  std::vector<int64_t> out;
  for (const auto& piece : unit(u).buffers->pieces()) {
    out.insert(out.end(), {piece.param, piece.param_offset, piece.length, piece.shard_offset});
  }
  return out;
}

void FullyShardedState::attach(int64_t u, std::vector<at::Tensor> compute_params, std::vector<at::Tensor> masters) {
  std::lock_guard<std::mutex> lock(mutex_);
  Unit& target = unit(u);
  TORCH_CHECK(target.compute_params.empty(), kWho, ": unit ", u, " is attached already");
  const size_t count = target.buffers->compute_views().size();
  TORCH_CHECK(compute_params.size() == count && masters.size() == count, kWho, ": unit ", u, " has ", count,
              " parameters, attach got ", compute_params.size(), " and ", masters.size());
  target.compute_params = std::move(compute_params);
  target.masters = std::move(masters);
  target.buffers->release_compute();
  for (size_t i = 0; i < count; ++i) {
    const at::Tensor& param = target.compute_params[i];
    if (!param.requires_grad()) continue;
    ++target.trainable;
    auto accumulator = torch::autograd::impl::grad_accumulator(param);
    TORCH_CHECK(accumulator, kWho, ": a compute parameter of unit ", u, " is not a leaf");
    const size_t index = static_cast<size_t>(u);
    auto key = accumulator->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
        [this, index, i](const torch::autograd::variable_list& outputs, const torch::autograd::variable_list&) {
          mark_ready(index, i);
          return outputs;
        }));
    hooks_.emplace_back(std::move(accumulator), key);
  }
}

// --- gathering -------------------------------------------------------------------------------------

void FullyShardedState::gather(size_t u, bool ahead) {
  Unit& target = units_[u];
  if (target.gathered != Gathered::kNo) return;
  UnitBuffers& buffers = *target.buffers;
  buffers.allocate_compute();
  buffers.fill_compute_locally();
  if (!buffers.gathers_across_ranks()) {
    target.gathered = Gathered::kYes;
  } else {
    ++gathers_;
    if (ahead) ++gathered_ahead_;
    UnitBuffers* raw = &buffers;  // the unit outlives its gather (release() and the destructor wait)
    target.gather_work = engine_->submit(c10::kCPU, comm::TransportKind::kAuto, "all_gather",
                                         [raw](comm::Communicator& comm) { raw->all_gather(comm); });
    target.gathered = Gathered::kInFlight;
  }
  int64_t gathered = 0;
  for (const auto& unit : units_) gathered += unit.gathered != Gathered::kNo && !unit.buffers->compute_is_master();
  peak_gathered_ = std::max(peak_gathered_, gathered);
}

void FullyShardedState::wait_gathered(size_t u) {
  Unit& target = units_[u];
  if (target.gathered == Gathered::kNo) gather(u, false);
  if (target.gathered == Gathered::kInFlight) {
    auto work = std::move(target.gather_work);
    target.gathered = Gathered::kYes;
    try {
      work->wait();
    } catch (const std::exception& e) {
      target.gathered = Gathered::kNo;  // gathered again by the next use
      target.buffers->release_compute();
      TORCH_CHECK(false, kWho, ": the all-gather of unit ", u,
                  " failed (every rank must run the same units in the same order): ", e.what());
    }
  }
}

void FullyShardedState::release(size_t u) {
  Unit& target = units_[u];
  const Gathered was = target.gathered;
  target.gathered = Gathered::kNo;
  if (was == Gathered::kInFlight) {
    // The engine's thread writes into the buffer until the gather has run.
    auto work = std::move(target.gather_work);
    try {
      work->wait();
    } catch (...) {
      target.buffers->release_compute();
      throw;
    }
  }
  target.buffers->release_compute();
}

void FullyShardedState::release_all() {
  std::exception_ptr failure;
  for (size_t u = 0; u < units_.size(); ++u) {
    try {
      release(u);
    } catch (...) {
      if (!failure) failure = std::current_exception();
    }
  }
  if (failure) std::rethrow_exception(failure);
}

void FullyShardedState::prefetch_after(size_t u, const std::vector<size_t>& order) {
  auto at = std::find(order.begin(), order.end(), u);
  if (at == order.end() || ++at == order.end()) return;
  if (units_[*at].buffers->gathers_across_ranks()) gather(*at, true);
}

// --- forward ---------------------------------------------------------------------------------------

void FullyShardedState::begin_forward(bool graph) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (in_backward_) abandon_backward();
  release_all();
  graph_ = graph;
  if (graph) {
    forward_order_.clear();
    std::fill(in_forward_order_.begin(), in_forward_order_.end(), false);
  }
  if (replicated_ >= 0) gather(static_cast<size_t>(replicated_), false);
}

void FullyShardedState::pre_forward(int64_t u) {
  std::lock_guard<std::mutex> lock(mutex_);
  unit(u);
  const size_t index = static_cast<size_t>(u);
  wait_gathered(index);
  if (graph_ && !in_backward_ && !in_forward_order_[index]) {
    in_forward_order_[index] = true;
    forward_order_.push_back(index);
  }
  if (!previous_order_.empty()) {
    prefetch_after(index, previous_order_);
  } else {
    for (size_t next = index + 1; next < units_.size(); ++next) {
      if (units_[next].buffers->gathers_across_ranks() && !units_[next].keep) {
        gather(next, true);
        break;
      }
    }
  }
}

void FullyShardedState::post_forward(int64_t u) {
  std::lock_guard<std::mutex> lock(mutex_);
  const Unit& target = unit(u);
  // A forward run again inside backward (activation checkpointing) computes what this unit's backward,
  // under way, needs: the unit stays gathered until its gradients are in.
  if (in_backward_) return;
  if (graph_) {
    if (target.keep) return;
    // The forward's last unit: its backward comes first (the previous forward's last, or the last
    // unit added before there was one).
    size_t last = units_.size();
    if (!previous_order_.empty()) {
      last = previous_order_.back();
    } else {
      for (size_t i = units_.size(); i-- > 0;) {
        if (units_[i].buffers->sharded() && !units_[i].keep) {
          last = i;
          break;
        }
      }
    }
    if (last == static_cast<size_t>(u)) return;
  }
  release(static_cast<size_t>(u));
}

void FullyShardedState::end_forward() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!graph_) {
    release_all();
    return;
  }
  previous_order_ = forward_order_;
}

// --- backward --------------------------------------------------------------------------------------

void FullyShardedState::start_backward() {
  in_backward_ = true;
  syncing_ = sync_enabled_;
  backward_order_.assign(forward_order_.rbegin(), forward_order_.rend());
  reduction_order_.clear();
  for (size_t u : backward_order_) {
    if (units_[u].trainable > 0) reduction_order_.push_back(u);
  }
  for (size_t u = 0; u < units_.size(); ++u) {
    if (units_[u].trainable > 0 && !in_forward_order_[u] && static_cast<int64_t>(u) != replicated_) {
      reduction_order_.push_back(u);
    }
  }
  if (replicated_ >= 0 && units_[replicated_].trainable > 0) reduction_order_.push_back(replicated_);
  next_reduction_ = 0;
  for (auto& unit : units_) {
    unit.arrived = 0;
    unit.ready = false;
  }
  // Runs on the autograd engine when this backward has finished (Note [Sharded units]).
  torch::autograd::Engine::get_default_engine().queue_callback([this] { finalize(); });
}

void FullyShardedState::write_gradient(Unit& target, size_t i) {
  UnitBuffers& buffers = *target.buffers;
  at::Tensor& grad = target.compute_params[i].mutable_grad();
  if (!target.input.defined() && grad.defined() && buffers.can_reduce_in_place(grad)) {
    // Note [Gradients of a unit]: the gradient is the input, scaled in place.
    buffers.scale_into(grad, i, grad, scale_);
    target.input = std::move(grad);
    grad = at::Tensor();
    target.written.assign(1, true);
    ++reduced_in_place_;
    return;
  }
  if (!target.input.defined()) {
    target.input = buffers.new_reduction_input();
    target.written.assign(buffers.parameters(), false);
  }
  if (grad.defined()) {
    buffers.scale_into(target.input, i, grad, scale_);
    grad = at::Tensor();
  } else {
    buffers.zero_into(target.input, i);
  }
  target.written[i] = true;
}

void FullyShardedState::pre_backward(int64_t u) {
  std::lock_guard<std::mutex> lock(mutex_);
  unit(u);  // checks the index
  if (!in_backward_) start_backward();
  const size_t index = static_cast<size_t>(u);
  wait_gathered(index);
  prefetch_after(index, backward_order_);
}

void FullyShardedState::mark_ready(size_t u, size_t i) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!in_backward_) start_backward();
  Unit& target = units_[u];
  if (syncing_) write_gradient(target, i);
  if (++target.arrived < target.trainable) return;
  // Every gradient of the unit is in: nothing needs its gathered parameters any more.
  if (!target.keep) release(u);
  if (!syncing_) return;
  target.ready = true;
  launch_ready_reductions();
}

void FullyShardedState::launch_ready_reductions() {
  while (next_reduction_ < reduction_order_.size() && units_[reduction_order_[next_reduction_]].ready) {
    launch_reduction(reduction_order_[next_reduction_++]);
  }
}

void FullyShardedState::launch_reduction(size_t u) {
  Unit& target = units_[u];
  UnitBuffers& buffers = *target.buffers;
  // Parameters whose gradient did not arrive: what no_sync() accumulated, else zeros.
  for (size_t i = 0; i < buffers.parameters(); ++i) {
    if (target.written.empty() || !target.written[i]) write_gradient(target, i);
  }
  const at::Tensor input = std::move(target.input);
  target.written.clear();
  const comm::WireFormat wire = wire_;
  ++reductions_;
  if (buffers.sharded()) {
    at::Tensor output = buffers.new_reduced();
    target.reduced = output;
    target.reduce_work = engine_->submit(c10::kCPU, comm::TransportKind::kAuto, "reduce_scatter",
                                         [input, output, wire](comm::Communicator& comm) mutable {
                                           comm.set_wire_format(wire);
                                           comm::reduce_scatter_tensor_(output, input, comm::ReduceOp::kSum,
                                                                        comm::Algorithm::kAuto, comm);
                                         });
  } else {
    at::Tensor flat = input;
    target.reduced = input;
    target.reduce_work = engine_->submit(c10::kCPU, comm::TransportKind::kAuto, "all_reduce",
                                         [flat, wire](comm::Communicator& comm) mutable {
                                           comm.set_wire_format(wire);
                                           comm::all_reduce_(flat, comm::ReduceOp::kSum, comm::Algorithm::kAuto, comm);
                                         });
  }
}

void FullyShardedState::finalize() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!in_backward_) return;
  in_backward_ = false;  // even if waiting fails below: the next backward starts afresh
  finish_backward();
}

void FullyShardedState::finish_backward() {
  std::exception_ptr failure;
  if (syncing_) {
    try {
      for (size_t u : reduction_order_) units_[u].ready = true;
      launch_ready_reductions();
    } catch (...) {
      failure = std::current_exception();
    }
    // Every reduction launched is waited for, then the first failure raises.
    for (size_t u : reduction_order_) {
      Unit& target = units_[u];
      auto work = std::move(target.reduce_work);
      at::Tensor reduced = std::move(target.reduced);
      if (!work) continue;
      try {
        work->wait();
      } catch (const std::exception& e) {
        // A plain runtime_error: the autograd engine rethrows it to Python with its message alone.
        if (!failure) {
          failure = std::make_exception_ptr(std::runtime_error(
              c10::str(kWho, ": the gradient reduction of unit ", u,
                       " failed (every rank must run the same units in the same order): ", e.what())));
        }
        continue;
      }
      const std::vector<at::Tensor> views = target.buffers->gradient_views(reduced);
      for (size_t i = 0; i < views.size(); ++i) {
        at::Tensor& master = target.masters[i];
        if (!target.compute_params[i].requires_grad()) continue;
        at::Tensor& grad = master.mutable_grad();
        if (!grad.defined()) {
          grad = views[i];
        } else {
          grad.add_(views[i]);
        }
      }
    }
    ++synced_backwards_;
  }
  try {
    release_all();
  } catch (...) {
    if (!failure) failure = std::current_exception();
  }
  if (failure) std::rethrow_exception(failure);
}

void FullyShardedState::abandon_backward() {
  // Note [A backward that raised] (ddp/reducer.h): its reductions still write into buffers; wait for
  // them and drop what they computed.
  std::string errors;
  for (auto& target : units_) {
    auto work = std::move(target.reduce_work);
    target.reduced = at::Tensor();
    target.input = at::Tensor();
    target.written.clear();
    for (auto& param : target.compute_params) {
      if (param.requires_grad()) param.mutable_grad() = at::Tensor();
    }
    if (!work) continue;
    try {
      work->wait();
    } catch (const std::exception& e) {
      errors += c10::str("; a reduction failed: ", e.what());
    }
  }
  in_backward_ = false;
  TORCH_WARN(kWho,
             ": the previous backward raised before its gradients were reduced: this step's gradients are lost "
             "(the parameters' gradients hold what earlier steps left); zero them before the next optimizer step",
             errors);
}

void FullyShardedState::set_sync(bool enabled) {
  std::lock_guard<std::mutex> lock(mutex_);
  sync_enabled_ = enabled;
}

bool FullyShardedState::sync_enabled() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return sync_enabled_;
}

c10::Dict<std::string, int64_t> FullyShardedState::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  c10::Dict<std::string, int64_t> out;
  out.insert("gathers", gathers_);
  out.insert("gathered_ahead", gathered_ahead_);
  out.insert("reductions", reductions_);
  out.insert("synced_backwards", synced_backwards_);
  out.insert("peak_gathered_units", peak_gathered_);
  out.insert("cached_bytes", cache_->cached_bytes());
  out.insert("reduced_in_place", reduced_in_place_);
  return out;
}

}  // namespace ddpkit::fsdp
