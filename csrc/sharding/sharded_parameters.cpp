#include "sharding/sharded_parameters.h"

#include "comm/collectives/collectives.h"
#include "ddp/bucket_assignment.h"
#include "sharding/shard_layout.h"

#include <unordered_set>

namespace ddpkit::sharding {

ShardedParameters::ShardedParameters(std::vector<at::Tensor> params, std::vector<int64_t> bucket_of_param,
                                     std::string group_name)
    : params_(std::move(params)) {
  TORCH_CHECK(params_.size() == bucket_of_param.size(), "ShardedParameters: one bucket index per parameter expected");
  engine_ = comm::Engine::of(group_name);
  world_size_ = engine_->size();
  rank_ = engine_->rank();
  std::unordered_set<const void*> seen;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (bucket_of_param[i] < 0) continue;
    TORCH_CHECK(seen.insert(params_[i].unsafeGetTensorImpl()).second, "ShardedParameters: parameter ", i,
                " is given twice");
  }
  slots_ = ddp::bucket_slots(bucket_of_param);
  buckets_.resize(slots_.size());
  at::NoGradGuard no_grad;
  for (size_t b = 0; b < slots_.size(); ++b) {
    const at::Tensor& first = params_[slots_[b].front()];
    Bucket& bucket = buckets_[b];
    for (size_t i : slots_[b]) {
      TORCH_CHECK(params_[i].scalar_type() == first.scalar_type() && params_[i].device() == first.device(),
                  "ShardedParameters: bucket ", b, " mixes dtypes or devices");
      bucket.numel += params_[i].numel();
    }
    bucket.flat = at::zeros({world_size_ * shard_size(bucket.numel, world_size_)}, first.options());
    int64_t offset = 0;
    for (size_t i : slots_[b]) {
      at::Tensor& param = params_[i];
      at::Tensor region = bucket.flat.narrow(0, offset, param.numel());
      region.copy_(param.detach().reshape({-1}));
      param.set_data(region.view(param.sizes()));
      offset += param.numel();
    }
  }
}

ShardedParameters::~ShardedParameters() {
  // An all-gather still queued writes into the buffers it holds itself; waiting keeps the engine's
  // order simple for whoever comes next (its error, if any, is dropped with this object).
  for (auto& bucket : buckets_) {
    if (!bucket.work) continue;
    try {
      bucket.work->wait();
    } catch (const std::exception&) {
    }
  }
}

std::vector<at::Tensor> ShardedParameters::buffers() const {
  std::vector<at::Tensor> out;
  for (const auto& bucket : buckets_) out.push_back(bucket.flat);
  return out;
}

std::vector<at::Tensor> ShardedParameters::shards() const {
  std::vector<at::Tensor> out;
  for (const auto& bucket : buckets_) {
    const int64_t size = shard_size(bucket.numel, world_size_);
    out.push_back(bucket.flat.narrow(0, rank_ * size, size));
  }
  return out;
}

std::vector<int64_t> ShardedParameters::pieces() const {
  std::vector<int64_t> out;
  for (size_t b = 0; b < slots_.size(); ++b) {
    std::vector<int64_t> numels;
    for (size_t i : slots_[b]) numels.push_back(params_[i].numel());
    for (const ShardPiece& piece : shard_pieces(numels, world_size_, rank_)) {
      out.insert(out.end(), {static_cast<int64_t>(b), static_cast<int64_t>(slots_[b][piece.param]), piece.param_offset,
                             piece.length, piece.shard_offset});
    }
  }
  return out;
}

std::vector<int64_t> ShardedParameters::offsets() const {
  std::vector<int64_t> out(params_.size(), -1);
  for (const auto& members : slots_) {
    int64_t offset = 0;
    for (size_t i : members) {
      out[i] = offset;
      offset += params_[i].numel();
    }
  }
  return out;
}

void ShardedParameters::gather() {
  // The previous gather's all-gathers are waited out first, their errors dropped: this one gathers
  // every bucket again.
  for (auto& bucket : buckets_) {
    auto work = std::move(bucket.work);
    if (!work) continue;
    try {
      work->wait();
    } catch (const std::exception&) {
    }
  }
  failure_ = nullptr;
  for (size_t b = buckets_.size(); b-- > 0;) {
    Bucket& bucket = buckets_[b];
    if (bucket.numel == 0) continue;
    at::Tensor flat = bucket.flat;
    const int64_t size = flat.numel() / world_size_;
    at::Tensor shard = flat.narrow(0, rank_ * size, size);
    bucket.work = engine_->submit(flat.device().type(), comm::TransportKind::kAuto, "all_gather",
                                  [flat, shard](comm::Communicator& comm) mutable {
                                    comm::all_gather_into_tensor_(flat, shard, comm::Algorithm::kAuto, comm);
                                  });
  }
}

void ShardedParameters::wait(int64_t bucket) {
  TORCH_CHECK(bucket >= 0 && bucket < static_cast<int64_t>(buckets_.size()), "ShardedParameters::wait: bucket ", bucket,
              " of ", buckets_.size());
  // The engine runs the all-gathers in the order gather() queued them (the last bucket first), so
  // waiting for this one waits for those before it too; they are marked done here as well.
  for (size_t b = buckets_.size(); b-- > static_cast<size_t>(bucket);) {
    auto work = std::move(buckets_[b].work);
    if (!work) continue;
    try {
      work->wait();
    } catch (...) {
      if (!failure_) failure_ = std::current_exception();
    }
  }
  if (failure_) std::rethrow_exception(failure_);
}

void ShardedParameters::wait_all() {
  if (!buckets_.empty()) wait(0);
}

bool ShardedParameters::pending() const {
  for (const auto& bucket : buckets_) {
    if (bucket.work) return true;
  }
  return false;
}

}  // namespace ddpkit::sharding
