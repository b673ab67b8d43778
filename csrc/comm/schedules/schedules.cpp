#include "comm/schedules/schedules.h"

#include "comm/core/arguments.h"
#include "comm/reduction/reduce_kernel.h"
#include "comm/reduction/split.h"

#include <algorithm>
#include <bit>

namespace ddpkit::comm {
namespace {

// The blocks [first, first + count) of rank r's group of `count` ranks (count a power of two):
// the aligned run of blocks that contains block r.
int aligned_first(int r, int count) { return r & ~(count - 1); }

}  // namespace

void run_schedule(Communicator& comm, Schedule& schedule, size_t look_ahead) {
  const bool independent = comm.independent_messages();
  auto tag_of = [&](size_t k) { return schedule[k].tag >= 0 ? schedule[k].tag : static_cast<int>(k); };
  std::vector<MessageList> recvs(schedule.size());
  size_t posted = 0;  // rounds whose receives are posted
  auto post_recvs_until = [&](size_t end) {
    for (; posted < std::min(end, schedule.size()); ++posted) {
      for (auto& t : schedule[posted].recvs) {
        if (t.tensor.numel() > 0) recvs[posted].push_back(comm.irecv(t.tensor, t.peer, tag_of(posted)));
      }
    }
  };
  auto abort_from = [&](size_t first) {
    for (size_t j = first; j < recvs.size(); ++j) abort_all(recvs[j]);
  };
  try {
    if (independent) post_recvs_until(look_ahead);
    comm.settle_header();  // no payload leaves before every rank agreed (Note [Collective checks])
  } catch (...) {
    abort_from(0);
    throw;
  }
  for (size_t k = 0; k < schedule.size(); ++k) {
    MessageList& current = recvs[k];
    if (!independent) {
      comm.start_group();
      post_recvs_until(k + 1);
    }
    for (auto& t : schedule[k].sends) {
      if (t.tensor.numel() > 0) current.push_back(comm.isend(t.tensor, t.peer, tag_of(k)));
    }
    if (independent) {
      post_recvs_until(k + 1 + look_ahead);
    } else {
      current.clear();
      current.push_back(comm.end_group());
    }
    try {
      comm.wait(current);
    } catch (...) {
      abort_from(k + 1);
      throw;
    }
    if (schedule[k].then) schedule[k].then();
  }
}

Schedule ring_schedule(const at::Tensor& flat, ReduceOp op, int n, int r) {
  const int right = (r + 1) % n;
  const int left = (r + n - 1) % n;
  const BalancedSplit chunks{flat.numel(), n};
  auto chunk = [=](int64_t i) { return flat.narrow(0, chunks.start(i), chunks.length(i)); };
  // One scratch chunk per reduce-scatter step, so that every receive of the ring can be posted at the
  // start (Note [Ring receives up front]).
  at::Tensor scratch = at::empty({std::max(n - 1, 1), chunks.max_length()}, flat.options());
  Schedule schedule;
  for (int step = 0; step < n - 1; ++step) {
    const int send_index = (r - step + n) % n;
    const int recv_index = (r - step - 1 + 2 * n) % n;
    at::Tensor incoming = scratch[step].narrow(0, 0, chunks.length(recv_index));
    at::Tensor target = chunk(recv_index);
    const bool last = step == n - 2;
    schedule.push_back(Round{{{chunk(send_index), right}}, {{incoming, left}}, [=]() mutable {
                               combine_(target, incoming, op);
                               if (last) finish_reduction_(target, op, n);  // target is now the owned chunk r+1
                             }});
  }
  for (int step = 0; step < n - 1; ++step) {
    schedule.push_back(Round{{{chunk((r + 1 - step + n) % n), right}}, {{chunk((r - step + n) % n), left}}, {}});
  }
  return schedule;
}

Schedule butterfly_schedule(const at::Tensor& flat, ReduceOp op, int n, int r) {
  const BalancedSplit chunks{flat.numel(), n};
  auto chunk = [=](int64_t i) { return flat.narrow(0, chunks.start(i), chunks.length(i)); };
  at::Tensor owned = chunk(r);
  at::Tensor received = at::empty({n, chunks.length(r)}, flat.options());
  Round scatter_reduce, all_gather;
  for (int peer = 0; peer < n; ++peer) {
    if (peer == r) continue;
    scatter_reduce.sends.push_back({chunk(peer), peer});
    scatter_reduce.recvs.push_back({received[peer], peer});
    all_gather.sends.push_back({owned, peer});
    all_gather.recvs.push_back({chunk(peer), peer});
  }
  scatter_reduce.then = [=]() mutable {
    for (int peer = 0; peer < n; ++peer) {
      if (peer != r) combine_(owned, received[peer], op);
    }
    finish_reduction_(owned, op, n);
  };
  return {scatter_reduce, all_gather};
}

namespace {

// kStar and kGatherScatter: everything through rank 0, which reduces with `reduce_on_root`.
Schedule rooted_schedule(const at::Tensor& flat, int n, int r, std::function<void(const at::Tensor&)> reduce_on_root) {
  constexpr int kRoot = 0;
  if (r != kRoot) return {Round{{{flat, kRoot}}, {}, {}}, Round{{}, {{flat, kRoot}}, {}}};
  at::Tensor gathered = at::empty({n, flat.numel()}, flat.options());
  Round gather_round, send_round;
  for (int peer = 1; peer < n; ++peer) {
    gather_round.recvs.push_back({gathered[peer], peer});
    send_round.sends.push_back({flat, peer});
  }
  gather_round.then = [=]() { reduce_on_root(gathered); };
  return {gather_round, send_round};
}

}  // namespace

Schedule star_schedule(const at::Tensor& flat, ReduceOp op, int n, int r) {
  return rooted_schedule(flat, n, r, [=](const at::Tensor& gathered) mutable {
    for (int peer = 1; peer < n; ++peer) combine_(flat, gathered[peer], op);
    finish_reduction_(flat, op, n);
  });
}

Schedule gather_scatter_schedule(const at::Tensor& flat, ReduceOp op, int n, int r) {
  // The parameter server: rank 0 reduces the gathered [n, N] buffer row by row, in rank order, with
  // the same reduction as every other path (Note [Reductions]), then sends the result back.
  return rooted_schedule(flat, n, r, [=](const at::Tensor& gathered) mutable {
    gathered[0].copy_(flat);
    at::Tensor total = gathered[0];
    for (int peer = 1; peer < n; ++peer) combine_(total, gathered[peer], op);
    finish_reduction_(total, op, n);
    flat.copy_(total);
  });
}

namespace {

// Note [Folding to a power of two]
// With p the largest power of two <= n and extra = n - p, each even rank r < 2·extra hands its
// vector to r+1 and sits out; the p remaining ranks run the power-of-two algorithm under the
// folded rank q (r/2 for the odd ranks of the folded region, r - extra above it), then every odd
// rank of the folded region returns the result to r-1. Fold and unfold are the first and last
// rounds of every rank's schedule (empty where a rank has no part in them), so round tags agree.
struct Fold {
  int rank;
  int extra;
  int p;
  bool sits_out() const { return rank < 2 * extra && rank % 2 == 0; }
  bool in_pair() const { return rank < 2 * extra; }
  int folded_rank() const { return in_pair() ? rank / 2 : rank - extra; }
  int real_rank(int q) const { return q < extra ? 2 * q + 1 : q + extra; }
};

Fold make_fold(int n, int r) {
  return Fold{r, n - static_cast<int>(std::bit_floor(static_cast<unsigned>(n))),
              static_cast<int>(std::bit_floor(static_cast<unsigned>(n)))};
}

// Wraps `core` (the rounds of the power-of-two algorithm, run by every rank that does not sit out)
// with the fold and unfold rounds; `rounds_in_core` keeps every rank's round numbering aligned.
// The fold receives into `scratch`, so core round i (schedule round i+1) must receive elsewhere:
// the schedules alternate scratch[(i + 1) % 2] and pass scratch[0] here.
Schedule folded_schedule(const at::Tensor& flat, ReduceOp op, const Fold& f, at::Tensor scratch, Schedule core,
                         size_t rounds_in_core) {
  Round fold_round, unfold_round;
  if (f.sits_out()) {
    fold_round.sends.push_back({flat, f.rank + 1});
    unfold_round.recvs.push_back({flat, f.rank + 1});
  } else if (f.in_pair()) {
    at::Tensor incoming = scratch.narrow(0, 0, flat.numel());
    fold_round.recvs.push_back({incoming, f.rank - 1});
    fold_round.then = [=]() mutable { combine_(flat, incoming, op); };
    unfold_round.sends.push_back({flat, f.rank - 1});
  }
  Schedule schedule{fold_round};
  if (f.sits_out()) {
    schedule.resize(1 + rounds_in_core);
  } else {
    TORCH_INTERNAL_ASSERT(core.size() == rounds_in_core);
    schedule.insert(schedule.end(), core.begin(), core.end());
  }
  schedule.push_back(unfold_round);
  return schedule;
}

size_t log2_of(int p) { return static_cast<size_t>(std::countr_zero(static_cast<unsigned>(p))); }

}  // namespace

Schedule recursive_doubling_schedule(const at::Tensor& flat, ReduceOp op, int n, int r) {
  const Fold f = make_fold(n, r);
  at::Tensor scratch = at::empty({2, flat.numel()}, flat.options());
  Schedule core;
  if (!f.sits_out()) {
    const int q = f.folded_rank();
    for (int mask = 1; mask < f.p; mask <<= 1) {
      const int partner = f.real_rank(q ^ mask);
      at::Tensor incoming = scratch[(core.size() + 1) % 2];
      const bool last = (mask << 1) >= f.p;
      // Both ranks of the pair compute the same sum: the lower rank's operand first (Note [Reductions]).
      const bool partner_first = partner < r;
      core.push_back(Round{{{flat, partner}}, {{incoming, partner}}, [=]() mutable {
                             combine_(flat, incoming, op, partner_first);
                             if (last) finish_reduction_(flat, op, n);
                           }});
    }
    if (core.empty()) core.push_back(Round{{}, {}, [=]() mutable { finish_reduction_(flat, op, n); }});
  }
  return folded_schedule(flat, op, f, scratch[0], std::move(core), std::max<size_t>(1, log2_of(f.p)));
}

Schedule halving_doubling_schedule(const at::Tensor& flat, ReduceOp op, int n, int r) {
  const Fold f = make_fold(n, r);
  at::Tensor scratch = at::empty({2, flat.numel()}, flat.options());
  Schedule core;
  if (!f.sits_out()) {
    const int q = f.folded_rank();
    const BalancedSplit chunks{flat.numel(), f.p};
    auto range = [=](int lo, int hi) { return slice(flat, chunks.start(lo), chunks.start(hi)); };
    int lo = 0, hi = f.p;
    // Reduce-scatter by recursive halving: keep the half holding chunk q, hand the other half over.
    for (int mask = f.p / 2; mask >= 1; mask /= 2) {
      const int partner = f.real_rank(q ^ mask);
      const int mid = lo + mask;
      const bool keep_low = q < mid;
      at::Tensor kept = keep_low ? range(lo, mid) : range(mid, hi);
      at::Tensor given = keep_low ? range(mid, hi) : range(lo, mid);
      at::Tensor incoming = scratch[(core.size() + 1) % 2].narrow(0, 0, kept.numel());
      const bool last = mask == 1;
      core.push_back(Round{{{given, partner}}, {{incoming, partner}}, [=]() mutable {
                             combine_(kept, incoming, op);
                             if (last) finish_reduction_(kept, op, n);  // kept is now chunk q
                           }});
      if (keep_low)
        hi = mid;
      else
        lo = mid;
    }
    // All-gather by recursive doubling: swap the block held so far with the partner's adjacent one.
    for (int mask = 1; mask < f.p; mask <<= 1) {
      const int partner = f.real_rank(q ^ mask);
      const bool partner_below = (q & mask) != 0;
      const int their_lo = partner_below ? lo - mask : hi;
      const int their_hi = partner_below ? lo : hi + mask;
      core.push_back(Round{{{range(lo, hi), partner}}, {{range(their_lo, their_hi), partner}}, {}});
      lo = std::min(lo, their_lo);
      hi = std::max(hi, their_hi);
    }
    if (core.empty()) core.push_back(Round{{}, {}, [=]() mutable { finish_reduction_(flat, op, n); }});
  }
  return folded_schedule(flat, op, f, scratch[0], std::move(core), std::max<size_t>(1, 2 * log2_of(f.p)));
}

Schedule reduce_schedule(const at::Tensor& flat, ReduceOp op, int n, int r, int root) {
  const int relative = (r - root + n) % n;
  auto real = [=](int rel) { return (rel + root) % n; };
  at::Tensor scratch;
  Schedule schedule;
  for (int mask = 1; mask < n; mask <<= 1) {
    if (relative & mask) {
      schedule.push_back(Round{{{flat, real(relative - mask)}}, {}, {}, 0});
      break;
    }
    if (relative + mask < n) {
      if (!scratch.defined()) scratch = at::empty({2, flat.numel()}, flat.options());
      at::Tensor incoming = scratch[schedule.size() % 2];
      schedule.push_back(
          Round{{}, {{incoming, real(relative + mask)}}, [=]() mutable { combine_(flat, incoming, op); }, 0});
    }
  }
  return schedule;
}

Schedule broadcast_schedule(const at::Tensor& tensor, int n, int r, int root) {
  const int relative = (r - root + n) % n;
  auto real = [=](int rel) { return (rel + root) % n; };
  Round from_parent{{}, {}, {}, 0}, to_children{{}, {}, {}, 0};
  int mask = 1;
  for (; mask < n; mask <<= 1) {
    if (relative & mask) {
      from_parent.recvs.push_back({tensor, real(relative - mask)});
      break;
    }
  }
  for (mask >>= 1; mask > 0; mask >>= 1) {
    if (relative + mask < n) to_children.sends.push_back({tensor, real(relative + mask)});
  }
  return {from_parent, to_children};
}

Schedule ring_reduce_scatter_schedule(const at::Tensor& acc, int64_t m, ReduceOp op, int n, int r) {
  auto block = [=](int b) { return slice(acc, ((b % n + n) % n) * m, ((b % n + n) % n + 1) * m); };
  // Round t: send the partial sum of block r-t-1 to the right, add the left's partial sum of block
  // r-t-2 to ours. Two scratch blocks alternate: round t+1's receive, posted ahead, never lands in
  // round t's.
  at::Tensor scratch = at::empty({2, m}, acc.options());
  Schedule schedule;
  for (int t = 0; t < n - 1; ++t) {
    at::Tensor incoming = scratch[t % 2];
    at::Tensor into = block(r - t - 2);
    schedule.push_back(Round{
        {{block(r - t - 1), (r + 1) % n}}, {{incoming, (r - 1 + n) % n}}, [=]() { combine_(into, incoming, op); }, t});
  }
  return schedule;
}

// Round t sends block r-t to the right and receives block r-t-1 from the left.
Schedule ring_all_gather_schedule(const at::Tensor& flat, int64_t m, int n, int r) {
  auto block = [=](int b) { return slice(flat, ((b % n + n) % n) * m, ((b % n + n) % n + 1) * m); };
  Schedule schedule;
  for (int t = 0; t < n - 1; ++t) {
    schedule.push_back(Round{{{block(r - t), (r + 1) % n}}, {{block(r - t - 1), (r - 1 + n) % n}}, {}, t});
  }
  return schedule;
}

// Recursive doubling, n a power of two: with the partner r^d, exchange the aligned runs of d blocks
// each holds; after log2(n) rounds every rank holds all n.
Schedule doubling_all_gather_schedule(const at::Tensor& flat, int64_t m, int n, int r) {
  auto run = [=](int first, int count) { return slice(flat, first * m, (first + count) * m); };
  Schedule schedule;
  int round = 0;
  for (int d = 1; d < n; d <<= 1, ++round) {
    const int partner = r ^ d;
    schedule.push_back(
        Round{{{run(aligned_first(r, d), d), partner}}, {{run(aligned_first(partner, d), d), partner}}, {}, round});
  }
  return schedule;
}

// Recursive halving: with the partner r^d (d = n/2, n/4, ..., 1), keep the half of the current
// aligned run of 2d blocks that holds block r, send the other half's partial sums to the partner and
// add the partner's partial sums of the kept half. Two scratch buffers alternate, as in the ring.
Schedule halving_reduce_scatter_schedule(const at::Tensor& acc, int64_t m, ReduceOp op, int n, int r) {
  auto run = [=](int first, int count) { return slice(acc, first * m, (first + count) * m); };
  at::Tensor scratch = at::empty({2, (n / 2) * m}, acc.options());
  Schedule schedule;
  int round = 0;
  for (int d = n / 2; d >= 1; d >>= 1, ++round) {
    const int partner = r ^ d;
    at::Tensor incoming = scratch[round % 2].narrow(0, 0, d * m);
    at::Tensor kept = run(aligned_first(r, d), d);
    schedule.push_back(Round{{{run(aligned_first(partner, d), d), partner}},
                             {{incoming, partner}},
                             [=]() { combine_(kept, incoming, op); },
                             round});
  }
  return schedule;
}

}  // namespace ddpkit::comm
