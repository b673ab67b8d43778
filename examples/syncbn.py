"""SyncBatchNorm in a model: each rank normalizes its own part of the batch with the statistics of the
whole (global) batch, so training on N ranks behaves as BatchNorm on one process with the whole batch.
Checked here against that single-process BatchNorm: outputs, running statistics and gradients.

    torchrun --nproc_per_node 2 examples/syncbn.py
"""

import copy

import torch
import torch.distributed as dist
from torch import nn

import ddpkit

ddpkit.init_distributed()
rank, world_size = dist.get_rank(), dist.get_world_size()

torch.manual_seed(0)  # the same weights and the same global batch on every rank
model = nn.Sequential(
    nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 8 * 8, 10)
)
reference = copy.deepcopy(model)  # plain BatchNorm, to run on the whole batch in this process
global_batch = torch.randn(4 * world_size, 3, 8, 8)

model = ddpkit.convert_sync_batchnorm(model)  # BatchNorm1d/2d/3d -> ddpkit.SyncBatchNorm
local_batch = global_batch.chunk(world_size)[rank]  # this rank's 4 samples
out = model(local_batch)  # one all-reduce of the batch statistics per SyncBatchNorm layer
out.square().sum().backward()  # and one for their gradients

expected = reference(global_batch)
expected.square().sum().backward()
torch.testing.assert_close(out, expected.chunk(world_size)[rank], rtol=1e-4, atol=1e-5)
torch.testing.assert_close(model[1].running_mean, reference[1].running_mean)
torch.testing.assert_close(model[1].running_var, reference[1].running_var)
# Each rank's gradient covers its own samples; summed over ranks it is the whole batch's.
grad = model[0].weight.grad.clone()
ddpkit.all_reduce(grad)
torch.testing.assert_close(grad, reference[0].weight.grad, rtol=1e-4, atol=1e-4)

if rank == 0:
    print(
        f"syncbn: outputs, running statistics and gradients on {world_size} ranks equal BatchNorm on the "
        f"global batch of {len(global_batch)}"
    )
dist.destroy_process_group()
