#include "comm/shm/channels.h"

#include "comm/core/counters.h"

#include <algorithm>
#include <cstring>

namespace ddpkit::comm {

using namespace shm_detail;

class ShmTransport::Message final : public c10d::Work {
 public:
  Message(ShmTransport* transport, bool is_send, int peer, int tag, const at::Tensor& tensor)
      : c10d::Work(-1, is_send ? c10d::OpType::SEND : c10d::OpType::RECV),
        transport_(transport),
        is_send_(is_send),
        peer_(peer),
        tag_(tag),
        tensor_(tensor),
        data_(static_cast<char*>(tensor.data_ptr())),
        total_(static_cast<int64_t>(tensor.numel() * tensor.element_size())) {}

  bool wait(std::chrono::milliseconds /*timeout*/) override {
    transport_->wait_for_message(*this, "collective");
    return true;
  }
  bool isCompleted() override {
    std::lock_guard<std::mutex> lock(transport_->mutex_);
    transport_->progress_locked();
    return done_;
  }
  bool isSuccess() const override { return done_ && error_.empty(); }
  void abort() override { transport_->abort_message(*this); }

  ShmTransport* transport_;
  const bool is_send_;
  const int peer_;
  const int tag_;
  at::Tensor tensor_;
  char* const data_;
  const int64_t total_;
  int64_t moved_ = 0;  // bytes copied into (send) or out of (receive) shared memory
  bool done_ = false;  // guarded by the transport's mutex
  std::string error_;
};

ShmTransport::ShmTransport(std::shared_ptr<ShmSegment> segment)
    : segment_(std::move(segment)),
      direct_(segment_),
      sends_(segment_->size()),
      recvs_(segment_->size()),
      unexpected_(segment_->size()) {}

ShmTransport::~ShmTransport() = default;

c10::intrusive_ptr<c10d::Work> ShmTransport::send(const at::Tensor& tensor, int dst, int tag) {
  segment_->liveness().check_usable("collective");
  TORCH_INTERNAL_ASSERT(tensor.is_contiguous() && tensor.device().is_cpu());
  TORCH_INTERNAL_ASSERT(dst >= 0 && dst < segment_->size() && dst != segment_->rank());
  auto message = c10::make_intrusive<Message>(this, true, dst, tag, tensor);
  std::lock_guard<std::mutex> lock(mutex_);
  sends_[dst].push_back(message);
  progress_locked();
  return message;
}

c10::intrusive_ptr<c10d::Work> ShmTransport::recv(const at::Tensor& tensor, int src, int tag) {
  segment_->liveness().check_usable("collective");
  TORCH_INTERNAL_ASSERT(tensor.is_contiguous() && tensor.device().is_cpu());
  TORCH_INTERNAL_ASSERT(src >= 0 && src < segment_->size() && src != segment_->rank());
  auto message = c10::make_intrusive<Message>(this, false, src, tag, tensor);
  std::lock_guard<std::mutex> lock(mutex_);
  bool complete = false;
  auto found = unexpected_[src].find(tag);
  if (found != unexpected_[src].end()) {
    const Unexpected& early = found->second;
    if (early.total != message->total_) {
      message->error_ = c10::str("rank ", segment_->group_ranks()[src], " sent ", early.total,
                                 " bytes, this rank expected ", message->total_);
      complete = true;
    } else {
      std::memcpy(message->data_, early.bytes.data(), early.bytes.size());
      message->moved_ = early.received;
      complete = early.received == early.total;
    }
    buffered_bytes_ -= static_cast<int64_t>(early.bytes.size());
    unexpected_[src].erase(found);
  }
  if (complete) {
    message->done_ = true;
  } else {
    recvs_[src].push_back(message);
  }
  progress_locked();
  return message;
}

void ShmTransport::corrupt(int peer, const std::string& what) const {
  const std::string why =
      c10::str("rank ", segment_->group_ranks()[peer], "'s channel holds inconsistent data (", what, ")");
  segment_->liveness().mark_broken(why);
  C10_THROW_ERROR(Error, c10::str("ddpkit (", segment_->liveness().where(), "): the shared-memory transport failed: ",
                                  why, "; destroy the group and create a new one"));
}

bool ShmTransport::progress_locked() {
  const ShmSegment& segment = *segment_;
  const SegmentMemory& memory = segment.memory();
  const int me = segment.rank();
  const int64_t chunk_bytes = memory.chunk_bytes();
  bool moved_any = false;
  for (int dst = 0; dst < segment.size(); ++dst) {
    auto& queue = sends_[dst];
    if (queue.empty()) continue;
    Channel& channel = memory.channel(me, dst);
    uint64_t head = channel.head.load(std::memory_order_relaxed);
    bool pushed = false;
    while (!queue.empty()) {
      Message& message = *queue.front();
      const uint64_t tail = channel.tail.load(std::memory_order_acquire);
      if (head - tail > static_cast<uint64_t>(kChannelSlots)) {
        corrupt(dst, c10::str("its receive counter ", tail, " is not within ", kChannelSlots, " chunks of ", head));
      }
      if (head - tail == static_cast<uint64_t>(kChannelSlots)) break;
      char* chunk = memory.chunk(channel, head);
      const int64_t length = std::min(chunk_bytes, message.total_ - message.moved_);
      *reinterpret_cast<ChunkHeader*>(chunk) = ChunkHeader{message.tag_, message.total_, message.moved_, length};
      if (length > 0) std::memcpy(chunk + kChunkHeaderBytes, message.data_ + message.moved_, length);
      channel.head.store(++head, std::memory_order_release);
      message.moved_ += length;
      pushed = true;
      if (message.moved_ == message.total_) {
        message.done_ = true;
        queue.pop_front();
      }
    }
    if (pushed) {
      memory.control(dst).doorbell.bump();
      moved_any = true;
    }
  }
  for (int src = 0; src < segment.size(); ++src) {
    if (src == me) continue;
    Channel& channel = memory.channel(src, me);
    uint64_t tail = channel.tail.load(std::memory_order_relaxed);
    bool took = false;
    for (;;) {
      const uint64_t head = channel.head.load(std::memory_order_acquire);
      if (head - tail > static_cast<uint64_t>(kChannelSlots)) {
        corrupt(src, c10::str("its send counter ", head, " is not within ", kChannelSlots, " chunks of ", tail));
      }
      if (head == tail) break;
      const char* chunk = memory.chunk(channel, tail);
      const ChunkHeader header = *reinterpret_cast<const ChunkHeader*>(chunk);
      // Note [Shared-memory segment]: nothing read from the segment is used unchecked.
      if (header.total < 0 || header.offset < 0 || header.length < 0 || header.length > chunk_bytes ||
          header.offset > header.total - header.length) {
        corrupt(src, c10::str("a chunk of ", header.length, " bytes at offset ", header.offset, " of a ", header.total,
                              "-byte message"));
      }
      auto& posted = recvs_[src];
      auto match = std::find_if(posted.begin(), posted.end(),
                                [&](const c10::intrusive_ptr<Message>& m) { return m->tag_ == header.tag; });
      if (match != posted.end()) {
        Message& message = **match;
        if (header.total != message.total_) {
          message.error_ = c10::str("rank ", segment_->group_ranks()[src], " sent ", header.total,
                                    " bytes, this rank expected ", message.total_);
        } else if (header.offset != message.moved_) {
          corrupt(src, c10::str("a chunk at offset ", header.offset, " where offset ", message.moved_, " comes next"));
        } else if (header.length > 0) {
          std::memcpy(message.data_ + header.offset, chunk + kChunkHeaderBytes, header.length);
        }
        message.moved_ += header.length;
        if (!message.error_.empty() || message.moved_ == message.total_) {
          message.done_ = true;
          posted.erase(match);
        }
      } else if (posted.empty()) {
        break;  // stays in the channel until its receive is posted (Note [Shared-memory messages])
      } else {
        // A posted receive waits behind this chunk: move it aside so the channel does not block.
        Unexpected& early = unexpected_[src][static_cast<int>(header.tag)];
        if (early.bytes.empty() && header.total > 0) {
          early.total = header.total;
          early.bytes.resize(static_cast<size_t>(header.total));
          buffered_bytes_ += header.total;
          note_buffered_bytes(buffered_bytes_);
        }
        if (header.total != early.total || header.offset != early.received) {
          corrupt(src,
                  c10::str("a chunk at offset ", header.offset, " of a ", header.total, "-byte message where offset ",
                           early.received, " of a ", early.total, "-byte one comes next"));
        }
        if (header.length > 0)
          std::memcpy(early.bytes.data() + header.offset, chunk + kChunkHeaderBytes, header.length);
        early.received += header.length;
      }
      channel.tail.store(++tail, std::memory_order_release);
      took = true;
    }
    if (took) {
      memory.control(src).doorbell.bump();
      moved_any = true;
    }
  }
  return moved_any;
}

void ShmTransport::wait_for_message(Message& message, std::string_view what) {
  WaitContext context = segment_->wait_context(what);
  context.peer = message.peer_;
  segment_->waits().wait_for(
      segment_->memory().control(segment_->rank()).doorbell,
      [&] {
        std::lock_guard<std::mutex> lock(mutex_);
        progress_locked();
        return message.done_;
      },
      context);
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(message.error_.empty(), message.error_);
}

void ShmTransport::abort_message(Message& message) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (message.done_) return;
  auto drop = [&](auto& list) {
    for (auto it = list.begin(); it != list.end(); ++it) {
      if (it->get() == &message) {
        list.erase(it);
        return;
      }
    }
  };
  if (message.is_send_)
    drop(sends_[message.peer_]);
  else
    drop(recvs_[message.peer_]);
  if (message.moved_ > 0) segment_->liveness().mark_broken("a message was aborted half-way");
  message.error_ = "aborted";
  message.done_ = true;
}

}  // namespace ddpkit::comm
