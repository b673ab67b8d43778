"""A torchrun elastic restart on the "ddpkit" backend: rank 1 fails once in the middle of training,
torchrun restarts every worker, and training continues from the last checkpoint. The final weights
equal those of a run that never failed, computed here in one process.

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc_per_node 2 --max-restarts 1 examples/elastic_restart.py

Without ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` the restarted workers can read the failed attempt's
addresses from the rendezvous store that torchrun shares with them, and fail or hang. That is torch's
own bug (pytorch/pytorch#135712); it hits gloo just the same. ``--standalone`` picks the c10d
rendezvous on one node (``--rdzv-backend c10d`` across nodes): with torchrun's default static
rendezvous a restart could still hang.
"""

import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import ddpkit  # noqa: F401  (registers the "ddpkit" backend)

STEPS, FAIL_AT = 8, 5

dist.init_process_group("ddpkit")
rank, world_size = dist.get_rank(), dist.get_world_size()
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
# Every attempt's workers are children of the same torchrun agent: its pid names a directory that
# outlives a restart and that no other run uses.
checkpoint = Path(tempfile.gettempdir()) / f"ddpkit-elastic-{os.getppid()}" / "checkpoint.pt"


def new_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 1))


def batch(step: int, rank: int) -> torch.Tensor:
    # A function of the step, so a resumed run sees exactly the batches the failed one would have.
    return torch.randn(16, 10, generator=torch.Generator().manual_seed(1000 * step + rank))


model = nn.parallel.DistributedDataParallel(new_model())
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
start = 0
if attempt > 0:  # a first attempt never resumes: whatever lies there is not this run's
    state = torch.load(checkpoint)
    model.module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    start = state["step"]

for step in range(start, STEPS):
    if attempt == 0 and step == FAIL_AT and rank == 1:
        sys.exit(f"rank 1: a simulated failure at step {step}; torchrun restarts the workers")
    model(batch(step, rank)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    if rank == 0:  # written whole, then renamed: a failure while writing leaves the old checkpoint
        checkpoint.parent.mkdir(exist_ok=True)
        torch.save(
            {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "step": step + 1},
            checkpoint.with_suffix(".tmp"),
        )
        os.replace(checkpoint.with_suffix(".tmp"), checkpoint)
    dist.barrier()  # nobody goes on before the checkpoint of this step is on disk

# An uninterrupted run in this process: each step the gradient averaged over the ranks' batches.
reference = new_model()
reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
for step in range(STEPS):
    grads = []
    for r in range(world_size):
        reference.zero_grad()
        reference(batch(step, r)).square().mean().backward()
        grads.append([p.grad.clone() for p in reference.parameters()])
    for p, *per_rank in zip(reference.parameters(), *grads):
        p.grad = torch.stack(per_rank).mean(0)
    reference_optimizer.step()
for p, q in zip(model.module.parameters(), reference.parameters()):
    torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)

assert (attempt, start) == (1, FAIL_AT), "the failure should cost one restart and no finished step"
dist.barrier()
if rank == 0:
    shutil.rmtree(checkpoint.parent)
    print(
        f"elastic_restart: {STEPS} steps on {world_size} ranks ({dist.get_backend()} backend), resumed at step "
        f"{start} after a restart; the weights equal an uninterrupted run's"
    )
dist.destroy_process_group()
