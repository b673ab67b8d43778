"""9. Training that survives a lost replica: torchft on gloo against torchft on ddpkit (fault_tolerance.json)."""

from __future__ import annotations

import collections
import statistics

import matplotlib.pyplot as plt
from IPython.display import Markdown
from matplotlib.lines import Line2D

from .formatting import ratio, step_time
from .output import command, display, table

FT_CANDIDATES = {
    "torchft-gloo": "torchft on gloo",
    "torchft-ddpkit": "torchft on ddpkit",
    "torchft-floor": "no communication (ProcessGroupDummy)",
    "torchrun-restart": "torchrun --max-restarts",
}
FT_WRAPPERS = {
    "torchft-ddp": "torchft's DDP",
    "torchft-ddp-async": "torchft's DDP, ddpkit.torchft's hook",
    "ddpkit-ddp": "ddpkit's DDP, the manager's hook",
}
FT_STEADY_TARGET = 0.7  # torchft on ddpkit over torchft on gloo, torchft's DDP, the steady step


def _ft_median(runs: list, field: str) -> float | None:
    values = [getattr(r, field) for r in runs if r.failed is None and getattr(r, field) is not None]
    return statistics.median(values) if values else None


def fault_tolerance(R: dict) -> None:
    """torchft on gloo against torchft on ddpkit (fault_tolerance.json): the steady step against the floor, the
    kill's figures, and the timeline of the kill whose death-to-commit time is each group's median; a sentence
    where the folder has no fault_tolerance.json."""
    if "fault_tolerance" not in R:
        display(
            Markdown(
                "No `fault_tolerance.json` in this results folder, so torchft is not shown: "
                "`.venv/bin/python benchmarks/bench_fault_tolerance.py` measures it."
            )
        )
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
    floor = next(
        (
            r[f"{FT_CANDIDATES['torchft-floor']} / gloo"]
            for r in steady_rows
            if r["wrapper"] == FT_WRAPPERS["torchft-ddp"]
        ),
        None,
    )
    display(
        Markdown(
            f"The steady step, median over {F['settings']['repeats']} repetitions of 2 replica groups training the "
            f"8.4M-parameter MLP. The issue's target is {FT_STEADY_TARGET}x gloo with torchft's DDP"
            + (
                f"; with no communication at all the step is {ratio(floor)} gloo's, the least any process group "
                "could reach here."
                if floor
                else "."
            )
        )
    )
    kill_rows = []
    for (measure, wrapper, candidate), runs in groups.items():
        if measure != "kill":
            continue
        failed = sum(r.failed is not None for r in runs)
        kill_rows.append(
            {
                "candidate": FT_CANDIDATES.get(candidate, candidate),
                "wrapper": "ddpkit's DDP, no torchft"
                if candidate == "torchrun-restart"
                else FT_WRAPPERS.get(wrapper, wrapper),
                "runs": f"{len(runs) - failed} of {len(runs)}",
                "death → next commit": _ft_median(runs, "death_to_next_commit_s"),
                "noticed": _ft_median(runs, "noticed_s"),
                "next quorum": _ft_median(runs, "next_quorum_s"),
                "restart → first commit": _ft_median(runs, "restart_to_first_commit_s"),
                "manager up → first commit": _ft_median(runs, "ready_to_first_commit_s"),
                "steps lost": _ft_median(runs, "steps_lost"),
            }
        )
    seconds = lambda x: "—" if x is None else f"{x:.3f} s"  # noqa: E731
    table(
        kill_rows,
        [
            "candidate",
            "wrapper",
            "runs",
            "death → next commit",
            "noticed",
            "next quorum",
            "restart → first commit",
            "manager up → first commit",
            "steps lost",
        ],
        {
            c: seconds
            for c in (
                "death → next commit",
                "noticed",
                "next quorum",
                "restart → first commit",
                "manager up → first commit",
            )
        },
    )
    display(
        Markdown(
            "One replica group of 3 SIGKILLed mid-run and restarted; medians over the repetitions that survived (a "
            "run that failed is counted in `runs`). `noticed`: the survivors' failed step ended; `next quorum`: the "
            "lighthouse formed the quorum of their next committed step; both in seconds after the kill."
        )
    )
    _fault_tolerance_timeline(groups)


def _fault_tolerance_timeline(groups: dict) -> None:
    # The kill of each torchft group with ddpkit's DDP whose death-to-commit time is the median: every
    # replica's iterations around the kill, each its wait for the quorum then its step, committed or discarded.
    shown = []
    for candidate in ("torchft-gloo", "torchft-ddpkit"):
        runs = sorted(
            (r for r in groups.get(("kill", "ddpkit-ddp", candidate), []) if r.failed is None and r.timeline),
            key=lambda r: r.death_to_next_commit_s,
        )
        if runs:
            shown.append((candidate, runs[(len(runs) - 1) // 2]))
    if not shown:
        return
    fig, axes = plt.subplots(len(shown), 1, figsize=(12, 1.6 + 1.1 * len(shown)), sharex=True, squeeze=False)
    for ax, (candidate, run) in zip(axes[:, 0], shown):
        for end, replica, _step, committed, _participants, quorum, start in run.timeline:
            if end > 1.0:
                continue
            ax.plot(
                [max(start, -0.3), max(quorum, -0.3)],
                [replica, replica],
                color="lightgray",
                linewidth=6,
                solid_capstyle="butt",
                label="iteration, waiting for its quorum",
            )
            ax.plot(
                [max(quorum, -0.3), end],
                [replica, replica],
                color="tab:green" if committed else "tab:red",
                linewidth=6,
                solid_capstyle="butt",
                label="iteration, committed" if committed else "iteration, discarded",
            )
        ax.axvline(0, color="black", linestyle="--", linewidth=1, label="the kill")
        ax.set_yticks(sorted({row[1] for row in run.timeline}))
        ax.set_ylabel("replica")
        ax.set_title(f"{FT_CANDIDATES[candidate]}: death → next commit {run.death_to_next_commit_s:.3f} s", fontsize=10)
    axes[-1, 0].set_xlabel("seconds after the kill")
    handles = [
        Line2D([], [], color="tab:green", linewidth=6, label="iteration, committed"),
        Line2D([], [], color="tab:red", linewidth=6, label="iteration, discarded"),
        Line2D([], [], color="lightgray", linewidth=6, label="iteration, waiting for its quorum"),
        Line2D([], [], color="black", linestyle="--", label="the kill"),
    ]
    for ax in axes[:, 0]:
        ax.legend(handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    plt.tight_layout()
    plt.show()
    display(
        Markdown(
            "Each replica's iterations from 0.3 s before the kill to 1 s after it, in the kill whose death-to-commit "
            "time is its group's median (ddpkit's DDP under the manager), each split into its wait for the quorum (gray) "
            "and its step: the survivors' step in flight fails as soon as the death is seen, and their next quorum "
            "waits for the lighthouse's heartbeat timeout on both groups."
        )
    )
