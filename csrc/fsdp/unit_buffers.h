#pragma once
// The flat buffers of one unit of ddpkit.FullyShardedDataParallel: its parameters' fp32 master values
// (this rank's shard, or the whole of them), the buffer they are gathered into for compute, and the
// arithmetic of its gradient reduction (Note [Unit buffers]).

#include "comm/core/communicator.h"
#include "fsdp/block_cache.h"
#include "sharding/shard_layout.h"

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <vector>

namespace ddpkit::fsdp {

// Note [Unit buffers]
// A unit's parameters lie back to back in one flat buffer of T elements, in the order given, as Note
// [Shard layout] lays out any flat buffer that ranks shard: padded to N·S elements (S = ceil(T / N)),
// rank r owning elements [r·S, min((r+1)·S, T)). Three buffers hold it:
//  - the master, in the parameters' own dtype: this rank's S elements when the unit is sharded, all T
//    when it is replicated (the small parameters every rank keeps whole: Note [Persistent parameters]
//    in fully_sharded.h). The optimizer steps views of it (master_views): for a sharded unit a 1-D
//    piece of each parameter (possibly empty), for a replicated one the parameter's own shape;
//  - the compute buffer, N·S elements (T replicated) in the compute dtype, which a gather fills: an
//    all-gather of the ranks' shards, cast first to the compute dtype on each rank so that the
//    all-gather carries the compute dtype's bytes; for a replicated unit, a cast of the master (or the
//    master itself when the dtypes agree: nothing to gather). Its storage is released between uses
//    and allocated again for the next gather (release_compute/allocate_compute); the views over it
//    that autograd saves (compute_views) stay the same tensors, so a graph built on them reads
//    whatever the latest gather put there;
//  - the reduction's input, N·S elements (T replicated) in the master dtype, into which each
//    parameter's gradient is written as it arrives, scaled by 1/N as DDP scales each gradient
//    (scale_into: the same bits as DDP's bucket), so that a sum over ranks (a reduce-scatter, or an
//    all-reduce for a replicated unit) gives the average (Note [Gradients of a unit] in
//    fully_sharded.h).
// Every write into the compute buffer bypasses autograd's version counters (c10's
// AutoDispatchBelowADInplaceOrView): a gather before backward refills memory that tensors saved
// during forward view, with the same values, and must not read as an in-place change of them.
class UnitBuffers {
 public:
  // `params`: the unit's parameters, one floating dtype, their values the master's (after the
  // caller made them equal on every rank). `sharded`: split over the `world_size` ranks, else whole
  // on each. `compute_dtype`: the dtype of the compute buffer (the parameters' own for none). The
  // compute buffer, gradients and reduced shards take their memory from `cache` (Note [Block cache]).
  UnitBuffers(const std::vector<at::Tensor>& params, bool sharded, int rank, int world_size,
              at::ScalarType compute_dtype, std::shared_ptr<BlockCache> cache);

  // The parameters back to back, padded to N·S elements (T replicated), in the master dtype: what
  // the caller broadcasts from rank 0 before adopt() takes this rank's part of it.
  at::Tensor packed() const { return packed_; }
  // Takes this rank's shard (or the whole) of `packed` as the master and drops packed().
  void adopt();

  bool sharded() const { return sharded_; }
  int64_t total() const { return total_; }       // T
  int64_t shard_size() const { return shard_; }  // S (T when replicated)
  const at::Tensor& master() const { return master_; }
  at::ScalarType compute_dtype() const { return compute_dtype_; }
  // Per parameter, a view of the master: a 1-D piece of this rank's shard (0 elements where the
  // parameter has none here), or the parameter's shape when replicated.
  std::vector<at::Tensor> master_views() const;
  // Per parameter, a view of the compute buffer in the parameter's shape.
  const std::vector<at::Tensor>& compute_views() const { return compute_views_; }
  // This rank's pieces (sharded; none when replicated).
  const std::vector<sharding::ShardPiece>& pieces() const { return pieces_; }

  // Whether a gather moves data between ranks (sharded units) or only on this rank.
  bool gathers_across_ranks() const { return sharded_ && world_size_ > 1; }
  // Whether the compute buffer is the master itself (replicated, same dtype): never released.
  bool compute_is_master() const { return !sharded_ && compute_dtype_ == master_.scalar_type(); }
  bool compute_allocated() const;
  void allocate_compute();
  void release_compute();
  // The part of a gather on this rank: the cast of the master into its place in the compute buffer.
  void fill_compute_locally();
  // The all-gather of the ranks' shards into the compute buffer (sharded units; the calling rank's
  // part filled first by fill_compute_locally).
  void all_gather(comm::Communicator& comm);

  // A buffer of the compute buffer's size in the master dtype, for the reduction's input: each
  // parameter's region is written by scale_into or zero_into, the padding is zero.
  at::Tensor new_reduction_input() const;
  // Parameter i's region of `input` <- (gradient + 0) * scale, in the master dtype, in one pass: what
  // DDP's bucket holds for it (the gradient accumulated into a zeroed slot, then multiplied in place
  // by 1/N as a float64 scalar tensor; the + 0 is that accumulation's, which turns -0 into +0).
  // `gradient`: the compute parameter's, any floating dtype, its shape.
  void scale_into(const at::Tensor& input, size_t i, const at::Tensor& gradient, double scale) const;
  // Whether `gradient`, the compute gradient autograd handed over for the unit's only parameter, can
  // be the reduction's input itself, scaled in place (Note [Gradients of a unit] in fully_sharded.h):
  // the unit has one parameter and no padding, the gradient is in the master dtype, contiguous, and
  // no one else holds it (autograd's post-hook inputs are the one other reference that torch's
  // AccumulateGrad expects when it hands a gradient over). A .grad is its parameter's to change in
  // place, as torch's clip_grad_norm_ and GradScaler.unscale_ scale it.
  bool can_reduce_in_place(const at::Tensor& gradient) const;
  void zero_into(const at::Tensor& input, size_t i) const;
  // Per parameter, its view of `flat` (a buffer of the compute buffer's size) in its shape.
  std::vector<at::Tensor> shaped_views(const at::Tensor& flat) const;
  size_t parameters() const { return numels_.size(); }
  // A buffer for this rank's reduced shard (sharded units; replicated ones reduce in place).
  at::Tensor new_reduced() const;
  // Per parameter, the view of `reduced` (new_reduced's, or the reduction input of a replicated
  // unit) that its master view's gradient is: same shape as master_views()[i].
  std::vector<at::Tensor> gradient_views(const at::Tensor& reduced) const;

 private:
  const bool sharded_;
  const int rank_;
  const int world_size_;
  const at::ScalarType compute_dtype_;
  const std::shared_ptr<BlockCache> cache_;
  std::vector<int64_t> numels_;
  std::vector<std::vector<int64_t>> shapes_;
  std::vector<int64_t> offsets_;  // each parameter's first element in the flat buffer
  int64_t total_ = 0;
  int64_t shard_ = 0;
  int64_t compute_bytes_ = 0;
  std::vector<sharding::ShardPiece> pieces_;
  at::Tensor packed_;
  at::Tensor master_;
  at::Tensor compute_;
  std::vector<at::Tensor> compute_views_;
};

}  // namespace ddpkit::fsdp
