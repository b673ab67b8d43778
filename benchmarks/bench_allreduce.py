"""All-reduce grid: ddpkit against gloo, the memory floor, MPICH and DeepSpeed (float32, CPU, one host).

    python benchmarks/bench_allreduce.py                 # the grid below, about 30-40 minutes on 2 cores
    python benchmarks/bench_allreduce.py --quick         # a smoke run: 2 and 4 processes, 3 sizes, 5 reps
    python benchmarks/bench_allreduce.py --world-sizes 2 --sizes 100000 --candidates ddpkit gloo
    python benchmarks/bench_allreduce.py --check-overhead --world-sizes 2 --sizes 100000 --transport shm \\
        --output allreduce_checks                        # checked vs unchecked ddpkit, on one transport

Grid: float32 vectors of 1k, 10k, 100k, 1M, 16M and 64M elements on n = 1..8 processes, and on 16
and 32 processes up to 100k. Candidates (``--candidates``; every one is checked before it is timed):

* ``ddpkit``          ``ddpkit.all_reduce(t, op="sum", algorithm="auto")`` with ddpkit's default transport
  (shared memory on one host when ddpkit has one; a ddpkit without the ``transport`` argument only
  has the process group's send/recv, and the record says so), collective checks on.
* ``ddpkit_ring_pg``  ``ddpkit.all_reduce(t, algorithm="ring", transport="process_group")``: the ring over
  torch.distributed send/recv.
* ``gloo``            ``torch.distributed.all_reduce`` on the gloo group.
* ``floor``           the memory floor: one in-place ``a.add_(b)`` of the vector in one process (rank 0,
  one thread, random data: pages of ``zeros`` are the kernel's shared zero page and read as free).
* ``mpich``           MPICH's ``MPI_Allreduce`` (``peers/mpich_allreduce.py`` under MPICH's ``mpiexec``).
* ``deepspeed``       DeepSpeed's CPU shared-memory ``inference_all_reduce`` (``peers/deepspeed_allreduce.py``
  under torchrun, ``DS_ACCELERATOR=cpu``, ``LOCAL_SIZE=n``).
* ``ddpkit:ALGORITHM[:TRANSPORT][:unchecked]``  any other ddpkit configuration (e.g. ``ddpkit:ring:shm``).

``mpich`` and ``deepspeed`` are separate jobs, only if installed (``bash benchmarks/peers/install.sh``);
otherwise ``settings.candidates`` says "not installed". Their repetitions are split over ``--pools``
jobs like the in-process candidates' over fresh sets of processes, and each of their jobs runs right
after one set has exited, so the candidates alternate over the run (ddpkit's processes, MPICH's,
DeepSpeed's, then again) and a slow spell of the VM falls on all of them alike. They run up to
``--peer-max-world-size`` processes (8): both busy-poll, and with more processes than cores they
collapse (allreduce.json's points from 4 processes on 2 cores show it), so each of their points gets
``--point-budget`` seconds of repetitions in all and says ``cut_off`` when fewer than planned fit; a
job that outlives its time limit is killed and its missing points say so.

Method, for every candidate and size: correctness first (integer-valued inputs must sum exactly on
every rank, else the run stops), the error of the mean (max |mean - float64 mean| on N(0, 1) inputs,
up to ``--accuracy-max-numel``), then timing: ``peers.timing.settle``'s 0.1 s of back-to-back calls
(so that the scheduler has spread a fresh set of processes over the CPUs, as it has in a training
job), then the repetitions. A repetition synchronises the ranks *through the
candidate under test* (a one-float all-reduce of the same ddpkit configuration, of gloo, of DeepSpeed's
shm op; ``MPI_Barrier`` for MPICH; a gloo barrier around rank 0's floor) and then times
``peers.timing.batch_size(numel)`` back-to-back calls on every rank (16 up to 10k floats, 4 at 100k,
else 1; a gloo barrier before a shared-memory call would add the skew of its wake-ups, longer than
a small call, and the batch spreads what skew remains), each the library's own function called from the timing loop with nothing of the
benchmark's between (``user_call``), as the peers' scripts call theirs. The repetition's time per
call is the slowest rank's batch time / batch; the figure is the median (p25, p75 beside it) over
repetitions in which the candidates are interleaved, their order rotating each repetition
(``common.interleave``), split over ``--pools`` fresh sets of processes. The candidates that spin on
shared memory and those that sleep on sockets (gloo, ddpkit over the process group, the floor) run in
separate sets of processes, one after the other (``process_sets``): sockets' wake-ups leave both ranks
on one CPU, which slowed the spinning candidates' next repetitions (MPICH's and DeepSpeed's jobs have
processes of their own).
Repetitions per point: ``peers.timing.reps_for``: ``--reps`` (30) up to 100k floats, /2 at 1M, /4 at
16M, /6 at 64M, /4 again above 8 processes, at least 3. Bus bandwidth as nccl-tests:
bytes / time * 2(n-1)/n. Memory (ddpkit candidates and gloo, at ``--memory-sizes`` up to 8 processes, in a
fresh set of processes): the peak resident-set increase of one warm call, the maximum over ranks
(allocations of 64 KiB and more forced through mmap so that they show in the resident set; the peers'
memory is not measured).
Results: benchmarks/results/allreduce.json; ``summary`` holds the issue's bars.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import common  # noqa: E402
import ddpkit  # noqa: E402
from allreduce_candidates import (  # noqa: E402
    CANDIDATES,
    DEFAULT_TRANSPORT,
    GRID_SIZES,
    GRID_WORLD_SIZES,
    HAS_TRANSPORT,
    PEERS,
    UNCHECKED,
    Candidate,
    collective_checks,
    parse_candidate,
    process_sets,
    run_candidate,
    time_record,
    user_call,
)
from allreduce_peers import merge_points, peer_records, peer_status, run_peer  # noqa: E402
from allreduce_summary import print_summary, summarize  # noqa: E402
from ddpkit.testing import WorkerPool  # noqa: E402
from peers import timing  # noqa: E402
from records import AllreduceMemoryRecord, Record  # noqa: E402

current_cpu = ctypes.CDLL(None).sched_getcpu  # glibc's: the CPU this thread runs on now


def reps_sharing_a_cpu(cpus_per_rank: list[list[int]], cpus: int) -> int:
    """How many repetitions began with fewer CPUs in use than there were ranks and CPUs, from each
    rank's CPU at each repetition's start: two ranks that spin on one CPU take turns, many times slower
    than on two, which the figure then says."""
    return sum(len(set(at_rep)) < min(len(at_rep), cpus) for at_rep in zip(*cpus_per_rank))


def agree_through(candidate: Candidate, flag: torch.Tensor, done: bool) -> bool:
    """True on every rank once any rank is ``done``: a one-float sum through the candidate itself."""
    flag.fill_(float(done))
    run_candidate(candidate, flag)
    return flag.item() > 0


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


def check_sum(candidate: Candidate, numel: int) -> None:
    """Integer-valued inputs reduce exactly; raises on every rank if any rank got a wrong sum."""
    rank, n = dist.get_rank(), dist.get_world_size()
    if candidate.implementation == "floor":
        a = torch.arange(numel, dtype=torch.float32) % 1000
        a.add_(torch.full((numel,), float(rank + 1)))
        ok = torch.equal(a, torch.arange(numel, dtype=torch.float32) % 1000 + (rank + 1))
    else:
        tensor = torch.arange(numel, dtype=torch.float32) % 1000 + rank
        with collective_checks(candidate):
            run_candidate(candidate, tensor)
        expected = (torch.arange(numel, dtype=torch.float32) % 1000) * n + n * (n - 1) / 2
        ok = torch.equal(tensor, expected)
    wrong = torch.tensor([0 if ok else 1])
    dist.all_reduce(wrong, op=dist.ReduceOp.MAX)
    if wrong.item():
        raise AssertionError(f"{candidate.name} returned a wrong sum for numel={numel}, world_size={n}")


def measure(names: list[str], sizes: list[int], reps_per_size: dict, accuracy_max_numel: int) -> dict:
    """Runs on every rank; returns this rank's raw measurements (times per call, seconds)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    candidates = [parse_candidate(name) for name in names]
    out = {"times": {}, "accuracy": {}, "cpus": {}}
    flag = torch.ones(1)
    for numel in sizes:
        for candidate in candidates:
            check_sum(candidate, numel)
        # Accuracy of averaging on N(0, 1) inputs, against the float64 mean of all ranks' inputs.
        if numel <= accuracy_max_numel:
            inputs = torch.randn(world_size, numel, generator=torch.Generator().manual_seed(numel))
            exact = inputs.double().mean(0)
            for candidate in candidates:
                if candidate.implementation == "floor":
                    continue
                tensor = inputs[rank].clone()
                with collective_checks(candidate):
                    run_candidate(candidate, tensor, op="mean")
                out["accuracy"][(candidate.name, numel)] = float((tensor.double() - exact).abs().max())
            del inputs, exact
        # Timing, interleaved; see the module docstring.
        base = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
        work = torch.empty(numel)
        batch = timing.batch_size(numel)

        def measure_one(candidate: Candidate) -> float | None:
            """This rank's time per call in one repetition (the floor: rank 0's alone, None elsewhere)."""
            work.copy_(base)
            if candidate.implementation == "floor":
                dist.barrier()  # the others wait in gloo (asleep), not spinning on a shared-memory flag
                seconds = common.time_per_call(work.add_, base, calls=batch) if rank == 0 else None
                dist.barrier()
                return seconds
            with collective_checks(candidate):
                flag.fill_(1.0)
                run_candidate(candidate, flag)  # the barrier: the candidate's own transport
                out["cpus"].setdefault((candidate.name, numel), []).append(current_cpu())
                return common.time_per_call(user_call(candidate), work, calls=batch)

        for candidate in candidates:
            if candidate.implementation != "floor":
                with collective_checks(candidate):
                    call = user_call(candidate)
                    timing.settle(lambda: call(work), functools.partial(agree_through, candidate, flag), batch)
        times = common.interleave(candidates, reps_per_size[numel], measure_one)
        for candidate in candidates:
            out["times"][(candidate.name, numel)] = times[candidate]
        base = work = None  # frees them before the next size (measure_one holds their cells)
    return out


def measure_memory(names: list[str], memory_sizes: list[int]) -> dict:
    """Runs on every rank of a fresh set of processes: (candidate, numel) -> peak RSS increase of one warm call.

    Fresh processes, because allocations of 64 KiB and more are forced through mmap here (so that they show
    in the resident set): in a process that already ran bigger vectors, glibc would serve them from heap
    pages that are resident already, and the increase would read as zero.
    """
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD (also turns off its dynamic growth)
    out = {}
    for numel in memory_sizes:
        for candidate in map(parse_candidate, names):
            if candidate.implementation == "floor":
                continue
            tensor = torch.randn(numel)
            with collective_checks(candidate):
                run_candidate(candidate, tensor)  # warm
                dist.barrier()
                out[(candidate.name, numel)] = _peak_rss_increase(functools.partial(run_candidate, candidate, tensor))
            del tensor
    return out


def merge(first: list[dict], second: list[dict]) -> list[dict]:
    """Per rank: the repetitions of both runs; the worse accuracy of the two (a point only one run
    measured is kept as it is)."""

    def times(a, b):  # also each rank's CPUs per repetition
        return {k: a.get(k, []) + b.get(k, []) for k in {**a, **b}}

    def accuracy(a, b):
        return {k: max(v for v in (a.get(k), b.get(k)) if v is not None) for k in {**a, **b}}

    return [
        {
            "times": times(a["times"], b["times"]),
            "accuracy": accuracy(a["accuracy"], b["accuracy"]),
            "cpus": times(a["cpus"], b["cpus"]),
        }
        for a, b in zip(first, second)
    ]


def aggregate(
    per_rank: list[dict],
    memory_per_rank: list[dict] | None,
    world_size: int,
    names: list[str],
    sizes: list[int],
    memory_sizes: list[int],
    reps_per_size: dict,
) -> list[Record]:
    records = []
    for numel in sizes:
        for name in names:
            candidate = parse_candidate(name)
            key = (name, numel)
            if candidate.implementation == "floor":
                slowest = per_rank[0]["times"][key]  # measured on rank 0 only
            else:
                slowest = timing.slowest_per_rep([rank["times"][key] for rank in per_rank])
            accuracy = [rank["accuracy"][key] for rank in per_rank if key in rank["accuracy"]]
            sharing = None
            if key in per_rank[0]["cpus"]:
                sharing = reps_sharing_a_cpu([rank["cpus"][key] for rank in per_rank], len(os.sched_getaffinity(0)))
            records.append(
                time_record(
                    candidate,
                    world_size,
                    numel,
                    slowest,
                    batch=timing.batch_size(numel),
                    reps_planned=reps_per_size[numel],
                    cut_off=False,
                    reps_sharing_a_cpu=sharing,
                    max_abs_error_of_mean=max(accuracy) if accuracy else None,
                )
            )
    for numel in memory_sizes:
        for name in names:
            if memory_per_rank and (name, numel) in memory_per_rank[0]:
                records.append(
                    AllreduceMemoryRecord(
                        world_size=world_size,
                        numel=numel,
                        candidate=name,
                        peak_memory_increase_bytes=max(r[(name, numel)] for r in memory_per_rank),
                        input_bytes=numel * 4,
                    )
                )
    return records


# -- main ---------------------------------------------------------------------------------------------


def parse_arguments() -> argparse.Namespace:
    """The command line, its defaults resolved: ``candidates`` parsed, ``sizes`` set; --check-overhead and --quick
    applied."""
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world-sizes", type=int, nargs="+", default=GRID_WORLD_SIZES)
    parser.add_argument(
        "--sizes",
        type=int,
        nargs="+",
        default=None,
        help=f"floats per vector (default {GRID_SIZES}; with --check-overhead 1k 10k 100k)",
    )
    parser.add_argument(
        "--max-numel-above-8", type=int, default=100_000, help="sizes above this are skipped for more than 8 processes"
    )
    parser.add_argument(
        "--reps",
        type=int,
        default=30,
        help="repetitions up to 100k floats at <= 8 processes; fewer above (peers/timing.py reps_for)",
    )
    parser.add_argument("--pools", type=int, default=2, help="fresh sets of processes per world size")
    parser.add_argument(
        "--memory-sizes",
        type=int,
        nargs="*",
        default=[1_000_000, 16_000_000],
        help="sizes of the memory pass (up to 8 processes; none: skip it)",
    )
    parser.add_argument(
        "--accuracy-max-numel",
        type=int,
        default=1_000_000,
        help="largest size of the error-of-the-mean check (it holds n vectors per rank)",
    )
    parser.add_argument(
        "--candidates",
        nargs="+",
        type=parse_candidate,
        default=None,
        help=f"{CANDIDATES} or ddpkit:ALGORITHM[:TRANSPORT][:unchecked] (default: all six)",
    )
    parser.add_argument("--peer-max-world-size", type=int, default=8, help="mpich and deepspeed up to this many")
    parser.add_argument(
        "--point-budget",
        type=float,
        default=5.0,
        help="seconds of timed repetitions per point for mpich and deepspeed (cut_off beyond)",
    )
    parser.add_argument(
        "--check-overhead",
        action="store_true",
        help="measure Note [Collective checks]: ddpkit ring and auto with and without checks, and gloo",
    )
    parser.add_argument(
        "--transport",
        default="default",
        help="with --check-overhead: ddpkit's transport (default: ddpkit's own default)",
    )
    parser.add_argument(
        "--check-algorithms",
        nargs="+",
        default=["ring", "auto"],
        help="with --check-overhead: the ddpkit algorithms to measure",
    )
    parser.add_argument("--quick", action="store_true", help="2 and 4 processes, 1k/100k/1M floats, 5 repetitions")
    parser.add_argument("--output", default="allreduce", help="results/<output>.json")
    args = parser.parse_args()
    sizes_given = args.sizes is not None
    if args.check_overhead:
        suffix = "" if args.transport == "default" else f":{args.transport}"
        base = [f"ddpkit:{a}{suffix}" for a in args.check_algorithms]
        try:
            args.candidates = [parse_candidate(n) for b in base for n in (b, f"{b}:{UNCHECKED}")]
        except argparse.ArgumentTypeError as error:
            parser.error(str(error))
        args.candidates.append(parse_candidate("gloo"))
        if args.sizes is None:
            args.sizes = [1_000, 10_000, 100_000]
        args.memory_sizes = []
    if args.candidates is None:
        args.candidates = [parse_candidate(n) for n in CANDIDATES]
    if args.sizes is None:
        args.sizes = GRID_SIZES
    if args.quick:
        args.world_sizes, args.reps, args.pools = [2, 4], 5, 1
        if not sizes_given:
            args.sizes = [1_000, 100_000] if args.check_overhead else [1_000, 100_000, 1_000_000]
        args.memory_sizes = args.memory_sizes[:1] if args.memory_sizes else []
        args.point_budget = min(args.point_budget, 3.0)
    return args


def candidate_statuses(names: list[str]) -> dict:
    """name -> how it runs: in-process, or a peer's install status and launcher; says which peers are skipped."""
    statuses = {n: {"status": "in-process"} for n in names if parse_candidate(n).implementation not in PEERS}
    statuses.update({n: peer_status(n) for n in names if n in PEERS})
    for name, status in statuses.items():
        if status["status"] == "not installed":
            print(f"{name}: not installed ({status['install']}); skipped", flush=True)
    return statuses


def settings(args: argparse.Namespace, statuses: dict) -> dict:
    """The result's ``settings``: the grid, the candidates and how they were timed."""
    return {
        "format": "candidates-v2",
        "world_sizes": args.world_sizes,
        "sizes": args.sizes,
        "max_numel_above_8_processes": args.max_numel_above_8,
        "candidates": statuses,
        "candidate_definitions": {
            c.name: {
                "implementation": c.implementation,
                "algorithm": c.algorithm,
                "transport": c.effective_transport,
                "checked": c.checked if c.implementation == "ddpkit" else None,
            }
            for c in args.candidates
        },
        "ddpkit_transport_argument": HAS_TRANSPORT,
        "ddpkit_default_transport": DEFAULT_TRANSPORT,
        "reps": args.reps,
        "reps_per_point": {
            f"n={n}": {
                str(s): timing.reps_for(s, n, args.reps) for s in args.sizes if n <= 8 or s <= args.max_numel_above_8
            }
            for n in args.world_sizes
        },
        "calls_per_repetition": {str(s): timing.batch_size(s) for s in args.sizes},
        "pools_per_world_size": args.pools,
        "dtype": "float32",
        "memory_sizes": args.memory_sizes,
        "memory_up_to_processes": 8,
        "accuracy_max_numel": args.accuracy_max_numel,
        "peer_max_world_size": args.peer_max_world_size,
        "peer_point_budget_s": args.point_budget,
        "threads_per_process": 1,
        "collective_checks": ddpkit.collective_checks_enabled(),
        "settle_s": timing.SETTLE_S,
        "timing": "per point and job: settle_s of back-to-back calls first; per repetition: synchronise through the candidate itself, time a batch of back-to-back "
        "calls on every rank; slowest rank per repetition, median over interleaved repetitions; "
        "the in-process candidates that spin on shared memory and the others in separate sets of processes; "
        "mpich and deepspeed in separate jobs, each split like the in-process repetitions over "
        "--pools jobs that run between the in-process pools",
    }


def measure_world_size(
    world_size: int, args: argparse.Namespace, in_process: list[str], runnable_peers: list[str]
) -> list[Record]:
    """Every candidate's records at ``world_size``: the in-process ones' times in fresh sets of processes with the
    peers' jobs between them, then their memory in a set of its own."""
    sizes = [s for s in args.sizes if world_size <= 8 or s <= args.max_numel_above_8]
    memory_sizes = [s for s in (args.memory_sizes or []) if world_size <= 8]
    reps_per_size = {s: timing.reps_for(s, world_size, args.reps) for s in sizes}
    new = []
    peers_here = [n for n in runnable_peers if 2 <= world_size <= args.peer_max_world_size]
    per_rank = None
    peer_points = {name: [] for name in peers_here}
    peer_problems = {name: None for name in peers_here}
    pools = max(1, min(args.pools, min(reps_per_size.values()), args.reps))
    # The repetitions are split over fresh sets of processes and pooled, and every peer's job is
    # split alike and run between them (ddpkit's processes, MPICH's, DeepSpeed's, then again): a
    # scheduling episode that lasts as long as one set of processes, or a slow spell of the VM,
    # then cannot decide a whole row, nor favour the candidate that ran first.
    for index in range(pools):
        for names_here in process_sets(in_process):
            part_reps = {s: timing.split_reps(r, pools)[index] for s, r in reps_per_size.items()}
            pool = WorkerPool(world_size, timeout=3600, group_timeout=900, threads=1)
            try:
                part = pool.run(measure, names_here, sizes, part_reps, args.accuracy_max_numel)
            finally:
                pool.close()
            per_rank = part if per_rank is None else merge(per_rank, part)
        for name in peers_here:
            points, problem = run_peer(
                name,
                world_size,
                sizes,
                timing.split_reps(args.reps, pools)[index],
                args.point_budget / pools,
                args.accuracy_max_numel,
            )
            if problem:
                print(f"{name} at {world_size} processes: {problem}", flush=True)
            peer_points[name] = merge_points(peer_points[name], points)
            peer_problems[name] = peer_problems[name] or problem
    if in_process:
        memory_per_rank = None
        if memory_sizes:
            pool = WorkerPool(world_size, timeout=1800, group_timeout=600, threads=1)
            try:
                memory_per_rank = pool.run(measure_memory, in_process, memory_sizes)
            finally:
                pool.close()
        new += aggregate(per_rank, memory_per_rank, world_size, in_process, sizes, memory_sizes, reps_per_size)
    for name in peers_here:
        new += peer_records(name, world_size, sizes, peer_points[name], peer_problems[name])
    return new


def main() -> None:
    args = parse_arguments()
    names = list(dict.fromkeys(c.name for c in args.candidates))
    statuses = candidate_statuses(names)
    in_process = [n for n in names if statuses[n]["status"] == "in-process"]
    runnable_peers = [n for n in names if statuses[n]["status"] == "installed"]
    for name in runnable_peers:
        statuses[name]["world_sizes"] = [n for n in args.world_sizes if 2 <= n <= args.peer_max_world_size]

    def write(records: list) -> Path:
        """Writes the results so far: after every world size, so that a run cut short keeps them."""
        return common.write_results(
            args.output,
            backend="gloo",
            device_type="cpu",
            settings=settings(args, statuses),
            records=records,
            summary=summarize(records),
            quick=args.quick,
        )

    records = []
    started = time.monotonic()
    for world_size in args.world_sizes:
        records.extend(measure_world_size(world_size, args, in_process, runnable_peers))
        write(records)
        print(f"{world_size} processes: done, {time.monotonic() - started:.0f} s since the start", flush=True)
    path = write(records)
    print_summary(records, summarize(records))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
