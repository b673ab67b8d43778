#pragma once
// The shared-memory transport: point-to-point messages through the segment's channels, and the
// direct collectives (shm/direct.h) as its capability.

#include "comm/core/transport.h"
#include "comm/shm/direct.h"
#include "comm/shm/segment.h"

#include <ATen/ATen.h>

#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace ddpkit::comm {

// Note [Shared-memory messages]
// Point-to-point messages between ranks of one host, so that every schedule of schedules/schedules.cpp runs
// unchanged over shared memory. Each ordered pair (src, dst) has a channel: a ring of fixed-size
// chunks, each tagged with the message's tag, its total size and the chunk's offset. A send copies
// its tensor into the channel chunk by chunk (eager: a send is complete when its last chunk is in
// shared memory, so its tensor is free again); a receive copies chunks out into its tensor. Progress
// is made by whichever thread waits: it pushes pending sends while the channel has room and drains
// every incoming channel into the posted receives. Sends to one peer leave in the order they were
// posted; receives match by (peer, tag).
//
// A chunk whose receive is not posted yet stays in the channel (its sender waits for room), so the
// memory a rank uses is the segment's whatever the message size. Only when a posted receive from
// the same peer waits behind such a chunk is the chunk moved to a heap buffer kept for its receive,
// so that a channel never stays blocked. The schedules of schedules/schedules.cpp post their receives round
// by round ahead of their sends (Note [Pre-posted receives]) and send to a peer in round order, so
// that case needs a peer that sends what this rank never receives (a mismatched schedule, or the
// rest of an aborted collective); comm_counters' peak_buffered_bytes shows what it ever held. No
// rank waits forever on a parked chunk: the rank furthest behind has posted the receives of its
// current round, so the chunks its peers send it are taken.
// The Transport (core/transport.h) of a group whose ranks share a host: messages through the segment's
// channels; its capability is the direct collectives.
class ShmTransport final : public Transport {
 public:
  explicit ShmTransport(std::shared_ptr<ShmSegment> segment);
  ~ShmTransport() override;
  std::string_view name() const override { return transport_name(TransportKind::kShm); }
  c10::intrusive_ptr<c10d::Work> send(const at::Tensor& tensor, int dst, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(const at::Tensor& tensor, int src, int tag) override;
  DirectCollectives* direct() override { return &direct_; }

  class Message;  // the Work of one send or receive

 private:
  friend class Message;
  // Moves every message as far as the channels allow; true if anything moved. Call with mutex_ held.
  bool progress_locked();
  // Raises (and marks the segment broken) for data from `peer`'s channel that cannot be right.
  [[noreturn]] void corrupt(int peer, const std::string& what) const;
  void wait_for_message(Message& message, std::string_view what);
  void abort_message(Message& message);

  std::shared_ptr<ShmSegment> segment_;
  ShmDirect direct_;
  std::mutex mutex_;
  std::vector<std::deque<c10::intrusive_ptr<Message>>> sends_;   // per destination, in posting order
  std::vector<std::vector<c10::intrusive_ptr<Message>>> recvs_;  // per source, posted and incomplete
  struct Unexpected {
    std::vector<char> bytes;
    int64_t total = 0;
    int64_t received = 0;
  };
  std::vector<std::map<int, Unexpected>> unexpected_;  // per source, by tag
  int64_t buffered_bytes_ = 0;                         // bytes held in unexpected_
};

}  // namespace ddpkit::comm
