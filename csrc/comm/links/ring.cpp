#include "comm/links/ring.h"

#include "comm/core/arguments.h"
#include "comm/reduction/reduce_kernel.h"
#include "comm/reduction/split.h"

#include <algorithm>
#include <functional>
#include <optional>
#include <vector>

namespace ddpkit::comm {
namespace {

int wrap(int i, int n) { return ((i % n) + n) % n; }

// Elements [begin, end) of a tensor: one block of the ring.
struct Span {
  int64_t begin;
  int64_t end;
  int64_t size() const { return end - begin; }
};

// The all-reduce's blocks: BalancedSplit's (Note [Splitting among ranks]).
std::vector<Span> balanced_blocks(int64_t numel, int n) {
  const BalancedSplit split{numel, n};
  std::vector<Span> blocks(n);
  for (int b = 0; b < n; ++b) blocks[b] = {split.start(b), split.start(b + 1)};
  return blocks;
}

// n blocks of m elements.
std::vector<Span> blocks_of(int64_t m, int n) {
  std::vector<Span> blocks(n);
  for (int b = 0; b < n; ++b) blocks[b] = {b * m, (b + 1) * m};
  return blocks;
}

int64_t largest(const std::vector<Span>& blocks) {
  int64_t most = 0;
  for (const Span& b : blocks) most = std::max(most, b.size());
  return most;
}

at::Tensor part(const at::Tensor& flat, const Span& span) { return slice(flat, span.begin, span.end); }

// The frames of a ring's steps, moved in one exchange (Note [A streaming ring] in links/ring.h):
// step t's frame to the right neighbour forwards what step t - 1's frame from the left brought, as
// its reports pass it.
class RingFrames {
 public:
  explicit RingFrames(Links& links) : links_(links) {}

  // The next step: `out` to the right neighbour while the left one's frame of exactly `in`'s size
  // arrives into `in`; `on_part(elements)` is called as the first `elements` of it are in, and must
  // leave them in `out` of the next step (null: only where no step follows). With `source`, `out` is
  // written from it as it goes out (Links::Send's prepare: an encoded frame whose encoding overlaps
  // the transfer; the first step only). With `in_numel`, the frame has that many elements and `in`
  // is its window (Note [Receiving windows]): element k lands at in[k % in.numel()]. The tensors,
  // and what on_part refers to, must outlive run().
  void add(const at::Tensor& out, const at::Tensor& in, std::function<void(int64_t)> on_part,
           const at::Tensor& source = at::Tensor(), std::optional<int64_t> in_numel = std::nullopt) {
    const int n = links_.size(), r = links_.rank();
    const int step = static_cast<int>(sends_.size());
    const int64_t element = in.element_size();
    const auto in_bytes = in_numel ? *in_numel * element : static_cast<int64_t>(in.nbytes());
    const int64_t window = in_numel ? static_cast<int64_t>(in.nbytes()) : 0;
    std::function<void(int64_t)> on_data;
    if (on_part) {
      on_data = [on_part = std::move(on_part), element](int64_t bytes) { on_part(bytes / element); };
    }
    TORCH_INTERNAL_ASSERT(!source.defined() || step == 0);
    std::function<void(int64_t)> prepare = source.defined() ? encode_as_sent(out, source) : nullptr;
    sends_.push_back({wrap(r + 1, n), out.data_ptr(), static_cast<int64_t>(out.nbytes()), nullptr, 0,
                      std::move(prepare), kLinkPartBytes, step - 1});
    recvs_.push_back(
        {wrap(r - 1, n), in.data_ptr(), in_bytes, 0, std::move(on_data), kLinkPartBytes, in_bytes, window});
  }

  void run(uint64_t sequence) {
    if (!sends_.empty()) links_.exchange(sequence, std::move(sends_), recvs_);
  }

 private:
  Links& links_;
  std::vector<Links::Send> sends_;
  std::vector<Links::Recv> recvs_;
};

// Forwards the data of a step of the all-gather: the next step sends it as it is reported.
void forwarded(int64_t) {}

// The reduce-scatter of Note [A ring across hosts] over `blocks` of `flat`, its steps added to
// `frames`: once they ran, this rank's block is reduced over every rank. Blocks larger than
// kLinkWindowBytes arrive through a window (Note [Receiving windows]). With `wire` compressing,
// frames go through `wired` (flat's layout in the wire's dtype): parts are decoded into a float32
// scratch before they are reduced, and each reduced part is encoded at once for the next step's
// frame, so that the rounding overlaps the transfer. `round_own`: this rank's finished block too,
// encoded and taken back rounded (the all-reduce's, whose all-gather sends it so: Note [Compressed
// crossing]). `reduced`: the elements each step reduced, for the caller to check.
void add_reduce_scatter(RingFrames& frames, const Links& links, const at::Tensor& flat, const std::vector<Span>& blocks,
                        ReduceOp op, bool compressed, const at::Tensor& wired, bool round_own,
                        std::vector<int64_t>& reduced, ScratchBuffers& scratch) {
  const int n = links.size(), r = links.rank();
  const ReduceOp sum_or_op = accumulating_op(op);
  const int64_t most = largest(blocks);
  // The compressed frames stay whole: each reduced part is encoded back into its place in `wired`.
  // Frames from the left share one receiving buffer: each is received once the one before it was
  // reduced whole (Links::exchange).
  const int64_t window = kLinkWindowBytes / flat.element_size();
  const bool windowed = !compressed && most > window;
  const at::Tensor incoming =
      compressed ? at::Tensor() : scratch.get(ScratchBuffers::kFromPeer, windowed ? window : most, flat.scalar_type());
  const at::Tensor decoded = compressed ? scratch.get(ScratchBuffers::kDecoded, most, at::kFloat) : at::Tensor();
  reduced.assign(n - 1, 0);
  for (int s = 0; s < n - 1; ++s) {
    const Span& sent = blocks[wrap(r - 1 - s, n)];
    const Span& received = blocks[wrap(r - 2 - s, n)];
    const at::Tensor mine = part(flat, received);
    at::Tensor out = part(flat, sent);
    const at::Tensor in =
        compressed ? part(wired, received) : (windowed ? incoming : incoming.narrow(0, 0, received.size()));
    // The partial result, rounded as it leaves: the first step's is this rank's own block, encoded as
    // it goes out; the later ones' were encoded as they were reduced.
    at::Tensor source;
    if (compressed) {
      if (s == 0) source = out;
      out = part(wired, sent);
    }
    const bool last = s == n - 2;
    int64_t& done = reduced[s];
    auto reduce_ready = [=, &done](int64_t ready) {
      if (windowed) {
        for (int64_t upto; done < ready; done = upto) {  // in at most two pieces: the window wraps
          const int64_t at = done % window;
          upto = std::min(ready, done + window - at);
          combine_(slice(mine, done, upto), incoming.narrow(0, at, upto - done), sum_or_op, /*other_first=*/true);
        }
        return;
      }
      at::Tensor theirs = slice(in, done, ready);
      if (compressed) theirs = decoded.narrow(0, 0, ready - done).copy_(theirs);
      const at::Tensor result = slice(mine, done, ready);
      combine_(result, theirs, sum_or_op, /*other_first=*/true);
      if (compressed && (!last || round_own)) {
        // `in`'s part is decoded already: its place takes the encoded result.
        slice(in, done, ready).copy_(result);
        if (last) result.copy_(slice(in, done, ready));
      }
      done = ready;
    };
    frames.add(out, in, reduce_ready, source, windowed ? std::make_optional(received.size()) : std::nullopt);
  }
}

// The all-gather of Note [A ring across hosts] over `blocks` of `flat`, its steps added to `frames`
// after any that finish this rank's block. With `wire` compressing, the frames carry `wired`'s
// bytes: the owner's block is there already, rounded (add_reduce_scatter's round_own), and the
// others decode each block as it lands and forward its bytes. `decoded`: the elements each step
// decoded, for the caller to check.
void add_all_gather(RingFrames& frames, const Links& links, const at::Tensor& flat, const std::vector<Span>& blocks,
                    bool compressed, const at::Tensor& wired, std::vector<int64_t>& decoded) {
  const int n = links.size(), r = links.rank();
  const at::Tensor& bytes = compressed ? wired : flat;
  decoded.assign(n - 1, 0);
  for (int s = 0; s < n - 1; ++s) {
    const Span& received = blocks[wrap(r - 1 - s, n)];
    const at::Tensor in = part(bytes, received);
    std::function<void(int64_t)> on_part = s < n - 2 ? forwarded : nullptr;
    if (compressed) {
      const at::Tensor into = part(flat, received);
      on_part = [in, into, &done = decoded[s]](int64_t ready) {
        slice(into, done, ready).copy_(slice(in, done, ready));
        done = ready;
      };
    }
    frames.add(part(bytes, blocks[wrap(r - s, n)]), in, on_part);
  }
}

bool all_of(const std::vector<int64_t>& counts, const std::vector<Span>& blocks, int first_block) {
  const int n = static_cast<int>(blocks.size());
  for (size_t s = 0; s < counts.size(); ++s) {
    if (counts[s] != blocks[wrap(first_block - static_cast<int>(s), n)].size()) return false;
  }
  return true;
}

}  // namespace

void ring_all_reduce(Links& links, uint64_t sequence, const at::Tensor& flat, ReduceOp op, WireFormat wire,
                     ScratchBuffers& scratch) {
  TORCH_INTERNAL_ASSERT(flat.is_contiguous() && links.size() >= 3);
  if (flat.numel() == 0) return;
  const bool compressed = compresses(wire, flat, op);
  const at::Tensor wired =
      compressed ? scratch.get(ScratchBuffers::kWire, flat.numel(), wire_dtype(wire)) : at::Tensor();
  const std::vector<Span> blocks = balanced_blocks(flat.numel(), links.size());
  RingFrames frames(links);
  std::vector<int64_t> reduced, decoded;
  add_reduce_scatter(frames, links, flat, blocks, op, compressed, wired, /*round_own=*/true, reduced, scratch);
  add_all_gather(frames, links, flat, blocks, compressed, wired, decoded);
  frames.run(sequence);
  const int r = links.rank();
  TORCH_INTERNAL_ASSERT(all_of(reduced, blocks, r - 2) && (!compressed || all_of(decoded, blocks, r - 1)));
}

void ring_reduce_scatter(Links& links, uint64_t sequence, const at::Tensor& run, int64_t m, ReduceOp op,
                         WireFormat wire, ScratchBuffers& scratch) {
  TORCH_INTERNAL_ASSERT(run.is_contiguous() && run.numel() == m * links.size() && links.size() >= 3);
  if (m == 0) return;
  const bool compressed = compresses(wire, run, op);
  const at::Tensor wired =
      compressed ? scratch.get(ScratchBuffers::kWire, run.numel(), wire_dtype(wire)) : at::Tensor();
  const std::vector<Span> blocks = blocks_of(m, links.size());
  RingFrames frames(links);
  std::vector<int64_t> reduced;
  add_reduce_scatter(frames, links, run, blocks, op, compressed, wired, /*round_own=*/false, reduced, scratch);
  frames.run(sequence);
  TORCH_INTERNAL_ASSERT(all_of(reduced, blocks, links.rank() - 2));
}

void ring_all_gather(Links& links, uint64_t sequence, const at::Tensor& flat, int64_t m) {
  TORCH_INTERNAL_ASSERT(flat.is_contiguous() && flat.numel() == m * links.size() && links.size() >= 3);
  if (m == 0) return;
  RingFrames frames(links);
  std::vector<int64_t> decoded;
  add_all_gather(frames, links, flat, blocks_of(m, links.size()), /*compressed=*/false, at::Tensor(), decoded);
  frames.run(sequence);
}

}  // namespace ddpkit::comm
