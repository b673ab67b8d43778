"""torch's own DistributedDataParallel, unchanged, on the "ddpkit" torch.distributed backend: every
collective torch issues (DDP's broadcast of the weights, its gradient all-reduces, dist.all_reduce)
runs on ddpkit's engine, over shared memory when the ranks share a host.

    torchrun --nproc_per_node 2 examples/torch_ddp_on_ddpkit.py

``import ddpkit`` registers the backend. With GPUs, ``init_process_group("cpu:ddpkit,cuda:nccl")``
keeps CUDA tensors on NCCL.
"""

import torch
import torch.distributed as dist
from torch import nn

import ddpkit  # noqa: F401  (registers the "ddpkit" backend)

dist.init_process_group("ddpkit")  # or "cpu:ddpkit,cuda:nccl"
rank, world_size = dist.get_rank(), dist.get_world_size()

torch.manual_seed(rank)  # different weights on every rank: DDP starts them all from rank 0's
model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 4)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
generator = torch.Generator().manual_seed(100 + rank)
for _step in range(10):
    x = torch.randn(16, 20, generator=generator)
    loss = model(x).square().mean()
    loss.backward()  # the gradient all-reduces run on ddpkit's engine
    optimizer.step()
    optimizer.zero_grad()

weights = torch.cat([p.detach().flatten() for p in model.parameters()])
spread = weights.clone()
dist.all_reduce(spread, op=dist.ReduceOp.MAX)  # torch.distributed's own call, on the same backend
assert torch.equal(spread, weights), "the replicas diverged"
if rank == 0:
    print(
        f"torch_ddp_on_ddpkit: torch DDP trained 10 steps on the {dist.get_backend()} backend; the weights are "
        f"identical on all {world_size} ranks"
    )
dist.destroy_process_group()
