"""Training: the ddpkit pipeline (DDP + SyncBatchNorm) against PyTorch's (DDP + SyncBatchNorm).

    python benchmarks/bench_training.py                                 # Fashion-MNIST, template Net, to convergence
    python benchmarks/bench_training.py --dataset cifar100 --model resnet18 --epochs 30   # where CIFAR-100 is present
    python benchmarks/bench_training.py --quick                          # a smoke run

Both pipelines are ``ddpkit.train.Trainer`` with the same configuration (seed, data order,
augmentation, optimizer, schedule; ``--world-size`` >= 2 ranks, ``--accumulation-steps`` >= 2)
except ``--impl``. On CPU torch has no SyncBatchNorm: its pipeline then uses plain BatchNorm (the
results say so). Each runs in its own pool of processes, kept alive across the run, and the two
alternate epoch by epoch (order rotating) so that machine noise hits both alike. Reported: time per
epoch, peak memory (RSS, max over ranks), loss curve, test accuracy after every epoch.
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
    configs = {impl: TrainConfig(dataset=args.dataset, data_root=args.data_root, model=args.model, impl=impl,
                                 epochs=epochs, batch_size=args.batch_size, accumulation_steps=args.accumulation_steps,
                                 lr=args.lr, optimizer=args.optimizer, seed=args.seed, limit_train=limit_train,
                                 out_dir=str(runs_dir / impl), resume=False, progress=False, log_every=10**9)
               for impl in ("ddpkit", "torch")}
    pools = {impl: WorkerPool(args.world_size, backend=backend, timeout=24 * 3600, group_timeout=1800)
             for impl in configs}
    started = time.monotonic()
    try:
        built = {impl: pools[impl].run(build, config)[0] for impl, config in configs.items()}
        epochs_by_impl = {impl: [] for impl in configs}
        impls = list(configs)
        for index in range(epochs):
            order = impls if index % 2 == 0 else impls[::-1]
            for impl in order:
                record = pools[impl].run(epoch)[0]
                epochs_by_impl[impl].append(record)
                print(f"[{time.monotonic() - started:7.0f}s] {impl:6s} epoch {index + 1}: test accuracy "
                      f"{100 * record['test_accuracy']:.2f}%, {record['epoch_time_s']:.1f}s", flush=True)
        finals = {impl: pools[impl].run(finish)[0] for impl in configs}
    finally:
        for pool in pools.values():
            pool.close()

    records = []
    for impl in configs:
        history = epochs_by_impl[impl]
        records.append({
            "impl": impl, "world_size": args.world_size, "notes": built[impl]["notes"],
            "global_batch": built[impl]["global_batch"], "optimizer_steps": built[impl]["total_steps"],
            "epochs": history, "final_test_accuracy": history[-1]["test_accuracy"],
            "final_test_loss": history[-1]["test_loss"],
            "median_epoch_time_s": common.median(r["epoch_time_s"] for r in history),
            "peak_rss_bytes": finals[impl]["peak_rss_bytes"],
            "loss_curve": finals[impl]["losses"],
        })
    ddpkit_record, torch_record = records
    summary = {
        "accuracy_difference_pp": 100 * (ddpkit_record["final_test_accuracy"] - torch_record["final_test_accuracy"]),
        "epoch_time_ratio": ddpkit_record["median_epoch_time_s"] / torch_record["median_epoch_time_s"],
        "memory_ratio": ddpkit_record["peak_rss_bytes"] / torch_record["peak_rss_bytes"],
    }
    path = common.write_results(
        args.output, backend=backend, device_type="cuda" if torch.cuda.is_available() else "cpu",
        settings={**{k: v for k, v in dataclasses.asdict(configs["ddpkit"]).items() if k not in ("impl", "out_dir")},
                  "world_size": args.world_size, "threads_per_process": pools["ddpkit"].threads,
                  "schedule": "epochs alternate between the two pipelines, order rotating"},
        records=records, summary=summary)
    common.print_table(records, ["impl", "final_test_accuracy", "median_epoch_time_s", "peak_rss_bytes"])
    print(f"accuracy difference {summary['accuracy_difference_pp']:+.2f} pp, epoch time x{summary['epoch_time_ratio']:.3f}, "
          f"memory x{summary['memory_ratio']:.3f}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
