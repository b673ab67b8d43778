"""The training run's settings (``TrainConfig``), and the error a mistake in them raises (``UsageError``)."""

from __future__ import annotations

import dataclasses

from ..ddp import DEFAULT_ALGORITHM


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
