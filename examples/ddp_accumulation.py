"""ddpkit's DistributedDataParallel with gradient accumulation: each optimizer step takes 4
micro-batches per rank, and the gradients are all-reduced only on the 4th (the other three run
under ``no_sync()``). A small classifier learns a synthetic problem; every rank ends with the same
weights.

    torchrun --nproc_per_node 2 examples/ddp_accumulation.py

``ddpkit.DistributedDataParallel`` buckets the gradients (25 MiB, a 1 MiB first one) and all-reduces
each bucket as soon as backward has filled it, overlapping communication with the rest of backward.
"""

import torch
import torch.distributed as dist
from torch import nn

import ddpkit

ddpkit.init_distributed()
rank, world_size = dist.get_rank(), dist.get_world_size()

torch.manual_seed(0)  # the same problem on every rank; DDP broadcasts rank 0's weights anyway
teacher = torch.randn(20, 4)
model = nn.Sequential(nn.Linear(20, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 4))
model = ddpkit.convert_sync_batchnorm(model)  # BatchNorm1d/2d/3d -> ddpkit.SyncBatchNorm
model = ddpkit.DistributedDataParallel(model)  # bucketed, overlapped with backward
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
accumulate = ddpkit.GradientAccumulation(model, accumulation_steps=4)
loss_fn = nn.CrossEntropyLoss()

generator = torch.Generator().manual_seed(1 + rank)  # each rank its own data
losses = []
for _step in range(30):
    for _micro_batch in range(4):
        x = torch.randn(16, 20, generator=generator)
        y = (x @ teacher).argmax(1)
        loss = loss_fn(model(x), y)
        if accumulate.backward(loss):  # no all-reduce on 3 of 4 micro-batches
            optimizer.step()
            optimizer.zero_grad()
    losses.append(loss.item())
assert sum(losses[-5:]) < 0.5 * sum(losses[:5]), losses

# The averaged gradients kept the replicas identical: compare every rank's weights with rank 0's.
weights = torch.cat([p.detach().flatten() for p in model.parameters()])
rank0 = weights.clone()
ddpkit.broadcast(rank0, src=0)
assert torch.equal(weights, rank0)
if rank == 0:
    print(
        f"ddp_accumulation: loss {sum(losses[:5]) / 5:.3f} -> {sum(losses[-5:]) / 5:.3f} in 30 steps of "
        f"4 x {world_size} micro-batches; the weights are identical on all {world_size} ranks"
    )
dist.destroy_process_group()
