"""ZeRO-3 with ``ddpkit.FullyShardedDataParallel``: each rank keeps 1/N of every layer's parameters, of their
gradients and of AdamW's state; a layer is all-gathered for its forward and again for its backward, and its
gradients are reduce-scattered as its backward ends. The same model trains under ddpkit's DDP beside it: the
parameters come out with the same bits on every rank. Then it computes in bfloat16 over float32 shards, and
saves and loads a whole state dict.

    torchrun --nproc_per_node 2 examples/fully_sharded.py

``persistence_threshold``: parameters of at most that many elements (here the biases) stay whole on every rank
and are all-reduced; the default, 100,000 elements, would keep this small model whole.
"""

import torch
import torch.distributed as dist
from torch import nn

import ddpkit


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 257), nn.ReLU(), nn.Linear(257, 10))  # 19,280 parameters


def train(wrapped: nn.Module, rank: int) -> None:
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)  # steps this rank's pieces only
    for step in range(5):
        generator = torch.Generator().manual_seed(100 * step + rank)  # each rank its own batch
        x, y = torch.randn(16, 64, generator=generator), torch.randint(0, 10, (16,), generator=generator)
        nn.functional.cross_entropy(wrapped(x).float(), y).backward()
        optimizer.step()
        optimizer.zero_grad()


def main() -> None:
    ddpkit.init_distributed()
    rank = dist.get_rank()
    ddp = ddpkit.DistributedDataParallel(model())
    train(ddp, rank)
    sharded = ddpkit.FullyShardedDataParallel(model(), persistence_threshold=1000)
    train(sharded, rank)
    whole = sharded.state_dict()  # every rank calls it: it gathers the shards
    for name, theirs in ddp.module.state_dict().items():
        assert torch.equal(whole[name], theirs), f"ZeRO-3: {name} differs from DDP + AdamW's"
    pieces = {name: tuple(p.shape) for name, p in sharded.module.named_parameters()}  # this rank's pieces
    half = ddpkit.FullyShardedDataParallel(model(), compute_dtype=torch.bfloat16, persistence_threshold=1000)
    train(half, rank)
    half.load_state_dict(whole)  # each rank takes its pieces of the whole tensors
    assert all(torch.equal(half.state_dict()[name], value) for name, value in whole.items())
    if rank == 0:
        print(f"fully_sharded: ZeRO-3 gives DDP + AdamW's parameters on every rank; rank 0 holds {pieces}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
