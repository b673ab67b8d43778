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
import math
import os
import platform
import resource
import shlex
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch

from ddpkit.atomic import write_atomically
from records import Record

SCHEMA_VERSION = 1
REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"  # the measured results, committed; the report reads them
QUICK_RESULTS_DIR = RESULTS_DIR / "quick"  # smoke runs (--quick), git-ignored


def results_dir(quick: bool) -> Path:
    """Where a script writes its results: ``$DDPKIT_RESULTS_DIR`` if set, else ``QUICK_RESULTS_DIR`` for a
    smoke run (so that one never replaces a measured result), else ``RESULTS_DIR``."""
    if os.environ.get("DDPKIT_RESULTS_DIR"):
        return Path(os.environ["DDPKIT_RESULTS_DIR"]).resolve()
    return QUICK_RESULTS_DIR if quick else RESULTS_DIR


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


# What the benchmarks and the report write themselves: a change there does not make a measurement's
# tree dirty (run_all.sh rewrites them one after the other from one commit).
MEASUREMENT_OUTPUTS = ("benchmarks/results", "notebooks/report.ipynb")


def _git_commit() -> str | None:
    """HEAD, with "-dirty" when tracked files other than MEASUREMENT_OUTPUTS have uncommitted changes."""
    if os.environ.get("DDPKIT_GIT_COMMIT"):  # a copy of the tree without .git (the GPU machine)
        return os.environ["DDPKIT_GIT_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            [
                "git",
                "-C",
                str(REPO_ROOT),
                "status",
                "--porcelain",
                "--untracked-files=no",
                "--",
                ".",
                *(f":(exclude){path}" for path in MEASUREMENT_OUTPUTS),
            ],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        return out + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def environment(backend: str, device_type: str) -> dict:
    """The context a reader needs to reproduce or judge a result."""
    gpu = {}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        gpu = {
            "gpu_name": props.name,
            "gpu_count": torch.cuda.device_count(),
            "cuda_version": torch.version.cuda,
            "gpu_driver": _nvidia_driver(),
        }
    return {
        "command": " ".join(
            shlex.quote(arg) for arg in [*_settings_from_environment(), Path(sys.executable).name, *sys.argv]
        ),
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


def _settings_from_environment() -> list[str]:
    """The DDPKIT_* variables that change what ddpkit does (DDPKIT_SHM_WHOLE_BYTES=131072, say), as the
    command's prefix; not the two that only say where results go and which commit wrote them."""
    where = {"DDPKIT_RESULTS_DIR", "DDPKIT_GIT_COMMIT"}
    return [f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("DDPKIT_") and k not in where]


def _nvidia_driver() -> str | None:
    try:
        return (
            subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=10,
            )
            .stdout.strip()
            .splitlines()[0]
        )
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


def write_results(
    name: str,
    *,
    backend: str,
    device_type: str,
    settings: dict,
    records: Sequence[Record],
    summary: dict | None = None,
    quick: bool = False,
    directory: Path | None = None,
) -> Path:
    """Writes ``<directory>/<name>.json`` atomically and returns its path; the directory is
    ``results_dir(quick)`` unless given."""
    directory = Path(directory) if directory is not None else results_dir(quick)
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


def interleave(
    names: Sequence[Name], reps: int, measure_one: Callable[[Name], Result], *, warmup: int = 0
) -> dict[Name, list[Result]]:
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


def median_interval(values: Iterable[float], confidence: float = 0.95) -> tuple[float, float]:
    """A distribution-free confidence interval of the median: the order statistics that the binomial
    distribution puts around it. Too few values for ``confidence`` give their whole range."""
    xs = sorted(values)
    n = len(xs)
    if n == 0:
        raise ValueError("median_interval needs at least one value")
    tail = (1 - confidence) / 2
    below, k = 0.0, 0  # P(Binomial(n, 1/2) < k), and k
    while k < n:
        p = math.comb(n, k) / 2**n
        if below + p > tail:
            break
        below += p
        k += 1
    return (xs[k - 1], xs[n - k]) if k else (xs[0], xs[-1])


def ratio_spread(ratios: Iterable[float], confidence: float = 0.95) -> dict:
    """The median of paired ratios with its confidence interval (``low``, ``high``) and the pairs'
    quartiles: what a printed ratio needs to be read as more than one draw."""
    ratios = list(ratios)
    low, high = median_interval(ratios, confidence)
    p25, _, p75 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
    return {
        "median": statistics.median(ratios),
        "low": low,
        "high": high,
        "confidence": confidence,
        "p25": p25,
        "p75": p75,
        "pairs": len(ratios),
    }


def spread_text(spread: dict) -> str:
    """``0.812x (95% CI 0.795-0.830, 40 pairs)``."""
    pairs = f"{spread['pairs']} pair{'' if spread['pairs'] == 1 else 's'}"
    if spread["pairs"] < MIN_PAIRS:
        return f"{spread['median']:.3f}x ({pairs}, no interval)"
    return (
        f"{spread['median']:.3f}x ({100 * spread['confidence']:.0f}% CI {spread['low']:.3f}-{spread['high']:.3f}, "
        f"{pairs})"
    )


MIN_PAIRS = 6  # fewer values than this have no 95% interval of their median, only their range


def verdict(spread: dict, faster: str, slower: str) -> str:
    """What a ratio's interval lets one say: which side of 1.0 it lies on, or that it includes it."""
    if spread["pairs"] < MIN_PAIRS:
        return f"too few pairs to tell ({MIN_PAIRS} or more give a {100 * spread['confidence']:.0f}% interval)"
    if spread["low"] <= 1.0 <= spread["high"]:
        return f"the interval includes 1.0: this run cannot tell {faster} and {slower} apart"
    return f"{faster} faster" if spread["high"] < 1.0 else f"{faster} slower"


def _cpu_jiffies() -> tuple[int, int, int] | None:
    """The machine's (total, busy, steal) CPU time since boot, in clock ticks (/proc/stat)."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:9]]
    except (OSError, ValueError, IndexError):
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = fields
    return sum(fields), user + nice + system + irq + softirq, steal


def _own_jiffies() -> int:
    """CPU time of this process and all its descendants alive now, in clock ticks."""
    parents, times = {}, {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2 :].split()  # the command name may hold spaces
        pid = int(stat.parent.name)
        parents[pid], times[pid] = int(fields[1]), int(fields[11]) + int(fields[12])
    mine, frontier = {os.getpid()}, [os.getpid()]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent and pid not in mine]
        mine.update(children)
        frontier.extend(children)
    return sum(times.get(pid, 0) for pid in mine)


class MachineLoad:
    """How busy the machine was with other work while a benchmark ran: the CPU time that neither this
    process nor its descendants used, the hypervisor's steal, and the 1-minute load average.

    ``start()`` and ``stop()`` must be called while the benchmark's worker processes are alive: the
    time of a process that has exited is lost to the count of our own, and would read as others'."""

    # Above these, a ratio measured here may not be what a quiet machine gives.
    OTHERS_LIMIT = 0.10
    STEAL_LIMIT = 0.05

    def __init__(self) -> None:
        self._start: tuple | None = None
        self.load_averages: list[float] = []

    def start(self) -> None:
        self._start = (_cpu_jiffies(), _own_jiffies())
        self.sample()

    def sample(self) -> None:
        try:
            self.load_averages.append(os.getloadavg()[0])
        except OSError:
            pass

    def stop(self) -> dict:
        self.sample()
        machine, own = _cpu_jiffies(), _own_jiffies()
        result: dict = {
            "cpus": os.cpu_count(),
            "load_average_1m_max": max(self.load_averages, default=None),
            "others_cpu_fraction": None,
            "steal_fraction": None,
        }
        if self._start and self._start[0] and machine:
            total = machine[0] - self._start[0][0]
            if total > 0:
                others = (machine[1] - self._start[0][1]) - (own - self._start[1])
                result["others_cpu_fraction"] = max(0.0, others / total)
                result["steal_fraction"] = (machine[2] - self._start[0][2]) / total
        result["loaded"] = bool(
            (result["others_cpu_fraction"] or 0) > self.OTHERS_LIMIT
            or (result["steal_fraction"] or 0) > self.STEAL_LIMIT
        )
        return result


def load_text(load: dict) -> str:
    """One sentence on how busy the machine was with other work."""
    others, steal = load.get("others_cpu_fraction"), load.get("steal_fraction")
    if others is None:
        return "machine load: not measured (no /proc/stat)"
    text = (
        f"other processes used {100 * others:.0f}% of the {load['cpus']} CPUs, steal {100 * steal:.0f}%, "
        f"load average up to {load['load_average_1m_max']:.1f}"
    )
    if load["loaded"]:
        return f"the machine was loaded: {text}; a quiet machine may give another ratio"
    return f"the machine was quiet: {text}"


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


TABLE_WIDTH = 100  # a terminal's or a log's width: wider tables are printed in parts


def print_table(
    rows: Sequence[Mapping | Record],
    columns: list[str],
    *,
    headers: Mapping[str, str] | None = None,
    formats: Mapping[str, Callable[[Any], str]] | None = None,
    align_left: Iterable[str] = (),
    keys: int = 1,
    width: int = TABLE_WIDTH,
) -> None:
    """A plain fixed-width table on stdout, of dicts or records (a field a row lacks: blank).

    ``headers`` renames columns (default: the key), ``formats`` turns a column's values into text
    with their unit (``seconds``, ``mebibytes``, ``times``; default: 4 significant digits), and the
    columns in ``align_left`` are aligned left (names), the others right (numbers). A table wider
    than ``width`` is printed as several, one under the other, each repeating the first ``keys``
    columns (what names a row) before as many of the others as fit.
    """
    headers, formats, align_left = headers or {}, formats or {}, set(align_left)
    cells = []
    for row in rows:
        values = row.to_dict() if isinstance(row, Record) else row
        cells.append([_format(values.get(col), formats.get(col)) for col in columns])
    titles = [headers.get(col, col) for col in columns]
    widths = [max(len(title), *(len(c[i]) for c in cells)) if cells else len(title) for i, title in enumerate(titles)]

    def line(indices: Sequence[int], texts: Sequence[str]) -> str:
        return "  ".join(
            texts[i].ljust(widths[i]) if columns[i] in align_left else texts[i].rjust(widths[i]) for i in indices
        ).rstrip()

    def span(indices: Sequence[int]) -> int:
        return sum(widths[i] for i in indices) + 2 * (len(indices) - 1)

    keys = min(keys, len(columns))
    parts, part = [], list(range(keys))
    for i in range(keys, len(columns)):
        if len(part) > keys and span(part + [i]) > width:
            parts.append(part)
            part = list(range(keys))
        part.append(i)
    parts.append(part)
    for number, part in enumerate(parts):
        if number:
            print()
        print(line(part, titles))
        for row in cells:
            print(line(part, row))


def _format(value: Any, format: Callable[[Any], str] | None = None) -> str:
    if value is None:
        return ""
    if format is not None:
        return format(value)
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def seconds(value: float) -> str:
    """A duration with the unit that keeps it readable: 12.3 µs, 4.56 ms, 7.89 s."""
    if abs(value) < 1e-3:
        return f"{value * 1e6:.1f} µs"
    if abs(value) < 1:
        return f"{value * 1e3:.2f} ms"
    return f"{value:.2f} s"


def mebibytes(value: float) -> str:
    return f"{value / 2**20:.1f} MiB"


def times(value: float) -> str:
    """A ratio: 0.84x."""
    return f"{value:.3f}x"


def gigabytes_per_second(value: float) -> str:
    return f"{value:.3g} GB/s"
