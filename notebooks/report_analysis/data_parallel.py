"""3. DistributedDataParallel and 4. training: ddpkit's DDP against torch's, step by step and over a whole
training run, and the steps below the no-communication floor."""

from __future__ import annotations

import math
import statistics

import matplotlib.pyplot as plt
from IPython.display import Markdown

from .formatting import mib, ms, ratio
from .output import command, display, table


def below_floor(records: list, names: dict | None = None) -> str | None:
    """A paragraph on every DDP record whose median step is below the no-communication floor's (candidate
    "floor", same model and accumulation), or None. ``names``: the words to call a candidate by."""
    floors = {(r.model, r.accumulation): r for r in records if r.candidate == "floor"}
    cases = [
        (r, floors[(r.model, r.accumulation)])
        for r in records
        if r.candidate != "floor"
        and (r.model, r.accumulation) in floors
        and r.median_step_s < floors[(r.model, r.accumulation)].median_step_s
    ]
    if not cases:
        return None

    def overlap(r, f) -> bool:
        return max(r.p25_step_s, f.p25_step_s) <= min(r.p75_step_s, f.p75_step_s)

    described = "; ".join(
        f"`{(names or {}).get(r.candidate, r.candidate)}` {r.model}, accumulation {r.accumulation}: "
        f"{ms(r.median_step_s)} (middle half {ms(r.p25_step_s)}–{ms(r.p75_step_s)}) against the floor's "
        f"{ms(f.median_step_s)} ({ms(f.p25_step_s)}–{ms(f.p75_step_s)})"
        for r, f in cases
    )
    ties = sum(overlap(r, f) for r, f in cases)
    text = (
        f"Below the floor: {described}. No wrapper can be faster than the same steps without any communication; "
        "each candidate runs in processes of its own, on 2 cores shared with the other candidates' idle "
        "processes, so its steps and the floor's differ by where and when the scheduler runs them. "
    )
    if ties == len(cases):
        return text + (
            "In every case the middle halves of the repetitions overlap: the candidate and the floor are "
            "tied within the spread of the measurement, not faster."
        )
    return text + (
        f"In {len(cases) - ties} of them the middle halves do not overlap: a difference this benchmark "
        "does not explain; re-measure before reading anything into it."
    )


def ddp(R: dict) -> None:
    """Every DDP record's step time and memory, the candidates over torch DDP (plot and table), the default
    all-reduce's range in words, and a paragraph on any step below the no-communication floor."""
    command(R, "ddp")
    d = R["ddp"]
    rows = [
        {
            "model": r.model,
            "accumulation": r.accumulation,
            "candidate": r.candidate,
            "median step": r.median_step_s,
            "p25 step": r.p25_step_s,
            "p75 step": r.p75_step_s,
            "peak memory": r.peak_memory_bytes,
            "buckets": (r.reducer_stats or {}).get("buckets"),
        }
        for r in d["records"]
    ]
    table(
        rows,
        ["model", "accumulation", "candidate", "median step", "p25 step", "p75 step", "peak memory", "buckets"],
        {"median step": ms, "p25 step": ms, "p75 step": ms, "peak memory": mib},
    )
    fig, ax = plt.subplots(figsize=(10, 3.5))
    names = list(d["summary"])
    ax.bar(
        [i - 0.2 for i in range(len(names))],
        [d["summary"][n]["time_ratio"] for n in names],
        width=0.4,
        label="step time",
    )
    ax.bar(
        [i + 0.2 for i in range(len(names))],
        [d["summary"][n]["memory_ratio"] for n in names],
        width=0.4,
        label="peak memory",
    )
    ax.axhline(1.0, color="black", linestyle="--", linewidth=1, label="torch DDP (1)")
    ax.set_xticks(range(len(names)), names, rotation=20, fontsize=8)
    ax.set_ylabel("candidate / torch DDP")
    ax.legend(fontsize=8)
    plt.tight_layout()
    plt.show()
    rows = [
        {"configuration": k, "time vs torch DDP": v["time_ratio"], "memory vs torch DDP": v["memory_ratio"]}
        for k, v in d["summary"].items()
    ]
    table(
        rows,
        ["configuration", "time vs torch DDP", "memory vs torch DDP"],
        {"time vs torch DDP": ratio, "memory vs torch DDP": ratio},
    )
    default = [v for k, v in d["summary"].items() if k.startswith("ddpkit ")]
    times, memories = [v["time_ratio"] for v in default], [v["memory_ratio"] for v in default]
    display(
        Markdown(
            f"{d['settings']['world_size']} processes, synthetic CIFAR-shaped batches. ddpkit with its default "
            f"all-reduce: step time {min(times):.2f}–{max(times):.2f}× torch DDP, peak memory {min(memories):.2f}–"
            f"{max(memories):.2f}× (targets: time ≤ 0.9×, memory ≤ 1.0×). Accumulation 4 uses `no_sync` on 3 of every 4 "
            "micro-batches in both. `floor` (where measured) is the same steps with no gradient communication at all: no "
            "data-parallel wrapper can take less."
        )
    )
    floor_text = below_floor(d["records"])
    if floor_text:
        display(Markdown(floor_text))


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
    fig, (loss_ax, accuracy_ax, time_ax) = plt.subplots(
        1, 3, figsize=(17, 4.2), gridspec_kw={"width_ratios": [3, 3, 2]}
    )
    for i, record in enumerate(pipelines):
        losses = record.loss_curve
        window = max(1, len(losses) // 100)
        smooth = [statistics.fmean(losses[j : j + window]) for j in range(0, len(losses) - window + 1, window)]
        loss_ax.plot([j * window for j in range(len(smooth))], smooth, color=f"C{i}", label=record.label)
        accuracy_ax.plot(
            [e["epoch"] + 1 for e in record.epochs],
            [100 * e["test_accuracy"] for e in record.epochs],
            marker="o",
            color=f"C{i}",
            label=record.label,
        )
    loss_ax.set_xlabel("optimizer step")
    loss_ax.set_ylabel("training loss (rank 0, smoothed)")
    # The accuracies differ by tenths of a point: the axis is zoomed to where they are, and its label says so.
    floor = 5 * math.floor((min(100 * e["test_accuracy"] for r in pipelines for e in r.epochs) - 1) / 5)
    accuracy_ax.set_ylim(bottom=floor)
    accuracy_ax.set_xlabel("epoch")
    accuracy_ax.set_ylabel(f"test accuracy (%), axis from {floor} %")
    medians = [r.median_epoch_time_s for r in pipelines]
    time_ax.bar(
        range(len(pipelines)),
        medians,
        color=[f"C{i}" for i in range(len(pipelines))],
        yerr=[
            [m - min(r.epoch_times_s) for m, r in zip(medians, pipelines)],
            [max(r.epoch_times_s) - m for m, r in zip(medians, pipelines)],
        ],
        capsize=6,
    )
    time_ax.set_xticks(range(len(pipelines)), [r.label.replace(", ", "\n") for r in pipelines], fontsize=8)
    time_ax.set_ylabel(f"epoch time (s): median, min–max of {len(like.epochs)}")
    for ax in (loss_ax, accuracy_ax, time_ax):
        ax.grid(alpha=0.3)
    loss_ax.legend(fontsize=8)
    accuracy_ax.legend(fontsize=8)
    plt.tight_layout()
    plt.show()
    rows = [
        {
            "pipeline": r.label,
            "final test accuracy": r.final_test_accuracy,
            "vs torch": 100 * (r.final_test_accuracy - torch_run.final_test_accuracy),
            "epoch time": r,
            "time vs torch": r.median_epoch_time_s / torch_run.median_epoch_time_s,
            "peak memory": r.peak_rss_bytes,
            "memory vs torch": r.peak_rss_bytes / torch_run.peak_rss_bytes,
        }
        for r in pipelines
    ]
    table(
        rows,
        [
            "pipeline",
            "final test accuracy",
            "vs torch",
            "epoch time",
            "time vs torch",
            "peak memory",
            "memory vs torch",
        ],
        {
            "final test accuracy": lambda v: f"{100 * v:.2f} %",
            "vs torch": lambda v: f"{v:+.2f} pp",
            "epoch time": lambda r: (
                f"{r.median_epoch_time_s:.1f} s ({min(r.epoch_times_s):.1f}–{max(r.epoch_times_s):.1f})"
            ),
            "time vs torch": ratio,
            "peak memory": mib,
            "memory vs torch": ratio,
        },
    )
    display(
        Markdown(
            f"{settings['dataset']}, model `{settings['model']}`, {settings['world_size']} processes, accumulation "
            f"{settings['accumulation_steps']}, {settings['epochs']} epochs, same seed and data order. Epoch time: the "
            f"median over the epochs, their range in brackets. **Like for like** ({like.label} against "
            f"{torch_run.label}): ddpkit's final accuracy is "
            f"{100 * (like.final_test_accuracy - torch_run.final_test_accuracy):+.2f} percentage points from torch's "
            f"(target within 0.5), its epoch time {like.median_epoch_time_s / torch_run.median_epoch_time_s:.2f}× and its "
            f"peak memory {like.peak_rss_bytes / torch_run.peak_rss_bytes:.2f}× torch's (targets ≤ 1.0×)."
        )
    )
    for other in pipelines[2:]:
        micro_batches = other.optimizer_steps // settings["epochs"] * settings["accumulation_steps"]
        display(
            Markdown(
                f"**{other.label}** is a row of its own: torch has no SyncBatchNorm on CPU to compare it with. Against "
                f"ddpkit with plain BatchNorm, synchronizing the batch statistics costs "
                f"{other.median_epoch_time_s - like.median_epoch_time_s:+.1f} s per epoch ({micro_batches} micro-batches "
                f"per epoch, two all-reduces per BatchNorm layer each) and changes the final accuracy by "
                f"{100 * (other.final_test_accuracy - like.final_test_accuracy):+.2f} points."
            )
        )
