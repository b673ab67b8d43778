"""The analysis behind notebooks/report.ipynb: reading the benchmark results, and every section's tables, plots
and sentences.

notebooks/report.py assembles the notebook from prose and one-line calls into this module. Each section function
takes ``R``, the loaded results (:func:`load_results`: benchmark name -> its JSON document, the records typed by
benchmarks/records.py), and shows its output through IPython's ``display`` and matplotlib's ``plt.show``; it
returns nothing. Every number shown is computed here from the results when the notebook runs: nothing is typed
in. Importing the module reads no result and draws nothing, so tests import it on its own.
"""

from __future__ import annotations

import collections
import json
import math
import os
import re
import statistics
import sys
from dataclasses import dataclass
from html import escape
from pathlib import Path

import matplotlib.pyplot as plt
from IPython.display import HTML, Markdown, display
from matplotlib.lines import Line2D

REPO = Path(__file__).resolve().parent.parent
# records.py is a file of the benchmarks, not of an installed package (pure Python: no torch in the kernel).
if str(REPO / "benchmarks") not in sys.path:
    sys.path.insert(0, str(REPO / "benchmarks"))
from records import load_records  # noqa: E402

# results/<name>.json the report reads: benchmarks/run_all.sh produces every one of them from the current tree.
EXPECTED = ["allreduce", "allreduce_checks", "syncbn", "ddp", "training", "backend"]
# Shown when present, a sentence in their place when not: the GPU results, which run_all.sh produces only on a
# machine with a GPU, and the all-reduce grid on that machine's CPU cores (scripts/gpu_checks.sh grid);
# torch_stack (bench_torch_stack.py); multihost (bench_multihost.py, which needs root); latency (bench_latency.py);
# fault_tolerance (bench_fault_tolerance.py, which needs torchft).
OPTIONAL = ["syncbn_cuda", "ddp_cuda", "allreduce_16core", "torch_stack", "multihost", "latency", "fault_tolerance"]
# Read from the repository, not from the results folder: torch's own distributed test suite on gloo and on
# "ddpkit", written by scripts/run_torch_suite.py (run_all.sh does not run it); a sentence in its place when absent.
SUITE = "docs/torch_suite.json"


# ---------------------------------------------------------------------------------------------------------------
# Loading and provenance


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
        problems.append("the tree it was measured from had uncommitted changes, so no commit holds the code that "
                        "produced it")
    return " and ".join(problems) or None


def minute(date: str) -> str:
    """An ISO date as "YYYY-MM-DD HH:MM"."""
    return date[:16].replace("T", " ")


def warn(text: str) -> None:
    """Shows ``text`` (markdown-free HTML) as a warning box, marked ⚠."""
    display(HTML(f'<div style="border-left: 6px solid #d9822b; background: #fff4e5; padding: 6px 12px; '
                 f'margin: 6px 0">⚠ {text}</div>'))


def command(R: dict, name: str) -> None:
    """A section's first line: the command that produced result ``name`` and when; a warning under it where the
    result is not of the report's commit."""
    env = R[name]["environment"]
    display(Markdown(f"Produced by `{env['command']}` on {minute(env['date'])} UTC."))
    problem = provenance_problem(R, name)
    if problem:
        warn(f"`{name}.json`: {problem}. Run `bash benchmarks/run_all.sh` on a clean checkout to measure every "
             "result from one commit.")


# ---------------------------------------------------------------------------------------------------------------
# Formatting


def us(seconds: float) -> str:
    """Whole microseconds: "12 µs"."""
    return f"{seconds * 1e6:.0f} µs"


def us_tenths(seconds: float) -> str:
    """Microseconds to a tenth, for latencies of a few µs: "12.3 µs"."""
    return f"{seconds * 1e6:.1f} µs"


def ms(seconds: float) -> str:
    """Milliseconds to a tenth: "1.2 ms"."""
    return f"{seconds * 1e3:.1f} ms"


def step_time(seconds: float) -> str:
    """A time per step or call in the unit that reads best: ms from 1 ms up, whole µs below."""
    return ms(seconds) if seconds >= 1e-3 else us(seconds)


def call_time(seconds: float) -> str:
    """A time per call with a third significant digit, for times from a few µs to ms: "2.5 µs", "1.25 ms"."""
    return f"{seconds * 1e6:.1f} µs" if seconds < 1e-3 else f"{seconds * 1e3:.2f} ms"


def mib(size: float) -> str:
    """Bytes in MiB to a tenth."""
    return f"{size / 2**20:.1f} MiB"


def kib(size: float) -> str:
    """Bytes in whole KiB."""
    return f"{size / 2**10:.0f} KiB"


def ratio(x: float) -> str:
    """A ratio to two decimals: "0.85×"."""
    return f"{x:.2f}×"


def floats(n: int) -> str:
    """A vector's length as the targets name it: 1000 -> "1k", 16000000 -> "16M", others in full ("1,234")."""
    for unit, size in (("M", 10**6), ("k", 10**3)):
        if n >= size and n % size == 0:
            return f"{n // size:,}{unit}"
    return f"{n:,}"


def html_table(rows: list[dict], columns: list[str], formats: dict | None = None) -> str:
    """An HTML table of dict rows, one column per key in ``columns``. A missing or None value is an empty cell;
    ``formats`` maps a column to the function that writes its values; other floats get 3 significant digits,
    anything else ``str``. Values are not escaped: a cell may hold HTML."""
    formats = formats or {}

    def cell(row: dict, column: str) -> str:
        value = row.get(column)
        if value is None:
            return ""
        if column in formats:
            return formats[column](value)
        return f"{value:.3g}" if isinstance(value, float) else str(value)

    head = "".join(f"<th>{c}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{cell(r, c)}</td>" for c in columns) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def table(rows: list[dict], columns: list[str], formats: dict | None = None) -> None:
    """Shows :func:`html_table`'s table."""
    display(HTML(html_table(rows, columns, formats)))


def figure_legend(axes) -> dict:
    """label -> handle of every line of ``axes``, each label once (its first handle), in drawing order: the
    entries of one legend for a figure whose panels do not all show every line."""
    legend = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(label, handle)
    return legend


def below_floor(records: list, names: dict | None = None) -> str | None:
    """A paragraph on every DDP record whose median step is below the no-communication floor's (candidate
    "floor", same model and accumulation), or None. ``names``: the words to call a candidate by."""
    floors = {(r.model, r.accumulation): r for r in records if r.candidate == "floor"}
    cases = [(r, floors[(r.model, r.accumulation)]) for r in records if r.candidate != "floor"
             and (r.model, r.accumulation) in floors
             and r.median_step_s < floors[(r.model, r.accumulation)].median_step_s]
    if not cases:
        return None

    def overlap(r, f) -> bool:
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


# ---------------------------------------------------------------------------------------------------------------
# 0. Provenance and infrastructure


def provenance(R: dict) -> None:
    """The report's commit, once, and a warning for each result not of it (or a sentence that every one is)."""
    display(Markdown(f"**These results were measured at commit `{report_commit(R)}`**, the commit of most of them."))
    problems = {name: provenance_problem(R, name) for name in R}
    for name, problem in problems.items():
        if problem:
            warn(f"`{name}.json`: {problem}.")
    if not any(problems.values()):
        display(Markdown("Every result comes from that commit, measured on a tree without uncommitted changes."))


def infrastructure(R: dict) -> None:
    """Each result's date, software, machine and commit, and a sentence on the all-reduce's machine."""
    rows = []
    for name, document in R.items():
        e = document["environment"]
        commit, dirty = commit_of(document)
        rows.append({"benchmark": name, "date": minute(e["date"]), "torch": e["torch_version"],
                     "backend": e["backend"], "device": e["device_type"], "host": e["hostname"],
                     "CPU": f"{e['cpu_model']} × {e['cpu_count']}", "GPU": (e["gpu"] or {}).get("gpu_name", "none"),
                     "commit": commit[:10] + (" + uncommitted changes" if dirty else "")})
    table(rows, ["benchmark", "date", "torch", "backend", "device", "host", "CPU", "GPU", "commit"])
    env = R["allreduce"]["environment"]
    gpu = env["gpu"]
    display(Markdown(
        f"Python {env['python_version']} on `{env['hostname']}`: {env['cpu_count']} cores of a {env['cpu_model']}, "
        + (f"{gpu['gpu_count']} × {gpu['gpu_name']} (driver {gpu['gpu_driver']}), collectives of CUDA tensors over "
           "NCCL." if gpu else
           f"no GPU, so torch's collectives run over {env['backend']} on loopback TCP, ddpkit's over its "
           f"shared-memory transport (`transport=\"auto\"`), and world sizes above "
           f"{env['cpu_count']} oversubscribe the cores. On a GPU machine the same scripts run over NCCL, and the "
           "SyncBatchNorm baseline becomes torch.nn.SyncBatchNorm.")))


# ---------------------------------------------------------------------------------------------------------------
# 1. All-reduce

ALLREDUCE_STYLE = {"gloo": dict(color="black", linewidth=2.5), "floor": dict(color="gray", linestyle="--"),
                   "ddpkit": dict(color="tab:red", linewidth=2.5)}
CUT = "point cut short by its time budget"


@dataclass(frozen=True)
class AllreduceGrid:
    """The time records of an all-reduce result, as its tables and plot read them."""

    timed: list  # the time records with a median
    missing: list  # those without: not measured
    by: dict  # (world size, numel, candidate) -> timed record
    sizes: list  # every numel timed, ascending
    world_sizes: list  # every world size timed, ascending
    candidates: list  # in the order the records first name them


def allreduce_grid(document: dict) -> AllreduceGrid:
    """The :class:`AllreduceGrid` of an all-reduce results document."""
    timed = [r for r in document["records"] if r.kind == "time" and r.median_s]
    return AllreduceGrid(
        timed=timed, missing=[r for r in document["records"] if r.kind == "time" and not r.median_s],
        by={(r.world_size, r.numel, r.candidate): r for r in timed}, sizes=sorted({r.numel for r in timed}),
        world_sizes=sorted({r.world_size for r in timed}), candidates=list(dict.fromkeys(r.candidate for r in timed)))


def allreduce_time(R: dict) -> None:
    """The candidates of the all-reduce run and how each ran, then median time against size, one panel per world
    size (× on the points cut short by their time budget), and the points not measured."""
    command(R, "allreduce")
    A = R["allreduce"]
    grid = allreduce_grid(A)
    statuses = A["settings"].get("candidates", {})
    if statuses:
        table([{"candidate": k, "status": v["status"], "how": v.get("launcher", v.get("install", ""))}
               for k, v in statuses.items()], ["candidate", "status", "how"])
        display(Markdown(f"ddpkit's default transport in this run: `{A['settings']['ddpkit_default_transport']}`"
                         + ("" if A["settings"]["ddpkit_transport_argument"] else
                            " (this ddpkit had no `transport` argument: everything of ddpkit's ran over the process "
                            "group)") + "."))
    columns = min(4, len(grid.world_sizes))
    panel_rows = -(-len(grid.world_sizes) // columns)
    fig, axes = plt.subplots(panel_rows, columns, figsize=(4.3 * columns, 3.3 * panel_rows), sharey=True, squeeze=False)
    colors = {c: ALLREDUCE_STYLE.get(c, {}).get("color", f"C{i}") for i, c in enumerate(grid.candidates)}
    for ax, ws in zip(axes.flat, grid.world_sizes):
        for c in grid.candidates:
            points = sorted((r.numel, r.median_s, r.cut_off) for r in grid.timed
                            if r.world_size == ws and r.candidate == c)
            if not points:
                continue
            ax.plot([p[0] for p in points], [p[1] * 1e3 for p in points], marker="o", markersize=3, label=c,
                    **{**ALLREDUCE_STYLE.get(c, {}), "color": colors[c]})
            cut = [p for p in points if p[2]]
            if cut:
                ax.plot([p[0] for p in cut], [p[1] * 1e3 for p in cut], "x", color=colors[c], markersize=9, label=CUT)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(f"n = {ws} process{'es' if ws > 1 else ''}", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.set_xlabel("floats", fontsize=8)
    for ax in axes.flat[len(grid.world_sizes):]:
        ax.axis("off")
    for row in axes:
        row[0].set_ylabel("median time (ms)")
    # One legend for the whole figure: a candidate may be missing from some panels (the peers run from n = 2 up).
    legend = figure_legend(axes.flat)
    if CUT in legend:  # one black × for the markers of every candidate
        legend[CUT] = Line2D([], [], marker="x", linestyle="", color="black", markersize=9)
    fig.legend(legend.values(), legend.keys(), loc="upper center", ncol=len(legend), fontsize=8,
               bbox_to_anchor=(0.5, 1.0))
    plt.tight_layout(rect=(0, 0, 1, 0.95))
    plt.show()
    display(Markdown("A × marks a point cut short by its time budget (fewer repetitions than planned). " +
                     (f"Not measured: {', '.join(sorted({f'{r.candidate} n={r.world_size}' for r in grid.missing}))}."
                      if grid.missing else "")))


def allreduce_targets(R: dict) -> None:
    """ddpkit over gloo by world size (2, 4, 8) and size, then the all-reduce's targets against the summary:
    ddpkit / gloo, / the best peer and / the memory floor, and the points cut short."""
    grid = allreduce_grid(R["allreduce"])
    summary = R["allreduce"]["summary"]
    rows = []
    for ws in [n for n in (2, 4, 8) if n in grid.world_sizes]:
        row = {"n": ws}
        for numel in grid.sizes:
            row[f"{numel:,}"] = summary["ddpkit_over_gloo"].get(f"n={ws} numel={numel}")
        rows.append(row)
    table(rows, ["n"] + [f"{n:,}" for n in grid.sizes], {f"{n:,}": ratio for n in grid.sizes})
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
    cut = summary.get("cut_off_points")
    if cut:
        lines.append(f"Cut off by the time budget: {len(cut)} points "
                     f"({', '.join(cut[:8])}{' …' if len(cut) > 8 else ''}).")
    display(Markdown("\n\n".join(lines)))


def allreduce_spread(R: dict) -> None:
    """Bus bandwidth by world size (up to 8), size and candidate, then every point's quartiles and repetitions at
    2, 4 and 8 processes."""
    grid = allreduce_grid(R["allreduce"])
    candidates = grid.candidates
    rows = []
    for ws in [w for w in grid.world_sizes if w <= 8]:
        for numel in grid.sizes:
            row = {"n": ws, "floats": f"{numel:,}"}
            for c in candidates:
                r = grid.by.get((ws, numel, c))
                row[c] = r.bus_bandwidth_GBps if r else None
            if any(row[c] is not None for c in candidates):
                rows.append(row)
    shown = [c for c in candidates if any(row[c] is not None for row in rows)]
    table(rows, ["n", "floats"] + shown, {c: (lambda v: f"{v:.3g}") for c in shown})
    display(Markdown("Bus bandwidth in GB/s as nccl-tests define it: bytes / median time × 2(n−1)/n (none for the "
                     "floor, which is no collective, nor at n = 1)."))
    rows = []
    for ws in [2, 4, 8]:
        for numel in grid.sizes:
            for c in candidates:
                r = grid.by.get((ws, numel, c))
                if r:
                    rows.append({"n": ws, "floats": f"{numel:,}", "candidate": c, "p25": r.p25_s,
                                 "median": r.median_s, "p75": r.p75_s, "reps": r.reps, "cut off": r.cut_off})
    table(rows, ["n", "floats", "candidate", "p25", "median", "p75", "reps", "cut off"],
          {"p25": us, "median": us, "p75": us})
    display(Markdown(
        "The spread between the 25th and 75th percentiles shows how much of each figure is scheduling: with more "
        "runnable processes than the 2 cores, a process waits out time slices of several ms, and implementations "
        "that busy-poll (MPICH, DeepSpeed) lose their cores to each other."))


def allreduce_accuracy(R: dict) -> None:
    """The largest error of the mean by world size and candidate, over the sizes checked."""
    grid = allreduce_grid(R["allreduce"])
    rows = []
    for ws in grid.world_sizes:
        row = {"world size": ws}
        for c in grid.candidates:
            errors = [r.max_abs_error_of_mean for r in grid.timed
                      if r.world_size == ws and r.candidate == c and r.max_abs_error_of_mean is not None]
            row[c] = max(errors) if errors else None
        rows.append(row)
    measured = [c for c in grid.candidates if any(row[c] is not None for row in rows)]
    table(rows, ["world size"] + measured, {c: (lambda v: f"{v:.1e}") for c in measured})
    display(Markdown("Accuracy of averaging: max |result − float64 mean| over the sizes checked, N(0, 1) float32 "
                     "inputs (MPICH, DeepSpeed and gloo: the sum divided by n)."))


def allreduce_memory(R: dict) -> None:
    """A plot: the peak memory increase of one all-reduce of the largest size measured, against world size."""
    memory = [r for r in R["allreduce"]["records"] if r.kind == "memory"]
    big = max(r.numel for r in memory)
    fig, ax = plt.subplots(figsize=(8, 4))
    for c in dict.fromkeys(r.candidate for r in memory):
        points = sorted((r.world_size, r.peak_memory_increase_bytes) for r in memory
                        if r.numel == big and r.candidate == c)
        ax.plot([p[0] for p in points], [p[1] / 2**20 for p in points], marker="o", label=c)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("world size")
    ax.set_ylabel("peak RSS increase (MiB)")
    ax.set_title(f"memory of one warm all-reduce of {big:,} floats ({big * 4 / 2**20:.0f} MiB), max over ranks")
    ax.legend(fontsize=8)
    ax.grid(True, alpha=0.3)
    plt.show()


def collective_checks(R: dict) -> None:
    """What the collective checks cost: checked over unchecked time at each point, and their median and range."""
    command(R, "allreduce_checks")
    overhead = R["allreduce_checks"]["summary"]["checked_over_unchecked"]
    rows = [{"point": k, "checked / unchecked": v} for k, v in sorted(overhead.items())]
    table(rows, ["point", "checked / unchecked"], {"checked / unchecked": ratio})
    values = list(overhead.values())
    display(Markdown(
        f"The collective checks (before any payload, the ranks exchange a small header naming the collective, so "
        f"that mismatched calls raise on every rank instead of hanging; on by default) cost a median "
        f"{statistics.median(values):.2f}× (range {min(values):.2f}–{max(values):.2f}×) over the same algorithm "
        "unchecked, on these latency-bound sizes."))


def latency(R: dict) -> None:
    """The layers of a small all-reduce's call path and what each adds (latency.json), or a sentence where the
    folder has no latency.json."""
    if "latency" not in R:
        display(Markdown("No `latency.json` in this results folder, so the layers of a small all-reduce's call path "
                         "are not shown: `.venv/bin/python benchmarks/bench_latency.py` measures them."))
        return
    command(R, "latency")
    L = R["latency"]
    sizes = sorted({r.numel for r in L["records"] if r.numel})
    rows = [{"layer": stage, **{f"{n:,} floats": next((r.median_s for r in L["records"] if r.stage == stage
                                                       and r.numel in (0, n)), None) for n in sizes}}
            for stage in dict.fromkeys(r.stage for r in L["records"])]
    table(rows, ["layer"] + [f"{n:,} floats" for n in sizes], {f"{n:,} floats": us_tenths for n in sizes})
    budget = L["summary"]
    lines = [f"| {label} | " + " | ".join(us_tenths(budget[f"numel={n}"][label]) for n in sizes) + " |"
             for label in budget[f"numel={sizes[0]}"]]
    display(Markdown(
        "Where a small all-reduce's time goes, 2 ranks on one host: each layer of `ddpkit.all_reduce`'s call path "
        "looped back to back, the `c++` rows with the loop itself in C++ (no Python and no dispatcher between "
        "calls). The budget is what each layer adds to the one below it (both Python rows add to `c++ all_reduce`):"
        "\n\n| layer | " + " | ".join(f"{n:,} floats" for n in sizes) + " |\n|---|" + "---|" * len(sizes) + "\n"
        + "\n".join(lines)))


# ---------------------------------------------------------------------------------------------------------------
# 2. SyncBatchNorm

SYNCBN_TARGET = 1.15  # ddpkit's SyncBatchNorm at 2 workers, over torch's BatchNorm alone


def syncbn_distributed(R: dict) -> list:
    """The SyncBatchNorm records of more than one worker."""
    return [r for r in R["syncbn"]["records"] if r.world_size > 1]


def _over_local(r, seconds: float | None) -> float | None:
    # Computed from the times, not read from the file's ratios, so that every version of the file reads the same.
    return seconds / r.t_torch_bn_local if seconds is not None else None


def syncbn_table(R: dict) -> None:
    """Every SyncBatchNorm configuration's times and their ratios to torch's BatchNorm alone (the headline) and to
    the older floor (BatchNorm + two gloo all-reduces), and how to read them."""
    command(R, "syncbn")
    distributed = syncbn_distributed(R)
    steps = {r.steps_per_repetition or 1 for r in distributed}
    rows = [{"workers": r.world_size, "shape": "×".join(map(str, r.shape)), "ddpkit (auto)": r.t_ddpkit,
             "ddpkit (process_group)": r.t_ddpkit_pg, "torch BatchNorm alone": r.t_torch_bn_local,
             "auto/BN": _over_local(r, r.t_ddpkit), "pg/BN": _over_local(r, r.t_ddpkit_pg),
             "unchecked/BN": _over_local(r, r.t_ddpkit_unchecked),
             "auto/(BN + 2 gloo)": r.t_ddpkit / r.t_floor, "local kernels/BN": _over_local(r, r.t_ddpkit_local)}
            for r in distributed]
    table(rows, ["workers", "shape", "ddpkit (auto)", "ddpkit (process_group)", "torch BatchNorm alone", "auto/BN",
                 "pg/BN", "unchecked/BN", "auto/(BN + 2 gloo)", "local kernels/BN"],
          {"ddpkit (auto)": us, "ddpkit (process_group)": us, "torch BatchNorm alone": us, "auto/BN": ratio,
           "pg/BN": ratio, "unchecked/BN": ratio, "auto/(BN + 2 gloo)": ratio, "local kernels/BN": ratio})
    display(Markdown(
        f"Forward + backward of one layer, global batch split evenly, {' or '.join(map(str, sorted(steps)))} steps "
        "back to back per repetition as a training loop runs them (per step: the slowest rank's time over the steps, "
        "median over repetitions). On CPU torch has no SyncBatchNorm, so the baseline is torch's BatchNorm on the "
        "same local batch with no communication at all: `auto/BN` is what synchronizing the batch costs on top of a "
        f"plain batch norm. Target at 2 workers: ≤ {SYNCBN_TARGET}×. The column `auto/(BN + 2 gloo)` divides by the "
        "baseline this report used before, torch's own parts (that BatchNorm plus one gloo all-reduce of 2C+1 and "
        "one of 2C float64 values): that floor already pays gloo's latency twice, so ratios against it look far "
        "better than against BatchNorm alone, and earlier versions of this report judged the target against it."))


def syncbn_plot(R: dict) -> None:
    """A plot per world size: each candidate's time over torch's BatchNorm alone, by shape, with the target."""
    distributed = syncbn_distributed(R)
    fig, axes = plt.subplots(1, 2, figsize=(13, 3.8), sharey=True)
    for ax, ws in zip(axes, sorted({r.world_size for r in distributed})):
        rows = [r for r in distributed if r.world_size == ws]
        labels = ["×".join(map(str, r.shape)) for r in rows]
        xs = range(len(rows))
        for offset, key, label in [(-0.3, "t_ddpkit", "ddpkit (auto)"),
                                   (-0.1, "t_ddpkit_unchecked", "ddpkit (auto, unchecked)"),
                                   (0.1, "t_ddpkit_pg", "ddpkit (process_group)"),
                                   (0.3, "t_torch_emulated",
                                    "torch's parts: BatchNorm + 2 gloo all-reduces in one step")]:
            if all(getattr(r, key) is not None for r in rows):
                ax.bar([x + offset for x in xs], [getattr(r, key) / r.t_torch_bn_local for r in rows], width=0.18,
                       label=label)
        ax.axhline(SYNCBN_TARGET, color="black", linestyle="--", linewidth=1, label=f"target {SYNCBN_TARGET}")
        ax.axhline(1.0, color="gray", linewidth=0.8, label="torch BatchNorm alone (1)")
        ax.set_xticks(list(xs), labels, rotation=30, fontsize=8)
        ax.set_title(f"{ws} workers: time / torch BatchNorm alone (no communication)")
    axes[0].legend(fontsize=8)
    plt.tight_layout()
    plt.show()


def syncbn_local(R: dict) -> None:
    """The local kernels against torch's batch norm, the memory per channel, and the 2-worker ratios in words
    (with the collective checks off too, where measured)."""
    s = R["syncbn"]
    distributed = syncbn_distributed(R)
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
        f"BatchNorm alone ({sum(b <= SYNCBN_TARGET for b in best)} of {len(best)} configurations within "
        f"{SYNCBN_TARGET}×); against the older floor (BatchNorm plus two gloo all-reduces) `auto` is "
        f"{min(floor):.2f}–{max(floor):.2f}×. The local kernels alone are {min(local.values()):.2f}–"
        f"{max(local.values()):.2f}× torch's CPU batch norm (target ≤ 1.0×); memory is at most "
        f"{s['summary']['max_alloc_extra_per_channel_bytes']:.1f} bytes per channel above BatchNorm's."))
    unchecked = [r.t_ddpkit_unchecked / r.t_torch_bn_local for r in two if r.t_ddpkit_unchecked is not None]
    checked = [r.t_ddpkit / r.t_torch_bn_local for r in two]
    if unchecked:
        display(Markdown(
            f"With the collective checks off (one header exchange less per all-reduce), `auto` is "
            f"{min(unchecked):.2f}–{max(unchecked):.2f}× torch's BatchNorm alone at 2 workers "
            f"({sum(u <= SYNCBN_TARGET for u in unchecked)} of {len(unchecked)} within {SYNCBN_TARGET}×), against "
            f"{min(checked):.2f}–{max(checked):.2f}× with them on (median {statistics.median(unchecked):.2f}× vs "
            f"{statistics.median(checked):.2f}×)."))


# ---------------------------------------------------------------------------------------------------------------
# 3. DistributedDataParallel


def ddp(R: dict) -> None:
    """Every DDP record's step time and memory, the candidates over torch DDP (plot and table), the default
    all-reduce's range in words, and a paragraph on any step below the no-communication floor."""
    command(R, "ddp")
    d = R["ddp"]
    rows = [{"model": r.model, "accumulation": r.accumulation, "candidate": r.candidate,
             "median step": r.median_step_s, "p25 step": r.p25_step_s, "p75 step": r.p75_step_s,
             "peak memory": r.peak_memory_bytes, "buckets": (r.reducer_stats or {}).get("buckets")}
            for r in d["records"]]
    table(rows, ["model", "accumulation", "candidate", "median step", "p25 step", "p75 step", "peak memory",
                 "buckets"],
          {"median step": ms, "p25 step": ms, "p75 step": ms, "peak memory": mib})
    fig, ax = plt.subplots(figsize=(10, 3.5))
    names = list(d["summary"])
    ax.bar([i - 0.2 for i in range(len(names))], [d["summary"][n]["time_ratio"] for n in names], width=0.4,
           label="step time")
    ax.bar([i + 0.2 for i in range(len(names))], [d["summary"][n]["memory_ratio"] for n in names], width=0.4,
           label="peak memory")
    ax.axhline(1.0, color="black", linestyle="--", linewidth=1, label="torch DDP (1)")
    ax.set_xticks(range(len(names)), names, rotation=20, fontsize=8)
    ax.set_ylabel("candidate / torch DDP")
    ax.legend(fontsize=8)
    plt.tight_layout()
    plt.show()
    rows = [{"configuration": k, "time vs torch DDP": v["time_ratio"], "memory vs torch DDP": v["memory_ratio"]}
            for k, v in d["summary"].items()]
    table(rows, ["configuration", "time vs torch DDP", "memory vs torch DDP"],
          {"time vs torch DDP": ratio, "memory vs torch DDP": ratio})
    default = [v for k, v in d["summary"].items() if k.startswith("ddpkit ")]
    times, memories = [v["time_ratio"] for v in default], [v["memory_ratio"] for v in default]
    display(Markdown(
        f"{d['settings']['world_size']} processes, synthetic CIFAR-shaped batches. ddpkit with its default "
        f"all-reduce: step time {min(times):.2f}–{max(times):.2f}× torch DDP, peak memory {min(memories):.2f}–"
        f"{max(memories):.2f}× (targets: time ≤ 0.9×, memory ≤ 1.0×). Accumulation 4 uses `no_sync` on 3 of every 4 "
        "micro-batches in both. `floor` (where measured) is the same steps with no gradient communication at all: no "
        "data-parallel wrapper can take less."))
    floor_text = below_floor(d["records"])
    if floor_text:
        display(Markdown(floor_text))


# ---------------------------------------------------------------------------------------------------------------
# 4. Training


def training(R: dict) -> None:
    """The training comparison: loss, test accuracy and epoch time of each pipeline (plots and table), the
    like-for-like pair (ddpkit's DDP and torch's, the same BatchNorm) in words, and any other pipeline against
    ddpkit's plain one."""
    command(R, "training")
    t = R["training"]
    settings = t["settings"]
    # The headline pair: ddpkit's DDP and torch's with the same BatchNorm (both plain on CPU, where torch has no
    # SyncBatchNorm); any other pipeline (ddpkit's SyncBatchNorm on CPU) is a row of its own.
    torch_run = next(r for r in t["records"] if r.impl == "torch")
    like = next(r for r in t["records"] if r.impl == "ddpkit" and r.synchronized == torch_run.synchronized)
    pipelines = [like, torch_run, *(r for r in t["records"] if r is not like and r is not torch_run)]
    fig, (loss_ax, accuracy_ax, time_ax) = plt.subplots(1, 3, figsize=(17, 4.2),
                                                        gridspec_kw={"width_ratios": [3, 3, 2]})
    for i, record in enumerate(pipelines):
        losses = record.loss_curve
        window = max(1, len(losses) // 100)
        smooth = [statistics.fmean(losses[j:j + window]) for j in range(0, len(losses) - window + 1, window)]
        loss_ax.plot([j * window for j in range(len(smooth))], smooth, color=f"C{i}", label=record.label)
        accuracy_ax.plot([e["epoch"] + 1 for e in record.epochs], [100 * e["test_accuracy"] for e in record.epochs],
                         marker="o", color=f"C{i}", label=record.label)
    loss_ax.set_xlabel("optimizer step")
    loss_ax.set_ylabel("training loss (rank 0, smoothed)")
    # The accuracies differ by tenths of a point: the axis is zoomed to where they are, and its label says so.
    floor = 5 * math.floor((min(100 * e["test_accuracy"] for r in pipelines for e in r.epochs) - 1) / 5)
    accuracy_ax.set_ylim(bottom=floor)
    accuracy_ax.set_xlabel("epoch")
    accuracy_ax.set_ylabel(f"test accuracy (%), axis from {floor} %")
    medians = [r.median_epoch_time_s for r in pipelines]
    time_ax.bar(range(len(pipelines)), medians, color=[f"C{i}" for i in range(len(pipelines))],
                yerr=[[m - min(r.epoch_times_s) for m, r in zip(medians, pipelines)],
                      [max(r.epoch_times_s) - m for m, r in zip(medians, pipelines)]], capsize=6)
    time_ax.set_xticks(range(len(pipelines)), [r.label.replace(", ", "\n") for r in pipelines], fontsize=8)
    time_ax.set_ylabel(f"epoch time (s): median, min–max of {len(like.epochs)}")
    for ax in (loss_ax, accuracy_ax, time_ax):
        ax.grid(alpha=0.3)
    loss_ax.legend(fontsize=8)
    accuracy_ax.legend(fontsize=8)
    plt.tight_layout()
    plt.show()
    rows = [{"pipeline": r.label, "final test accuracy": r.final_test_accuracy,
             "vs torch": 100 * (r.final_test_accuracy - torch_run.final_test_accuracy),
             "epoch time": r, "time vs torch": r.median_epoch_time_s / torch_run.median_epoch_time_s,
             "peak memory": r.peak_rss_bytes, "memory vs torch": r.peak_rss_bytes / torch_run.peak_rss_bytes}
            for r in pipelines]
    table(rows, ["pipeline", "final test accuracy", "vs torch", "epoch time", "time vs torch", "peak memory",
                 "memory vs torch"],
          {"final test accuracy": lambda v: f"{100 * v:.2f} %", "vs torch": lambda v: f"{v:+.2f} pp",
           "epoch time": lambda r: (f"{r.median_epoch_time_s:.1f} s "
                                    f"({min(r.epoch_times_s):.1f}–{max(r.epoch_times_s):.1f})"),
           "time vs torch": ratio, "peak memory": mib, "memory vs torch": ratio})
    display(Markdown(
        f"{settings['dataset']}, model `{settings['model']}`, {settings['world_size']} processes, accumulation "
        f"{settings['accumulation_steps']}, {settings['epochs']} epochs, same seed and data order. Epoch time: the "
        f"median over the epochs, their range in brackets. **Like for like** ({like.label} against "
        f"{torch_run.label}): ddpkit's final accuracy is "
        f"{100 * (like.final_test_accuracy - torch_run.final_test_accuracy):+.2f} percentage points from torch's "
        f"(target within 0.5), its epoch time {like.median_epoch_time_s / torch_run.median_epoch_time_s:.2f}× and its "
        f"peak memory {like.peak_rss_bytes / torch_run.peak_rss_bytes:.2f}× torch's (targets ≤ 1.0×)."))
    for other in pipelines[2:]:
        micro_batches = other.optimizer_steps // settings["epochs"] * settings["accumulation_steps"]
        display(Markdown(
            f"**{other.label}** is a row of its own: torch has no SyncBatchNorm on CPU to compare it with. Against "
            f"ddpkit with plain BatchNorm, synchronizing the batch statistics costs "
            f"{other.median_epoch_time_s - like.median_epoch_time_s:+.1f} s per epoch ({micro_batches} micro-batches "
            f"per epoch, two all-reduces per BatchNorm layer each) and changes the final accuracy by "
            f"{100 * (other.final_test_accuracy - like.final_test_accuracy):+.2f} points."))


# ---------------------------------------------------------------------------------------------------------------
# 5. On a GPU


def gpu(R: dict) -> None:
    """The GPU results: CUDA SyncBatchNorm against torch's, DDP on CUDA, and the CPU all-reduce on the GPU machine's
    cores, each where its file is present; a sentence where there is no GPU result at all."""
    if "syncbn_cuda" not in R:
        display(Markdown("No GPU results in this results folder (`syncbn_cuda.json`, `ddp_cuda.json`)."))
    else:
        g = R["syncbn_cuda"]
        command(R, "syncbn_cuda")
        device = g["environment"]["gpu"]
        display(Markdown(f"GPU: {device['gpu_name']}, driver {device['gpu_driver']}, CUDA {device['cuda_version']}, "
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
        table(rows, ["world size", "shape", "ddpkit", "ddpkit (process_group)", "torch", "baseline", "ratio",
                     "memory ratio"],
              {"ddpkit": ms, "ddpkit (process_group)": ms, "torch": ms, "ratio": ratio,
               "memory ratio": lambda x: f"{x:.4f}×"})
    if "ddp_cuda" in R:
        command(R, "ddp_cuda")
        rows = [{"candidate": k, "time / torch DDP": v["time_ratio"], "memory / torch DDP": v["memory_ratio"]}
                for k, v in R["ddp_cuda"]["summary"].items()]
        table(rows, ["candidate", "time / torch DDP", "memory / torch DDP"],
              {"time / torch DDP": ratio, "memory / torch DDP": ratio})
    if "allreduce_16core" in R:
        c = R["allreduce_16core"]
        command(R, "allreduce_16core")
        env = c["environment"]
        display(Markdown(f"**CPU all-reduce on the GPU machine's cores**, not this report's machine: "
                         f"{env['cpu_model']}, {env['cpu_count']} cores (the machine lent with the "
                         f"{env['gpu']['gpu_name']}). Every rank has a core of its own up to 16 ranks, where the other "
                         "CPU tables share 2. ddpkit (shared memory), gloo, the memory floor and MPICH's "
                         "`MPI_Allreduce`, float32, median of the slowest rank."))
        med = {(r.world_size, r.numel, r.candidate): r.median_s for r in c["records"]
               if r.kind == "time" and r.median_s}
        rows = []
        for n, numel in sorted({(n, numel) for n, numel, _ in med}):
            row = {"n": n, "floats": numel, **{k: med.get((n, numel, k)) for k in ("ddpkit", "gloo", "mpich", "floor")}}
            if row["ddpkit"] and row["gloo"]:
                row["ddpkit / gloo"] = row["ddpkit"] / row["gloo"]
            if row["ddpkit"] and row["mpich"]:
                row["ddpkit / MPICH"] = row["ddpkit"] / row["mpich"]
            rows.append(row)
        table(rows, ["n", "floats", "ddpkit", "gloo", "mpich", "floor", "ddpkit / gloo", "ddpkit / MPICH"],
              {"ddpkit": call_time, "gloo": call_time, "mpich": call_time, "floor": call_time,
               "ddpkit / gloo": ratio, "ddpkit / MPICH": ratio})


# ---------------------------------------------------------------------------------------------------------------
# 6. The "ddpkit" torch.distributed backend


def backend(R: dict) -> None:
    """torch.distributed's collectives on gloo and on the "ddpkit" backend, and ddpkit's own functions (table and
    plots); then, where measured, the layers of one all-reduce and torch's DDP on both backends."""
    b = R["backend"]
    command(R, "backend")
    coll = [r for r in b["records"] if r.kind == "collective"]
    by = {(r.collective, r.world_size, r.numel, r.candidate): r for r in coll}
    rows = []
    for (collective, n, numel, candidate), r in sorted(by.items()):
        if candidate != "backend":
            continue
        gloo, own = by[(collective, n, numel, "gloo")], by[(collective, n, numel, "ddpkit")]
        rows.append({"collective": collective, "n": n, "size": numel, "gloo": gloo.median_s,
                     "backend": r.median_s, "ddpkit": own.median_s, "backend / gloo": r.median_s / gloo.median_s,
                     "backend / ddpkit": r.median_s / own.median_s, "busbw backend": r.busbw_GBps})
    table(rows, ["collective", "n", "size", "gloo", "backend", "ddpkit", "backend / gloo", "backend / ddpkit",
                 "busbw backend"],
          {"gloo": us, "backend": us, "ddpkit": us, "backend / gloo": ratio, "backend / ddpkit": ratio,
           "busbw backend": lambda v: f"{v:.2f} GB/s"})
    fig, axes = plt.subplots(1, 3, figsize=(15, 4), sharey=True)
    for ax, collective in zip(axes, ["all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor"]):
        for n in sorted({r.world_size for r in coll}):
            sizes = sorted({r.numel for r in coll if r.world_size == n and r.collective == collective})
            for candidate, style in (("gloo", "--"), ("backend", "-")):
                ax.loglog(sizes, [by[(collective, n, s, candidate)].median_s for s in sizes], style, marker="o",
                          label=f"{candidate} n={n}")
        ax.set_title(collective)
        ax.set_xlabel("floats")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("seconds per call (median, slowest rank)")
    axes[0].legend()
    plt.show()
    layers = [r for r in b["records"] if r.kind == "layers"]
    if layers:
        display(Markdown("One all-reduce through each layer, 2 processes: where the time above `ddpkit.all_reduce` "
                         "goes."))
        table([{"layer": r.layer, "size": r.numel, "time per call": r.median_s} for r in layers],
              ["layer", "size", "time per call"], {"time per call": us_tenths})
    steps = [r for r in b["records"] if r.kind == "ddp"]
    if steps:
        base = {(r.model, r.accumulation): r for r in steps if r.candidate == "torch_gloo"}
        floor = {(r.model, r.accumulation): r.median_step_s for r in steps if r.candidate == "floor"}
        rows = [{"model": r.model, "accumulation": r.accumulation,
                 "torch DDP on gloo": base[(r.model, r.accumulation)].median_step_s, "on ddpkit": r.median_step_s,
                 "no communication": floor.get((r.model, r.accumulation)),
                 "time ratio": r.median_step_s / base[(r.model, r.accumulation)].median_step_s,
                 "memory ratio": r.peak_memory_bytes / base[(r.model, r.accumulation)].peak_memory_bytes}
                for r in steps if r.candidate == "torch_ddpkit"]
        table(rows, ["model", "accumulation", "torch DDP on gloo", "on ddpkit", "no communication", "time ratio",
                     "memory ratio"],
              {"torch DDP on gloo": ms, "on ddpkit": ms, "no communication": ms, "time ratio": ratio,
               "memory ratio": ratio})
        display(Markdown("Median step of torch's DDP (2 processes) on each backend, and of the same steps without "
                         "any gradient communication (`no communication`: the least a backend can reach)."))
        floor_text = below_floor(steps, names={"torch_ddpkit": "torch DDP on ddpkit",
                                               "torch_gloo": "torch DDP on gloo"})
        if floor_text:
            display(Markdown(floor_text))


# ---------------------------------------------------------------------------------------------------------------
# 7. Across hosts

MULTIHOST_HOSTS = {"2x2": "2 hosts × 2 ranks", "2x1": "2 hosts × 1 rank"}
MULTIHOST_LINKS = {"unshaped": "unshaped link", "10gbit": "10 Gbit/s", "1gbit": "1 Gbit/s"}
# The targets for ddpkit's time over gloo's, by (hosts x ranks, link) and size (None: no target there);
# 2 hosts x 1 rank's target, 1.0 everywhere, is the gloo line itself.
MULTIHOST_TARGETS = {("2x2", "unshaped"): lambda n: 0.5 if n >= 16_000_000 else 0.6,
                     ("2x2", "1gbit"): lambda n: 0.75 if n >= 1_000_000 else None}
MULTIHOST_STYLE = {"ddpkit": dict(color="tab:red", linewidth=2.5), "ddpkit_flat": dict(color="tab:blue"),
                   "ddpkit_backend": dict(color="tab:green", linestyle="-.")}


@dataclass(frozen=True)
class Multihost:
    """The records of a multihost result, as its plots and tables read them."""

    reduces: list  # all-reduce records
    collectives: list  # the other collectives' records (a run may measure them alone: --collectives)
    steps: list  # DDP step records
    topologies: list  # of the settings', those measured, in the settings' order
    links: list  # likewise
    others: list  # the candidates other than gloo
    by_point: dict  # (topology, link, numel, candidate) -> all-reduce record


def multihost_records(document: dict) -> Multihost:
    """The :class:`Multihost` of a multihost results document."""
    records, settings = document["records"], document["settings"]
    reduces = [r for r in records if r.kind == "multihost_all_reduce"]
    collectives = [r for r in records if r.kind == "multihost_collective"]
    measured = reduces + collectives
    return Multihost(
        reduces=reduces, collectives=collectives, steps=[r for r in records if r.kind == "multihost_ddp"],
        topologies=[t for t in settings["topologies"] if any(r.topology == t for r in measured)],
        links=[link for link in settings["links"] if any(r.link == link for r in measured)],
        others=[c for c in settings["candidates"] if c != "gloo"],
        by_point={(r.topology, r.link, r.numel, r.candidate): r for r in reduces})


def multihost_target(topology: str, link: str, numel: int) -> float | None:
    """The target for ddpkit's all-reduce time over gloo's at a point, or None where the issue sets none."""
    goal = MULTIHOST_TARGETS.get((topology, link))
    return goal(numel) if goal else None


def multihost(R: dict) -> None:
    """Across hosts: the all-reduce candidates over gloo by topology and link (plot and table), the other
    collectives, and the DDP step; a sentence where the folder has no multihost.json."""
    if "multihost" not in R:
        display(Markdown("No `multihost.json` in this results folder, so nothing across hosts is shown: "
                         "`sudo .venv/bin/python benchmarks/bench_multihost.py` measures it (as root: its hosts are "
                         "namespaces)."))
        return
    command(R, "multihost")
    m = multihost_records(R["multihost"])
    if m.reduces:
        _multihost_all_reduce(m)
    if m.collectives:
        _multihost_collectives(m)
    if m.steps:
        names = {"ddpkit_ddp": "ddpkit's DDP (on the gloo group)", "torch_ddp_gloo": "torch DDP on gloo",
                 "torch_ddp_ddpkit": "torch DDP on the \"ddpkit\" backend"}
        table([{"hosts × ranks": r.topology, "link": r.link, "candidate": names.get(r.candidate, r.candidate),
                "median step": r.median_s, "p25–p75": f"{ms(r.p25_s)}–{ms(r.p75_s)}", "reps": r.reps,
                "/ torch DDP on gloo": r.ratio_to_torch_ddp_gloo} for r in m.steps],
              ["hosts × ranks", "link", "candidate", "median step", "p25–p75", "reps", "/ torch DDP on gloo"],
              {"median step": ms, "/ torch DDP on gloo": ratio})
        display(Markdown("One DDP training step (forward, backward with its gradient all-reduces, SGD step), the "
                         "slowest rank's, median over the repetitions."))
    else:
        display(Markdown("No DDP step across hosts in this file."))


def _multihost_all_reduce(m: Multihost) -> None:
    # The all-reduce's panels (topology × link) with the targets, then its table with the CPU the points kept busy.
    fig, axes = plt.subplots(len(m.topologies), len(m.links), figsize=(4.6 * len(m.links), 3.4 * len(m.topologies)),
                             sharex=True, sharey=True, squeeze=False)
    for row, topology in zip(axes, m.topologies):
        for ax, link in zip(row, m.links):
            panel = [r for r in m.reduces if r.topology == topology and r.link == link]
            for c in m.others:
                points = sorted((r.numel, r.ratio_to_gloo) for r in panel if r.candidate == c)
                if points:
                    ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", markersize=4, label=c,
                            **MULTIHOST_STYLE.get(c, {}))
            ax.axhline(1.0, color="black", linestyle="--", linewidth=1.2, label="gloo (1.0)")
            goals = sorted((r.numel, multihost_target(topology, link, r.numel)) for r in panel
                           if r.candidate == "ddpkit")
            goals = [g for g in goals if g[1] is not None]
            if goals:
                ax.plot([g[0] for g in goals], [g[1] for g in goals], linestyle=":", color="gray", marker="_",
                        markersize=14, drawstyle="steps-post", label="target for ddpkit")
            ax.set_xscale("log")
            ax.grid(True, which="both", alpha=0.3)
            ax.set_title(f"{MULTIHOST_HOSTS.get(topology, topology)}, {MULTIHOST_LINKS.get(link, link)}"
                         + ("" if panel else ": not measured"), fontsize=10)
    axes[0][0].set_ylim(0, 1.08 * max([1.0, *(r.ratio_to_gloo for r in m.reduces)]))  # the axes share it
    for ax in axes[-1]:
        ax.set_xlabel("floats (float32)")
    for row in axes:
        row[0].set_ylabel("time / gloo's (median)")
    legend = figure_legend(axes.flat)
    fig.legend(legend.values(), legend.keys(), loc="upper center", ncol=len(legend), fontsize=9,
               bbox_to_anchor=(0.5, 1.0))
    plt.tight_layout(rect=(0, 0, 1, 0.93))
    plt.show()
    rows = []
    for topology in m.topologies:
        for link in m.links:
            for numel in sorted({r.numel for r in m.reduces if r.topology == topology and r.link == link}):
                gloo = m.by_point.get((topology, link, numel, "gloo"))
                row = {"hosts × ranks": topology, "link": link, "floats": floats(numel),
                       "gloo": gloo.median_s if gloo else None}
                for c in m.others:
                    r = m.by_point.get((topology, link, numel, c))
                    row[c] = r.ratio_to_gloo if r else None
                backend_point = m.by_point.get((topology, link, numel, "ddpkit_backend"))
                own = m.by_point.get((topology, link, numel, "ddpkit"))
                row["backend / ddpkit"] = backend_point.median_s / own.median_s if backend_point and own else None
                busy = [r.cpu_busy for r in (own, gloo) if r is not None and r.cpu_busy is not None]
                row["CPUs busy: ddpkit, gloo"] = " / ".join(f"{b:.0%}" for b in busy) if len(busy) == 2 else None
                row["reps"] = gloo.reps if gloo else None
                rows.append(row)
    cpu_column = ["CPUs busy: ddpkit, gloo"] if any(row["CPUs busy: ddpkit, gloo"] for row in rows) else []
    table(rows, ["hosts × ranks", "link", "floats", "gloo", *m.others, "backend / ddpkit", *cpu_column, "reps"],
          {"gloo": step_time, **{c: ratio for c in m.others}, "backend / ddpkit": ratio})
    display(Markdown("`gloo`: its time per call (median); the candidates' columns: their time over gloo's; "
                     "`backend / ddpkit`: the \"ddpkit\" backend's time over `ddpkit.all_reduce`'s, the cost of going "
                     "through torch's API. `CPUs busy`: the CPU time all ranks' processes spent per call (every "
                     "thread, kernel time included), over the slowest rank's time × this machine's cores, for "
                     "`ddpkit` and `gloo`. Near 100%, a point was bound by the cores the simulated hosts share, not "
                     "by its link: there every CPU-microsecond a candidate or torch's own call path spends adds to "
                     "its time."))


def _multihost_collectives(m: Multihost) -> None:
    # The other collectives' table: gloo's time, the candidates' over it.
    points = {(r.collective, r.topology, r.link, r.numel, r.candidate): r for r in m.collectives}
    rows = []
    for collective in dict.fromkeys(r.collective for r in m.collectives):
        for topology in m.topologies:
            for link in m.links:
                for numel in sorted({r.numel for r in m.collectives
                                     if (r.collective, r.topology, r.link) == (collective, topology, link)}):
                    gloo = points.get((collective, topology, link, numel, "gloo"))
                    row = {"collective": collective, "hosts × ranks": topology, "link": link,
                           "floats": floats(numel), "gloo": gloo.median_s if gloo else None}
                    for c in m.others:
                        r = points.get((collective, topology, link, numel, c))
                        row[c] = r.ratio_to_gloo if r else None
                    rows.append(row)
    present = [c for c in m.others if any(c in row and row[c] is not None for row in rows)]
    table(rows, ["collective", "hosts × ranks", "link", "floats", "gloo", *present],
          {"gloo": step_time, **{c: ratio for c in present}})
    display(Markdown("The other collectives across hosts: `gloo`, its time per call (median); the candidates' "
                     "columns, their time over gloo's (`ddpkit_flat`: `transport=\"process_group\"`, ddpkit's "
                     "schedules over gloo's send/recv that ignore the hosts)."))


def target_row(text: str, points: dict, limit: float, expected=()) -> dict:
    """A row of the targets' table: ``points`` maps where (a label) to the ratio measured there; ``expected``: the
    points the target names, those absent listed as not measured. Its result is decided by the largest ratio:
    "met", "not met", or "not measured" where ``points`` is empty."""
    missing = [p for p in expected if p not in points]
    worst = max(points, key=points.get) if points else None
    result = "not measured" if not points else "met" if points[worst] <= limit else "not met"
    return {"target": text, "limit": limit, "worst": f"{points[worst]:.2f}× ({worst})" if points else "",
            "measured at": ", ".join(points) or "—", "not measured at": ", ".join(missing), "result": result}


def _ratios(m: Multihost, topology: str, link: str | None, candidate: str, low=0, high=float("inf")) -> dict:
    # {where: time / gloo's} of one candidate's all-reduces from low to high floats; link None: every link.
    chosen = sorted((r for r in m.reduces if r.topology == topology and r.candidate == candidate
                     and (link is None or r.link == link) and low <= r.numel <= high),
                    key=lambda r: (m.links.index(r.link), r.numel))
    return {(floats(r.numel) if link else f"{r.link} {floats(r.numel)}"): r.ratio_to_gloo for r in chosen}


def multihost_targets(R: dict) -> None:
    """The issue's targets across hosts against the multihost result (table and count), and what the missed
    points' own figures (their CPU) say; nothing where the folder has no multihost.json."""
    if "multihost" not in R:
        return
    m = multihost_records(R["multihost"])
    sizes = [floats(n) for n in (1_000, 100_000, 1_000_000, 16_000_000)]  # the sizes the targets name
    own = {r.numel: r.median_s for r in m.reduces if (r.topology, r.link, r.candidate) == ("2x2", "unshaped", "ddpkit")}
    backend_over_own = {floats(r.numel): r.median_s / own[r.numel] for r in m.reduces
                        if (r.topology, r.link, r.candidate) == ("2x2", "unshaped", "ddpkit_backend")
                        and r.numel in own}
    steps = {r.candidate: r.ratio_to_torch_ddp_gloo for r in m.steps if r.topology == "2x2"}
    rows = [
        target_row("2 hosts × 2 ranks, unshaped: <code>ddpkit</code> ≤ 0.6× gloo at every size from 1k to 16M floats",
                   _ratios(m, "2x2", "unshaped", "ddpkit", 1_000, 16_000_000), 0.6, sizes),
        target_row("2 hosts × 2 ranks, unshaped: <code>ddpkit</code> ≤ 0.5× gloo at 16M floats",
                   _ratios(m, "2x2", "unshaped", "ddpkit", 16_000_000, 16_000_000), 0.5, sizes[-1:]),
        target_row("2 hosts × 2 ranks, unshaped: the \"ddpkit\" backend within 1.1× of <code>ddpkit.all_reduce</code> "
                   "(the backend's time over ddpkit's own)", backend_over_own, 1.1, sizes),
        target_row("2 hosts × 1 rank: <code>ddpkit</code> ≤ 1.0× gloo everywhere (every link, every size)",
                   _ratios(m, "2x1", None, "ddpkit"), 1.0),
        target_row("2 hosts × 2 ranks at 1 Gbit/s: <code>ddpkit</code> ≤ 0.75× gloo from 1M floats up",
                   _ratios(m, "2x2", "1gbit", "ddpkit", 1_000_000), 0.75, sizes[2:]),
        target_row("DDP step across 2 hosts × 2 ranks: ddpkit's DDP ≤ 0.8× torch DDP on gloo",
                   {"step": steps["ddpkit_ddp"]} if "ddpkit_ddp" in steps else {}, 0.8),
        target_row("DDP step across 2 hosts × 2 ranks: torch DDP on the \"ddpkit\" backend ≤ 0.85× torch DDP on gloo",
                   {"step": steps["torch_ddp_ddpkit"]} if "torch_ddp_ddpkit" in steps else {}, 0.85),
    ]
    partial = any(r["not measured at"] for r in rows)
    table(rows, ["target", "worst", "measured at", *(["not measured at"] if partial else []), "result"])
    count = collections.Counter(r["result"] for r in rows)
    lines = [f"The issue's targets against these figures (<code>worst</code>: the largest ratio among the points a "
             f"target covers, the one that decides it): **{count['met']} of {len(rows)} met**, {count['not met']} not "
             "met" + (f", {count['not measured']} not measured in this file" if count["not measured"] else "") + "."]
    lines += [f"- Not met: {r['target']}: {r['worst']}." for r in rows if r["result"] == "not met"]
    lines += [f"- Judged on part of its points only: {r['target']} (not measured at {r['not measured at']})."
              for r in rows if r["not measured at"] and r["result"] != "not measured"]
    display(Markdown(lines[0] + "\n\n" + "\n".join(lines[1:])))
    why = _multihost_misses(m, own)
    if why:
        display(Markdown("The missed points' own figures:\n\n" + "\n".join(why)))


def _multihost_misses(m: Multihost, own: dict) -> list[str]:
    # What the missed points' own figures say: their CPU (files written before bench_multihost measured it lack it).
    why = []
    for numel in sorted(own):
        backend_point, mine = (m.by_point.get(("2x2", "unshaped", numel, c)) for c in ("ddpkit_backend", "ddpkit"))
        if (backend_point and mine and backend_point.median_s > 1.1 * mine.median_s
                and backend_point.cpu_busy is not None):
            extra = (backend_point.all_ranks_cpu_s - mine.all_ranks_cpu_s) / 4  # 2 hosts x 2 ranks
            why.append(f"- The backend at 2 hosts × 2 ranks, {floats(numel)}: "
                       f"{backend_point.median_s / mine.median_s:.2f}× `ddpkit.all_reduce`'s time. Each rank's call "
                       f"through torch's API spent {us(extra)} more CPU than `ddpkit.all_reduce`'s, with the cores "
                       f"{backend_point.cpu_busy:.0%} busy: the 4 ranks share 2 cores, so what a call costs in CPU "
                       "adds to its time.")
    for r in m.reduces:
        gloo = m.by_point.get((r.topology, r.link, r.numel, "gloo"))
        goal = multihost_target(r.topology, r.link, r.numel)
        if (r.candidate == "ddpkit" and goal is not None and r.ratio_to_gloo > goal and gloo
                and r.cpu_busy is not None and gloo.cpu_busy is not None):
            why.append(f"- {MULTIHOST_HOSTS.get(r.topology, r.topology)}, {MULTIHOST_LINKS.get(r.link, r.link)}, "
                       f"{floats(r.numel)}: {r.ratio_to_gloo:.2f}× (target {goal}×; gloo {ms(gloo.median_s)}, "
                       f"p25–p75 {ms(gloo.p25_s)}–{ms(gloo.p75_s)}). All ranks spent {ms(r.all_ranks_cpu_s)} of CPU "
                       f"per call against gloo's {ms(gloo.all_ranks_cpu_s)} "
                       f"({r.all_ranks_cpu_s / gloo.all_ranks_cpu_s:.2f}×), the cores {r.cpu_busy:.0%} and "
                       f"{gloo.cpu_busy:.0%} busy: where the cores bound both, the time follows the CPU.")
        if (r.topology, r.candidate) == ("2x1", "ddpkit") and r.ratio_to_gloo > 1.0 and gloo and r.cpu_busy is not None:
            text = (f"- 2 hosts × 1 rank, {MULTIHOST_LINKS.get(r.link, r.link)}, {floats(r.numel)}: "
                    f"{r.ratio_to_gloo:.3f}× ({ms(r.median_s)} against gloo's {ms(gloo.median_s)}), the cores "
                    f"{r.cpu_busy:.0%} and {gloo.cpu_busy:.0%} busy")
            rate = {"10gbit": 10e9, "1gbit": 1e9}.get(r.link)
            if rate:  # an all-reduce between two ranks moves the whole vector each way, whatever its schedule
                line = r.numel * 4 * 8 / rate
                text += (f"; {4 * r.numel / 1e6:g} MB each way take {ms(line)} at the link's rate: ddpkit "
                         f"{r.median_s / line - 1:+.1%}, gloo {gloo.median_s / line - 1:+.1%} above it")
            why.append(text + ".")
    return why


# ---------------------------------------------------------------------------------------------------------------
# 8. torch's own stack on the ddpkit backend

TORCH_STACK_TARGETS = {"fsdp2": 0.6, "tp_mlp": 0.5}  # the targets for ddpkit's step over gloo's


def torch_stack(R: dict) -> None:
    """torch's FSDP2, DDP hooks and tensor parallelism on the ddpkit backend against gloo (table), each workload's
    target in words, and the largest parameter difference; a sentence where the folder has no torch_stack.json."""
    if "torch_stack" not in R:
        display(Markdown("No `torch_stack.json` in this results folder, so torch's FSDP2, DDP hooks and tensor "
                         "parallelism on the ddpkit backend are not shown: `.venv/bin/python "
                         "benchmarks/bench_torch_stack.py` measures them."))
        return
    command(R, "torch_stack")
    T = R["torch_stack"]
    targets = TORCH_STACK_TARGETS
    by = {(r.workload, r.world_size, r.candidate): r for r in T["records"]}
    rows = []
    for (workload, n, candidate), r in by.items():
        g, floor = by.get((workload, n, "gloo")), by.get((workload, n, "floor"))
        if candidate != "ddpkit" or g is None:
            continue
        rows.append({"workload": workload, "n": n, "model": r.model, "batch per rank": r.batch_per_rank,
                     "gloo step": g.median_step_s, "ddpkit step": r.median_step_s,
                     "ddpkit / gloo": r.median_step_s / g.median_step_s,
                     "target": f"≤ {targets[workload]}×" if workload in targets else "",
                     "floor step": floor.median_step_s if floor else None,
                     "floor / gloo": floor.median_step_s / g.median_step_s if floor else None,
                     "gloo memory": g.peak_rss_increase_bytes, "ddpkit memory": r.peak_rss_increase_bytes,
                     "memory ddpkit / gloo": (r.peak_rss_increase_bytes / g.peak_rss_increase_bytes
                                              if r.peak_rss_increase_bytes is not None and g.peak_rss_increase_bytes
                                              else None),
                     "max |param diff|": r.max_param_diff_vs_gloo})
    table(rows, ["workload", "n", "model", "batch per rank", "gloo step", "ddpkit step", "ddpkit / gloo", "target",
                 "floor step", "floor / gloo", "gloo memory", "ddpkit memory", "memory ddpkit / gloo",
                 "max |param diff|"],
          {"gloo step": step_time, "ddpkit step": step_time, "ddpkit / gloo": ratio, "floor step": step_time,
           "floor / gloo": ratio, "gloo memory": mib, "ddpkit memory": mib, "memory ddpkit / gloo": ratio,
           "max |param diff|": lambda v: f"{v:.1e}"})
    display(Markdown("`n`: processes. Steps: median of the slowest rank. Memory (FSDP2 only): the peak resident "
                     "memory's increase over the processes' memory before the model was built, the largest over "
                     "ranks, each backend alone."))
    lines = []
    fsdp = [row for row in rows if row["workload"] == "fsdp2"]
    missing = [n for n in (2, 4) if n not in {row["n"] for row in fsdp}]
    if fsdp:
        met = all(row["ddpkit / gloo"] <= targets["fsdp2"] for row in fsdp)
        lines.append(
            f"**FSDP2** (target ≤ {targets['fsdp2']}× gloo at 2 and 4 processes): "
            + ", ".join(f"{row['ddpkit / gloo']:.2f}× at {row['n']}" for row in fsdp)
            + f" — {'met' if met else 'not met'}"
            + (f" where measured (not measured at {', '.join(map(str, missing))} processes)" if missing else "")
            + "." + "".join(f" Memory at {row['n']}: {row['memory ddpkit / gloo']:.2f}× gloo's."
                            for row in fsdp if row["memory ddpkit / gloo"] is not None))
    else:
        lines.append("**FSDP2**: not measured in this file.")
    for row in (row for row in rows if row["workload"] == "tp_mlp"):
        limit = targets["tp_mlp"]
        text = (f"**Tensor-parallel MLP** at {row['n']} processes (target ≤ {limit}× gloo): "
                f"{row['ddpkit / gloo']:.2f}× — {'met' if row['ddpkit / gloo'] <= limit else 'not met'}.")
        if row["floor / gloo"] is not None:
            gloo_s, ddpkit_s, floor_s = row["gloo step"], row["ddpkit step"], row["floor step"]
            text += (f" The floor, the same step on a mesh of one rank with no communication at all, takes "
                     f"{row['floor / gloo']:.2f}× gloo's step ({step_time(floor_s)} of {step_time(gloo_s)})")
            if row["floor / gloo"] > limit:
                text += (": above the target, so no backend can reach it. Most of the step is not communication but "
                         "the model's own work and DTensor's dispatch in Python, which run the same on any backend.")
            else:
                text += ": below the target, so a backend could reach it."
            if gloo_s > floor_s:
                text += (f" Of what communicating adds to the step over gloo ({step_time(gloo_s - floor_s)}), ddpkit "
                         f"saves {100 * (gloo_s - ddpkit_s) / (gloo_s - floor_s):.0f} %.")
        lines.append(text)
    others = [row for row in rows if row["workload"] not in targets]
    if others:
        lines.append("Without a target: " + ", ".join(f"{row['workload']} {row['ddpkit / gloo']:.2f}× gloo at "
                                                      f"{row['n']} processes" for row in others) + ".")
    diff = max(r.max_param_diff_vs_gloo for r in T["records"] if r.candidate == "ddpkit")
    lines.append(f"Every ddpkit copy agreed with gloo's before timing: largest difference {diff:.1e}.")
    display(Markdown("\n\n".join(lines)))


# ---------------------------------------------------------------------------------------------------------------
# torch's distributed test suite on both backends (docs/torch_suite.json, not a result of the results folder)

DIFFERENCE_CAUSES = {"torch": "torch's own code", "ddpkit bug": "a ddpkit bug", "unclassified": "not yet read"}


def code_html(text: str) -> str:
    """``text`` escaped for HTML, its `backquoted` spans as <code>."""
    return re.sub(r"`([^`]*)`", r"<code>\1</code>", escape(text))


def skip_reason(summary: str) -> str:
    """The kind of reason a skipped test's summary gives: "CUDA", "NCCL or MPI only", "another world size",
    "disabled upstream" (torch's own skip: an issue or a flaky test) or "other"."""
    text = summary.lower()
    return ("CUDA" if "cuda" in text else "NCCL or MPI only" if "nccl" in text or "mpi" in text
            else "another world size" if "world size" in text
            else "disabled upstream" if "github.com/pytorch" in text or "flak" in text or "failing" in text
            else "other")


def _passed(run: dict, name: str) -> bool:
    return run.get(name, {}).get("outcome") == "passed"


def torch_suite(path: Path = REPO / SUITE) -> None:
    """torch's own distributed test suite on gloo and on "ddpkit" (``path``: scripts/run_torch_suite.py's JSON):
    its counts per backend, each test that passes on one backend only with its recorded reason, the flaky ones, and
    the skips by reason; a sentence where the file is absent."""
    shown = path.relative_to(REPO) if path.is_relative_to(REPO) else path
    if not path.exists():
        display(Markdown(f"No `{shown}`, so torch's own distributed test suite on the ddpkit backend is not "
                         "summarised here: `.venv/bin/python scripts/run_torch_suite.py` runs it."))
        return
    suite = json.loads(path.read_text())
    display(Markdown(
        f"**torch's own distributed test suite** (`torch.testing._internal.distributed.distributed_test`, "
        f"{suite['tests']} tests, {suite['world_size']} processes), run on gloo and on \"ddpkit\" one after the other "
        f"by `.venv/bin/python scripts/run_torch_suite.py` on {minute(suite['date'])} UTC, at commit "
        f"`{suite['git_commit']}` (ddpkit built from `{suite['ddpkit_commit']}`), torch {suite['torch_version']}. "
        f"Every outcome is in `{shown}`, the differences also in `docs/torch_suite.md`."))
    runs = suite["runs"]
    table([{"backend": name, "tests": len(run["records"]), "passed": run["counts"].get("passed", 0),
            "failed or error": run["counts"].get("failed", 0) + run["counts"].get("error", 0),
            "skipped": run["counts"].get("skipped", 0), "run time": run["seconds"]} for name, run in runs.items()],
          ["backend", "tests", "passed", "failed or error", "skipped", "run time"],
          {"run time": lambda s: f"{s / 60:.1f} min"})
    gloo_runs, ddpkit_runs = runs["gloo"]["records"], runs["ddpkit"]["records"]
    only_gloo = sorted(name for name in gloo_runs if _passed(gloo_runs, name) and not _passed(ddpkit_runs, name))
    only_ddpkit = sorted(name for name in ddpkit_runs if _passed(ddpkit_runs, name) and not _passed(gloo_runs, name))
    reasons = {d["test"]: d for d in suite["differences"]}
    display(Markdown(
        f"gloo passes {sum(_passed(gloo_runs, n) for n in gloo_runs)} tests and \"ddpkit\" "
        f"{sum(_passed(ddpkit_runs, n) for n in ddpkit_runs)}: {len(only_gloo)} pass on gloo only"
        + (f", {len(only_ddpkit)} on \"ddpkit\" only" if only_ddpkit else ", none on \"ddpkit\" only") + "."
        + (" Each test gloo passes and \"ddpkit\" does not, with its reason:" if only_gloo else "")))
    if only_gloo:
        table([{"test": f"<code>{name}</code>",
                "on ddpkit": f"{ddpkit_runs.get(name, {}).get('outcome', 'not run')}: "
                             f"<code>{escape(ddpkit_runs.get(name, {}).get('summary', ''))}</code>",
                "why": code_html(reasons.get(name, {}).get("reason", "no reason recorded")),
                "cause": DIFFERENCE_CAUSES.get(reasons.get(name, {}).get("kind"),
                                               reasons.get(name, {}).get("kind", "—"))}
               for name in only_gloo], ["test", "on ddpkit", "why", "cause"])
    if only_ddpkit:
        table([{"test": f"<code>{name}</code>", "on gloo": f"{gloo_runs.get(name, {}).get('outcome', 'not run')}: "
                f"<code>{escape(gloo_runs.get(name, {}).get('summary', ''))}</code>"} for name in only_ddpkit],
              ["test", "on gloo"])
    if suite.get("flaky"):
        display(Markdown("Failed once and passed when run again (the machine was shared while the suite ran): "
                         + ", ".join(f"`{f['test']}` on {f['backend']}" for f in suite["flaky"]) + "."))
    both = [gloo_runs[n]["summary"] for n in gloo_runs
            if gloo_runs[n]["outcome"] == "skipped" and ddpkit_runs.get(n, {}).get("outcome") == "skipped"]
    kinds = collections.Counter(map(skip_reason, both))
    display(Markdown(
        f"Skipped on both backends: {len(both)} tests, by the reason the suite gives: "
        + ", ".join(f"{kind} {count}" for kind, count in kinds.most_common())
        + " (\"disabled upstream\": torch's own skip, an issue or a flaky test). `tests/test_torch_suite.py` runs "
        "every test gloo passes on \"ddpkit\"."))


# ---------------------------------------------------------------------------------------------------------------
# 9. Training that survives a lost replica: torchft

FT_CANDIDATES = {"torchft-gloo": "torchft on gloo", "torchft-ddpkit": "torchft on ddpkit",
                 "torchft-floor": "no communication (ProcessGroupDummy)", "torchrun-restart": "torchrun --max-restarts"}
FT_WRAPPERS = {"torchft-ddp": "torchft's DDP", "torchft-ddp-async": "torchft's DDP, ddpkit.torchft's hook",
               "ddpkit-ddp": "ddpkit's DDP, the manager's hook"}
FT_STEADY_TARGET = 0.7  # torchft on ddpkit over torchft on gloo, torchft's DDP, the steady step


def _ft_median(runs: list, field: str) -> float | None:
    values = [getattr(r, field) for r in runs if r.failed is None and getattr(r, field) is not None]
    return statistics.median(values) if values else None


def fault_tolerance(R: dict) -> None:
    """torchft on gloo against torchft on ddpkit (fault_tolerance.json): the steady step against the floor, the
    kill's figures, and the timeline of the kill whose death-to-commit time is each group's median; a sentence
    where the folder has no fault_tolerance.json."""
    if "fault_tolerance" not in R:
        display(Markdown("No `fault_tolerance.json` in this results folder, so torchft is not shown: "
                         "`.venv/bin/python benchmarks/bench_fault_tolerance.py` measures it."))
        return
    command(R, "fault_tolerance")
    F = R["fault_tolerance"]
    records = F["records"]
    groups: dict = collections.defaultdict(list)
    for r in records:
        groups[(r.measure, r.wrapper, r.candidate)].append(r)
    gloo_name = FT_CANDIDATES["torchft-gloo"]
    others = [FT_CANDIDATES["torchft-ddpkit"], FT_CANDIDATES["torchft-floor"]]
    steady_rows = []
    for wrapper in dict.fromkeys(r.wrapper for r in records if r.measure == "steady"):
        row = {"wrapper": FT_WRAPPERS.get(wrapper, wrapper)}
        for candidate in ("torchft-gloo", "torchft-ddpkit", "torchft-floor"):
            row[FT_CANDIDATES[candidate]] = _ft_median(groups[("steady", wrapper, candidate)], "step_s")
        for name in others:
            row[f"{name} / gloo"] = row[name] / row[gloo_name] if row[name] and row[gloo_name] else None
        steady_rows.append(row)
    columns = ["wrapper", gloo_name] + [c for name in others for c in (name, f"{name} / gloo")]
    table(steady_rows, columns, {c: (ratio if c.endswith("/ gloo") else step_time) for c in columns[1:]})
    floor = next((r[f"{FT_CANDIDATES['torchft-floor']} / gloo"] for r in steady_rows
                  if r["wrapper"] == FT_WRAPPERS["torchft-ddp"]), None)
    display(Markdown(
        f"The steady step, median over {F['settings']['repeats']} repetitions of 2 replica groups training the "
        f"8.4M-parameter MLP. The issue's target is {FT_STEADY_TARGET}x gloo with torchft's DDP"
        + (f"; with no communication at all the step is {ratio(floor)} gloo's, the least any process group "
           "could reach here." if floor else ".")))
    kill_rows = []
    for (measure, wrapper, candidate), runs in groups.items():
        if measure != "kill":
            continue
        failed = sum(r.failed is not None for r in runs)
        kill_rows.append({"candidate": FT_CANDIDATES.get(candidate, candidate),
                          "wrapper": "ddpkit's DDP, no torchft" if candidate == "torchrun-restart"
                          else FT_WRAPPERS.get(wrapper, wrapper), "runs": f"{len(runs) - failed} of {len(runs)}",
                          "death → next commit": _ft_median(runs, "death_to_next_commit_s"),
                          "noticed": _ft_median(runs, "noticed_s"), "next quorum": _ft_median(runs, "next_quorum_s"),
                          "restart → first commit": _ft_median(runs, "restart_to_first_commit_s"),
                          "manager up → first commit": _ft_median(runs, "ready_to_first_commit_s"),
                          "steps lost": _ft_median(runs, "steps_lost")})
    seconds = lambda x: "—" if x is None else f"{x:.3f} s"  # noqa: E731
    table(kill_rows, ["candidate", "wrapper", "runs", "death → next commit", "noticed", "next quorum",
                      "restart → first commit", "manager up → first commit", "steps lost"],
          {c: seconds for c in ("death → next commit", "noticed", "next quorum", "restart → first commit",
                                "manager up → first commit")})
    display(Markdown(
        "One replica group of 3 SIGKILLed mid-run and restarted; medians over the repetitions that survived (a "
        "run that failed is counted in `runs`). `noticed`: the survivors' failed step ended; `next quorum`: the "
        "lighthouse formed the quorum of their next committed step; both in seconds after the kill."))
    _fault_tolerance_timeline(groups)


def _fault_tolerance_timeline(groups: dict) -> None:
    # The kill of each torchft group with ddpkit's DDP whose death-to-commit time is the median: every
    # replica's iterations around the kill, each its wait for the quorum then its step, committed or discarded.
    shown = []
    for candidate in ("torchft-gloo", "torchft-ddpkit"):
        runs = sorted((r for r in groups.get(("kill", "ddpkit-ddp", candidate), []) if r.failed is None
                       and r.timeline), key=lambda r: r.death_to_next_commit_s)
        if runs:
            shown.append((candidate, runs[(len(runs) - 1) // 2]))
    if not shown:
        return
    fig, axes = plt.subplots(len(shown), 1, figsize=(12, 1.6 + 1.1 * len(shown)), sharex=True, squeeze=False)
    for ax, (candidate, run) in zip(axes[:, 0], shown):
        for end, replica, _step, committed, _participants, quorum, start in run.timeline:
            if end > 1.0:
                continue
            ax.plot([max(start, -0.3), max(quorum, -0.3)], [replica, replica], color="lightgray", linewidth=6,
                    solid_capstyle="butt", label="iteration, waiting for its quorum")
            ax.plot([max(quorum, -0.3), end], [replica, replica], color="tab:green" if committed else "tab:red",
                    linewidth=6, solid_capstyle="butt",
                    label="iteration, committed" if committed else "iteration, discarded")
        ax.axvline(0, color="black", linestyle="--", linewidth=1, label="the kill")
        ax.set_yticks(sorted({row[1] for row in run.timeline}))
        ax.set_ylabel("replica")
        ax.set_title(f"{FT_CANDIDATES[candidate]}: death → next commit {run.death_to_next_commit_s:.3f} s",
                     fontsize=10)
    axes[-1, 0].set_xlabel("seconds after the kill")
    handles = [Line2D([], [], color="tab:green", linewidth=6, label="iteration, committed"),
               Line2D([], [], color="tab:red", linewidth=6, label="iteration, discarded"),
               Line2D([], [], color="lightgray", linewidth=6, label="iteration, waiting for its quorum"),
               Line2D([], [], color="black", linestyle="--", label="the kill")]
    for ax in axes[:, 0]:
        ax.legend(handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    plt.tight_layout()
    plt.show()
    display(Markdown(
        "Each replica's iterations from 0.3 s before the kill to 1 s after it, in the kill whose death-to-commit "
        "time is its group's median (ddpkit's DDP under the manager), each split into its wait for the quorum (gray) "
        "and its step: the survivors' step in flight fails as soon as the death is seen, and their next quorum "
        "waits for the lighthouse's heartbeat timeout on both groups."))
