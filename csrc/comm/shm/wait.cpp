#include "comm/shm/wait.h"

namespace ddpkit::comm {

void SegmentWaits::peer_exited() const {
  exits_.fetch_add(1, std::memory_order_seq_cst);
  memory_.wake_all_sleepers();
}

bool SegmentWaits::awaits_a_rank_on_this_cpu(const WaitContext& context) const {
  const int cpu = sched_getcpu();
  if (cpu < 0) return false;
  const int32_t mark = cpu + 1;  // RankControl::cpu's encoding: 0 until the rank first waits
  memory_.control(liveness_.ranks().rank).cpu.store(mark, std::memory_order_relaxed);
  const int awaited = liveness_.first_awaited_peer(context);
  return awaited >= 0 && memory_.control(awaited).cpu.load(std::memory_order_relaxed) == mark;
}

}  // namespace ddpkit::comm
