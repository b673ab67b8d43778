"""6. The "ddpkit" torch.distributed backend, 8. torch's own stack on it (FSDP2, DDP hooks, tensor
parallelism), and torch's own distributed test suite on both backends."""

from __future__ import annotations

import collections
import json
from html import escape
from pathlib import Path

import matplotlib.pyplot as plt
from IPython.display import Markdown

from .data_parallel import below_floor
from .formatting import code_html, mib, minute, ms, ratio, step_time, us, us_tenths
from .output import command, display, table
from .results import REPO, SUITE


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
        rows.append(
            {
                "collective": collective,
                "n": n,
                "size": numel,
                "gloo": gloo.median_s,
                "backend": r.median_s,
                "ddpkit": own.median_s,
                "backend / gloo": r.median_s / gloo.median_s,
                "backend / ddpkit": r.median_s / own.median_s,
                "busbw backend": r.busbw_GBps,
            }
        )
    table(
        rows,
        ["collective", "n", "size", "gloo", "backend", "ddpkit", "backend / gloo", "backend / ddpkit", "busbw backend"],
        {
            "gloo": us,
            "backend": us,
            "ddpkit": us,
            "backend / gloo": ratio,
            "backend / ddpkit": ratio,
            "busbw backend": lambda v: f"{v:.2f} GB/s",
        },
    )
    fig, axes = plt.subplots(1, 3, figsize=(15, 4), sharey=True)
    for ax, collective in zip(axes, ["all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor"]):
        for n in sorted({r.world_size for r in coll}):
            sizes = sorted({r.numel for r in coll if r.world_size == n and r.collective == collective})
            for candidate, style in (("gloo", "--"), ("backend", "-")):
                ax.loglog(
                    sizes,
                    [by[(collective, n, s, candidate)].median_s for s in sizes],
                    style,
                    marker="o",
                    label=f"{candidate} n={n}",
                )
        ax.set_title(collective)
        ax.set_xlabel("floats")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("seconds per call (median, slowest rank)")
    axes[0].legend()
    plt.show()
    layers = [r for r in b["records"] if r.kind == "layers"]
    if layers:
        display(
            Markdown("One all-reduce through each layer, 2 processes: where the time above `ddpkit.all_reduce` goes.")
        )
        table(
            [{"layer": r.layer, "size": r.numel, "time per call": r.median_s} for r in layers],
            ["layer", "size", "time per call"],
            {"time per call": us_tenths},
        )
    steps = [r for r in b["records"] if r.kind == "ddp"]
    if steps:
        base = {(r.model, r.accumulation): r for r in steps if r.candidate == "torch_gloo"}
        floor = {(r.model, r.accumulation): r.median_step_s for r in steps if r.candidate == "floor"}
        rows = [
            {
                "model": r.model,
                "accumulation": r.accumulation,
                "torch DDP on gloo": base[(r.model, r.accumulation)].median_step_s,
                "on ddpkit": r.median_step_s,
                "no communication": floor.get((r.model, r.accumulation)),
                "time ratio": r.median_step_s / base[(r.model, r.accumulation)].median_step_s,
                "memory ratio": r.peak_memory_bytes / base[(r.model, r.accumulation)].peak_memory_bytes,
            }
            for r in steps
            if r.candidate == "torch_ddpkit"
        ]
        table(
            rows,
            [
                "model",
                "accumulation",
                "torch DDP on gloo",
                "on ddpkit",
                "no communication",
                "time ratio",
                "memory ratio",
            ],
            {
                "torch DDP on gloo": ms,
                "on ddpkit": ms,
                "no communication": ms,
                "time ratio": ratio,
                "memory ratio": ratio,
            },
        )
        display(
            Markdown(
                "Median step of torch's DDP (2 processes) on each backend, and of the same steps without "
                "any gradient communication (`no communication`: the least a backend can reach)."
            )
        )
        floor_text = below_floor(
            steps, names={"torch_ddpkit": "torch DDP on ddpkit", "torch_gloo": "torch DDP on gloo"}
        )
        if floor_text:
            display(Markdown(floor_text))


TORCH_STACK_TARGETS = {"fsdp2": 0.6, "tp_mlp": 0.5}  # the targets for ddpkit's step over gloo's


def torch_stack(R: dict) -> None:
    """torch's FSDP2, DDP hooks and tensor parallelism on the ddpkit backend against gloo (table), each workload's
    target in words, and the largest parameter difference; a sentence where the folder has no torch_stack.json."""
    if "torch_stack" not in R:
        display(
            Markdown(
                "No `torch_stack.json` in this results folder, so torch's FSDP2, DDP hooks and tensor "
                "parallelism on the ddpkit backend are not shown: `.venv/bin/python "
                "benchmarks/bench_torch_stack.py` measures them."
            )
        )
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
        rows.append(
            {
                "workload": workload,
                "n": n,
                "model": r.model,
                "batch per rank": r.batch_per_rank,
                "gloo step": g.median_step_s,
                "ddpkit step": r.median_step_s,
                "ddpkit / gloo": r.median_step_s / g.median_step_s,
                "target": f"≤ {targets[workload]}×" if workload in targets else "",
                "floor step": floor.median_step_s if floor else None,
                "floor / gloo": floor.median_step_s / g.median_step_s if floor else None,
                "gloo memory": g.peak_rss_increase_bytes,
                "ddpkit memory": r.peak_rss_increase_bytes,
                "memory ddpkit / gloo": (
                    r.peak_rss_increase_bytes / g.peak_rss_increase_bytes
                    if r.peak_rss_increase_bytes is not None and g.peak_rss_increase_bytes
                    else None
                ),
                "max |param diff|": r.max_param_diff_vs_gloo,
            }
        )
    table(
        rows,
        [
            "workload",
            "n",
            "model",
            "batch per rank",
            "gloo step",
            "ddpkit step",
            "ddpkit / gloo",
            "target",
            "floor step",
            "floor / gloo",
            "gloo memory",
            "ddpkit memory",
            "memory ddpkit / gloo",
            "max |param diff|",
        ],
        {
            "gloo step": step_time,
            "ddpkit step": step_time,
            "ddpkit / gloo": ratio,
            "floor step": step_time,
            "floor / gloo": ratio,
            "gloo memory": mib,
            "ddpkit memory": mib,
            "memory ddpkit / gloo": ratio,
            "max |param diff|": lambda v: f"{v:.1e}",
        },
    )
    display(
        Markdown(
            "`n`: processes. Steps: median of the slowest rank. Memory (FSDP2 only): the peak resident "
            "memory's increase over the processes' memory before the model was built, the largest over "
            "ranks, each backend alone."
        )
    )
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
            + "."
            + "".join(
                f" Memory at {row['n']}: {row['memory ddpkit / gloo']:.2f}× gloo's."
                for row in fsdp
                if row["memory ddpkit / gloo"] is not None
            )
        )
    else:
        lines.append("**FSDP2**: not measured in this file.")
    for row in (row for row in rows if row["workload"] == "tp_mlp"):
        limit = targets["tp_mlp"]
        text = (
            f"**Tensor-parallel MLP** at {row['n']} processes (target ≤ {limit}× gloo): "
            f"{row['ddpkit / gloo']:.2f}× — {'met' if row['ddpkit / gloo'] <= limit else 'not met'}."
        )
        if row["floor / gloo"] is not None:
            gloo_s, ddpkit_s, floor_s = row["gloo step"], row["ddpkit step"], row["floor step"]
            text += (
                f" The floor, the same step on a mesh of one rank with no communication at all, takes "
                f"{row['floor / gloo']:.2f}× gloo's step ({step_time(floor_s)} of {step_time(gloo_s)})"
            )
            if row["floor / gloo"] > limit:
                text += (
                    ": above the target, so no backend can reach it. Most of the step is not communication but "
                    "the model's own work and DTensor's dispatch in Python, which run the same on any backend."
                )
            else:
                text += ": below the target, so a backend could reach it."
            if gloo_s > floor_s:
                text += (
                    f" Of what communicating adds to the step over gloo ({step_time(gloo_s - floor_s)}), ddpkit "
                    f"saves {100 * (gloo_s - ddpkit_s) / (gloo_s - floor_s):.0f} %."
                )
        lines.append(text)
    others = [row for row in rows if row["workload"] not in targets]
    if others:
        lines.append(
            "Without a target: "
            + ", ".join(f"{row['workload']} {row['ddpkit / gloo']:.2f}× gloo at {row['n']} processes" for row in others)
            + "."
        )
    diff = max(r.max_param_diff_vs_gloo for r in T["records"] if r.candidate == "ddpkit")
    lines.append(f"Every ddpkit copy agreed with gloo's before timing: largest difference {diff:.1e}.")
    display(Markdown("\n\n".join(lines)))


DIFFERENCE_CAUSES = {"torch": "torch's own code", "ddpkit bug": "a ddpkit bug", "unclassified": "not yet read"}


def skip_reason(summary: str) -> str:
    """The kind of reason a skipped test's summary gives: "CUDA", "NCCL or MPI only", "another world size",
    "disabled upstream" (torch's own skip: an issue or a flaky test) or "other"."""
    text = summary.lower()
    return (
        "CUDA"
        if "cuda" in text
        else "NCCL or MPI only"
        if "nccl" in text or "mpi" in text
        else "another world size"
        if "world size" in text
        else "disabled upstream"
        if "github.com/pytorch" in text or "flak" in text or "failing" in text
        else "other"
    )


def _passed(run: dict, name: str) -> bool:
    return run.get(name, {}).get("outcome") == "passed"


def torch_suite(path: Path = REPO / SUITE) -> None:
    """torch's own distributed test suite on gloo and on "ddpkit" (``path``: scripts/run_torch_suite.py's JSON):
    its counts per backend, each test that passes on one backend only with its recorded reason, the flaky ones, and
    the skips by reason; a sentence where the file is absent."""
    shown = path.relative_to(REPO) if path.is_relative_to(REPO) else path
    if not path.exists():
        display(
            Markdown(
                f"No `{shown}`, so torch's own distributed test suite on the ddpkit backend is not "
                "summarised here: `.venv/bin/python scripts/run_torch_suite.py` runs it."
            )
        )
        return
    suite = json.loads(path.read_text())
    display(
        Markdown(
            f"**torch's own distributed test suite** (`torch.testing._internal.distributed.distributed_test`, "
            f'{suite["tests"]} tests, {suite["world_size"]} processes), run on gloo and on "ddpkit" one after the other '
            f"by `.venv/bin/python scripts/run_torch_suite.py` on {minute(suite['date'])} UTC, at commit "
            f"`{suite['git_commit']}` (ddpkit built from `{suite['ddpkit_commit']}`), torch {suite['torch_version']}. "
            f"Every outcome is in `{shown}`, the differences also in `docs/torch_suite.md`."
        )
    )
    runs = suite["runs"]
    table(
        [
            {
                "backend": name,
                "tests": len(run["records"]),
                "passed": run["counts"].get("passed", 0),
                "failed or error": run["counts"].get("failed", 0) + run["counts"].get("error", 0),
                "skipped": run["counts"].get("skipped", 0),
                "run time": run["seconds"],
            }
            for name, run in runs.items()
        ],
        ["backend", "tests", "passed", "failed or error", "skipped", "run time"],
        {"run time": lambda s: f"{s / 60:.1f} min"},
    )
    gloo_runs, ddpkit_runs = runs["gloo"]["records"], runs["ddpkit"]["records"]
    only_gloo = sorted(name for name in gloo_runs if _passed(gloo_runs, name) and not _passed(ddpkit_runs, name))
    only_ddpkit = sorted(name for name in ddpkit_runs if _passed(ddpkit_runs, name) and not _passed(gloo_runs, name))
    reasons = {d["test"]: d for d in suite["differences"]}
    display(
        Markdown(
            f'gloo passes {sum(_passed(gloo_runs, n) for n in gloo_runs)} tests and "ddpkit" '
            f"{sum(_passed(ddpkit_runs, n) for n in ddpkit_runs)}: {len(only_gloo)} pass on gloo only"
            + (f', {len(only_ddpkit)} on "ddpkit" only' if only_ddpkit else ', none on "ddpkit" only')
            + "."
            + (' Each test gloo passes and "ddpkit" does not, with its reason:' if only_gloo else "")
        )
    )
    if only_gloo:
        table(
            [
                {
                    "test": f"<code>{name}</code>",
                    "on ddpkit": f"{ddpkit_runs.get(name, {}).get('outcome', 'not run')}: "
                    f"<code>{escape(ddpkit_runs.get(name, {}).get('summary', ''))}</code>",
                    "why": code_html(reasons.get(name, {}).get("reason", "no reason recorded")),
                    "cause": DIFFERENCE_CAUSES.get(
                        reasons.get(name, {}).get("kind"), reasons.get(name, {}).get("kind", "—")
                    ),
                }
                for name in only_gloo
            ],
            ["test", "on ddpkit", "why", "cause"],
        )
    if only_ddpkit:
        table(
            [
                {
                    "test": f"<code>{name}</code>",
                    "on gloo": f"{gloo_runs.get(name, {}).get('outcome', 'not run')}: "
                    f"<code>{escape(gloo_runs.get(name, {}).get('summary', ''))}</code>",
                }
                for name in only_ddpkit
            ],
            ["test", "on gloo"],
        )
    if suite.get("flaky"):
        display(
            Markdown(
                "Failed once and passed when run again (the machine was shared while the suite ran): "
                + ", ".join(f"`{f['test']}` on {f['backend']}" for f in suite["flaky"])
                + "."
            )
        )
    both = [
        gloo_runs[n]["summary"]
        for n in gloo_runs
        if gloo_runs[n]["outcome"] == "skipped" and ddpkit_runs.get(n, {}).get("outcome") == "skipped"
    ]
    kinds = collections.Counter(map(skip_reason, both))
    display(
        Markdown(
            f"Skipped on both backends: {len(both)} tests, by the reason the suite gives: "
            + ", ".join(f"{kind} {count}" for kind, count in kinds.most_common())
            + ' ("disabled upstream": torch\'s own skip, an issue or a flaky test). `tests/test_torch_suite.py` runs '
            'every test gloo passes on "ddpkit".'
        )
    )
