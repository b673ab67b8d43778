#pragma once
// The order of a group's collectives (Note [Collective engine] in engine/engine.h): numbered as they are
// issued, run one at a time, on the caller's thread or the queue's own.

#include "comm/core/transport.h"
#include "comm/engine/collective_work.h"

#include <ATen/ATen.h>
#include <c10/core/AutogradState.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

namespace ddpkit::comm {

class Communicator;

// Note [Issued, then run]
// A collective queued for the engine's thread runs there under the issuing thread's modes, as one
// run on the calling thread does: its grad and inference mode (the autograd state and the dispatch
// keys that carry them: a collective under torch.no_grad() writes into a parameter, one under
// torch.inference_mode() into inference tensors, and both raise on a thread with the defaults) and
// its checked mode (Note [Collective checks]): a rank that turns the checks off while its
// asynchronous collectives are queued still runs those as its peers, which ran them at once, did.
// Not the whole at::ThreadLocalState, as gloo's work takes: copying it cost a small asynchronous
// all-reduce a visible share of its time, and these two fields nothing visible (an interleaved loop
// of async_op=True all-reduces, the two builds alternated, decided it; bench_ddp.py times the
// asynchronous buckets it serves); and Python's dispatch and function modes belong to the issuing
// thread, whose own calls they see.

// The collectives of one group, in program order. `execute` runs one of them (the engine's: it
// picks the collective's lane and calls its body), never two at once.
class CollectiveQueue {
 public:
  using Body = std::function<void(Communicator&)>;
  using Execute =
      std::function<void(c10::DeviceType, TransportKind, std::string_view what, uint64_t sequence, const Body&)>;

  // `rank`: the group's, for the Work of queued collectives.
  CollectiveQueue(int rank, Execute execute) : rank_(rank), execute_(std::move(execute)) {}
  // Runs what is queued, then stops and joins the queue's thread (never from that thread itself: a
  // last reference dropped there detaches it).
  ~CollectiveQueue();
  CollectiveQueue(const CollectiveQueue&) = delete;
  CollectiveQueue& operator=(const CollectiveQueue&) = delete;

  // Numbers `body` as the group's next collective and runs it: on this thread when nothing of the
  // group is queued or running (no thread hand-off on the synchronous fast path), otherwise after
  // what came before it, on the queue's thread; returns when it has run (rethrowing its error).
  void run(c10::DeviceType device, TransportKind requested, std::string_view what, const Body& body);

  // Numbers `body` as the group's next collective and queues it for the queue's thread under this
  // thread's modes (Note [Issued, then run]); the returned Work completes (or fails) when it has
  // run, its future then holding `outputs`.
  c10::intrusive_ptr<CollectiveWork> submit(c10::DeviceType device, TransportKind requested, std::string_view what,
                                            Body body, c10d::OpType type, std::vector<at::Tensor> outputs);

 private:
  struct Task {
    c10::DeviceType device;
    TransportKind requested;
    std::string what;
    uint64_t sequence;
    Body body;
    c10::intrusive_ptr<CollectiveWork> work;
    // The issuing thread's modes, under which the queue's thread runs it (Note [Issued, then run]).
    c10::impl::LocalDispatchKeySet dispatch_keys;
    c10::AutogradState autograd;
    bool checked;
  };
  c10::intrusive_ptr<CollectiveWork> enqueue_locked(c10::DeviceType device, TransportKind requested,
                                                    std::string_view what, uint64_t sequence, Body body,
                                                    c10d::OpType type, std::vector<at::Tensor> outputs);
  void worker_loop();

  const int rank_;
  const Execute execute_;
  std::mutex mutex_;  // guards everything below
  std::condition_variable cv_;
  uint64_t next_sequence_ = 0;
  bool busy_ = false;  // a collective of this group is running
  std::deque<Task> queue_;
  std::thread worker_;
  bool stopping_ = false;
};

}  // namespace ddpkit::comm
