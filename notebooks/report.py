"""Builds notebooks/report.ipynb from the benchmark results and executes it headless.

    python notebooks/report.py                                   # benchmarks/results -> notebooks/report.ipynb
    python notebooks/report.py --results DIR --output PATH       # e.g. the --quick results of run_all.sh

The notebook reads ``<results>/*.json`` (schema: benchmarks/README.md), their records as the
typed records of benchmarks/records.py (``r.median_s``), and SUITE (torch's distributed test suite on
both backends, written by scripts/run_torch_suite.py). Every number in its text is computed from
those files when it runs; nothing is typed in. The cells are defined here so that the report's
source is reviewable as code; edit this file, not the .ipynb.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import nbformat
from nbclient import NotebookClient

HERE = Path(__file__).resolve().parent
# results/<name>.json the report reads: benchmarks/run_all.sh produces every one of them from the current tree.
EXPECTED = ["allreduce", "allreduce_checks", "syncbn", "ddp", "training", "backend"]
# Shown when present, a sentence in their place when not: the GPU results, which run_all.sh produces only on a
# machine with a GPU, and the all-reduce grid on that machine's CPU cores (scripts/gpu_checks.sh grid); torch_stack (bench_torch_stack.py); multihost (bench_multihost.py, which needs root);
# latency (bench_latency.py).
OPTIONAL = ["syncbn_cuda", "ddp_cuda", "allreduce_16core", "torch_stack", "multihost", "latency"]
# Read from the repository, not from the results folder: torch's own distributed test suite on gloo and on
# "ddpkit", written by scripts/run_torch_suite.py (run_all.sh does not run it); a sentence in its place when absent.
SUITE = "docs/torch_suite.json"

SETUP = r'''
%matplotlib inline
import collections, json, math, os, re, statistics, sys
from html import escape
from pathlib import Path
import matplotlib.pyplot as plt
from matplotlib.lines import Line2D
from IPython.display import HTML, Markdown, display

sys.path.insert(0, str(Path("../benchmarks").resolve()))  # the notebook runs in notebooks/
from records import load_records

RESULTS = Path(os.environ.get("DDPKIT_REPORT_RESULTS", "../benchmarks/results"))
EXPECTED = __EXPECTED__
SUITE = Path("..") / __SUITE__

def load(name):
    """A results file, its records typed (benchmarks/records.py: r.median_s, r.kind, ...)."""
    document = json.loads((RESULTS / f"{name}.json").read_text())
    return {**document, "records": load_records(document)}

R = {name: load(name) for name in EXPECTED}
R.update({name: load(name) for name in __OPTIONAL__ if (RESULTS / f"{name}.json").exists()})

def table(rows, columns, formats=None):
    """An HTML table of dict rows."""
    formats = formats or {}
    def cell(row, col):
        value = row.get(col)
        if value is None:
            return ""
        if col in formats:
            return formats[col](value)
        return f"{value:.3g}" if isinstance(value, float) else str(value)
    head = "".join(f"<th>{c}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{cell(r, c)}</td>" for c in columns) + "</tr>" for r in rows)
    display(HTML(f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"))

def commit_of(name):
    """(commit, dirty) of a result: git_commit is "<sha>" or "<sha>-dirty" (tracked files had uncommitted changes)."""
    recorded = R[name]["environment"]["git_commit"] or "unknown"
    return recorded.removesuffix("-dirty"), recorded.endswith("-dirty")

# The report's commit: the one most of the expected results were measured at (the latest of a tie).
_by_commit = {}
for _name in sorted(EXPECTED, key=lambda name: R[name]["environment"]["date"]):
    _by_commit.setdefault(commit_of(_name)[0], []).append(_name)
COMMIT = max(_by_commit, key=lambda commit: len(_by_commit[commit]))

def provenance_problem(name):
    """Why a result is not of the report's commit, in words, or None."""
    commit, dirty = commit_of(name)
    problems = []
    if commit != COMMIT:
        problems.append(f"it was measured at commit `{commit[:10]}`, not at `{COMMIT[:10]}` like this report")
    if dirty:
        problems.append("the tree it was measured from had uncommitted changes, so no commit holds the code that "
                        "produced it")
    return " and ".join(problems) or None

def warn(text):
    display(HTML(f'<div style="border-left: 6px solid #d9822b; background: #fff4e5; padding: 6px 12px; '
                 f'margin: 6px 0">⚠ {text}</div>'))

def command(name):
    env = R[name]["environment"]
    display(Markdown(f"Produced by `{env['command']}` on {env['date'][:16].replace('T', ' ')} UTC."))
    problem = provenance_problem(name)
    if problem:
        warn(f"`{name}.json`: {problem}. Run `bash benchmarks/run_all.sh` on a clean checkout to measure every "
             "result from one commit.")

def below_floor(records, names=None):
    """A paragraph on every DDP record whose median step is below the no-communication floor's, or None."""
    floors = {(r.model, r.accumulation): r for r in records if r.candidate == "floor"}
    cases = [(r, floors[(r.model, r.accumulation)]) for r in records if r.candidate != "floor"
             and (r.model, r.accumulation) in floors and r.median_step_s < floors[(r.model, r.accumulation)].median_step_s]
    if not cases:
        return None
    def overlap(r, f):
        return max(r.p25_step_s, f.p25_step_s) <= min(r.p75_step_s, f.p75_step_s)
    described = "; ".join(
        f"`{(names or {}).get(r.candidate, r.candidate)}` {r.model}, accumulation {r.accumulation}: "
        f"{ms(r.median_step_s)} (middle half {ms(r.p25_step_s)}–{ms(r.p75_step_s)}) against the floor's "
        f"{ms(f.median_step_s)} ({ms(f.p25_step_s)}–{ms(f.p75_step_s)})" for r, f in cases)
    ties = sum(overlap(r, f) for r, f in cases)
    text = (f"Below the floor: {described}. No wrapper can be faster than the same steps without any communication; "
            "each candidate runs in processes of its own, on 2 cores shared with the other candidates' idle "
            "processes, so its steps and the floor's differ by where and when the scheduler runs them. ")
    if ties == len(cases):
        return text + ("In every case the middle halves of the repetitions overlap: the candidate and the floor are "
                       "tied within the spread of the measurement, not faster.")
    return text + (f"In {len(cases) - ties} of them the middle halves do not overlap: a difference this benchmark "
                   "does not explain; re-measure before reading anything into it.")

us = lambda s: f"{s * 1e6:.0f} µs"
ms = lambda s: f"{s * 1e3:.1f} ms"
mib = lambda b: f"{b / 2**20:.1f} MiB"
kib = lambda b: f"{b / 2**10:.0f} KiB"
ratio = lambda x: f"{x:.2f}×"
'''

INTRO = r'''
# ddpkit report

Every figure below is read from `benchmarks/results/*.json` and was measured side by side with the
PyTorch baseline in the same run (candidates interleaved, median of repetitions); the outcomes of
torch's own distributed test suite on both backends come from `docs/torch_suite.json`. `bash
benchmarks/run_all.sh` (about 2 hours on 2 cores) measures all of them again from the checked-out
tree and rebuilds this notebook; `bash benchmarks/run_all.sh --quick` is a smoke run of the same.
Each section names the exact command that produced its file.
'''

PROVENANCE = r'''
display(Markdown(f"**These results were measured at commit `{COMMIT}`**, the commit of most of them."))
problems = {name: provenance_problem(name) for name in R}
for name, problem in problems.items():
    if problem:
        warn(f"`{name}.json`: {problem}.")
if not any(problems.values()):
    display(Markdown("Every result comes from that commit, measured on a tree without uncommitted changes."))
'''

INFRA = r'''
env = R["allreduce"]["environment"]
rows = []
for name in R:
    e = R[name]["environment"]
    commit, dirty = commit_of(name)
    rows.append({"benchmark": name, "date": e["date"][:16].replace("T", " "), "torch": e["torch_version"],
                 "backend": e["backend"], "device": e["device_type"], "host": e["hostname"],
                 "CPU": f"{e['cpu_model']} × {e['cpu_count']}", "GPU": (e["gpu"] or {}).get("gpu_name", "none"),
                 "commit": commit[:10] + (" + uncommitted changes" if dirty else "")})
table(rows, ["benchmark", "date", "torch", "backend", "device", "host", "CPU", "GPU", "commit"])
gpu = env["gpu"]
display(Markdown(
    f"Python {env['python_version']} on `{env['hostname']}`: {env['cpu_count']} cores of a {env['cpu_model']}, " +
    (f"{gpu['gpu_count']} × {gpu['gpu_name']} (driver {gpu['gpu_driver']}), collectives of CUDA tensors over NCCL."
     if gpu else
     f"no GPU, so torch's collectives run over {env['backend']} on loopback TCP, ddpkit's over its "
     f"shared-memory transport (`transport=\"auto\"`), and world sizes above "
     f"{env['cpu_count']} oversubscribe the cores. On a GPU machine the same scripts run over NCCL, and the "
     "SyncBatchNorm baseline becomes torch.nn.SyncBatchNorm.")))
'''

ALLREDUCE_INTRO = r'''
## 1. All-reduce

ddpkit's default all-reduce (`ddpkit`: `algorithm="auto"` on ddpkit's default transport, collective checks on) and its
ring over torch.distributed send/recv (`ddpkit_ring_pg`) against `torch.distributed.all_reduce` on gloo (`gloo`),
the memory floor (`floor`: one in-place `a.add_(b)` of the vector in one process), MPICH's `MPI_Allreduce`
(`mpich`) and DeepSpeed's CPU shared-memory all-reduce (`deepspeed`), float32 vectors on one host. A repetition
synchronises the ranks through the candidate itself and times a batch of back-to-back calls; its time is the
slowest rank's; the figure is the median over interleaved repetitions (method: `benchmarks/bench_allreduce.py`).
'''

ALLREDUCE_TIME = r'''
command("allreduce")
A = R["allreduce"]
timed = [r for r in A["records"] if r.kind == "time" and r.median_s]
missing = [r for r in A["records"] if r.kind == "time" and not r.median_s]
statuses = A["settings"].get("candidates", {})
if statuses:
    table([{"candidate": k, "status": v["status"], "how": v.get("launcher", v.get("install", ""))}
           for k, v in statuses.items()], ["candidate", "status", "how"])
    display(Markdown(f"ddpkit's default transport in this run: `{A['settings']['ddpkit_default_transport']}`"
                     + ("" if A["settings"]["ddpkit_transport_argument"] else
                        " (this ddpkit had no `transport` argument: everything of ddpkit's ran over the process group)")
                     + "."))
sizes = sorted({r.numel for r in timed})
world_sizes = sorted({r.world_size for r in timed})
candidates = list(dict.fromkeys(r.candidate for r in timed))
STYLE = {"gloo": dict(color="black", linewidth=2.5), "floor": dict(color="gray", linestyle="--"),
         "ddpkit": dict(color="tab:red", linewidth=2.5)}
columns = min(4, len(world_sizes))
fig, axes = plt.subplots(-(-len(world_sizes) // columns), columns, figsize=(4.3 * columns, 3.3 * -(-len(world_sizes) // columns)),
                         sharey=True, squeeze=False)
colors = {c: STYLE.get(c, {}).get("color", f"C{i}") for i, c in enumerate(candidates)}
CUT = "point cut short by its time budget"
for ax, ws in zip(axes.flat, world_sizes):
    for c in candidates:
        points = sorted((r.numel, r.median_s, r.cut_off) for r in timed if r.world_size == ws and r.candidate == c)
        if not points:
            continue
        ax.plot([p[0] for p in points], [p[1] * 1e3 for p in points], marker="o", markersize=3, label=c,
                **{**STYLE.get(c, {}), "color": colors[c]})
        cut = [p for p in points if p[2]]
        if cut:
            ax.plot([p[0] for p in cut], [p[1] * 1e3 for p in cut], "x", color=colors[c], markersize=9, label=CUT)
    ax.set_xscale("log"); ax.set_yscale("log"); ax.set_title(f"n = {ws} process{'es' if ws > 1 else ''}", fontsize=10)
    ax.grid(True, which="both", alpha=0.3); ax.set_xlabel("floats", fontsize=8)
for ax in axes.flat[len(world_sizes):]:
    ax.axis("off")
for row in axes:
    row[0].set_ylabel("median time (ms)")
# One legend for the whole figure: a candidate may be missing from some panels (the peers run from n = 2 up).
legend = {}
for ax in axes.flat:
    for handle, label in zip(*ax.get_legend_handles_labels()):
        legend.setdefault(label, handle)
if CUT in legend:  # one black × for the markers of every candidate
    legend[CUT] = Line2D([], [], marker="x", linestyle="", color="black", markersize=9)
fig.legend(legend.values(), legend.keys(), loc="upper center", ncol=len(legend), fontsize=8, bbox_to_anchor=(0.5, 1.0))
plt.tight_layout(rect=(0, 0, 1, 0.95)); plt.show()
display(Markdown("A × marks a point cut short by its time budget (fewer repetitions than planned). " +
                 (f"Not measured: {', '.join(sorted({f'{r.candidate} n={r.world_size}' for r in missing}))}."
                  if missing else "")))
'''

ALLREDUCE_RING = r'''
by = {(r.world_size, r.numel, r.candidate): r for r in timed}
summary = A["summary"]
grid = [n for n in (2, 4, 8) if n in world_sizes]
rows = []
for ws in grid:
    row = {"n": ws}
    for numel in sizes:
        row[f"{numel:,}"] = summary["ddpkit_over_gloo"].get(f"n={ws} numel={numel}")
    rows.append(row)
table(rows, ["n"] + [f"{n:,}" for n in sizes], {f"{n:,}": ratio for n in sizes})
worst, met = summary["ddpkit_over_gloo_max"], summary["ddpkit_over_gloo_bar_met"]
measured = summary.get("ddpkit_over_gloo_measured")  # absent from results written before it was
verdict = ("met" if met else "not met" if met is False or measured is None
           else "not checked: the run left out part of its grid")
lines = [f"**ddpkit / gloo** (table above; target ≤ 0.2 at n ∈ {{2, 4, 8}} × 1k–16M floats"
         f"{'' if measured is None else '; measured at ' + measured}): worst {worst:.2f}× — {verdict}."
         if worst is not None else "**ddpkit / gloo**: not measured."]
peers = summary["ddpkit_over_best_peer_n2"]
if peers:
    lines.append("**ddpkit / best of MPICH and DeepSpeed at n = 2**: " + ", ".join(
        f"{int(k.split('=')[1]):,} floats {v['ratio']:.2f}× ({v['best_peer']})" for k, v in peers.items()) + ".")
floor = summary["ddpkit_over_floor_n2"]
if floor:
    lines.append("**ddpkit / floor at n = 2** (target ≤ 3 from 1M floats): " + ", ".join(
        f"{int(k.split('=')[1]):,} floats {v:.1f}×" for k, v in floor.items()) +
        f" — {'met' if summary['ddpkit_over_floor_bar_met'] else 'not met'}.")
if summary.get("cut_off_points"):
    lines.append(f"Cut off by the time budget: {len(summary['cut_off_points'])} points "
                 f"({', '.join(summary['cut_off_points'][:8])}{' …' if len(summary['cut_off_points']) > 8 else ''}).")
display(Markdown("\n\n".join(lines)))
'''

ALLREDUCE_SPREAD = r'''
rows = []
for ws in [w for w in world_sizes if w <= 8]:
    for numel in sizes:
        row = {"n": ws, "floats": f"{numel:,}"}
        for c in candidates:
            r = by.get((ws, numel, c))
            row[c] = r.bus_bandwidth_GBps if r else None
        if any(row[c] is not None for c in candidates):
            rows.append(row)
shown = [c for c in candidates if any(row[c] is not None for row in rows)]
table(rows, ["n", "floats"] + shown, {c: (lambda v: f"{v:.3g}") for c in shown})
display(Markdown("Bus bandwidth in GB/s as nccl-tests define it: bytes / median time × 2(n−1)/n (none for the floor, "
                 "which is no collective, nor at n = 1)."))
rows = []
for ws in [2, 4, 8]:
    for numel in sizes:
        for c in candidates:
            r = by.get((ws, numel, c))
            if r:
                rows.append({"n": ws, "floats": f"{numel:,}", "candidate": c, "p25": r.p25_s, "median": r.median_s,
                             "p75": r.p75_s, "reps": r.reps, "cut off": r.cut_off})
table(rows, ["n", "floats", "candidate", "p25", "median", "p75", "reps", "cut off"],
      {"p25": us, "median": us, "p75": us})
display(Markdown(
    "The spread between the 25th and 75th percentiles shows how much of each figure is scheduling: with more "
    "runnable processes than the 2 cores, a process waits out time slices of several ms, and implementations that "
    "busy-poll (MPICH, DeepSpeed) lose their cores to each other."))
'''

ALLREDUCE_ACCURACY = r'''
rows = []
for ws in world_sizes:
    row = {"world size": ws}
    for c in candidates:
        errors = [r.max_abs_error_of_mean for r in timed
                  if r.world_size == ws and r.candidate == c and r.max_abs_error_of_mean is not None]
        row[c] = max(errors) if errors else None
    rows.append(row)
measured = [c for c in candidates if any(row[c] is not None for row in rows)]
table(rows, ["world size"] + measured, {c: (lambda v: f"{v:.1e}") for c in measured})
display(Markdown("Accuracy of averaging: max |result − float64 mean| over the sizes checked, N(0, 1) float32 inputs "
                 "(MPICH, DeepSpeed and gloo: the sum divided by n)."))
'''

ALLREDUCE_MEMORY = r'''
memory = [r for r in A["records"] if r.kind == "memory"]
big = max(r.numel for r in memory)
fig, ax = plt.subplots(figsize=(8, 4))
for c in dict.fromkeys(r.candidate for r in memory):
    points = sorted((r.world_size, r.peak_memory_increase_bytes) for r in memory if r.numel == big and r.candidate == c)
    ax.plot([p[0] for p in points], [p[1] / 2**20 for p in points], marker="o", label=c)
ax.set_xscale("log", base=2); ax.set_xlabel("world size"); ax.set_ylabel("peak RSS increase (MiB)")
ax.set_title(f"memory of one warm all-reduce of {big:,} floats ({big * 4 / 2**20:.0f} MiB), max over ranks")
ax.legend(fontsize=8); ax.grid(True, alpha=0.3); plt.show()
'''

CHECKS = r'''
command("allreduce_checks")
overhead = R["allreduce_checks"]["summary"]["checked_over_unchecked"]
rows = [{"point": k, "checked / unchecked": v} for k, v in sorted(overhead.items())]
table(rows, ["point", "checked / unchecked"], {"checked / unchecked": ratio})
values = list(overhead.values())
display(Markdown(
    f"The collective checks (before any payload, the ranks exchange a small header naming the collective, so that "
    f"mismatched calls raise on every rank instead of hanging; on by default) cost a median "
    f"{statistics.median(values):.2f}× (range {min(values):.2f}–{max(values):.2f}×) over the same algorithm "
    "unchecked, on these latency-bound sizes."))
'''

LATENCY = r'''
if "latency" not in R:
    display(Markdown("No `latency.json` in this results folder, so the layers of a small all-reduce's call path are not "
                     "shown: `.venv/bin/python benchmarks/bench_latency.py` measures them."))
else:
    command("latency")
    L = R["latency"]
    us1 = lambda s: f"{s * 1e6:.1f} µs"
    sizes = sorted({r.numel for r in L["records"] if r.numel})
    rows = [{"layer": stage, **{f"{n:,} floats": next((r.median_s for r in L["records"] if r.stage == stage
                                                         and r.numel in (0, n)), None) for n in sizes}}
            for stage in dict.fromkeys(r.stage for r in L["records"])]
    table(rows, ["layer"] + [f"{n:,} floats" for n in sizes], {f"{n:,} floats": us1 for n in sizes})
    budget = L["summary"]
    lines = [f"| {label} | " + " | ".join(us1(budget[f"numel={n}"][label]) for n in sizes) + " |"
             for label in budget[f"numel={sizes[0]}"]]
    display(Markdown(
        "Where a small all-reduce's time goes, 2 ranks on one host: each layer of `ddpkit.all_reduce`'s call path "
        "looped back to back, the `c++` rows with the loop itself in C++ (no Python and no dispatcher between calls). "
        "The budget is what each layer adds to the one below it (both Python rows add to `c++ all_reduce`):\n\n| layer | "
        + " | ".join(f"{n:,} floats" for n in sizes) + " |\n|---|" + "---|" * len(sizes) + "\n" + "\n".join(lines)))
'''

SYNCBN = r'''
## 2. SyncBatchNorm
'''

SYNCBN_TABLE = r'''
command("syncbn")
s = R["syncbn"]
records = s["records"]
distributed = [r for r in records if r.world_size > 1]
steps = {r.steps_per_repetition or 1 for r in distributed}
# The ratios are computed here from the times, so that they read the same from any version of the file:
# against torch's BatchNorm alone (the headline) and against the older floor (BatchNorm + two gloo all-reduces).
def over_local(r, seconds):
    return seconds / r.t_torch_bn_local if seconds is not None else None
rows = [{"workers": r.world_size, "shape": "×".join(map(str, r.shape)), "ddpkit (auto)": r.t_ddpkit,
         "ddpkit (process_group)": r.t_ddpkit_pg, "torch BatchNorm alone": r.t_torch_bn_local,
         "auto/BN": over_local(r, r.t_ddpkit), "pg/BN": over_local(r, r.t_ddpkit_pg),
         "unchecked/BN": over_local(r, r.t_ddpkit_unchecked),
         "auto/(BN + 2 gloo)": r.t_ddpkit / r.t_floor, "local kernels/BN": over_local(r, r.t_ddpkit_local)}
        for r in distributed]
table(rows, ["workers", "shape", "ddpkit (auto)", "ddpkit (process_group)", "torch BatchNorm alone", "auto/BN", "pg/BN",
             "unchecked/BN", "auto/(BN + 2 gloo)", "local kernels/BN"],
      {"ddpkit (auto)": us, "ddpkit (process_group)": us, "torch BatchNorm alone": us, "auto/BN": ratio,
       "pg/BN": ratio, "unchecked/BN": ratio, "auto/(BN + 2 gloo)": ratio, "local kernels/BN": ratio})
display(Markdown(
    f"Forward + backward of one layer, global batch split evenly, {' or '.join(map(str, sorted(steps)))} steps back "
    "to back per repetition as a training loop runs them (per step: the slowest rank's time over the steps, median "
    "over repetitions). On CPU torch has no SyncBatchNorm, so the baseline is torch's BatchNorm on the same local "
    "batch with no communication at all: `auto/BN` is what synchronizing the batch costs on top of a plain batch "
    "norm. Target at 2 workers: ≤ 1.15×. The column `auto/(BN + 2 gloo)` divides by the baseline this report used "
    "before, torch's own parts (that BatchNorm plus one gloo all-reduce of 2C+1 and one of 2C float64 values): "
    "that floor already pays gloo's latency twice, so ratios against it look far better than against BatchNorm "
    "alone, and earlier versions of this report judged the target against it."))
'''

SYNCBN_PLOT = r'''
fig, axes = plt.subplots(1, 2, figsize=(13, 3.8), sharey=True)
for ax, ws in zip(axes, sorted({r.world_size for r in distributed})):
    rows = [r for r in distributed if r.world_size == ws]
    labels = ["×".join(map(str, r.shape)) for r in rows]
    xs = range(len(rows))
    for offset, key, label in [(-0.3, "t_ddpkit", "ddpkit (auto)"), (-0.1, "t_ddpkit_unchecked", "ddpkit (auto, unchecked)"),
                               (0.1, "t_ddpkit_pg", "ddpkit (process_group)"),
                               (0.3, "t_torch_emulated", "torch's parts: BatchNorm + 2 gloo all-reduces in one step")]:
        if all(getattr(r, key) is not None for r in rows):
            ax.bar([x + offset for x in xs], [getattr(r, key) / r.t_torch_bn_local for r in rows], width=0.18,
                   label=label)
    ax.axhline(1.15, color="black", linestyle="--", linewidth=1, label="target 1.15")
    ax.axhline(1.0, color="gray", linewidth=0.8, label="torch BatchNorm alone (1)")
    ax.set_xticks(list(xs), labels, rotation=30, fontsize=8)
    ax.set_title(f"{ws} workers: time / torch BatchNorm alone (no communication)")
axes[0].legend(fontsize=8); plt.tight_layout(); plt.show()
'''

SYNCBN_LOCAL = r'''
two = [r for r in distributed if r.world_size == 2]
best = [min(r.t_ddpkit, r.t_ddpkit_pg) / r.t_torch_bn_local for r in two]
floor = [r.t_ddpkit / r.t_floor for r in two]
local = s["summary"]["local_ratios"]
table([{"shape / threads": k, "ddpkit local / torch BN": v} for k, v in local.items()],
      ["shape / threads", "ddpkit local / torch BN"], {"ddpkit local / torch BN": ratio})
memory_rows = [{"workers": r.world_size, "shape": "×".join(map(str, r.shape)), "ddpkit bytes": r.alloc_ddpkit,
                "BatchNorm bytes": r.alloc_torch_bn_local, "extra per channel": r.alloc_extra_per_channel}
               for r in distributed]
table(memory_rows, ["workers", "shape", "ddpkit bytes", "BatchNorm bytes", "extra per channel"],
      {"ddpkit bytes": kib, "BatchNorm bytes": kib, "extra per channel": lambda v: f"{v:.1f} B"})
display(Markdown(
    f"At 2 workers the better of ddpkit's two all-reduce choices is {min(best):.2f}–{max(best):.2f}× torch's "
    f"BatchNorm alone ({sum(b <= 1.15 for b in best)} of {len(best)} configurations within 1.15×); against the older "
    f"floor (BatchNorm plus two gloo all-reduces) `auto` is {min(floor):.2f}–{max(floor):.2f}×. The local kernels alone are "
    f"{min(local.values()):.2f}–{max(local.values()):.2f}× torch's CPU batch norm (target ≤ 1.0×); memory is at most "
    f"{s['summary']['max_alloc_extra_per_channel_bytes']:.1f} bytes per channel above BatchNorm's."))
unchecked = [r.t_ddpkit_unchecked / r.t_torch_bn_local for r in two if r.t_ddpkit_unchecked is not None]
checked = [r.t_ddpkit / r.t_torch_bn_local for r in two]
if unchecked:
    display(Markdown(
        f"With the collective checks off (one header exchange less per all-reduce), `auto` is "
        f"{min(unchecked):.2f}–{max(unchecked):.2f}× torch's BatchNorm alone at 2 workers "
        f"({sum(u <= 1.15 for u in unchecked)} of {len(unchecked)} within 1.15×), against "
        f"{min(checked):.2f}–{max(checked):.2f}× with them on (median {statistics.median(unchecked):.2f}× vs "
        f"{statistics.median(checked):.2f}×)."))
'''

DDP = r'''
## 3. DistributedDataParallel
'''

DDP_TABLE = r'''
command("ddp")
d = R["ddp"]
rows = [{"model": r.model, "accumulation": r.accumulation, "candidate": r.candidate,
         "median step": r.median_step_s, "p25 step": r.p25_step_s, "p75 step": r.p75_step_s,
         "peak memory": r.peak_memory_bytes, "buckets": (r.reducer_stats or {}).get("buckets")} for r in d["records"]]
table(rows, ["model", "accumulation", "candidate", "median step", "p25 step", "p75 step", "peak memory", "buckets"],
      {"median step": ms, "p25 step": ms, "p75 step": ms, "peak memory": mib})
fig, ax = plt.subplots(figsize=(10, 3.5))
names = list(d["summary"])
ax.bar([i - 0.2 for i in range(len(names))], [d["summary"][n]["time_ratio"] for n in names], width=0.4, label="step time")
ax.bar([i + 0.2 for i in range(len(names))], [d["summary"][n]["memory_ratio"] for n in names], width=0.4,
       label="peak memory")
ax.axhline(1.0, color="black", linestyle="--", linewidth=1, label="torch DDP (1)")
ax.set_xticks(range(len(names)), names, rotation=20, fontsize=8); ax.set_ylabel("candidate / torch DDP")
ax.legend(fontsize=8); plt.tight_layout(); plt.show()
rows = [{"configuration": k, "time vs torch DDP": v["time_ratio"], "memory vs torch DDP": v["memory_ratio"]}
        for k, v in d["summary"].items()]
table(rows, ["configuration", "time vs torch DDP", "memory vs torch DDP"],
      {"time vs torch DDP": ratio, "memory vs torch DDP": ratio})
default = {k: v for k, v in d["summary"].items() if k.startswith("ddpkit ")}
display(Markdown(
    f"{d['settings']['world_size']} processes, synthetic CIFAR-shaped batches. ddpkit with its default all-reduce: "
    f"step time {min(v['time_ratio'] for v in default.values()):.2f}–{max(v['time_ratio'] for v in default.values()):.2f}× "
    f"torch DDP, peak memory {min(v['memory_ratio'] for v in default.values()):.2f}–"
    f"{max(v['memory_ratio'] for v in default.values()):.2f}× (targets: time ≤ 0.9×, memory ≤ 1.0×). Accumulation 4 "
    "uses `no_sync` on 3 of every 4 micro-batches in both. `floor` (where measured) is the same steps with no "
    "gradient communication at all: no data-parallel wrapper can take less."))
floor_text = below_floor(d["records"])
if floor_text:
    display(Markdown(floor_text))
'''

TRAINING = r'''
## 4. Training: ddpkit's pipeline against PyTorch's, like for like
'''

TRAINING_PLOTS = r'''
command("training")
t = R["training"]
settings = t["settings"]
# The headline pair: ddpkit's DDP and torch's with the same BatchNorm (both plain on CPU, where torch has no
# SyncBatchNorm); any other pipeline (ddpkit's SyncBatchNorm on CPU) is a row of its own.
torch_run = next(r for r in t["records"] if r.impl == "torch")
like = next(r for r in t["records"] if r.impl == "ddpkit" and r.synchronized == torch_run.synchronized)
pipelines = [like, torch_run, *(r for r in t["records"] if r is not like and r is not torch_run)]
fig, (loss_ax, accuracy_ax, time_ax) = plt.subplots(1, 3, figsize=(17, 4.2), gridspec_kw={"width_ratios": [3, 3, 2]})
for i, record in enumerate(pipelines):
    losses = record.loss_curve
    window = max(1, len(losses) // 100)
    smooth = [statistics.fmean(losses[j:j + window]) for j in range(0, len(losses) - window + 1, window)]
    loss_ax.plot([j * window for j in range(len(smooth))], smooth, color=f"C{i}", label=record.label)
    accuracy_ax.plot([e["epoch"] + 1 for e in record.epochs], [100 * e["test_accuracy"] for e in record.epochs],
                     marker="o", color=f"C{i}", label=record.label)
loss_ax.set_xlabel("optimizer step"); loss_ax.set_ylabel("training loss (rank 0, smoothed)")
# The accuracies differ by tenths of a point: the axis is zoomed to where they are, and its label says so.
floor = 5 * math.floor((min(100 * e["test_accuracy"] for r in pipelines for e in r.epochs) - 1) / 5)
accuracy_ax.set_ylim(bottom=floor)
accuracy_ax.set_xlabel("epoch"); accuracy_ax.set_ylabel(f"test accuracy (%), axis from {floor} %")
medians = [r.median_epoch_time_s for r in pipelines]
time_ax.bar(range(len(pipelines)), medians, color=[f"C{i}" for i in range(len(pipelines))],
            yerr=[[m - min(r.epoch_times_s) for m, r in zip(medians, pipelines)],
                  [max(r.epoch_times_s) - m for m, r in zip(medians, pipelines)]], capsize=6)
time_ax.set_xticks(range(len(pipelines)), [r.label.replace(", ", "\n") for r in pipelines], fontsize=8)
time_ax.set_ylabel(f"epoch time (s): median, min–max of {len(like.epochs)}")
for ax in (loss_ax, accuracy_ax, time_ax):
    ax.grid(alpha=0.3)
loss_ax.legend(fontsize=8); accuracy_ax.legend(fontsize=8)
plt.tight_layout(); plt.show()
rows = [{"pipeline": r.label, "final test accuracy": r.final_test_accuracy,
         "vs torch": 100 * (r.final_test_accuracy - torch_run.final_test_accuracy),
         "epoch time": r, "time vs torch": r.median_epoch_time_s / torch_run.median_epoch_time_s,
         "peak memory": r.peak_rss_bytes, "memory vs torch": r.peak_rss_bytes / torch_run.peak_rss_bytes}
        for r in pipelines]
table(rows, ["pipeline", "final test accuracy", "vs torch", "epoch time", "time vs torch", "peak memory",
             "memory vs torch"],
      {"final test accuracy": lambda v: f"{100 * v:.2f} %", "vs torch": lambda v: f"{v:+.2f} pp",
       "epoch time": lambda r: f"{r.median_epoch_time_s:.1f} s ({min(r.epoch_times_s):.1f}–{max(r.epoch_times_s):.1f})",
       "time vs torch": ratio, "peak memory": mib, "memory vs torch": ratio})
display(Markdown(
    f"{settings['dataset']}, model `{settings['model']}`, {settings['world_size']} processes, accumulation "
    f"{settings['accumulation_steps']}, {settings['epochs']} epochs, same seed and data order. Epoch time: the median "
    f"over the epochs, their range in brackets. **Like for like** ({like.label} against {torch_run.label}): ddpkit's "
    f"final accuracy is {100 * (like.final_test_accuracy - torch_run.final_test_accuracy):+.2f} percentage points "
    f"from torch's (target within 0.5), its epoch time {like.median_epoch_time_s / torch_run.median_epoch_time_s:.2f}× "
    f"and its peak memory {like.peak_rss_bytes / torch_run.peak_rss_bytes:.2f}× torch's (targets ≤ 1.0×)."))
for other in pipelines[2:]:
    micro_batches = other.optimizer_steps // settings["epochs"] * settings["accumulation_steps"]
    display(Markdown(
        f"**{other.label}** is a row of its own: torch has no SyncBatchNorm on CPU to compare it with. Against ddpkit "
        f"with plain BatchNorm, synchronizing the batch statistics costs "
        f"{other.median_epoch_time_s - like.median_epoch_time_s:+.1f} s per epoch ({micro_batches} micro-batches per "
        f"epoch, two all-reduces per BatchNorm layer each) and changes the final accuracy by "
        f"{100 * (other.final_test_accuracy - like.final_test_accuracy):+.2f} points."))
'''

GPU = r'''
## 5. On a GPU: CUDA SyncBatchNorm kernels and DDP

`csrc/syncbn/cuda/` holds ddpkit's own CUDA kernels (Welford statistics, normalize + affine, the
backward sums and element pass; planar and channels-last). With two processes on one GPU the group
is gloo (NCCL refuses two ranks on one device) for both implementations: torch's SyncBatchNorm
gathers the statistics through gloo's staged collectives, ddpkit copies its one buffer per pass to
the host and all-reduces it over shared memory (see "Device tensors on a host group" in
`csrc/comm/engine.h`). At world
size 1 the baseline is torch's CUDA BatchNorm (cuDNN). Times by CUDA events, memory by
`torch.cuda.max_memory_allocated`.
'''

GPU_TABLES = r'''
if "syncbn_cuda" not in R:
    display(Markdown("No GPU results in this results folder (`syncbn_cuda.json`, `ddp_cuda.json`)."))
else:
    g = R["syncbn_cuda"]
    command("syncbn_cuda")
    gpu = g["environment"]["gpu"]
    display(Markdown(f"GPU: {gpu['gpu_name']}, driver {gpu['gpu_driver']}, CUDA {gpu['cuda_version']}, "
                     f"torch {g['environment']['torch_version']}."))
    rows = []
    for r in g["records"]:
        synchronized = r.t_torch_syncbn is not None  # world size 2; at 1 the baseline is torch's CUDA BatchNorm
        baseline = r.t_torch_syncbn if synchronized else r.t_torch_bn_local
        base_alloc = r.alloc_torch_syncbn if synchronized else r.alloc_torch_bn_local
        rows.append({"world size": r.world_size, "shape": "x".join(map(str, r.shape)),
                     "ddpkit": r.t_ddpkit, "ddpkit (process_group)": r.t_ddpkit_pg,
                     "torch": baseline, "baseline": "nn.SyncBatchNorm" if synchronized else "BatchNorm (cuDNN)",
                     "ratio": r.ratio, "memory ratio": r.alloc_ddpkit / base_alloc})
    table(rows, ["world size", "shape", "ddpkit", "ddpkit (process_group)", "torch", "baseline", "ratio", "memory ratio"],
          {"ddpkit": ms, "ddpkit (process_group)": ms, "torch": ms, "ratio": ratio,
           "memory ratio": lambda x: f"{x:.4f}×"})
if "ddp_cuda" in R:
    d = R["ddp_cuda"]
    command("ddp_cuda")
    rows = [{"candidate": k, "time / torch DDP": v["time_ratio"], "memory / torch DDP": v["memory_ratio"]}
            for k, v in d["summary"].items()]
    table(rows, ["candidate", "time / torch DDP", "memory / torch DDP"], {"time / torch DDP": ratio,
                                                                          "memory / torch DDP": ratio})
if "allreduce_16core" in R:
    c = R["allreduce_16core"]
    command("allreduce_16core")
    env = c["environment"]
    display(Markdown(f"**CPU all-reduce on the GPU machine's cores**, not this report's machine: {env['cpu_model']}, "
                     f"{env['cpu_count']} cores (the machine lent with the {env['gpu']['gpu_name']}). Every rank has a "
                     "core of its own up to 16 ranks, where the other CPU tables share 2. ddpkit (shared memory), gloo, "
                     "the memory floor and MPICH's `MPI_Allreduce`, float32, median of the slowest rank."))
    med = {(r.world_size, r.numel, r.candidate): r.median_s for r in c["records"] if r.kind == "time" and r.median_s}
    rows = []
    for n, numel in sorted({(n, numel) for n, numel, _ in med}):
        row = {"n": n, "floats": numel, **{k: med.get((n, numel, k)) for k in ("ddpkit", "gloo", "mpich", "floor")}}
        if row["ddpkit"] and row["gloo"]:
            row["ddpkit / gloo"] = row["ddpkit"] / row["gloo"]
        if row["ddpkit"] and row["mpich"]:
            row["ddpkit / MPICH"] = row["ddpkit"] / row["mpich"]
        rows.append(row)
    per_call = lambda s: f"{s * 1e6:.1f} µs" if s < 1e-3 else f"{s * 1e3:.2f} ms"
    table(rows, ["n", "floats", "ddpkit", "gloo", "mpich", "floor", "ddpkit / gloo", "ddpkit / MPICH"],
          {"ddpkit": per_call, "gloo": per_call, "mpich": per_call, "floor": per_call, "ddpkit / gloo": ratio,
           "ddpkit / MPICH": ratio})
'''

BACKEND = r'''
## 6. The "ddpkit" torch.distributed backend

`dist.init_process_group("ddpkit")` puts torch's own collectives on ddpkit's engine (which calls go
where, op by op, is described at the top of `csrc/backend/backend.h`). Below, in one set of processes: torch.distributed's call on a
gloo group of the same ranks (`gloo`), the same call on the ddpkit group (`backend`), and ddpkit's own
function on that group (`ddpkit`: same engine and segment, so `backend / ddpkit` is the cost of the
backend layer: torch.distributed's Python wrapper, the dispatcher, the Work object). `size` is the
whole vector (all-reduce's tensor, all-gather's output, reduce-scatter's input), float32. Then torch's
own `DistributedDataParallel`, unchanged, on both backends.
'''

BACKEND_TABLES = r'''
b = R["backend"]
command("backend")
coll = [r for r in b["records"] if r.kind == "collective"]
by = {(r.collective, r.world_size, r.numel, r.candidate): r for r in coll}
rows = []
for (collective, n, numel, candidate), r in sorted(by.items()):
    if candidate != "backend":
        continue
    rows.append({"collective": collective, "n": n, "size": numel, "gloo": by[(collective, n, numel, "gloo")].median_s,
                 "backend": r.median_s, "ddpkit": by[(collective, n, numel, "ddpkit")].median_s,
                 "backend / gloo": r.median_s / by[(collective, n, numel, "gloo")].median_s,
                 "backend / ddpkit": r.median_s / by[(collective, n, numel, "ddpkit")].median_s,
                 "busbw backend": r.busbw_GBps})
table(rows, ["collective", "n", "size", "gloo", "backend", "ddpkit", "backend / gloo", "backend / ddpkit", "busbw backend"],
      {"gloo": us, "backend": us, "ddpkit": us, "backend / gloo": ratio, "backend / ddpkit": ratio,
       "busbw backend": lambda v: f"{v:.2f} GB/s"})
fig, axes = plt.subplots(1, 3, figsize=(15, 4), sharey=True)
for ax, collective in zip(axes, ["all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor"]):
    for n in sorted({r.world_size for r in coll}):
        sizes = sorted({r.numel for r in coll if r.world_size == n and r.collective == collective})
        for candidate, style in (("gloo", "--"), ("backend", "-")):
            ax.loglog(sizes, [by[(collective, n, s, candidate)].median_s for s in sizes], style, marker="o",
                      label=f"{candidate} n={n}")
    ax.set_title(collective); ax.set_xlabel("floats"); ax.grid(True, which="both", alpha=0.3)
axes[0].set_ylabel("seconds per call (median, slowest rank)"); axes[0].legend()
plt.show()
layers = [r for r in b["records"] if r.kind == "layers"]
if layers:
    display(Markdown("One all-reduce through each layer, 2 processes: where the time above `ddpkit.all_reduce` goes."))
    table([{"layer": r.layer, "size": r.numel, "time per call": r.median_s} for r in layers],
          ["layer", "size", "time per call"], {"time per call": lambda v: f"{v * 1e6:.1f} µs"})
ddp = [r for r in b["records"] if r.kind == "ddp"]
if ddp:
    base = {(r.model, r.accumulation): r for r in ddp if r.candidate == "torch_gloo"}
    floor = {(r.model, r.accumulation): r.median_step_s for r in ddp if r.candidate == "floor"}
    rows = [{"model": r.model, "accumulation": r.accumulation,
             "torch DDP on gloo": base[(r.model, r.accumulation)].median_step_s, "on ddpkit": r.median_step_s,
             "no communication": floor.get((r.model, r.accumulation)),
             "time ratio": r.median_step_s / base[(r.model, r.accumulation)].median_step_s,
             "memory ratio": r.peak_memory_bytes / base[(r.model, r.accumulation)].peak_memory_bytes}
            for r in ddp if r.candidate == "torch_ddpkit"]
    table(rows, ["model", "accumulation", "torch DDP on gloo", "on ddpkit", "no communication", "time ratio",
                 "memory ratio"],
          {"torch DDP on gloo": ms, "on ddpkit": ms, "no communication": ms, "time ratio": ratio, "memory ratio": ratio})
    display(Markdown("Median step of torch's DDP (2 processes) on each backend, and of the same steps without any "
                     "gradient communication (`no communication`: the least a backend can reach)."))
    floor_text = below_floor(ddp, names={"torch_ddpkit": "torch DDP on ddpkit", "torch_gloo": "torch DDP on gloo"})
    if floor_text:
        display(Markdown(floor_text))
'''

MULTIHOST = r'''
## 7. Across hosts

ddpkit's all-reduce and DDP with the ranks on different hosts. The hosts are simulated on this one machine
(`ddpkit.testing.HostPool`): each is a network namespace and a mount namespace with a hostname and a `/dev/shm` of
its own, so ranks on different hosts share no memory and reach each other only over the network, a veth link from
each host to a bridge. The link is left as it is (`unshaped`: as fast as the kernel copies) or limited by tc's token
bucket filter (`tbf`) to 10 Gbit/s (`10gbit`) or 1 Gbit/s (`1gbit`): bandwidth only, no added latency (this kernel
has no netem). `2x2` is 2 hosts × 2 ranks, `2x1` 2 hosts × 1 rank. Every process runs on the same 2 cores (4 of
them at 2x2), so the network costs CPU too: the kernel copies every byte through the veth pair and the bridge on the
cores that run the ranks, where a real network card would take that work off them. Candidates, float32 vectors, all
interleaved in the same repetitions:

| name | what runs |
|---|---|
| `ddpkit` | `ddpkit.all_reduce(t)` on the gloo group (`algorithm="auto"`): ddpkit's hierarchical all-reduce. Up to 64 KiB, the host's all-reduce over its shared memory, then one round across hosts that carries the collective check and the host's result to one rank and the total back; above, the check's round, a reduce-scatter over each host's shared memory, every rank swapping its slice with its counterpart on the other host (both ways at once, each part reduced as it arrives), and an all-gather over shared memory. Everything that crosses hosts goes over TCP connections of ddpkit's own between the ranks, not gloo's. At 2x1 only the steps across hosts run |
| `ddpkit_flat` | `ddpkit.all_reduce(t, algorithm="halving_doubling")`: a ddpkit schedule over gloo's send/recv that ignores the hosts |
| `ddpkit_backend` | `torch.distributed.all_reduce` on a group of the "ddpkit" backend: ddpkit's engine behind torch's own API |
| `gloo` | `torch.distributed.all_reduce` on the gloo group: the baseline |

A repetition synchronises the ranks through the candidate itself, then every rank times a batch of back-to-back
calls of the library's own function (bound once, nothing of the benchmark's between the calls); a point is the
slowest rank's time per call, the median over the repetitions. Every rank also reads its process's CPU time
around the batch, so the table can say how much of the machine's 2 cores a point kept busy. The other collectives
(`broadcast` and `reduce` from the last rank, `all_gather_into_tensor`, `reduce_scatter_tensor`; the size is the
whole tensor: the all-gather's output, the reduce-scatter's input) are timed the same way with the same candidates,
`ddpkit_flat` being ddpkit's collective with `transport="process_group"` (its flat schedule over gloo's send/recv).
`ddpkit` runs them hierarchically too: inside each host over shared memory, and between the two hosts over the same
TCP connections of its own (the broadcast and the reduce as one message from one host to the other, the all-gather
and the reduce-scatter as a swap of blocks, reduced as they arrive).
Then one DDP training step
across 2x2 on the unshaped link (8 linear layers 1024 wide, batch 8 per rank, SGD): ddpkit's DDP (`ddpkit_ddp`),
torch's `DistributedDataParallel` on gloo (`torch_ddp_gloo`) and torch's on the "ddpkit" backend
(`torch_ddp_ddpkit`). The command runs as root, because it makes namespaces:
`sudo .venv/bin/python benchmarks/bench_multihost.py` (`run_all.sh` runs it when it runs as root).
'''

MULTIHOST_PLOT = r'''
def floats(n):
    """1000 -> "1k", 16000000 -> "16M"."""
    for unit, size in (("M", 10**6), ("k", 10**3)):
        if n >= size and n % size == 0:
            return f"{n // size:,}{unit}"
    return f"{n:,}"

if "multihost" not in R:
    display(Markdown(f"No `multihost.json` in this results folder, so nothing across hosts is shown: "
                     "`sudo .venv/bin/python benchmarks/bench_multihost.py` measures it (as root: its hosts are "
                     "namespaces)."))
else:
    command("multihost")
    M = R["multihost"]
    reduces = [r for r in M["records"] if r.kind == "multihost_all_reduce"]
    steps = [r for r in M["records"] if r.kind == "multihost_ddp"]
    HOSTS = {"2x2": "2 hosts × 2 ranks", "2x1": "2 hosts × 1 rank"}
    LINKS = {"unshaped": "unshaped link", "10gbit": "10 Gbit/s", "1gbit": "1 Gbit/s"}
    collectives = [r for r in M["records"] if r.kind == "multihost_collective"]
    measured = reduces + collectives  # a run may measure other collectives alone (--collectives)
    topologies = [t for t in M["settings"]["topologies"] if any(r.topology == t for r in measured)]
    links = [l for l in M["settings"]["links"] if any(r.link == l for r in measured)]
    others = [c for c in M["settings"]["candidates"] if c != "gloo"]
    # The issue's targets for ddpkit's time over gloo's, by (hosts x ranks, link) and size (None: no target there);
    # 2 hosts x 1 rank's target, 1.0 everywhere, is the gloo line itself.
    MH_TARGET = {("2x2", "unshaped"): lambda n: 0.5 if n >= 16_000_000 else 0.6,
                 ("2x2", "1gbit"): lambda n: 0.75 if n >= 1_000_000 else None}
    MH_STYLE = {"ddpkit": dict(color="tab:red", linewidth=2.5), "ddpkit_flat": dict(color="tab:blue"),
                "ddpkit_backend": dict(color="tab:green", linestyle="-.")}
    if reduces:
        fig, axes = plt.subplots(len(topologies), len(links), figsize=(4.6 * len(links), 3.4 * len(topologies)),
                                 sharex=True, sharey=True, squeeze=False)
        for row, topology in zip(axes, topologies):
            for ax, link in zip(row, links):
                panel = [r for r in reduces if r.topology == topology and r.link == link]
                for c in others:
                    points = sorted((r.numel, r.ratio_to_gloo) for r in panel if r.candidate == c)
                    if points:
                        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", markersize=4, label=c,
                                **MH_STYLE.get(c, {}))
                ax.axhline(1.0, color="black", linestyle="--", linewidth=1.2, label="gloo (1.0)")
                goals = sorted((r.numel, MH_TARGET[(topology, link)](r.numel)) for r in panel
                               if r.candidate == "ddpkit" and (topology, link) in MH_TARGET)
                goals = [g for g in goals if g[1] is not None]
                if goals:
                    ax.plot([g[0] for g in goals], [g[1] for g in goals], linestyle=":", color="gray", marker="_",
                            markersize=14, drawstyle="steps-post", label="target for ddpkit")
                ax.set_xscale("log"); ax.grid(True, which="both", alpha=0.3)
                ax.set_title(f"{HOSTS.get(topology, topology)}, {LINKS.get(link, link)}"
                             + ("" if panel else ": not measured"), fontsize=10)
        axes[0][0].set_ylim(0, 1.08 * max([1.0, *(r.ratio_to_gloo for r in reduces)]))  # the axes share it
        for ax in axes[-1]:
            ax.set_xlabel("floats (float32)")
        for row in axes:
            row[0].set_ylabel("time / gloo's (median)")
        legend = {}
        for ax in axes.flat:
            for handle, label in zip(*ax.get_legend_handles_labels()):
                legend.setdefault(label, handle)
        fig.legend(legend.values(), legend.keys(), loc="upper center", ncol=len(legend), fontsize=9,
                   bbox_to_anchor=(0.5, 1.0))
        plt.tight_layout(rect=(0, 0, 1, 0.93)); plt.show()
        by_point = {(r.topology, r.link, r.numel, r.candidate): r for r in reduces}
        rows = []
        for topology in topologies:
            for link in links:
                for numel in sorted({r.numel for r in reduces if r.topology == topology and r.link == link}):
                    gloo = by_point.get((topology, link, numel, "gloo"))
                    row = {"hosts × ranks": topology, "link": link, "floats": floats(numel),
                           "gloo": gloo.median_s if gloo else None}
                    for c in others:
                        r = by_point.get((topology, link, numel, c))
                        row[c] = r.ratio_to_gloo if r else None
                    backend = by_point.get((topology, link, numel, "ddpkit_backend"))
                    own = by_point.get((topology, link, numel, "ddpkit"))
                    row["backend / ddpkit"] = backend.median_s / own.median_s if backend and own else None
                    busy = [r.cpu_busy for r in (own, gloo) if r is not None and r.cpu_busy is not None]
                    row["CPUs busy: ddpkit, gloo"] = " / ".join(f"{b:.0%}" for b in busy) if len(busy) == 2 else None
                    row["reps"] = gloo.reps if gloo else None
                    rows.append(row)
        cpu_column = ["CPUs busy: ddpkit, gloo"] if any(row["CPUs busy: ddpkit, gloo"] for row in rows) else []
        table(rows, ["hosts × ranks", "link", "floats", "gloo", *others, "backend / ddpkit", *cpu_column, "reps"],
              {"gloo": lambda s: ms(s) if s >= 1e-3 else us(s), **{c: ratio for c in others}, "backend / ddpkit": ratio})
        display(Markdown("`gloo`: its time per call (median); the candidates' columns: their time over gloo's; "
                         "`backend / ddpkit`: the \"ddpkit\" backend's time over `ddpkit.all_reduce`'s, the cost of going "
                         "through torch's API. `CPUs busy`: the CPU time all ranks' processes spent per call (every "
                         "thread, kernel time included), over the slowest rank's time × this machine's cores, for "
                         "`ddpkit` and `gloo`. Near 100%, a point was bound by the cores the simulated hosts share, not by "
                         "its link: there every CPU-microsecond a candidate or torch's own call path spends adds to "
                         "its time."))
    if collectives:
        points = {(r.collective, r.topology, r.link, r.numel, r.candidate): r for r in collectives}
        crows = []
        for collective in dict.fromkeys(r.collective for r in collectives):
            for topology in topologies:
                for link in links:
                    for numel in sorted({r.numel for r in collectives if (r.collective, r.topology, r.link)
                                         == (collective, topology, link)}):
                        gloo = points.get((collective, topology, link, numel, "gloo"))
                        row = {"collective": collective, "hosts × ranks": topology, "link": link,
                               "floats": floats(numel), "gloo": gloo.median_s if gloo else None}
                        for c in others:
                            r = points.get((collective, topology, link, numel, c))
                            row[c] = r.ratio_to_gloo if r else None
                        crows.append(row)
        present = [c for c in others if any(c in row and row[c] is not None for row in crows)]
        table(crows, ["collective", "hosts × ranks", "link", "floats", "gloo", *present],
              {"gloo": lambda s: ms(s) if s >= 1e-3 else us(s), **{c: ratio for c in present}})
        display(Markdown("The other collectives across hosts: `gloo`, its time per call (median); the candidates' "
                         "columns, their time over gloo's (`ddpkit_flat`: `transport=\"process_group\"`, ddpkit's "
                         "schedules over gloo's send/recv that ignore the hosts)."))
    if steps:
        names = {"ddpkit_ddp": "ddpkit's DDP (on the gloo group)", "torch_ddp_gloo": "torch DDP on gloo",
                 "torch_ddp_ddpkit": "torch DDP on the \"ddpkit\" backend"}
        table([{"hosts × ranks": r.topology, "link": r.link, "candidate": names.get(r.candidate, r.candidate),
                "median step": r.median_s, "p25–p75": f"{ms(r.p25_s)}–{ms(r.p75_s)}", "reps": r.reps,
                "/ torch DDP on gloo": r.ratio_to_torch_ddp_gloo} for r in steps],
              ["hosts × ranks", "link", "candidate", "median step", "p25–p75", "reps", "/ torch DDP on gloo"],
              {"median step": ms, "/ torch DDP on gloo": ratio})
        display(Markdown("One DDP training step (forward, backward with its gradient all-reduces, SGD step), the "
                         "slowest rank's, median over the repetitions."))
    else:
        display(Markdown("No DDP step across hosts in this file."))
'''

MULTIHOST_TARGETS = r'''
if "multihost" in R:
    def target(text, points, limit, expected=()):
        # A row of the targets' table. points: {where: ratio}; expected: the points the target names.
        missing = [p for p in expected if p not in points]
        worst = max(points, key=points.get) if points else None
        result = "not measured" if not points else "met" if points[worst] <= limit else "not met"
        return {"target": text, "limit": limit, "worst": f"{points[worst]:.2f}× ({worst})" if points else "",
                "measured at": ", ".join(points) or "—", "not measured at": ", ".join(missing), "result": result}

    def ratios(topology, link, candidate, low=0, high=float("inf")):
        # {where: time / gloo's} of one candidate; link None: every link.
        chosen = sorted((r for r in reduces if r.topology == topology and r.candidate == candidate
                         and (link is None or r.link == link) and low <= r.numel <= high),
                        key=lambda r: (links.index(r.link), r.numel))
        return {(floats(r.numel) if link else f"{r.link} {floats(r.numel)}"): r.ratio_to_gloo for r in chosen}

    SIZES = [floats(n) for n in (1_000, 100_000, 1_000_000, 16_000_000)]  # the sizes the targets name
    own = {r.numel: r.median_s for r in reduces if (r.topology, r.link, r.candidate) == ("2x2", "unshaped", "ddpkit")}
    backend_over_own = {floats(r.numel): r.median_s / own[r.numel] for r in reduces
                        if (r.topology, r.link, r.candidate) == ("2x2", "unshaped", "ddpkit_backend") and r.numel in own}
    ddp = {r.candidate: r.ratio_to_torch_ddp_gloo for r in steps if r.topology == "2x2"}
    rows = [
        target("2 hosts × 2 ranks, unshaped: <code>ddpkit</code> ≤ 0.6× gloo at every size from 1k to 16M floats",
               ratios("2x2", "unshaped", "ddpkit", 1_000, 16_000_000), 0.6, SIZES),
        target("2 hosts × 2 ranks, unshaped: <code>ddpkit</code> ≤ 0.5× gloo at 16M floats",
               ratios("2x2", "unshaped", "ddpkit", 16_000_000, 16_000_000), 0.5, SIZES[-1:]),
        target("2 hosts × 2 ranks, unshaped: the \"ddpkit\" backend within 1.1× of <code>ddpkit.all_reduce</code> (the "
               "backend's time over ddpkit's own)", backend_over_own, 1.1, SIZES),
        target("2 hosts × 1 rank: <code>ddpkit</code> ≤ 1.0× gloo everywhere (every link, every size)",
               ratios("2x1", None, "ddpkit"), 1.0),
        target("2 hosts × 2 ranks at 1 Gbit/s: <code>ddpkit</code> ≤ 0.75× gloo from 1M floats up",
               ratios("2x2", "1gbit", "ddpkit", 1_000_000), 0.75, SIZES[2:]),
        target("DDP step across 2 hosts × 2 ranks: ddpkit's DDP ≤ 0.8× torch DDP on gloo",
               {"step": ddp["ddpkit_ddp"]} if "ddpkit_ddp" in ddp else {}, 0.8),
        target("DDP step across 2 hosts × 2 ranks: torch DDP on the \"ddpkit\" backend ≤ 0.85× torch DDP on gloo",
               {"step": ddp["torch_ddp_ddpkit"]} if "torch_ddp_ddpkit" in ddp else {}, 0.85),
    ]
    partial = any(r["not measured at"] for r in rows)
    table(rows, ["target", "worst", "measured at", *(["not measured at"] if partial else []), "result"])
    count = lambda result: sum(r["result"] == result for r in rows)
    lines = [f"The issue's targets against these figures (<code>worst</code>: the largest ratio among the points a target "
             f"covers, the one that decides it): **{count('met')} of {len(rows)} met**, {count('not met')} not met"
             + (f", {count('not measured')} not measured in this file" if count("not measured") else "") + "."]
    lines += [f"- Not met: {r['target']}: {r['worst']}." for r in rows if r["result"] == "not met"]
    lines += [f"- Judged on part of its points only: {r['target']} (not measured at {r['not measured at']})."
              for r in rows if r["not measured at"] and r["result"] != "not measured"]
    display(Markdown(lines[0] + "\n\n" + "\n".join(lines[1:])))

    # What the missed points' own figures say: their CPU (files before bench_multihost measured it lack it).
    why = []
    for numel in sorted(own):
        backend, mine = (by_point.get(("2x2", "unshaped", numel, c)) for c in ("ddpkit_backend", "ddpkit"))
        if backend and mine and backend.median_s > 1.1 * mine.median_s and backend.cpu_busy is not None:
            extra = (backend.all_ranks_cpu_s - mine.all_ranks_cpu_s) / 4  # 2 hosts x 2 ranks
            why.append(f"- The backend at 2 hosts × 2 ranks, {floats(numel)}: {backend.median_s / mine.median_s:.2f}× "
                       f"`ddpkit.all_reduce`'s time. Each rank's call through torch's API spent {us(extra)} more CPU "
                       f"than `ddpkit.all_reduce`'s, with the cores {backend.cpu_busy:.0%} busy: the 4 ranks share 2 "
                       "cores, so what a call costs in CPU adds to its time.")
    for r in reduces:
        gloo = by_point.get((r.topology, r.link, r.numel, "gloo"))
        goal = MH_TARGET[(r.topology, r.link)](r.numel) if (r.topology, r.link) in MH_TARGET else None
        if (r.candidate == "ddpkit" and goal is not None and r.ratio_to_gloo > goal and gloo
                and r.cpu_busy is not None and gloo.cpu_busy is not None):
            why.append(f"- {HOSTS.get(r.topology, r.topology)}, {LINKS.get(r.link, r.link)}, {floats(r.numel)}: "
                       f"{r.ratio_to_gloo:.2f}× (target {goal}×; gloo {ms(gloo.median_s)}, p25–p75 "
                       f"{ms(gloo.p25_s)}–{ms(gloo.p75_s)}). All ranks spent {ms(r.all_ranks_cpu_s)} of CPU per call "
                       f"against gloo's {ms(gloo.all_ranks_cpu_s)} ({r.all_ranks_cpu_s / gloo.all_ranks_cpu_s:.2f}×), "
                       f"the cores {r.cpu_busy:.0%} and {gloo.cpu_busy:.0%} busy: where the cores bound both, the time "
                       "follows the CPU.")
        if (r.topology, r.candidate) == ("2x1", "ddpkit") and r.ratio_to_gloo > 1.0 and gloo and r.cpu_busy is not None:
            text = (f"- 2 hosts × 1 rank, {LINKS.get(r.link, r.link)}, {floats(r.numel)}: {r.ratio_to_gloo:.3f}× "
                    f"({ms(r.median_s)} against gloo's {ms(gloo.median_s)}), the cores {r.cpu_busy:.0%} and "
                    f"{gloo.cpu_busy:.0%} busy")
            rate = {"10gbit": 10e9, "1gbit": 1e9}.get(r.link)
            if rate:  # an all-reduce between two ranks moves the whole vector each way, whatever its schedule
                line = r.numel * 4 * 8 / rate
                text += (f"; {4 * r.numel / 1e6:g} MB each way take {ms(line)} at the link's rate: ddpkit "
                         f"{r.median_s / line - 1:+.1%}, gloo {gloo.median_s / line - 1:+.1%} above it")
            why.append(text + ".")
    if why:
        display(Markdown("The missed points' own figures:\n\n" + "\n".join(why)))
'''

TORCH_STACK = r'''
## 8. torch's own stack on the ddpkit backend

What torch builds on `torch.distributed`, unchanged, on the "ddpkit" backend against gloo, one host, CPU:

| workload | what runs |
|---|---|
| `fsdp2` | FSDP2: `fully_shard` on each linear layer and on the root, on `DeviceMesh.from_group(group, "cpu")`, AdamW; a model whose gradients dominate the step |
| `ddp_powerSGD` | torch DDP with the `powerSGD_hook` communication hook (low-rank gradient compression, one bucket), SGD |
| `ddp_fp16` | torch DDP with `fp16_compress_hook` (gradients all-reduced as float16), SGD |
| `tp_mlp` | a tensor-parallel MLP (`ColwiseParallel` then `RowwiseParallel`, DTensor), forward and backward; its messages are small |

Both candidates run side by side in the same processes: one copy of the model (same seed, same data) on a group of
each backend, repetitions interleaved; a repetition's figure is the slowest rank's time per step, the figure shown the
median over repetitions. Before timing, the copies take the same warm-up steps and their parameters must agree with
gloo's (`max |param diff|`). For `tp_mlp` a third candidate, `floor`, runs the same model on a mesh of one rank: the
step without any communication, the least any backend could reach. FSDP2's memory: each candidate alone in fresh
processes, the peak resident memory's increase over what the processes held before the model was built, the largest
over ranks. Command: `.venv/bin/python benchmarks/bench_torch_stack.py`.
'''

TORCH_STACK_TABLE = r'''
if "torch_stack" not in R:
    display(Markdown("No `torch_stack.json` in this results folder, so torch's FSDP2, DDP hooks and tensor "
                     "parallelism on the ddpkit backend are not shown: `.venv/bin/python benchmarks/bench_torch_stack.py` "
                     "measures them."))
else:
    command("torch_stack")
    T = R["torch_stack"]
    by = {(r.workload, r.world_size, r.candidate): r for r in T["records"]}
    TARGETS = {"fsdp2": 0.6, "tp_mlp": 0.5}
    rows = []
    for (workload, n, candidate), r in by.items():
        g, floor = by.get((workload, n, "gloo")), by.get((workload, n, "floor"))
        if candidate != "ddpkit" or g is None:
            continue
        rows.append({"workload": workload, "n": n, "model": r.model, "batch per rank": r.batch_per_rank,
                     "gloo step": g.median_step_s, "ddpkit step": r.median_step_s,
                     "ddpkit / gloo": r.median_step_s / g.median_step_s,
                     "target": f"≤ {TARGETS[workload]}×" if workload in TARGETS else "",
                     "floor step": floor.median_step_s if floor else None,
                     "floor / gloo": floor.median_step_s / g.median_step_s if floor else None,
                     "gloo memory": g.peak_rss_increase_bytes, "ddpkit memory": r.peak_rss_increase_bytes,
                     "memory ddpkit / gloo": (r.peak_rss_increase_bytes / g.peak_rss_increase_bytes
                                              if r.peak_rss_increase_bytes is not None and g.peak_rss_increase_bytes
                                              else None),
                     "max |param diff|": r.max_param_diff_vs_gloo})
    step = lambda s: ms(s) if s >= 1e-3 else us(s)
    table(rows, ["workload", "n", "model", "batch per rank", "gloo step", "ddpkit step", "ddpkit / gloo", "target",
                 "floor step", "floor / gloo", "gloo memory", "ddpkit memory", "memory ddpkit / gloo",
                 "max |param diff|"],
          {"gloo step": step, "ddpkit step": step, "ddpkit / gloo": ratio, "floor step": step, "floor / gloo": ratio,
           "gloo memory": mib, "ddpkit memory": mib, "memory ddpkit / gloo": ratio,
           "max |param diff|": lambda v: f"{v:.1e}"})
    display(Markdown("`n`: processes. Steps: median of the slowest rank. Memory (FSDP2 only): the peak resident "
                     "memory's increase over the processes' memory before the model was built, the largest over ranks, "
                     "each backend alone."))
    lines = []
    fsdp = [row for row in rows if row["workload"] == "fsdp2"]
    wanted = [2, 4]
    missing = [n for n in wanted if n not in {row["n"] for row in fsdp}]
    if fsdp:
        met = all(row["ddpkit / gloo"] <= TARGETS["fsdp2"] for row in fsdp)
        lines.append(
            f"**FSDP2** (target ≤ {TARGETS['fsdp2']}× gloo at 2 and 4 processes): "
            + ", ".join(f"{row['ddpkit / gloo']:.2f}× at {row['n']}" for row in fsdp)
            + f" — {'met' if met else 'not met'}" + (f" where measured (not measured at "
                                                   f"{', '.join(map(str, missing))} processes)" if missing else "")
            + "." + "".join(f" Memory at {row['n']}: {row['memory ddpkit / gloo']:.2f}× gloo's."
                            for row in fsdp if row["memory ddpkit / gloo"] is not None))
    else:
        lines.append("**FSDP2**: not measured in this file.")
    for row in (row for row in rows if row["workload"] == "tp_mlp"):
        limit = TARGETS["tp_mlp"]
        text = (f"**Tensor-parallel MLP** at {row['n']} processes (target ≤ {limit}× gloo): "
                f"{row['ddpkit / gloo']:.2f}× — {'met' if row['ddpkit / gloo'] <= limit else 'not met'}.")
        if row["floor / gloo"] is not None:
            gloo_s, ddpkit_s, floor_s = row["gloo step"], row["ddpkit step"], row["floor step"]
            text += (f" The floor, the same step on a mesh of one rank with no communication at all, takes "
                     f"{row['floor / gloo']:.2f}× gloo's step ({step(floor_s)} of {step(gloo_s)})")
            if row["floor / gloo"] > limit:
                text += (f": above the target, so no backend can reach it. Most of the step is not communication but "
                         "the model's own work and DTensor's dispatch in Python, which run the same on any backend.")
            else:
                text += ": below the target, so a backend could reach it."
            if gloo_s > floor_s:
                text += (f" Of what communicating adds to the step over gloo ({step(gloo_s - floor_s)}), ddpkit "
                         f"saves {100 * (gloo_s - ddpkit_s) / (gloo_s - floor_s):.0f} %.")
        lines.append(text)
    others = [row for row in rows if row["workload"] not in TARGETS]
    if others:
        lines.append("Without a target: " + ", ".join(f"{row['workload']} {row['ddpkit / gloo']:.2f}× gloo at "
                                                      f"{row['n']} processes" for row in others) + ".")
    diff = max(r.max_param_diff_vs_gloo for r in T["records"] if r.candidate == "ddpkit")
    lines.append(f"Every ddpkit copy agreed with gloo's before timing: largest difference {diff:.1e}.")
    display(Markdown("\n\n".join(lines)))
'''

TORCH_SUITE = r'''
if not SUITE.exists():
    display(Markdown(f"No `{SUITE.relative_to('..')}`, so torch's own distributed test suite on the ddpkit backend "
                     "is not summarised here: `.venv/bin/python scripts/run_torch_suite.py` runs it."))
else:
    suite = json.loads(SUITE.read_text())
    display(Markdown(
        f"**torch's own distributed test suite** (`torch.testing._internal.distributed.distributed_test`, "
        f"{suite['tests']} tests, {suite['world_size']} processes), run on gloo and on \"ddpkit\" one after the other by "
        f"`.venv/bin/python scripts/run_torch_suite.py` on {suite['date'][:16].replace('T', ' ')} UTC, at commit "
        f"`{suite['git_commit']}` (ddpkit built from `{suite['ddpkit_commit']}`), torch {suite['torch_version']}. "
        f"Every outcome is in `{SUITE.relative_to('..')}`, the differences also in `docs/torch_suite.md`."))
    runs = suite["runs"]
    table([{"backend": name, "tests": len(run["records"]), "passed": run["counts"].get("passed", 0),
            "failed or error": run["counts"].get("failed", 0) + run["counts"].get("error", 0),
            "skipped": run["counts"].get("skipped", 0), "run time": run["seconds"]} for name, run in runs.items()],
          ["backend", "tests", "passed", "failed or error", "skipped", "run time"],
          {"run time": lambda s: f"{s / 60:.1f} min"})
    gloo_runs, ddpkit_runs = runs["gloo"]["records"], runs["ddpkit"]["records"]
    passed = lambda run, name: run.get(name, {}).get("outcome") == "passed"
    only_gloo = sorted(name for name in gloo_runs if passed(gloo_runs, name) and not passed(ddpkit_runs, name))
    only_ddpkit = sorted(name for name in ddpkit_runs if passed(ddpkit_runs, name) and not passed(gloo_runs, name))
    skipped = [n for n in gloo_runs if gloo_runs[n]["outcome"] == "skipped"]
    reasons = {d["test"]: d for d in suite["differences"]}
    html = lambda text: re.sub(r"`([^`]*)`", r"<code>\1</code>", escape(text))
    causes = {"torch": "torch's own code", "ddpkit bug": "a ddpkit bug", "unclassified": "not yet read"}
    display(Markdown(
        f"gloo passes {sum(passed(gloo_runs, n) for n in gloo_runs)} tests and \"ddpkit\" "
        f"{sum(passed(ddpkit_runs, n) for n in ddpkit_runs)}: {len(only_gloo)} pass on gloo only"
        + (f", {len(only_ddpkit)} on \"ddpkit\" only" if only_ddpkit else ", none on \"ddpkit\" only") + "."
        + (" Each test gloo passes and \"ddpkit\" does not, with its reason:" if only_gloo else "")))
    if only_gloo:
        table([{"test": f"<code>{name}</code>",
                "on ddpkit": f"{ddpkit_runs.get(name, {}).get('outcome', 'not run')}: "
                             f"<code>{escape(ddpkit_runs.get(name, {}).get('summary', ''))}</code>",
                "why": html(reasons.get(name, {}).get("reason", "no reason recorded")),
                "cause": causes.get(reasons.get(name, {}).get("kind"), reasons.get(name, {}).get("kind", "—"))}
               for name in only_gloo], ["test", "on ddpkit", "why", "cause"])
    if only_ddpkit:
        table([{"test": f"<code>{name}</code>", "on gloo": f"{gloo_runs.get(name, {}).get('outcome', 'not run')}: "
                f"<code>{escape(gloo_runs.get(name, {}).get('summary', ''))}</code>"} for name in only_ddpkit],
              ["test", "on gloo"])
    if suite.get("flaky"):
        display(Markdown("Failed once and passed when run again (the machine was shared while the suite ran): "
                         + ", ".join(f"`{f['test']}` on {f['backend']}" for f in suite["flaky"]) + "."))
    def skip_reason(summary):
        text = summary.lower()
        return ("CUDA" if "cuda" in text else "NCCL or MPI only" if "nccl" in text or "mpi" in text
                else "another world size" if "world size" in text
                else "disabled upstream" if "github.com/pytorch" in text or "flak" in text or "failing" in text
                else "other")
    both = [gloo_runs[n]["summary"] for n in gloo_runs
            if gloo_runs[n]["outcome"] == "skipped" and ddpkit_runs.get(n, {}).get("outcome") == "skipped"]
    kinds = collections.Counter(map(skip_reason, both))
    display(Markdown(
        f"Skipped on both backends: {len(both)} tests, by the reason the suite gives: "
        + ", ".join(f"{kind} {count}" for kind, count in kinds.most_common())
        + " (\"disabled upstream\": torch's own skip, an issue or a flaky test). `tests/test_torch_suite.py` runs "
        "every test gloo passes on \"ddpkit\"."))
'''

COMMANDS = r'''
## 9. Reproduce

From the repository, after `make main` (which sets up `.venv`):

| what | command |
|---|---|
| everything, then this notebook | `bash benchmarks/run_all.sh` (`--quick` for a smoke run into `benchmarks/results/quick/`) |
| all-reduce grid | `bash benchmarks/peers/install.sh` (MPICH, DeepSpeed; once), then `.venv/bin/python benchmarks/bench_allreduce.py` |
| checked-mode overhead | `.venv/bin/python benchmarks/bench_allreduce.py --check-overhead --world-sizes 2 4 8 --reps 300 --output allreduce_checks` |
| SyncBatchNorm | `.venv/bin/python benchmarks/bench_syncbn.py --device cpu` |
| DDP | `.venv/bin/python benchmarks/bench_ddp.py` |
| the ddpkit torch.distributed backend | `.venv/bin/python benchmarks/bench_backend.py` |
| across simulated hosts (root: the hosts are namespaces) | `sudo .venv/bin/python benchmarks/bench_multihost.py` |
| FSDP2, DDP communication hooks, tensor parallelism on the ddpkit backend | `.venv/bin/python benchmarks/bench_torch_stack.py` |
| torch's distributed test suite on gloo and on ddpkit | `.venv/bin/python scripts/run_torch_suite.py` (writes `docs/torch_suite.json`, `docs/torch_suite.md`) |
| training comparison | `.venv/bin/python benchmarks/bench_training.py --full` (`make main`: the short run) |
| GPU: build, CUDA tests, GPU benchmarks | `bash scripts/gpu_checks.sh build test bench` |
| this notebook only | `.venv/bin/python notebooks/report.py` |
| one training run | `.venv/bin/torchrun --nproc_per_node 2 train.py --dataset fashion_mnist --accumulation-steps 2` |
'''


def build() -> nbformat.NotebookNode:
    cells = [
        nbformat.v4.new_markdown_cell(INTRO.strip()),
        nbformat.v4.new_code_cell(SETUP.strip().replace("__EXPECTED__", repr(EXPECTED))
                                 .replace("__OPTIONAL__", repr(OPTIONAL)).replace("__SUITE__", repr(SUITE))),
        nbformat.v4.new_code_cell(PROVENANCE.strip()),
        nbformat.v4.new_markdown_cell("## 0. Infrastructure"),
        nbformat.v4.new_code_cell(INFRA.strip()),
        nbformat.v4.new_markdown_cell(ALLREDUCE_INTRO.strip()),
        nbformat.v4.new_code_cell(ALLREDUCE_TIME.strip()),
        nbformat.v4.new_code_cell(ALLREDUCE_RING.strip()),
        nbformat.v4.new_code_cell(ALLREDUCE_SPREAD.strip()),
        nbformat.v4.new_code_cell(ALLREDUCE_ACCURACY.strip()),
        nbformat.v4.new_code_cell(ALLREDUCE_MEMORY.strip()),
        nbformat.v4.new_code_cell(CHECKS.strip()),
        nbformat.v4.new_code_cell(LATENCY.strip()),
        nbformat.v4.new_markdown_cell(SYNCBN.strip()),
        nbformat.v4.new_code_cell(SYNCBN_TABLE.strip()),
        nbformat.v4.new_code_cell(SYNCBN_PLOT.strip()),
        nbformat.v4.new_code_cell(SYNCBN_LOCAL.strip()),
        nbformat.v4.new_markdown_cell(DDP.strip()),
        nbformat.v4.new_code_cell(DDP_TABLE.strip()),
        nbformat.v4.new_markdown_cell(TRAINING.strip()),
        nbformat.v4.new_code_cell(TRAINING_PLOTS.strip()),
        nbformat.v4.new_markdown_cell(GPU.strip()),
        nbformat.v4.new_code_cell(GPU_TABLES.strip()),
        nbformat.v4.new_markdown_cell(BACKEND.strip()),
        nbformat.v4.new_code_cell(BACKEND_TABLES.strip()),
        nbformat.v4.new_markdown_cell(MULTIHOST.strip()),
        nbformat.v4.new_code_cell(MULTIHOST_PLOT.strip()),
        nbformat.v4.new_code_cell(MULTIHOST_TARGETS.strip()),
        nbformat.v4.new_markdown_cell(TORCH_STACK.strip()),
        nbformat.v4.new_code_cell(TORCH_STACK_TABLE.strip()),
        nbformat.v4.new_code_cell(TORCH_SUITE.strip()),
        nbformat.v4.new_markdown_cell(COMMANDS.strip()),
    ]
    # Ids by position, not nbformat's random ones: a rebuild from the same results is the same file.
    for index, cell in enumerate(cells):
        cell.id = f"cell-{index:02d}"
    notebook = nbformat.v4.new_notebook(cells=cells)
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return notebook


def execute(notebook: nbformat.NotebookNode, results: Path, timeout: int = 300) -> nbformat.NotebookNode:
    """Runs every cell in notebooks/ (relative paths resolve there); raises on the first failing cell."""
    os.environ["DDPKIT_REPORT_RESULTS"] = str(results.resolve())
    # No timestamps in the cells' metadata: they would change the file at every run.
    NotebookClient(notebook, timeout=timeout, kernel_name="python3", record_timing=False,
                   resources={"metadata": {"path": str(HERE)}}).execute()
    return notebook


def write_if_changed(notebook: nbformat.NotebookNode, path: Path) -> bool:
    """Writes ``notebook`` to ``path`` unless the file holds it already; whether it wrote. A tracked
    report rebuilt from the results it shows stays untouched, and the tree clean."""
    text = nbformat.writes(notebook)
    if not text.endswith("\n"):
        text += "\n"  # as nbformat.write ends the file
    if path.is_file() and path.read_text() == text:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=HERE.parent / "benchmarks" / "results")
    parser.add_argument("--output", type=Path, default=HERE / "report.ipynb")
    parser.add_argument("--execute-only", action="store_true",
                        help="run the existing notebook at --output instead of rebuilding it (CI)")
    args = parser.parse_args()
    notebook = nbformat.read(args.output, as_version=4) if args.execute_only else build()
    execute(notebook, args.results)
    if write_if_changed(notebook, args.output):
        print(f"wrote {args.output}")
    else:
        print(f"{args.output} is unchanged: the same results give the same report")


if __name__ == "__main__":
    main()
