#include "comm/shm/direct.h"

#include "comm/reduction/reduce_kernel.h"
#include "comm/reduction/split.h"

#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

namespace ddpkit::comm {

using namespace shm_detail;

void ShmDirect::carry_check(const CollectiveHeader& header, std::string_view local_error) {
  carried_ = CarriedCheck{header, local_error};
  armed_ = true;
}

WaitContext ShmDirect::begin(std::string_view what, const CarriedCheck*& check) {
  check = std::exchange(armed_, false) ? &carried_ : nullptr;  // this collective's, whatever happens next
  seg_.liveness().check_usable(what);
  return seg_.wait_context(what);
}

void ShmDirect::post_header(const CarriedCheck* check, int set) const {
  if (check) memory_.slot_header(seg_.rank(), set) = check->header;
}

std::vector<CollectiveHeader> ShmDirect::read_headers(int set) const {
  std::vector<CollectiveHeader> headers(seg_.size());
  for (int peer = 0; peer < seg_.size(); ++peer) headers[peer] = memory_.slot_header(peer, set);
  return headers;
}

void ShmDirect::verify_headers(const CarriedCheck* check, int set, std::string_view what) const {
  if (!check) return;
  const std::vector<CollectiveHeader> headers = read_headers(set);
  const std::string error = describe_headers(headers.data(), seg_.size(), what, seg_.group_ranks().data());
  TORCH_CHECK(check->local_error.empty(), std::string(check->local_error));
  TORCH_CHECK(error.empty(), error);
}

void ShmDirect::all_reduce(const at::Tensor& flat, ReduceOp op, std::string_view what) {
  const CarriedCheck* check = nullptr;
  const WaitContext context = begin(what, check);
  const bool rejected = !flat.defined();
  const at::ScalarType dtype = rejected ? at::kByte : flat.scalar_type();
  const int64_t element = rejected ? 1 : static_cast<int64_t>(flat.element_size());
  const int64_t numel = rejected ? 0 : flat.numel();
  char* const data = rejected || numel == 0 ? nullptr : static_cast<char*>(flat.data_ptr());
  const int64_t chunk_elems = memory_.slot_bytes() / element;
  const int64_t chunks = std::max<int64_t>(1, (numel + chunk_elems - 1) / chunk_elems);
  std::vector<const char*> sources(seg_.size());
  for (int64_t c = 0; c < chunks; ++c) {
    const uint32_t target = ++step_;
    const int set = static_cast<int>(target & 1);
    const int64_t begin = c * chunk_elems;
    const int64_t count = std::min(chunk_elems, numel - begin);
    const bool whole = count * element * seg_.size() <= memory_.whole_bytes();
    const BalancedSplit slices{count, seg_.size()};
    const int64_t start = slices.start(seg_.rank());
    const int64_t length = slices.length(seg_.rank());
    char* const chunk = data == nullptr ? nullptr : data + begin * element;
    char* mine = memory_.slot(seg_.rank(), set);
    if (c == 0) post_header(check, set);
    if (count > 0 && whole) {
      std::memcpy(mine, chunk, count * element);
    } else if (count > 0) {
      // Only the slices the peers reduce: this rank reads its own slice from its tensor (below).
      std::memcpy(mine, chunk, start * element);
      std::memcpy(mine + (start + length) * element, chunk + (start + length) * element,
                  (count - start - length) * element);
    }
    arrive_and_wait(target, context);
    if (c == 0) verify_headers(check, set, what);
    if (count == 0) continue;
    for (int peer = 0; peer < seg_.size(); ++peer) sources[peer] = memory_.slot(peer, set);
    if (whole) {
      reduce_sources(dtype, op, chunk, sources, 0, count);
      continue;
    }
    // This rank's slice, reduced by this rank alone (so every rank gets the same bits) from the ranks'
    // data in rank order, this rank's own read from its tensor (Note [Reductions]: the order of the
    // whole-chunk path and of the reduce-scatter, so that an element's bits never depend on which
    // rank's slice it falls in), into its slot for the peers and, block by block from L1, its tensor.
    sources[seg_.rank()] = chunk;
    reduce_sources(dtype, op, mine + start * element, sources, start, length, chunk + start * element);
    sources[seg_.rank()] = mine;
    memory_.control(seg_.rank()).reduced.post(target);
    WaitContext reductions = context;
    reductions.awaited = WaitContext::Awaited::kReduced;
    reductions.step = target;
    for (int peer = 0; peer < seg_.size(); ++peer) {
      if (peer == seg_.rank()) continue;
      Signal& reduced = memory_.control(peer).reduced;
      seg_.waits().wait_for(
          reduced, [&] { return reached(reduced.value.load(std::memory_order_acquire), target); }, reductions);
      const int64_t their_start = slices.start(peer);
      const int64_t their_length = slices.length(peer);
      std::memcpy(chunk + their_start * element, sources[peer] + their_start * element, their_length * element);
    }
  }
}

void ShmDirect::all_gather(const at::Tensor& output, const at::Tensor& input, std::string_view what) {
  const CarriedCheck* check = nullptr;
  const WaitContext context = begin(what, check);
  const int64_t bytes = input.defined() ? static_cast<int64_t>(input.numel() * input.element_size()) : 0;
  const char* const in = bytes == 0 ? nullptr : static_cast<const char*>(input.data_ptr());
  char* const out = bytes == 0 ? nullptr : static_cast<char*>(output.data_ptr());
  const int64_t steps = std::max<int64_t>(1, (bytes + memory_.slot_bytes() - 1) / memory_.slot_bytes());
  for (int64_t c = 0; c < steps; ++c) {
    const uint32_t target = ++step_;
    const int set = static_cast<int>(target & 1);
    const int64_t begin = c * memory_.slot_bytes();
    const int64_t length = std::min(memory_.slot_bytes(), bytes - begin);
    if (c == 0) post_header(check, set);
    if (length > 0) std::memcpy(memory_.slot(seg_.rank(), set), in + begin, length);
    arrive_and_wait(target, context);
    if (c == 0) verify_headers(check, set, what);
    if (length <= 0) continue;
    for (int peer = 0; peer < seg_.size(); ++peer) {
      char* to = out + peer * bytes + begin;
      const char* from = peer == seg_.rank() ? in + begin : memory_.slot(peer, set);
      if (to != from) std::memcpy(to, from, length);  // in place, this rank's block is already there
    }
  }
}

void ShmDirect::reduce_scatter(const at::Tensor& output, const at::Tensor& input, ReduceOp op, std::string_view what) {
  const CarriedCheck* check = nullptr;
  const WaitContext context = begin(what, check);
  const bool rejected = !output.defined();
  const at::ScalarType dtype = rejected ? at::kByte : output.scalar_type();
  const int64_t element = rejected ? 1 : static_cast<int64_t>(output.element_size());
  const int64_t block = rejected ? 0 : output.numel();  // elements per rank
  const char* const in = block == 0 ? nullptr : static_cast<const char*>(input.data_ptr());
  char* const out = block == 0 ? nullptr : static_cast<char*>(output.data_ptr());
  const bool in_place = out != nullptr && out == in + seg_.rank() * block * element;
  // Each step carries a piece of every block: n pieces of `piece` elements per slot, cache-line aligned.
  const int64_t piece = std::max<int64_t>(
      1, (memory_.slot_bytes() / seg_.size()) / static_cast<int64_t>(kLine) * static_cast<int64_t>(kLine) / element);
  const int64_t steps = std::max<int64_t>(1, (block + piece - 1) / piece);
  std::vector<const char*> sources(seg_.size());
  for (int64_t c = 0; c < steps; ++c) {
    const uint32_t target = ++step_;
    const int set = static_cast<int>(target & 1);
    const int64_t begin = c * piece;
    const int64_t count = std::min(piece, block - begin);
    char* const mine = memory_.slot(seg_.rank(), set);
    if (c == 0) post_header(check, set);
    for (int peer = 0; count > 0 && peer < seg_.size(); ++peer) {
      if (peer == seg_.rank()) continue;  // this rank's own block is read from its input below
      std::memcpy(mine + peer * piece * element, in + (peer * block + begin) * element, count * element);
    }
    arrive_and_wait(target, context);
    if (c == 0) verify_headers(check, set, what);
    if (count <= 0) continue;
    // The ranks' pieces in rank order, this rank's own from its input (Note [Reductions]: the direct
    // all-reduce's order). reduce_sources lets `out` alias only its first source: an output that is
    // this rank's own block of the input (in place) on a rank other than 0 is reduced into this rank's
    // unused piece of its slot, and copied out block by block from L1.
    for (int peer = 0; peer < seg_.size(); ++peer) {
      sources[peer] = peer == seg_.rank() ? in + (seg_.rank() * block + begin) * element
                                          : memory_.slot(peer, set) + seg_.rank() * piece * element;
    }
    if (in_place && seg_.rank() > 0) {
      reduce_sources(dtype, op, mine + seg_.rank() * piece * element, sources, 0, count, out + begin * element);
    } else {
      reduce_sources(dtype, op, out + begin * element, sources, 0, count);
    }
  }
}

void ShmDirect::broadcast(const at::Tensor& tensor, int root, std::string_view what) {
  const CarriedCheck* check = nullptr;
  const WaitContext context = begin(what, check);
  const int64_t bytes = tensor.defined() ? static_cast<int64_t>(tensor.numel() * tensor.element_size()) : 0;
  char* const data = bytes == 0 ? nullptr : static_cast<char*>(tensor.data_ptr());
  const int64_t steps = std::max<int64_t>(1, (bytes + memory_.slot_bytes() - 1) / memory_.slot_bytes());
  for (int64_t c = 0; c < steps; ++c) {
    const uint32_t target = ++step_;
    const int set = static_cast<int>(target & 1);
    const int64_t begin = c * memory_.slot_bytes();
    const int64_t length = std::min(memory_.slot_bytes(), bytes - begin);
    if (c == 0) post_header(check, set);
    if (seg_.rank() == root && length > 0) std::memcpy(memory_.slot(root, set), data + begin, length);
    arrive_and_wait(target, context);
    if (c == 0) verify_headers(check, set, what);
    if (seg_.rank() != root && length > 0) std::memcpy(data + begin, memory_.slot(root, set), length);
  }
}

void ShmDirect::arrive_and_wait(uint32_t target, const WaitContext& context) {
  // Only a sliced all-reduce step posts `reduced`, and reached() compares counters modulo 2^32: one
  // left behind by 2^31 steps of other kinds (an all-gather-only job: some 512 TiB per rank) would
  // read as ahead, and the next sliced step would copy slices its peers never reduced. Kept one step
  // behind here (never `target` itself: that is posted once this rank's slice is reduced), published
  // by the arrival's release.
  memory_.control(seg_.rank()).reduced.value.store(target - 1, std::memory_order_relaxed);
  memory_.control(seg_.rank()).arrived.post(target);
  WaitContext arrivals = context;
  arrivals.awaited = WaitContext::Awaited::kArrived;
  arrivals.step = target;
  for (int peer = 0; peer < seg_.size(); ++peer) {
    if (peer == seg_.rank()) continue;
    Signal& arrived = memory_.control(peer).arrived;
    seg_.waits().wait_for(
        arrived, [&] { return reached(arrived.value.load(std::memory_order_acquire), target); }, arrivals);
  }
}

void ShmDirect::barrier(std::string_view what) {
  const CarriedCheck* check = nullptr;
  const WaitContext context = begin(what, check);
  const uint32_t target = ++step_;
  const int set = static_cast<int>(target & 1);
  post_header(check, set);
  arrive_and_wait(target, context);
  verify_headers(check, set, what);
}

std::vector<CollectiveHeader> ShmDirect::exchange_headers(const CollectiveHeader& header, std::string_view what) {
  seg_.liveness().check_usable(what);
  const WaitContext context = seg_.wait_context(what);
  const uint32_t target = ++step_;
  const int set = static_cast<int>(target & 1);
  memory_.slot_header(seg_.rank(), set) = header;
  arrive_and_wait(target, context);
  return read_headers(set);
}

}  // namespace ddpkit::comm
