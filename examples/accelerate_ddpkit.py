"""Hugging Face Accelerate on the "ddpkit" backend: create the process group first, then the
``Accelerator``. Checked against the same training in one process, where each step's gradient is the
average over the ranks' batches.

    torchrun --nproc_per_node 2 examples/accelerate_ddpkit.py

Why the group first: asked for the backend by name on CPU (``Accelerator(cpu=True,
kwargs_handlers=[InitProcessGroupKwargs(backend="ddpkit")])``), accelerate/state.py refuses any name
but gloo ("Your assigned backend ddpkit is not available, please use gloo"). Given a group that
already exists, Accelerate uses it as it is.
"""

import torch
import torch.distributed as dist
from accelerate import Accelerator
from torch import nn

import ddpkit  # noqa: F401  (registers the "ddpkit" backend)

STEPS, BATCH = 6, 8

dist.init_process_group("ddpkit")  # before the Accelerator, which then takes this group
accelerator = Accelerator(cpu=True)
rank, world_size = accelerator.process_index, accelerator.num_processes

torch.manual_seed(0)  # the same data and initial weights in every process
inputs, targets = torch.randn(world_size * STEPS * BATCH, 10), torch.randn(world_size * STEPS * BATCH, 1)
net = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 1))
initial = {name: value.clone() for name, value in net.state_dict().items()}
model, optimizer = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))

for step in range(STEPS):
    rows = slice(step * BATCH, (step + 1) * BATCH)
    x, y = inputs[rank::world_size][rows], targets[rank::world_size][rows]  # rank r's rows: r, r + n, ...
    accelerator.backward(nn.functional.mse_loss(model(x), y))  # the gradient all-reduce runs on ddpkit
    optimizer.step()
    optimizer.zero_grad()

# One process, the same steps: the mean loss over every rank's batch has the averaged gradient.
reference = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 1))
reference.load_state_dict(initial)
reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
for step in range(STEPS):
    rows = slice(step * BATCH, (step + 1) * BATCH)
    losses = [
        nn.functional.mse_loss(reference(inputs[r::world_size][rows]), targets[r::world_size][rows])
        for r in range(world_size)
    ]
    torch.stack(losses).mean().backward()
    reference_optimizer.step()
    reference_optimizer.zero_grad()
for p, q in zip(accelerator.unwrap_model(model).parameters(), reference.parameters()):
    torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)

assert dist.get_backend() == "ddpkit" and isinstance(model, nn.parallel.DistributedDataParallel)
accelerator.wait_for_everyone()  # rank 0 speaks for all once all have checked
if accelerator.is_main_process:
    print(
        f"accelerate_ddpkit: Accelerate trained {STEPS} steps on {world_size} ranks ({dist.get_backend()} "
        f"backend); the weights equal the one-process reference"
    )
accelerator.end_training()  # destroys the process group too, though Accelerate did not create it
