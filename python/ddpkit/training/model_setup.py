"""The model's set-up for a training run: its BatchNorm layers (``batch_norm_of``,
``convert_batch_norm``), its data-parallel wrapper (``wrap_data_parallel``), the optimizer and the
learning-rate schedule (``make_optimizer``, ``make_scheduler``)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from ..backend import Options
from ..ddp import DistributedDataParallel
from ..fsdp import FullyShardedDataParallel
from ..sharded_optimizer import ShardedOptimizer
from .config import TrainConfig, UsageError


def batch_norm_of(config: TrainConfig, device: torch.device) -> tuple[str, list[str]]:
    """What this run's BatchNorm layers will be (the model may have none): "ddpkit.SyncBatchNorm",
    "torch.nn.SyncBatchNorm" or "BatchNorm" (plain, statistics of each rank's own batch); and the notes
    the log shows about it."""
    if config.impl == "ddpkit" and config.sync_bn:
        return "ddpkit.SyncBatchNorm", []
    if config.impl == "torch" and config.sync_bn and device.type == "cuda":
        return "torch.nn.SyncBatchNorm", []
    if config.impl == "torch" and config.sync_bn:
        return "BatchNorm", ["torch.nn.SyncBatchNorm needs CUDA: the torch pipeline uses plain BatchNorm on CPU"]
    return "BatchNorm", []


def check_batch_norm_has_samples(
    model: nn.Module, config: TrainConfig, batch_norm: str, micro_batch: int, world_size: int
) -> None:
    """Raises ``UsageError`` where ``model`` has BatchNorm1d and training would normalise over one sample.

    The models' BatchNorm1d normalise [N, C] features over the samples alone (the 2d ones also over
    H x W pixels), so one sample leaves training nothing to normalise over: torch's forward raises.
    Every rank has the same settings, so every rank raises here, before the first collective."""
    if not any(isinstance(module, nn.BatchNorm1d) for module in model.modules()):
        return
    samples = micro_batch * (world_size if batch_norm != "BatchNorm" else 1)
    if samples == 1:
        where = "each rank's micro-batch" if batch_norm == "BatchNorm" else "all ranks' micro-batches"
        raise UsageError(
            f"ddpkit: --model {config.model} has BatchNorm1d, which in training normalises over "
            f"the samples of {where} ({batch_norm}), and 1 sample leaves nothing to "
            "normalise over; use --batch-size 2 or more (or a --global-batch-size that gives it)"
        )


def convert_batch_norm(model: nn.Module, batch_norm: str) -> nn.Module:
    """``model`` with its BatchNorm layers made ``batch_norm`` (``batch_norm_of``'s)."""
    if batch_norm == "ddpkit.SyncBatchNorm":
        from ..syncbn import convert_sync_batchnorm

        return convert_sync_batchnorm(model)
    if batch_norm == "torch.nn.SyncBatchNorm":
        return nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return model


def wrap_data_parallel(model: nn.Module, config: TrainConfig, device: torch.device) -> nn.Module:
    """ddpkit's DistributedDataParallel (--impl ddpkit) or torch's (--impl torch) around ``model``, with
    the communication hook of --comm-hook (COMM_HOOKS); ddpkit's FullyShardedDataParallel with --shard
    parameters."""
    if config.shard == "parameters":
        return FullyShardedDataParallel(model)
    if config.impl == "ddpkit":
        wrapped = DistributedDataParallel(model, grad_sync=config.grad_sync, algorithm=config.algorithm)
    else:
        wrapped = nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        )
    if config.comm_hook == "bf16_crossing":
        # Collective: every rank makes the group.
        crossing = dist.new_group(backend="ddpkit", pg_options=Options(cross_host_dtype=torch.bfloat16))
        wrapped.register_comm_hook(crossing, default_hooks.allreduce_hook)
    elif config.comm_hook == "bf16_compress":
        wrapped.register_comm_hook(None, default_hooks.bf16_compress_hook)
    return wrapped


def make_optimizer(model: nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    """SGD or AdamW (--optimizer); with --shard, ddpkit.ShardedOptimizer around it, built after the DDP so
    that it shards that DDP's gradients too (ZeRO-2)."""
    parameters = [p for p in model.parameters() if p.requires_grad]
    if config.optimizer == "sgd":
        optimizer_class, options = torch.optim.SGD, dict(momentum=config.momentum)
    else:
        optimizer_class, options = torch.optim.AdamW, {}
    options.update(lr=config.lr, weight_decay=config.weight_decay)
    if config.shard in ("optimizer", "gradients"):
        return ShardedOptimizer(parameters, optimizer_class, shard_gradients=config.shard == "gradients", **options)
    return optimizer_class(parameters, **options)


def count_total_steps(steps_per_epoch: int, config: TrainConfig) -> int:
    """Optimizer steps of the whole run: every epoch's, or --max-steps where fewer."""
    total_steps = steps_per_epoch * config.epochs
    return min(total_steps, config.max_steps) if config.max_steps else total_steps


def make_scheduler(optimizer: torch.optim.Optimizer, config: TrainConfig, total_steps: int):
    """The cosine schedule over ``total_steps`` optimizer steps, or None (--schedule constant)."""
    if config.schedule != "cosine":
        return None
    return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total_steps)
