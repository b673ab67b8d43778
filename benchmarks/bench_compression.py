"""Training with gradients that cross hosts in bfloat16: Fashion-MNIST on simulated hosts, against float32
and against torch's bf16_compress_hook.

    sudo .venv/bin/python benchmarks/bench_compression.py            # 2 hosts x 2 ranks, 3 epochs on 30000 samples
    sudo .venv/bin/python benchmarks/bench_compression.py --quick    # a smoke run, into results/quick/

Every run is ``ddpkit.training.Trainer`` (ddpkit's DDP, plain BatchNorm) with the same configuration and
seed, so the same initial weights and data order, on the same simulated hosts (ddpkit.testing.HostPool:
network and mount namespaces, veth links to a bridge; it needs root). The runs differ only in
``comm_hook`` (ddpkit.training's ``--comm-hook``):
  none            float32 everywhere (ddpkit's own all-reduce)
  bf16_crossing   torch's allreduce_hook on a "ddpkit" group made with
                  ddpkit.Options(cross_host_dtype=torch.bfloat16): float32 inside each host, bfloat16
                  across hosts (Note [Compressed crossing])
  bf16_compress   torch's bf16_compress_hook: every gradient rounded to bfloat16 and all-reduced so,
                  inside hosts too (torch's DDP refuses it on CPU; ddpkit's runs it)
Per run: rank 0's loss at every optimizer step, and the test accuracy and loss after every epoch; the
summary gives each final accuracy against the float32 run's. Results: benchmarks/results/compression.json.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from bench_multihost import ranks_per_host  # noqa: E402
from ddpkit.launch import DistInfo  # noqa: E402
from ddpkit.testing import HostPool  # noqa: E402
from ddpkit.training.config import COMM_HOOKS  # noqa: E402
from ddpkit.training.train import TrainConfig, Trainer  # noqa: E402
from records import CompressionRecord  # noqa: E402

# The runs' shared settings: `make main`'s short run (3 epochs on 30000 samples), plain BatchNorm.
SETTINGS = {"epochs": 3, "limit_train": 30000, "sync_bn": False, "impl": "ddpkit", "seed": 0}
QUICK = {"epochs": 1, "limit_train": 4096, "limit_test": 2000}


def train(settings: dict) -> dict:
    """One whole run on every rank; rank 0's history."""
    config = TrainConfig(**settings, out_dir=None, progress=False)
    info = DistInfo(dist.get_rank(), dist.get_world_size(), 0, dist.get_backend())
    trainer = Trainer(config, info)
    trainer.verbose = False
    summary = trainer.run()
    return {
        "epochs": summary["history"]["epochs"],
        "losses": [step["local_loss"] for step in summary["history"]["steps"]],
        "final_test_accuracy": summary["final_test_accuracy"],
        "final_test_loss": summary["final_test_loss"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topology", default="2x2", help="HOSTSxRANKS, as bench_multihost.py's")
    parser.add_argument("--link", default="unshaped", help='"unshaped" or a tbf rate such as "1gbit"')
    parser.add_argument("--comm-hooks", nargs="+", choices=COMM_HOOKS, default=list(COMM_HOOKS))
    parser.add_argument("--epochs", type=int, default=SETTINGS["epochs"])
    parser.add_argument("--quick", action="store_true", help="1 epoch on 4096 samples")
    args = parser.parse_args()
    reason = HostPool.unavailable()
    if reason:
        sys.exit(f"bench_compression: {reason}")
    settings = {**SETTINGS, "epochs": args.epochs, **(QUICK if args.quick else {})}
    cases = importlib.import_module("bench_compression")  # what the ranks can unpickle by name
    hooks = list(dict.fromkeys(["none", *args.comm_hooks]))  # float32 first: the others are against it
    runs = {}
    pool = HostPool(
        ranks_per_host(args.topology),
        group_timeout=600,
        timeout=3600,
        rate=None if args.link == "unshaped" else args.link,
    )
    try:
        for hook in hooks:
            runs[hook] = pool.run(cases.train, {**settings, "comm_hook": hook}, timeout=3600)[0]
            print(f"{hook}: final test accuracy {runs[hook]['final_test_accuracy']:.2%}", flush=True)
    finally:
        pool.close()
    records = [
        CompressionRecord(
            comm_hook=hook,
            topology=args.topology,
            link=args.link,
            epochs=run["epochs"],
            final_test_accuracy=run["final_test_accuracy"],
            final_test_loss=run["final_test_loss"],
            median_epoch_time_s=statistics.median(epoch["epoch_time_s"] for epoch in run["epochs"]),
            loss_curve=run["losses"],
            accuracy_minus_fp32_points=100 * (run["final_test_accuracy"] - runs["none"]["final_test_accuracy"]),
        )
        for hook, run in runs.items()
    ]
    summary = {f"{r.comm_hook} accuracy - fp32 (points)": r.accuracy_minus_fp32_points for r in records}
    summary["bf16_crossing_within_0.3_points"] = abs(summary.get("bf16_crossing accuracy - fp32 (points)", 0)) <= 0.3
    path = common.write_results(
        "compression",
        backend="gloo",
        device_type="cpu",
        quick=args.quick,
        records=records,
        summary=summary,
        settings={
            **settings,
            "topology": args.topology,
            "link": args.link,
            "comm_hooks": hooks,
            "hosts": "network + mount namespaces, veth to a bridge (ddpkit.testing.HostPool)",
        },
    )
    common.print_table(
        records,
        ["comm_hook", "final_test_accuracy", "accuracy_minus_fp32_points", "final_test_loss", "median_epoch_time_s"],
        headers={
            "final_test_accuracy": "accuracy",
            "accuracy_minus_fp32_points": "- fp32 (points)",
            "final_test_loss": "test loss",
            "median_epoch_time_s": "epoch",
        },
        formats={
            "final_test_accuracy": lambda v: f"{v:.2%}",
            "accuracy_minus_fp32_points": lambda v: f"{v:+.2f}",
            "final_test_loss": lambda v: f"{v:.4f}",
            "median_epoch_time_s": common.seconds,
        },
        align_left=["comm_hook"],
    )
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
