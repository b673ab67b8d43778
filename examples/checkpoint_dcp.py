"""torch.distributed.checkpoint (DCP) on the "ddpkit" backend: an FSDP2 model (each rank holds half of
every parameter) and its optimizer are saved with ``dcp.save``, then loaded into a fresh model with
``dcp.load``. The loaded model must continue training exactly as the original does.

    torchrun --nproc_per_node 2 examples/checkpoint_dcp.py

Each rank writes and reads only its own shards; the collectives DCP needs to plan the files (gathers and
broadcasts of the plan, as objects) run on ddpkit's engine.
"""

import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import ddpkit  # noqa: F401  (registers the "ddpkit" backend)

dist.init_process_group("ddpkit")
rank, world_size = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cpu", (world_size,))


def sharded_model_and_optimizer(seed: int):
    torch.manual_seed(seed)
    model = fully_shard(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)), mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def train_step(model, optimizer, step: int) -> torch.Tensor:
    # Seeded by step and rank, so both models see the same batches.
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(100 * step + rank))
    loss = model(x).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


model, optimizer = sharded_model_and_optimizer(seed=0)
for step in range(3):
    train_step(model, optimizer, step)

# DCP writes into one directory that every rank can reach; rank 0 picks it and tells the others.
directory = [tempfile.mkdtemp(prefix="ddpkit-dcp-") if rank == 0 else None]
dist.broadcast_object_list(directory, src=0)
model_state, optimizer_state = get_state_dict(model, optimizer)
dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=directory[0])

# A fresh model from other weights: only the checkpoint can make it equal to the original.
restored, restored_optimizer = sharded_model_and_optimizer(seed=1)
model_state, optimizer_state = get_state_dict(restored, restored_optimizer)
state = {"model": model_state, "optimizer": optimizer_state}
dcp.load(state, checkpoint_id=directory[0])
set_state_dict(restored, restored_optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])

# The optimizer's moments came back too: two more steps give the same losses and the same weights.
for step in range(3, 5):
    assert torch.equal(train_step(model, optimizer, step), train_step(restored, restored_optimizer, step))
for p, q in zip(model.parameters(), restored.parameters()):
    assert torch.equal(p.full_tensor(), q.full_tensor())

dist.barrier()  # nobody reads the files any more
if rank == 0:
    shutil.rmtree(directory[0])
    print(
        f"checkpoint_dcp: an FSDP2 model and its AdamW state saved and loaded with DCP on {world_size} ranks "
        f"({dist.get_backend()} backend); the restored model trains bit for bit as the original"
    )
dist.destroy_process_group()
