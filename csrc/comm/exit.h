#pragma once
// Leaving the process cleanly while collectives are in flight (Note [Exit paths] in completion_pool.h), and
// a forked child's view of its parent's groups (Note [Forked children] in exit.cpp).

#include <cstdint>
#include <string_view>

namespace ddpkit::comm {

// Called by Python's atexit (ddpkit/__init__.py), with the GIL released, before the interpreter starts
// finalizing: lets the completions already running finish (their Python callbacks need the GIL) and
// from then on leaves every future of a completed collective unsettled, so that no thread of ddpkit's
// takes the GIL, or drops a Python callback, once the interpreter is finalizing. The same atexit
// call then frees the engines of destroyed groups (Engine::release_destroyed, Note [Exit paths]).
void prepare_for_exit();

// How many forks separate this process from the one that loaded ddpkit (a pthread_atfork child
// handler counts them). An object that owns threads records it when made: a different count later
// means this is a forked child, where those threads do not exist.
uint64_t fork_generation();

// Raises "ddpkit.<what> (rank r): ..." when this process is a fork of the one whose
// fork_generation() was `made_in`: a forked child cannot use its parent's group.
void check_not_forked(uint64_t made_in, std::string_view what, int rank);

}  // namespace ddpkit::comm
