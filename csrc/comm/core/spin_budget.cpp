#include "comm/core/spin_budget.h"

namespace ddpkit::comm {
namespace {

thread_local std::chrono::microseconds spin_budget_of_this_thread = kCallerSpinMicros;

}  // namespace

std::chrono::microseconds spin_budget() { return spin_budget_of_this_thread; }

void spin_briefly_on_this_thread() { spin_budget_of_this_thread = kSpinMicros; }

}  // namespace ddpkit::comm
