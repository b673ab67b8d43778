"""Sharded data parallelism (issue 60): ZeRO-1/2 (ddpkit.ShardedOptimizer on ddpkit's DDP) and ZeRO-3
(ddpkit.FullyShardedDataParallel, float32 and bfloat16 compute) against ddpkit's DDP and torch's ways, on CPU.

    python benchmarks/bench_sharding.py                                   # everything below (about 45 minutes)
    python benchmarks/bench_sharding.py --quick                           # a smoke run: small model, few reps
    python benchmarks/bench_sharding.py --phases one_host --models 25M --world-sizes 2
    python benchmarks/bench_sharding.py --candidates ddpkit_ddp zero3 zero3_bf16 fsdp2_ddpkit fsdp2_gloo \
        --output sharding_zero3                                           # ZeRO-3 and its baselines alone

The candidates (sharding_candidates.py: ``CANDIDATES``) each train the same MLP (``--models``: 25M = six Linear
2048x2048, 100M = six 4096x4096) with AdamW, batch ``--batch`` per rank, one thread per rank, on a pool
whose world group is the "ddpkit" backend (each rank also makes a gloo group of the same ranks for the gloo
candidates). Phases:

  * ``one_host``: at each of ``--world-sizes``, each repetition builds every candidate in turn in the same
    processes (``common.interleave``: order rotating), from the same seed, takes ``--warmup`` steps, then times
    ``--steps`` back-to-back steps after a barrier on its group (the slowest rank's time per step; the median
    over ``--reps`` repetitions is reported, with its quartiles), counts its model state after one more
    backward (sharding_candidates.model_state_bytes), reads this process's peak RSS (VmHWM, reset before the
    candidate was built, so it is the candidate's alone: ``peak_rss_bytes``, and its increase over the RSS at
    the reset), compares its parameters with ddpkit DDP's after the same steps (max |difference| recorded;
    ZeRO's are bitwise equal: tests/test_sharded_optimizer.py, tests/test_fsdp.py; read after the peak RSS,
    since ZeRO-3's whole parameters are gathered for it), then drops the candidate. DDP's parameters wait for
    that comparison in a file (``reference_dir``), not in the ranks' memory, where they would add the
    model's size to every candidate's peak RSS alike.
  * ``bytes``: ddpkit's own counters (``ddpkit.comm_counters()["bytes_sent"]``) over one step of each
    candidate whose collectives ddpkit runs, in a pool whose collectives go over messages
    (DDPKIT_TRANSPORT=process_group: shared memory sends none), ddpkit's DDP all-reducing with the ring so
    that ddpkit, not gloo, moves its bytes; the largest over ranks, per step and per parameter. For ZeRO-3 also
    the bytes of one forward without a graph (``gather_bytes_per_forward``: every unit all-gathered once), whose
    bfloat16 to float32 ratio is the issue's "the parameter all-gathers carry half the bytes".
  * ``hosts``: the one_host measurements with bytes on 2x2 simulated hosts (network namespaces of this
    machine: root), the 25M model; the bytes are what crosses hosts (inside a host ddpkit uses shared memory).

Results: benchmarks/results/sharding.json, or ``--output``'s name (``--quick``: results/quick/); the report
reads ZeRO-1/2 from sharding.json, ZeRO-3 from sharding_zero3.json and ZeRO-3's peak memory at the 100M model
from sharding_memory.json (benchmarks/run_all.sh writes all three). ``summary`` holds the issue's bars:
model state per parameter against the ZeRO paper's (within 5%), bytes per step against DDP's, and the step
time ratios (ZeRO-1 <= 0.85x and ZeRO-2 <= 0.8x ddpkit DDP, ZeRO-1 <= 0.9x torch's ZeroRedundancyOptimizer,
ZeRO-3 <= 1.0x ddpkit DDP, <= 0.75x FSDP2 on ddpkit and <= 0.45x FSDP2 on gloo, at 2 ranks and the 25M model;
the others reported), ZeRO-3's peak RSS against DDP's (<= 0.7x at 2 ranks and the 100M model) and its bytes
per step (<= 1.5x DDP's).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import importlib
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import ddpkit  # noqa: E402
import sharding_candidates as candidates  # noqa: E402
from ddpkit.testing import HostPool, WorkerPool  # noqa: E402
from records import ShardingRecord  # noqa: E402

MODELS = {"25M": (2048, 6), "100M": (4096, 6), "tiny": (512, 3)}  # tiny: --quick (above ZeRO-3's persistence threshold)
PHASES = ("one_host", "bytes", "hosts")
TIME_BARS = {
    ("zero1", "ddpkit_ddp"): 0.85,
    ("zero2", "ddpkit_ddp"): 0.8,
    ("zero1", "torch_zero_ddpkit"): 0.9,
    ("zero3", "ddpkit_ddp"): 1.0,
    ("zero3", "fsdp2_ddpkit"): 0.75,
    ("zero3", "fsdp2_gloo"): 0.45,
}
# Peak RSS at 2 ranks and the 100M model, and bytes sent per step, against ddpkit DDP's (the bars).
RSS_BARS = {"zero3": 0.7}
BYTES_BARS = {"zero3": 1.5}
STATE_TOLERANCE = 0.05

# --- on every rank ---------------------------------------------------------------------------------------


def _status_kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def _reset_peak_rss() -> int:
    """Frees what earlier candidates left, resets VmHWM to the current RSS and returns that RSS (bytes)."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")
    return _status_kib("VmRSS") * 1024


def _batches(width: int, batch: int, count: int) -> list[torch.Tensor]:
    rank = dist.get_rank()
    return [torch.randn(batch, width, generator=torch.Generator().manual_seed(1000 * s + rank)) for s in range(count)]


def measure(
    name: str, model: str, batch: int, warmup: int, steps: int, reference_dir: str, algorithm: str = "auto"
) -> dict:
    """One repetition of candidate ``name``: build, warm up, time, count; this rank's figures. ddpkit DDP's
    parameters are saved in ``reference_dir`` (one per rank) and the others compared with them."""
    width, layers = MODELS[model]
    baseline = _reset_peak_rss()
    data = _batches(width, batch, warmup + steps + 1)
    built = candidates.build(name, width, layers, algorithm)
    for x in data[:warmup]:
        built.step(x)
    built.finish()
    dist.barrier(group=built.group)
    ddpkit.reset_comm_counters()
    start = time.perf_counter()
    for x in data[warmup : warmup + steps]:
        built.step(x)
    built.finish()
    seconds = (time.perf_counter() - start) / steps
    bytes_sent = ddpkit.comm_counters()["bytes_sent"] / steps
    built.model(data[-1]).square().mean().backward()  # the state with gradients, before a step
    state = candidates.model_state_bytes(built)
    built.optimizer.step()
    built.optimizer.zero_grad()
    built.finish()
    peak_rss = _status_kib("VmHWM") * 1024
    # After the peak is read: whole parameters are no part of a candidate's training (ZeRO-3 gathers them here).
    parameters = candidates.full_parameters(built)
    reference_path = Path(reference_dir) / f"{model}-rank{dist.get_rank()}.pt"
    if name == "ddpkit_ddp":
        torch.save(parameters, reference_path)
    difference = None
    if reference_path.exists():
        difference = float((parameters - torch.load(reference_path, mmap=True)).abs().max())
    del parameters
    result = {
        "seconds": seconds,
        "state": state,
        "transfer": built.transfer_bytes(),
        "params": _param_count(built),
        "difference": difference,
        "bytes_sent": bytes_sent,
        "peak_rss": peak_rss,
        "baseline_rss": baseline,
    }
    del built
    return result


def _param_count(built) -> int:
    if built.param_count is not None:  # ZeRO-3's parameters are this rank's pieces
        return built.param_count
    return sum(p.numel() for p in built.module.parameters())  # a DTensor's numel is the whole parameter's


def count_bytes(name: str, model: str, batch: int, algorithm: str) -> dict:
    """ddpkit's bytes_sent over one step (after one untimed one), on this rank."""
    width, layers = MODELS[model]
    data = _batches(width, batch, 2)
    built = candidates.build(name, width, layers, algorithm)
    built.step(data[0])
    built.finish()
    ddpkit.reset_comm_counters()
    built.step(data[1])
    built.finish()
    counters = ddpkit.comm_counters()
    gathers = None
    if isinstance(built.model, ddpkit.FullyShardedDataParallel):  # its parameter all-gathers alone
        ddpkit.reset_comm_counters()
        with torch.no_grad():
            built.model(data[1])
        gathers = ddpkit.comm_counters()["bytes_sent"]
    return {
        "bytes": counters["bytes_sent"],
        "messages": counters["messages_sent"],
        "params": _param_count(built),
        "gathers": gathers,
    }


# --- the parent --------------------------------------------------------------------------------------------


def _time_and_state(pool, names, model, args, phase, topology=None) -> list[ShardingRecord]:
    """The one_host (or hosts) phase for one model on one pool: interleaved repetitions of every candidate."""
    n = pool.world_size

    # DDP's parameters for the comparison, this pool's and model's alone (the ranks see this machine's files)
    reference_dir = tempfile.TemporaryDirectory(prefix="bench_sharding-")

    def measure_one(name: str) -> list[dict]:
        cases = importlib.import_module("bench_sharding")  # what the ranks can unpickle by name (hosts too)
        return pool.run(
            cases.measure, name, model, args.batch, args.warmup, args.steps, reference_dir.name, timeout=3600
        )

    with reference_dir:
        per_rep = common.interleave(names, args.reps, measure_one)
    records = []
    for name in names:
        slowest = [max(rank["seconds"] for rank in rep) for rep in per_rep[name]]
        quartiles = statistics.quantiles(slowest, n=4) if len(slowest) > 1 else [slowest[0]] * 3
        ranks = [rank for rep in per_rep[name] for rank in rep]
        params = ranks[0]["params"]
        state = max(rank["state"] for rank in ranks)
        expected = candidates.STATE_BYTES_PER_PARAM.get(name)
        differences = [rank["difference"] for rank in ranks if rank["difference"] is not None]
        peak = max(rank["peak_rss"] for rank in ranks)
        # across hosts ddpkit's counters see what crosses them (inside a host, shared memory sends nothing)
        crossing = max(rank["bytes_sent"] for rank in ranks) if topology and name in candidates.ON_DDPKIT else None
        records.append(
            ShardingRecord(
                phase=phase,
                candidate=name,
                world_size=n,
                topology=topology,
                model=model,
                params=params,
                batch_per_rank=args.batch,
                median_step_s=common.median(slowest),
                p25_step_s=quartiles[0],
                p75_step_s=quartiles[2],
                reps=args.reps,
                steps_per_rep=args.steps,
                model_state_bytes=state,
                model_state_bytes_per_param=state / params,
                expected_bytes_per_param=expected(n) if expected else None,
                transfer_bytes=max(rank["transfer"] for rank in ranks),
                peak_rss_bytes=peak,
                peak_rss_increase_bytes=max(rank["peak_rss"] - rank["baseline_rss"] for rank in ranks),
                bytes_sent_per_step=crossing,
                bytes_sent_per_param=crossing / params if crossing is not None else None,
                max_param_diff_vs_ddp=max(differences) if differences else None,
            )
        )
    return records


def _bytes(pool, names, model, args, phase, topology=None) -> list[ShardingRecord]:
    records = []
    for name in names:
        cases = importlib.import_module("bench_sharding")
        outcomes = pool.run(cases.count_bytes, name, model, args.batch, "ring", timeout=3600)
        sent = max(o["bytes"] for o in outcomes)
        records.append(
            ShardingRecord(
                phase=phase,
                candidate=name,
                world_size=pool.world_size,
                topology=topology,
                model=model,
                params=outcomes[0]["params"],
                batch_per_rank=args.batch,
                bytes_sent_per_step=sent,
                bytes_sent_per_param=sent / outcomes[0]["params"],
                algorithm="ring",
                gather_bytes_per_forward=(
                    max(o["gathers"] for o in outcomes) if outcomes[0]["gathers"] is not None else None
                ),
            )
        )
    return records


def run(args) -> list[ShardingRecord]:
    names = [name for name in candidates.CANDIDATES if name in args.candidates]
    records: list[ShardingRecord] = []
    if "one_host" in args.phases:
        for n in args.world_sizes:
            with WorkerPool(n, backend="ddpkit", threads=1, timeout=3600, group_timeout=600) as pool:
                for model in args.models:
                    records += _time_and_state(pool, names, model, args, "one_host")
                    _print_progress(records)
    if "bytes" in args.phases:
        on_ddpkit = [name for name in names if name in candidates.ON_DDPKIT]
        for n in args.world_sizes:
            env = {"DDPKIT_TRANSPORT": "process_group"}
            with WorkerPool(n, backend="ddpkit", threads=1, timeout=3600, group_timeout=600, env=env) as pool:
                records += _bytes(pool, on_ddpkit, args.models[0], args, "bytes")
    if "hosts" in args.phases:
        unavailable = HostPool.unavailable()
        if unavailable:
            print(f"hosts phase skipped: {unavailable}")
        else:
            with HostPool([2, 2], backend="ddpkit", threads=1, timeout=3600, group_timeout=600) as pool:
                records += _time_and_state(pool, names, args.models[0], args, "hosts", topology="2x2")
    return records


def summarize(records: list[ShardingRecord]) -> dict:
    summary: dict = {}
    timed = {(r.phase, r.topology, r.world_size, r.model, r.candidate): r for r in records if r.median_step_s}
    for (phase, topology, n, model, name), r in sorted(timed.items(), key=str):
        where = f"{topology} hosts" if topology else f"n={n}"
        if r.expected_bytes_per_param:
            ratio = r.model_state_bytes_per_param / r.expected_bytes_per_param
            summary[f"{name} {model} {where}: model state bytes/param (expected {r.expected_bytes_per_param:g})"] = (
                r.model_state_bytes_per_param
            )
            summary[f"{name} {model} {where}: model state within 5%"] = abs(ratio - 1) <= STATE_TOLERANCE
        for (candidate, baseline), bar in TIME_BARS.items():
            base = timed.get((phase, topology, n, model, baseline))
            if candidate != name or base is None:
                continue
            ratio = r.median_step_s / base.median_step_s
            summary[f"{name}/{baseline} step time {model} {where}"] = ratio
            if phase == "one_host" and n == 2 and model == "25M":
                summary[f"{name}/{baseline} step time {model} {where}: meets <= {bar}x"] = ratio <= bar
        base = timed.get((phase, topology, n, model, "ddpkit_ddp"))
        if name in RSS_BARS and base is not None:
            ratio = r.peak_rss_bytes / base.peak_rss_bytes
            summary[f"{name}/ddpkit_ddp peak RSS {model} {where}"] = ratio
            if phase == "one_host" and n == 2 and model == "100M":
                summary[f"{name}/ddpkit_ddp peak RSS {model} {where}: meets <= {RSS_BARS[name]}x"] = (
                    ratio <= RSS_BARS[name]
                )
    sent = {(r.phase, r.world_size, r.candidate): r for r in records if r.bytes_sent_per_step is not None}
    for (phase, n, name), r in sorted(sent.items()):
        base = sent.get((phase, n, "ddpkit_ddp"))
        where = f"{r.topology} hosts (what crosses them)" if r.topology else f"n={n} over messages"
        if base and name != "ddpkit_ddp":
            ratio = r.bytes_sent_per_step / base.bytes_sent_per_step
            summary[f"{name}/ddpkit_ddp bytes sent per step {where}"] = ratio
            if name in BYTES_BARS and phase == "bytes":
                summary[f"{name}/ddpkit_ddp bytes sent per step {where}: meets <= {BYTES_BARS[name]}x"] = (
                    ratio <= BYTES_BARS[name]
                )
    gathers = {(r.world_size, r.candidate): r.gather_bytes_per_forward for r in records if r.gather_bytes_per_forward}
    for (n, name), sent_bytes in sorted(gathers.items()):
        if name != "zero3" and (n, "zero3") in gathers:
            summary[f"{name}/zero3 all-gather bytes per forward n={n}"] = sent_bytes / gathers[(n, "zero3")]
    return summary


def _print_progress(records: list[ShardingRecord]) -> None:
    rows = [
        {
            "phase": r.phase if not r.topology else f"{r.topology} hosts",
            "n": r.world_size,
            "model": r.model,
            "candidate": r.candidate,
            "step": r.median_step_s,
            "state B/param": r.model_state_bytes_per_param,
            "expected": r.expected_bytes_per_param,
            "peak RSS": r.peak_rss_bytes,
            "|diff| vs DDP": r.max_param_diff_vs_ddp,
        }
        for r in records
        if r.median_step_s is not None
    ]
    common.print_table(
        rows,
        list(rows[0]) if rows else [],
        formats={"step": common.seconds, "peak RSS": common.mebibytes},
        align_left=("phase", "model", "candidate"),
        keys=4,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--phases", nargs="+", choices=PHASES, default=list(PHASES))
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=["25M", "100M"])
    parser.add_argument("--world-sizes", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--candidates", nargs="+", default=list(candidates.CANDIDATES))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--output", default="sharding", help="results/<output>.json")
    args = parser.parse_args()
    unknown = sorted(set(args.candidates) - set(candidates.CANDIDATES))
    if unknown:
        parser.error(f"unknown candidates {unknown}; known: {list(candidates.CANDIDATES)}")
    if args.quick:
        args.models, args.reps, args.steps, args.warmup = ["tiny"], 2, 2, 1
    records = run(args)
    summary = summarize(records)
    settings = {
        "models": {m: {"width": MODELS[m][0], "layers": MODELS[m][1]} for m in args.models},
        "world_sizes": args.world_sizes,
        "phases": args.phases,
        "candidates": args.candidates,
        "batch_per_rank": args.batch,
        "reps": args.reps,
        "steps_per_rep": args.steps,
        "warmup_steps": args.warmup,
        "threads_per_rank": 1,
        "optimizer": f"torch.optim.AdamW(lr={candidates.LR})",
    }
    path = common.write_results(
        args.output,
        backend="ddpkit",
        device_type="cpu",
        settings=settings,
        records=records,
        summary=summary,
        quick=args.quick,
    )
    _print_progress(records)
    for key, value in summary.items():
        print(f"{key}: {value}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
