#pragma once
// The parameters of ZeRO-1/2 (ddpkit.ShardedOptimizer) in flat padded buffers, one per bucket, whose
// shards the ranks update and then all-gather (Note [Sharded parameters]).

#include "comm/engine/collective_work.h"
#include "comm/engine/engine.h"

#include <ATen/ATen.h>
#include <torch/custom_class.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace ddpkit::sharding {

// Note [Sharded parameters]
// ShardedParameters moves the parameters of each bucket into one flat buffer laid out as Note [Shard
// layout] says (the parameters back to back in the bucket's slot order, padded to N·S elements) and
// points each parameter's data at its region of it. The buckets are those of the DDP reducer
// (Note [Bucket assignment], slot order by bucket_slots()), so this rank's shard of a parameter bucket
// and the reducer's gradient shard of the same bucket (Note [Sharded gradients] in ddp/reducer.h) hold
// the same elements: the optimizer steps the one with the other, and one all-gather per bucket, in
// place (this rank's shard is its block of the buffer), brings every rank the whole buffer again, with
// no copy in or out of the parameters.
// gather() queues those all-gathers on the group's engine in the order a forward needs them (the last
// bucket holds the first parameters) and returns at once, so they travel while the caller goes on (into
// the next forward: Note [Gathering during the forward] in python/ddpkit/sharded_optimizer.py); wait(b)
// returns once bucket b's has arrived (and every bucket queued before it: the engine runs them in order),
// wait_all() once all have. A failed all-gather raises in the wait that meets it, and every later wait
// raises it again until the next gather(), which gathers every bucket anew (the shards are intact), so
// no parameter is read half gathered. Buckets of 0 elements are skipped on every rank alike.
class ShardedParameters : public torch::CustomClassHolder {
 public:
  // `params` and `bucket_of_param` as the reducer takes them (-1: left out, kept as they are); the
  // parameters must be distinct, contiguous or not (their data becomes contiguous). `group_name`: the
  // registered group whose ranks share the buffers and whose engine runs the all-gathers.
  ShardedParameters(std::vector<at::Tensor> params, std::vector<int64_t> bucket_of_param, std::string group_name);
  ~ShardedParameters() override;

  ShardedParameters(const ShardedParameters&) = delete;
  ShardedParameters& operator=(const ShardedParameters&) = delete;

  // Each bucket's padded flat buffer (N·S elements), in bucket order.
  std::vector<at::Tensor> buffers() const;
  // This rank's shard of each bucket: its block of S elements of the buffer (padding included).
  std::vector<at::Tensor> shards() const;
  // This rank's pieces (Note [Shard layout]), five integers each: bucket, parameter index (into
  // `params`), the piece's first element in the flattened parameter, its length, its first element in
  // the bucket's shard; in bucket order, then buffer order.
  std::vector<int64_t> pieces() const;
  // Each parameter's first element in its bucket's buffer (-1 for one left out), in `params` order.
  std::vector<int64_t> offsets() const;

  // Queues one all-gather per bucket, last bucket first (Note [Sharded parameters]), after waiting out
  // the previous gather()'s.
  void gather();
  // Blocks until bucket `bucket`'s all-gather of the latest gather() (and those queued before it) has
  // arrived; a no-op when none is pending.
  void wait(int64_t bucket);
  void wait_all();
  // Whether an all-gather of the latest gather() may still be running.
  bool pending() const;

  int64_t world_size() const { return world_size_; }
  int64_t rank() const { return rank_; }

 private:
  struct Bucket {
    at::Tensor flat;                                // N·S elements: the parameters, then zeros
    int64_t numel = 0;                              // T: the parameters' elements
    c10::intrusive_ptr<comm::CollectiveWork> work;  // its all-gather, until waited for
  };

  std::vector<at::Tensor> params_;
  std::vector<std::vector<size_t>> slots_;  // each bucket's parameters, in buffer order
  std::vector<Bucket> buckets_;
  std::shared_ptr<comm::Engine> engine_;
  int64_t world_size_ = 1;
  int64_t rank_ = 0;
  std::exception_ptr failure_;  // the latest gather()'s first failure, raised by every later wait
};

}  // namespace ddpkit::sharding
