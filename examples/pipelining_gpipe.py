"""Pipeline parallelism with torch.distributed.pipelining on the "ddpkit" backend: a model cut into two
stages, one per rank, trained with the GPipe schedule (4 micro-batches: all forwards, then all
backwards). Checked against the whole model on the whole batch in one process: same loss, same gradients.

    torchrun --nproc_per_node 2 examples/pipelining_gpipe.py

The stages pass activations and gradients with point-to-point send/recv, which the "ddpkit" backend
hands to its inner gloo backend; the collectives around them run on ddpkit's engine.
"""

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

import ddpkit  # noqa: F401  (registers the "ddpkit" backend)

dist.init_process_group("ddpkit")
rank, world_size = dist.get_rank(), dist.get_world_size()
assert world_size == 2, "one stage per rank: run it with --nproc_per_node 2"

torch.manual_seed(0)  # the same whole model, batch and targets on both ranks
whole = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
x, target = torch.randn(8, 16), torch.randn(8, 4)
reference = copy.deepcopy(whole)

stage_module = whole[:2] if rank == 0 else whole[2:]
stage = PipelineStage(stage_module, stage_index=rank, num_stages=2, device=torch.device("cpu"))
schedule = ScheduleGPipe(stage, n_microbatches=4, loss_fn=nn.functional.mse_loss)
if rank == 0:
    schedule.step(x)  # the first stage takes the inputs
else:
    losses = []
    schedule.step(target=target, losses=losses)  # the last stage takes the targets and returns the losses

# The reference: one process, the whole batch. GPipe averages the micro-batches' gradients
# (scale_grads=True), which is the gradient of the whole batch's mean loss.
loss = nn.functional.mse_loss(reference(x), target)
loss.backward()
reference_stage = reference[:2] if rank == 0 else reference[2:]
for p, q in zip(stage_module.parameters(), reference_stage.parameters()):
    torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
if rank == 1:
    torch.testing.assert_close(torch.stack(losses).mean(), loss.detach())

dist.barrier()  # rank 0 prints only once rank 1's checks have passed too
if rank == 0:
    print(
        f"pipelining_gpipe: 2 stages x 4 micro-batches on the {dist.get_backend()} backend; the gradients equal "
        f"the whole model's on the whole batch"
    )
dist.destroy_process_group()
