#pragma once
// A forked child's view of its parent's groups (Note [Forked children] in core/fork_guard.cpp): what
// every object that owns threads records, and the check a group's calls make.

#include <cstdint>
#include <string_view>

namespace ddpkit::comm {

// How many forks separate this process from the one that loaded ddpkit (a pthread_atfork child
// handler counts them). An object that owns threads records it when made: a different count later
// means this is a forked child, where those threads do not exist.
uint64_t fork_generation();

// Raises "ddpkit.<what> (rank r): ..." when this process is a fork of the one whose
// fork_generation() was `made_in`: a forked child cannot use its parent's group.
void check_not_forked(uint64_t made_in, std::string_view what, int rank);

}  // namespace ddpkit::comm
