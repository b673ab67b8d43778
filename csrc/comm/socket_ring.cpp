#include "comm/socket_ring.h"

#include "comm/arguments.h"
#include "comm/reduce_kernel.h"

#include <algorithm>
#include <functional>
#include <vector>

namespace ddpkit::comm {
namespace {

// A part of Note [A ring across hosts]: reduced as it lands, as the pair's swap does (its
// kSwapStepBytes, measured there; bench_multihost.py's 3x1 and 4x1 points time the ring).
constexpr int64_t kRingPartBytes = 256 << 10;

int wrap(int i, int n) { return ((i % n) + n) % n; }

// Elements [begin, end) of a tensor: one block of the ring.
struct Span {
  int64_t begin;
  int64_t end;
  int64_t size() const { return end - begin; }
};

// `numel` elements in n blocks differing by at most one element.
std::vector<Span> even_blocks(int64_t numel, int n) {
  std::vector<Span> blocks(n);
  for (int b = 0; b < n; ++b) blocks[b] = {b * numel / n, (b + 1) * numel / n};
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
void step(SocketLinks& links, uint64_t sequence, const at::Tensor& out, const at::Tensor& in,
          std::function<void(int64_t)> on_part) {
  const int n = links.size(), r = links.rank();
  const int64_t element = in.element_size();
  const auto in_bytes = static_cast<int64_t>(in.nbytes());
  std::function<void(int64_t)> on_data;
  if (on_part) on_data = [&on_part, element](int64_t bytes) { on_part(bytes / element); };
  std::vector<SocketLinks::Send> sends{{wrap(r + 1, n), out.data_ptr(), static_cast<int64_t>(out.nbytes())}};
  std::vector<SocketLinks::Recv> recvs{
      {wrap(r - 1, n), in.data_ptr(), in_bytes, 0, std::move(on_data), kRingPartBytes, in_bytes}};
  links.exchange(sequence, std::move(sends), recvs);
}

// The reduce-scatter of Note [A ring across hosts] over `blocks` of `flat`: afterwards this rank's
// block is reduced over every rank. With `wire` compressing, frames go through `wired` (flat's
// layout in the wire's dtype) and parts are decoded into a float32 scratch before they are reduced.
void reduce_scatter_blocks(SocketLinks& links, uint64_t sequence, const at::Tensor& flat,
                           const std::vector<Span>& blocks, ReduceOp op, bool compressed, const at::Tensor& wired,
                           ScratchBuffers& scratch) {
  const int n = links.size(), r = links.rank();
  const ReduceOp sum_or_op = accumulating_op(op);
  const int64_t most = largest(blocks);
  const at::Tensor incoming =
      compressed ? at::Tensor() : scratch.get(ScratchBuffers::kFromPeer, most, flat.scalar_type());
  const at::Tensor decoded = compressed ? scratch.get(ScratchBuffers::kDecoded, most, at::kFloat) : at::Tensor();
  for (int s = 0; s < n - 1; ++s) {
    const Span& sent = blocks[wrap(r - 1 - s, n)];
    const Span& received = blocks[wrap(r - 2 - s, n)];
    const at::Tensor mine = part(flat, received);
    at::Tensor out = part(flat, sent);
    at::Tensor in = compressed ? part(wired, received) : incoming.narrow(0, 0, received.size());
    if (compressed) out = part(wired, sent).copy_(out);  // the partial result, rounded as it leaves
    int64_t reduced = 0;
    auto reduce_ready = [&](int64_t ready) {
      at::Tensor theirs = slice(in, reduced, ready);
      if (compressed) theirs = decoded.narrow(0, 0, ready - reduced).copy_(theirs);
      combine_(slice(mine, reduced, ready), theirs, sum_or_op, /*other_first=*/true);
      reduced = ready;
    };
    step(links, sequence, out, in, reduce_ready);
    TORCH_INTERNAL_ASSERT(reduced == mine.numel());
  }
}

// The all-gather of Note [A ring across hosts] over `blocks` of `flat`, this rank's block finished.
// With `wire` compressing, the frames carry `wired`'s bytes: the owner rounds its block into it and
// takes the rounded value itself, the others decode each block as it lands and forward its bytes.
void all_gather_blocks(SocketLinks& links, uint64_t sequence, const at::Tensor& flat, const std::vector<Span>& blocks,
                       bool compressed, const at::Tensor& wired) {
  const int n = links.size(), r = links.rank();
  if (compressed) part(flat, blocks[r]).copy_(part(wired, blocks[r]).copy_(part(flat, blocks[r])));
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

void ring_all_reduce(SocketLinks& links, uint64_t sequence, const at::Tensor& flat, ReduceOp op, WireFormat wire,
                     ScratchBuffers& scratch) {
  TORCH_INTERNAL_ASSERT(flat.is_contiguous() && links.size() >= 2);
  if (flat.numel() == 0) return;
  const bool compressed = compresses(wire, flat, op);
  const at::Tensor wired =
      compressed ? scratch.get(ScratchBuffers::kWire, flat.numel(), wire_dtype(wire)) : at::Tensor();
  const std::vector<Span> blocks = even_blocks(flat.numel(), links.size());
  reduce_scatter_blocks(links, sequence, flat, blocks, op, compressed, wired, scratch);
  all_gather_blocks(links, sequence, flat, blocks, compressed, wired);
}

void ring_reduce_scatter(SocketLinks& links, uint64_t sequence, const at::Tensor& run, int64_t m, ReduceOp op,
                         WireFormat wire, ScratchBuffers& scratch) {
  TORCH_INTERNAL_ASSERT(run.is_contiguous() && run.numel() == m * links.size());
  if (m == 0) return;
  const bool compressed = compresses(wire, run, op);
  const at::Tensor wired =
      compressed ? scratch.get(ScratchBuffers::kWire, run.numel(), wire_dtype(wire)) : at::Tensor();
  reduce_scatter_blocks(links, sequence, run, blocks_of(m, links.size()), op, compressed, wired, scratch);
}

void ring_all_gather(SocketLinks& links, uint64_t sequence, const at::Tensor& flat, int64_t m) {
  TORCH_INTERNAL_ASSERT(flat.is_contiguous() && flat.numel() == m * links.size());
  if (m == 0) return;
  all_gather_blocks(links, sequence, flat, blocks_of(m, links.size()), /*compressed=*/false, at::Tensor());
}

}  // namespace ddpkit::comm
