"""The timing plan and statistics that bench_allreduce.py and the peer scripts share.

Pure Python (no torch, no numpy), so that the MPI script can import it without torch.

* A *repetition* times ``batch_size(numel)`` back-to-back all-reduces of the same vector on every rank,
  right after a synchronisation through the implementation under test; its time per call is the
  batch time divided by the batch. The figure of a repetition is the slowest rank's.
* ``reps_for`` is the number of repetitions for a point: fewer for big vectors and many processes.
* ``plan_reps`` cuts a point down to what fits in a time budget (for the peers, which busy-poll
  and collapse when processes outnumber cores); the point then says ``cut_off``.
* ``settle`` runs before a point's first repetition in every job, of every candidate alike.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

# numel -> back-to-back calls per timed repetition. Small messages take microseconds with a shared-memory
# transport: a batch makes the skew of the synchronisation before it small against the batch.
BATCH = ((10_000, 16), (100_000, 4))


# Seconds of back-to-back calls before a point's repetitions. A fresh set of processes keeps the CPUs
# the kernel gave it at start-up for a while: two ranks that start on one CPU stay there longer than
# the repetitions of a small point take (the load balancer leaves tasks that just ran where they are),
# and two ranks that spin on one CPU take turns, many times slower than on two. bench_allreduce.py logs
# each rank's CPU at every repetition and counts those begun with spinning ranks doubled up
# (``reps_sharing_a_cpu`` in its records, printed after its tables): that count says whether this
# settling was long enough. A training job runs for minutes, so the placement it sees is the settled one.
SETTLE_S = 0.1


def settle(
    call: Callable[[], object], agree: Callable[[bool], bool], calls_per_check: int, seconds: float = SETTLE_S
) -> None:
    """Runs ``call()`` back to back for about ``seconds`` on every rank of a job: ``calls_per_check``
    calls, then ``agree(this rank's time is up)``, which must return the same on every rank (an
    all-reduce of the flag through the candidate itself), until it returns True."""
    end = time.perf_counter() + seconds
    while True:
        for _ in range(calls_per_check):
            call()
        if agree(time.perf_counter() >= end):
            return


def batch_size(numel: int) -> int:
    for limit, calls in BATCH:
        if numel <= limit:
            return calls
    return 1


def reps_for(numel: int, world_size: int, reps: int) -> int:
    """Repetitions for a point, from ``reps`` (the count for <= 100k floats at <= 8 processes)."""
    if numel <= 100_000:
        scaled = reps
    elif numel <= 1_000_000:
        scaled = reps // 2
    elif numel <= 16_000_000:
        scaled = reps // 4
    else:
        scaled = reps // 6
    if world_size > 8:
        scaled //= 4
    return min(reps, max(3, scaled))


def plan_reps(first_call_s: float, reps: int, budget_s: float | None) -> tuple[int, bool]:
    """(repetitions to run, cut_off): as many of ``reps`` as fit in ``budget_s`` at ``first_call_s`` each.

    At least one repetition always runs; ``cut_off`` is True when fewer than ``reps`` will.
    """
    if budget_s is None or first_call_s <= 0:
        return reps, False
    fit = max(1, min(reps, int(budget_s // first_call_s)))
    return fit, fit < reps


def split_reps(reps: int, pools: int) -> list[int]:
    """``reps`` repetitions over ``pools`` sets of processes, as evenly as possible (none empty)."""
    pools = max(1, min(pools, reps))
    return [reps // pools + (1 if i < reps % pools else 0) for i in range(pools)]


def quantile(ordered: Sequence[float], q: float) -> float:
    """The ``q`` quantile of sorted values, linear between neighbours."""
    if not ordered:
        raise ValueError("quantile of no values")
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def slowest_per_rep(per_rank: Sequence[Sequence[float]]) -> list[float]:
    """Per repetition, the slowest rank's time (every rank ran the same repetitions)."""
    counts = {len(times) for times in per_rank}
    if len(counts) != 1:
        raise ValueError(f"ranks ran different numbers of repetitions: {sorted(counts)}")
    return [max(column) for column in zip(*per_rank)]


def time_stats(slowest: Sequence[float]) -> dict:
    """median, p25, p75 (seconds per call) of the slowest rank's times."""
    ordered = sorted(slowest)
    return {
        "median_s": statistics.median(ordered),
        "p25_s": quantile(ordered, 0.25),
        "p75_s": quantile(ordered, 0.75),
        "reps": len(ordered),
    }


def bus_bandwidth_GBps(nbytes: int, seconds: float | None, world_size: int) -> float | None:
    """nccl-tests' bus bandwidth of an all-reduce: bytes/time * 2(n-1)/n, in GB/s (None for n=1)."""
    if world_size <= 1 or not seconds or seconds <= 0:
        return None
    return nbytes / seconds * 2 * (world_size - 1) / world_size / 1e9


def parse_peer_args(description: str) -> argparse.Namespace:
    """The command line every peer script takes from bench_allreduce.py."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--sizes", type=int, nargs="+", required=True)
    parser.add_argument("--reps", type=int, default=30, help="as bench_allreduce.py --reps (timing.reps_for)")
    parser.add_argument("--point-budget", type=float, default=None, help="seconds of timed repetitions per size")
    parser.add_argument("--accuracy-max-numel", type=int, default=1_000_000)
    parser.add_argument("--out", type=Path, required=True)
    return parser.parse_args()
