"""Reading the results, and where each comes from: the files the report reads, their commits, and whether a
result is of the report's commit."""

from __future__ import annotations

import json
import os
from pathlib import Path

from benchmarks.records import load_records

REPO = Path(__file__).resolve().parents[2]


# results/<name>.json the report reads: benchmarks/run_all.sh produces every one of them from the current tree.
EXPECTED = ["allreduce", "allreduce_checks", "syncbn", "ddp", "training", "backend"]
# Shown when present, a sentence in their place when not: the GPU results, which run_all.sh produces only on a
# machine with a GPU, and the all-reduce grid on that machine's CPU cores (scripts/gpu_checks.sh grid);
# torch_stack (bench_torch_stack.py); multihost (bench_multihost.py, which needs root); latency (bench_latency.py);
# fault_tolerance (bench_fault_tolerance.py, which needs torchft); across three hosts or more, the compressed
# crossing's training and torchft across hosts, also across delayed links (multihost_hosts, multihost_unshaped,
# compression, fault_tolerance_hosts, multihost_delayed, multihost_delayed_4x1_16M, fault_tolerance_hosts_delayed:
# root); sharding and
# sharding_zero3 (bench_sharding.py: ZeRO-1/2 and ZeRO-3, whose 2x2 hosts need root), and sharding_memory
# (ZeRO-3's peak memory at the 100M model).
OPTIONAL = [
    "syncbn_cuda",
    "ddp_cuda",
    "allreduce_16core",
    "torch_stack",
    "multihost",
    "latency",
    "fault_tolerance",
    "multihost_hosts",
    "multihost_unshaped",
    "compression",
    "fault_tolerance_hosts",
    "sharding",
    "sharding_zero3",
    "sharding_memory",
    "multihost_delayed",
    "multihost_delayed_4x1_16M",
    "fault_tolerance_hosts_delayed",
]
# Read from the repository, not from the results folder: torch's own distributed test suite on gloo and on
# "ddpkit", written by scripts/run_torch_suite.py (run_all.sh does not run it); a sentence in its place when absent.
SUITE = "docs/torch_suite.json"


def results_folder() -> Path:
    """The folder the notebook reads: ``$DDPKIT_REPORT_RESULTS`` (how report.py's ``--results`` reaches the
    kernel), else the repository's benchmarks/results."""
    return Path(os.environ.get("DDPKIT_REPORT_RESULTS", REPO / "benchmarks" / "results"))


def load(folder: Path, name: str) -> dict:
    """``<folder>/<name>.json``, its records typed (benchmarks/records.py: r.median_s, r.kind, ...)."""
    document = json.loads((Path(folder) / f"{name}.json").read_text())
    return {**document, "records": load_records(document)}


def load_results(folder: Path) -> dict:
    """The results the report shows, by name: every EXPECTED one (a missing file raises), then each OPTIONAL one
    the folder holds."""
    folder = Path(folder)
    results = {name: load(folder, name) for name in EXPECTED}
    results.update({name: load(folder, name) for name in OPTIONAL if (folder / f"{name}.json").exists()})
    return results


def commit_of(document: dict) -> tuple[str, bool]:
    """(commit, dirty) of a result: git_commit is "<sha>" or "<sha>-dirty" (tracked files had uncommitted
    changes); "unknown" where none was recorded."""
    recorded = document["environment"]["git_commit"] or "unknown"
    return recorded.removesuffix("-dirty"), recorded.endswith("-dirty")


def report_commit(R: dict) -> str:
    """The report's commit: the one most of the EXPECTED results were measured at; of a tie, the one whose latest
    result is the latest."""
    dates: dict[str, list[str]] = {}
    for name in EXPECTED:
        dates.setdefault(commit_of(R[name])[0], []).append(R[name]["environment"]["date"])
    return max(dates, key=lambda commit: (len(dates[commit]), max(dates[commit])))


def provenance_problem(R: dict, name: str) -> str | None:
    """Why result ``name`` is not of the report's commit, in words, or None."""
    commit, dirty = commit_of(R[name])
    expected = report_commit(R)
    problems = []
    if commit != expected:
        problems.append(f"it was measured at commit `{commit[:10]}`, not at `{expected[:10]}` like this report")
    if dirty:
        problems.append(
            "the tree it was measured from had uncommitted changes, so no commit holds the code that produced it"
        )
    return " and ".join(problems) or None
