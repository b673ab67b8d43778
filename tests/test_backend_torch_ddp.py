"""torch's own training code, unchanged, on the "ddpkit" backend: DistributedDataParallel and
ZeroRedundancyOptimizer against the same on gloo (on one host and across simulated hosts), and train.py
(--impl torch, --backend ddpkit) under torchrun, one launcher or two as two nodes."""

import contextlib
import json
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn

from helpers import TRAIN, batch, both, free_port, needs_fashion_mnist, needs_hosts, small_cli

# --- torch's DistributedDataParallel and ZeroRedundancyOptimizer, unchanged ------------------


class Branchy(nn.Module):
    """A batch-normalized trunk and one or two heads; a step uses one of them (the other's parameters are unused)."""

    def __init__(self, heads=1):
        super().__init__()
        self.trunk = nn.Sequential(
            nn.Linear(8, 32, bias=False), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU()
        )
        self.heads = nn.ModuleList([nn.Linear(16, 4) for _ in range(heads)])

    def forward(self, x, head=0):
        return self.heads[head](self.trunk(x))


def train_torch_ddp(group, steps, accumulate=1, alternate_heads=False, hook=False, zero=None, **ddp_kwargs):
    """Final state of a few SGD steps (with ZeRO or without) of torch's DDP over `group`; every rank starts
    from its own random weights, so DDP's broadcast from rank 0 matters."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = dist.get_rank()
    torch.manual_seed(rank)
    # tiny buckets: several bucket all-reduces in flight during backward
    model = DDP(Branchy(2 if alternate_heads else 1), process_group=group, bucket_cap_mb=0.001, **ddp_kwargs)
    if hook:
        model.register_comm_hook(group, default_hooks.allreduce_hook)
    if zero is None:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    else:
        # (SGD: Adam would turn the last-bit differences of a three-rank sum into lr-sized ones)
        optimizer = ZeroRedundancyOptimizer(
            model.parameters(),
            optimizer_class=torch.optim.SGD,
            lr=0.1,
            momentum=0.9,
            process_group=group,
            parameters_as_bucket_view=zero,
        )
    for step in range(steps):
        for micro in range(accumulate):
            x, y = batch(rank, step * accumulate + micro)
            head = step % 2 if alternate_heads else 0
            context = model.no_sync() if micro < accumulate - 1 else contextlib.nullcontext()
            with context:
                nn.functional.cross_entropy(model(x, head), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    state = {k: v.clone() for k, v in model.module.state_dict().items()}
    if zero is not None:
        optimizer.consolidate_state_dict(to=0)
        if rank == 0:
            for index, entry in optimizer.state_dict()["state"].items():
                state[f"momentum.{index}"] = entry["momentum_buffer"]
    return state


DDP_SETTINGS = {
    "plain": dict(),
    "no_sync": dict(accumulate=3),
    "find_unused": dict(alternate_heads=True, find_unused_parameters=True),
    "grad_as_bucket_view": dict(gradient_as_bucket_view=True, accumulate=2),
    "static_graph": dict(static_graph=True),
    "comm_hook": dict(hook=True),
    "zero": dict(zero=False),
    "zero_bucket_view": dict(zero=True),
}


def case_torch_ddp(settings, steps):
    return {name: both(lambda g: train_torch_ddp(g, steps, **DDP_SETTINGS[name])) for name in settings}


@pytest.mark.parametrize("world_size", [2, 3])
def test_torch_ddp_and_zero_match_gloo(pools, world_size):
    per_rank = pools("ddpkit", world_size).run(case_torch_ddp, list(DDP_SETTINGS), 4, timeout=120)
    for rank, results in enumerate(per_rank):
        for name, (ours, theirs) in results.items():
            assert ours.keys() == theirs.keys()
            for key in ours:
                if world_size == 2:  # a + b: the same bits whatever the algorithm
                    assert torch.equal(ours[key], theirs[key]), (rank, name, key)
                else:  # three ranks' gradients may be added in another order
                    torch.testing.assert_close(ours[key], theirs[key], rtol=1e-6, atol=1e-6, msg=f"{rank} {name} {key}")
                if "running" not in key:  # all ranks hold the same parameters (buffers: their last batch's)
                    assert torch.equal(ours[key], per_rank[0][name][0][key]), (rank, name, key)
        untrained = Branchy()
        assert not torch.equal(results["plain"][0]["heads.0.weight"], untrained.heads[0].weight.detach())
    # rank 0 consolidated every rank's shard of the optimizer state
    parameters = len(list(Branchy().parameters()))
    assert sum(key.startswith("momentum.") for key in per_rank[0]["zero"][0]) == parameters


@needs_hosts
def test_torch_ddp_across_hosts_matches_gloo(hosts):
    """Two simulated hosts of two ranks: torch DDP's buckets cross hosts through the backend's hierarchy."""
    per_rank = hosts("2x2", backend="ddpkit").run(case_torch_ddp, ["plain", "no_sync"], 3, timeout=300)
    for rank, results in enumerate(per_rank):
        for name, (ours, theirs) in results.items():
            for key in ours:
                torch.testing.assert_close(ours[key], theirs[key], rtol=1e-6, atol=1e-6, msg=f"{rank} {name} {key}")


# --- train.py --backend ddpkit under torchrun -------------------------------------------------


def assert_succeeded(processes, outputs):
    codes = [process.returncode for process in processes]
    assert codes == [0] * len(processes), "\n".join(
        f"--- process {i} (exit {code}):\n{output[-6000:]}" for i, (code, output) in enumerate(zip(codes, outputs))
    )


@needs_fashion_mnist
def test_torchrun_with_the_ddpkit_backend(tmp_path):
    """torch's DDP (--impl torch) through train.py, all its collectives on the "ddpkit" backend."""
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(free_port()),
            str(TRAIN),
            "--backend",
            "ddpkit",
            "--impl",
            "torch",
            *small_cli(tmp_path / "run"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    output = process.communicate(timeout=240)[0]
    assert_succeeded([process], [output])
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["world_size"] == 2 and metrics["final_test_accuracy"] is not None
    assert output.count("test loss") == 1
