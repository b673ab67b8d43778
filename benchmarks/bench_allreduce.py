"""All-reduce: ddpkit's point-to-point algorithms against torch.distributed.all_reduce (gloo, CPU).

    python benchmarks/bench_allreduce.py              # the assignment's grid: 1-32 workers, 1e3-1e5 floats
    python benchmarks/bench_allreduce.py --quick      # a smoke run in well under a minute

For every world size, gloo processes run every candidate on float32 vectors of each size:
correctness first (integer-valued inputs must reduce exactly, else the run stops), then
``--reps`` timed repetitions with the candidates interleaved (their order rotating each repetition),
each preceded by a barrier, split over ``--pools`` fresh sets of processes. A repetition's time is
the slowest rank's; the figure is the median.
Accuracy of averaging: max |ddpkit mean - float64 mean| on N(0, 1) inputs. Memory: the peak
resident-set increase of one call, the maximum over ranks, at the largest size and at
``--memory-numel`` (allocations of 64 KiB and more are forced through mmap so that they show in
the resident set, gloo's own buffers included; Linux updates the peak lazily, so figures below a
few hundred KiB are coarse).
Results: benchmarks/results/allreduce.json.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

import ddpkit  # noqa: E402
from ddpkit.comm import ALGORITHMS  # noqa: E402
from ddpkit.launch import WorkerPool  # noqa: E402

TORCH = "torch.distributed"
UNCHECKED = ":unchecked"  # suffix: the same algorithm with Note [Collective checks] turned off
CANDIDATES = [a for a in ALGORITHMS if a != "process_group"] + [TORCH]
CHECK_OVERHEAD_CANDIDATES = ["ring", "ring" + UNCHECKED, "auto", "auto" + UNCHECKED, TORCH]


def run_candidate(candidate: str, tensor: torch.Tensor, op: str = "sum") -> None:
    if candidate == TORCH:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        if op == "mean":
            tensor.div_(dist.get_world_size())
    elif candidate.endswith(UNCHECKED):
        ddpkit.set_collective_checks(False)  # every rank switches at the same point of the program
        try:
            ddpkit.all_reduce(tensor, op=op, algorithm=candidate[:-len(UNCHECKED)])
        finally:
            ddpkit.set_collective_checks(True)
    else:
        ddpkit.all_reduce(tensor, op=op, algorithm=candidate)


def _vm_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _peak_rss_increase(fn) -> int:
    """Resident bytes added at the peak of ``fn()``: VmHWM is reset to VmRSS first (Linux >= 4.0)."""
    Path("/proc/self/clear_refs").write_text("5")
    before = _vm_kib("VmRSS")
    fn()
    return max(0, _vm_kib("VmHWM") - before) * 1024


def measure(candidates: list[str], sizes: list[int], reps: int, memory_sizes: list[int]) -> dict:
    """Runs on every rank; returns this rank's raw measurements."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    out = {"times": {}, "accuracy": {}, "memory": {}}
    for numel in sizes:
        # Correctness before timing: integer-valued inputs reduce exactly with every candidate.
        for candidate in candidates:
            tensor = torch.arange(numel, dtype=torch.float32) % 1000 + rank
            run_candidate(candidate, tensor)
            expected = (torch.arange(numel, dtype=torch.float32) % 1000) * world_size + world_size * (world_size - 1) / 2
            if not torch.equal(tensor, expected):
                raise AssertionError(f"{candidate} returned a wrong sum for numel={numel}, world_size={world_size}")
        # Accuracy of averaging on N(0, 1) inputs, against the float64 mean of all ranks' inputs.
        inputs = torch.randn(world_size, numel, generator=torch.Generator().manual_seed(numel))
        exact = inputs.double().mean(0)
        for candidate in candidates:
            tensor = inputs[rank].clone()
            run_candidate(candidate, tensor, op="mean")
            out["accuracy"][(candidate, numel)] = float((tensor.double() - exact).abs().max())
        # Timing, interleaved.
        base = torch.randn(numel)
        times = {candidate: [] for candidate in candidates}
        for rep in range(reps):
            shift = rep % len(candidates)
            for candidate in candidates[shift:] + candidates[:shift]:
                tensor = base.clone()
                dist.barrier()
                start = time.perf_counter()
                run_candidate(candidate, tensor)
                times[candidate].append(time.perf_counter() - start)
        for candidate in candidates:
            out["times"][(candidate, numel)] = times[candidate]
    # Memory last: forcing allocations >= 64 KiB through mmap changes the allocator's behaviour.
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD (also turns off its dynamic growth)
    for numel in memory_sizes:
        for candidate in candidates:
            tensor = torch.randn(numel)
            run_candidate(candidate, tensor)  # warm
            dist.barrier()
            out["memory"][(candidate, numel)] = _peak_rss_increase(lambda: run_candidate(candidate, tensor))
    return out


def merge(first: list[dict], second: list[dict]) -> list[dict]:
    """Per rank: the repetitions of both runs; the worse accuracy and memory of the two."""
    merged = []
    for a, b in zip(first, second):
        merged.append({"times": {k: a["times"][k] + b["times"][k] for k in a["times"]},
                       "accuracy": {k: max(a["accuracy"][k], b["accuracy"][k]) for k in a["accuracy"]},
                       "memory": {k: max(a["memory"][k], b["memory"][k]) for k in a["memory"]}})
    return merged


def aggregate(per_rank: list[dict], world_size: int, candidates: list[str], sizes: list[int],
              memory_sizes: list[int]) -> list[dict]:
    records = []
    for numel in memory_sizes:
        for candidate in candidates:
            records.append({"world_size": world_size, "numel": numel, "algorithm": candidate, "kind": "memory",
                            "peak_memory_increase_bytes": max(rank["memory"][(candidate, numel)] for rank in per_rank),
                            "input_bytes": numel * 4})
    for numel in sizes:
        for candidate in candidates:
            reps = len(per_rank[0]["times"][(candidate, numel)])
            slowest = [max(rank["times"][(candidate, numel)][i] for rank in per_rank) for i in range(reps)]
            ordered = sorted(slowest)
            median = common.median(slowest)
            nbytes = numel * 4
            records.append({
                "world_size": world_size,
                "numel": numel,
                "algorithm": candidate,
                "kind": "time",
                "resolved_algorithm": ddpkit.comm.choose_algorithm(nbytes, world_size)
                if candidate.startswith("auto") else candidate.removesuffix(UNCHECKED),
                "checked": not candidate.endswith(UNCHECKED) and candidate != TORCH,
                "median_s": median,
                "p25_s": ordered[len(ordered) // 4],
                "p75_s": ordered[(3 * len(ordered)) // 4],
                "reps": reps,
                "bus_bandwidth_GBps": (nbytes / median) * 2 * (world_size - 1) / world_size / 1e9
                if world_size > 1 and median > 0 else None,
                "max_abs_error_of_mean": max(rank["accuracy"][(candidate, numel)] for rank in per_rank),
            })
    return records


def summarize(records: list[dict]) -> dict:
    by_key = {(r["world_size"], r["numel"], r["algorithm"]): r for r in records if r["kind"] == "time"}
    ratios = {}
    for (world_size, numel, algorithm), record in by_key.items():
        baseline = by_key.get((world_size, numel, TORCH))
        if algorithm in ("ring", "auto") and baseline and world_size > 1:
            ratios[f"{algorithm}/torch ws={world_size} n={numel}"] = record["median_s"] / baseline["median_s"]
    overhead = {}
    for (world_size, numel, algorithm), record in by_key.items():
        unchecked = by_key.get((world_size, numel, algorithm + UNCHECKED))
        if unchecked:
            overhead[f"{algorithm} ws={world_size} n={numel}"] = record["median_s"] / unchecked["median_s"]
    ring_bar = {k: v for k, v in ratios.items() if k.startswith("ring/") and ("ws=2 " in k or "ws=4 " in k)
                and k.endswith("n=100000")}
    auto_upto8 = {k: v for k, v in ratios.items() if k.startswith("auto/") and int(k.split("ws=")[1].split()[0]) <= 8}
    return {
        "ratios_vs_torch": ratios,
        "ring_100k_at_2_and_4": ring_bar,
        "ring_bar_met": all(v <= 1.2 for v in ring_bar.values()) if ring_bar else None,
        "auto_worst_ratio_up_to_8": max(auto_upto8.values()) if auto_upto8 else None,
        "auto_bar_met": all(v <= 1.0 for v in auto_upto8.values()) if auto_upto8 else None,
        "checked_over_unchecked": overhead,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000, 10_000, 100_000])
    parser.add_argument("--pools", type=int, default=2, help="fresh sets of processes per world size")
    parser.add_argument("--memory-numel", type=int, default=4_000_000, help="extra size for the memory pass")
    parser.add_argument("--reps", type=int, default=40, help="timed repetitions per point (fewer above 8 workers)")
    parser.add_argument("--candidates", nargs="+", default=CANDIDATES,
                        choices=CANDIDATES + [c for c in CHECK_OVERHEAD_CANDIDATES if c not in CANDIDATES])
    parser.add_argument("--check-overhead", action="store_true",
                        help="measure Note [Collective checks]: ring and auto with and without checks")
    parser.add_argument("--quick", action="store_true", help="2 and 4 workers, 5 repetitions")
    parser.add_argument("--output", default="allreduce", help="results/<output>.json")
    args = parser.parse_args()
    if args.check_overhead:
        args.candidates = CHECK_OVERHEAD_CANDIDATES
    if args.quick:
        args.world_sizes, args.reps, args.memory_numel, args.pools = [2, 4], 5, 1_000_000, 1
    memory_sizes = [max(args.sizes), args.memory_numel]

    records = []
    started = time.monotonic()
    for world_size in args.world_sizes:
        reps = args.reps if world_size <= 8 else max(5, args.reps // 4)
        per_rank = None
        # The repetitions are split over --pools fresh sets of processes and pooled: a scheduling
        # episode that lasts as long as one set of processes then cannot decide a whole row.
        for _ in range(args.pools):
            pool = WorkerPool(world_size, timeout=1800, group_timeout=600)
            try:
                part = pool.run(measure, args.candidates, args.sizes, max(1, reps // args.pools), memory_sizes)
            finally:
                pool.close()
            per_rank = part if per_rank is None else merge(per_rank, part)
        new = aggregate(per_rank, world_size, args.candidates, args.sizes, memory_sizes)
        records.extend(new)
        print(f"world size {world_size}: {time.monotonic() - started:.0f}s elapsed", flush=True)
        common.print_table([r for r in new if r["kind"] == "time"],
                           ["world_size", "numel", "algorithm", "median_s", "p25_s", "max_abs_error_of_mean"])
        common.print_table([r for r in new if r["kind"] == "memory"],
                           ["world_size", "numel", "algorithm", "peak_memory_increase_bytes"])
    summary = summarize(records)
    path = common.write_results(
        args.output, backend="gloo", device_type="cpu",
        settings={"world_sizes": args.world_sizes, "sizes": args.sizes, "reps": args.reps,
                  "reps_above_8_workers": max(5, args.reps // 4), "pools_per_world_size": args.pools,
                  "dtype": "float32",
                  "memory_sizes": memory_sizes,
                  "threads_per_process": 1, "collective_checks": ddpkit.collective_checks_enabled(),
                  "timing": "slowest rank per repetition, median over interleaved repetitions"},
        records=records, summary=summary)
    print("ring / torch at 100k floats:", {k: round(v, 3) for k, v in summary["ring_100k_at_2_and_4"].items()})
    print("auto worst ratio up to 8 workers:", summary["auto_worst_ratio_up_to_8"])
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
