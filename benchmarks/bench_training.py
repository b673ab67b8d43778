"""Training: ddpkit's pipeline against PyTorch's, like for like (same DDP job, same BatchNorm).

    python benchmarks/bench_training.py          # `make main`: 3 epochs on 30000 samples, under 10 minutes on 2 cores
    python benchmarks/bench_training.py --full   # the full-length comparison: 15 epochs on all 60000 (about 35 minutes)
    python benchmarks/bench_training.py --dataset cifar100 --model resnet18 --epochs 30   # where CIFAR-100 is present
    python benchmarks/bench_training.py --quick  # a smoke run
    python benchmarks/bench_training.py --plot-from benchmarks/results/training.json   # only redraw a saved run

Every pipeline is ``ddpkit.training.Trainer`` with the same configuration (seed, data order,
augmentation, optimizer, schedule; ``--world-size`` >= 2 ranks, ``--accumulation-steps`` >= 2)
except ``--impl`` and ``--sync-bn``. The headline compares ``ddpkit`` (ddpkit's DDP) with ``torch``
(torch's DDP) on the same BatchNorm: on CUDA both synchronize it (ddpkit.SyncBatchNorm against
torch.nn.SyncBatchNorm); on CPU, where torch has no SyncBatchNorm, both run plain BatchNorm, and a
third pipeline, ``ddpkit_sync_bn`` (ddpkit's DDP with ddpkit.SyncBatchNorm), is its own row: the
difference between it and ``ddpkit`` is the cost of synchronizing batch statistics. Each pipeline runs
in its own pool of processes, kept alive across the run, and they take turns every ``--block-steps``
optimizer steps (order rotating, ``common.interleave``): each block of steps is run by every pipeline
one right after the other, on the same data, so that a slow spell of the machine falls on all alike.
The headline ratio is the median over those blocks of ddpkit's time over torch's (the first block, the
warm-up, left out), with its 95% confidence interval; the run also measures how much CPU other
processes took meanwhile (``common.MachineLoad``), and says so when the interval includes 1.0 or the
machine was loaded. Reported besides: time per epoch (median, min and max over the epochs, training
only), peak memory (RSS, max over ranks), loss curve, test accuracy after every epoch; each record
says which BatchNorm really ran (``batch_norm``). A progress bar follows each epoch where stderr is a
terminal; at the end a table compares the pipelines and a plot (loss curves, accuracy per epoch, epoch
time, peak memory) is saved next to the results as a PNG.

Where results go: ``--full`` writes ``training.json`` (+ ``training.png``) to benchmarks/results/,
the measured figures the report reads, ``--quick`` to benchmarks/results/quick/ (``$DDPKIT_RESULTS_DIR``
overrides both); the short default run writes ``runs/main/training.json`` and ``runs/main/training.png``, so that it never
replaces the full-length results (``--results-dir`` puts either elsewhere). The short run evaluates
on the whole test set, so its final accuracies compare with the full run's, a little lower.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from ddpkit.launch import DistInfo  # noqa: E402
from ddpkit.testing import WorkerPool  # noqa: E402
from ddpkit.training.config import SHARD_MODES  # noqa: E402
from ddpkit.training.data import dataset_name  # noqa: E402
from ddpkit.training.train import TrainConfig, Trainer  # noqa: E402
from records import TrainingRecord, load_records  # noqa: E402

_state: dict = {}


def build(config: TrainConfig, label: str = "") -> dict:
    backend = dist.get_backend()
    info = DistInfo(
        dist.get_rank(), dist.get_world_size(), dist.get_rank() % max(1, torch.cuda.device_count()), backend
    )
    trainer = Trainer(config, info)
    trainer.progress_label = label
    trainer.verbose = False  # the parent prints one line per epoch
    _state["trainer"] = trainer
    return {
        "notes": trainer.notes,
        "total_steps": trainer.total_steps,
        "global_batch": trainer.data.global_batch,
        "batch_norm": trainer.batch_norm,
        "steps_per_epoch": trainer.data.steps_per_epoch,
    }


def block(until_step: int) -> dict:
    """Trains up to optimizer step ``until_step`` (or the end of the epoch) and returns the training
    time of those steps, without the evaluation, and the epoch's record where the epoch ended."""
    trainer = _state["trainer"]
    before, first = trainer._epoch_time_s, trainer.step
    record = trainer.train_epoch(until_step=until_step)
    seconds = (record["epoch_time_s"] if record else trainer._epoch_time_s) - before
    if record:
        steps = [s for s in trainer.history["steps"] if s["epoch"] == record["epoch"]]
        record["median_step_s"] = common.median(s["forward_s"] + s["backward_s"] for s in steps) if steps else None
        record["mean_comm_wait_s"] = (sum(s.get("comm_wait_s", 0.0) for s in steps) / len(steps)) if steps else None
    return {"steps": trainer.step - first, "seconds": seconds, "epoch": record}


def block_ends(steps_per_epoch: int, total_steps: int, block_steps: int) -> list[int]:
    """The optimizer steps at which the blocks end: each epoch cut into blocks of about ``block_steps``,
    none across an epoch's end (where the evaluation runs)."""
    ends = []
    for start in range(0, total_steps, steps_per_epoch):
        end = min(start + steps_per_epoch, total_steps)
        count = max(1, round((end - start) / block_steps))
        ends += [start + round(k * (end - start) / count) for k in range(1, count + 1)]
    return ends


def paired_ratios(mine: list[dict], theirs: list[dict]) -> list[float]:
    """The time ratio of every block both pipelines ran (the same steps, one right after the other),
    the first left out: it pays for the warm-up."""
    return [
        a["seconds"] / b["seconds"]
        for a, b in zip(mine[1:], theirs[1:])
        if a["steps"] == b["steps"] and b["seconds"] > 0
    ]


def finish() -> dict:
    summary = _state["trainer"].summary()
    return {
        "peak_rss_bytes": summary["peak_rss_bytes_max_over_ranks"],
        "losses": [s["local_loss"] for s in summary["history"]["steps"]],
    }


def pipelines(backend: str, shards: list[str] = ()) -> dict[str, tuple[str, bool, str]]:
    """The pipelines to compare, name -> (impl, sync_bn, shard). "ddpkit" and "torch" are the like-for-like
    pair: torch synchronizes BatchNorm only on CUDA (nccl), so elsewhere both run plain BatchNorm and ddpkit's
    SyncBatchNorm is a row of its own. Each of ``shards`` (--shard: train.py's) adds "ddpkit_shard_<it>",
    the "ddpkit" pipeline with that sharding."""
    if backend == "nccl":
        chosen = {"ddpkit": ("ddpkit", True, "none"), "torch": ("torch", True, "none")}
    else:
        chosen = {
            "ddpkit": ("ddpkit", False, "none"),
            "torch": ("torch", False, "none"),
            "ddpkit_sync_bn": ("ddpkit", True, "none"),
        }
    for shard in shards:
        chosen[f"ddpkit_shard_{shard}"] = ("ddpkit", chosen["ddpkit"][1], shard)
    return chosen


# The settings of the runs (per rank and micro-batch: --batch-size).
FULL = {"epochs": 15, "limit_train": None}  # `--full`: the measured comparison the report shows
SHORT = {"epochs": 3, "limit_train": 30000}  # the default (`make main`): under 10 minutes on 2 cores
QUICK = {"epochs": 2, "limit_train": 4096}  # `--quick`: a smoke run
BLOCK_STEPS = 10  # long enough that a turn's switch costs little, short enough for many pairs close in time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    length = parser.add_mutually_exclusive_group()
    length.add_argument(
        "--full",
        action="store_true",
        help=f"the full-length comparison ({FULL['epochs']} epochs on the whole training set, about "
        "35 minutes on 2 cores), written where the report reads it",
    )
    length.add_argument(
        "--quick", action="store_true", help=f"a smoke run ({QUICK['epochs']} epochs on {QUICK['limit_train']} samples)"
    )
    parser.add_argument("--dataset", default="fashion_mnist")
    parser.add_argument("--model", default="net")
    parser.add_argument(
        "--epochs",
        type=int,
        help=f"default: {SHORT['epochs']} ({FULL['epochs']} with --full, {QUICK['epochs']} with --quick)",
    )
    parser.add_argument(
        "--limit-train",
        type=int,
        help=f"use the first N training samples (default: {SHORT['limit_train']}; all with --full)",
    )
    parser.add_argument("--limit-test", type=int, help="evaluate each epoch on the first N test samples (default: all)")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--accumulation-steps", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank and micro-batch")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--optimizer", default="sgd")
    parser.add_argument("--data-root")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--shard",
        nargs="+",
        default=[],
        choices=[mode for mode in SHARD_MODES if mode != "none"],
        help="add the ddpkit pipeline with train.py's --shard of each (ZeRO-1: optimizer, ZeRO-2: gradients)",
    )
    parser.add_argument("--output", default="training", help="results name: <results-dir>/<output>.json and .png")
    parser.add_argument(
        "--results-dir",
        help=f"default: {common.RESULTS_DIR} with --full, {common.QUICK_RESULTS_DIR} with --quick, "
        f"else {common.REPO_ROOT / 'runs/main'} ($DDPKIT_RESULTS_DIR overrides the first two)",
    )
    parser.add_argument(
        "--block-steps",
        type=int,
        default=BLOCK_STEPS,
        help="optimizer steps per timed block: the pipelines take turns block by block",
    )
    parser.add_argument(
        "--no-progress",
        dest="progress",
        action="store_false",
        default=None,
        help="no progress bars (default: bars only where stderr is a terminal)",
    )
    parser.add_argument("--no-plot", dest="plot", action="store_false", help="no PNG")
    parser.add_argument("--plot-from", metavar="JSON", help="only draw the plot of saved results (next to them)")
    args = parser.parse_args()
    if args.plot_from:
        print(f"wrote {plot(json.loads(Path(args.plot_from).read_text()), Path(args.plot_from).with_suffix('.png'))}")
        return
    if args.world_size < 2 or args.accumulation_steps < 2:
        parser.error("the comparison needs --world-size >= 2 and --accumulation-steps >= 2")
    if args.block_steps < 1:
        parser.error("--block-steps must be >= 1")
    try:
        args.dataset = dataset_name(args.dataset)
    except ValueError as error:
        parser.error(str(error))
    length = FULL if args.full else QUICK if args.quick else SHORT
    epochs = args.epochs if args.epochs is not None else length["epochs"]
    limit_train = args.limit_train if args.limit_train is not None else length["limit_train"]
    results_dir = (
        Path(args.results_dir)
        if args.results_dir
        else (common.results_dir(args.quick) if args.full or args.quick else common.REPO_ROOT / "runs" / "main")
    )
    backend = "nccl" if torch.cuda.is_available() else "gloo"

    candidates = pipelines(backend, args.shard)
    configs = {
        name: TrainConfig(
            dataset=args.dataset,
            data_root=args.data_root,
            model=args.model,
            impl=impl,
            sync_bn=sync_bn,
            shard=shard,
            epochs=epochs,
            batch_size=args.batch_size,
            accumulation_steps=args.accumulation_steps,
            lr=args.lr,
            optimizer=args.optimizer,
            seed=args.seed,
            limit_train=limit_train,
            limit_test=args.limit_test,
            out_dir=None,
            resume=False,
            progress=args.progress,
            log_every=10**9,
        )
        for name, (impl, sync_bn, shard) in candidates.items()
    }
    width = max(map(len, configs))
    print(
        f"Training {args.model} on {args.dataset} ({limit_train or 'all'} training samples, {epochs} epochs) with "
        f"{', '.join(configs)}: {args.world_size} processes each, taking turns every {args.block_steps} steps"
        + ("" if args.full else "; --full for the full-length comparison"),
        flush=True,
    )
    pools = {
        name: WorkerPool(args.world_size, backend=backend, timeout=24 * 3600, group_timeout=1800) for name in configs
    }
    started = time.monotonic()
    try:
        built = {name: pools[name].run(build, config, name.ljust(width))[0] for name, config in configs.items()}

        first = built[next(iter(configs))]
        ends = block_ends(first["steps_per_epoch"], first["total_steps"], args.block_steps)
        done = {name: 0 for name in configs}  # blocks each pipeline has run

        def run_block(name: str) -> dict:
            result = pools[name].run(block, ends[done[name]])[0]
            done[name] += 1
            load.sample()
            record = result["epoch"]
            if record:
                print(
                    f"[{time.monotonic() - started:7.0f}s] {name:{width}s} epoch {record['epoch'] + 1}/{epochs}: "
                    f"test accuracy {100 * record['test_accuracy']:.2f}%, {record['epoch_time_s']:.1f}s",
                    flush=True,
                )
            return result

        # Short blocks in turn, not whole epochs: a slow spell of the machine then falls on both
        # pipelines of a pair, and the many pairs give the ratio an interval.
        load = common.MachineLoad()
        load.start()
        blocks = common.interleave(list(configs), len(ends), run_block)
        machine_load = load.stop()
        finals = {name: pools[name].run(finish)[0] for name in configs}
    finally:
        for pool in pools.values():
            pool.close()
    elapsed = time.monotonic() - started
    epochs_by_name = {name: [b["epoch"] for b in results if b["epoch"]] for name, results in blocks.items()}

    records = []
    for name, config in configs.items():
        history = epochs_by_name[name]
        batch_norm = built[name]["batch_norm"]  # what ran, which need not be what was asked for
        records.append(
            TrainingRecord(
                candidate=name,
                impl=config.impl,
                shard=config.shard if config.shard != "none" else None,
                sync_bn=batch_norm != "BatchNorm",
                batch_norm=batch_norm,
                world_size=args.world_size,
                notes=built[name]["notes"],
                global_batch=built[name]["global_batch"],
                optimizer_steps=built[name]["total_steps"],
                epochs=history,
                final_test_accuracy=history[-1]["test_accuracy"],
                final_test_loss=history[-1]["test_loss"],
                median_epoch_time_s=common.median(r["epoch_time_s"] for r in history),
                peak_rss_bytes=finals[name]["peak_rss_bytes"],
                loss_curve=finals[name]["losses"],
                block_times_s=[b["seconds"] for b in blocks[name]],
                block_steps=[b["steps"] for b in blocks[name]],
            )
        )
    by_name = {record.candidate: record for record in records}

    def compare(name: str) -> dict:
        mine, theirs = by_name[name], by_name["torch"]
        return {
            "accuracy_difference_pp": 100 * (mine.final_test_accuracy - theirs.final_test_accuracy),
            "epoch_time_ratio": mine.median_epoch_time_s / theirs.median_epoch_time_s,
            "time_ratio": common.ratio_spread(paired_ratios(blocks[name], blocks["torch"])),
            "memory_ratio": mine.peak_rss_bytes / theirs.peak_rss_bytes,
        }

    # The headline: ddpkit against torch on the same BatchNorm; ddpkit's SyncBatchNorm (CPU) beside it.
    summary = {"batch_norm": by_name["ddpkit"].batch_norm, **compare("ddpkit"), "machine_load": machine_load}
    if "ddpkit_sync_bn" in by_name:
        summary["ddpkit_sync_bn_vs_torch"] = compare("ddpkit_sync_bn")
    for shard in args.shard:
        summary[f"ddpkit_shard_{shard}_vs_torch"] = compare(f"ddpkit_shard_{shard}")
    path = common.write_results(
        args.output,
        backend=backend,
        device_type="cuda" if torch.cuda.is_available() else "cpu",
        settings={
            **{
                k: v
                for k, v in dataclasses.asdict(configs["ddpkit"]).items()
                if k not in ("impl", "sync_bn", "out_dir", "progress")
            },
            "world_size": args.world_size,
            "threads_per_process": pools["ddpkit"].threads,
            "candidates": {
                r.candidate: {
                    "impl": r.impl,
                    "sync_bn": r.sync_bn,
                    "batch_norm": r.batch_norm,
                    "shard": r.shard or "none",
                }
                for r in records
            },
            "headline": "ddpkit against torch, both with the same BatchNorm",
            "block_steps": args.block_steps,
            "interleaving": "the pipelines take turns every block_steps optimizer steps (none across an "
            "epoch's end), order rotating; time_ratio: the median of the blocks' time "
            "ratios, the first block left out, with its confidence interval",
        },
        records=records,
        summary=summary,
        directory=results_dir,
    )
    print()
    print_comparison(records, by_name, summary)
    for note in sorted({note for record in records for note in record.notes}):
        print(f"note: {note}")
    print(f"training took {elapsed / 60:.1f} minutes; wrote {path}")
    if args.plot:
        try:
            print(f"wrote {plot(json.loads(path.read_text()), path.with_suffix('.png'))}")
        except ImportError:
            print("no plot: matplotlib is missing (pip install -e '.[report]')")


def print_comparison(records: list[TrainingRecord], by_name: dict, summary: dict) -> None:
    """The pipelines side by side, each with its ratios to torch's; the like-for-like pair first."""
    base = by_name["torch"]
    ratios = {"ddpkit": summary["time_ratio"]}
    if "ddpkit_sync_bn_vs_torch" in summary:
        ratios["ddpkit_sync_bn"] = summary["ddpkit_sync_bn_vs_torch"]["time_ratio"]
    rows = [
        {
            "pipeline": r.candidate,
            "accuracy": f"{100 * r.final_test_accuracy:.2f} %",
            "accuracy_vs_torch": f"{100 * (r.final_test_accuracy - base.final_test_accuracy):+.2f} pp",
            "epoch_time": r.median_epoch_time_s,
            "time_vs_torch": (
                f"{ratios[r.candidate]['median']:.3f}x [{ratios[r.candidate]['low']:.3f}, "
                f"{ratios[r.candidate]['high']:.3f}]"
            )
            if r.candidate in ratios
            else "",
            "memory": r.peak_rss_bytes,
            "memory_vs_torch": r.peak_rss_bytes / base.peak_rss_bytes,
        }
        for r in records
    ]
    common.print_table(
        rows,
        list(rows[0]),
        align_left={"pipeline"},
        headers={
            "accuracy": "accuracy",
            "accuracy_vs_torch": "vs torch",
            "epoch_time": "epoch time",
            "time_vs_torch": "time vs torch [95% CI]",
            "memory": "peak memory",
            "memory_vs_torch": "vs torch",
        },
        formats={"epoch_time": lambda v: f"{v:.1f} s", "memory": common.mebibytes, "memory_vs_torch": common.times},
    )
    for r in records:
        print(f"  {r.candidate}: {r.label}")
    print(
        "accuracy: on the test set after the last epoch; epoch time: training only, median over the epochs\n"
        "time vs torch: the median ratio of the blocks of steps both ran one after the other, and its 95% CI"
    )
    like, spread = by_name["ddpkit"], summary["time_ratio"]
    print(
        f"headline, like for like: {like.label} against {base.label}:\n"
        f"  training time {common.spread_text(spread)}: {common.verdict(spread, 'ddpkit', 'torch')}\n"
        f"  final accuracy "
        f"{100 * (like.final_test_accuracy - base.final_test_accuracy):+.2f} pp, peak memory "
        f"{like.peak_rss_bytes / base.peak_rss_bytes:.3f}x (below 1x: ddpkit takes less)"
    )
    print(common.load_text(summary["machine_load"]))


def plot(document: dict, path: Path) -> Path:
    """Loss curves, test accuracy per epoch, epoch time (median, min-max whiskers) and peak memory of
    every pipeline, as a PNG; each pipeline is labelled with the DDP and the BatchNorm it ran."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    records, settings = load_records(document, without_kind=TrainingRecord), document["settings"]
    fig, axes = plt.subplots(1, 4, figsize=(21, 4.8), gridspec_kw={"width_ratios": [3, 3, 2.4, 2.4]})
    loss_axis, accuracy_axis, time_axis, memory_axis = axes
    labels = [record.label for record in records]
    colors = [f"C{i}" for i in range(len(records))]
    for record, label, color in zip(records, labels, colors):
        losses = record.loss_curve
        window = max(1, len(losses) // 100)
        smooth = [statistics.fmean(losses[i : i + window]) for i in range(0, len(losses) - window + 1, window)]
        loss_axis.plot([i * window for i in range(len(smooth))], smooth, color=color, label=label)
        accuracy_axis.plot(
            [e["epoch"] + 1 for e in record.epochs],
            [100 * e["test_accuracy"] for e in record.epochs],
            marker="o",
            color=color,
            label=label,
        )
    loss_axis.set(xlabel="optimizer step", ylabel="training loss (rank 0, smoothed)")
    # The accuracies differ by tenths of a point: the axis is zoomed to where they are, and says so.
    lowest = min(100 * e["test_accuracy"] for r in records for e in r.epochs)
    floor = 5 * math.floor((lowest - 1) / 5)
    accuracy_axis.set_ylim(bottom=floor)
    accuracy_axis.set(xlabel="epoch", ylabel=f"test accuracy (%), axis from {floor} %")
    accuracy_axis.xaxis.set_major_locator(MaxNLocator(integer=True))
    short = [label.replace(", ", "\n") for label in labels]
    medians = [r.median_epoch_time_s for r in records]
    time_axis.bar(
        short,
        medians,
        color=colors,
        yerr=[
            [m - min(r.epoch_times_s) for m, r in zip(medians, records)],
            [max(r.epoch_times_s) - m for m, r in zip(medians, records)],
        ],
        capsize=6,
    )
    time_axis.set(ylabel=f"epoch time (s): median, min-max of {len(records[0].epochs)}")
    memory_axis.bar(short, [r.peak_rss_bytes / 2**20 for r in records], color=colors)
    memory_axis.set(ylabel="peak memory, max over ranks (MiB)")
    for axis in axes:
        axis.grid(alpha=0.3)
    for axis in (time_axis, memory_axis):
        axis.tick_params(axis="x", labelsize=7)
    loss_axis.legend(fontsize=8)
    accuracy_axis.legend(fontsize=8)
    environment = document["environment"]
    commit = str(environment["git_commit"])
    commit = commit[:10] + (" (uncommitted changes)" if commit.endswith("-dirty") else "")
    fig.suptitle(
        f"{settings['dataset']}, {settings['model']}: {settings['world_size']} processes, "
        f"{settings['epochs']} epochs on {settings.get('limit_train') or 'all'} training samples, "
        f"accumulation {settings['accumulation_steps']}; ddpkit against torch with the same BatchNorm "
        f"({environment['device_type']}, commit {commit}, "
        f"{environment['date'][:10]})"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


if __name__ == "__main__":
    main()
