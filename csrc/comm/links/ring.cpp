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

// One step: `out` to the right neighbour while the left one's frame of exactly `in`'s size arrives
// into `in`; `on_part(elements)` is called as the first `elements` of it are in (null: not at all).
// With `source`, `out` is written from it as it goes out (Links::Send's prepare: an encoded
// frame whose encoding overlaps the transfer). With `in_numel`, the frame has that many elements
// and `in` is its window (Note [Receiving windows]): element k lands at in[k % in.numel()].
void step(Links& links, uint64_t sequence, const at::Tensor& out, const at::Tensor& in,
          std::function<void(int64_t)> on_part, const at::Tensor& source = at::Tensor(),
          std::optional<int64_t> in_numel = std::nullopt) {
  const int n = links.size(), r = links.rank();
  const int64_t element = in.element_size();
  const auto in_bytes = in_numel ? *in_numel * element : static_cast<int64_t>(in.nbytes());
  const int64_t window = in_numel ? static_cast<int64_t>(in.nbytes()) : 0;
  std::function<void(int64_t)> on_data;
  if (on_part) on_data = [&on_part, element](int64_t bytes) { on_part(bytes / element); };
  std::function<void(int64_t)> prepare = source.defined() ? encode_as_sent(out, source) : nullptr;
  std::vector<Links::Send> sends{{wrap(r + 1, n), out.data_ptr(), static_cast<int64_t>(out.nbytes()), nullptr, 0,
                                  std::move(prepare), kLinkPartBytes}};
  std::vector<Links::Recv> recvs{
      {wrap(r - 1, n), in.data_ptr(), in_bytes, 0, std::move(on_data), kLinkPartBytes, in_bytes, window}};
  links.exchange(sequence, std::move(sends), recvs);
}

// The reduce-scatter of Note [A ring across hosts] over `blocks` of `flat`: afterwards this rank's
// block is reduced over every rank. Blocks larger than kLinkWindowBytes arrive through a window
// (Note [Receiving windows]). With `wire` compressing, frames go through `wired` (flat's
// layout in the wire's dtype): parts are decoded into a float32 scratch before they are reduced,
// and each reduced part is encoded at once for the next step's frame, so that the rounding overlaps
// the transfer. `round_own`: this rank's finished block too, encoded and taken back rounded (the
// all-reduce's, whose all-gather sends it so: Note [Compressed crossing]).
void reduce_scatter_blocks(Links& links, uint64_t sequence, const at::Tensor& flat, const std::vector<Span>& blocks,
                           ReduceOp op, bool compressed, const at::Tensor& wired, bool round_own,
                           ScratchBuffers& scratch) {
  const int n = links.size(), r = links.rank();
  const ReduceOp sum_or_op = accumulating_op(op);
  const int64_t most = largest(blocks);
  // The compressed frames stay whole: each reduced part is encoded back into its place in `wired`.
  // Two ranks receive from the peer they send to, whose reports wait for the send: no window.
  const int64_t window = kLinkWindowBytes / flat.element_size();
  const bool windowed = !compressed && most > window && n > 2;
  const at::Tensor incoming =
      compressed ? at::Tensor() : scratch.get(ScratchBuffers::kFromPeer, windowed ? window : most, flat.scalar_type());
  const at::Tensor decoded = compressed ? scratch.get(ScratchBuffers::kDecoded, most, at::kFloat) : at::Tensor();
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
    int64_t reduced = 0;
    auto reduce_ready = [&](int64_t ready) {
      if (windowed) {
        for (int64_t upto; reduced < ready; reduced = upto) {  // in at most two pieces: the window wraps
          const int64_t at = reduced % window;
          upto = std::min(ready, reduced + window - at);
          combine_(slice(mine, reduced, upto), incoming.narrow(0, at, upto - reduced), sum_or_op,
                   /*other_first=*/true);
        }
        return;
      }
      at::Tensor theirs = slice(in, reduced, ready);
      if (compressed) theirs = decoded.narrow(0, 0, ready - reduced).copy_(theirs);
      const at::Tensor result = slice(mine, reduced, ready);
      combine_(result, theirs, sum_or_op, /*other_first=*/true);
      if (compressed && (!last || round_own)) {
        // `in`'s part is decoded already: its place takes the encoded result.
        slice(in, reduced, ready).copy_(result);
        if (last) result.copy_(slice(in, reduced, ready));
      }
      reduced = ready;
    };
    step(links, sequence, out, in, reduce_ready, source, windowed ? std::make_optional(received.size()) : std::nullopt);
    TORCH_INTERNAL_ASSERT(reduced == mine.numel());
  }
}

// The all-gather of Note [A ring across hosts] over `blocks` of `flat`, this rank's block finished.
// With `wire` compressing, the frames carry `wired`'s bytes: the owner's block is there already,
// rounded (reduce_scatter_blocks' round_own), and the others decode each block as it lands and
// forward its bytes.
void all_gather_blocks(Links& links, uint64_t sequence, const at::Tensor& flat, const std::vector<Span>& blocks,
                       bool compressed, const at::Tensor& wired) {
  const int n = links.size(), r = links.rank();
  const at::Tensor& frames = compressed ? wired : flat;
  for (int s = 0; s < n - 1; ++s) {
    const Span& received = blocks[wrap(r - 1 - s, n)];
    const at::Tensor in = part(frames, received);
    std::function<void(int64_t)> decode;
    int64_t decoded = 0;
    if (compressed) {
      const at::Tensor into = part(flat, received);
      decode = [&, into](int64_t ready) {
        slice(into, decoded, ready).copy_(slice(in, decoded, ready));
        decoded = ready;
      };
    }
    step(links, sequence, part(frames, blocks[wrap(r - s, n)]), in, decode);
    TORCH_INTERNAL_ASSERT(!compressed || decoded == received.size());
  }
}

}  // namespace

void ring_all_reduce(Links& links, uint64_t sequence, const at::Tensor& flat, ReduceOp op, WireFormat wire,
                     ScratchBuffers& scratch) {
  TORCH_INTERNAL_ASSERT(flat.is_contiguous() && links.size() >= 2);
  if (flat.numel() == 0) return;
  const bool compressed = compresses(wire, flat, op);
  const at::Tensor wired =
      compressed ? scratch.get(ScratchBuffers::kWire, flat.numel(), wire_dtype(wire)) : at::Tensor();
  const std::vector<Span> blocks = balanced_blocks(flat.numel(), links.size());
  reduce_scatter_blocks(links, sequence, flat, blocks, op, compressed, wired, /*round_own=*/true, scratch);
  all_gather_blocks(links, sequence, flat, blocks, compressed, wired);
}

void ring_reduce_scatter(Links& links, uint64_t sequence, const at::Tensor& run, int64_t m, ReduceOp op,
                         WireFormat wire, ScratchBuffers& scratch) {
  TORCH_INTERNAL_ASSERT(run.is_contiguous() && run.numel() == m * links.size());
  if (m == 0) return;
  const bool compressed = compresses(wire, run, op);
  const at::Tensor wired =
      compressed ? scratch.get(ScratchBuffers::kWire, run.numel(), wire_dtype(wire)) : at::Tensor();
  reduce_scatter_blocks(links, sequence, run, blocks_of(m, links.size()), op, compressed, wired, /*round_own=*/false,
                        scratch);
}

void ring_all_gather(Links& links, uint64_t sequence, const at::Tensor& flat, int64_t m) {
  TORCH_INTERNAL_ASSERT(flat.is_contiguous() && flat.numel() == m * links.size());
  if (m == 0) return;
  all_gather_blocks(links, sequence, flat, blocks_of(m, links.size()), /*compressed=*/false, at::Tensor());
}

}  // namespace ddpkit::comm
