"""2. SyncBatchNorm: ddpkit's against torch's BatchNorm alone, its local kernels and its memory."""

from __future__ import annotations

import statistics

import matplotlib.pyplot as plt
from IPython.display import Markdown

from .formatting import kib, ratio, us
from .output import command, display, table

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
    rows = [
        {
            "workers": r.world_size,
            "shape": "×".join(map(str, r.shape)),
            "ddpkit (auto)": r.t_ddpkit,
            "ddpkit (process_group)": r.t_ddpkit_pg,
            "torch BatchNorm alone": r.t_torch_bn_local,
            "auto/BN": _over_local(r, r.t_ddpkit),
            "pg/BN": _over_local(r, r.t_ddpkit_pg),
            "unchecked/BN": _over_local(r, r.t_ddpkit_unchecked),
            "auto/(BN + 2 gloo)": r.t_ddpkit / r.t_floor,
            "local kernels/BN": _over_local(r, r.t_ddpkit_local),
        }
        for r in distributed
    ]
    table(
        rows,
        [
            "workers",
            "shape",
            "ddpkit (auto)",
            "ddpkit (process_group)",
            "torch BatchNorm alone",
            "auto/BN",
            "pg/BN",
            "unchecked/BN",
            "auto/(BN + 2 gloo)",
            "local kernels/BN",
        ],
        {
            "ddpkit (auto)": us,
            "ddpkit (process_group)": us,
            "torch BatchNorm alone": us,
            "auto/BN": ratio,
            "pg/BN": ratio,
            "unchecked/BN": ratio,
            "auto/(BN + 2 gloo)": ratio,
            "local kernels/BN": ratio,
        },
    )
    display(
        Markdown(
            f"Forward + backward of one layer, global batch split evenly, {' or '.join(map(str, sorted(steps)))} steps "
            "back to back per repetition as a training loop runs them (per step: the slowest rank's time over the steps, "
            "median over repetitions). On CPU torch has no SyncBatchNorm, so the baseline is torch's BatchNorm on the "
            "same local batch with no communication at all: `auto/BN` is what synchronizing the batch costs on top of a "
            f"plain batch norm. Target at 2 workers: ≤ {SYNCBN_TARGET}×. The column `auto/(BN + 2 gloo)` divides by the "
            "baseline this report used before, torch's own parts (that BatchNorm plus one gloo all-reduce of 2C+1 and "
            "one of 2C float64 values): that floor already pays gloo's latency twice, so ratios against it look far "
            "better than against BatchNorm alone, and earlier versions of this report judged the target against it."
        )
    )


def syncbn_plot(R: dict) -> None:
    """A plot per world size: each candidate's time over torch's BatchNorm alone, by shape, with the target."""
    distributed = syncbn_distributed(R)
    fig, axes = plt.subplots(1, 2, figsize=(13, 3.8), sharey=True)
    for ax, ws in zip(axes, sorted({r.world_size for r in distributed})):
        rows = [r for r in distributed if r.world_size == ws]
        labels = ["×".join(map(str, r.shape)) for r in rows]
        xs = range(len(rows))
        for offset, key, label in [
            (-0.3, "t_ddpkit", "ddpkit (auto)"),
            (-0.1, "t_ddpkit_unchecked", "ddpkit (auto, unchecked)"),
            (0.1, "t_ddpkit_pg", "ddpkit (process_group)"),
            (0.3, "t_torch_emulated", "torch's parts: BatchNorm + 2 gloo all-reduces in one step"),
        ]:
            if all(getattr(r, key) is not None for r in rows):
                ax.bar(
                    [x + offset for x in xs],
                    [getattr(r, key) / r.t_torch_bn_local for r in rows],
                    width=0.18,
                    label=label,
                )
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
    table(
        [{"shape / threads": k, "ddpkit local / torch BN": v} for k, v in local.items()],
        ["shape / threads", "ddpkit local / torch BN"],
        {"ddpkit local / torch BN": ratio},
    )
    memory_rows = [
        {
            "workers": r.world_size,
            "shape": "×".join(map(str, r.shape)),
            "ddpkit bytes": r.alloc_ddpkit,
            "BatchNorm bytes": r.alloc_torch_bn_local,
            "extra per channel": r.alloc_extra_per_channel,
        }
        for r in distributed
    ]
    table(
        memory_rows,
        ["workers", "shape", "ddpkit bytes", "BatchNorm bytes", "extra per channel"],
        {"ddpkit bytes": kib, "BatchNorm bytes": kib, "extra per channel": lambda v: f"{v:.1f} B"},
    )
    display(
        Markdown(
            f"At 2 workers the better of ddpkit's two all-reduce choices is {min(best):.2f}–{max(best):.2f}× torch's "
            f"BatchNorm alone ({sum(b <= SYNCBN_TARGET for b in best)} of {len(best)} configurations within "
            f"{SYNCBN_TARGET}×); against the older floor (BatchNorm plus two gloo all-reduces) `auto` is "
            f"{min(floor):.2f}–{max(floor):.2f}×. The local kernels alone are {min(local.values()):.2f}–"
            f"{max(local.values()):.2f}× torch's CPU batch norm (target ≤ 1.0×); memory is at most "
            f"{s['summary']['max_alloc_extra_per_channel_bytes']:.1f} bytes per channel above BatchNorm's."
        )
    )
    unchecked = [r.t_ddpkit_unchecked / r.t_torch_bn_local for r in two if r.t_ddpkit_unchecked is not None]
    checked = [r.t_ddpkit / r.t_torch_bn_local for r in two]
    if unchecked:
        display(
            Markdown(
                f"With the collective checks off (one header exchange less per all-reduce), `auto` is "
                f"{min(unchecked):.2f}–{max(unchecked):.2f}× torch's BatchNorm alone at 2 workers "
                f"({sum(u <= SYNCBN_TARGET for u in unchecked)} of {len(unchecked)} within {SYNCBN_TARGET}×), against "
                f"{min(checked):.2f}–{max(checked):.2f}× with them on (median {statistics.median(unchecked):.2f}× vs "
                f"{statistics.median(checked):.2f}×)."
            )
        )
