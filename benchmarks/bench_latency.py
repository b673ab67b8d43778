"""Where a small all-reduce's time goes: each layer of ``ddpkit.all_reduce``'s call path, looped back to back.

    python benchmarks/bench_latency.py            # n=2, 1k and 10k floats: about 1 minute
    python benchmarks/bench_latency.py --quick    # a smoke run
    perf record -g -o /tmp/ddpkit.perf -- python benchmarks/bench_latency.py --stages "c++ all_reduce"
                                                  # then: perf report -i /tmp/ddpkit.perf --no-children

Two processes on one host (shared memory), float32 sums. Each stage adds one layer to the one before:

  C++ loops (``ddpkit.testing.time_engine_loop``, a testing build's: the loop itself runs in C++, no Python and no dispatcher
  between calls; csrc/comm/engine/ops.h):
    c++ lookup                 Engine::of(group name), the group's engine from its name
    c++ engine                 + an empty collective through the engine (numbering, ordering, transport)
    c++ all_reduce unchecked   + the all-reduce itself, Note [Collective checks] off
    c++ all_reduce             + the collective check (header exchange), as ddpkit runs by default
  Python loops:
    python op call             torch.ops.ddpkit.collective_checks_enabled(): an op call with no work
    python torch.ops           torch.ops.ddpkit.all_reduce_: the custom op through the dispatcher (what
                               torch.compile and tensors the dispatcher must see take)
    python ddpkit.all_reduce   the public wrapper as users call it: on plain CPU tensors it calls the
                               kernel past the dispatcher (Note [Eager calls past the dispatcher])

A repetition times ``--calls`` back-to-back calls of one stage on every rank (after a one-float
all-reduce lines the ranks up) and divides by the calls; stages are interleaved in a rotating order
(``common.interleave``, 2 warm-up repetitions dropped); a repetition's figure is the slowest rank's and
the figure reported is the median over repetitions. The budget in the summary is the difference
between a layer and the one it adds to (BUDGET). Results: benchmarks/results/latency.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import ddpkit  # noqa: E402
from common import interleave, print_table, write_results  # noqa: E402
from ddpkit.testing import WorkerPool  # noqa: E402
from peers import timing  # noqa: E402
from records import LatencyRecord  # noqa: E402

CPP_STAGES = {
    "c++ lookup": "lookup",
    "c++ engine": "engine",
    "c++ all_reduce unchecked": "all_reduce_unchecked",
    "c++ all_reduce": "all_reduce",
}
PYTHON_STAGES = ("python op call", "python torch.ops", "python ddpkit.all_reduce")
STAGES = (*CPP_STAGES, *PYTHON_STAGES)
MOVES_DATA = {"c++ all_reduce unchecked", "c++ all_reduce", "python torch.ops", "python ddpkit.all_reduce"}
# (what the budget line names, the stage, the stage it adds to)
BUDGET = (
    ("the group's engine from its name", "c++ lookup", None),
    ("engine: numbering, ordering, transport", "c++ engine", "c++ lookup"),
    ("communication: arrive, wait, copy, reduce", "c++ all_reduce unchecked", "c++ engine"),
    ("collective check (header exchange)", "c++ all_reduce", "c++ all_reduce unchecked"),
    ("Python, through the dispatcher (torch.ops)", "python torch.ops", "c++ all_reduce"),
    ("Python, ddpkit.all_reduce past the dispatcher", "python ddpkit.all_reduce", "c++ all_reduce"),
)


def measure(numel: int, stages: list[str], reps: int, warmup: int, calls: int) -> dict[str, list[float]]:
    """On every rank: per stage, the seconds per call of each repetition."""
    tensor = torch.ones(numel)
    line_up = torch.ones(1)
    name = ddpkit.comm.group_name()

    def measure_one(stage: str) -> float:
        ddpkit.all_reduce(line_up)
        if stage in CPP_STAGES:
            return ddpkit.testing.time_engine_loop(numel, calls, CPP_STAGES[stage])
        if stage == "python op call":
            return common.time_per_call(torch.ops.ddpkit.collective_checks_enabled, calls=calls)
        if stage == "python torch.ops":
            return common.time_per_call(torch.ops.ddpkit.all_reduce_, tensor, "sum", "auto", name, "auto", calls=calls)
        return common.time_per_call(ddpkit.all_reduce, tensor, calls=calls)

    return interleave(stages, reps, measure_one, warmup=warmup)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke run: few repetitions and calls")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000], help="float32 values per all-reduce")
    parser.add_argument("--stages", nargs="+", choices=STAGES, default=list(STAGES))
    parser.add_argument("--reps", type=int, default=None, help="repetitions per stage (default 25)")
    parser.add_argument("--calls", type=int, default=None, help="back-to-back calls per repetition (default 2000)")
    args = parser.parse_args()
    reps = args.reps or (3 if args.quick else 25)
    calls = args.calls or (100 if args.quick else 2000)
    warmup = 1 if args.quick else 2
    world_size = 2

    records = []
    pool = WorkerPool(world_size, backend="gloo", timeout=600)
    try:
        for numel in args.sizes:
            per_rank = pool.run(measure, numel, args.stages, reps, warmup, calls)
            for stage in args.stages:
                stats = timing.time_stats(timing.slowest_per_rep([rank[stage] for rank in per_rank]))
                records.append(
                    LatencyRecord(
                        stage=stage,
                        loop=stage.split()[0],
                        world_size=world_size,
                        numel=numel if stage in MOVES_DATA else 0,
                        calls_per_rep=calls,
                        **stats,
                    )
                )
    finally:
        pool.close()

    summary = {}
    for numel in args.sizes:
        at = {r.stage: r.median_s for r in records if r.numel in (0, numel)}
        summary[f"numel={numel}"] = {
            label: at[stage] - (at[base] if base else 0.0)
            for label, stage, base in BUDGET
            if stage in at and (base is None or base in at)
        }
    settings = {
        "world_size": world_size,
        "sizes": args.sizes,
        "stages": args.stages,
        "reps": reps,
        "warmup": warmup,
        "calls_per_rep": calls,
        "dtype": "float32",
        "op": "sum",
        "algorithm": "auto",
        "transport": "auto",
        "timing": "per repetition: calls back to back after a one-float all-reduce, divided by the calls; "
        "stages interleaved in a rotating order; the slowest rank per repetition; median",
        "budget": "summary[numel][layer] = median of a stage - median of the stage it adds to (BUDGET)",
    }
    path = write_results(
        "latency",
        backend="gloo",
        device_type="cpu",
        settings=settings,
        records=records,
        summary=summary,
        quick=args.quick,
    )
    print(f"\nper call, 2 ranks on one host (median of the slowest rank over {reps} repetitions of {calls} calls)")
    print_table(
        records,
        ["stage", "numel", "median_s", "p25_s", "p75_s"],
        formats={"median_s": common.seconds, "p25_s": common.seconds, "p75_s": common.seconds},
        align_left=["stage"],
    )
    for key, layers in summary.items():
        print(f"\nbudget of ddpkit.all_reduce at {key}:")
        for label, seconds in layers.items():
            print(f"  {common.seconds(seconds):>10}  {label}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
