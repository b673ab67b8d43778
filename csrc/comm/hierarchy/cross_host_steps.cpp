#include "comm/hierarchy/cross_host_steps.h"

#include "comm/core/arguments.h"
#include "comm/core/communicator.h"
#include "comm/links/ring.h"
#include "comm/reduction/reduce_kernel.h"
#include "comm/reduction/split.h"
#include "comm/schedules/schedules.h"

#include <algorithm>
#include <functional>
#include <vector>

namespace ddpkit::comm {

SwapSteps::SwapSteps(int rank, std::vector<int> group_ranks, std::shared_ptr<Links> links, ScratchBuffers& scratch)
    : CrossHostSteps(rank, std::move(group_ranks), std::move(links)), scratch_(scratch) {
  TORCH_INTERNAL_ASSERT(size() == 2, "a socket pair spans two hosts");
}

// A part is reduced once it is in and, where `sends` reads `mine`, once this rank's copy of it has
// left. A peer that passed another size breaks the links (with checks off), and both ranks raise,
// naming the sizes. With the check in front (Note [A check in front of the swap] in
// checks/cross_host_check.h), the one frame sent carries the words first, and nothing of the peer's is
// reduced unless its words agree.
void SwapSteps::receive_and_combine(const at::Tensor& mine, ReduceOp op, std::vector<Links::Send> sends,
                                    Communicator& comm) {
  TORCH_INTERNAL_ASSERT(mine.is_contiguous());
  const int64_t element = mine.element_size();
  const int64_t bytes = mine.numel() * element;
  const ReduceOp sum_or_op = accumulating_op(op);
  CheckInFront* check = comm.check_in_front();
  const int64_t front = check != nullptr ? check->words().numel() : 0;
  if (check != nullptr) {
    TORCH_INTERNAL_ASSERT(sends.size() == 1 && sends[0].second_bytes == 0 && !sends[0].prepare);
    sends[0].second = sends[0].first;
    sends[0].second_bytes = sends[0].first_bytes;
    sends[0].first = check->words().data_ptr();
    sends[0].first_bytes = front;
  }
  const at::Tensor frame = scratch_.get(ScratchBuffers::kFromPeer, front + bytes, at::kByte);
  const at::Tensor theirs = frame.narrow(0, front, bytes).view(mine.scalar_type());
  bool agreed = check == nullptr;
  bool judged = agreed;
  int64_t reduced = 0;  // elements
  auto reduce_ready = [&](int64_t ready_bytes) {
    if (!judged) {
      agreed = check->agree(comm, peer(), frame.data_ptr());
      judged = true;
    }
    if (!agreed) return;
    const int64_t ready = std::max<int64_t>(0, ready_bytes - front) / element;
    combine_(slice(mine, reduced, ready), slice(theirs, reduced, ready), sum_or_op, /*other_first=*/peer() == 0);
    reduced = ready;
  };
  std::vector<Links::Recv> recvs{
      {peer(), frame.data_ptr(), front + bytes, 0, reduce_ready, kLinkPartBytes, check ? check->minimum() : bytes}};
  recvs[0].drain = check != nullptr;
  links().exchange(comm.sequence(), std::move(sends), recvs);
  if (check != nullptr) check->conclude(comm, recvs[0].received == front + bytes);
  TORCH_INTERNAL_ASSERT(reduced == mine.numel());
}

// Note [Compressed crossing] between two hosts: each host rounds its own block into the wire
// format, the frames carry the rounded blocks, and both hosts add the two decoded blocks in host
// order: each element ends with the same bits wherever it is computed. `out` (mine itself, or the
// peer's block of a reduce-scatter's run) goes to the peer while its frame for `mine` arrives.
void SwapSteps::swap_compressed(const at::Tensor& mine, const at::Tensor& out, ReduceOp op, Communicator& comm) {
  TORCH_INTERNAL_ASSERT(out.numel() == mine.numel() && out.is_contiguous() && mine.is_contiguous());
  const at::ScalarType wire = wire_dtype(comm.wire_format());
  // With the check in front, both frames start with the words (receive_and_combine).
  CheckInFront* check = comm.check_in_front();
  const int64_t front = check != nullptr ? check->words().numel() : 0;
  const int64_t bytes = mine.numel() * static_cast<int64_t>(c10::elementSize(wire));
  const at::Tensor sent = scratch_.get(ScratchBuffers::kWire, front + bytes, at::kByte);
  const at::Tensor frame = scratch_.get(ScratchBuffers::kFromPeer, front + bytes, at::kByte);
  if (check != nullptr) sent.narrow(0, 0, front).copy_(check->words());
  const at::Tensor outgoing = sent.narrow(0, front, bytes).view(wire);
  const at::Tensor incoming = frame.narrow(0, front, bytes).view(wire);
  const at::Tensor decoded = scratch_.get(ScratchBuffers::kDecoded, mine.numel(), mine.scalar_type());
  const int64_t element = incoming.element_size();
  bool agreed = check == nullptr;
  bool judged = agreed;
  int64_t reduced = 0;  // elements
  // Part by part as the peer's arrives, so that rounding this host's own part overlaps the transfer:
  // this host's contribution rounded as the peer's is, then the two added in host order.
  auto reduce_ready = [&](int64_t ready_bytes) {
    if (!judged) {
      agreed = check->agree(comm, peer(), frame.data_ptr());
      judged = true;
    }
    if (!agreed) return;
    const int64_t ready = std::max<int64_t>(0, ready_bytes - front) / element;
    const at::Tensor own = slice(mine, reduced, ready);
    // Where `out` is `mine`, its parts up to `ready` are encoded: the exchange reports data ready
    // only as far as it has sent this peer's frame (Links::Recv).
    own.copy_(out.is_same(mine) ? slice(outgoing, reduced, ready) : own.to(wire));
    const at::Tensor theirs = slice(decoded, reduced, ready).copy_(slice(incoming, reduced, ready));
    combine_(own, theirs, accumulating_op(op), /*other_first=*/peer() == 0);
    reduced = ready;
  };
  auto encode = encode_as_sent(outgoing, out);
  auto prepare = [encode = std::move(encode), front](int64_t frame_bytes) {
    if (frame_bytes > front) encode(frame_bytes - front);
  };
  std::vector<Links::Send> sends{{peer(), sent.data_ptr(), front + bytes, nullptr, 0, prepare, kLinkPartBytes}};
  std::vector<Links::Recv> recvs{
      {peer(), frame.data_ptr(), front + bytes, 0, reduce_ready, kLinkPartBytes, check ? check->minimum() : bytes}};
  recvs[0].drain = check != nullptr;
  links().exchange(comm.sequence(), std::move(sends), recvs);
  if (check != nullptr) check->conclude(comm, recvs[0].received == front + bytes);
  TORCH_INTERNAL_ASSERT(reduced == mine.numel());
}

void SwapSteps::move(const at::Tensor& outgoing, const at::Tensor& incoming, Communicator& comm) {
  std::vector<Links::Send> sends;
  if (outgoing.defined()) sends.push_back({peer(), outgoing.data_ptr(), static_cast<int64_t>(outgoing.nbytes())});
  std::vector<Links::Recv> recvs;
  if (incoming.defined()) {
    const auto bytes = static_cast<int64_t>(incoming.nbytes());
    recvs.push_back({peer(), incoming.data_ptr(), bytes, 0, nullptr, 0, bytes});
  }
  links().exchange(comm.sequence(), std::move(sends), recvs);
}

// A swap: each host sends the other its block whole, both ways at once, then both reduce the two in
// host order (each link carries the block once each way, as a ring's reduce-scatter and all-gather
// together would).
void SwapSteps::all_reduce(const at::Tensor& block, ReduceOp op, Communicator& comm) {
  if (block.numel() == 0) return;
  if (compresses(comm.wire_format(), block, op)) return swap_compressed(block, block, op, comm);
  receive_and_combine(block, op, {{peer(), block.data_ptr(), block.numel() * block.element_size()}}, comm);
}

void SwapSteps::broadcast(const at::Tensor& flat, int root, Communicator& comm) {
  if (flat.numel() == 0) return;
  const bool sender = rank() == root;
  move(sender ? flat : at::Tensor(), sender ? at::Tensor() : flat, comm);
}

void SwapSteps::reduce(const at::Tensor& flat, int root, ReduceOp op, Communicator& comm) {
  if (flat.numel() == 0) return;
  if (rank() == root) {
    receive_and_combine(flat, op, {}, comm);
  } else {
    move(flat, at::Tensor(), comm);
  }
}

void SwapSteps::all_gather(const at::Tensor& flat, int64_t m, Communicator& comm) {
  if (m == 0) return;
  move(flat.narrow(0, rank() * m, m), flat.narrow(0, peer() * m, m), comm);
}

// Each host sends the other its block of the run, and reduces its own.
void SwapSteps::reduce_scatter(const at::Tensor& run, int64_t m, ReduceOp op, Communicator& comm) {
  if (m == 0) return;
  const at::Tensor theirs = slice(run, peer() * m, (peer() + 1) * m);
  const at::Tensor mine = slice(run, rank() * m, (rank() + 1) * m);
  if (compresses(comm.wire_format(), run, op)) return swap_compressed(mine, theirs, op, comm);
  receive_and_combine(mine, op, {{peer(), theirs.data_ptr(), static_cast<int64_t>(theirs.nbytes())}}, comm);
}

RingSteps::RingSteps(int rank, std::vector<int> group_ranks, std::shared_ptr<Links> links,
                     c10::intrusive_ptr<c10d::Backend> backend, ScratchBuffers& scratch)
    : CrossHostSteps(rank, std::move(group_ranks), std::move(links)),
      backend_(std::move(backend)),
      messages_(std::make_shared<SendRecvTransport>(backend_, c10::kCPU)),
      scratch_(scratch) {}

Communicator RingSteps::subgroup(const Communicator& comm) const {
  return Communicator(rank(), size(), c10::kCPU, backend_, messages_, comm.sequence(), comm.group(), comm.what());
}

bool RingSteps::takes_two_shots(const at::Tensor& tensor, ReduceOp op, const Communicator& comm) const {
  return long_paths() && !compresses(comm.wire_format(), tensor, op) &&
         static_cast<int64_t>(tensor.nbytes()) <= kTwoShotsMaxBytes;
}

void RingSteps::settle_check_alone(Communicator& comm) {
  if (comm.check_in_front() != nullptr) comm.settle_header();
}

// The first shot (Note [Two shots across hosts]): this rank's block `b` of `flat` (elements
// [start(b), start(b + 1))) to partner b, each partner's block rank() in, reduced into this rank's
// own in one order: its own, then the partners' from the next rank round. With the check in front,
// every frame starts with the words, and nothing is reduced before every partner's agreed.
void RingSteps::reduce_scatter_shot(const at::Tensor& flat, const std::function<int64_t(int)>& start, ReduceOp op,
                                    Communicator& comm) {
  const int n = size(), r = rank();
  const ReduceOp sum_or_op = accumulating_op(op);
  CheckInFront* check = comm.check_in_front();
  const int64_t front = check != nullptr ? check->words().numel() : 0;
  const int64_t element = flat.element_size();
  const at::Tensor mine = slice(flat, start(r), start(r + 1));
  const int64_t bytes = mine.numel() * element;
  const int64_t stride = (front + bytes + 63) / 64 * 64;  // each partner's frame, cache-line aligned
  const at::Tensor frames = scratch_.get(ScratchBuffers::kFromPeer, n * stride, at::kByte);
  auto frame = [&](int j) { return frames.narrow(0, j * stride, front + bytes); };
  auto theirs = [&](int j) { return frame(j).narrow(0, front, bytes).view(flat.scalar_type()); };
  std::vector<int64_t> arrived(n, 0);  // elements of each partner's block in
  std::vector<char> judged(n, 0);
  bool agreed = check == nullptr;
  int64_t reduced = 0;  // elements of this rank's block reduced over every rank
  std::vector<Links::Send> sends;
  std::vector<Links::Recv> recvs;
  for (int j = 0; j < n; ++j) {
    if (j == r) continue;
    const at::Tensor out = slice(flat, start(j), start(j + 1));
    const auto out_bytes = static_cast<int64_t>(out.nbytes());
    if (check != nullptr) {
      sends.push_back({j, check->words().data_ptr(), front, out.data_ptr(), out_bytes});
    } else {
      sends.push_back({j, out.data_ptr(), out_bytes});
    }
    auto reduce_ready = [&, j](int64_t ready_bytes) {
      if (!judged[j]) {
        judged[j] = 1;
        if (check != nullptr) agreed = check->agree(comm, j, frame(j).data_ptr());
      }
      arrived[j] = std::max<int64_t>(0, ready_bytes - front) / element;
      if (!agreed) return;
      int64_t ready = mine.numel();
      for (int k = 0; k < n; ++k) {
        if (k != r) ready = std::min(ready, arrived[k]);
      }
      if (ready <= reduced) return;
      const at::Tensor result = slice(mine, reduced, ready);
      for (int k = 1; k < n; ++k) combine_(result, slice(theirs((r + k) % n), reduced, ready), sum_or_op);
      reduced = ready;
    };
    recvs.push_back({j, frame(j).data_ptr(), front + bytes, 0, reduce_ready, kLinkPartBytes,
                     check != nullptr ? check->minimum() : bytes});
    recvs.back().drain = check != nullptr;
  }
  links().exchange(comm.sequence(), std::move(sends), recvs);
  if (check != nullptr) {
    bool whole = true;
    for (const Links::Recv& recv : recvs) whole = whole && recv.received == front + bytes;
    check->conclude(comm, whole);
  }
  TORCH_INTERNAL_ASSERT(reduced == mine.numel());
}

// The second shot (Note [Two shots across hosts]): this rank's block of `bytes` to every partner,
// each partner's straight into place.
void RingSteps::all_gather_shot(const at::Tensor& bytes, const std::function<int64_t(int)>& start, Communicator& comm) {
  const int n = size(), r = rank();
  const at::Tensor mine = slice(bytes, start(r), start(r + 1));
  std::vector<Links::Send> sends;
  std::vector<Links::Recv> recvs;
  for (int j = 0; j < n; ++j) {
    if (j == r) continue;
    sends.push_back({j, mine.data_ptr(), mine.numel()});
    const at::Tensor in = slice(bytes, start(j), start(j + 1));
    recvs.push_back({j, in.data_ptr(), in.numel(), 0, nullptr, 0, in.numel()});
  }
  links().exchange(comm.sequence(), std::move(sends), recvs);
}

void RingSteps::all_reduce(const at::Tensor& block, ReduceOp op, Communicator& comm) {
  if (!takes_two_shots(block, op, comm)) {
    settle_check_alone(comm);
    return ring_all_reduce(links(), comm.sequence(), block, op, comm.wire_format(), scratch_);
  }
  if (block.numel() == 0) return;
  const BalancedSplit split{block.numel(), size()};
  reduce_scatter_shot(block, [&](int b) { return split.start(b); }, op, comm);
  const int64_t element = block.element_size();
  all_gather_shot(block.view(at::kByte), [&](int b) { return split.start(b) * element; }, comm);
}

void RingSteps::broadcast(const at::Tensor& flat, int root, Communicator& comm) {
  if (flat.numel() == 0) return;
  Communicator cross = subgroup(comm);
  Schedule schedule = broadcast_schedule(flat, size(), rank(), root);
  run_schedule(cross, schedule);
}

void RingSteps::reduce(const at::Tensor& flat, int root, ReduceOp op, Communicator& comm) {
  if (flat.numel() == 0) return;
  Communicator cross = subgroup(comm);
  Schedule schedule = reduce_schedule(flat, op, size(), rank(), root);
  run_schedule(cross, schedule);
}

void RingSteps::all_gather(const at::Tensor& flat, int64_t m, Communicator& comm) {
  if (!long_paths() || static_cast<int64_t>(flat.nbytes()) > kTwoShotsMaxBytes) {
    return ring_all_gather(links(), comm.sequence(), flat, m);
  }
  if (m == 0) return;
  const int64_t element = flat.element_size();
  all_gather_shot(flat.view(at::kByte), [&](int b) { return b * m * element; }, comm);
}

void RingSteps::reduce_scatter(const at::Tensor& run, int64_t m, ReduceOp op, Communicator& comm) {
  if (!takes_two_shots(run, op, comm)) {
    settle_check_alone(comm);
    return ring_reduce_scatter(links(), comm.sequence(), run, m, op, comm.wire_format(), scratch_);
  }
  if (m == 0) return;
  reduce_scatter_shot(run, [&](int b) { return b * m; }, op, comm);
}

}  // namespace ddpkit::comm
