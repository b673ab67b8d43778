#pragma once
// The native part of ddpkit.FullyShardedDataParallel (ZeRO-3): its units' buffers, when each is
// gathered and released, and its gradient reductions, on the group's collective engine.

#include "comm/engine/collective_work.h"
#include "comm/engine/engine.h"
#include "comm/core/wire_format.h"
#include "fsdp/block_cache.h"
#include "fsdp/unit_buffers.h"

#include <ATen/ATen.h>
#include <torch/custom_class.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <torch/csrc/autograd/variable.h>

namespace ddpkit::fsdp {

// Note [Sharded units]
// ddpkit.FullyShardedDataParallel (python/ddpkit/fsdp.py) splits a model into units, by default each
// module that holds a parameter of its own above the persistence threshold, and gives each unit one
// UnitBuffers (Note [Unit buffers]). Each parameter then has two tensors: its master view, which
// python's side makes the module's registered parameter between forwards (the original Parameter
// object, whose data is now the view: what parameters() and the optimizer see), and its compute
// parameter, a leaf viewing the compute buffer, which python's side registers on the module for the
// unit's forward only. Python calls pre_forward/post_forward around each unit's forward and
// pre_backward (from an autograd node on the unit's outputs) before its backward; this class decides
// what is gathered, when, and when it is released:
//  - forward: pre_forward(u) waits for u's gather (queued ahead, or now), then queues the next unit's
//    gather on the group's engine, which runs it while u computes (Note [Gathering ahead]);
//    post_forward(u) releases u's compute buffer, except where a graph is being built and u is the
//    last unit of the forward (its backward comes first) or is kept for the whole step (the root);
//  - backward: pre_backward(u) gathers u again (waiting for the gather queued ahead, if any), points
//    its compute parameters' gradients into a fresh gradient buffer and queues the gather of the unit
//    whose backward comes next; when u's last gradient has arrived, u's compute buffer is released and
//    its reduction queued (Note [Gradients of a unit]);
//  - the end of backward (a callback queued on the autograd engine) reduces what is left, waits for
//    every reduction, gives the master views their gradients and releases every compute buffer.
// Collectives are queued in program order on the group's engine, whose one thread runs them in that
// order, so every rank issues the same sequence as long as every rank runs the same forward (the
// units in the same order), as torch's FSDP assumes too; a rank that runs another sequence is
// reported by the collective checks where the sizes differ.
//
// Note [Gathering ahead]
// The unit gathered ahead is the one that follows in the order the previous forward ran its units
// (registration order before the first), and in backward the one that precedes in the order this
// forward ran them. At most two units are gathered at a time in either pass, plus the kept ones.
//
// Note [Gradients of a unit]
// Autograd leaves each compute parameter's gradient in its .grad (a new tensor it hands over, or the
// sum with what earlier backwards left there), and a post hook on its AccumulateGrad node counts it in
// (as the DDP reducer's, Note [Overlap]) and writes it at once into the unit's reduction input, scaled
// (UnitBuffers::scale_into: one pass, the bits DDP's bucket holds), dropping the compute gradient.
// DDP accumulates into a zeroed bucket and then scales it in place, three passes over the gradient;
// here the gradient is read once. A unit of one parameter whose gradient fills its input exactly (no
// padding, the master dtype, held by nothing else: UnitBuffers::can_reduce_in_place; each layer's
// weight under the default policy in float32) is not copied at all: the gradient is scaled in place
// and is the input, so a backward holds no input buffer beside autograd's gradient and caches none
// between steps, which lowers ZeRO-3's peak memory by a unit's gradient (bench_sharding.py's peak
// RSS; the bits are scale_into's). When a unit's last trainable parameter has arrived, its compute
// buffer is released and its reduction is ready: a reduce-scatter of the input into a shard-sized
// buffer (a sum: the average), or an all-reduce in place for the replicated unit. Reductions are
// queued strictly in one order: the reverse of the order the forward ran the units, then units the
// forward did not run, then the replicated unit; a unit ready early waits for those before it. A
// parameter whose gradient never arrived (unused, frozen) contributes zeros at the end of backward,
// so that every rank issues every reduction and an unused parameter ends with a zero gradient, as
// with DDP. The end of backward then sets each master view's gradient to its view of the reduced
// buffer, or adds to the gradient it already has (accumulation across synchronised backwards, as
// torch's FSDP adds its reduced shards). Inside no_sync() nothing is written or reduced: autograd
// accumulates into the compute parameters' gradients (a unit's whole gradient, as torch's FSDP keeps
// it), and the first synchronised backward writes and reduces the sum, as DDP reduces its buckets.
//
// Note [Persistent parameters]
// Parameters of at most the persistence threshold's elements (norms, biases: DeepSpeed's
// stage3_param_persistence_threshold) are not sharded: they form one replicated unit, whole on every
// rank, its gradients all-reduced (reduction order above). Gathering a few KB costs a collective's
// latency each, which is most of it; keeping them costs 16 bytes per parameter on every rank.
class FullyShardedState : public torch::CustomClassHolder {
 public:
  // `group_name`: the registered group whose ranks shard the units and whose engine runs the
  // collectives. `compute_dtype`: the dtype of the compute buffers (none: each unit's own).
  // `wire`: how reductions cross hosts (a name of kWireFormatNames, Note [Compressed crossing]).
  FullyShardedState(std::string group_name, std::optional<at::ScalarType> compute_dtype, std::string wire);
  ~FullyShardedState() override;

  FullyShardedState(const FullyShardedState&) = delete;
  FullyShardedState& operator=(const FullyShardedState&) = delete;

  // A new unit over `params` (Note [Unit buffers]), made equal on every rank from rank 0's values (a
  // broadcast: every rank adds the same units in the same order); returns its index. `sharded`: false
  // for the replicated unit (at most one). `keep`: stays gathered from its forward to the end of
  // backward (the root's).
  int64_t add_unit(std::vector<at::Tensor> params, bool sharded, bool keep);
  // Unit `u`'s master views and compute views (UnitBuffers), to make the Python parameters from.
  std::vector<at::Tensor> master_views(int64_t u) const;
  std::vector<at::Tensor> compute_views(int64_t u) const;
  // Unit `u`'s flat master (this rank's shard, or the whole replicated unit), and [T, S].
  at::Tensor master(int64_t u) const;
  std::vector<int64_t> layout(int64_t u) const;
  // Unit `u`'s pieces on this rank (Note [Shard layout]), four integers each: parameter index,
  // first element in the flattened parameter, length, first element in the shard.
  std::vector<int64_t> pieces(int64_t u) const;
  // Takes unit `u`'s compute parameters (leaves over compute_views, requires_grad as their masters')
  // and master parameters (over master_views): hooks the trainable compute parameters' AccumulateGrad.
  void attach(int64_t u, std::vector<at::Tensor> compute_params, std::vector<at::Tensor> masters);

  // The wrapper's forward starts (`graph`: grad mode is on): finishes off a backward that raised (Note
  // [A backward that raised] in ddp/reducer.h) or releases what a forward without backward left
  // gathered, and fills the replicated unit's compute buffer.
  void begin_forward(bool graph);
  void pre_forward(int64_t u);
  void post_forward(int64_t u);
  // The wrapper's forward returns: without a graph, releases every compute buffer.
  void end_forward();
  void pre_backward(int64_t u);

  // no_sync(): while disabled, backwards accumulate gradients in the units' buffers and reduce nothing.
  void set_sync(bool enabled);
  bool sync_enabled() const;
  // Finishes the current backward's reductions if one is under way (normally done by backward).
  void finalize();

  // Counters since construction: "gathers" (all-gathers queued), "gathered_ahead" (of those, queued
  // before their unit asked), "reductions", "synced_backwards", "peak_gathered_units", "cached_bytes"
  // (Note [Block cache]), "reduced_in_place" (reductions whose input was the gradient itself: Note
  // [Gradients of a unit]).
  c10::Dict<std::string, int64_t> stats() const;

 private:
  enum class Gathered { kNo, kInFlight, kYes };
  struct Unit {
    std::unique_ptr<UnitBuffers> buffers;
    bool keep = false;
    std::vector<at::Tensor> compute_params;
    std::vector<at::Tensor> masters;
    int64_t trainable = 0;  // compute parameters that require grad
    Gathered gathered = Gathered::kNo;
    c10::intrusive_ptr<c10d::Work> gather_work;
    at::Tensor input;           // the reduction's input while it is written
    std::vector<bool> written;  // per parameter, its region of `input` is
    int64_t arrived = 0;        // trainable gradients in this backward
    bool ready = false;         // its reduction may be queued
    c10::intrusive_ptr<c10d::Work> reduce_work;
    at::Tensor reduced;  // where the reduction's result lands
  };
  using NodePtr = decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));

  Unit& unit(int64_t u);
  const Unit& unit(int64_t u) const;
  void gather(size_t u, bool ahead);  // queues u's gather unless it has one
  void wait_gathered(size_t u);       // u's compute buffer holds the gathered values on return
  void release(size_t u);             // waits out a gather in flight first
  void prefetch_after(size_t u, const std::vector<size_t>& order);
  void start_backward();
  void write_gradient(Unit& unit, size_t i);  // into the reduction input; drops the compute gradient
  void mark_ready(size_t u, size_t i);        // the AccumulateGrad post hook
  void launch_ready_reductions();
  void launch_reduction(size_t u);
  void finish_backward();
  void abandon_backward();
  void release_all();

  std::shared_ptr<comm::Engine> engine_;
  std::optional<at::ScalarType> compute_dtype_;
  comm::WireFormat wire_;
  int world_size_ = 1;
  double scale_ = 1.0;  // 1/world_size, as DDP scales gradients (Note [Gradients of a unit])
  std::shared_ptr<BlockCache> cache_ = std::make_shared<BlockCache>();
  std::vector<Unit> units_;
  std::vector<std::pair<NodePtr, uintptr_t>> hooks_;
  int64_t replicated_ = -1;

  mutable std::mutex mutex_;
  bool sync_enabled_ = true;
  bool graph_ = false;                  // the current forward builds a graph
  std::vector<size_t> forward_order_;   // units in the order this forward ran them
  std::vector<size_t> previous_order_;  // the previous graph-building forward's
  std::vector<bool> in_forward_order_;
  bool in_backward_ = false;
  bool syncing_ = false;                 // this backward reduces (sync was enabled when it started)
  std::vector<size_t> backward_order_;   // reverse of forward_order_
  std::vector<size_t> reduction_order_;  // Note [Gradients of a unit]
  size_t next_reduction_ = 0;

  int64_t gathers_ = 0;
  int64_t gathered_ahead_ = 0;
  int64_t reductions_ = 0;
  int64_t reduced_in_place_ = 0;
  int64_t synced_backwards_ = 0;
  int64_t peak_gathered_ = 0;
};

}  // namespace ddpkit::fsdp
