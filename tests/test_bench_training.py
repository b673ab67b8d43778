"""benchmarks/bench_training.py compares like for like and records what each pipeline really ran."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ddpkit.training.data import FASHION_MNIST_ROOT

from helpers import uncompressed_fashion_mnist

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
import bench_training  # noqa: E402


def test_the_headline_pair_runs_the_same_batch_norm():
    cpu = bench_training.pipelines("gloo")
    assert cpu["ddpkit"] == ("ddpkit", False, "none") and cpu["torch"] == ("torch", False, "none")  # plain both
    assert cpu["ddpkit_sync_bn"] == ("ddpkit", True, "none")  # ddpkit's SyncBatchNorm: a row of its own
    assert bench_training.pipelines("nccl") == {"ddpkit": ("ddpkit", True, "none"), "torch": ("torch", True, "none")}
    # --shard adds the ddpkit pipeline with the sharding, on its BatchNorm
    assert bench_training.pipelines("gloo", ["gradients"])["ddpkit_shard_gradients"] == ("ddpkit", False, "gradients")


def test_blocks_cut_every_epoch_and_never_cross_its_end():
    ends = bench_training.block_ends(234, 702, 20)
    assert {234, 468, 702} <= set(ends) and ends == sorted(set(ends)) and ends[-1] == 702
    assert all(15 <= b - a <= 25 for a, b in zip([0, *ends], ends))
    assert bench_training.block_ends(10, 25, 4) == [5, 10, 15, 20, 25]  # --max-steps ends within an epoch
    assert bench_training.block_ends(3, 6, 20) == [3, 6]  # an epoch shorter than a block is one block


def test_the_ratio_pairs_blocks_and_leaves_out_the_warm_up():
    mine = [{"steps": 5, "seconds": 9.0}, {"steps": 5, "seconds": 1.0}, {"steps": 5, "seconds": 3.0}]
    theirs = [{"steps": 5, "seconds": 1.0}, {"steps": 5, "seconds": 2.0}, {"steps": 5, "seconds": 4.0}]
    assert bench_training.paired_ratios(mine, theirs) == [0.5, 0.75]


@pytest.mark.skipif(not Path(FASHION_MNIST_ROOT).is_dir(), reason="apt-get install dataset-fashion-mnist")
def test_a_tiny_run_records_what_ran_and_plots_it(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "bench_training.py"),
            "--quick",
            "--epochs",
            "1",
            "--data-root",
            str(uncompressed_fashion_mnist(tmp_path / "fashion_mnist")),
            "--limit-train",
            "512",
            "--batch-size",
            "16",  # 8 optimizer steps, each a block of its own: 7 pairs, enough for an interval
            "--limit-test",
            "100",
            "--block-steps",
            "1",
            "--no-progress",
            "--results-dir",
            str(tmp_path / "results"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    document = json.loads((tmp_path / "results" / "training.json").read_text())
    ran = {r["candidate"]: (r["impl"], r["sync_bn"], r["batch_norm"]) for r in document["records"]}
    assert ran == {
        "ddpkit": ("ddpkit", False, "BatchNorm"),
        "torch": ("torch", False, "BatchNorm"),
        "ddpkit_sync_bn": ("ddpkit", True, "ddpkit.SyncBatchNorm"),
    }
    assert document["settings"]["candidates"]["torch"] == {
        "impl": "torch",
        "sync_bn": False,
        "batch_norm": "BatchNorm",
        "shard": "none",
    }
    assert document["summary"]["batch_norm"] == "BatchNorm" and "ddpkit_sync_bn_vs_torch" in document["summary"]
    assert "headline, like for like: ddpkit DDP, plain BatchNorm against torch DDP, plain BatchNorm" in result.stdout
    spread = document["summary"]["time_ratio"]
    assert spread["low"] <= spread["median"] <= spread["high"] and spread["pairs"] >= 1
    assert f"training time {spread['median']:.3f}x (95% CI" in result.stdout, result.stdout
    assert "the machine was " in result.stdout and "loaded" in document["summary"]["machine_load"]
    assert all(len(r["block_times_s"]) == len(r["block_steps"]) > 1 for r in document["records"])
    assert (tmp_path / "results" / "training.png").stat().st_size > 0
