"""PyTorch Lightning on the "ddpkit" backend: ``DDPStrategy(process_group_backend="ddpkit")`` is all it
takes. Lightning creates the process group and wraps the model in torch's DDP; the gradient
all-reduces run on ddpkit's engine. Checked against the same training in one process, where each
step's gradient is the average over the ranks' batches.

    torchrun --nproc_per_node 2 examples/lightning_ddpkit.py

Under torchrun, Lightning takes the ranks from torchrun's environment (``devices`` must equal
``--nproc_per_node``). Run as plain ``python``, the same script has Lightning start the second
process itself.
"""

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ddpkit  # noqa: F401  (registers the "ddpkit" backend)

WORLD_SIZE, STEPS, BATCH = 2, 6, 8

torch.manual_seed(0)  # the same data and initial weights in every process
inputs, targets = torch.randn(WORLD_SIZE * STEPS * BATCH, 10), torch.randn(WORLD_SIZE * STEPS * BATCH, 1)
initial = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 1)).state_dict()


class Regression(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 1))
        self.net.load_state_dict(initial)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        # Rank r takes rows r, r + 2, ...; we shard ourselves so the reference below knows each batch.
        shard = slice(self.global_rank, None, self.trainer.world_size)
        return DataLoader(TensorDataset(inputs[shard], targets[shard]), batch_size=BATCH)


model = Regression()
trainer = L.Trainer(
    accelerator="cpu",
    devices=WORLD_SIZE,
    strategy=DDPStrategy(process_group_backend="ddpkit"),
    max_epochs=1,
    use_distributed_sampler=False,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
)
trainer.fit(model)
assert dist.get_backend() == "ddpkit"
rank = dist.get_rank()

# One process, the same steps: the mean loss over both ranks' batches has the averaged gradient.
reference = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 1))
reference.load_state_dict(initial)
optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
for step in range(STEPS):
    losses = []
    for r in range(WORLD_SIZE):
        rows = slice(step * BATCH, (step + 1) * BATCH)
        losses.append(nn.functional.mse_loss(reference(inputs[r::WORLD_SIZE][rows]), targets[r::WORLD_SIZE][rows]))
    torch.stack(losses).mean().backward()
    optimizer.step()
    optimizer.zero_grad()
for p, q in zip(model.net.parameters(), reference.parameters()):
    torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)

dist.barrier()  # rank 0 speaks for both once both have checked
if rank == 0:
    print(
        f"lightning_ddpkit: Lightning's DDPStrategy trained {STEPS} steps on {WORLD_SIZE} ranks "
        f"({dist.get_backend()} backend); the weights equal the one-process reference"
    )
