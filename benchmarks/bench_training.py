"""Training: the ddpkit pipeline (DDP + SyncBatchNorm) against PyTorch's (DDP + SyncBatchNorm).

    python benchmarks/bench_training.py                                 # Fashion-MNIST, template Net, to convergence
    python benchmarks/bench_training.py --dataset cifar100 --model resnet18 --epochs 30   # where CIFAR-100 is present
    python benchmarks/bench_training.py --quick                          # a smoke run

Both pipelines are ``ddpkit.train.Trainer`` with the same configuration (seed, data order,
augmentation, optimizer, schedule; ``--world-size`` >= 2 ranks, ``--accumulation-steps`` >= 2)
except ``--impl``. On CPU torch has no SyncBatchNorm: its pipeline then uses plain BatchNorm (the
results say so), and a third pipeline, ``ddpkit_plain_bn`` (ddpkit's DDP with plain BatchNorm,
``--no-sync-bn``), is the like-for-like control: the difference between it and ``ddpkit`` is the cost
of synchronizing batch statistics. Each runs in its own pool of processes, kept alive across the run,
and they alternate epoch by epoch (order rotating) so that machine noise hits all alike. Reported:
time per epoch, peak memory (RSS, max over ranks), loss curve, test accuracy after every epoch.
Results: benchmarks/results/training.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from ddpkit.launch import DistInfo, WorkerPool  # noqa: E402
from ddpkit.train import TrainConfig, Trainer  # noqa: E402

_state: dict = {}


def build(config: TrainConfig) -> dict:
    backend = dist.get_backend()
    info = DistInfo(dist.get_rank(), dist.get_world_size(), dist.get_rank() % max(1, torch.cuda.device_count()),
                    backend)
    trainer = Trainer(config, info)
    _state["trainer"] = trainer
    return {"notes": trainer.notes, "total_steps": trainer.total_steps, "global_batch": trainer.global_batch}


def epoch() -> dict:
    trainer = _state["trainer"]
    first = len(trainer.history["steps"])
    record = trainer.train_epoch()
    steps = trainer.history["steps"][first:]
    record["median_step_s"] = common.median(s["forward_s"] + s["backward_s"] for s in steps) if steps else None
    record["mean_comm_wait_s"] = (sum(s.get("comm_wait_s", 0.0) for s in steps) / len(steps)) if steps else None
    return record


def finish() -> dict:
    summary = _state["trainer"].summary()
    return {"peak_rss_bytes": summary["peak_rss_bytes_max_over_ranks"],
            "losses": [s["local_loss"] for s in summary["history"]["steps"]]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default="fashion_mnist")
    parser.add_argument("--model", default="net")
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--accumulation-steps", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank and micro-batch")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--optimizer", default="sgd")
    parser.add_argument("--data-root")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="2 epochs on 4096 samples")
    parser.add_argument("--output", default="training")
    args = parser.parse_args()
    if args.world_size < 2 or args.accumulation_steps < 2:
        parser.error("the comparison needs --world-size >= 2 and --accumulation-steps >= 2")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    limit_train = 4096 if args.quick else None
    epochs = 2 if args.quick else args.epochs

    runs_dir = Path(tempfile.mkdtemp(prefix="ddpkit-bench-training-"))
    # candidate -> (impl, sync_bn); torch's pipeline synchronizes BatchNorm only where it can (CUDA).
    candidates = {"ddpkit": ("ddpkit", True), "torch": ("torch", True)}
    if backend != "nccl":
        candidates["ddpkit_plain_bn"] = ("ddpkit", False)
    configs = {name: TrainConfig(dataset=args.dataset, data_root=args.data_root, model=args.model, impl=impl,
                                 sync_bn=sync_bn, epochs=epochs, batch_size=args.batch_size,
                                 accumulation_steps=args.accumulation_steps, lr=args.lr, optimizer=args.optimizer,
                                 seed=args.seed, limit_train=limit_train, out_dir=str(runs_dir / name), resume=False,
                                 progress=False, log_every=10**9)
               for name, (impl, sync_bn) in candidates.items()}
    pools = {name: WorkerPool(args.world_size, backend=backend, timeout=24 * 3600, group_timeout=1800)
             for name in configs}
    started = time.monotonic()
    try:
        built = {name: pools[name].run(build, config)[0] for name, config in configs.items()}
        epochs_by_name = {name: [] for name in configs}
        names = list(configs)
        for index in range(epochs):
            shift = index % len(names)
            for name in names[shift:] + names[:shift]:
                record = pools[name].run(epoch)[0]
                epochs_by_name[name].append(record)
                print(f"[{time.monotonic() - started:7.0f}s] {name:15s} epoch {index + 1}: test accuracy "
                      f"{100 * record['test_accuracy']:.2f}%, {record['epoch_time_s']:.1f}s", flush=True)
        finals = {name: pools[name].run(finish)[0] for name in configs}
    finally:
        for pool in pools.values():
            pool.close()

    records = []
    for name, config in configs.items():
        history = epochs_by_name[name]
        records.append({
            "candidate": name, "impl": config.impl, "sync_bn": config.sync_bn, "world_size": args.world_size,
            "notes": built[name]["notes"], "global_batch": built[name]["global_batch"],
            "optimizer_steps": built[name]["total_steps"], "epochs": history,
            "final_test_accuracy": history[-1]["test_accuracy"], "final_test_loss": history[-1]["test_loss"],
            "median_epoch_time_s": common.median(r["epoch_time_s"] for r in history),
            "peak_rss_bytes": finals[name]["peak_rss_bytes"],
            "loss_curve": finals[name]["losses"],
        })
    by_name = {record["candidate"]: record for record in records}

    def compare(name: str) -> dict:
        mine, theirs = by_name[name], by_name["torch"]
        return {"accuracy_difference_pp": 100 * (mine["final_test_accuracy"] - theirs["final_test_accuracy"]),
                "epoch_time_ratio": mine["median_epoch_time_s"] / theirs["median_epoch_time_s"],
                "memory_ratio": mine["peak_rss_bytes"] / theirs["peak_rss_bytes"]}

    summary = compare("ddpkit")
    if "ddpkit_plain_bn" in by_name:
        summary["plain_bn_vs_torch"] = compare("ddpkit_plain_bn")
    path = common.write_results(
        args.output, backend=backend, device_type="cuda" if torch.cuda.is_available() else "cpu",
        settings={**{k: v for k, v in dataclasses.asdict(configs["ddpkit"]).items()
                     if k not in ("impl", "sync_bn", "out_dir")},
                  "world_size": args.world_size, "threads_per_process": pools["ddpkit"].threads,
                  "candidates": {name: {"impl": impl, "sync_bn": sync_bn} for name, (impl, sync_bn) in candidates.items()},
                  "interleaving": "epochs alternate between the pipelines, order rotating"},
        records=records, summary=summary)
    common.print_table(records, ["candidate", "final_test_accuracy", "median_epoch_time_s", "peak_rss_bytes"])
    for name, ratios in [("ddpkit", summary), ("ddpkit_plain_bn", summary.get("plain_bn_vs_torch"))]:
        if ratios:
            print(f"{name} vs torch: accuracy difference {ratios['accuracy_difference_pp']:+.2f} pp, epoch time "
                  f"x{ratios['epoch_time_ratio']:.3f}, memory x{ratios['memory_ratio']:.3f}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
