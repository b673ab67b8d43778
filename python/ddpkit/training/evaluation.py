"""The distributed evaluation of a training run: every rank scores a shard of the test set, and every
rank gets the whole set's loss and accuracy (``evaluate``)."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from .. import comm


@torch.no_grad()
def evaluate(
    model: nn.Module, images: torch.Tensor, labels: torch.Tensor, transform, batch_size: int, device: torch.device
) -> dict:
    """Exact test loss and accuracy over all of ``images``, computed by all ranks together.

    Rank 0 splits the indices 0..N-1 into world_size contiguous shards (sizes differing by at most
    one, padded with -1 to a common length) and hands them out with ``ddpkit.scatter``;
    each rank sums the loss and counts the correct predictions of its shard; ``ddpkit.all_reduce``
    adds up the sums, and every rank divides them by N: every rank returns the same dict.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    count = len(images)
    shard_length = math.ceil(count / world_size)
    shard = torch.empty(shard_length, dtype=torch.int64)
    chunks = None
    if rank == 0:
        chunks = torch.full((world_size, shard_length), -1, dtype=torch.int64)
        for r, part in enumerate(torch.arange(count).tensor_split(world_size)):
            chunks[r, : len(part)] = part
    comm.scatter(shard, chunks, src=0)

    was_training = model.training
    model.eval()
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    totals = torch.zeros(3, dtype=torch.float64)  # loss sum, correct, samples
    # Every rank runs the same number of forwards, the last ones of a shorter shard over fewer samples or
    # none: a forward may be a collective (ddpkit.FullyShardedDataParallel gathers each layer).
    for chunk in shard.split(batch_size):
        batch = chunk[chunk >= 0]
        x = transform(images[batch]).to(device)
        y = labels[batch].to(device)
        logits = model(x)
        totals[0] += float(loss_fn(logits, y))
        totals[1] += int((logits.argmax(1) == y).sum())
        totals[2] += len(batch)
    model.train(was_training)
    comm.all_reduce(totals, op="sum")
    if int(totals[2]) != count:
        raise RuntimeError(f"distributed evaluation covered {int(totals[2])} of {count} samples")
    return {"loss": float(totals[0] / totals[2]), "accuracy": float(totals[1] / totals[2]), "samples": int(totals[2])}
