"""The "ddpkit" torch.distributed backend against gloo, and against ddpkit's own API (CPU, one host).

    python benchmarks/bench_backend.py           # collectives at 2 and 4 processes, torch DDP at 2: ~15 minutes
    python benchmarks/bench_backend.py --quick   # a smoke run
    python benchmarks/bench_backend.py --skip-ddp --world-sizes 2 --sizes 100000

Collectives (float32; ``size`` is the whole vector: all_reduce's tensor, all_gather's output,
reduce_scatter's input; each rank's block is size/n): in one set of processes whose world group runs
on the "ddpkit" backend and which also hold a gloo group of the same ranks, every point times
  * ``gloo``     torch.distributed's call on the gloo group;
  * ``backend``  the same torch.distributed call on the "ddpkit" group;
  * ``ddpkit``   ddpkit's own function (``ddpkit.all_reduce``, ``ddpkit.all_gather_into_tensor``,
                 ``ddpkit.reduce_scatter_tensor``) on that same group, so the two ddpkit candidates
                 share the engine and the shared-memory segment and differ only by the backend layer.
Each candidate's result is checked against gloo's on integer-valued inputs before it is timed.
A repetition synchronises the ranks through the candidate's own transport (a one-float all-reduce),
then times ``timing.batch_size`` back-to-back calls; its figure is the slowest rank's time per call;
repetitions interleave the candidates (order rotating, ``common.interleave``); the figure reported
is the median.
Layers (2 processes, ``--layer-sizes``): one all-reduce through each layer of the stack, from
``dist.all_reduce`` through ``ProcessGroup.allreduce`` down to the backend object's ``allreduce``,
beside ``ddpkit.all_reduce`` and the raw op: where the time above ddpkit's own call goes. A
repetition is a ``dist.barrier()`` then a tight loop of back-to-back calls (200 up to 10k floats,
else 50), the layers interleaved as the candidates above.

DDP: torch's own DistributedDataParallel, unchanged, on "ddpkit" and on "gloo" (2 processes, the
week-4 Net and ResNet-18 on CIFAR-shaped batches, accumulation 1 and 4 with ``no_sync``), timed as in
bench_ddp.py (alternating blocks, slowest rank, median step; parameters must agree after 2 steps).
Results: benchmarks/results/backend.json; ``summary`` holds the issue's bars.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_ddp  # noqa: E402
import common  # noqa: E402
import ddpkit  # noqa: E402
from ddpkit.testing import WorkerPool  # noqa: E402
from peers import timing  # noqa: E402
from records import CollectiveRecord, DdpRecord, LayerRecord, Record  # noqa: E402

COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor")
CANDIDATES = ("gloo", "backend", "ddpkit")
# "floor": the same steps without any gradient communication, the bound on what a backend can save.
DDP_CANDIDATES = {
    "torch_gloo": {"impl": "torch", "backend": "gloo"},
    "torch_ddpkit": {"impl": "torch", "backend": "ddpkit"},
    "floor": {"impl": "floor", "backend": "gloo"},
}

_groups: dict = {}

# torch 2.13 renames all_gather_into_tensor/reduce_scatter_tensor (*_single) and warns on the old names.
_dist_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_dist_reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def _gloo_group():
    if "gloo" not in _groups:
        _groups["gloo"] = dist.new_group(backend="gloo")
    return _groups["gloo"]


def call(collective: str, candidate: str, output: torch.Tensor, input: torch.Tensor) -> None:
    """One collective; all_reduce works in place on ``output`` (``input`` unused)."""
    group = _gloo_group() if candidate == "gloo" else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        if candidate == "ddpkit":
            if collective == "all_reduce":
                ddpkit.all_reduce(output)
            elif collective == "all_gather_into_tensor":
                ddpkit.all_gather_into_tensor(output, input)
            else:
                ddpkit.reduce_scatter_tensor(output, input)
        elif collective == "all_reduce":
            dist.all_reduce(output, group=group)
        elif collective == "all_gather_into_tensor":
            _dist_all_gather(output, input, group=group)
        else:
            _dist_reduce_scatter(output, input, group=group)


def buffers(collective: str, size: int, world_size: int, generator: torch.Generator, integer: bool = False):
    """(output, input) of a collective of ``size`` floats in all."""
    block = size // world_size
    make = (
        (lambda n: torch.randint(-8, 8, (n,), generator=generator).float())
        if integer
        else (lambda n: torch.randn(n, generator=generator))
    )
    if collective == "all_reduce":
        return make(size), None
    if collective == "all_gather_into_tensor":
        return torch.empty(block * world_size), make(block)
    return torch.empty(block), make(block * world_size)


def measure(sizes: list[int], reps: int) -> dict:
    """Runs on every rank: per (collective, size, candidate), this rank's time per call in each repetition."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    times: dict = {}
    for collective in COLLECTIVES:
        for size in sizes:
            # Correctness first: integer-valued inputs, every candidate equal to gloo.
            results = {}
            for candidate in CANDIDATES:
                output, input = buffers(collective, size, world_size, torch.Generator().manual_seed(rank), integer=True)
                call(collective, candidate, output, input)
                results[candidate] = output
            for candidate in CANDIDATES:
                if not torch.equal(results[candidate], results["gloo"]):
                    raise AssertionError(f"{collective} of {size} floats: {candidate} differs from gloo")
            del results
            output, input = buffers(collective, size, world_size, torch.Generator().manual_seed(rank))
            flag = torch.ones(1)
            batch = timing.batch_size(size)

            def measure_one(candidate: str) -> float:
                call("all_reduce", candidate, flag, None)  # synchronise through the candidate's transport
                return common.time_per_call(call, collective, candidate, output, input, calls=batch)

            per = common.interleave(CANDIDATES, timing.reps_for(size, world_size, reps), measure_one)
            for candidate in CANDIDATES:
                times[(collective, size, candidate)] = per[candidate]
    return times


LAYERS = (
    "dist.all_reduce",
    "ProcessGroup.allreduce",
    "Backend.allreduce",
    "ddpkit.all_reduce",
    "torch.ops.ddpkit.all_reduce_",
)


def measure_layers(sizes: list[int], reps: int) -> dict:
    """Runs on every rank: one all-reduce through each layer of the stack, from torch.distributed's Python
    function down to the backend object, beside ddpkit's own call, in a tight loop (calls per rep:
    200 up to 10k floats, else 50); the repetitions interleave the layers."""
    group = dist.group.WORLD
    options = dist.AllreduceOptions()
    options.asyncOp = False
    backend = group._get_backend(torch.device("cpu"))
    times: dict = {}
    for size in sizes:
        tensor = torch.randn(size)
        calls = {
            "dist.all_reduce": lambda: dist.all_reduce(tensor),
            "ProcessGroup.allreduce": lambda: group.allreduce([tensor], options).wait(),
            "Backend.allreduce": lambda: backend.allreduce([tensor], options).wait(),
            "ddpkit.all_reduce": lambda: ddpkit.all_reduce(tensor),
            "torch.ops.ddpkit.all_reduce_": lambda: torch.ops.ddpkit.all_reduce_(
                tensor, "sum", "auto", group.group_name
            ),
        }
        batch = 200 if size <= 10_000 else 50

        def measure_one(name: str) -> float:
            dist.barrier()
            return common.time_per_call(calls[name], calls=batch)

        per = common.interleave(LAYERS, reps, measure_one)
        for name in LAYERS:
            times[(size, name)] = per[name]
    return times


def layer_records(sizes: list[int], reps: int) -> list[LayerRecord]:
    with WorkerPool(2, backend="ddpkit", timeout=3600, group_timeout=600) as pool:
        per_rank = pool.run(measure_layers, sizes, reps)
    records = []
    for size, name in per_rank[0]:
        slowest = timing.slowest_per_rep([rank[(size, name)] for rank in per_rank])
        records.append(
            LayerRecord(layer=name, world_size=2, numel=size, median_s=common.median(slowest), reps=len(slowest))
        )
    return records


def collective_records(world_size: int, sizes: list[int], reps: int) -> list[CollectiveRecord]:
    with WorkerPool(world_size, backend="ddpkit", timeout=3600, group_timeout=600) as pool:
        per_rank = pool.run(measure, sizes, reps)
    records = []
    for collective, size, candidate in per_rank[0]:
        slowest = timing.slowest_per_rep([rank[(collective, size, candidate)] for rank in per_rank])
        ordered = sorted(slowest)
        median = common.median(slowest)
        nbytes = 4 * size
        records.append(
            CollectiveRecord(
                collective=collective,
                candidate=candidate,
                world_size=world_size,
                numel=size,
                bytes=nbytes,
                median_s=median,
                p25_s=ordered[len(ordered) // 4],
                p75_s=ordered[(3 * len(ordered)) // 4],
                reps=len(slowest),
                # nccl-tests' bus bandwidth: all-reduce moves 2(n-1)/n of the vector, the other two (n-1)/n.
                busbw_GBps=nbytes
                / median
                * (2 if collective == "all_reduce" else 1)
                * (world_size - 1)
                / world_size
                / 1e9,
            )
        )
    return records


def summarize(records: list[Record]) -> dict:
    summary: dict = {}
    times = {
        (r.collective, r.world_size, r.numel, r.candidate): r.median_s
        for r in records
        if isinstance(r, CollectiveRecord)
    }
    for (collective, n, size, candidate), t in sorted(times.items()):
        if candidate != "backend":
            continue
        summary[f"{collective} n={n} {size}: backend/ddpkit"] = t / times[(collective, n, size, "ddpkit")]
        summary[f"{collective} n={n} {size}: backend/gloo"] = t / times[(collective, n, size, "gloo")]
    layers = {(r.numel, r.layer): r.median_s for r in records if isinstance(r, LayerRecord)}
    for (size, name), t in sorted(layers.items()):
        if name != "ddpkit.all_reduce":
            summary[f"layers n=2 {size}: {name}/ddpkit.all_reduce"] = t / layers[(size, "ddpkit.all_reduce")]
    ddp = {(r.model, r.accumulation, r.candidate): r for r in records if isinstance(r, DdpRecord)}
    for (model, accumulation, candidate), r in ddp.items():
        if candidate != "torch_ddpkit":
            continue
        base = ddp[(model, accumulation, "torch_gloo")]
        summary[f"torch DDP {model} acc={accumulation}: ddpkit/gloo time"] = r.median_step_s / base.median_step_s
        summary[f"torch DDP {model} acc={accumulation}: ddpkit/gloo memory"] = (
            r.peak_memory_bytes / base.peak_memory_bytes
        )
        floor = ddp.get((model, accumulation, "floor"))
        if floor is not None:
            summary[f"torch DDP {model} acc={accumulation}: floor/gloo time"] = floor.median_step_s / base.median_step_s
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000, 10_000, 100_000, 1_000_000, 16_000_000])
    parser.add_argument("--reps", type=int, default=30, help="repetitions up to 100k floats (fewer above)")
    parser.add_argument(
        "--layer-sizes",
        type=int,
        nargs="+",
        default=[1_000, 100_000],
        help="sizes of the per-layer all-reduce timing (2 processes)",
    )
    parser.add_argument("--models", nargs="+", default=["net", "resnet18"])
    parser.add_argument("--accumulation", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--blocks", type=int, default=12, help="alternating DDP blocks per candidate")
    parser.add_argument("--skip-ddp", action="store_true")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--output", default="backend")
    args = parser.parse_args()
    if args.quick:
        args.sizes, args.reps, args.models, args.blocks = [1_000, 100_000], 5, ["net"], 2
    records = []
    for world_size in args.world_sizes:
        started = time.monotonic()
        records += collective_records(world_size, args.sizes, args.reps)
        print(f"collectives at {world_size} processes: measured in {time.monotonic() - started:.0f} s", flush=True)
    started = time.monotonic()
    records += layer_records(args.layer_sizes, 15)
    print(f"layers: measured in {time.monotonic() - started:.0f} s", flush=True)
    batch_for, steps_for = {"net": 64, "resnet18": 16}, {"net": 10, "resnet18": 2}
    if not args.skip_ddp:
        for model_name in args.models:
            for accumulation in args.accumulation:
                started = time.monotonic()
                ddp = bench_ddp.run_config(
                    model_name,
                    batch_for[model_name],
                    accumulation,
                    2,
                    args.blocks,
                    steps_for[model_name],
                    "gloo",
                    candidates=DDP_CANDIDATES,
                    reference="torch_gloo",
                )
                records += [dataclasses.replace(r, kind="ddp") for r in ddp]
                print(
                    f"torch DDP {model_name} accumulation {accumulation}: measured in "
                    f"{time.monotonic() - started:.0f} s",
                    flush=True,
                )
    summary = summarize(records)
    path = common.write_results(
        args.output,
        backend="ddpkit vs gloo",
        device_type="cpu",
        settings={
            "world_sizes": args.world_sizes,
            "sizes": args.sizes,
            "reps": args.reps,
            "dtype": "float32",
            "collectives": list(COLLECTIVES),
            "candidates": list(CANDIDATES),
            "ddp_models": args.models,
            "ddp_accumulation": args.accumulation,
            "ddp_blocks": args.blocks,
            "ddp_skipped": args.skip_ddp,
            "ddp_batch_per_rank": batch_for,
            "ddp_steps_per_block": steps_for,
        },
        records=records,
        summary=summary,
        quick=args.quick,
    )
    print_summary(records)
    print(f"wrote {path}")


def print_summary(records: list[Record]) -> None:
    """The collectives per candidate with the backend's ratios, the layers, and torch DDP on both backends."""
    collectives = [r for r in records if isinstance(r, CollectiveRecord)]
    times = {(r.collective, r.world_size, r.numel, r.candidate): r.median_s for r in collectives}
    rows = [
        {
            "collective": collective,
            "world_size": n,
            "numel": numel,
            **{candidate: times[(collective, n, numel, candidate)] for candidate in CANDIDATES},
            "backend_over_gloo": times[(collective, n, numel, "backend")] / times[(collective, n, numel, "gloo")],
            "backend_over_ddpkit": times[(collective, n, numel, "backend")] / times[(collective, n, numel, "ddpkit")],
        }
        for (collective, n, numel, candidate) in times
        if candidate == "backend"
    ]
    print(
        "\ntorch.distributed's collectives on the ddpkit backend (backend) against gloo and against ddpkit's own "
        "function on the same group (ddpkit); median time per call of the slowest rank, float32"
    )
    common.print_table(
        rows,
        ["collective", "world_size", "numel", *CANDIDATES, "backend_over_gloo", "backend_over_ddpkit"],
        align_left={"collective"},
        keys=3,
        headers={
            "world_size": "ranks",
            "numel": "floats",
            "backend_over_gloo": "backend/gloo",
            "backend_over_ddpkit": "backend/ddpkit",
        },
        formats={
            **{candidate: common.seconds for candidate in CANDIDATES},
            "backend_over_gloo": common.times,
            "backend_over_ddpkit": common.times,
        },
    )
    layers = [r for r in records if isinstance(r, LayerRecord)]
    own = {r.numel: r.median_s for r in layers if r.layer == "ddpkit.all_reduce"}
    print("\none all-reduce through each layer of torch.distributed (2 processes), against ddpkit.all_reduce")
    common.print_table(
        [{**r.to_dict(), "ratio": r.median_s / own[r.numel]} for r in layers],
        ["layer", "numel", "median_s", "ratio"],
        align_left={"layer"},
        headers={"numel": "floats", "median_s": "time per call", "ratio": "/ddpkit.all_reduce"},
        formats={"median_s": common.seconds, "ratio": common.times},
    )
    ddp = [r for r in records if isinstance(r, DdpRecord)]
    if ddp:
        bench_ddp.print_summary(ddp, reference="torch_gloo")


if __name__ == "__main__":
    main()
