"""ZeRO-1 and ZeRO-2 on ddpkit's DistributedDataParallel: ``ddpkit.ShardedOptimizer`` keeps the AdamW state of
1/N of the parameters on each rank (ZeRO-1), and with ``shard_gradients=True`` (the default, ZeRO-2) only
that 1/N of the averaged gradients too. The same model trains with a plain AdamW beside it; the
parameters come out with the same bits on every rank, and the optimizer's consolidated state dict is the
plain AdamW's.

    torchrun --nproc_per_node 2 examples/sharded_optimizer.py

Build the optimizer after the DDP: it finds the DDP that synchronises its parameters and makes its reducer
reduce-scatter the gradient buckets (half an all-reduce) instead of all-reducing them; the parameters are
all-gathered after each step (the other half), so a step sends what DDP's does.
"""

import torch
import torch.distributed as dist
from torch import nn

import ddpkit


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 257), nn.ReLU(), nn.Linear(257, 10))  # 19,280 parameters


def train(ddp: ddpkit.DistributedDataParallel, optimizer: torch.optim.Optimizer, rank: int) -> None:
    for step in range(5):
        generator = torch.Generator().manual_seed(100 * step + rank)  # each rank its own batch
        x, y = torch.randn(16, 64, generator=generator), torch.randint(0, 10, (16,), generator=generator)
        nn.functional.cross_entropy(ddp(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    inner = getattr(optimizer, "optim", optimizer)  # a ShardedOptimizer's optimizer of this rank's shard
    return sum(v.numel() * v.element_size() for s in inner.state.values() for v in s.values() if v.dim() > 0)


def main() -> None:
    ddpkit.init_distributed()
    rank = dist.get_rank()
    sizes = []
    reference = ddpkit.DistributedDataParallel(model())
    plain = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    train(reference, plain, rank)
    for shard_gradients in (False, True):
        ddp = ddpkit.DistributedDataParallel(model())
        sharded = ddpkit.ShardedOptimizer(ddp.parameters(), torch.optim.AdamW, shard_gradients=shard_gradients, lr=1e-2)
        train(ddp, sharded, rank)
        stage = "ZeRO-2" if shard_gradients else "ZeRO-1"
        for (name, mine), theirs in zip(ddp.module.state_dict().items(), reference.module.state_dict().values()):
            assert torch.equal(mine, theirs), f"{stage}: {name} differs from DDP + AdamW's"
        consolidated = sharded.state_dict()  # a collective: every rank calls it
        assert consolidated["param_groups"] == plain.state_dict()["param_groups"]
        for index, entries in plain.state_dict()["state"].items():
            assert all(torch.equal(consolidated["state"][index][k], v) for k, v in entries.items())
        sizes.append(f"{stage} {state_bytes(sharded)}")
    if rank == 0:
        print(
            "sharded_optimizer: ZeRO-1 and ZeRO-2 give DDP + AdamW's parameters on every rank; AdamW state on "
            f"rank 0: {', '.join(sizes)} bytes, {state_bytes(plain)} unsharded"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
