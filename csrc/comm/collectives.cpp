#include "comm/collectives.h"

#include "testing/faults.h"
#include "comm/split.h"

#include <algorithm>
#include <bit>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace ddpkit::comm {
namespace {

at::Tensor slice(const at::Tensor& flat, int64_t begin, int64_t end) { return flat.narrow(0, begin, end - begin); }

// True when `part` is exactly block `rank` of `whole` (contiguous, the same dtype): the in-place
// forms torch's backends accept (Note [All-gather and reduce-scatter]).
bool is_own_block(const at::Tensor& whole, const at::Tensor& part, int rank) {
  const auto element = static_cast<intptr_t>(whole.element_size());
  return static_cast<const char*>(part.data_ptr()) ==
         static_cast<const char*>(whole.data_ptr()) + static_cast<intptr_t>(rank) * part.numel() * element;
}

// The blocks [first, first + count) of rank r's group of `count` ranks (count a power of two):
// the aligned run of blocks that contains block r.
int aligned_first(int r, int count) { return r & ~(count - 1); }

// The reason `tensor` cannot take part in a ddpkit collective, or "" when it can. Collectives that
// only move data (no `op`) take any dtype; reductions take the dtypes of collectives.h.
std::string tensor_error(const at::Tensor& tensor, std::string_view what, std::optional<ReduceOp> op) {
  if (!tensor.defined()) return c10::str("ddpkit.", what, ": expected a tensor, got None");
  if (tensor.layout() != at::kStrided) return c10::str("ddpkit.", what, ": expected a dense tensor, got layout ", tensor.layout());
  if (!tensor.is_contiguous()) {
    return c10::str("ddpkit.", what, ": expected a contiguous tensor (strides ", tensor.strides(),
                    " for shape ", tensor.sizes(), "); call .contiguous() first");
  }
  if (!op) return {};
  const auto dtype = tensor.scalar_type();
  const bool floating = dtype == at::kFloat || dtype == at::kDouble || dtype == at::kHalf || dtype == at::kBFloat16;
  const bool integral = dtype == at::kInt || dtype == at::kLong;
  if (!floating && !integral) {
    return c10::str("ddpkit.", what, ": unsupported dtype ", dtype,
                    "; supported: float32, float64, float16, bfloat16, int32, int64");
  }
  if (integral && op == ReduceOp::kMean) {
    return c10::str("ddpkit.", what, ": op 'mean' needs a floating-point tensor, got ", dtype);
  }
  return {};
}

std::string root_error(int root, int size, std::string_view what, std::string_view role) {
  if (root >= 0 && root < size) return {};
  return c10::str("ddpkit.", what, ": ", role, "=", root, " is not a rank of this group (size ", size, ")");
}

CollectiveHeader make_header(CollectiveKind kind, const at::Tensor& tensor, std::optional<ReduceOp> op,
                             std::optional<Algorithm> algorithm, int root) {
  CollectiveHeader header;
  header.kind = static_cast<int64_t>(kind);
  header.numel = tensor.defined() ? tensor.numel() : -1;
  header.dtype = tensor.defined() ? static_cast<int64_t>(tensor.scalar_type()) : -1;
  header.op = op ? static_cast<int64_t>(*op) : -1;
  header.algorithm = algorithm ? static_cast<int64_t>(*algorithm) : -1;
  header.root = root;
  return header;
}

// The dtype a reduction of `tensor` runs in: float16/bfloat16 in float32, the rest as they are.
at::ScalarType working_dtype(const at::Tensor& tensor) {
  const auto dtype = tensor.scalar_type();
  return dtype == at::kHalf || dtype == at::kBFloat16 ? at::kFloat : dtype;
}

size_t working_element_size(const at::Tensor& tensor) { return c10::elementSize(working_dtype(tensor)); }

// float16/bfloat16 are reduced in float32; everything else in place.
at::Tensor working_copy(const at::Tensor& tensor) {
  const auto dtype = tensor.scalar_type();
  if (dtype == at::kHalf || dtype == at::kBFloat16) return tensor.to(at::kFloat);
  return tensor;
}

void write_back(at::Tensor& tensor, const at::Tensor& work) {
  if (!work.is_same(tensor)) tensor.copy_(work);
}

// One round of a schedule: this rank's sends and receives, then local work on what arrived.
// Messages of round k carry round tag `tag` (default k); sender and receiver must agree on it.
struct Transfer {
  at::Tensor tensor;
  int peer;
};
struct Round {
  std::vector<Transfer> sends;
  std::vector<Transfer> recvs;
  std::function<void()> then;
  int tag = -1;
};
using Schedule = std::vector<Round>;

// Runs `schedule` with the receives of rounds k+1 .. k+look_ahead posted before round k is waited
// on (Note [Pre-posted receives]), or round by round in groups where the backend needs that.
void run_schedule(Communicator& comm, Schedule& schedule, size_t look_ahead = 1) {
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
      if (keep_low) hi = mid; else lo = mid;
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

// The binomial tree towards `root`: every rank combines its children's partial results into `flat`,
// then passes its own to its parent; `flat` of `root` ends with op over every rank's (before
// finish_reduction_), the others with partial results.
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
      schedule.push_back(Round{{}, {{incoming, real(relative + mask)}}, [=]() mutable { combine_(flat, incoming, op); }, 0});
    }
  }
  return schedule;
}

// The binomial tree from `root`, over ranks relative to it: receive `tensor` from the parent, then
// send it to the children (ceil(log2 n) rounds in all).
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

// The reduce-scatter halves of Note [All-gather and reduce-scatter] on `acc`: n blocks of m elements,
// partial sums accumulating in place. After the rounds block r holds op over every rank's block r
// (before finish_reduction_). The ring takes any n; halving-doubling a power of two.
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
    schedule.push_back(
        Round{{{block(r - t - 1), (r + 1) % n}}, {{incoming, (r - 1 + n) % n}}, [=]() { combine_(into, incoming, op); }, t});
  }
  return schedule;
}

// The all-gather halves of Note [All-gather and reduce-scatter] on `flat`: n blocks of m elements,
// block r already this rank's. After the rounds every block holds its rank's. Every receive lands in
// a block of its own, sent on only after it arrived, so all may be posted up front (Note [Ring
// receives up front]). The ring takes any n: round t sends block r-t to the right and receives block
// r-t-1 from the left.
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

}  // namespace

Algorithm parse_algorithm(std::string_view name) {
  for (size_t i = 0; i < kAlgorithmNames.size(); ++i) {
    if (kAlgorithmNames[i] == name) return static_cast<Algorithm>(i);
  }
  std::string expected;
  for (std::string_view known : kAlgorithmNames) expected += c10::str(expected.empty() ? "" : ", ", known);
  TORCH_CHECK(false, "ddpkit: unknown algorithm '", name, "'; expected one of ", expected);
}

std::string_view algorithm_name(Algorithm algorithm) {
  const auto index = static_cast<size_t>(algorithm);
  TORCH_INTERNAL_ASSERT(index < kAlgorithmNames.size(), "unknown algorithm ", index);
  return kAlgorithmNames[index];
}

Algorithm choose_algorithm(int64_t bytes, int world_size, c10::DeviceType device, bool shared_memory,
                           bool hierarchical, ReduceOp op) {
  if (device != c10::kCPU) return Algorithm::kProcessGroup;
  if (shared_memory) return Algorithm::kDirect;
  if (hierarchical) return Algorithm::kHierarchical;
  // Note [Choosing an algorithm]: small messages go through the star, large ones through the
  // schedules that spread the reduction evenly over the ranks.
  constexpr int64_t kStarMaxBytes = 512 * 1024;
  constexpr int64_t kStarBudgetBytes = 16 * 1024 * 1024;  // what rank 0 receives: (n-1)·bytes
  if (bytes <= kStarMaxBytes && static_cast<int64_t>(world_size - 1) * bytes <= kStarBudgetBytes) {
    return Algorithm::kStar;
  }
  if (op == ReduceOp::kSum || op == ReduceOp::kMean) return Algorithm::kProcessGroup;
  const bool power_of_two = (world_size & (world_size - 1)) == 0;
  return power_of_two ? Algorithm::kHalvingDoubling : Algorithm::kRing;
}

namespace {

// True when `tensor` lives on a device whose messages travel through host copies (Note [Device
// tensors on a host group]): the engine then gave the collective a CPU communicator.
bool staged(const at::Tensor& tensor, const Communicator& comm) {
  return tensor.defined() && tensor.device().type() != comm.device_type();
}

// A host copy of `tensor`, in pinned memory when it comes from a CUDA device: the driver copies
// pageable memory through a pinned bounce buffer of its own, so a pinned target is the faster copy
// both ways (gloo stages CUDA tensors in pinned memory too). The blocks come from torch's caching
// host allocator, so a warm DDP step allocates none. bench_ddp.py --device cuda measures it.
at::Tensor to_host(const at::Tensor& tensor) {
  if (!tensor.defined()) return tensor;
  if (!tensor.is_cuda()) return tensor.to(at::kCPU);
  at::Tensor host = at::empty_like(tensor, tensor.options().device(at::kCPU).pinned_memory(true));
  host.copy_(tensor);
  return host;
}

// Runs `collective` on a host copy of `tensor`, then copies the result back into `tensor`.
template <class Collective>
void on_host_copy(at::Tensor& tensor, Collective&& collective) {
  at::Tensor host = to_host(tensor);
  collective(host);
  tensor.copy_(host);
}

}  // namespace

namespace {

// An exception's message without the C++ backtrace a c10::Error carries.
std::string without_backtrace(const std::exception& e) {
  const auto* error = dynamic_cast<const c10::Error*>(&e);
  return error != nullptr ? error->what_without_backtrace() : e.what();
}

// "rank 2" or "ranks 2, 4": the ranks this one crosses hosts with, for errors.
std::string cross_ranks_text(const Hierarchy& h) {
  std::string ranks;
  for (int j = 0; j < h.cross_size; ++j) {
    if (j != h.cross_rank) ranks += c10::str(ranks.empty() ? "" : ", ", h.cross_ranks[j]);
  }
  return c10::str(h.cross_size > 2 ? "ranks " : "rank ", ranks);
}

// Runs `step` among the ranks `h.cross` spans; its failure raises naming them.
template <class Step>
void across_hosts(const Hierarchy& h, Communicator& comm, Step&& step) {
  try {
    step();
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "ddpkit.", comm.what(), " (", comm.where(), "): the step across hosts, with ",
                cross_ranks_text(h), ", failed: ", without_backtrace(e));
  }
}

// What a failure inside on_hosts' steps leaves of the links across hosts.
enum class OnFailure {
  kKeepLinks,  // the check's round, which still sends the partners this rank's words naming the failure
  kCutLinks,   // the data steps, after the check: the partners may be waiting for this rank's frames
};

// Runs steps of a hierarchical collective on this rank. A failure (a rank lost, a step across hosts
// that failed) stops this host's other ranks too, who may be waiting for this one inside the host,
// then raises here. With kCutLinks it also shuts the links across hosts down, so that a partner on
// another host waiting for this rank's frame raises at once instead of at the group's timeout (this
// rank is alive, so its connections would stay open). Among three hosts or more the sums cross on
// gloo's all-reduce, which nothing here can interrupt: those partners wait for the timeout.
template <class Steps>
void on_hosts(const Hierarchy& h, OnFailure on_failure, Steps&& steps) {
  try {
    steps();
  } catch (const std::exception& e) {
    if (DirectCollectives* local = h.local ? h.local->direct() : nullptr) local->abandon(without_backtrace(e));
    if (on_failure == OnFailure::kCutLinks && h.links) h.links->break_off(without_backtrace(e));
    throw;
  }
}

// A communicator for ddpkit's own schedules among the ranks `h.cross` spans, as part of `comm`'s
// collective (its sequence number, so its tags).
Communicator cross_communicator(const Hierarchy& h, const Communicator& comm) {
  return Communicator(h.cross_rank, h.cross_size, c10::kCPU, h.cross, h.cross_messages, comm.sequence(), comm.group());
}

// The part of a frame across two hosts reduced at a time while the rest arrives: reducing parts as
// they land beat reducing once everything is in, unshaped and at 1 Gbit/s, and 256 KiB parts beat
// 1 MiB ones at 1M floats while tying at 16M (bench_multihost.py's 2x1 points, the part size
// changed by hand).
constexpr int64_t kSwapStepBytes = 256 << 10;

// The steps across two hosts (h.cross_size == 2) move over the socket links (Note [Socket links]):
// `sends` go to the other host while its frame of exactly `mine`'s size arrives and is reduced into
// `mine` (contiguous) part by part, in host order, so that both hosts reduce to the same bits. A
// part is reduced once it is in and, where `sends` reads `mine`, once this rank's copy of it has
// left. A kMean is summed; the caller divides once. A peer that passed another size breaks the links
// (with checks off), and both ranks raise, naming the sizes.
void receive_and_combine_across_two_hosts(const at::Tensor& mine, ReduceOp op, std::vector<SocketLinks::Send> sends,
                                          const Hierarchy& h, Communicator& comm) {
  TORCH_INTERNAL_ASSERT(h.cross_size == 2 && mine.is_contiguous());
  const int peer = 1 - h.cross_rank;
  const int64_t element = mine.element_size();
  const int64_t bytes = mine.numel() * element;
  const ReduceOp sum_or_op = op == ReduceOp::kMean ? ReduceOp::kSum : op;
  at::Tensor theirs = h.scratch.get(ScratchBuffers::kFromPeer, mine.numel(), mine.scalar_type());
  int64_t reduced = 0;  // elements
  auto reduce_ready = [&](int64_t ready_bytes) {
    const int64_t ready = ready_bytes / element;
    combine_(slice(mine, reduced, ready), slice(theirs, reduced, ready), sum_or_op, /*other_first=*/peer == 0);
    reduced = ready;
  };
  std::vector<SocketLinks::Recv> recvs{{peer, theirs.data_ptr(), bytes, 0, reduce_ready, kSwapStepBytes, bytes}};
  h.links->exchange(comm.sequence(), std::move(sends), recvs);
  TORCH_INTERNAL_ASSERT(reduced == mine.numel());
}

// Between two hosts, sends `outgoing` (null: nothing) to the other host while its frame of exactly
// `incoming`'s size (undefined: none) arrives into `incoming`, both contiguous, over the socket links.
void move_across_two_hosts(const at::Tensor& outgoing, const at::Tensor& incoming, const Hierarchy& h,
                           Communicator& comm) {
  TORCH_INTERNAL_ASSERT(h.cross_size == 2);
  const int peer = 1 - h.cross_rank;
  std::vector<SocketLinks::Send> sends;
  if (outgoing.defined()) sends.push_back({peer, outgoing.data_ptr(), static_cast<int64_t>(outgoing.nbytes())});
  std::vector<SocketLinks::Recv> recvs;
  if (incoming.defined()) {
    const auto bytes = static_cast<int64_t>(incoming.nbytes());
    recvs.push_back({peer, incoming.data_ptr(), bytes, 0, nullptr, 0, bytes});
  }
  h.links->exchange(comm.sequence(), std::move(sends), recvs);
}

// The all-reduce of `block` (contiguous) among the ranks `h.cross` spans (one per host), in place
// (Note [Hierarchical collectives]): between two hosts a swap over the socket links, each host
// sending the other its block whole, both ways at once, then both reducing the two in host order (each
// link carries the block once each way, as a ring's reduce-scatter and all-gather together would);
// else gloo's own for sums, ddpkit's ring for max and min. A kMean is summed here; the caller
// divides once.
void cross_host_all_reduce(const at::Tensor& block, ReduceOp op, const Hierarchy& h, Communicator& comm) {
  if (h.cross_size == 1 || block.numel() == 0) return;
  across_hosts(h, comm, [&] {
    if (h.cross_size == 2) {
      const int peer = 1 - h.cross_rank;
      receive_and_combine_across_two_hosts(block, op, {{peer, block.data_ptr(), block.numel() * block.element_size()}},
                                           h, comm);
      return;
    }
    if (op == ReduceOp::kSum || op == ReduceOp::kMean) {
      c10d::AllreduceOptions options;
      options.reduceOp = c10d::ReduceOp::SUM;
      std::vector<at::Tensor> tensors{block};
      h.cross->allreduce(tensors, options)->wait();
      return;
    }
    Communicator cross = cross_communicator(h, comm);
    Schedule schedule = ring_schedule(block, op, h.cross_size, h.cross_rank);
    run_schedule(cross, schedule, schedule.size());
  });
}

// Each rank's words in the check across hosts (Note [Hierarchical collectives]): its own header,
// its host's culprit (-1: none) with the culprit's header and its host's first header, so that
// every rank of every host can name it, then the rank its host lost (-1: none).
constexpr int64_t kCheckWords = 3 * kHeaderWords + 2;
constexpr int64_t kLostRankWord = 3 * kHeaderWords + 1;  // the last of them

// The rank this host lost when a step of its shared memory failed: the rank its transport saw fail,
// else this one (its own step gave up).
int64_t lost_rank(DirectCollectives* local, const Communicator& comm) {
  const int failed = local != nullptr ? local->failed_rank() : -1;
  return failed >= 0 ? failed : comm.rank();
}

// This rank's part of the check: one step over its host's shared memory, and its words.
struct HostCheck {
  CollectiveHeader stamped;
  std::string host_error;  // the host's step failed (a rank died or gave up): its ranks still tell their partners
  at::Tensor words;        // kCheckWords int64
};

HostCheck check_host(const CollectiveHeader& header, const std::string& error, const Hierarchy& h, Communicator& comm) {
  DirectCollectives* local = h.local ? h.local->direct() : nullptr;
  HostCheck check{comm.stamp(header, error), {}, at::zeros({kCheckWords}, at::kLong)};
  std::vector<CollectiveHeader> host{check.stamped};
  int64_t lost = -1;
  if (local != nullptr) {
    try {
      host = local->exchange_headers(check.stamped, comm.what());
    } catch (const std::exception& e) {
      check.host_error = without_backtrace(e);
      lost = lost_rank(local, comm);
      host = {check.stamped};
    }
  }
  int culprit = -1;  // the first of the host's headers that differs from its first (or was rejected)
  for (size_t i = 0; i < host.size() && culprit < 0; ++i) {
    if (host[i].magic != kHeaderMagic || !describe_mismatch(0, host[i], host[0], comm.what()).empty()) {
      culprit = static_cast<int>(i);
    }
  }
  int64_t* out = check.words.data_ptr<int64_t>();
  std::memcpy(out, &check.stamped, sizeof(CollectiveHeader));
  out[kHeaderWords] = culprit < 0 ? -1 : (local != nullptr ? local->group_rank(culprit) : comm.rank());
  if (culprit >= 0) {
    std::memcpy(out + kHeaderWords + 1, &host[culprit], sizeof(CollectiveHeader));
    std::memcpy(out + 2 * kHeaderWords + 1, &host[0], sizeof(CollectiveHeader));
  }
  out[kLostRankWord] = lost;
  return check;
}

// Raises, alike on every rank, unless every host's words (`words_of(j)` for cross rank j, null where
// they never came) say that all agree.
template <class WordsOf>
void verify_hosts(const HostCheck& check, const std::string& error, WordsOf words_of, const Hierarchy& h,
                  Communicator& comm) {
  TORCH_CHECK(check.host_error.empty(), check.host_error);
  TORCH_CHECK(error.empty(), error);  // this rank's own rejection, before anyone else's
  auto header_at = [](const int64_t* at) {
    CollectiveHeader value;
    std::memcpy(static_cast<void*>(&value), at, sizeof(CollectiveHeader));
    return value;
  };
  for (int j = 0; j < h.cross_size; ++j) {  // a rank lost on another host first
    const int64_t* theirs = words_of(j);
    if (theirs == nullptr) continue;
    const int64_t lost = theirs[kLostRankWord];
    TORCH_CHECK(lost < 0, "ddpkit.", comm.what(), " (", comm.where(), "): rank ", lost,
                " failed on its host: the process died or its transport gave up (rank ", h.cross_ranks[j],
                " reported it)");
  }
  for (int j = 0; j < h.cross_size; ++j) {  // then a culprit on some host: its host saw how it differs
    const int64_t* theirs = words_of(j);
    if (theirs == nullptr || theirs[kHeaderWords] < 0) continue;
    const int rank = static_cast<int>(theirs[kHeaderWords]);
    const CollectiveHeader bad = header_at(theirs + kHeaderWords + 1);
    TORCH_CHECK(bad.magic == kHeaderMagic, "ddpkit.", comm.what(), ": rank ", rank,
                " rejected its arguments (its own error says why)");
    const int host_first = h.topology.hosts[h.topology.host_of[rank]].front();
    TORCH_CHECK(false, describe_mismatch(rank, bad, header_at(theirs + 2 * kHeaderWords + 1), comm.what(), host_first));
  }
  for (int j = 0; j < h.cross_size; ++j) {  // else the hosts' own headers, against this rank's
    const int64_t* theirs = words_of(j);
    if (theirs == nullptr) continue;
    const std::string mismatch =
        describe_mismatch(h.cross_ranks[j], header_at(theirs), check.stamped, comm.what(), comm.rank());
    TORCH_CHECK(mismatch.empty(), mismatch);
  }
}

// Up to this many bytes of payload ride in the one round of the check across hosts (Note [One round
// across hosts]).
constexpr int64_t kOneRoundMaxBytes = 64 * 1024;

// Each rank's check words as bytes, the start of its message in a round across hosts.
constexpr int64_t kCheckBytes = kCheckWords * static_cast<int64_t>(sizeof(int64_t));
// The center's reply starts with its status and, after a failure, the group's rank that failed.
constexpr int64_t kReplyOk = 0;
constexpr int64_t kReplyPartnerFailed = 1;
constexpr int64_t kReplyPrefixBytes = 2 * static_cast<int64_t>(sizeof(int64_t));

// The check across equal hosts, carrying data (Note [One round across hosts]), through the cross rank
// `center`: this rank's step of its host's shared memory, then `payload_of()` (bytes, at most
// kOneRoundMaxBytes; called only where every rank of its host agreed, so it may take a step inside the
// host), which every other rank sends the center after its words. The center, once every partner's
// message is in, answers each with every rank's words and, where all agree, `reply_of(payloads)` (the
// payloads by cross rank, each a receive buffer the caller narrows to the agreed size; bytes, at most
// cross_size·kOneRoundMaxBytes). Then verify_hosts raises alike on every rank unless all agree.
// Returns the reply's payload (a receive buffer, likewise).
template <class PayloadOf, class ReplyOf>
at::Tensor check_in_one_round(const CollectiveHeader& header, const std::string& error, int center,
                              const Hierarchy& h, Communicator& comm, PayloadOf&& payload_of, ReplyOf&& reply_of) {
  HostCheck check = check_host(header, error, h, comm);
  const bool host_agrees = check.host_error.empty() && check.words.data_ptr<int64_t>()[kHeaderWords] < 0;
  at::Tensor payload = at::empty({0}, at::kByte);
  if (host_agrees) {
    try {
      payload = payload_of().contiguous();  // sent from its memory as it is
    } catch (const std::exception& e) {
      // A rank of this host failed during its step: the partners still get this rank's words, which
      // name the lost rank, so that every rank of every host raises now rather than at the timeout.
      check.host_error = without_backtrace(e);
      check.words.data_ptr<int64_t>()[kLostRankWord] = lost_rank(h.local ? h.local->direct() : nullptr, comm);
    }
  }
  TORCH_INTERNAL_ASSERT(payload.scalar_type() == at::kByte && payload.numel() <= kOneRoundMaxBytes);
  const int partners = h.cross_size;
  at::Tensor words = at::empty({partners * kCheckWords}, at::kLong);
  auto words_of = [&](int j) { return static_cast<const int64_t*>(words.data_ptr<int64_t>()) + j * kCheckWords; };
  std::memcpy(words.data_ptr<int64_t>() + h.cross_rank * kCheckWords, check.words.data_ptr(), kCheckBytes);
  at::Tensor reply;
  SocketLinks& links = *h.links;
  on_hosts(h, OnFailure::kKeepLinks, [&] {
    across_hosts(h, comm, [&] {
      if (h.cross_rank != center) {
        at::Tensor answer = at::empty({kReplyPrefixBytes + partners * (kCheckBytes + kOneRoundMaxBytes)}, at::kByte);
        std::vector<SocketLinks::Recv> recvs{{center, answer.data_ptr(), answer.numel()}};
        recvs[0].minimum = kReplyPrefixBytes;
        links.exchange(comm.sequence(),
                       {{center, check.words.data_ptr(), kCheckBytes, payload.data_ptr(), payload.numel()}}, recvs);
        const auto* prefix = static_cast<const int64_t*>(answer.data_ptr());
        TORCH_CHECK(prefix[0] == kReplyOk, "rank ", prefix[1], " failed or died during the check (rank ",
                    h.cross_ranks[center], " reported it)");
        TORCH_CHECK(recvs[0].received >= kReplyPrefixBytes + partners * kCheckBytes, "rank ", h.cross_ranks[center],
                    " sent a short answer");
        std::memcpy(words.data_ptr(), static_cast<const char*>(answer.data_ptr()) + kReplyPrefixBytes,
                    partners * kCheckBytes);
        reply = answer.narrow(0, kReplyPrefixBytes + partners * kCheckBytes,
                              recvs[0].received - kReplyPrefixBytes - partners * kCheckBytes);
        return;
      }
      std::vector<at::Tensor> payloads(partners);
      std::vector<SocketLinks::Recv> recvs;
      for (int j = 0; j < partners; ++j) {
        if (j == center) continue;
        payloads[j] = at::empty({kCheckBytes + kOneRoundMaxBytes}, at::kByte);
        recvs.push_back({j, payloads[j].data_ptr(), payloads[j].numel()});
        recvs.back().minimum = kCheckBytes;
      }
      try {
        links.exchange(comm.sequence(), {}, recvs);
      } catch (const std::exception&) {
        // Best effort: the partners still waiting learn at once which rank failed, not at the timeout.
        // The links are broken from here on, so this goes to each partner over its own socket.
        const int failed = links.failed_peer();
        const int64_t failure[2] = {kReplyPartnerFailed, failed >= 0 ? h.cross_ranks[failed] : -1};
        for (int j = 0; j < partners; ++j) {
          if (j == center || j == failed) continue;
          links.send_last_words(comm.sequence(), j, failure, sizeof(failure));
        }
        links.shut_down();
        throw;
      }
      for (const SocketLinks::Recv& recv : recvs) {
        std::memcpy(words.data_ptr<int64_t>() + recv.peer * kCheckWords, payloads[recv.peer].data_ptr(), kCheckBytes);
        payloads[recv.peer] = payloads[recv.peer].narrow(0, kCheckBytes, recv.received - kCheckBytes);
      }
      payloads[center] = payload;
      bool agree = true;
      try {
        verify_hosts(check, error, words_of, h, comm);
      } catch (const c10::Error&) {
        agree = false;  // raised below, on every rank alike
      }
      const at::Tensor out = agree ? reply_of(payloads) : at::empty({0}, at::kByte);
      TORCH_INTERNAL_ASSERT(out.scalar_type() == at::kByte && out.numel() <= partners * kOneRoundMaxBytes &&
                            out.is_contiguous());
      const int64_t prefix[2] = {kReplyOk, -1};
      reply = out;
      std::vector<SocketLinks::Send> sends;
      at::Tensor head = at::empty({kReplyPrefixBytes + partners * kCheckBytes}, at::kByte);
      std::memcpy(head.data_ptr(), prefix, kReplyPrefixBytes);
      std::memcpy(static_cast<char*>(head.data_ptr()) + kReplyPrefixBytes, words.data_ptr(), partners * kCheckBytes);
      for (int j = 0; j < partners; ++j) {
        if (j != center) sends.push_back({j, head.data_ptr(), head.numel(), out.data_ptr(), out.numel()});
      }
      std::vector<SocketLinks::Recv> none;
      links.exchange(comm.sequence(), std::move(sends), none);
    });
  });
  verify_hosts(check, error, words_of, h, comm);
  return reply;
}

// A round across hosts that carries nothing back.
at::Tensor no_reply(const std::vector<at::Tensor>&) { return at::empty({0}, at::kByte); }

// True when `bytes` fit one round across hosts and the check may carry them: checks on, equal hosts,
// this rank's arguments accepted.
bool fits_one_round(int64_t bytes, const std::string& error, const Hierarchy& h) {
  return is_checked() && h.uniform && error.empty() && bytes <= kOneRoundMaxBytes;
}

}  // namespace

// check_in_one_round with no payload; every rank agrees with every other by transitivity, or every
// rank raises.
void hierarchical_check(const CollectiveHeader& header, const std::string& error, const Hierarchy& h,
                        Communicator& comm) {
  comm.note_collective(static_cast<CollectiveKind>(header.kind));
  DirectCollectives* local = h.local ? h.local->direct() : nullptr;
  if (!is_checked()) {
    if (!error.empty() && local != nullptr) local->reject_unchecked(comm.what());
    TORCH_CHECK(error.empty(), error);
    return;
  }
  check_in_one_round(header, error, /*center=*/0, h, comm, [] { return at::empty({0}, at::kByte); }, no_reply);
}

namespace {

// Small all-reduces of kHierarchical with equal hosts (fits_one_round): the host's all-reduce over
// shared memory after the check's step, its result to the center in the check's round, and the
// center's reply with the hosts' results reduced in host order. `header` may be a reduce's or a reduce-scatter's,
// which take this path on a copy when small. Returns false, doing nothing, where it does not apply;
// else runs the whole collective (counted) and returns true.
bool hierarchical_all_reduce_in_one_round(const at::Tensor& tensor, ReduceOp op, const CollectiveHeader& header,
                                          const std::string& error, const Hierarchy& h, Communicator& comm) {
  if (!error.empty() ||
      !fits_one_round(tensor.numel() * static_cast<int64_t>(working_element_size(tensor)), error, h)) {
    return false;
  }
  comm.note_collective(static_cast<CollectiveKind>(header.kind));
  DirectCollectives* local = h.local ? h.local->direct() : nullptr;
  // A copy whatever the dtype: the host's all-reduce runs before the round has compared every host's
  // header, and a call that another host disagrees with must leave the tensor as it was (Note
  // [Collective checks]). At most kOneRoundMaxBytes.
  at::Tensor work = working_copy(tensor);
  if (work.is_same(tensor)) work = tensor.clone();
  at::Tensor flat = work.view(-1);
  const ReduceOp sum_or_op = op == ReduceOp::kMean ? ReduceOp::kSum : op;
  // The host's result on every rank of the host, then to the center with the check's words; the
  // center reduces the hosts' results in host order and answers with the total: the same bits everywhere.
  const int64_t data_bytes = flat.numel() * static_cast<int64_t>(flat.element_size());
  const at::Tensor reply = check_in_one_round(
      header, error, /*center=*/0, h, comm,
      [&] {
        DDPKIT_DIE_IF_FAULT_ARMED("die_in_host_step", comm.rank());
        if (local != nullptr && flat.numel() > 0) {
          on_hosts(h, OnFailure::kKeepLinks,
                   [&] { local->all_reduce(flat, sum_or_op, comm.stamp(header, {}), {}, /*checked=*/false); });
        }
        return flat.view(at::kByte);
      },
      [&](const std::vector<at::Tensor>& payloads) {
        at::Tensor total = payloads[0].narrow(0, 0, data_bytes).view(flat.scalar_type()).clone();
        for (size_t j = 1; j < payloads.size(); ++j) {
          combine_(total, payloads[j].narrow(0, 0, data_bytes).view(flat.scalar_type()), sum_or_op);
        }
        finish_reduction_(total, op, comm.size());
        return total.view(at::kByte);
      });
  if (data_bytes > 0) flat.view(at::kByte).copy_(reply.narrow(0, 0, data_bytes));
  write_back(const_cast<at::Tensor&>(tensor), work);
  return true;
}

// `flat` in one slice per rank of this host (Horovod's split), padded with zeros in a scratch buffer
// where the host's size does not divide it.
struct HostSlices {
  at::Tensor padded;  // `flat`, or its padded copy
  at::Tensor mine;    // this rank's slice of `padded`
};

// The host's reduce-scatter of `flat` (unchecked: the check already ran): this rank's slice then
// holds `op` over the host's slices.
HostSlices reduce_scatter_in_host(const at::Tensor& flat, ReduceOp op, const CollectiveHeader& header,
                                  const Hierarchy& h) {
  const int64_t parts = h.topology.local_size();
  const int64_t m = (flat.numel() + parts - 1) / parts;
  at::Tensor padded = flat;
  if (m * parts != flat.numel()) {
    padded = h.scratch.get(0, m * parts, flat.scalar_type());
    padded.narrow(0, 0, flat.numel()).copy_(flat);
    padded.narrow(0, flat.numel(), m * parts - flat.numel()).zero_();
  }
  HostSlices slices{padded, padded.narrow(0, h.topology.local_rank() * m, m)};
  if (h.local != nullptr) h.local->direct()->reduce_scatter(slices.mine, padded, op, header, {}, /*checked=*/false);
  return slices;
}

// The host's all-gather of its ranks' slices back into `flat` (unchecked).
void all_gather_in_host(const HostSlices& slices, const at::Tensor& flat, const CollectiveHeader& header,
                        const Hierarchy& h) {
  if (h.local != nullptr) h.local->direct()->all_gather(slices.padded, slices.mine, header, {}, /*checked=*/false);
  if (!slices.padded.is_same(flat)) flat.copy_(slices.padded.narrow(0, 0, flat.numel()));
}

// The data part of kHierarchical (Note [Hierarchical collectives]) on `flat` (contiguous, float32/64 or
// int32/64), in place, after the collective check ran: every rank ends with the same bits.
void hierarchical_all_reduce(const at::Tensor& flat, ReduceOp op, const Hierarchy& h, Communicator& comm) {
  const Topology& topology = h.topology;
  DirectCollectives* local = h.local ? h.local->direct() : nullptr;
  // Inside a host the mean is a sum: the division by the group's size comes once, at the end.
  const ReduceOp local_op = op == ReduceOp::kMean ? ReduceOp::kSum : op;
  // Unchecked steps: the group's check already ran over the process group.
  CollectiveHeader header = comm.stamp(make_header(CollectiveKind::kAllReduce, flat, local_op, Algorithm::kHierarchical, -1), {});
  on_hosts(h, OnFailure::kCutLinks, [&] {
    if (h.uniform) {
      // Horovod's split: reduce-scatter in the host, the slices across hosts, all-gather in the host.
      DDPKIT_DIE_IF_FAULT_ARMED("die_in_host_data_step", comm.rank());
      const HostSlices slices = reduce_scatter_in_host(flat, local_op, header, h);
      cross_host_all_reduce(slices.mine, op, h, comm);
      finish_reduction_(slices.mine, op, comm.size());
      all_gather_in_host(slices, flat, header, h);
    } else {
      // The leaders' form: all-reduce in the host, the leaders across hosts, broadcast in the host.
      at::Tensor whole = flat;
      if (local != nullptr) local->all_reduce(whole, local_op, header, {}, /*checked=*/false);
      if (topology.local_rank() == 0) {
        cross_host_all_reduce(whole, op, h, comm);
        finish_reduction_(whole, op, comm.size());
      }
      if (local != nullptr) local->broadcast(whole, 0, header, {}, /*checked=*/false);
    }
  });
}

// `flat` of cross rank `root` to the other ranks `h.cross` spans (one per host): between two hosts
// over the socket link, else ddpkit's binomial tree on that subgroup (every dtype alike: only bytes
// move).
void cross_host_broadcast(const at::Tensor& flat, int root, const Hierarchy& h, Communicator& comm) {
  if (h.cross_size == 1 || flat.numel() == 0) return;
  across_hosts(h, comm, [&] {
    if (h.cross_size == 2) {
      const bool sender = h.cross_rank == root;
      move_across_two_hosts(sender ? flat : at::Tensor(), sender ? at::Tensor() : flat, h, comm);
      return;
    }
    Communicator cross = cross_communicator(h, comm);
    Schedule schedule = broadcast_schedule(flat, h.cross_size, h.cross_rank, root);
    run_schedule(cross, schedule);
  });
}

// The data part of a hierarchical broadcast (Note [Hierarchical collectives]) of `flat` (contiguous)
// from rank `root`, after the collective check ran.
void hierarchical_broadcast(const at::Tensor& flat, int root, const Hierarchy& h, Communicator& comm) {
  const Topology& topology = h.topology;
  DirectCollectives* local = h.local ? h.local->direct() : nullptr;
  const int root_host = topology.host_of[root];
  const int root_local = topology.local_rank_of(root);
  const CollectiveHeader header =
      comm.stamp(make_header(CollectiveKind::kBroadcast, flat, std::nullopt, Algorithm::kHierarchical, root), {});
  on_hosts(h, OnFailure::kCutLinks, [&] {
    if (h.uniform) {
      // The ranks of the root's local rank carry the tensor across hosts (cross rank = host), then
      // every host broadcasts it from that local rank over shared memory.
      if (topology.local_rank() == root_local) cross_host_broadcast(flat, root_host, h, comm);
      if (local != nullptr) local->broadcast(flat, root_local, header, {}, /*checked=*/false);
    } else {
      // The leaders' form: the root's host first (its leader among the receivers), the leaders
      // across hosts, then every other host from its leader.
      const bool root_side = topology.host() == root_host;
      if (root_side && local != nullptr) local->broadcast(flat, root_local, header, {}, /*checked=*/false);
      if (topology.local_rank() == 0) cross_host_broadcast(flat, root_host, h, comm);
      if (!root_side && local != nullptr) local->broadcast(flat, 0, header, {}, /*checked=*/false);
    }
  });
}

// The collective check of a collective across hosts (Note [Hierarchical collectives]): with equal
// hosts hierarchical_check, else the process group's through rank 0. Raises alike on every rank.
void check_across_hosts(const CollectiveHeader& header, const std::string& error, const Hierarchy& h,
                        Communicator& comm) {
  if (h.uniform) {
    hierarchical_check(header, error, h, comm);
    return;
  }
  comm.begin(header, error);
  comm.settle_header();
}

// The group's rank at local-major position p = j·H + i of H equal hosts: local rank j of host i.
// The hierarchical all-gather and reduce-scatter hold the ranks' blocks in this order, so that the
// step across hosts moves one contiguous run of H blocks per local rank and the step inside the host
// the L runs.
int local_major_rank(const Topology& topology, int position) {
  const int hosts = static_cast<int>(topology.hosts.size());
  return topology.hosts[position % hosts][position / hosts];
}

// op over the `flat` of the ranks `h.cross` spans, into `flat` of cross rank `root`: between two
// hosts the other sends its `flat` over the socket link, else ddpkit's binomial reduce on the cross
// subgroup (the others keep partial results).
void cross_host_reduce(const at::Tensor& flat, int root, ReduceOp op, const Hierarchy& h, Communicator& comm) {
  if (h.cross_size == 1 || flat.numel() == 0) return;
  across_hosts(h, comm, [&] {
    if (h.cross_size == 2) {
      if (h.cross_rank == root) {
        receive_and_combine_across_two_hosts(flat, op, {}, h, comm);
      } else {
        move_across_two_hosts(flat, at::Tensor(), h, comm);
      }
      return;
    }
    Communicator cross = cross_communicator(h, comm);
    Schedule schedule = reduce_schedule(flat, op, h.cross_size, h.cross_rank, root);
    run_schedule(cross, schedule);
  });
}

// The blocks of `flat` (cross_size blocks of m bytes, this rank's at its cross rank) of every rank
// `h.cross` spans, into every rank's `flat`: between two hosts a swap of the blocks over the socket
// link, else ddpkit's ring all-gather on the cross subgroup, which over gloo's messages took well
// under half the time of gloo's own all-gather (bench_multihost.py's all_gather_into_tensor at 16M
// floats).
void cross_host_all_gather(const at::Tensor& flat, int64_t m, const Hierarchy& h, Communicator& comm) {
  if (h.cross_size == 1 || m == 0) return;
  across_hosts(h, comm, [&] {
    if (h.cross_size == 2) {
      const int peer = 1 - h.cross_rank;
      move_across_two_hosts(flat.narrow(0, h.cross_rank * m, m), flat.narrow(0, peer * m, m), h, comm);
      return;
    }
    Communicator cross = cross_communicator(h, comm);
    Schedule schedule = ring_all_gather_schedule(flat, m, h.cross_size, h.cross_rank);
    run_schedule(cross, schedule, schedule.size());
  });
}

// The data part of the hierarchical reduce of `flat` (contiguous, float32/64 or int32/64) to rank
// `root`, after the collective check. With equal hosts: reduce-scatter inside every host, each
// local rank's slice reduced across hosts to the root's host, all-gather inside that host; else the
// leaders' form: all-reduce inside every host, the leaders reduce to the root's host's leader, which
// broadcasts inside its host. Ranks off the root's host keep partial results, as torch's reduce
// allows.
void hierarchical_reduce(const at::Tensor& flat, int root, ReduceOp op, const Hierarchy& h, Communicator& comm) {
  const Topology& topology = h.topology;
  DirectCollectives* local = h.local ? h.local->direct() : nullptr;
  const ReduceOp local_op = op == ReduceOp::kMean ? ReduceOp::kSum : op;
  const int root_host = topology.host_of[root];
  const bool root_side = topology.host() == root_host;
  const CollectiveHeader header =
      comm.stamp(make_header(CollectiveKind::kReduce, flat, local_op, Algorithm::kHierarchical, root), {});
  on_hosts(h, OnFailure::kCutLinks, [&] {
    if (h.uniform) {
      const HostSlices slices = reduce_scatter_in_host(flat, local_op, header, h);
      cross_host_reduce(slices.mine, root_host, local_op, h, comm);
      if (!root_side) return;
      finish_reduction_(slices.mine, op, comm.size());
      all_gather_in_host(slices, flat, header, h);
    } else {
      if (local != nullptr) local->all_reduce(const_cast<at::Tensor&>(flat), local_op, header, {}, /*checked=*/false);
      if (topology.local_rank() == 0) cross_host_reduce(flat, root_host, local_op, h, comm);
      if (!root_side) return;
      if (topology.local_rank() == 0) finish_reduction_(flat, op, comm.size());
      if (local != nullptr) local->broadcast(flat, 0, header, {}, /*checked=*/false);
    }
  });
}

// The data part of the hierarchical all-gather (any dtype: bytes move), after the collective check.
// With equal hosts: this rank's block to the ranks of its local rank on every host (ddpkit's ring
// on their subgroup), then the hosts' runs inside the host (shared memory), in local-major order,
// put in rank order at the end. Else the leaders' form: the host's blocks inside
// the host, the hosts' runs (padded to the largest host's) among the leaders, and every host's
// result from its leader.
void hierarchical_all_gather(const at::Tensor& output, const at::Tensor& input, const Hierarchy& h,
                             Communicator& comm) {
  const Topology& topology = h.topology;
  DirectCollectives* local = h.local ? h.local->direct() : nullptr;
  const int hosts = static_cast<int>(topology.hosts.size());
  const at::Tensor in = input.reshape(-1).view(at::kByte);
  const at::Tensor out = output.view(-1).view(at::kByte);
  const int64_t m = in.numel();
  auto block = [m](const at::Tensor& bytes, int64_t i) { return bytes.narrow(0, i * m, m); };
  const CollectiveHeader header =
      comm.stamp(make_header(CollectiveKind::kAllGather, input, std::nullopt, Algorithm::kHierarchical, -1), {});
  on_hosts(h, OnFailure::kCutLinks, [&] {
    if (h.uniform && local == nullptr) {
      // One rank per host, numbered as the hosts: the ring runs in the output itself.
      if (!is_own_block(out, in, comm.rank())) block(out, comm.rank()).copy_(in);
      cross_host_all_gather(out, m, h, comm);
    } else if (h.uniform) {
      at::Tensor run = h.scratch.get(0, hosts * m, at::kByte);
      run.narrow(0, h.cross_rank * m, m).copy_(in);
      cross_host_all_gather(run, m, h, comm);
      at::Tensor gathered = h.scratch.get(1, comm.size() * m, at::kByte);
      local->all_gather(gathered, run, header, {}, /*checked=*/false);
      for (int p = 0; p < comm.size(); ++p) block(out, local_major_rank(topology, p)).copy_(block(gathered, p));
    } else {
      size_t widest = 0;
      for (const auto& ranks : topology.hosts) widest = std::max(widest, ranks.size());
      const int64_t run_bytes = static_cast<int64_t>(widest) * m;
      at::Tensor run = h.scratch.get(0, run_bytes, at::kByte);
      if (local != nullptr) {
        local->all_gather(run.narrow(0, 0, topology.local_size() * m), in, header, {}, /*checked=*/false);
      } else {
        block(run, 0).copy_(in);
      }
      if (topology.local_rank() == 0) {
        at::Tensor runs = h.scratch.get(1, hosts * run_bytes, at::kByte);
        runs.narrow(0, h.cross_rank * run_bytes, run_bytes).copy_(run);
        cross_host_all_gather(runs, run_bytes, h, comm);
        for (int i = 0; i < hosts; ++i) {
          for (size_t j = 0; j < topology.hosts[i].size(); ++j) {
            block(out, topology.hosts[i][j]).copy_(block(runs, static_cast<int64_t>(i * widest + j)));
          }
        }
      }
      if (local != nullptr) local->broadcast(out, 0, header, {}, /*checked=*/false);
    }
  });
}

// The data part of the hierarchical reduce-scatter, after the collective check; `input` (n blocks of
// output.numel()) stays unchanged. With equal hosts: the blocks in local-major order (a copy, in the
// working dtype), the host's reduce-scatter of those runs over shared memory (local rank j receives
// the host's sum of run j: the blocks of the ranks of local rank j on every host), then ddpkit's
// ring reduce-scatter of that run among those ranks. Else the leaders' form of the all-reduce on a
// copy of the whole input, of which each rank keeps its block.
void hierarchical_reduce_scatter(const at::Tensor& output, const at::Tensor& input, ReduceOp op, const Hierarchy& h,
                                 Communicator& comm) {
  const Topology& topology = h.topology;
  DirectCollectives* local = h.local ? h.local->direct() : nullptr;
  const int n = comm.size();
  const int hosts = static_cast<int>(topology.hosts.size());
  const int64_t m = output.numel();
  const ReduceOp local_op = op == ReduceOp::kMean ? ReduceOp::kSum : op;
  const auto options = output.options().dtype(working_dtype(output));
  const CollectiveHeader header =
      comm.stamp(make_header(CollectiveKind::kReduceScatter, output, local_op, Algorithm::kHierarchical, -1), {});
  at::Tensor result;
  if (h.uniform) {
    const at::Tensor blocks = input.reshape({n, m});
    at::Tensor ordered = h.scratch.get(0, n * m, options.dtype().toScalarType());
    for (int p = 0; p < n; ++p) slice(ordered, p * m, (p + 1) * m).copy_(blocks[local_major_rank(topology, p)]);
    at::Tensor run = local != nullptr ? h.scratch.get(1, hosts * m, options.dtype().toScalarType()) : ordered;
    on_hosts(h, OnFailure::kCutLinks, [&] {
      if (local != nullptr) local->reduce_scatter(run, ordered, local_op, header, {}, /*checked=*/false);
      if (m == 0) return;
      across_hosts(h, comm, [&] {
        if (h.cross_size == 2) {  // each host sends the other its block of the run, and reduces its own
          const int peer = 1 - h.cross_rank;
          const at::Tensor theirs = slice(run, peer * m, (peer + 1) * m);
          const at::Tensor mine = slice(run, h.cross_rank * m, (h.cross_rank + 1) * m);
          receive_and_combine_across_two_hosts(
              mine, local_op, {{peer, theirs.data_ptr(), static_cast<int64_t>(theirs.nbytes())}}, h, comm);
          return;
        }
        Communicator cross = cross_communicator(h, comm);
        Schedule schedule = ring_reduce_scatter_schedule(run, m, local_op, h.cross_size, h.cross_rank);
        run_schedule(cross, schedule);
      });
    });
    result = slice(run, h.cross_rank * m, (h.cross_rank + 1) * m);
  } else {
    at::Tensor whole = input.reshape(-1).to(options, /*non_blocking=*/false, /*copy=*/true);
    hierarchical_all_reduce(whole, local_op, h, comm);
    result = slice(whole, comm.rank() * m, (comm.rank() + 1) * m);
  }
  finish_reduction_(result, op, n);
  output.view(-1).copy_(result);
}

// A small broadcast across equal hosts (fits_one_round): the root's tensor rides in its message of
// the check's round to the center, whose reply carries it to the root's partners, then every host
// broadcasts it from the root's local rank over shared memory. Returns false, doing nothing, where it
// does not apply.
bool hierarchical_broadcast_in_one_round(const at::Tensor& tensor, int root, const CollectiveHeader& header,
                                         const std::string& error, const Hierarchy& h, Communicator& comm) {
  if (!error.empty() || !fits_one_round(tensor.numel() * static_cast<int64_t>(tensor.element_size()), error, h)) {
    return false;
  }
  comm.note_collective(CollectiveKind::kBroadcast);
  const Topology& topology = h.topology;
  const at::Tensor bytes = tensor.view(-1).view(at::kByte);
  const int root_host = topology.host_of[root];
  const int root_local = topology.local_rank_of(root);
  // The center is cross rank 0 as in every other round across hosts, whatever the root: ranks that
  // disagree on the root, or on whether the tensor fits, must still meet in one round to learn it.
  const bool carries = topology.local_rank() == root_local;
  const at::Tensor reply = check_in_one_round(
      header, error, /*center=*/0, h, comm,
      [&] { return comm.rank() == root ? bytes : at::empty({0}, at::kByte); },
      [&](const std::vector<at::Tensor>& payloads) {
        return carries ? payloads[root_host].narrow(0, 0, bytes.numel()) : at::empty({0}, at::kByte);
      });
  if (bytes.numel() == 0) return true;
  if (carries && comm.rank() != root) bytes.copy_(reply.narrow(0, 0, bytes.numel()));
  if (h.local == nullptr) return true;
  on_hosts(h, OnFailure::kCutLinks,
           [&] { h.local->direct()->broadcast(bytes, root_local, comm.stamp(header, {}), {}, /*checked=*/false); });
  return true;
}

// A small all-gather across equal hosts (fits_one_round of the input): this rank's block rides in its
// message of the check's round to the center, whose reply carries its partners' blocks, then the
// hosts' runs are all-gathered inside the host, as in hierarchical_all_gather. Returns false, doing nothing, where it does not apply.
bool hierarchical_all_gather_in_one_round(const at::Tensor& output, const at::Tensor& input,
                                          const CollectiveHeader& header, const std::string& error, const Hierarchy& h,
                                          Communicator& comm) {
  if (!error.empty() || !fits_one_round(input.numel() * static_cast<int64_t>(input.element_size()), error, h)) {
    return false;
  }
  comm.note_collective(CollectiveKind::kAllGather);
  const Topology& topology = h.topology;
  const at::Tensor in = input.reshape(-1).view(at::kByte);
  const at::Tensor out = output.view(-1).view(at::kByte);
  const int64_t m = in.numel();
  // The center answers with the blocks of every partner, in host order: this local rank's run.
  const at::Tensor reply = check_in_one_round(
      header, error, /*center=*/0, h, comm, [&] { return in; },
      [&](const std::vector<at::Tensor>& payloads) {
        at::Tensor run = at::empty({static_cast<int64_t>(payloads.size()) * m}, at::kByte);
        for (size_t j = 0; j < payloads.size(); ++j) run.narrow(0, j * m, m).copy_(payloads[j].narrow(0, 0, m));
        return run;
      });
  if (m == 0) return true;
  const at::Tensor run = reply.narrow(0, 0, h.cross_size * m);
  at::Tensor gathered = run;
  if (h.local != nullptr) {
    gathered = h.scratch.get(0, comm.size() * m, at::kByte);
    on_hosts(h, OnFailure::kCutLinks,
             [&] { h.local->direct()->all_gather(gathered, run, comm.stamp(header, {}), {}, /*checked=*/false); });
  }
  for (int p = 0; p < comm.size(); ++p) out.narrow(0, local_major_rank(topology, p) * m, m).copy_(gathered.narrow(0, p * m, m));
  return true;
}

}  // namespace

void all_reduce_(at::Tensor& tensor, ReduceOp op, Algorithm algorithm, Communicator& comm) {
  if (staged(tensor, comm)) {
    return on_host_copy(tensor, [&](at::Tensor& host) { all_reduce_(host, op, algorithm, comm); });
  }
  std::string error = tensor_error(tensor, "all_reduce", op);
  const int n = comm.size();
  const int r = comm.rank();
  const Algorithm requested = algorithm;
  if (algorithm == Algorithm::kDirect && !comm.has_direct() && n > 1) {
    // Rejected like any bad argument, so that the peers learn it (Note [Collective checks]).
    if (error.empty()) {
      error = "ddpkit.all_reduce: algorithm 'direct' needs the shared-memory transport (every rank on this host, "
              "CPU tensors)";
    }
    algorithm = Algorithm::kAuto;
  }
  if (algorithm == Algorithm::kHierarchical && comm.hierarchy() == nullptr) {
    if (error.empty()) {
      error = "ddpkit.all_reduce: algorithm 'hierarchical' needs a group spanning hosts, "
              "and CPU tensors over transport 'auto'";
    }
    algorithm = Algorithm::kAuto;
  }
  if (algorithm == Algorithm::kAuto) {
    const int64_t bytes = error.empty() ? tensor.numel() * static_cast<int64_t>(tensor.element_size()) : 0;
    algorithm = choose_algorithm(bytes, n, comm.device_type(), comm.has_direct(), comm.hierarchy() != nullptr, op);
  }
  if (algorithm == Algorithm::kDirect && n > 1) {
    // Note [Direct all-reduce]: the header check rides in the transport's first step, no messages.
    at::Tensor work = error.empty() ? working_copy(tensor) : at::Tensor();
    at::Tensor flat = work.defined() ? work.view(-1) : work;
    comm.run_direct(make_header(CollectiveKind::kAllReduce, tensor, op, requested, -1), error,
                    [&](DirectCollectives& direct, const CollectiveHeader& header, bool checked) {
                      direct.all_reduce(flat, op, header, error, checked);
                    });
    write_back(tensor, work);
    return;
  }
  if (algorithm == Algorithm::kHierarchical && n > 1 &&
      hierarchical_all_reduce_in_one_round(tensor, op, make_header(CollectiveKind::kAllReduce, tensor, op, requested, -1),
                                           error, *comm.hierarchy(), comm)) {
    return;
  }
  if (algorithm == Algorithm::kHierarchical && comm.hierarchy()->uniform && n > 1) {
    hierarchical_check(make_header(CollectiveKind::kAllReduce, tensor, op, requested, -1), error, *comm.hierarchy(),
                       comm);
    if (tensor.numel() == 0) return;
    at::Tensor work = working_copy(tensor);
    hierarchical_all_reduce(work.view(-1), op, *comm.hierarchy(), comm);
    write_back(tensor, work);
    return;
  }
  // The group's own all-reduce asked for by name is the unchecked baseline (Note [Choosing an algorithm]).
  comm.begin(make_header(CollectiveKind::kAllReduce, tensor, op, requested, -1), error,
             /*exchange_header=*/requested != Algorithm::kProcessGroup);
  if (tensor.numel() == 0 || n == 1) {
    comm.settle_header();
    return;
  }
  at::Tensor work = working_copy(tensor);
  at::Tensor flat = work.view(-1);
  if (algorithm == Algorithm::kHierarchical) {
    comm.settle_header();
    hierarchical_all_reduce(flat, op, *comm.hierarchy(), comm);
    write_back(tensor, work);
    return;
  }
  if (algorithm == Algorithm::kProcessGroup) {
    comm.settle_header();
    comm.process_group_all_reduce(work, op)->wait();
    finish_reduction_(work, op, n);
    write_back(tensor, work);
    return;
  }
  Schedule schedule;
  switch (algorithm) {
    case Algorithm::kRing: schedule = ring_schedule(flat, op, n, r); break;
    case Algorithm::kButterfly: schedule = butterfly_schedule(flat, op, n, r); break;
    case Algorithm::kStar: schedule = star_schedule(flat, op, n, r); break;
    case Algorithm::kGatherScatter: schedule = gather_scatter_schedule(flat, op, n, r); break;
    case Algorithm::kRecursiveDoubling: schedule = recursive_doubling_schedule(flat, op, n, r); break;
    case Algorithm::kHalvingDoubling: schedule = halving_doubling_schedule(flat, op, n, r); break;
    case Algorithm::kAuto:
    case Algorithm::kDirect:
    case Algorithm::kHierarchical:
    case Algorithm::kProcessGroup: TORCH_INTERNAL_ASSERT(false, "resolved above");
  }
  // Note [Ring receives up front]: the ring's every receive may be posted before its first send.
  run_schedule(comm, schedule, algorithm == Algorithm::kRing ? schedule.size() : 1);
  write_back(tensor, work);
}

void broadcast_(at::Tensor& tensor, int src, Communicator& comm) {
  if (staged(tensor, comm)) return on_host_copy(tensor, [&](at::Tensor& host) { broadcast_(host, src, comm); });
  const int n = comm.size();
  std::string error = tensor_error(tensor, "broadcast", std::nullopt);
  if (error.empty()) error = root_error(src, n, "broadcast", "src");
  const CollectiveHeader header = make_header(CollectiveKind::kBroadcast, tensor, std::nullopt, std::nullopt, src);
  if (comm.hierarchy() != nullptr && n > 1) {
    // Across hosts (Note [Hierarchical collectives]): the check, then the tensor crosses hosts once
    // per local rank's tree (a binomial tree of the hosts) and spreads over shared memory.
    const Hierarchy& h = *comm.hierarchy();
    if (hierarchical_broadcast_in_one_round(tensor, src, header, error, h, comm)) return;
    check_across_hosts(header, error, h, comm);
    if (tensor.numel() == 0) return;
    // The tensor itself, whatever its dtype: a broadcast moves bytes, and a float32 working copy of a
    // float16/bfloat16 tensor would rewrite its NaNs' bits on every rank, the root's too.
    hierarchical_broadcast(tensor.view(-1), src, h, comm);
    return;
  }
  comm.begin(header, error);
  if (n == 1 || tensor.numel() == 0) {
    comm.settle_header();
    return;
  }
  Schedule schedule = broadcast_schedule(tensor, n, comm.rank(), src);
  run_schedule(comm, schedule);
}

void reduce_(at::Tensor& tensor, int dst, ReduceOp op, Communicator& comm) {
  if (staged(tensor, comm)) return on_host_copy(tensor, [&](at::Tensor& host) { reduce_(host, dst, op, comm); });
  const int n = comm.size();
  std::string error = tensor_error(tensor, "reduce", op);
  if (error.empty()) error = root_error(dst, n, "reduce", "dst");
  const CollectiveHeader header = make_header(CollectiveKind::kReduce, tensor, op, std::nullopt, dst);
  if (comm.hierarchy() != nullptr && n > 1) {
    // Across hosts (Note [Hierarchical collectives]): the check, then each host's share crosses once.
    if (hierarchical_all_reduce_in_one_round(tensor, op, header, error, *comm.hierarchy(), comm)) return;
    check_across_hosts(header, error, *comm.hierarchy(), comm);
    if (tensor.numel() == 0) return;
    at::Tensor work = working_copy(tensor);
    hierarchical_reduce(work.view(-1), dst, op, *comm.hierarchy(), comm);
    write_back(tensor, work);
    return;
  }
  comm.begin(header, error);
  if (tensor.numel() == 0) {
    comm.settle_header();
    return;
  }
  at::Tensor work = working_copy(tensor);
  at::Tensor flat = work.view(-1);
  Schedule schedule = reduce_schedule(flat, op, n, comm.rank(), dst);
  run_schedule(comm, schedule);
  if (comm.rank() == dst) finish_reduction_(flat, op, n);
  write_back(tensor, work);
}

at::Tensor gather(const at::Tensor& tensor, int dst, Communicator& comm) {
  if (staged(tensor, comm)) return gather(to_host(tensor), dst, comm).to(tensor.device());
  const int n = comm.size();
  at::Tensor gathered;
  std::vector<at::Tensor> rows;
  if (comm.rank() == dst && tensor.defined()) {
    std::vector<int64_t> shape{n};
    shape.insert(shape.end(), tensor.sizes().begin(), tensor.sizes().end());
    gathered = at::empty(shape, tensor.options());
    for (int peer = 0; peer < n; ++peer) rows.push_back(gathered[peer]);
  } else {
    gathered = at::empty({0}, tensor.defined() ? tensor.options() : at::TensorOptions());
  }
  gather_into(rows, tensor, dst, comm);
  return gathered;
}

void gather_into(std::vector<at::Tensor>& outputs, const at::Tensor& tensor, int dst, Communicator& comm) {
  const int n = comm.size();
  std::string error = tensor_error(tensor, "gather", std::nullopt);
  if (error.empty()) error = root_error(dst, n, "gather", "dst");
  if (error.empty() && comm.rank() == dst) {
    bool matching = static_cast<int>(outputs.size()) == n;
    for (const auto& out : outputs) {
      matching = matching && out.defined() && out.numel() == tensor.numel() && out.scalar_type() == tensor.scalar_type() &&
                 out.device() == tensor.device();
    }
    if (!matching) {
      error = c10::str("ddpkit.gather: on dst the outputs must be ", n, " tensors of ", tensor.numel(),
                       " elements, dtype ", tensor.scalar_type(), " and device ", tensor.device());
    }
  }
  comm.begin(make_header(CollectiveKind::kGather, tensor, std::nullopt, std::nullopt, dst), error);
  Round round;
  // Received into contiguous stand-ins where an output is not contiguous, copied over after.
  std::vector<std::pair<at::Tensor, at::Tensor>> copy_back;
  if (comm.rank() == dst) {
    for (int peer = 0; peer < n; ++peer) {
      at::Tensor out = outputs[peer];
      if (peer == dst) continue;
      at::Tensor target = out.is_contiguous() ? out : at::empty(out.sizes(), out.options());
      if (!target.is_same(out)) copy_back.emplace_back(out, target);
      round.recvs.push_back({target, peer});
    }
  } else {
    round.sends.push_back({tensor, dst});
  }
  Schedule schedule{round};
  run_schedule(comm, schedule);
  for (auto& [out, target] : copy_back) out.copy_(target);
  if (comm.rank() == dst) outputs[dst].copy_(tensor.view(outputs[dst].sizes()));
}

void scatter_(at::Tensor& output, const at::Tensor& chunks, int src, Communicator& comm) {
  if (staged(output, comm)) {
    // Chunks on another device than the output stay where they are, for scatter_'s own check to reject.
    const at::Tensor host_chunks = chunks.defined() && chunks.device() == output.device() ? to_host(chunks) : chunks;
    return on_host_copy(output, [&](at::Tensor& host) { scatter_(host, host_chunks, src, comm); });
  }
  const int n = comm.size();
  std::vector<at::Tensor> rows;
  std::string error;
  if (comm.rank() == src && output.defined()) {
    std::vector<int64_t> expected{n};
    expected.insert(expected.end(), output.sizes().begin(), output.sizes().end());
    if (!chunks.defined() || chunks.sizes() != c10::IntArrayRef(expected) ||
        chunks.scalar_type() != output.scalar_type() || chunks.device() != output.device()) {
      error = c10::str("ddpkit.scatter: on src the chunks must have shape ", c10::IntArrayRef(expected),
                       ", dtype ", output.scalar_type(), " and device ", output.device());
    } else {
      const at::Tensor contiguous = chunks.contiguous();
      for (int peer = 0; peer < n; ++peer) rows.push_back(contiguous[peer]);
    }
  }
  scatter_from(output, rows, src, comm, error);
}

void scatter_from(at::Tensor& output, const std::vector<at::Tensor>& inputs, int src, Communicator& comm,
                  std::string error) {
  const int n = comm.size();
  if (error.empty()) error = tensor_error(output, "scatter", std::nullopt);
  if (error.empty()) error = root_error(src, n, "scatter", "src");
  if (error.empty() && comm.rank() == src) {
    bool matching = static_cast<int>(inputs.size()) == n;
    for (const auto& in : inputs) {
      matching = matching && in.defined() && in.numel() == output.numel() && in.scalar_type() == output.scalar_type() &&
                 in.device() == output.device();
    }
    if (!matching) {
      error = c10::str("ddpkit.scatter: on src the inputs must be ", n, " tensors of ", output.numel(),
                       " elements, dtype ", output.scalar_type(), " and device ", output.device());
    }
  }
  comm.begin(make_header(CollectiveKind::kScatter, output, std::nullopt, std::nullopt, src), error);
  Round round;
  if (comm.rank() == src) {
    for (int peer = 0; peer < n; ++peer) {
      if (peer != src) round.sends.push_back({inputs[peer].contiguous(), peer});
    }
  } else {
    round.recvs.push_back({output, src});
  }
  Schedule schedule{round};
  run_schedule(comm, schedule);
  if (comm.rank() == src) output.copy_(inputs[src].reshape(output.sizes()));
}

namespace {

// The reason `output`/`input` cannot take part in an all-gather (`gather` true) or reduce-scatter of
// `n` ranks as rank `rank`, or "" when they can.
std::string gather_scatter_error(const at::Tensor& output, const at::Tensor& input, int n, int rank, bool gather,
                                 std::optional<ReduceOp> op) {
  const std::string_view what = gather ? "all_gather_into_tensor" : "reduce_scatter_tensor";
  std::string error = tensor_error(output, what, op);
  if (error.empty()) error = tensor_error(input, what, op);
  if (!error.empty()) return error;
  const at::Tensor& whole = gather ? output : input;
  const at::Tensor& part = gather ? input : output;
  if (whole.numel() != part.numel() * n) {
    return c10::str("ddpkit.", what, ": the ", gather ? "output" : "input", " must have world size (", n,
                    ") times the elements of the ", gather ? "input" : "output", " (", part.numel(), "), got ",
                    whole.numel());
  }
  if (output.scalar_type() != input.scalar_type() || output.device() != input.device()) {
    return c10::str("ddpkit.", what, ": input and output must have the same dtype and device, got ",
                    input.scalar_type(), " on ", input.device(), " and ", output.scalar_type(), " on ", output.device());
  }
  if (output.numel() > 0 && output.is_alias_of(input) && !is_own_block(whole, part, rank)) {
    return c10::str("ddpkit.", what, ": output and input must not share memory, except ",
                    gather ? "an input that is this rank's block of the output"
                           : "an output that is this rank's block of the input",
                    " (block ", rank, ")");
  }
  return {};
}

// What `algorithm` runs on `comm`. An algorithm this collective cannot run sets `error` (when it
// holds none yet), so that the rank rejects its arguments in the collective check like any other
// bad argument and its peers learn it (Note [Collective checks]); the rank then takes kAuto's path,
// which meets its peers' first step whatever they chose.
Algorithm resolve_block_algorithm(Algorithm algorithm, const Communicator& comm, std::string_view what,
                                  std::string& error) {
  const Algorithm automatic = comm.has_direct()               ? Algorithm::kDirect
                              : comm.hierarchy() != nullptr ? Algorithm::kHierarchical
                                                            : Algorithm::kRing;
  std::string problem;
  if (algorithm != Algorithm::kAuto && algorithm != Algorithm::kRing && algorithm != Algorithm::kDirect &&
      algorithm != Algorithm::kHalvingDoubling && algorithm != Algorithm::kHierarchical) {
    problem = c10::str("ddpkit.", what,
                       ": algorithm must be 'auto', 'ring', 'halving_doubling', 'direct' or 'hierarchical', got '",
                       algorithm_name(algorithm), "'");
  } else if (algorithm == Algorithm::kDirect && !comm.has_direct() && comm.size() > 1) {
    problem = c10::str("ddpkit.", what,
                       ": algorithm 'direct' needs the shared-memory transport (every rank on this host, CPU tensors)");
  } else if (algorithm == Algorithm::kHierarchical && comm.hierarchy() == nullptr && comm.size() > 1) {
    problem = c10::str("ddpkit.", what,
                       ": algorithm 'hierarchical' needs a group spanning hosts, and CPU "
                       "tensors over transport 'auto'");
  } else if (algorithm == Algorithm::kHalvingDoubling && !std::has_single_bit(static_cast<unsigned>(comm.size()))) {
    problem = c10::str("ddpkit.", what, ": algorithm 'halving_doubling' needs a power-of-two world size, got ",
                       comm.size(), "; use 'ring'");
  }
  if (problem.empty()) return algorithm == Algorithm::kAuto ? automatic : algorithm;
  if (error.empty()) error = std::move(problem);
  return automatic;
}

}  // namespace

void all_gather_into_tensor_(at::Tensor& output, const at::Tensor& input, Algorithm algorithm, Communicator& comm) {
  if (staged(output, comm)) {
    const at::Tensor host_input = input.device() == output.device() ? to_host(input) : input;
    return on_host_copy(output, [&](at::Tensor& host) { all_gather_into_tensor_(host, host_input, algorithm, comm); });
  }
  const int n = comm.size();
  const int r = comm.rank();
  std::string error = gather_scatter_error(output, input, n, r, /*gather=*/true, std::nullopt);
  const Algorithm requested = algorithm;
  algorithm = resolve_block_algorithm(algorithm, comm, "all_gather_into_tensor", error);
  const CollectiveHeader header = make_header(CollectiveKind::kAllGather, input, std::nullopt, requested, -1);
  if (algorithm == Algorithm::kDirect && n > 1) {
    comm.run_direct(header, error, [&](DirectCollectives& direct, const CollectiveHeader& stamped, bool checked) {
      direct.all_gather(output, input, stamped, error, checked);
    });
    return;
  }
  if (algorithm == Algorithm::kHierarchical && n > 1) {
    if (hierarchical_all_gather_in_one_round(output, input, header, error, *comm.hierarchy(), comm)) return;
    check_across_hosts(header, error, *comm.hierarchy(), comm);
    if (input.numel() > 0) hierarchical_all_gather(output, input, *comm.hierarchy(), comm);
    return;
  }
  comm.begin(header, error);
  const int64_t m = input.numel();
  at::Tensor flat = output.view(-1);
  if (m > 0 && !is_own_block(output, input, r)) slice(flat, r * m, (r + 1) * m).copy_(input.reshape(-1));
  if (n == 1 || m == 0) {
    comm.settle_header();
    return;
  }
  Schedule schedule = algorithm == Algorithm::kHalvingDoubling ? doubling_all_gather_schedule(flat, m, n, r)
                                                               : ring_all_gather_schedule(flat, m, n, r);
  // All receives may be posted up front (Note [Ring receives up front] holds for both).
  run_schedule(comm, schedule, schedule.size());
}

void reduce_scatter_tensor_(at::Tensor& output, const at::Tensor& input, ReduceOp op, Algorithm algorithm,
                            Communicator& comm) {
  if (staged(output, comm)) {
    const at::Tensor host_input = input.device() == output.device() ? to_host(input) : input;
    return on_host_copy(output,
                        [&](at::Tensor& host) { reduce_scatter_tensor_(host, host_input, op, algorithm, comm); });
  }
  const int n = comm.size();
  const int r = comm.rank();
  std::string error = gather_scatter_error(output, input, n, r, /*gather=*/false, op);
  const Algorithm requested = algorithm;
  algorithm = resolve_block_algorithm(algorithm, comm, "reduce_scatter_tensor", error);
  const CollectiveHeader header = make_header(CollectiveKind::kReduceScatter, output, op, requested, -1);
  const bool narrow_float = error.empty() && (output.scalar_type() == at::kHalf || output.scalar_type() == at::kBFloat16);
  if (algorithm == Algorithm::kDirect && n > 1) {
    // float16/bfloat16 are reduced in float32, like every reduction (collectives.h).
    const at::Tensor work_in = narrow_float ? input.to(at::kFloat) : input;
    at::Tensor work_out = narrow_float ? at::empty(output.sizes(), output.options().dtype(at::kFloat)) : output;
    comm.run_direct(header, error, [&](DirectCollectives& direct, const CollectiveHeader& stamped, bool checked) {
      direct.reduce_scatter(work_out, work_in, op, stamped, error, checked);
    });
    write_back(output, work_out);
    return;
  }
  if (algorithm == Algorithm::kHierarchical && n > 1) {
    // Small: the one-round all-reduce of a copy of the whole input, of which this rank keeps its block.
    const at::Tensor whole = error.empty() && input.numel() * static_cast<int64_t>(working_element_size(input)) <=
                                                     kOneRoundMaxBytes
                                 ? input.reshape(-1).to(working_dtype(input), false, /*copy=*/true)
                                 : at::Tensor();
    if (whole.defined() && hierarchical_all_reduce_in_one_round(whole, op, header, error, *comm.hierarchy(), comm)) {
      output.view(-1).copy_(whole.narrow(0, r * output.numel(), output.numel()));
      return;
    }
    check_across_hosts(header, error, *comm.hierarchy(), comm);
    if (output.numel() > 0) hierarchical_reduce_scatter(output, input, op, *comm.hierarchy(), comm);
    return;
  }
  comm.begin(header, error);
  const int64_t m = output.numel();
  if (m == 0) {
    comm.settle_header();
    return;
  }
  // A private working copy: the input stays unchanged and the partial sums accumulate here.
  at::Tensor acc = narrow_float ? input.reshape(-1).to(at::kFloat) : input.reshape(-1).clone();
  auto block = [&](int b) { return slice(acc, ((b % n + n) % n) * m, ((b % n + n) % n + 1) * m); };
  if (n > 1) {
    Schedule schedule = algorithm == Algorithm::kHalvingDoubling ? halving_reduce_scatter_schedule(acc, m, op, n, r)
                                                                 : ring_reduce_scatter_schedule(acc, m, op, n, r);
    run_schedule(comm, schedule);
  } else {
    comm.settle_header();
  }
  at::Tensor mine = block(r);
  finish_reduction_(mine, op, n);
  output.view(-1).copy_(mine);
}

void all_to_all_(std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& inputs, Communicator& comm) {
  const int n = comm.size();
  const int r = comm.rank();
  std::string error;
  if (static_cast<int>(outputs.size()) != n || static_cast<int>(inputs.size()) != n) {
    error = c10::str("ddpkit.all_to_all: expected ", n, " input and output tensors (one per rank), got ",
                     inputs.size(), " and ", outputs.size());
  }
  for (size_t j = 0; error.empty() && j < inputs.size(); ++j) {
    error = tensor_error(inputs[j], "all_to_all", std::nullopt);
    if (error.empty()) error = tensor_error(outputs[j], "all_to_all", std::nullopt);
    if (error.empty() && (inputs[j].scalar_type() != inputs[0].scalar_type() ||
                          outputs[j].scalar_type() != inputs[0].scalar_type())) {
      error = c10::str("ddpkit.all_to_all: every input and output must have one dtype, got ", inputs[j].scalar_type(),
                       " and ", outputs[j].scalar_type(), " beside ", inputs[0].scalar_type());
    }
    if (error.empty() && j == static_cast<size_t>(r) && outputs[j].numel() != inputs[j].numel()) {
      error = c10::str("ddpkit.all_to_all: this rank sends itself ", inputs[j].numel(), " elements but expects ",
                       outputs[j].numel(), " from itself (split sizes that disagree)");
    }
    if (error.empty() && inputs[j].device() != comm.device_type()) {
      error = c10::str("ddpkit.all_to_all: expected ", c10::DeviceTypeName(comm.device_type(), true), " tensors, got ",
                       inputs[j].device());
    }
  }
  CollectiveHeader header;
  header.kind = static_cast<int64_t>(CollectiveKind::kAllToAll);
  header.numel = n;  // the sizes of the pairs differ legitimately; the count of tensors does not
  header.dtype = error.empty() && !inputs.empty() ? static_cast<int64_t>(inputs[0].scalar_type()) : -1;
  comm.begin(header, error);
  if (outputs[r].numel() > 0) outputs[r].copy_(inputs[r]);
  Round round;
  for (int peer = 0; peer < n; ++peer) {
    if (peer == r) continue;
    round.sends.push_back({inputs[peer], peer});
    round.recvs.push_back({outputs[peer], peer});
  }
  Schedule schedule{round};
  run_schedule(comm, schedule);
}

void barrier(Communicator& comm) {
  CollectiveHeader header;
  header.kind = static_cast<int64_t>(CollectiveKind::kBarrier);
  if (comm.hierarchy() != nullptr && comm.hierarchy()->uniform && is_checked()) {
    // Across equal hosts the check is a barrier in itself: a step of every host's shared memory,
    // then a round through a center among the ranks of each local rank, which completes only once
    // every host's step has (Note [One round across hosts]).
    hierarchical_check(header, {}, *comm.hierarchy(), comm);
    return;
  }
  if (comm.has_direct()) {
    // One step of the direct collectives is a barrier in itself, whether checks are on or off.
    comm.run_direct(header, {}, [&](DirectCollectives& direct, const CollectiveHeader& stamped, bool) {
      direct.check(stamped, {}, "barrier");
    });
    return;
  }
  comm.begin(header);
  if (comm.size() == 1) {
    comm.settle_header();
    return;
  }
  // Everyone reports to rank 0, which answers everyone once all have reported.
  at::Tensor token = at::zeros({comm.size()}, at::kByte);
  Round in, out;
  in.tag = 0;
  out.tag = 1;
  for (int peer = 1; peer < comm.size(); ++peer) {
    if (comm.rank() == 0) {
      in.recvs.push_back({token.narrow(0, peer, 1), peer});
      out.sends.push_back({token.narrow(0, 0, 1), peer});
    }
  }
  if (comm.rank() != 0) {
    in.sends.push_back({token.narrow(0, 0, 1), 0});
    out.recvs.push_back({token.narrow(0, 1, 1), 0});
  }
  Schedule schedule{in, out};
  run_schedule(comm, schedule);
}

void reject(CollectiveKind kind, const std::string& error, Communicator& comm) {
  TORCH_INTERNAL_ASSERT(!error.empty());
  CollectiveHeader header;
  header.kind = static_cast<int64_t>(kind);
  comm.begin(header, error);
  comm.settle_header();
  TORCH_INTERNAL_ASSERT(false, "a rejected collective returned");
}

void meta_collective(CollectiveKind kind, const at::Tensor& tensor, std::optional<ReduceOp> op,
                     std::optional<Algorithm> algorithm, int root, Communicator& comm, std::string error) {
  const std::string_view what = collective_name(kind);
  if (error.empty() && root != -1) error = root_error(root, comm.size(), what, kind == CollectiveKind::kGather ||
                                                                                   kind == CollectiveKind::kReduce
                                                                               ? "dst"
                                                                               : "src");
  CollectiveHeader header = make_header(kind, tensor, op, algorithm, root);
  header.meta = 1;
  comm.begin(header, error);
  comm.settle_header();
}

}  // namespace ddpkit::comm
