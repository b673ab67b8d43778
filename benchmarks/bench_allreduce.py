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
collapse (seconds per call at 16M floats from 4 processes on 2 cores), so each of their points gets
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
else 1; a gloo barrier before a shared-memory call would add tens of µs of skew, the batch spreads
what skew remains), each the library's own function called from the timing loop with nothing of the
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
import contextlib
import ctypes
import functools
import importlib.util
import inspect
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import common  # noqa: E402
from peers import timing  # noqa: E402
from records import AllreduceMemoryRecord, AllreduceTimeRecord, Record  # noqa: E402

import ddpkit  # noqa: E402
from ddpkit.testing import WorkerPool  # noqa: E402

# Until ddpkit has a transport argument, its only transport is the process group's send/recv.
HAS_TRANSPORT = "transport" in inspect.signature(ddpkit.all_reduce).parameters
DEFAULT_TRANSPORT = (inspect.signature(ddpkit.all_reduce).parameters["transport"].default
                     if HAS_TRANSPORT else "process_group")
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
    implementation: str                 # ddpkit, gloo, floor, mpich, deepspeed
    algorithm: Optional[str] = None     # ddpkit's algorithm argument
    transport: Optional[str] = None     # ddpkit's transport argument; None: not passed (ddpkit's default)
    checked: bool = True                # ddpkit's Note [Collective checks]

    @property
    def effective_transport(self) -> Optional[str]:
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
            f"unknown candidate {name!r}: one of {CANDIDATES} or ddpkit:ALGORITHM[:TRANSPORT][:{UNCHECKED}]")
    checked = parts[-1] != UNCHECKED
    parts = parts if checked else parts[:-1]
    if len(parts) not in (2, 3):
        raise argparse.ArgumentTypeError(f"cannot parse candidate {name!r}: ddpkit:ALGORITHM[:TRANSPORT][:{UNCHECKED}]")
    algorithm = parts[1]
    transport = parts[2] if len(parts) == 3 and parts[2] != "default" else None
    if transport not in (None, PROCESS_GROUP) and not HAS_TRANSPORT:
        raise argparse.ArgumentTypeError(
            f"candidate {name!r}: this ddpkit's all_reduce has no transport argument (process group only)")
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
    theirs (``comm.Allreduce`` inline in MPICH's loop). A wrapper in between took 0.4 us more per
    call (1.46 against 1.05 us per ``ddpkit.all_reduce`` of 1k floats at world size 1)."""
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


current_cpu = ctypes.CDLL(None).sched_getcpu  # glibc's: the CPU this thread runs on now


def reps_sharing_a_cpu(cpus_per_rank: list[list[int]], cpus: int) -> int:
    """How many repetitions began with fewer CPUs in use than there were ranks and CPUs, from each
    rank's CPU at each repetition's start: two ranks that spin on one CPU take turns (12-20 us per
    1k-float all-reduce at n=2 against 2 us), which the figure then says."""
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

        def measure_one(candidate: Candidate) -> Optional[float]:
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

    return [{"times": times(a["times"], b["times"]), "accuracy": accuracy(a["accuracy"], b["accuracy"]),
             "cpus": times(a["cpus"], b["cpus"])} for a, b in zip(first, second)]


def spins_on_shared_memory(candidate: Candidate) -> bool:
    """Whether ``candidate``'s ranks wait by spinning on shared memory (ddpkit on one host with its
    default or shared-memory transport), not asleep on sockets (gloo, ddpkit over the process group,
    the floor's gloo barriers)."""
    return candidate.implementation == "ddpkit" and candidate.effective_transport != PROCESS_GROUP


def process_sets(names: list[str]) -> list[list[str]]:
    """The in-process candidates in the sets of processes that measure them, interleaved within each
    set: those that spin on shared memory in one, the others in another. A candidate that sleeps on
    sockets leaves the ranks where its wake-ups put them, often both on one CPU: measured in the same
    processes right after gloo's repetitions, ddpkit's 1k-float all-reduce took 4.4-9.0 us against
    1.8 us alone (n=2, 2-vCPU VM), while MPICH and DeepSpeed run in processes of their own."""
    spinning = [n for n in names if spins_on_shared_memory(parse_candidate(n))]
    return [group for group in (spinning, [n for n in names if n not in spinning]) if group]


def _time_record(candidate: Candidate, world_size: int, numel: int, slowest: list[float],
                 status: str = "measured", **extra) -> AllreduceTimeRecord:
    """``slowest`` empty: a point not measured, and ``status`` says why."""
    nbytes = numel * 4
    resolved_algorithm = None
    if candidate.implementation == "ddpkit" and candidate.algorithm == "auto" \
            and candidate.effective_transport == PROCESS_GROUP:
        resolved_algorithm = ddpkit.comm.choose_algorithm(nbytes, world_size)
    if slowest:
        stats = timing.time_stats(slowest)
        collective = candidate.implementation != "floor"  # the floor is one process's add, not a collective
        stats.update(algorithm_bandwidth_GBps=nbytes / stats["median_s"] / 1e9,
                     bus_bandwidth_GBps=timing.bus_bandwidth_GBps(nbytes, stats["median_s"], world_size)
                     if collective else None)
    else:
        stats = dict(median_s=None, p25_s=None, p75_s=None, reps=0, algorithm_bandwidth_GBps=None,
                     bus_bandwidth_GBps=None)
    return AllreduceTimeRecord(
        world_size=world_size, numel=numel, candidate=candidate.name, implementation=candidate.implementation,
        algorithm=candidate.algorithm, transport=candidate.effective_transport,
        checked=candidate.checked if candidate.implementation == "ddpkit" else None,
        resolved_algorithm=resolved_algorithm, status=status, **stats, **extra)


def aggregate(per_rank: list[dict], memory_per_rank: Optional[list[dict]], world_size: int, names: list[str],
              sizes: list[int], memory_sizes: list[int], reps_per_size: dict) -> list[Record]:
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
            records.append(_time_record(candidate, world_size, numel, slowest, batch=timing.batch_size(numel),
                                        reps_planned=reps_per_size[numel], cut_off=False,
                                        reps_sharing_a_cpu=sharing,
                                        max_abs_error_of_mean=max(accuracy) if accuracy else None))
    for numel in memory_sizes:
        for name in names:
            if memory_per_rank and (name, numel) in memory_per_rank[0]:
                records.append(AllreduceMemoryRecord(
                    world_size=world_size, numel=numel, candidate=name,
                    peak_memory_increase_bytes=max(r[(name, numel)] for r in memory_per_rank), input_bytes=numel * 4))
    return records


# -- peers: separate jobs -----------------------------------------------------------------------------


def peer_status(name: str) -> dict:
    """Whether a peer can run here, and how it is launched."""
    if name == "mpich":
        mpiexec = Path(sys.executable).parent / "mpiexec"
        if importlib.util.find_spec("mpi4py") is None or importlib.util.find_spec("numpy") is None \
                or not mpiexec.exists():
            return {"status": "not installed", "install": "bash benchmarks/peers/install.sh mpich"}
        return {"status": "installed", "launcher": f"{mpiexec} -n N", "script": "benchmarks/peers/mpich_allreduce.py"}
    if name == "deepspeed":
        if importlib.util.find_spec("deepspeed") is None:
            return {"status": "not installed", "install": "bash benchmarks/peers/install.sh deepspeed"}
        return {"status": "installed", "launcher": "DS_ACCELERATOR=cpu LOCAL_SIZE=N torchrun --standalone "
                "--nproc_per_node N", "script": "benchmarks/peers/deepspeed_allreduce.py"}
    raise ValueError(name)


def _leftovers() -> set:
    """Files the peers leave behind: DeepSpeed never unlinks its shm segments (66 MB per rank), and MPICH's
    hydra leaves its hwloc topology file in /tmp when it is killed."""
    return set(Path("/dev/shm").glob("deepspeed_*")) | set(Path(tempfile.gettempdir()).glob("hydra_hwloc_xmlfile_*"))


def _descendants(pid: int) -> list[int]:
    """Every living descendant of ``pid``, from /proc (torchrun starts its workers in sessions of their own)."""
    children: dict = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    found, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def _kill_tree(pid: int) -> None:
    """SIGKILLs ``pid`` and all its descendants: frozen first, so that none starts another meanwhile."""
    frozen: list[int] = []
    for _ in range(3):  # a process spawned while the tree was listed is caught by the next listing
        for victim in [pid] + _descendants(pid):
            if victim not in frozen:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(victim, signal.SIGSTOP)
                frozen.append(victim)
    for victim in frozen:
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGKILL)


def run_peer(name: str, world_size: int, sizes: list[int], reps: int, point_budget: float,
             accuracy_max_numel: int, limit_s: Optional[float] = None) -> tuple[list[dict], Optional[str]]:
    """Runs one peer job for ``world_size`` processes; (its points as JSON objects, a problem or None)."""
    with tempfile.TemporaryDirectory(prefix=f"ddpkit-{name}-") as tmp:
        out = Path(tmp) / "points.jsonl"
        args = ["--sizes", *map(str, sizes), "--reps", str(reps), "--point-budget", str(point_budget),
                "--accuracy-max-numel", str(accuracy_max_numel), "--out", str(out)]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        if name == "mpich":
            command = [str(Path(sys.executable).parent / "mpiexec"), "-n", str(world_size), sys.executable,
                       str(HERE / "peers" / "mpich_allreduce.py"), *args]
        else:
            env.update(DS_ACCELERATOR="cpu", LOCAL_SIZE=str(world_size))
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                       str(world_size), str(HERE / "peers" / "deepspeed_allreduce.py"), *args]
        # Per point: the budget for repetitions plus correctness, accuracy and warm-up calls; plus start-up.
        limit = limit_s if limit_s is not None else 90 + len(sizes) * (2 * point_budget + 20)
        leftovers_before = _leftovers()
        problem = None
        log = Path(tmp) / "output.txt"
        with log.open("w") as output:  # a file, not a pipe: a stray grandchild cannot block the read
            process = subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT)
            try:
                process.wait(timeout=limit)
                if process.returncode != 0:
                    problem = f"exit code {process.returncode}: " + " | ".join(
                        log.read_text(errors="replace").strip().splitlines()[-5:])
            except subprocess.TimeoutExpired:
                problem = f"job time limit ({limit:.0f} s)"
            finally:
                if process.poll() is None:  # not reaped yet, so its pid is still its own
                    _kill_tree(process.pid)
                    process.wait()
                for leftover in _leftovers() - leftovers_before:  # only what appeared during this job
                    leftover.unlink(missing_ok=True)
        points = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    return points, problem


def merge_points(first: list[dict], second: list[dict]) -> list[dict]:
    """A peer's points of two jobs, per size: the repetitions of both, the worse accuracy, the first
    warm-up; a point only one job measured is kept as it is."""
    merged = {p["numel"]: dict(p) for p in first}
    for point in second:
        mine = merged.get(point["numel"])
        if mine is None:
            merged[point["numel"]] = dict(point)
            continue
        mine["times_s"] = mine["times_s"] + point["times_s"]
        mine["reps_planned"] = mine["reps_planned"] + point["reps_planned"]
        mine["cut_off"] = mine["cut_off"] or point["cut_off"]
        errors = [e for e in (mine["max_abs_error_of_mean"], point["max_abs_error_of_mean"]) if e is not None]
        mine["max_abs_error_of_mean"] = max(errors) if errors else None
    return list(merged.values())


def peer_records(name: str, world_size: int, sizes: list[int], points: list[dict],
                 problem: Optional[str]) -> list[AllreduceTimeRecord]:
    candidate = parse_candidate(name)
    by_numel = {p["numel"]: p for p in points}
    records = []
    for numel in sizes:
        point = by_numel.get(numel)
        if point is None:
            records.append(_time_record(candidate, world_size, numel, [], status=f"not measured: {problem}",
                                        batch=timing.batch_size(numel), cut_off=True, max_abs_error_of_mean=None))
            continue
        records.append(_time_record(candidate, world_size, numel, point["times_s"], batch=point["batch"],
                                    reps_planned=point["reps_planned"], cut_off=point["cut_off"],
                                    warmup_s=point["warmup_s"], library=point["library"],
                                    max_abs_error_of_mean=point["max_abs_error_of_mean"]))
    return records


# -- summary ------------------------------------------------------------------------------------------


def _median_of(by_key: dict, world_size: int, numel: int, name: str) -> Optional[float]:
    record = by_key.get((world_size, numel, name))
    return record.median_s if record and record.median_s else None


# The ddpkit / gloo target's grid.
GLOO_TARGET_WORLD_SIZES = [2, 4, 8]
GLOO_TARGET_SIZES = GRID_SIZES[:5]


def floats_text(numel: int) -> str:
    """1000 -> "1k", 16000000 -> "16M"."""
    for unit, scale in (("M", 1_000_000), ("k", 1_000)):
        if numel >= scale and numel % scale == 0:
            return f"{numel // scale}{unit}"
    return str(numel)


def grid_text(points: list[tuple[int, int]]) -> str:
    """The (world size, floats) points in words: "n in {2, 4} x 1k-1M floats", and how many where the
    points are not the whole product of their world sizes and sizes."""
    world_sizes, sizes = sorted({n for n, _ in points}), sorted({s for _, s in points})
    text = (f"n in {{{', '.join(map(str, world_sizes))}}} x "
            + (f"{floats_text(sizes[0])}-{floats_text(sizes[-1])}" if len(sizes) > 1 else floats_text(sizes[0]))
            + " floats")
    if len(set(points)) < len(world_sizes) * len(sizes):
        text += f" ({len(set(points))} of those points)"
    return text


def quartile_range(by_key: dict, world_size: int, numel: int, name: str, other: str) -> Optional[list[float]]:
    """The widest a ratio of two medians reads from their repetitions' quartiles: mine's p25 over the
    other's p75, mine's p75 over the other's p25."""
    mine, theirs = by_key.get((world_size, numel, name)), by_key.get((world_size, numel, other))
    if not (mine and theirs and mine.p25_s and mine.p75_s and theirs.p25_s and theirs.p75_s):
        return None
    return [mine.p25_s / theirs.p75_s, mine.p75_s / theirs.p25_s]


def summarize(records: list[Record]) -> dict:
    """The issue's bars, from the time records (a ratio below 1 means ddpkit is faster)."""
    by_key = {(r.world_size, r.numel, r.candidate): r for r in records if isinstance(r, AllreduceTimeRecord)}
    summary: dict = {}

    def ratio(world_size, numel, name, other):
        a, b = _median_of(by_key, world_size, numel, name), _median_of(by_key, world_size, numel, other)
        return a / b if a and b else None

    target = [(n, s) for n in GLOO_TARGET_WORLD_SIZES for s in GLOO_TARGET_SIZES]
    measured = [(n, s) for n, s in target if ratio(n, s, "ddpkit", "gloo") is not None]
    over_gloo = {f"n={n} numel={s}": ratio(n, s, "ddpkit", "gloo") for n, s in measured}
    summary["ddpkit_over_gloo"] = over_gloo
    summary["ddpkit_over_gloo_max"] = max(over_gloo.values()) if over_gloo else None
    # A run that left out part of the target's grid (--quick) cannot meet it, only miss it.
    within = all(v <= 0.2 for v in over_gloo.values())
    summary["ddpkit_over_gloo_bar_met"] = (None if not over_gloo else False if not within
                                           else True if len(measured) == len(target) else None)
    summary["ddpkit_over_gloo_bar"] = f"ddpkit / gloo <= 0.2 at {grid_text(target)}"
    summary["ddpkit_over_gloo_measured"] = grid_text(measured) if measured else None
    summary["ddpkit_over_gloo_points"] = [len(measured), len(target)]
    if over_gloo:
        n, s = max(measured, key=lambda point: ratio(*point, "ddpkit", "gloo"))
        summary["ddpkit_over_gloo_worst"] = {"point": f"n={n} numel={s}", "ratio": ratio(n, s, "ddpkit", "gloo"),
                                             "quartile_range": quartile_range(by_key, n, s, "ddpkit", "gloo")}
    ring_pg = {f"n={n} numel={s}": ratio(n, s, "ddpkit_ring_pg", "gloo")
               for n in (2, 4, 8) for s in GRID_SIZES if ratio(n, s, "ddpkit_ring_pg", "gloo") is not None}
    summary["ddpkit_ring_pg_over_gloo"] = ring_pg

    best_peer = {}
    for numel in sorted({r.numel for r in by_key.values() if r.world_size == 2}):
        peers = {name: _median_of(by_key, 2, numel, name) for name in PEERS}
        peers = {k: v for k, v in peers.items() if v}
        mine = _median_of(by_key, 2, numel, "ddpkit")
        if peers and mine:
            best = min(peers, key=peers.get)
            best_peer[f"numel={numel}"] = {"ratio": mine / peers[best], "best_peer": best}
    summary["ddpkit_over_best_peer_n2"] = best_peer

    over_floor = {f"numel={s}": ratio(2, s, "ddpkit", "floor") for s in GRID_SIZES if s >= 1_000_000
                  and ratio(2, s, "ddpkit", "floor") is not None}
    summary["ddpkit_over_floor_n2"] = over_floor
    summary["ddpkit_over_floor_bar_met"] = all(v <= 3 for v in over_floor.values()) if over_floor else None
    summary["ddpkit_over_floor_bar"] = "ddpkit / floor <= 3 at n=2 from 1M floats up"

    overhead = {}
    for (world_size, numel, name), record in by_key.items():
        if name.endswith(":" + UNCHECKED):
            continue
        unchecked = _median_of(by_key, world_size, numel, name + ":" + UNCHECKED)
        if unchecked and record.median_s:
            overhead[f"{name} ws={world_size} n={numel}"] = record.median_s / unchecked
    summary["checked_over_unchecked"] = overhead
    summary["cut_off_points"] = sorted(f"{r.candidate} n={r.world_size} numel={r.numel}"
                                       for r in by_key.values() if r.cut_off)
    return summary


# -- main ---------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=GRID_WORLD_SIZES)
    parser.add_argument("--sizes", type=int, nargs="+", default=None,
                        help=f"floats per vector (default {GRID_SIZES}; with --check-overhead 1k 10k 100k)")
    parser.add_argument("--max-numel-above-8", type=int, default=100_000,
                        help="sizes above this are skipped for more than 8 processes")
    parser.add_argument("--reps", type=int, default=30,
                        help="repetitions up to 100k floats at <= 8 processes; fewer above (peers/timing.py reps_for)")
    parser.add_argument("--pools", type=int, default=2, help="fresh sets of processes per world size")
    parser.add_argument("--memory-sizes", type=int, nargs="*", default=[1_000_000, 16_000_000],
                        help="sizes of the memory pass (up to 8 processes; none: skip it)")
    parser.add_argument("--accuracy-max-numel", type=int, default=1_000_000,
                        help="largest size of the error-of-the-mean check (it holds n vectors per rank)")
    parser.add_argument("--candidates", nargs="+", type=parse_candidate, default=None,
                        help=f"{CANDIDATES} or ddpkit:ALGORITHM[:TRANSPORT][:unchecked] (default: all six)")
    parser.add_argument("--peer-max-world-size", type=int, default=8, help="mpich and deepspeed up to this many")
    parser.add_argument("--point-budget", type=float, default=5.0,
                        help="seconds of timed repetitions per point for mpich and deepspeed (cut_off beyond)")
    parser.add_argument("--check-overhead", action="store_true",
                        help="measure Note [Collective checks]: ddpkit ring and auto with and without checks, and gloo")
    parser.add_argument("--transport", default="default",
                        help="with --check-overhead: ddpkit's transport (default: ddpkit's own default)")
    parser.add_argument("--check-algorithms", nargs="+", default=["ring", "auto"],
                        help="with --check-overhead: the ddpkit algorithms to measure")
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
    names = list(dict.fromkeys(c.name for c in args.candidates))
    in_process = [n for n in names if parse_candidate(n).implementation not in PEERS]
    peers = [n for n in names if n in PEERS]
    statuses = {n: {"status": "in-process"} for n in in_process}
    statuses.update({n: peer_status(n) for n in peers})
    for name, status in statuses.items():
        if status["status"] == "not installed":
            print(f"{name}: not installed ({status['install']}); skipped", flush=True)
    runnable_peers = [n for n in peers if statuses[n]["status"] == "installed"]

    def write(records: list) -> Path:
        """Writes the results so far: after every world size, so that a run cut short keeps them."""
        summary = summarize(records)
        for name in runnable_peers:
            statuses[name]["world_sizes"] = [n for n in args.world_sizes if 2 <= n <= args.peer_max_world_size]
        path = common.write_results(
            args.output, backend="gloo", device_type="cpu",
            settings={"format": "candidates-v2",
                      "world_sizes": args.world_sizes, "sizes": args.sizes,
                      "max_numel_above_8_processes": args.max_numel_above_8,
                      "candidates": statuses,
                      "candidate_definitions": {c.name: {"implementation": c.implementation, "algorithm": c.algorithm,
                                                         "transport": c.effective_transport,
                                                         "checked": c.checked if c.implementation == "ddpkit" else None}
                                                for c in args.candidates},
                      "ddpkit_transport_argument": HAS_TRANSPORT, "ddpkit_default_transport": DEFAULT_TRANSPORT,
                      "reps": args.reps,
                      "reps_per_point": {f"n={n}": {str(s): timing.reps_for(s, n, args.reps) for s in args.sizes
                                                    if n <= 8 or s <= args.max_numel_above_8}
                                         for n in args.world_sizes},
                      "calls_per_repetition": {str(s): timing.batch_size(s) for s in args.sizes},
                      "pools_per_world_size": args.pools, "dtype": "float32",
                      "memory_sizes": args.memory_sizes, "memory_up_to_processes": 8,
                      "accuracy_max_numel": args.accuracy_max_numel,
                      "peer_max_world_size": args.peer_max_world_size, "peer_point_budget_s": args.point_budget,
                      "threads_per_process": 1, "collective_checks": ddpkit.collective_checks_enabled(),
                      "settle_s": timing.SETTLE_S,
                      "timing": "per point and job: settle_s of back-to-back calls first; per repetition: synchronise through the candidate itself, time a batch of back-to-back "
                                "calls on every rank; slowest rank per repetition, median over interleaved repetitions; "
                                "the in-process candidates that spin on shared memory and the others in separate sets of processes; "
                                "mpich and deepspeed in separate jobs, each split like the in-process repetitions over "
                                "--pools jobs that run between the in-process pools"},
            records=records, summary=summary, quick=args.quick)
        return path

    records = []
    started = time.monotonic()
    for world_size in args.world_sizes:
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
                points, problem = run_peer(name, world_size, sizes, timing.split_reps(args.reps, pools)[index],
                                           args.point_budget / pools, args.accuracy_max_numel)
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
        records.extend(new)
        write(records)
        print(f"{world_size} processes: done, {time.monotonic() - started:.0f} s since the start", flush=True)
    path = write(records)
    summary = summarize(records)
    print_summary(records, summary)
    print(f"wrote {path}")


def _with_range(ratio: float, spread: Optional[list[float]]) -> str:
    """``0.150x (quartiles 0.12-0.19)``: the ratio of medians, and how far its repetitions' quartiles let it go."""
    return f"{ratio:.3f}x" + (f" (quartiles {spread[0]:.3f}-{spread[1]:.3f})" if spread else "")


def print_summary(records: list[Record], summary: dict) -> None:
    """Every point's time per call, bandwidth and error; then the ratios the summary holds."""
    timed = [r for r in records if isinstance(r, AllreduceTimeRecord)]
    gloo = {(r.world_size, r.numel): r.median_s for r in timed if r.candidate == "gloo" and r.median_s}
    rows = [{**r.to_dict(), "over_gloo": r.median_s / gloo[(r.world_size, r.numel)]
             if r.median_s and (r.world_size, r.numel) in gloo else None, "cut_off": "cut off" if r.cut_off else ""}
            for r in timed]
    print("\nall-reduce of float32 vectors: median time per call of the slowest rank (p25, p75), against gloo")
    common.print_table(rows, ["world_size", "numel", "candidate", "median_s", "p25_s", "p75_s", "over_gloo",
                              "bus_bandwidth_GBps", "max_abs_error_of_mean", "reps", "cut_off", "status"],
                       align_left={"candidate", "status"}, keys=3,
                       headers={"world_size": "ranks", "numel": "floats", "median_s": "median", "p25_s": "p25",
                                "p75_s": "p75", "over_gloo": "/gloo", "bus_bandwidth_GBps": "bus bandwidth",
                                "max_abs_error_of_mean": "error of mean", "cut_off": ""},
                       formats={"median_s": common.seconds, "p25_s": common.seconds, "p75_s": common.seconds,
                                "over_gloo": common.times, "bus_bandwidth_GBps": common.gigabytes_per_second,
                                "max_abs_error_of_mean": lambda v: f"{v:.1e}",
                                "status": lambda v: "" if v == "measured" else v})
    memory = [r for r in records if isinstance(r, AllreduceMemoryRecord)]
    if memory:
        print("\npeak resident memory added by one warm all-reduce (max over ranks)")
        common.print_table(memory, ["world_size", "numel", "candidate", "peak_memory_increase_bytes", "input_bytes"],
                           align_left={"candidate"},
                           headers={"world_size": "ranks", "numel": "floats", "peak_memory_increase_bytes": "added",
                                    "input_bytes": "vector"},
                           formats={"peak_memory_increase_bytes": common.mebibytes, "input_bytes": common.mebibytes})
    print()
    worst = summary["ddpkit_over_gloo_max"]
    if worst is not None:
        met = summary["ddpkit_over_gloo_bar_met"]
        done, planned = summary["ddpkit_over_gloo_points"]
        verdict = "met" if met else "not met" if met is False else f"not checked, {done} of its {planned} points run"
        target = "" if done == planned else \
            f" at {grid_text([(n, s) for n in GLOO_TARGET_WORLD_SIZES for s in GLOO_TARGET_SIZES])}"
        print(f"ddpkit / gloo at {summary['ddpkit_over_gloo_measured']}: worst "
              f"{_with_range(worst, summary['ddpkit_over_gloo_worst']['quartile_range'])} at "
              f"{summary['ddpkit_over_gloo_worst']['point']}; target <= 0.2x{target}: {verdict}")
    by_key = {(r.world_size, r.numel, r.candidate): r for r in timed}
    for key, value in summary["ddpkit_over_best_peer_n2"].items():
        numel = int(key.split("=")[1])
        spread = quartile_range(by_key, 2, numel, "ddpkit", value["best_peer"])
        print(f"ddpkit / best peer at n = 2, {key}: {_with_range(value['ratio'], spread)} ({value['best_peer']})")
    for key, value in summary["ddpkit_over_floor_n2"].items():
        spread = quartile_range(by_key, 2, int(key.split("=")[1]), "ddpkit", "floor")
        print(f"ddpkit / floor at n = 2, {key}: {_with_range(value, spread)} (target <= 3x)")
    for key, value in summary["checked_over_unchecked"].items():
        print(f"checked / unchecked, {key}: {value:.3f}x")
    if summary["cut_off_points"]:
        print(f"cut off by their time budget: {', '.join(summary['cut_off_points'])}")
    doubled_up = [f"{r.candidate} n={r.world_size} {r.numel}: {r.reps_sharing_a_cpu} of {r.reps}" for r in timed
                  if r.reps_sharing_a_cpu and spins_on_shared_memory(parse_candidate(r.candidate))]
    if doubled_up:
        print(f"repetitions begun with spinning ranks doubled up on a CPU: {', '.join(doubled_up)}")


if __name__ == "__main__":
    main()
