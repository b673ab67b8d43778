#include "fsdp/unit_buffers.h"

#include "comm/collectives/collectives.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/LegacyTypeDispatch.h>

namespace ddpkit::fsdp {

UnitBuffers::UnitBuffers(const std::vector<at::Tensor>& params, bool sharded, int rank, int world_size,
                         at::ScalarType compute_dtype, std::shared_ptr<BlockCache> cache)
    : sharded_(sharded), rank_(rank), world_size_(world_size), compute_dtype_(compute_dtype), cache_(std::move(cache)) {
  TORCH_CHECK(!params.empty(), "UnitBuffers: a unit without parameters");
  const at::ScalarType dtype = params.front().scalar_type();
  for (const auto& p : params) {
    TORCH_CHECK(p.scalar_type() == dtype && at::isFloatingType(dtype),
                "ddpkit.FullyShardedDataParallel: a unit's parameters must share one floating dtype, got ", dtype,
                " and ", p.scalar_type());
    TORCH_CHECK(p.device().is_cpu(), "ddpkit.FullyShardedDataParallel: CPU parameters only, got one on ", p.device());
    offsets_.push_back(total_);
    numels_.push_back(p.numel());
    shapes_.push_back(p.sizes().vec());
    total_ += p.numel();
  }
  shard_ = sharded_ ? sharding::shard_size(total_, world_size_) : total_;
  if (sharded_) pieces_ = sharding::shard_pieces(numels_, world_size_, rank_);
  const int64_t padded = sharded_ ? world_size_ * shard_ : total_;
  at::AutoDispatchBelowADInplaceOrView guard;
  packed_ = at::zeros({padded}, params.front().options());
  for (size_t i = 0; i < params.size(); ++i) {
    packed_.narrow(0, offsets_[i], numels_[i]).copy_(params[i].detach().reshape({-1}));
  }
}

void UnitBuffers::adopt() {
  TORCH_INTERNAL_ASSERT(packed_.defined(), "adopt() once");
  at::AutoDispatchBelowADInplaceOrView guard;
  master_ = sharded_ ? packed_.narrow(0, rank_ * shard_, shard_).clone() : packed_;
  packed_ = at::Tensor();
  if (compute_is_master()) {
    compute_ = master_;
  } else {
    compute_ = at::empty({sharded_ ? world_size_ * shard_ : total_}, master_.options().dtype(compute_dtype_));
  }
  compute_bytes_ = compute_.numel() * static_cast<int64_t>(compute_.element_size());
  compute_views_ = shaped_views(compute_);
  release_compute();  // the views exist; their memory comes with the first gather
}

std::vector<at::Tensor> UnitBuffers::shaped_views(const at::Tensor& flat) const {
  std::vector<at::Tensor> views;
  for (size_t i = 0; i < numels_.size(); ++i) views.push_back(flat.narrow(0, offsets_[i], numels_[i]).view(shapes_[i]));
  return views;
}

std::vector<at::Tensor> UnitBuffers::master_views() const {
  if (!sharded_) return shaped_views(master_);
  std::vector<at::Tensor> views;
  views.assign(numels_.size(), master_.narrow(0, 0, 0));
  for (const auto& piece : pieces_) views[piece.param] = master_.narrow(0, piece.shard_offset, piece.length);
  return views;
}

bool UnitBuffers::compute_allocated() const { return compute_.storage().nbytes() > 0 || compute_bytes_ == 0; }

void UnitBuffers::allocate_compute() {
  if (compute_allocated()) return;
  c10::StorageImpl* storage = compute_.storage().unsafeGetStorageImpl();
  storage->set_data_ptr_noswap(cache_->allocate(compute_bytes_));
  storage->set_nbytes(compute_bytes_);
}

void UnitBuffers::release_compute() {
  if (compute_is_master()) return;
  c10::StorageImpl* storage = compute_.storage().unsafeGetStorageImpl();
  storage->set_data_ptr_noswap(at::DataPtr(nullptr, compute_.device()));
  storage->set_nbytes(0);
}

void UnitBuffers::fill_compute_locally() {
  if (compute_is_master()) return;
  TORCH_INTERNAL_ASSERT(compute_allocated(), "allocate_compute() before a gather");
  at::AutoDispatchBelowADInplaceOrView guard;
  if (sharded_) {
    // Same dtype: the all-gather reads the master itself (all_gather), nothing to copy here.
    if (compute_dtype_ != master_.scalar_type()) compute_.narrow(0, rank_ * shard_, shard_).copy_(master_);
  } else {
    compute_.copy_(master_);
  }
}

void UnitBuffers::all_gather(comm::Communicator& comm) {
  TORCH_INTERNAL_ASSERT(sharded_ && compute_allocated(), "all_gather of a sharded unit's allocated buffer");
  at::Tensor output = compute_;
  // In place (the input is this rank's block of the output) once cast; else straight from the master.
  const at::Tensor input =
      compute_dtype_ == master_.scalar_type() ? master_ : compute_.narrow(0, rank_ * shard_, shard_);
  comm::all_gather_into_tensor_(output, input, comm::Algorithm::kAuto, comm);
}

at::Tensor UnitBuffers::new_reduction_input() const {
  const int64_t padded = sharded_ ? world_size_ * shard_ : total_;
  at::Tensor input = cache_->empty(padded, master_.options());
  at::AutoDispatchBelowADInplaceOrView guard;
  input.narrow(0, total_, padded - total_).zero_();
  return input;
}

void UnitBuffers::scale_into(const at::Tensor& input, size_t i, const at::Tensor& gradient, double scale) const {
  TORCH_CHECK(gradient.numel() == numels_[i], "ddpkit.FullyShardedDataParallel: a gradient of ", gradient.numel(),
              " elements for a parameter of ", numels_[i]);
  const at::Tensor source = gradient.detach().contiguous();
  AT_DISPATCH_FLOATING_TYPES(input.scalar_type(), "scale_into", [&] {
    using Master = scalar_t;
    Master* out = input.data_ptr<Master>() + offsets_[i];
    // ATen's mul by a float64 scalar tensor multiplies by the scalar cast to the tensor's dtype.
    const Master factor = static_cast<Master>(scale);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, source.scalar_type(), "scale_into", [&] {
      const scalar_t* in = source.const_data_ptr<scalar_t>();
      at::parallel_for(0, numels_[i], at::internal::GRAIN_SIZE, [&](int64_t begin, int64_t end) {
        for (int64_t k = begin; k < end; ++k) out[k] = (static_cast<Master>(in[k]) + Master(0)) * factor;
      });
    });
  });
}

bool UnitBuffers::can_reduce_in_place(const at::Tensor& gradient) const {
  const int64_t padded = sharded_ ? world_size_ * shard_ : total_;
  return numels_.size() == 1 && padded == total_ && gradient.layout() == at::kStrided &&
         gradient.scalar_type() == master_.scalar_type() && gradient.numel() == total_ && gradient.is_contiguous() &&
         gradient.use_count() <= 2;
}

void UnitBuffers::zero_into(const at::Tensor& input, size_t i) const {
  at::AutoDispatchBelowADInplaceOrView guard;
  input.narrow(0, offsets_[i], numels_[i]).zero_();
}

at::Tensor UnitBuffers::new_reduced() const { return cache_->empty(shard_, master_.options()); }

std::vector<at::Tensor> UnitBuffers::gradient_views(const at::Tensor& reduced) const {
  if (!sharded_) return shaped_views(reduced);
  std::vector<at::Tensor> views;
  views.assign(numels_.size(), reduced.narrow(0, 0, 0));
  for (const auto& piece : pieces_) views[piece.param] = reduced.narrow(0, piece.shard_offset, piece.length);
  return views;
}

}  // namespace ddpkit::fsdp
