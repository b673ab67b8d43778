#pragma once
// Leaving the process cleanly while collectives are in flight (Note [Exit paths] in engine.cpp).

namespace ddpkit::comm {

// Called by Python's atexit (ddpkit/__init__.py), with the GIL released, before the interpreter starts
// finalizing: lets the completions already running finish (their Python callbacks need the GIL) and
// from then on leaves every future of a completed collective unsettled, so that no thread of ddpkit's
// takes the GIL, or drops a Python callback, once the interpreter is finalizing.
void prepare_for_exit();

}  // namespace ddpkit::comm
