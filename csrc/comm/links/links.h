#pragma once
// Frames between the ranks that cross hosts together, behind one interface (Note [Socket links] in
// links/socket_links.h: ddpkit's own TCP connections).

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace ddpkit::comm {

// Connections from this rank to every other rank of a cross subgroup (peers are indices of the
// subgroup, in its order), carrying frames: each a collective's sequence number and its bytes. The
// steps across hosts (hierarchy/cross_host_steps.h) and the check's round across hosts (checks/cross_host_check.h) move
// their data through it. SocketLinks (links/socket_links.h) is the implementation.
// The part of a frame across hosts reduced (or encoded) at a time while the rest is on its way, by
// the swap between two hosts and the ring among more: reducing parts as they land against reducing
// once everything is in, and this size against larger ones, were decided on bench_multihost.py's
// 2x1 points (the size changed by hand); its 3x1 and 4x1 points time the ring.
inline constexpr int64_t kLinkPartBytes = 256 << 10;

// Note [Receiving windows]
// A ring step's reduce-scatter reduces what arrives into the rank's own block, so its frame only
// passes through the receiving buffer. Received whole, a block of megabytes streams through
// memory: every line the kernel's copy out of the socket writes must be fetched and later written
// back, and that copy is the largest single cost of a large step on a host's CPUs (perf). So such
// a frame is received into a window of kLinkWindowBytes used round and round (Links::Recv::window):
// the exchange receives no further ahead of the reports than the window holds, and the same lines
// stay in the cache from the copy to the reduction, as gloo's ring receives into two segments of a
// megabyte. The swap between two hosts keeps its frames whole: its reports wait for the frame it
// sends the same peer, so a window there would tie its receiving to its own sending
// (compare_builds.sh --hosts "2x1 2x2" timed it slower at two hosts of one rank and the largest size).
// Its size was chosen against windows of fewer and of more parts and against the whole block, on the
// largest all-reduces across three hosts or more (bench_multihost.py), each choice timed interleaved
// in one run; compare_builds.sh --hosts times the window against the build before it.
inline constexpr int64_t kLinkWindowBytes = 4 * kLinkPartBytes;

class Links {
 public:
  // One frame to send: `first` then `second` (either may be empty), as one message. With `prepare`,
  // the frame's data is written as it goes out: exchange() calls prepare(n) before it sends data
  // byte n - 1, n growing by `prepare_step` bytes at a time (or to the frame's end), so that the
  // caller fills the next part of `first` (a compressed crossing encodes it) while earlier parts
  // are on their way; `second` must be empty.
  struct Send {
    int peer;
    const void* first;
    int64_t first_bytes;
    const void* second = nullptr;
    int64_t second_bytes = 0;
    std::function<void(int64_t)> prepare = nullptr;
    int64_t prepare_step = 0;
    // With `follows` (an index into the exchange's recvs), the frame forwards what that received
    // frame's reports passed: its data byte k goes out once on_data was called with a count past k
    // (Note [A streaming ring] in links/ring.h), to the last multiple of its `step` before its end.
    // That frame needs on_data and a step, and is at least as long; `second` and `prepare` must be
    // empty.
    int follows = -1;
  };
  // One frame to receive into `data`, at most `capacity` bytes; exchange() sets `received`. With
  // `on_data`, exchange() calls it with a count of bytes each time another `step` of them (or the
  // rest of the frame) is ready, so that the caller works on the first part while the rest is on
  // its way: ready means received, and, where the exchange also sends this peer a frame, sent as
  // far (frame data bytes) or sent whole, so that the caller may overwrite what it sent up to there.
  // With a `window` (Note [Receiving windows]), `data` holds only `window` bytes, used round and
  // round, and `capacity` bounds the frame: frame byte k lands at data[k % window]. The exchange
  // receives at most `window` bytes past the largest multiple of `step` at or below the last count
  // it passed to on_data; on_data must be done with the bytes up to that multiple when it returns
  // (it may keep a partial element past it: `step` is a multiple of the element size). One report
  // spans at most `window` bytes and may wrap round. A window needs on_data, a multiple of `step`
  // of at least one step, and no frame sent to the same peer.
  struct Recv {
    int peer;
    void* data;
    int64_t capacity;
    int64_t received = 0;
    std::function<void(int64_t)> on_data = nullptr;
    int64_t step = 0;
    int64_t minimum = 0;  // a shorter frame breaks the links, as a longer one than `capacity` does
    int64_t window = 0;   // 0: `data` holds the whole frame
    // A longer frame than `capacity` is received whole, its first `capacity` bytes into `data` and the
    // rest dropped, instead of breaking the links: `received` then says its length, and on_data hears
    // of `capacity` bytes at most. For the check's frames, which may meet another collective's frame
    // and must still leave the stream in step (Note [A check in front of the swap] in
    // checks/cross_host_check.h). No window.
    bool drain = false;
  };

  virtual ~Links() = default;

  // This rank's index among the links' ranks, and their number.
  virtual int rank() const = 0;
  virtual int size() const = 0;

  // Sends every frame of `sends` and receives every frame of `recvs`, all at once, as part of the
  // collective numbered `sequence`; returns once all are done. Raises (and breaks the links) when a
  // peer closed its connection, the timeout expired, or a frame was not the one expected; then
  // failed_peer() names the peer. Frames to one peer go in the order given, each once the one before
  // it went whole; frames from one peer come in the order given, each received once the one before
  // it came whole and was reported whole, so that they may share a buffer. Where a report waits for
  // a send (a peer both sent to and received from with on_data), that peer has one frame each way and
  // no frame follows another.
  virtual void exchange(uint64_t sequence, std::vector<Send> sends, std::vector<Recv>& recvs) = 0;

  // Shuts every link down, so that no peer waits for this rank (after a failure).
  virtual void shut_down() noexcept = 0;

  // Breaks the links over a failure of this rank's own in a collective (`why`): shuts every one down,
  // so that a partner waiting for this rank's frames raises at once, and every later exchange raises
  // naming `why` (unless the links had already broken).
  virtual void break_off(const std::string& why) noexcept = 0;

  // After exchange() raised: best effort, sends `peer` one frame of `bytes` (a center's news of which
  // rank failed, Note [One round across hosts]) over its own connection, which may still work;
  // gives up after a second and never raises.
  virtual void send_last_words(uint64_t sequence, int peer, const void* data, int64_t bytes) noexcept = 0;

  // The peer of the exchange that broke the links, or -1.
  virtual int failed_peer() const = 0;

  // Whether a link of this rank crosses a long path (Note [Send buffers] in links/send_buffers.h).
  virtual bool crosses_long_paths() const { return false; }
};

}  // namespace ddpkit::comm
