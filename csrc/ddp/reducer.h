#pragma once
// The gradient reducer behind ddpkit.DistributedDataParallel.

#include "comm/collectives/collectives.h"
#include "comm/engine/engine.h"

#include <ATen/ATen.h>
#include <torch/custom_class.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/distributed/c10d/comm.hpp>

namespace ddpkit::ddp {

// How gradients are averaged (all modes give the same gradients; they differ in when and how).
enum class SyncMode {
  kBucketed,      // flat buckets launched during backward as they fill (Note [Overlap])
  kPerParameter,  // one all-reduce per gradient after backward, not overlapped
  kGatherScatter  // per gradient, rank 0 gathers, averages and sends back (a parameter server)
};

// The names Python passes as `grad_sync` ("bucketed", "per_parameter", "gather_scatter"), in the
// enum's order; ddpkit.ddp.GRAD_SYNC_MODES reads this list (op ddpkit::grad_sync_modes).
std::vector<std::string> grad_sync_modes();

// What a synchronised backward leaves of the averaged gradients (Note [Sharded gradients]).
enum class Sharding {
  kNone,       // every averaged gradient, in param.grad, on every rank (all-reduced): DDP
  kOptimizer,  // ZeRO-1: this rank's shard of each bucket, in place in the full, persistent bucket
  kGradients   // ZeRO-2: this rank's shard of each bucket only; the buckets are transfer buffers
};

// The names Python passes as `shard` ("none", "optimizer", "gradients"), in the enum's order;
// ddpkit.ddp.GRADIENT_SHARDING reads this list (op ddpkit::gradient_sharding_modes).
std::vector<std::string> gradient_sharding_modes();

// Note [Overlap]
// A post hook on each parameter's AccumulateGrad node runs right after the parameter's gradient
// has been accumulated. In kBucketed mode it copies the gradient, scaled by 1/world_size, into
// the parameter's slot of its bucket; when the last slot of a bucket is filled, that bucket and any
// following ones already full are launched asynchronously, strictly in bucket order, so that all
// ranks issue the same collectives in the same order even when gradients arrive in another order.
// Launched buckets travel while backward computes the rest. The first hook of a backward queues a
// callback on the autograd engine; it runs when backward has finished, launches what is left, waits
// for every bucket and leaves the averaged gradients in param.grad, so loss.backward() returns
// with synchronised gradients.

// Note [Unused parameters]
// A parameter that got no gradient in this backward never fires its hook. At the end of backward
// its slot is filled with what it has locally (zeros when its gradient is None; the sum of earlier
// no_sync() micro-batches when it was used only in those), scaled like any other, and its bucket
// launched, so nothing waits for it and no accumulated gradient is lost. A parameter no rank used
// ends with a zero gradient (torch DDP would leave it None). A parameter used on some ranks only
// holds its bucket back on the others until the end of backward, so other collectives the model
// issues on the same group during backward (ddpkit.SyncBatchNorm's) come in another order there: the
// collective checks report that as a mismatch on every rank (torch's DDP with
// find_unused_parameters=True marks such parameters ready at the first hook instead).

// Note [Frozen after wrapping]
// A parameter whose requires_grad is switched off after the reducer was built keeps its slot, so
// that every rank still issues the same collectives, but contributes zeros, and its gradient is left
// as it is (None after zero_grad(set_to_none=True)), so that an optimizer's weight decay or momentum
// does not move it, as with torch's DDP with find_unused_parameters=True. Switched on again, it is
// synchronised again.

// Note [A backward that raised]
// A backward that raised after the reducer's first hook (an error in the model's backward, out of
// memory) never runs the callback that finishes the synchronisation. The next training forward
// (prepare_for_forward) notices: it waits for the buckets already launched, whose all-reduces (or
// communication hooks' futures) write into memory the next backward refills, starts afresh and
// warns that the abandoned step's
// gradients were never averaged; without it the next backward would queue no callback and return
// gradients that were never synchronised. torch's DDP raises there instead ("Expected to have
// finished reduction in the prior iteration").

// Note [Gradient as bucket view]
// With gradient_as_bucket_view, param.grad is made a view of its bucket slot once the gradient has
// been copied there, so later backwards accumulate straight into the bucket and no second
// gradient-sized buffer exists. After optimizer.zero_grad(set_to_none=True) the next backward
// creates a fresh gradient, which the hook copies into the slot and replaces by the view again.
// Without it, the averaged bucket is copied back into param.grad at the end of backward.
// prepare_for_forward() goes one step further: before a training forward it points every gradient
// that is None (after zero_grad(set_to_none=True)) at its zeroed slot, so that even accumulation
// micro-batches under no_sync() accumulate into the buckets and no fresh gradient is allocated.

// Note [Communication thread]
// ddpkit's all-reduces are synchronous calls; the reducer hands each bucket to its group's Engine
// (Note [Collective engine]), whose one thread runs them in launch order while backward goes on.
// The engine numbers each bucket's collective on the autograd thread at launch (Note [Tags]), so
// that collectives issued meanwhile by other code on the same group (SyncBatchNorm's backward) keep
// the same order on every rank, and runs every collective of the group one after the other, so the
// two never interleave on a transport.

// Note [Communication hooks]
// register_comm_hook() replaces each bucket's all-reduce by a hook, as torch's reducer keeps its
// comm_hook_: everything else stays this reducer's, so a hooked DDP has the same bucket layout,
// launch order and rules for unused, frozen and accumulated parameters and for a backward that
// raised as the native one. Where launch() would queue a bucket's all-reduce it calls
// hook->runHook() with a c10d::GradBucket over the bucket (torch's own class, so torch's hooks run
// unchanged: buffer(), index(), is_last(), parameters(), gradients(), set_buffer()), on the autograd
// thread, under the reducer's lock, once per bucket and iteration. The future it returns is waited
// for where the all-reduce's Work would be (finish_bucketed); its value, any tensor of the bucket's
// numel (another dtype too: fp16_compress_wrapper's hook returns its float16 buffer), is copied into
// the bucket unless it is the bucket itself, then into the gradients as without a hook. As with
// torch's reducer, gradients enter the bucket unscaled: the hook averages (torch's hooks divide by
// the group's size). A future that failed fails backward once every bucket's future has settled,
// so that no hook's callback still writes into a bucket the next backward refills. The hook never
// calls back into this reducer (its lock is held).

// Note [Sharded gradients]
// With a ddpkit.ShardedOptimizer (ZeRO-1 and -2; the coupling is Note [Sharded optimizer and reducer]
// in python/ddpkit/sharded_optimizer.py) each bucket is laid out as Note [Shard layout] says (padded
// to N·S elements, the padding zero) and reduce-scattered instead of all-reduced: the same gradients
// enter it, scaled by 1/N as without sharding, and each rank receives the sum of its own shard only,
// its gradient shard (gradient_shards()[b]), with which the optimizer steps the same elements of the
// parameters (Note [Sharded parameters] in sharding/sharded_parameters.h). A reduce-scatter sends
// half of what an all-reduce sends and the parameters' all-gather after the step the other half, so a
// step sends what DDP's does. The reduce-scatter sums every element in the order the all-reduce does
// (Note [Reductions]), so a shard holds DDP's bits (tests/test_sharded_optimizer.py).
//  - kOptimizer (ZeRO-1): the buckets stay as without sharding, full-size and kept (with
//    gradient_as_bucket_view param.grad views them and no_sync() accumulates there); the
//    reduce-scatter writes this rank's block of the bucket in place: that block is its gradient shard.
//  - kGradients (ZeRO-2): a bucket is only a transfer buffer, taken from a pool when its first gradient
//    arrives and given back once its reduce-scatter has finished, and the hook drops each gradient
//    once it is in the bucket, so a rank keeps only its gradient shards (buffers of their own) from
//    one step to the next: 4/N bytes per float32 parameter, plus the pool (as many buckets as are in
//    flight at once). Under no_sync() gradients accumulate in param.grad, as autograd leaves them.
// Either way, after a synchronised backward param.grad is None for every parameter the reducer
// synchronises (a frozen one's is left alone, Note [Frozen after wrapping]): the averaged gradient
// exists only as shards, each on its owner. Unused parameters, frozen ones and a backward that raised
// keep their rules. A communication hook replaces an all-reduce by another reduction of the whole
// bucket, which a reduce-scatter is not: the two are refused together, as are grad_sync modes
// other than "bucketed".

class Reducer : public torch::CustomClassHolder {
 public:
  // `params`: the parameters in registration order (shared parameters once); `bucket_of_param[i]`
  // is param i's bucket from assign_buckets() or -1 for a parameter left out (frozen). Buckets of one
  // index must hold parameters of one dtype and device. `group_name`: the registered group whose
  // engine runs the all-reduces; none for a reducer whose buckets only a communication hook will
  // reduce (register_comm_hook before the first synchronised backward). `algorithm`: an all-reduce
  // algorithm name of collectives/collectives.h ("process_group" = the group's own); with `shard` other
  // than "none", one that also reduce-scatters (Note [All-gather and reduce-scatter]). `mode`: "bucketed" |
  // "per_parameter" | "gather_scatter". `shard`: "none" | "optimizer" | "gradients" (Note [Sharded
  // gradients]; needs a group and "bucketed"). Registers one post hook per included parameter; the
  // destructor removes them.
  Reducer(std::vector<at::Tensor> params, std::vector<int64_t> bucket_of_param, std::optional<std::string> group_name,
          std::string algorithm, std::string mode, bool gradient_as_bucket_view, std::string shard);
  ~Reducer() override;

  Reducer(const Reducer&) = delete;
  Reducer& operator=(const Reducer&) = delete;

  // Called before a training forward: finishes off a backward that raised (Note [A backward that
  // raised]), then Note [Gradient as bucket view].
  void prepare_for_forward();

  // Replaces each bucket's all-reduce by `hook` (Note [Communication hooks]). Once, in kBucketed
  // mode, outside backward.
  void register_comm_hook(std::unique_ptr<c10d::CommHookInterface> hook);

  // no_sync(): while disabled, hooks return at once and gradients just accumulate in param.grad.
  void set_sync(bool enabled);
  bool sync_enabled() const;

  // Finishes the current synchronisation if one is under way (it normally finishes inside
  // backward); a no-op otherwise. Blocks until every bucket has arrived.
  void finalize();

  // The flat bucket tensors, in launch order (for tests and memory accounting); with kGradients
  // those that hold a transfer buffer now (none outside backward).
  std::vector<at::Tensor> buckets() const;

  // With sharding: this rank's gradient shard of each bucket (S elements, Note [Sharded gradients]),
  // in bucket order; the same tensors for the reducer's life. Empty without.
  std::vector<at::Tensor> gradient_shards() const;

  // Counters since construction: "synced_backwards", "collectives" (gradient all-reduces issued, or
  // communication hook calls),
  // "launched_during_backward" (buckets launched before backward ended), "buckets", "wait_us" (time
  // the end of backward spent waiting for communication, i.e. the part not overlapped) and
  // "last_wait_us" (the same for the latest synchronised backward), "transfer_buffers" and
  // "transfer_bytes" (kGradients: the pool's buffers and their bytes, Note [Sharded gradients]).
  c10::Dict<std::string, int64_t> stats() const;

 private:
  struct Bucket {
    // One dtype and device; numel = sum of its parameters' numels, padded to N·S with sharding
    // (kGradients: a region of a transfer buffer while it holds one, else undefined).
    at::Tensor flat;
    int64_t numel = 0;                    // the parameters' elements (T)
    at::Tensor transfer;                  // kGradients: the pool's buffer `flat` lies in, while held
    at::Tensor grad_shard;                // with sharding: this rank's S elements of the reduced bucket
    std::vector<size_t> params;           // indices into params_, in slot order
    std::vector<size_t> offsets;          // each slot's first element in `flat` (c10d::GradBucket's)
    std::vector<size_t> lengths;          // each slot's numel
    size_t pending = 0;                   // slots still waiting for a gradient this iteration
    c10::intrusive_ptr<c10d::Work> work;  // its all-reduce on the group's engine, until waited on
    // With a communication hook instead of `work`: the future it returned for the bucket, until waited on.
    c10::intrusive_ptr<c10::ivalue::Future> hook_result;
  };
  struct Slot {
    bool included = false;  // synchronised by this reducer (requires grad, not left out)
    int64_t bucket = -1;    // kBucketed: its bucket
    at::Tensor view;        // kBucketed: its region of the bucket, shaped like the parameter
    bool ready = false;     // kBucketed: filled this iteration
  };

  void build_buckets(const std::vector<int64_t>& bucket_of_param);
  void lay_out_slots(size_t index);                // the slots' views of bucket `index`'s flat
  void take_transfer_buffer(size_t index);         // kGradients: a pool buffer for bucket `index`
  void give_back_transfer_buffer(Bucket& bucket);  // kGradients: once its reduce-scatter has finished
  void give_back_transfer_buffers();               // kGradients: every bucket's, once all have
  void mark_ready(size_t index);                   // the AccumulateGrad post hook
  void start_iteration();                          // first hook of a synchronised backward
  void copy_into_slot(size_t index);
  void launch_ready_buckets();
  void launch(size_t index);
  void wait_for_bucket(size_t index);  // its all-reduce or hook; the result in bucket.flat
  void finish_bucketed();
  void finish_per_parameter();
  void abandon_unfinished_backward();  // Note [A backward that raised]

  std::vector<at::Tensor> params_;
  std::vector<Slot> slots_;
  std::vector<Bucket> buckets_;
  // The pointer type grad_accumulator() returns (std::shared_ptr up to torch 2.11, intrusive_ptr after).
  using NodePtr = decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));
  std::vector<std::pair<NodePtr, uintptr_t>> hooks_;
  std::shared_ptr<comm::Engine> engine_;  // null without a group
  std::unique_ptr<c10d::CommHookInterface> comm_hook_;
  comm::Algorithm algorithm_;
  SyncMode mode_;
  bool gradient_as_bucket_view_;
  Sharding sharding_;
  int world_size_ = 1;
  int rank_ = 0;
  // kGradients: the free transfer buffers (bytes, each large enough for any bucket), and how many were made.
  std::vector<at::Tensor> transfer_pool_;
  int64_t transfer_bytes_ = 0;
  int64_t transfer_buffers_ = 0;
  // 1/world_size as a float64 CPU tensor: ATen multiplies a float16/bfloat16 gradient by it in
  // float32, where a scale of the gradient's own dtype, or a Scalar (mul_.Scalar rounds it to that
  // dtype), is 1/3 rounded to 0.333984 in bfloat16: every gradient 0.2% too large.
  at::Tensor scale_;

  mutable std::mutex mutex_;  // hooks of parameters on different devices run on different threads
  bool sync_enabled_ = true;
  bool in_backward_ = false;
  size_t next_launch_ = 0;

  int64_t synced_backwards_ = 0;
  int64_t collectives_ = 0;
  int64_t launched_during_backward_ = 0;
  int64_t wait_us_ = 0;
  int64_t last_wait_us_ = 0;
};

}  // namespace ddpkit::ddp
