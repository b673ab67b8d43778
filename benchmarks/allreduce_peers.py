"""The all-reduce benchmark's peers, MPICH and DeepSpeed (benchmarks/bench_allreduce.py): separate jobs under their
own launchers, killed with every process they started when they outlive their time limit, and their points as
records."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from allreduce_candidates import parse_candidate, time_record
from peers import timing
from records import AllreduceTimeRecord

HERE = Path(__file__).resolve().parent


def peer_status(name: str) -> dict:
    """Whether a peer can run here, and how it is launched."""
    if name == "mpich":
        mpiexec = Path(sys.executable).parent / "mpiexec"
        if (
            importlib.util.find_spec("mpi4py") is None
            or importlib.util.find_spec("numpy") is None
            or not mpiexec.exists()
        ):
            return {"status": "not installed", "install": "bash benchmarks/peers/install.sh mpich"}
        return {"status": "installed", "launcher": f"{mpiexec} -n N", "script": "benchmarks/peers/mpich_allreduce.py"}
    if name == "deepspeed":
        if importlib.util.find_spec("deepspeed") is None:
            return {"status": "not installed", "install": "bash benchmarks/peers/install.sh deepspeed"}
        return {
            "status": "installed",
            "launcher": "DS_ACCELERATOR=cpu LOCAL_SIZE=N torchrun --standalone --nproc_per_node N",
            "script": "benchmarks/peers/deepspeed_allreduce.py",
        }
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


def run_peer(
    name: str,
    world_size: int,
    sizes: list[int],
    reps: int,
    point_budget: float,
    accuracy_max_numel: int,
    limit_s: float | None = None,
) -> tuple[list[dict], str | None]:
    """Runs one peer job for ``world_size`` processes; (its points as JSON objects, a problem or None)."""
    with tempfile.TemporaryDirectory(prefix=f"ddpkit-{name}-") as tmp:
        out = Path(tmp) / "points.jsonl"
        args = [
            "--sizes",
            *map(str, sizes),
            "--reps",
            str(reps),
            "--point-budget",
            str(point_budget),
            "--accuracy-max-numel",
            str(accuracy_max_numel),
            "--out",
            str(out),
        ]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        if name == "mpich":
            command = [
                str(Path(sys.executable).parent / "mpiexec"),
                "-n",
                str(world_size),
                sys.executable,
                str(HERE / "peers" / "mpich_allreduce.py"),
                *args,
            ]
        else:
            env.update(DS_ACCELERATOR="cpu", LOCAL_SIZE=str(world_size))
            command = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc_per_node",
                str(world_size),
                str(HERE / "peers" / "deepspeed_allreduce.py"),
                *args,
            ]
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
                        log.read_text(errors="replace").strip().splitlines()[-5:]
                    )
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


def peer_records(
    name: str, world_size: int, sizes: list[int], points: list[dict], problem: str | None
) -> list[AllreduceTimeRecord]:
    candidate = parse_candidate(name)
    by_numel = {p["numel"]: p for p in points}
    records = []
    for numel in sizes:
        point = by_numel.get(numel)
        if point is None:
            records.append(
                time_record(
                    candidate,
                    world_size,
                    numel,
                    [],
                    status=f"not measured: {problem}",
                    batch=timing.batch_size(numel),
                    cut_off=True,
                    max_abs_error_of_mean=None,
                )
            )
            continue
        records.append(
            time_record(
                candidate,
                world_size,
                numel,
                point["times_s"],
                batch=point["batch"],
                reps_planned=point["reps_planned"],
                cut_off=point["cut_off"],
                warmup_s=point["warmup_s"],
                library=point["library"],
                max_abs_error_of_mean=point["max_abs_error_of_mean"],
            )
        )
    return records
