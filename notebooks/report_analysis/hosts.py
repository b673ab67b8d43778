"""7. Across hosts: the all-reduce and the other collectives on simulated hosts, the DDP step, and the issue's
targets against them."""

from __future__ import annotations

import collections
from dataclasses import dataclass

import matplotlib.pyplot as plt
from IPython.display import Markdown

from .formatting import figure_legend, floats, ms, ratio, step_time, us
from .output import command, display, table

MULTIHOST_HOSTS = {
    "2x2": "2 hosts × 2 ranks",
    "2x1": "2 hosts × 1 rank",
    "3x1": "3 hosts × 1 rank",
    "4x1": "4 hosts × 1 rank",
    "4x2": "4 hosts × 2 ranks",
    "8x1": "8 hosts × 1 rank",
}
MULTIHOST_LINKS = {"unshaped": "unshaped link", "10gbit": "10 Gbit/s", "1gbit": "1 Gbit/s"}


def link_label(link: str) -> str:
    """A link as bench_multihost.py names it, in words: "1gbit-10ms" is "1 Gbit/s, 10 ms round trip", and
    "1gbit-10ms-reno" adds the hosts' congestion control."""
    rate, _, rest = link.partition("-")
    round_trip, _, congestion_control = rest.partition("-")
    label = MULTIHOST_LINKS.get(rate, rate)
    if round_trip:
        label += f", {round_trip.removesuffix('ms')} ms round trip"
    return f"{label}, {congestion_control} in the hosts" if congestion_control else label


# The targets for ddpkit's time over gloo's, by (hosts x ranks, link) and size (None: no target there);
# 2 hosts x 1 rank's target, 1.0 everywhere, is the gloo line itself.
MULTIHOST_TARGETS = {
    ("2x2", "unshaped"): lambda n: 0.5 if n >= 16_000_000 else 0.6,
    ("2x2", "1gbit"): lambda n: 0.75 if n >= 1_000_000 else None,
    # issue 49: the ring across three hosts or more
    ("3x1", "unshaped"): lambda n: 0.6 if n == 100_000 else 0.85 if n >= 1_000_000 else None,
    ("4x1", "unshaped"): lambda n: 0.6 if n == 100_000 else 0.85 if n >= 1_000_000 else None,
    ("4x2", "unshaped"): lambda n: 0.6 if n >= 1_000_000 else None,
    # issue 65: links that fill long, fat paths
    ("2x1", "1gbit-10ms"): lambda n: 0.9 if n >= 1_000_000 else None,
    ("4x1", "1gbit-10ms"): lambda n: 0.9 if n >= 16_000_000 else None,
}
MULTIHOST_STYLE = {
    "ddpkit": dict(color="tab:red", linewidth=2.5),
    "ddpkit_flat": dict(color="tab:blue"),
    "ddpkit_backend": dict(color="tab:green", linestyle="-."),
    "ddpkit_bf16": dict(color="tab:purple", linestyle="--"),
}


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
        reduces=reduces,
        collectives=collectives,
        steps=[r for r in records if r.kind == "multihost_ddp"],
        topologies=[t for t in settings["topologies"] if any(r.topology == t for r in measured)],
        links=[link for link in settings["links"] if any(r.link == link for r in measured)],
        others=[c for c in settings["candidates"] if c != "gloo"],
        by_point={(r.topology, r.link, r.numel, r.candidate): r for r in reduces},
    )


def multihost_target(topology: str, link: str, numel: int) -> float | None:
    """The target for ddpkit's all-reduce time over gloo's at a point, or None where the issue sets none."""
    goal = MULTIHOST_TARGETS.get((topology, link))
    return goal(numel) if goal else None


def multihost(R: dict, name: str = "multihost") -> None:
    """Across hosts: the all-reduce candidates over gloo by topology and link (plot and table), the other
    collectives, and the DDP step, of the result `name` (multihost.json, or multihost_hosts.json: three hosts
    and more); a sentence where the folder has no such file."""
    if name not in R:
        display(
            Markdown(
                f"No `{name}.json` in this results folder, so it is not shown: "
                "`sudo .venv/bin/python benchmarks/bench_multihost.py` measures it (as root: its hosts are "
                "namespaces; `benchmarks/run_all.sh` gives the command of each file)."
            )
        )
        return
    command(R, name)
    m = multihost_records(R[name])
    if m.reduces:
        _multihost_all_reduce(m)
    if m.collectives:
        _multihost_collectives(m)
    if m.steps:
        names = {
            "ddpkit_ddp": "ddpkit's DDP (on the gloo group)",
            "torch_ddp_gloo": "torch DDP on gloo",
            "torch_ddp_ddpkit": 'torch DDP on the "ddpkit" backend',
        }
        table(
            [
                {
                    "hosts × ranks": r.topology,
                    "link": r.link,
                    "candidate": names.get(r.candidate, r.candidate),
                    "median step": r.median_s,
                    "p25–p75": f"{ms(r.p25_s)}–{ms(r.p75_s)}",
                    "reps": r.reps,
                    "/ torch DDP on gloo": r.ratio_to_torch_ddp_gloo,
                }
                for r in m.steps
            ],
            ["hosts × ranks", "link", "candidate", "median step", "p25–p75", "reps", "/ torch DDP on gloo"],
            {"median step": ms, "/ torch DDP on gloo": ratio},
        )
        display(
            Markdown(
                "One DDP training step (forward, backward with its gradient all-reduces, SGD step), the "
                "slowest rank's, median over the repetitions."
            )
        )
    else:
        display(Markdown("No DDP step across hosts in this file."))


def _multihost_all_reduce(m: Multihost) -> None:
    # The all-reduce's panels (topology × link) with the targets, then its table with the CPU the points kept busy.
    fig, axes = plt.subplots(
        len(m.topologies),
        len(m.links),
        figsize=(4.6 * len(m.links), 3.4 * len(m.topologies)),
        sharex=True,
        sharey=True,
        squeeze=False,
    )
    for row, topology in zip(axes, m.topologies):
        for ax, link in zip(row, m.links):
            panel = [r for r in m.reduces if r.topology == topology and r.link == link]
            for c in m.others:
                points = sorted((r.numel, r.ratio_to_gloo) for r in panel if r.candidate == c)
                if points:
                    ax.plot(
                        [p[0] for p in points],
                        [p[1] for p in points],
                        marker="o",
                        markersize=4,
                        label=c,
                        **MULTIHOST_STYLE.get(c, {}),
                    )
            ax.axhline(1.0, color="black", linestyle="--", linewidth=1.2, label="gloo (1.0)")
            goals = sorted(
                (r.numel, multihost_target(topology, link, r.numel)) for r in panel if r.candidate == "ddpkit"
            )
            goals = [g for g in goals if g[1] is not None]
            if goals:
                ax.plot(
                    [g[0] for g in goals],
                    [g[1] for g in goals],
                    linestyle=":",
                    color="gray",
                    marker="_",
                    markersize=14,
                    drawstyle="steps-post",
                    label="target for ddpkit",
                )
            ax.set_xscale("log")
            ax.grid(True, which="both", alpha=0.3)
            ax.set_title(
                f"{MULTIHOST_HOSTS.get(topology, topology)}, {link_label(link)}" + ("" if panel else ": not measured"),
                fontsize=10,
            )
    axes[0][0].set_ylim(0, 1.08 * max([1.0, *(r.ratio_to_gloo for r in m.reduces)]))  # the axes share it
    for ax in axes[-1]:
        ax.set_xlabel("floats (float32)")
    for row in axes:
        row[0].set_ylabel("time / gloo's (median)")
    legend = figure_legend(axes.flat)
    fig.legend(
        legend.values(), legend.keys(), loc="upper center", ncol=len(legend), fontsize=9, bbox_to_anchor=(0.5, 1.0)
    )
    plt.tight_layout(rect=(0, 0, 1, 0.93))
    plt.show()
    rows = []
    for topology in m.topologies:
        for link in m.links:
            for numel in sorted({r.numel for r in m.reduces if r.topology == topology and r.link == link}):
                gloo = m.by_point.get((topology, link, numel, "gloo"))
                row = {
                    "hosts × ranks": topology,
                    "link": link,
                    "floats": floats(numel),
                    "gloo": gloo.median_s if gloo else None,
                }
                for c in m.others:
                    r = m.by_point.get((topology, link, numel, c))
                    row[c] = r.ratio_to_gloo if r else None
                backend_point = m.by_point.get((topology, link, numel, "ddpkit_backend"))
                own = m.by_point.get((topology, link, numel, "ddpkit"))
                row["backend / ddpkit"] = backend_point.median_s / own.median_s if backend_point and own else None
                row["ddpkit: of the link"] = own.link_fraction if own and own.link_fraction is not None else None
                busy = [r.cpu_busy for r in (own, gloo) if r is not None and r.cpu_busy is not None]
                row["CPUs busy: ddpkit, gloo"] = " / ".join(f"{b:.0%}" for b in busy) if len(busy) == 2 else None
                row["reps"] = gloo.reps if gloo else None
                rows.append(row)
    cpu_column = ["CPUs busy: ddpkit, gloo"] if any(row["CPUs busy: ddpkit, gloo"] for row in rows) else []
    link_column = ["ddpkit: of the link"] if any(row["ddpkit: of the link"] is not None for row in rows) else []
    table(
        rows,
        ["hosts × ranks", "link", "floats", "gloo", *m.others, "backend / ddpkit", *link_column, *cpu_column, "reps"],
        {
            "gloo": step_time,
            **{c: ratio for c in m.others},
            "backend / ddpkit": ratio,
            "ddpkit: of the link": lambda x: f"{x:.2f}",
        },
    )
    display(
        Markdown(
            "`gloo`: its time per call (median); the candidates' columns: their time over gloo's; `ddpkit: "
            "of the link`: its bus bandwidth across hosts (2(N-1)/N of the bytes per host link, N hosts) over a "
            "shaped link's rate; "
            "`backend / ddpkit`: the \"ddpkit\" backend's time over `ddpkit.all_reduce`'s, the cost of going "
            "through torch's API. `CPUs busy`: the CPU time all ranks' processes spent per call (every "
            "thread, kernel time included), over the slowest rank's time × this machine's cores, for "
            "`ddpkit` and `gloo`. Near 100%, a point was bound by the cores the simulated hosts share, not "
            "by its link: there every CPU-microsecond a candidate or torch's own call path spends adds to "
            "its time."
        )
    )


def _multihost_collectives(m: Multihost) -> None:
    # The other collectives' table: gloo's time, the candidates' over it.
    points = {(r.collective, r.topology, r.link, r.numel, r.candidate): r for r in m.collectives}
    rows = []
    for collective in dict.fromkeys(r.collective for r in m.collectives):
        for topology in m.topologies:
            for link in m.links:
                for numel in sorted(
                    {
                        r.numel
                        for r in m.collectives
                        if (r.collective, r.topology, r.link) == (collective, topology, link)
                    }
                ):
                    gloo = points.get((collective, topology, link, numel, "gloo"))
                    row = {
                        "collective": collective,
                        "hosts × ranks": topology,
                        "link": link,
                        "floats": floats(numel),
                        "gloo": gloo.median_s if gloo else None,
                    }
                    for c in m.others:
                        r = points.get((collective, topology, link, numel, c))
                        row[c] = r.ratio_to_gloo if r else None
                    rows.append(row)
    present = [c for c in m.others if any(c in row and row[c] is not None for row in rows)]
    table(
        rows,
        ["collective", "hosts × ranks", "link", "floats", "gloo", *present],
        {"gloo": step_time, **{c: ratio for c in present}},
    )
    display(
        Markdown(
            "The other collectives across hosts: `gloo`, its time per call (median); the candidates' "
            "columns, their time over gloo's (`ddpkit_flat`: `transport=\"process_group\"`, ddpkit's "
            "schedules over gloo's send/recv that ignore the hosts)."
        )
    )


def target_row(text: str, points: dict, limit: float, expected=()) -> dict:
    """A row of the targets' table: ``points`` maps where (a label) to the ratio measured there; ``expected``: the
    points the target names, those absent listed as not measured. Its result is decided by the largest ratio:
    "met", "not met", or "not measured" where ``points`` is empty."""
    missing = [p for p in expected if p not in points]
    worst = max(points, key=points.get) if points else None
    result = "not measured" if not points else "met" if points[worst] <= limit else "not met"
    return {
        "target": text,
        "limit": limit,
        "worst": f"{points[worst]:.2f}× ({worst})" if points else "",
        "measured at": ", ".join(points) or "—",
        "not measured at": ", ".join(missing),
        "result": result,
    }


def _ratios(m: Multihost, topology: str, link: str | None, candidate: str, low=0, high=float("inf")) -> dict:
    # {where: time / gloo's} of one candidate's all-reduces from low to high floats; link None: every link.
    chosen = sorted(
        (
            r
            for r in m.reduces
            if r.topology == topology
            and r.candidate == candidate
            and (link is None or r.link == link)
            and low <= r.numel <= high
        ),
        key=lambda r: (m.links.index(r.link), r.numel),
    )
    return {(floats(r.numel) if link else f"{r.link} {floats(r.numel)}"): r.ratio_to_gloo for r in chosen}


def multihost_targets(R: dict) -> None:
    """The issue's targets across hosts against the multihost result (table and count), and what the missed
    points' own figures (their CPU) say; nothing where the folder has no multihost.json."""
    if "multihost" not in R:
        return
    m = multihost_records(R["multihost"])
    sizes = [floats(n) for n in (1_000, 100_000, 1_000_000, 16_000_000)]  # the sizes the targets name
    own = {r.numel: r.median_s for r in m.reduces if (r.topology, r.link, r.candidate) == ("2x2", "unshaped", "ddpkit")}
    backend_over_own = {
        floats(r.numel): r.median_s / own[r.numel]
        for r in m.reduces
        if (r.topology, r.link, r.candidate) == ("2x2", "unshaped", "ddpkit_backend") and r.numel in own
    }
    steps = {r.candidate: r.ratio_to_torch_ddp_gloo for r in m.steps if r.topology == "2x2"}
    rows = [
        target_row(
            "2 hosts × 2 ranks, unshaped: <code>ddpkit</code> ≤ 0.6× gloo at every size from 1k to 16M floats",
            _ratios(m, "2x2", "unshaped", "ddpkit", 1_000, 16_000_000),
            0.6,
            sizes,
        ),
        target_row(
            "2 hosts × 2 ranks, unshaped: <code>ddpkit</code> ≤ 0.5× gloo at 16M floats",
            _ratios(m, "2x2", "unshaped", "ddpkit", 16_000_000, 16_000_000),
            0.5,
            sizes[-1:],
        ),
        target_row(
            '2 hosts × 2 ranks, unshaped: the "ddpkit" backend within 1.1× of <code>ddpkit.all_reduce</code> '
            "(the backend's time over ddpkit's own)",
            backend_over_own,
            1.1,
            sizes,
        ),
        target_row(
            "2 hosts × 1 rank: <code>ddpkit</code> ≤ 1.0× gloo everywhere (every link, every size)",
            _ratios(m, "2x1", None, "ddpkit"),
            1.0,
        ),
        target_row(
            "2 hosts × 2 ranks at 1 Gbit/s: <code>ddpkit</code> ≤ 0.75× gloo from 1M floats up",
            _ratios(m, "2x2", "1gbit", "ddpkit", 1_000_000),
            0.75,
            sizes[2:],
        ),
        target_row(
            "DDP step across 2 hosts × 2 ranks: ddpkit's DDP ≤ 0.8× torch DDP on gloo",
            {"step": steps["ddpkit_ddp"]} if "ddpkit_ddp" in steps else {},
            0.8,
        ),
        target_row(
            'DDP step across 2 hosts × 2 ranks: torch DDP on the "ddpkit" backend ≤ 0.85× torch DDP on gloo',
            {"step": steps["torch_ddp_ddpkit"]} if "torch_ddp_ddpkit" in steps else {},
            0.85,
        ),
    ]
    partial = any(r["not measured at"] for r in rows)
    table(rows, ["target", "worst", "measured at", *(["not measured at"] if partial else []), "result"])
    count = collections.Counter(r["result"] for r in rows)
    lines = [
        f"The issue's targets against these figures (<code>worst</code>: the largest ratio among the points a "
        f"target covers, the one that decides it): **{count['met']} of {len(rows)} met**, {count['not met']} not "
        "met" + (f", {count['not measured']} not measured in this file" if count["not measured"] else "") + "."
    ]
    lines += [f"- Not met: {r['target']}: {r['worst']}." for r in rows if r["result"] == "not met"]
    lines += [
        f"- Judged on part of its points only: {r['target']} (not measured at {r['not measured at']})."
        for r in rows
        if r["not measured at"] and r["result"] != "not measured"
    ]
    display(Markdown(lines[0] + "\n\n" + "\n".join(lines[1:])))
    why = _multihost_misses(m, own)
    if why:
        display(Markdown("The missed points' own figures:\n\n" + "\n".join(why)))


def _multihost_misses(m: Multihost, own: dict) -> list[str]:
    # What the missed points' own figures say: their CPU (files written before bench_multihost measured it lack it).
    why = []
    for numel in sorted(own):
        backend_point, mine = (m.by_point.get(("2x2", "unshaped", numel, c)) for c in ("ddpkit_backend", "ddpkit"))
        if (
            backend_point
            and mine
            and backend_point.median_s > 1.1 * mine.median_s
            and backend_point.cpu_busy is not None
        ):
            extra = (backend_point.all_ranks_cpu_s - mine.all_ranks_cpu_s) / 4  # 2 hosts x 2 ranks
            why.append(
                f"- The backend at 2 hosts × 2 ranks, {floats(numel)}: "
                f"{backend_point.median_s / mine.median_s:.2f}× `ddpkit.all_reduce`'s time. Each rank's call "
                f"through torch's API spent {us(extra)} more CPU than `ddpkit.all_reduce`'s, with the cores "
                f"{backend_point.cpu_busy:.0%} busy: the 4 ranks share 2 cores, so what a call costs in CPU "
                "adds to its time."
            )
    for r in m.reduces:
        gloo = m.by_point.get((r.topology, r.link, r.numel, "gloo"))
        goal = multihost_target(r.topology, r.link, r.numel)
        if (
            r.candidate == "ddpkit"
            and goal is not None
            and r.ratio_to_gloo > goal
            and gloo
            and r.cpu_busy is not None
            and gloo.cpu_busy is not None
        ):
            why.append(
                f"- {MULTIHOST_HOSTS.get(r.topology, r.topology)}, {link_label(r.link)}, "
                f"{floats(r.numel)}: {r.ratio_to_gloo:.2f}× (target {goal}×; gloo {ms(gloo.median_s)}, "
                f"p25–p75 {ms(gloo.p25_s)}–{ms(gloo.p75_s)}). All ranks spent {ms(r.all_ranks_cpu_s)} of CPU "
                f"per call against gloo's {ms(gloo.all_ranks_cpu_s)} "
                f"({r.all_ranks_cpu_s / gloo.all_ranks_cpu_s:.2f}×), the cores {r.cpu_busy:.0%} and "
                f"{gloo.cpu_busy:.0%} busy: where the cores bound both, the time follows the CPU."
            )
        if (r.topology, r.candidate) == ("2x1", "ddpkit") and r.ratio_to_gloo > 1.0 and gloo and r.cpu_busy is not None:
            text = (
                f"- 2 hosts × 1 rank, {link_label(r.link)}, {floats(r.numel)}: "
                f"{r.ratio_to_gloo:.3f}× ({ms(r.median_s)} against gloo's {ms(gloo.median_s)}), the cores "
                f"{r.cpu_busy:.0%} and {gloo.cpu_busy:.0%} busy"
            )
            rate = {"10gbit": 10e9, "1gbit": 1e9}.get(r.link)
            if rate:  # an all-reduce between two ranks moves the whole vector each way, whatever its schedule
                line = r.numel * 4 * 8 / rate
                text += (
                    f"; {4 * r.numel / 1e6:g} MB each way take {ms(line)} at the link's rate: ddpkit "
                    f"{r.median_s / line - 1:+.1%}, gloo {gloo.median_s / line - 1:+.1%} above it"
                )
            why.append(text + ".")
    return why
