"""The all-reduce benchmark's candidates (benchmarks/bench_allreduce.py): what each name runs, the call a user makes
for it, the sets of processes that measure them, and a time record of one point."""

from __future__ import annotations

import argparse
import contextlib
import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

import ddpkit
from peers import timing
from records import AllreduceTimeRecord

# Until ddpkit has a transport argument, its only transport is the process group's send/recv.
HAS_TRANSPORT = "transport" in inspect.signature(ddpkit.all_reduce).parameters
DEFAULT_TRANSPORT = (
    inspect.signature(ddpkit.all_reduce).parameters["transport"].default if HAS_TRANSPORT else "process_group"
)
PROCESS_GROUP = "process_group"

IN_PROCESS = ["ddpkit", "ddpkit_ring_pg", "gloo", "floor"]
PEERS = ["mpich", "deepspeed"]
CANDIDATES = IN_PROCESS + PEERS
GRID_SIZES = [1_000, 10_000, 100_000, 1_000_000, 16_000_000, 64_000_000]
GRID_WORLD_SIZES = [1, 2, 3, 4, 5, 6, 7, 8, 16, 32]
UNCHECKED = "unchecked"


@dataclass(frozen=True)
class Candidate:
    name: str
    implementation: str  # ddpkit, gloo, floor, mpich, deepspeed
    algorithm: str | None = None  # ddpkit's algorithm argument
    transport: str | None = None  # ddpkit's transport argument; None: not passed (ddpkit's default)
    checked: bool = True  # ddpkit's Note [Collective checks]

    @property
    def effective_transport(self) -> str | None:
        if self.implementation != "ddpkit":
            return None
        return self.transport if self.transport is not None else DEFAULT_TRANSPORT


def parse_candidate(name: str) -> Candidate:
    """A candidate name (see the module docstring) -> what it runs; refuses what this ddpkit cannot run."""
    if name == "ddpkit":
        return Candidate(name, "ddpkit", "auto", None)
    if name == "ddpkit_ring_pg":
        return Candidate(name, "ddpkit", "ring", PROCESS_GROUP)
    if name in ("gloo", "floor", "mpich", "deepspeed"):
        return Candidate(name, name)
    parts = name.split(":")
    if parts[0] != "ddpkit" or len(parts) < 2:
        raise argparse.ArgumentTypeError(
            f"unknown candidate {name!r}: one of {CANDIDATES} or ddpkit:ALGORITHM[:TRANSPORT][:{UNCHECKED}]"
        )
    checked = parts[-1] != UNCHECKED
    parts = parts if checked else parts[:-1]
    if len(parts) not in (2, 3):
        raise argparse.ArgumentTypeError(f"cannot parse candidate {name!r}: ddpkit:ALGORITHM[:TRANSPORT][:{UNCHECKED}]")
    algorithm = parts[1]
    transport = parts[2] if len(parts) == 3 and parts[2] != "default" else None
    if transport not in (None, PROCESS_GROUP) and not HAS_TRANSPORT:
        raise argparse.ArgumentTypeError(
            f"candidate {name!r}: this ddpkit's all_reduce has no transport argument (process group only)"
        )
    return Candidate(name, "ddpkit", algorithm, transport, checked)


def _ddpkit_kwargs(candidate: Candidate) -> dict:
    # Without the argument, ddpkit runs over the process group: "process_group" is then the truth, not passed.
    return {"transport": candidate.transport} if HAS_TRANSPORT and candidate.transport is not None else {}


def run_candidate(candidate: Candidate, tensor: torch.Tensor, op: str = "sum") -> None:
    """One all-reduce of ``tensor`` in place (floor: none; it is timed separately)."""
    if candidate.implementation == "gloo" and op == "mean":  # gloo has no mean: its sum over n
        dist.all_reduce(tensor)
        tensor.div_(dist.get_world_size())
        return
    user_call(candidate, op)(tensor)


def user_call(candidate: Candidate, op: str = "sum") -> Callable[[torch.Tensor], object]:
    """The call a user makes for ``candidate``, bound once, for the timed loop: the loop then calls
    the library's own function with nothing of the benchmark's between, as the peers' scripts call
    theirs (``comm.Allreduce`` inline in MPICH's loop). A wrapper in between would add a Python call to
    every call timed, a sizeable part of a small all-reduce (bench_latency.py measures what each layer of
    the call path adds)."""
    if candidate.implementation == "gloo" and op == "sum":
        return dist.all_reduce
    if candidate.implementation != "ddpkit":
        raise ValueError(f"{candidate.name} does not run {op} in ddpkit's worker processes")
    options = {} if op == "sum" else {"op": op}
    if candidate.algorithm != "auto":
        options["algorithm"] = candidate.algorithm
    options.update(_ddpkit_kwargs(candidate))
    return functools.partial(ddpkit.all_reduce, **options) if options else ddpkit.all_reduce


@contextlib.contextmanager
def collective_checks(candidate: Candidate):
    """Turns Note [Collective checks] off for an unchecked candidate (every rank at the same point)."""
    if candidate.checked:
        yield
        return
    ddpkit.set_collective_checks(False)
    try:
        yield
    finally:
        ddpkit.set_collective_checks(True)


def spins_on_shared_memory(candidate: Candidate) -> bool:
    """Whether ``candidate``'s ranks wait by spinning on shared memory (ddpkit on one host with its
    default or shared-memory transport), not asleep on sockets (gloo, ddpkit over the process group,
    the floor's gloo barriers)."""
    return candidate.implementation == "ddpkit" and candidate.effective_transport != PROCESS_GROUP


def process_sets(names: list[str]) -> list[list[str]]:
    """The in-process candidates in the sets of processes that measure them, interleaved within each
    set: those that spin on shared memory in one, the others in another. A candidate that sleeps on
    sockets leaves the ranks where its wake-ups put them, often both on one CPU: measured in the same
    processes right after gloo's repetitions, ddpkit's small all-reduces ran several times slower than
    alone (the records' ``reps_sharing_a_cpu`` counts the repetitions begun so), while MPICH and DeepSpeed
    run in processes of their own."""
    spinning = [n for n in names if spins_on_shared_memory(parse_candidate(n))]
    return [group for group in (spinning, [n for n in names if n not in spinning]) if group]


def time_record(
    candidate: Candidate, world_size: int, numel: int, slowest: list[float], status: str = "measured", **extra
) -> AllreduceTimeRecord:
    """``slowest`` empty: a point not measured, and ``status`` says why."""
    nbytes = numel * 4
    resolved_algorithm = None
    if (
        candidate.implementation == "ddpkit"
        and candidate.algorithm == "auto"
        and candidate.effective_transport == PROCESS_GROUP
    ):
        resolved_algorithm = ddpkit.comm.choose_algorithm(nbytes, world_size)
    if slowest:
        stats = timing.time_stats(slowest)
        collective = candidate.implementation != "floor"  # the floor is one process's add, not a collective
        stats.update(
            algorithm_bandwidth_GBps=nbytes / stats["median_s"] / 1e9,
            bus_bandwidth_GBps=timing.bus_bandwidth_GBps(nbytes, stats["median_s"], world_size) if collective else None,
        )
    else:
        stats = dict(
            median_s=None, p25_s=None, p75_s=None, reps=0, algorithm_bandwidth_GBps=None, bus_bandwidth_GBps=None
        )
    return AllreduceTimeRecord(
        world_size=world_size,
        numel=numel,
        candidate=candidate.name,
        implementation=candidate.implementation,
        algorithm=candidate.algorithm,
        transport=candidate.effective_transport,
        checked=candidate.checked if candidate.implementation == "ddpkit" else None,
        resolved_algorithm=resolved_algorithm,
        status=status,
        **stats,
        **extra,
    )
