"""One rank's data for a training run: the training and test sets, the sampler of its micro-batches and
the batch sizes they make (``load_training_data``), loaded on every rank so that a rank's failure
reaches the others before any collective (``load_data_on_every_rank``)."""

from __future__ import annotations

import dataclasses

import torch

from ..launch import DistInfo
from .config import TrainConfig, UsageError, raise_if_any_rank_failed
from .data import ShardedBatches, load_dataset


@dataclasses.dataclass
class TrainingData:
    """One rank's data: the training and test sets (images as stored, labels), the sampler of this
    rank's training micro-batches, and the batch sizes they make."""

    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    sampler: ShardedBatches
    micro_batch: int  # samples per rank and micro-batch
    global_batch: int  # samples per optimizer step, over all ranks
    steps_per_epoch: int  # optimizer steps


def load_training_data(config: TrainConfig, rank: int, world_size: int) -> TrainingData:
    """This rank's data and its batches; raises ``UsageError`` for batch sizes that do not fit, and what
    ``load_dataset`` raises for a dataset that is missing or malformed."""
    micro_batch = config.batch_size
    if config.global_batch_size is not None:
        per_step = world_size * config.accumulation_steps
        if config.global_batch_size % per_step:
            raise UsageError(
                f"ddpkit: --global-batch-size {config.global_batch_size} is not divisible by "
                f"world size x --accumulation-steps = {world_size} x "
                f"{config.accumulation_steps} = {per_step}"
            )
        micro_batch = config.global_batch_size // per_step

    train_x, train_y = load_dataset(config.dataset, config.data_root, train=True, download=config.download)
    test_x, test_y = load_dataset(config.dataset, config.data_root, train=False, download=config.download)
    if config.limit_train:
        train_x, train_y = train_x[: config.limit_train], train_y[: config.limit_train]
    if config.limit_test:
        test_x, test_y = test_x[: config.limit_test], test_y[: config.limit_test]

    try:
        sampler = ShardedBatches(
            len(train_x), micro_batch, rank, world_size, seed=config.seed, shuffle=True, drop_last=True
        )
    except ValueError as exc:
        raise UsageError(f"{exc} (see --limit-train, --batch-size)") from None
    steps_per_epoch = len(sampler) // config.accumulation_steps
    if steps_per_epoch == 0:
        raise UsageError(
            f"ddpkit: an epoch has {len(sampler)} micro-batches per rank, fewer than "
            f"--accumulation-steps {config.accumulation_steps}"
        )
    return TrainingData(
        train_x,
        train_y,
        test_x,
        test_y,
        sampler,
        micro_batch,
        global_batch=micro_batch * world_size * config.accumulation_steps,
        steps_per_epoch=steps_per_epoch,
    )


def load_data_on_every_rank(config: TrainConfig, info: DistInfo) -> TrainingData:
    """``load_training_data`` on every rank; raises ``UsageError`` on every rank where any rank failed.

    This rank's setup (options, data, shards) comes first, and every rank learns whether any failed
    before the first collective, so that no rank is left waiting for one that has gone. With
    --download, local rank 0 sets up first and the node's other ranks wait for it: torchvision writes
    the archive straight to its final path, where they would find it half written."""
    downloads_first = config.download and info.local_rank == 0
    if config.download and not downloads_first:
        raise_if_any_rank_failed(None)  # matches the downloaders' check below
    data, error = None, None
    try:
        data = load_training_data(config, info.rank, info.world_size)
    except (OSError, ValueError) as exc:  # UsageError, or a missing, unreadable or malformed dataset
        error = str(exc)
    if downloads_first:
        raise_if_any_rank_failed(error)
    raise_if_any_rank_failed(error)
    return data
