"""1. All-reduce: the grid against gloo, the floor and the peers, its targets, spread, accuracy and memory; what
the collective checks cost; the layers of a small all-reduce's call path."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import matplotlib.pyplot as plt
from IPython.display import Markdown
from matplotlib.lines import Line2D

from .formatting import figure_legend, ratio, us, us_tenths
from .output import command, display, table

ALLREDUCE_STYLE = {
    "gloo": dict(color="black", linewidth=2.5),
    "floor": dict(color="gray", linestyle="--"),
    "ddpkit": dict(color="tab:red", linewidth=2.5),
}
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
        timed=timed,
        missing=[r for r in document["records"] if r.kind == "time" and not r.median_s],
        by={(r.world_size, r.numel, r.candidate): r for r in timed},
        sizes=sorted({r.numel for r in timed}),
        world_sizes=sorted({r.world_size for r in timed}),
        candidates=list(dict.fromkeys(r.candidate for r in timed)),
    )


def allreduce_time(R: dict) -> None:
    """The candidates of the all-reduce run and how each ran, then median time against size, one panel per world
    size (× on the points cut short by their time budget), and the points not measured."""
    command(R, "allreduce")
    A = R["allreduce"]
    grid = allreduce_grid(A)
    statuses = A["settings"].get("candidates", {})
    if statuses:
        table(
            [
                {"candidate": k, "status": v["status"], "how": v.get("launcher", v.get("install", ""))}
                for k, v in statuses.items()
            ],
            ["candidate", "status", "how"],
        )
        display(
            Markdown(
                f"ddpkit's default transport in this run: `{A['settings']['ddpkit_default_transport']}`"
                + (
                    ""
                    if A["settings"]["ddpkit_transport_argument"]
                    else " (this ddpkit had no `transport` argument: everything of ddpkit's ran over the process group)"
                )
                + "."
            )
        )
    columns = min(4, len(grid.world_sizes))
    panel_rows = -(-len(grid.world_sizes) // columns)
    fig, axes = plt.subplots(panel_rows, columns, figsize=(4.3 * columns, 3.3 * panel_rows), sharey=True, squeeze=False)
    colors = {c: ALLREDUCE_STYLE.get(c, {}).get("color", f"C{i}") for i, c in enumerate(grid.candidates)}
    for ax, ws in zip(axes.flat, grid.world_sizes):
        for c in grid.candidates:
            points = sorted(
                (r.numel, r.median_s, r.cut_off) for r in grid.timed if r.world_size == ws and r.candidate == c
            )
            if not points:
                continue
            ax.plot(
                [p[0] for p in points],
                [p[1] * 1e3 for p in points],
                marker="o",
                markersize=3,
                label=c,
                **{**ALLREDUCE_STYLE.get(c, {}), "color": colors[c]},
            )
            cut = [p for p in points if p[2]]
            if cut:
                ax.plot([p[0] for p in cut], [p[1] * 1e3 for p in cut], "x", color=colors[c], markersize=9, label=CUT)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(f"n = {ws} process{'es' if ws > 1 else ''}", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.set_xlabel("floats", fontsize=8)
    for ax in axes.flat[len(grid.world_sizes) :]:
        ax.axis("off")
    for row in axes:
        row[0].set_ylabel("median time (ms)")
    # One legend for the whole figure: a candidate may be missing from some panels (the peers run from n = 2 up).
    legend = figure_legend(axes.flat)
    if CUT in legend:  # one black × for the markers of every candidate
        legend[CUT] = Line2D([], [], marker="x", linestyle="", color="black", markersize=9)
    fig.legend(
        legend.values(), legend.keys(), loc="upper center", ncol=len(legend), fontsize=8, bbox_to_anchor=(0.5, 1.0)
    )
    plt.tight_layout(rect=(0, 0, 1, 0.95))
    plt.show()
    display(
        Markdown(
            "A × marks a point cut short by its time budget (fewer repetitions than planned). "
            + (
                f"Not measured: {', '.join(sorted({f'{r.candidate} n={r.world_size}' for r in grid.missing}))}."
                if grid.missing
                else ""
            )
        )
    )


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
    verdict = (
        "met"
        if met
        else "not met"
        if met is False or measured is None
        else "not checked: the run left out part of its grid"
    )
    lines = [
        f"**ddpkit / gloo** (table above; target ≤ 0.2 at n ∈ {{2, 4, 8}} × 1k–16M floats"
        f"{'' if measured is None else '; measured at ' + measured}): worst {worst:.2f}× — {verdict}."
        if worst is not None
        else "**ddpkit / gloo**: not measured."
    ]
    peers = summary["ddpkit_over_best_peer_n2"]
    if peers:
        lines.append(
            "**ddpkit / best of MPICH and DeepSpeed at n = 2**: "
            + ", ".join(
                f"{int(k.split('=')[1]):,} floats {v['ratio']:.2f}× ({v['best_peer']})" for k, v in peers.items()
            )
            + "."
        )
    floor = summary["ddpkit_over_floor_n2"]
    if floor:
        lines.append(
            "**ddpkit / floor at n = 2** (target ≤ 3 from 1M floats): "
            + ", ".join(f"{int(k.split('=')[1]):,} floats {v:.1f}×" for k, v in floor.items())
            + f" — {'met' if summary['ddpkit_over_floor_bar_met'] else 'not met'}."
        )
    cut = summary.get("cut_off_points")
    if cut:
        lines.append(
            f"Cut off by the time budget: {len(cut)} points ({', '.join(cut[:8])}{' …' if len(cut) > 8 else ''})."
        )
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
    display(
        Markdown(
            "Bus bandwidth in GB/s as nccl-tests define it: bytes / median time × 2(n−1)/n (none for the "
            "floor, which is no collective, nor at n = 1)."
        )
    )
    rows = []
    for ws in [2, 4, 8]:
        for numel in grid.sizes:
            for c in candidates:
                r = grid.by.get((ws, numel, c))
                if r:
                    rows.append(
                        {
                            "n": ws,
                            "floats": f"{numel:,}",
                            "candidate": c,
                            "p25": r.p25_s,
                            "median": r.median_s,
                            "p75": r.p75_s,
                            "reps": r.reps,
                            "cut off": r.cut_off,
                        }
                    )
    table(
        rows,
        ["n", "floats", "candidate", "p25", "median", "p75", "reps", "cut off"],
        {"p25": us, "median": us, "p75": us},
    )
    display(
        Markdown(
            "The spread between the 25th and 75th percentiles shows how much of each figure is scheduling: with more "
            "runnable processes than the 2 cores, a process waits out time slices of several ms, and implementations "
            "that busy-poll (MPICH, DeepSpeed) lose their cores to each other."
        )
    )


def allreduce_accuracy(R: dict) -> None:
    """The largest error of the mean by world size and candidate, over the sizes checked."""
    grid = allreduce_grid(R["allreduce"])
    rows = []
    for ws in grid.world_sizes:
        row = {"world size": ws}
        for c in grid.candidates:
            errors = [
                r.max_abs_error_of_mean
                for r in grid.timed
                if r.world_size == ws and r.candidate == c and r.max_abs_error_of_mean is not None
            ]
            row[c] = max(errors) if errors else None
        rows.append(row)
    measured = [c for c in grid.candidates if any(row[c] is not None for row in rows)]
    table(rows, ["world size"] + measured, {c: (lambda v: f"{v:.1e}") for c in measured})
    display(
        Markdown(
            "Accuracy of averaging: max |result − float64 mean| over the sizes checked, N(0, 1) float32 "
            "inputs (MPICH, DeepSpeed and gloo: the sum divided by n)."
        )
    )


def allreduce_memory(R: dict) -> None:
    """A plot: the peak memory increase of one all-reduce of the largest size measured, against world size."""
    memory = [r for r in R["allreduce"]["records"] if r.kind == "memory"]
    big = max(r.numel for r in memory)
    fig, ax = plt.subplots(figsize=(8, 4))
    for c in dict.fromkeys(r.candidate for r in memory):
        points = sorted(
            (r.world_size, r.peak_memory_increase_bytes) for r in memory if r.numel == big and r.candidate == c
        )
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
    display(
        Markdown(
            f"The collective checks (before any payload, the ranks exchange a small header naming the collective, so "
            f"that mismatched calls raise on every rank instead of hanging; on by default) cost a median "
            f"{statistics.median(values):.2f}× (range {min(values):.2f}–{max(values):.2f}×) over the same algorithm "
            "unchecked, on these latency-bound sizes."
        )
    )


def latency(R: dict) -> None:
    """The layers of a small all-reduce's call path and what each adds (latency.json), or a sentence where the
    folder has no latency.json."""
    if "latency" not in R:
        display(
            Markdown(
                "No `latency.json` in this results folder, so the layers of a small all-reduce's call path "
                "are not shown: `.venv/bin/python benchmarks/bench_latency.py` measures them."
            )
        )
        return
    command(R, "latency")
    L = R["latency"]
    sizes = sorted({r.numel for r in L["records"] if r.numel})
    rows = [
        {
            "layer": stage,
            **{
                f"{n:,} floats": next(
                    (r.median_s for r in L["records"] if r.stage == stage and r.numel in (0, n)), None
                )
                for n in sizes
            },
        }
        for stage in dict.fromkeys(r.stage for r in L["records"])
    ]
    table(rows, ["layer"] + [f"{n:,} floats" for n in sizes], {f"{n:,} floats": us_tenths for n in sizes})
    budget = L["summary"]
    lines = [
        f"| {label} | " + " | ".join(us_tenths(budget[f"numel={n}"][label]) for n in sizes) + " |"
        for label in budget[f"numel={sizes[0]}"]
    ]
    display(
        Markdown(
            "Where a small all-reduce's time goes, 2 ranks on one host: each layer of `ddpkit.all_reduce`'s call path "
            "looped back to back, the `c++` rows with the loop itself in C++ (no Python and no dispatcher between "
            "calls). The budget is what each layer adds to the one below it (both Python rows add to `c++ all_reduce`):"
            "\n\n| layer | "
            + " | ".join(f"{n:,} floats" for n in sizes)
            + " |\n|---|"
            + "---|" * len(sizes)
            + "\n"
            + "\n".join(lines)
        )
    )
