"""The training run's settings (``TrainConfig``, resolved by ``resolve_config``), and the error a mistake
in them raises (``UsageError``; ``raise_if_any_rank_failed`` raises it on every rank)."""

from __future__ import annotations

import dataclasses

import torch.distributed as dist

from ..ddp import DEFAULT_ALGORITHM
from .data import dataset_name


def resolved_augment(augment: bool | None, dataset: str) -> bool:
    """``--augment`` as the run uses it: where not given, on for CIFAR and off for Fashion-MNIST."""
    return augment if augment is not None else dataset.startswith("cifar")


class UsageError(ValueError):
    """A mistake in the command line or in the files it names: ``main`` prints the message alone, as
    one line on rank 0, and exits with status 1."""


# The communication hooks a run may register on its DDP (--comm-hook): "bf16_crossing", torch's
# allreduce_hook on a "ddpkit" group whose float32 sums cross hosts in bfloat16 (ddpkit.Options: Note
# [Compressed crossing]); "bf16_compress", torch's bf16_compress_hook, which rounds every gradient to
# bfloat16 before an all-reduce of bfloat16, inside hosts too.
COMM_HOOKS = ("none", "bf16_crossing", "bf16_compress")

# What a run shards across its ranks (--shard; docs/sharding.md): "optimizer" (ZeRO-1) and "gradients" (ZeRO-2)
# train with ddpkit.ShardedOptimizer on the DDP, "parameters" (ZeRO-3) with ddpkit.FullyShardedDataParallel
# instead of the DDP; all with the bits of "none".
SHARD_MODES = ("none", "optimizer", "gradients", "parameters")


@dataclasses.dataclass
class TrainConfig:
    dataset: str = "fashion_mnist"  # the one scripts/setup.sh installs
    data_root: str | None = None
    download: bool = False
    model: str = "net"
    impl: str = "ddpkit"
    sync_bn: bool = True
    grad_sync: str = "bucketed"
    algorithm: str = DEFAULT_ALGORITHM
    comm_hook: str = "none"  # COMM_HOOKS
    shard: str = "none"  # SHARD_MODES
    epochs: int = 10
    batch_size: int = 64  # per rank and micro-batch
    global_batch_size: int | None = None  # per optimizer step; overrides batch_size
    accumulation_steps: int = 1
    optimizer: str = "sgd"
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 5e-4
    schedule: str = "cosine"
    augment: bool | None = None  # default: on for CIFAR, off for Fashion-MNIST
    seed: int = 0
    log_every: int = 20
    eval_batch_size: int = 1000
    limit_train: int | None = None
    limit_test: int | None = None
    max_steps: int | None = None
    out_dir: str | None = "runs/latest"
    checkpoint_every: int = 0  # optimizer steps between checkpoints; 0: after every epoch only
    resume: bool = True
    progress: bool | None = None  # None: a bar only where stderr is a terminal


# The settings a resumed run must share with its checkpoint; the others (paths, logging, evaluation
# batch size) may change between launches.
RUN_DEFINING = (
    "dataset",
    "model",
    "impl",
    "sync_bn",
    "grad_sync",
    "algorithm",
    "comm_hook",
    "epochs",
    "batch_size",
    "global_batch_size",
    "accumulation_steps",
    "optimizer",
    "lr",
    "momentum",
    "weight_decay",
    "schedule",
    "augment",
    "seed",
    "limit_train",
    "limit_test",
    "max_steps",
)


def resolve_config(config: TrainConfig) -> TrainConfig:
    """``config`` with its dataset's canonical name and ``augment`` resolved: before the checkpoint stores
    it and resume compares it, so that an explicit --augment equal to the dataset's default is the same run.
    Raises ``UsageError`` (on every rank alike) for settings that do not go together."""
    try:
        config = dataclasses.replace(config, dataset=dataset_name(config.dataset))
    except ValueError as error:
        raise UsageError(str(error)) from None
    check_shard(config)
    return dataclasses.replace(config, augment=resolved_augment(config.augment, config.dataset))


def check_shard(config: TrainConfig) -> None:
    """--shard gradients reduce-scatters in ddpkit's reducer: --impl ddpkit, bucketed, no communication hook;
    --shard optimizer also runs beside torch's DDP (ZeRO-1 with one more all-gather)."""
    if config.shard not in SHARD_MODES:
        raise UsageError(f"ddpkit: --shard must be one of {', '.join(SHARD_MODES)}, got {config.shard!r}")
    if config.shard == "none":
        return
    if config.shard == "parameters":
        defaults = TrainConfig()
        if config.impl != "ddpkit":
            raise UsageError(
                "ddpkit: --shard parameters trains with ddpkit.FullyShardedDataParallel: it needs --impl ddpkit"
            )
        ignored = [
            f"--{name.replace('_', '-')} {getattr(config, name)}"
            for name in ("grad_sync", "algorithm", "comm_hook")
            if getattr(config, name) != getattr(defaults, name)
        ]
        if ignored:
            raise UsageError(
                f"ddpkit: {', '.join(ignored)} configure the DDP, which --shard parameters replaces by "
                "ddpkit.FullyShardedDataParallel: drop them"
            )
        return
    if config.shard == "gradients" and config.impl != "ddpkit":
        raise UsageError("ddpkit: --shard gradients shards the gradients in ddpkit's DDP: it needs --impl ddpkit")
    if config.impl == "ddpkit" and config.grad_sync != "bucketed":
        raise UsageError(f"ddpkit: --shard {config.shard} reduce-scatters buckets: it needs --grad-sync bucketed")
    if config.impl == "ddpkit" and config.comm_hook != "none":
        raise UsageError(
            f"ddpkit: --shard {config.shard} reduce-scatters the buckets a communication hook would all-reduce: "
            "use one or the other"
        )


def raise_if_any_rank_failed(error: str | None) -> None:
    """Raises ``UsageError`` on every rank if any rank passes an error (the lowest such rank's)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        failed = [(rank, message) for rank, message in enumerate(errors) if message is not None]
        if failed:
            rank, message = failed[0]
            if len(failed) < len(errors) or any(other != message for _, other in failed):
                message += f" (on rank {rank})"  # not every rank's own problem
            raise UsageError(message)
    elif error is not None:
        raise UsageError(error)
