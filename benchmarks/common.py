"""What every ddpkit benchmark shares: the results schema, the recorded context, and timing helpers.

A benchmark measures ddpkit against its PyTorch baseline *in the same run*: every repetition loop
goes through ``interleave``, which runs each candidate once per repetition in an order that rotates
(A B C, B C A, C A B, ...), so that the machine's noise and drift hit every candidate alike; the
figure reported is the median. What a candidate's measurement is (its synchronisation, its clock,
``time_per_call`` or CUDA events) stays the script's. Results go to
``benchmarks/results/<name>.json`` in the schema of ``benchmarks/README.md``, their records typed by
``records.py``; ``write_results`` adds the context (command, commit, machine, torch).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import resource
import shlex
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Hashable, Iterable, Mapping, Optional, Sequence, TypeVar, Union

import torch

from ddpkit.atomic import write_atomically
from records import Record

SCHEMA_VERSION = 1
# benchmarks/run_all.sh --quick points this elsewhere, so smoke runs never replace measured results.
RESULTS_DIR = Path(os.environ.get("DDPKIT_RESULTS_DIR", Path(__file__).resolve().parent / "results")).resolve()
REPO_ROOT = Path(__file__).resolve().parent.parent


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _git_commit() -> Optional[str]:
    if os.environ.get("DDPKIT_GIT_COMMIT"):  # a copy of the tree without .git (the GPU machine)
        return os.environ["DDPKIT_GIT_COMMIT"]
    try:
        out = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO_ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return out + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def environment(backend: str, device_type: str) -> dict:
    """The context a reader needs to reproduce or judge a result."""
    gpu = {}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        gpu = {"gpu_name": props.name, "gpu_count": torch.cuda.device_count(),
               "cuda_version": torch.version.cuda, "gpu_driver": _nvidia_driver()}
    return {
        "command": " ".join(shlex.quote(arg) for arg in [Path(sys.executable).name, *sys.argv]),
        "git_commit": _git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "hostname": socket.gethostname(),
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "backend": backend,
        "device_type": device_type,
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "gpu": gpu or None,
    }


def _nvidia_driver() -> Optional[str]:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=10).stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


def write_results(name: str, *, backend: str, device_type: str, settings: dict, records: Sequence[Record],
                  summary: Optional[dict] = None, directory: Optional[Path] = None) -> Path:
    """Writes ``<directory>/<name>.json`` (default directory: ``RESULTS_DIR``) atomically and returns its path."""
    directory = Path(directory) if directory is not None else RESULTS_DIR
    directory.mkdir(parents=True, exist_ok=True)
    document = {
        "schema_version": SCHEMA_VERSION,
        "benchmark": name,
        "environment": environment(backend, device_type),
        "settings": settings,
        "records": [record.to_dict() for record in records],
        "summary": summary or {},
    }
    text = json.dumps(document, indent=1, sort_keys=False) + "\n"
    return write_atomically(directory / f"{name}.json", lambda handle: handle.write(text.encode()))


Name = TypeVar("Name", bound=Hashable)
Result = TypeVar("Result")


def interleave(names: Sequence[Name], reps: int, measure_one: Callable[[Name], Result], *,
               warmup: int = 0) -> dict[Name, list[Result]]:
    """``measure_one(name)`` for every name in each of ``warmup + reps`` repetitions; name -> its results.

    Repetition ``rep`` runs the names rotated by ``rep`` (``names[rep % n:] + names[:rep % n]``), so
    that every candidate takes every position in turn (none always runs first, or last). The order
    depends on ``rep`` alone: every rank of a group calls ``measure_one`` for the same name at the
    same time, which the collectives inside it need. The first ``warmup`` repetitions run in the
    same rotation and their results are dropped; each list holds the ``reps`` measured results in
    order.
    """
    names = list(names)
    results: dict = {name: [] for name in names}
    for rep in range(warmup + reps):
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:
            result = measure_one(name)
            if rep >= warmup:
                results[name].append(result)
    return results


def time_per_call(fn: Callable[..., Any], *args: Any, calls: int) -> float:
    """Seconds per call of ``fn(*args)``, from the host clock around ``calls`` back-to-back calls."""
    start = time.perf_counter()
    for _ in range(calls):
        fn(*args)
    return (time.perf_counter() - start) / calls


def median(values: Iterable[float]) -> float:
    return statistics.median(list(values))


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def print_table(rows: Sequence[Union[Mapping, Record]], columns: list[str]) -> None:
    """A plain fixed-width table on stdout, of dicts or records (a field a record lacks: blank)."""
    cells = [[_format((row.to_dict() if isinstance(row, Record) else row).get(col)) for col in columns]
             for row in rows]
    widths = [max(len(col), *(len(c[i]) for c in cells)) if cells else len(col) for i, col in enumerate(columns)]
    print("  ".join(col.rjust(w) for col, w in zip(columns, widths)))
    for row in cells:
        print("  ".join(cell.rjust(w) for cell, w in zip(row, widths)))


def _format(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)
