"""Data-parallel training with ddpkit (DDP + SyncBatchNorm) or with PyTorch's built-ins.

    torchrun --nproc_per_node 2 -m ddpkit.training --dataset fashion_mnist --epochs 10 --accumulation-steps 2
    # in the repository, train.py is the same program:
    torchrun --nproc_per_node 2 train.py --dataset fashion_mnist --epochs 10 --accumulation-steps 2
    torchrun --nproc_per_node 2 train.py --impl torch ...                     # the PyTorch pipeline
    torchrun --nproc_per_node 4 train.py --dataset cifar100 --model resnet18 --download
    # two nodes with torchrun:
    torchrun --nnodes 2 --node_rank 0 --nproc_per_node 2 --rdzv_backend c10d --rdzv_endpoint HOST:29400 train.py ...
    # or without torchrun, one command per process:
    python train.py --master-addr HOST --master-port 29500 --world-size 2 --rank 0 ...

``--impl ddpkit`` converts every BatchNorm to ``ddpkit.SyncBatchNorm`` and wraps the model in
``ddpkit.DistributedDataParallel``; ``--impl torch`` uses ``torch.nn.SyncBatchNorm`` (GPU only: on
CPU torch has none, so plain BatchNorm, and the log says so) and
``torch.nn.parallel.DistributedDataParallel``. Both share everything else: data order, seeds,
augmentation, optimizer, schedule. ``--accumulation-steps k`` runs k micro-batches per optimizer
step with no gradient all-reduce on the first k-1. Only rank 0 prints; after every epoch the test
set is evaluated in a distributed way (rank 0 scatters shard indices with
``ddpkit.scatter``, each rank counts the correct predictions of rank 0's model, buffers included,
and ``ddpkit.all_reduce`` adds them up).
Rank 0 writes ``<out>/metrics.json``, ``<out>/model.pt`` and a resumable ``<out>/checkpoint.pt``
(atomically: temp file, then rename); a restarted run (e.g. ``torchrun --max-restarts 1``)
continues from the checkpoint exactly.

Mistakes in the command line or in the files it names (a missing dataset, options that do not go
together, a checkpoint of another run) end the run with one line on stderr, from rank 0 only, and a
non-zero exit status (2 for the command line itself, 1 otherwise), without a traceback from any rank:
a rank that finds a problem in its own setup tells the others before any of them waits on it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from .. import comm
from ..atomic import write_atomically
from ..ddp import DEFAULT_ALGORITHM, GRAD_SYNC_MODES, DistributedDataParallel, GradientAccumulation, _broadcast_tensors
from ..launch import DEFAULT_GROUP_TIMEOUT_S, DistInfo, init_distributed
from .data import (DATA_ROOT, DATASETS, FASHION_MNIST_ROOT, ShardedBatches, dataset_info, dataset_name, load_dataset,
                   normalize, random_crop_flip)
from .models import MODELS, build_model


# ----------------------------------------------------------------------------------------------
# Command line


def port_number(text: str) -> int:
    value = int(text)
    if not 0 < value < 65536:
        raise argparse.ArgumentTypeError(f"port must be in 1..65535, got {value}")
    return value


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


BACKENDS = ("gloo", "nccl", "ddpkit")
DEVICE_TYPES = ("cpu", "cuda")


def backend_argument(text: str) -> str:
    """A torch.distributed backend: one of ``BACKENDS``, or a device map such as ``cpu:ddpkit,cuda:nccl``."""
    if text in BACKENDS:
        return text
    for entry in text.split(","):
        device, _, backend = entry.partition(":")
        if device not in DEVICE_TYPES or backend not in BACKENDS:
            raise argparse.ArgumentTypeError(
                f"invalid choice: {text!r} (choose from {', '.join(BACKENDS)}, or map devices to them as in "
                "cpu:ddpkit,cuda:nccl)")
    return text


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the process-group flags: the backend, and launching one process per node without torchrun."""
    group = parser.add_argument_group("process group (under torchrun, only --backend and --timeout apply)")
    group.add_argument("--backend", type=backend_argument, metavar="{" + ",".join(BACKENDS) + "}",
                       help="torch.distributed backend (default: nccl with CUDA, else gloo); 'ddpkit' runs torch's "
                            "own collectives on ddpkit's engine. A device map such as cpu:ddpkit,cuda:nccl is "
                            "accepted too")
    group.add_argument("--timeout", type=float, default=DEFAULT_GROUP_TIMEOUT_S,
                       help="process-group timeout in seconds (a dead peer is reported within it)")
    group.add_argument("--master-addr", help="launch without torchrun: address of rank 0's node")
    group.add_argument("--master-port", type=port_number, default=29500,
                       help="launch without torchrun: a free TCP port on rank 0's node")
    group.add_argument("--world-size", type=positive_int, help="launch without torchrun: total number of processes")
    group.add_argument("--rank", type=non_negative_int, help="launch without torchrun: this process's rank")


def init_from_args(args: argparse.Namespace) -> DistInfo:
    """``init_distributed`` with the flags of ``add_launch_arguments``."""
    return init_distributed(backend=args.backend, master_addr=args.master_addr, master_port=args.master_port,
                            world_size=args.world_size, rank=args.rank, timeout=args.timeout)


def _resolved_augment(augment: Optional[bool], dataset: str) -> bool:
    """``--augment`` as the run uses it: where not given, on for CIFAR and off for Fashion-MNIST."""
    return augment if augment is not None else dataset.startswith("cifar")


class UsageError(ValueError):
    """A mistake in the command line or in the files it names: ``main`` prints the message alone, as
    one line on rank 0, and exits with status 1."""


@dataclasses.dataclass
class TrainConfig:
    dataset: str = "fashion_mnist"  # the one scripts/setup.sh installs
    data_root: Optional[str] = None
    download: bool = False
    model: str = "net"
    impl: str = "ddpkit"
    sync_bn: bool = True
    grad_sync: str = "bucketed"
    algorithm: str = DEFAULT_ALGORITHM
    epochs: int = 10
    batch_size: int = 64  # per rank and micro-batch
    global_batch_size: Optional[int] = None  # per optimizer step; overrides batch_size
    accumulation_steps: int = 1
    optimizer: str = "sgd"
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 5e-4
    schedule: str = "cosine"
    augment: Optional[bool] = None  # default: on for CIFAR, off for Fashion-MNIST
    seed: int = 0
    log_every: int = 20
    eval_batch_size: int = 1000
    limit_train: Optional[int] = None
    limit_test: Optional[int] = None
    max_steps: Optional[int] = None
    out_dir: Optional[str] = "runs/latest"
    checkpoint_every: int = 0  # optimizer steps between checkpoints; 0: after every epoch only
    resume: bool = True
    progress: Optional[bool] = None  # None: a bar only where stderr is a terminal


# The settings a resumed run must share with its checkpoint; the others (paths, logging, evaluation
# batch size) may change between launches.
_RUN_DEFINING = ("dataset", "model", "impl", "sync_bn", "grad_sync", "algorithm", "epochs", "batch_size",
                 "global_batch_size", "accumulation_steps", "optimizer", "lr", "momentum", "weight_decay", "schedule",
                 "augment", "seed", "limit_train", "limit_test", "max_steps")


class _Parser(argparse.ArgumentParser):
    """argparse with errors as one line (no usage block), printed by rank 0 only under torchrun."""

    def error(self, message: str):
        if os.environ.get("RANK", "0") == "0":
            self._print_message(f"{self.prog}: error: {message} (see {self.prog} --help)\n", sys.stderr)
        self.exit(2)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows defaults, except where there is none to show (None: the help says what happens); the
    epilog's examples keep their lines."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def _program_name() -> Optional[str]:
    """``python -m ddpkit.training`` where ``-m`` started it (argparse would say ``__main__.py``), else
    argparse's own (the script's name: ``train.py``)."""
    return "python -m ddpkit.training" if sys.argv and Path(sys.argv[0]).name == "__main__.py" else None


_EPILOG = """examples:
  torchrun --nproc_per_node 2 -m ddpkit.training --dataset fashion_mnist --epochs 10 --accumulation-steps 2
  torchrun --nproc_per_node 2 -m ddpkit.training --impl torch --dataset fashion_mnist   # PyTorch's DDP
  torchrun --nproc_per_node 4 -m ddpkit.training --dataset cifar100 --model resnet18 --download
(in the repository, train.py is the same program: torchrun --nproc_per_node 2 train.py ...)"""


def _dataset_argument(text: str) -> str:
    try:
        return dataset_name(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from {', '.join(sorted(DATASETS))}; "
                                         "'-' and '_' alike, e.g. fashion-mnist)") from None


def parse_args(argv: Optional[list[str]] = None) -> tuple[TrainConfig, argparse.Namespace]:
    defaults = TrainConfig()
    parser = _Parser(prog=_program_name(), description=__doc__.split("\n\n")[0], formatter_class=_HelpFormatter,
                     epilog=_EPILOG)
    parser.add_argument("--dataset", type=_dataset_argument, default=defaults.dataset,
                        metavar="{" + ",".join(sorted(DATASETS)) + "}",
                        help="fashion-mnist, cifar-10 and the like are accepted too")
    parser.add_argument("--data-root",
                        help=f"where the dataset lives (default: for CIFAR $DDPKIT_DATA, else {DATA_ROOT} under the "
                             f"current directory; for Fashion-MNIST $DDPKIT_FASHION_MNIST, else {FASHION_MNIST_ROOT}, "
                             "where apt-get install dataset-fashion-mnist puts it)")
    parser.add_argument("--download", action=argparse.BooleanOptionalAction, default=defaults.download,
                        help="download CIFAR into --data-root if it is missing (md5-checked)")
    parser.add_argument("--model", choices=MODELS, default=defaults.model, help="the network")
    parser.add_argument("--impl", choices=("ddpkit", "torch"), default=defaults.impl,
                        help="ddpkit: ddpkit.DistributedDataParallel and ddpkit.SyncBatchNorm; torch: "
                             "torch.nn.parallel.DistributedDataParallel and torch.nn.SyncBatchNorm (CUDA only: "
                             "plain BatchNorm on CPU)")
    parser.add_argument("--sync-bn", action=argparse.BooleanOptionalAction, default=defaults.sync_bn,
                        help="synchronize BatchNorm statistics across ranks (--no-sync-bn: plain BatchNorm)")
    parser.add_argument("--grad-sync", choices=GRAD_SYNC_MODES,
                        help=f"how ddpkit's DDP averages gradients, --impl ddpkit only (default: {defaults.grad_sync})")
    parser.add_argument("--algorithm", choices=comm.ALGORITHMS,
                        help=f"ddpkit's all-reduce algorithm, --impl ddpkit only (default: {defaults.algorithm})")
    parser.add_argument("--epochs", type=positive_int, default=defaults.epochs,
                        help="epochs to train (a larger value continues a finished run)")
    parser.add_argument("--batch-size", type=positive_int,
                        help=f"samples per rank and micro-batch (default: {defaults.batch_size})")
    parser.add_argument("--global-batch-size", type=positive_int,
                        help="samples per optimizer step over all ranks (sets --batch-size)")
    parser.add_argument("--accumulation-steps", type=positive_int, default=defaults.accumulation_steps,
                        help="micro-batches per optimizer step; gradients are all-reduced on the last one only")
    parser.add_argument("--optimizer", choices=("sgd", "adamw"), default=defaults.optimizer, help="the optimizer")
    parser.add_argument("--lr", type=positive_float, default=defaults.lr, help="peak learning rate")
    parser.add_argument("--momentum", type=float, default=defaults.momentum, help="SGD momentum")
    parser.add_argument("--weight-decay", type=float, default=defaults.weight_decay, help="weight decay")
    parser.add_argument("--schedule", choices=("cosine", "constant"), default=defaults.schedule,
                        help="learning-rate schedule over all optimizer steps")
    parser.add_argument("--augment", action=argparse.BooleanOptionalAction, default=None,
                        help="random crop + flip (default: on for CIFAR, off for Fashion-MNIST)")
    parser.add_argument("--seed", type=int, default=defaults.seed, help="seed of weights, data order and augmentation")
    parser.add_argument("--log-every", type=positive_int, default=defaults.log_every,
                        help="optimizer steps between loss lines")
    parser.add_argument("--eval-batch-size", type=positive_int, default=defaults.eval_batch_size,
                        help="samples per rank and batch in evaluation")
    parser.add_argument("--limit-train", type=positive_int, help="use only the first N training samples")
    parser.add_argument("--limit-test", type=positive_int, help="use only the first N test samples")
    parser.add_argument("--max-steps", type=positive_int, help="stop after N optimizer steps")
    parser.add_argument("--out", dest="out_dir", default=defaults.out_dir,
                        help="directory of metrics.json, model.pt and checkpoint.pt")
    parser.add_argument("--checkpoint-every", type=int, default=defaults.checkpoint_every,
                        help="optimizer steps between checkpoints (0: after every epoch only)")
    parser.add_argument("--resume", action=argparse.BooleanOptionalAction, default=defaults.resume,
                        help="continue from <out>/checkpoint.pt if it exists (--no-resume: start afresh and "
                             "overwrite it)")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=defaults.progress,
                        help="a progress bar per epoch on stderr (default: when stderr is a terminal)")
    add_launch_arguments(parser)
    args = parser.parse_args(argv)
    if args.checkpoint_every < 0:
        parser.error("--checkpoint-every must be >= 0")
    # Options that do not go together (each alone is fine).
    if args.batch_size is not None and args.global_batch_size is not None:
        parser.error("--batch-size and --global-batch-size are alternatives: give one")
    if args.impl == "torch":
        given = [flag for flag, value in (("--grad-sync", args.grad_sync), ("--algorithm", args.algorithm))
                 if value is not None]
        if given:
            parser.error(f"{' and '.join(given)} set{'' if len(given) > 1 else 's'} up ddpkit's DDP, not --impl torch's")
    if args.download and not args.dataset.startswith("cifar"):
        parser.error(f"--download fetches CIFAR only; {args.dataset} comes from `apt-get install "
                     "dataset-fashion-mnist`")
    if args.master_addr is not None and (args.world_size is None or args.rank is None):
        parser.error("--master-addr needs --world-size and --rank")
    if args.master_addr is None and (args.world_size is not None or args.rank is not None):
        parser.error("--world-size and --rank are for launching without torchrun and need --master-addr")
    if args.rank is not None and args.world_size is not None and args.rank >= args.world_size:
        parser.error(f"--rank {args.rank} is not in [0, --world-size {args.world_size})")
    for name in ("batch_size", "grad_sync", "algorithm"):
        if getattr(args, name) is None:
            setattr(args, name, getattr(defaults, name))
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    config = TrainConfig(**{k: v for k, v in vars(args).items() if k in fields})
    return config, args


def log(*parts) -> None:
    """Prints on rank 0 only."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*parts, flush=True)


# ----------------------------------------------------------------------------------------------
# Distributed validation


@torch.no_grad()
def evaluate(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, transform, batch_size: int,
             device: torch.device) -> dict:
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
            chunks[r, :len(part)] = part
    comm.scatter(shard, chunks, src=0)
    mine = shard[shard >= 0]

    was_training = model.training
    model.eval()
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    totals = torch.zeros(3, dtype=torch.float64)  # loss sum, correct, samples
    for batch in mine.split(batch_size):
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


# ----------------------------------------------------------------------------------------------
# Training


def _save_atomically(obj, path: Path) -> None:
    write_atomically(path, lambda handle: torch.save(obj, handle))


def _write_json_atomically(obj, path: Path) -> None:
    write_atomically(path, lambda handle: handle.write((json.dumps(obj, indent=1) + "\n").encode()))


def _peak_rss_bytes() -> int:
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class Trainer:
    """One rank's training run. ``run()`` trains to the end; ``train_epoch()`` does one epoch."""

    def __init__(self, config: TrainConfig, info: DistInfo):
        try:
            config = dataclasses.replace(config, dataset=dataset_name(config.dataset))
        except ValueError as error:
            raise UsageError(str(error)) from None
        # Resolved before the checkpoint stores it and resume compares it: an explicit --augment equal
        # to the dataset's default is the same run.
        config = dataclasses.replace(config, augment=_resolved_augment(config.augment, config.dataset))
        self.config = config
        self.rank, self.world_size = info.rank, info.world_size
        self.progress_label = ""  # put before "epoch N" on the progress bar
        self.verbose = True  # rank 0 logs progress lines (a caller that reports itself turns them off)
        self.device = torch.device("cuda", info.local_rank) if "nccl" in info.backend else torch.device("cpu")
        self.info = dataset_info(config.dataset)
        self.augment = config.augment
        self.out_dir = Path(config.out_dir) if config.out_dir else None

        # This rank's own setup (options, data, shards) comes first, and every rank learns whether any
        # failed before the first collective, so that no rank is left waiting for one that has gone.
        # With --download, local rank 0 sets up first and the node's other ranks wait for it: torchvision
        # writes the archive straight to its final path, where they would find it half written.
        downloads_first = config.download and info.local_rank == 0
        if config.download and not downloads_first:
            _raise_if_any_rank_failed(None)  # matches the downloaders' check below
        error = None
        try:
            self._set_up_data()
        except (OSError, ValueError) as exc:  # UsageError, or a missing, unreadable or malformed dataset
            error = str(exc)
        if downloads_first:
            _raise_if_any_rank_failed(error)
        _raise_if_any_rank_failed(error)

        torch.manual_seed(config.seed)
        model = build_model(config.model, self.info.channels, self.info.num_classes, self.info.image_size)
        # The models' BatchNorm1d normalise [N, C] features over the samples alone (the 2d ones also over
        # H x W pixels), so one sample leaves training nothing to normalise over: torch's forward raises.
        has_batch_norm_1d = any(isinstance(module, nn.BatchNorm1d) for module in model.modules())
        self.notes = []
        # What this run's BatchNorm layers really are (the model may have none): "ddpkit.SyncBatchNorm",
        # "torch.nn.SyncBatchNorm" or "BatchNorm" (plain, statistics of each rank's own batch).
        self.batch_norm = "BatchNorm"
        if config.impl == "ddpkit" and config.sync_bn:
            from ..syncbn import convert_sync_batchnorm
            model = convert_sync_batchnorm(model)
            self.batch_norm = "ddpkit.SyncBatchNorm"
        elif config.impl == "torch" and config.sync_bn and self.device.type == "cuda":
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
            self.batch_norm = "torch.nn.SyncBatchNorm"
        elif config.impl == "torch" and config.sync_bn:
            self.notes.append("torch.nn.SyncBatchNorm needs CUDA: the torch pipeline uses plain BatchNorm on CPU")
        # Every rank has the same settings, so every rank raises here, before the first collective.
        samples = self.micro_batch * (self.world_size if self.batch_norm != "BatchNorm" else 1)
        if has_batch_norm_1d and samples == 1:
            where = "each rank's micro-batch" if self.batch_norm == "BatchNorm" else "all ranks' micro-batches"
            raise UsageError(f"ddpkit: --model {config.model} has BatchNorm1d, which in training normalises over "
                             f"the samples of {where} ({self.batch_norm}), and 1 sample leaves nothing to "
                             "normalise over; use --batch-size 2 or more (or a --global-batch-size that gives it)")
        model = model.to(self.device)
        if config.impl == "ddpkit":
            self.model = DistributedDataParallel(model, grad_sync=config.grad_sync, algorithm=config.algorithm)
        else:
            self.model = nn.parallel.DistributedDataParallel(
                model, device_ids=[self.device.index] if self.device.type == "cuda" else None)

        parameters = [p for p in self.model.parameters() if p.requires_grad]
        if config.optimizer == "sgd":
            self.optimizer = torch.optim.SGD(parameters, lr=config.lr, momentum=config.momentum,
                                             weight_decay=config.weight_decay)
        else:
            self.optimizer = torch.optim.AdamW(parameters, lr=config.lr, weight_decay=config.weight_decay)
        self.total_steps = self.steps_per_epoch * config.epochs
        if config.max_steps:
            self.total_steps = min(self.total_steps, config.max_steps)
        self.scheduler = (torch.optim.lr_scheduler.CosineAnnealingLR(self.optimizer, T_max=self.total_steps)
                          if config.schedule == "cosine" else None)
        self.accumulate = GradientAccumulation(self.model, config.accumulation_steps)
        self.loss_fn = nn.CrossEntropyLoss()
        self.epoch = 0
        self.step = 0
        self.history: dict = {"epochs": [], "steps": []}
        self.resumed_from: Optional[Path] = None  # the checkpoint this run continues, if any
        self._epoch_batches: Optional[Iterator[torch.Tensor]] = None  # the epoch a train_epoch paused in
        self._epoch_time_s = 0.0  # training time of the current epoch so far, over the calls that ran it
        if config.resume:
            self._resume()

    def _log(self, *parts) -> None:
        if self.verbose:
            log(*parts)

    # -- data ----------------------------------------------------------------------------------
    def _set_up_data(self) -> None:
        config = self.config
        micro_batch = config.batch_size
        if config.global_batch_size is not None:
            per_step = self.world_size * config.accumulation_steps
            if config.global_batch_size % per_step:
                raise UsageError(f"ddpkit: --global-batch-size {config.global_batch_size} is not divisible by "
                                 f"world size x --accumulation-steps = {self.world_size} x "
                                 f"{config.accumulation_steps} = {per_step}")
            micro_batch = config.global_batch_size // per_step
        self.micro_batch = micro_batch
        self.global_batch = micro_batch * self.world_size * config.accumulation_steps

        self.train_x, self.train_y = load_dataset(config.dataset, config.data_root, train=True,
                                                  download=config.download)
        self.test_x, self.test_y = load_dataset(config.dataset, config.data_root, train=False,
                                                download=config.download)
        if config.limit_train:
            self.train_x, self.train_y = self.train_x[:config.limit_train], self.train_y[:config.limit_train]
        if config.limit_test:
            self.test_x, self.test_y = self.test_x[:config.limit_test], self.test_y[:config.limit_test]

        try:
            self.sampler = ShardedBatches(len(self.train_x), micro_batch, self.rank, self.world_size,
                                          seed=config.seed, shuffle=True, drop_last=True)
        except ValueError as exc:
            raise UsageError(f"{exc} (see --limit-train, --batch-size)") from None
        self.steps_per_epoch = len(self.sampler) // config.accumulation_steps
        if self.steps_per_epoch == 0:
            raise UsageError(f"ddpkit: an epoch has {len(self.sampler)} micro-batches per rank, fewer than "
                             f"--accumulation-steps {config.accumulation_steps}")

    def _transform(self, images: torch.Tensor, generator: Optional[torch.Generator] = None) -> torch.Tensor:
        if generator is not None and self.augment:
            images = random_crop_flip(images, padding=4, generator=generator)
        return normalize(images, self.info.mean, self.info.std)

    def _eval_transform(self, images: torch.Tensor) -> torch.Tensor:
        return normalize(images, self.info.mean, self.info.std)

    def _seed_micro_batch(self, micro_index: int) -> torch.Generator:
        # Note: every random draw of a micro-batch (dropout, augmentation) comes from seeds that are
        # a function of (seed, rank, micro-batch), so a resumed run replays them without saved states.
        seed = (self.config.seed * 1_000_003 + self.rank * 10_007 + micro_index) % (2**63)
        torch.manual_seed(seed)
        return torch.Generator().manual_seed(seed + 1)

    # -- checkpoints ---------------------------------------------------------------------------
    def _module(self) -> nn.Module:
        return self.model.module

    def checkpoint_state(self) -> dict:
        return {
            "config": dataclasses.asdict(self.config),
            "world_size": self.world_size,
            "model": self._module().state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler else None,
            "sampler": self.sampler.state_dict(),
            "accumulate": self.accumulate.state_dict(),
            "epoch": self.epoch,
            "step": self.step,
            "history": self.history,
        }

    def save_checkpoint(self) -> None:
        if self.rank == 0 and self.out_dir:
            _save_atomically(self.checkpoint_state(), self.out_dir / "checkpoint.pt")

    def _resume(self) -> None:
        path = self.out_dir / "checkpoint.pt" if self.out_dir else None
        holder = [None]
        if self.rank == 0 and path is not None and path.exists():
            try:
                holder[0] = torch.load(path, map_location="cpu", weights_only=False)
                if not isinstance(holder[0], dict) or not {"config", "world_size", "model"} <= holder[0].keys():
                    raise ValueError("not a ddpkit training checkpoint")
            except Exception as exc:  # whatever torch.load raises for a file that is no checkpoint
                holder[0] = {"error": f"ddpkit: checkpoint {path} cannot be resumed ({type(exc).__name__}: "
                                      f"{exc}); use another --out or --no-resume"}
        dist.broadcast_object_list(holder, src=0)  # nodes need not share a file system
        state = holder[0]
        if state is None:
            return
        if "error" in state:
            raise UsageError(state["error"])
        if state["world_size"] != self.world_size:
            raise UsageError(f"ddpkit: checkpoint {path} was written by {state['world_size']} ranks, this run has "
                             f"{self.world_size}; use another --out or --no-resume")
        saved = dict(state["config"])
        saved["augment"] = _resolved_augment(saved.get("augment"), saved["dataset"])  # older checkpoints kept None
        # More epochs continue a run that has finished all of its own; anywhere else a different
        # length would change the learning-rate schedule under the run.
        extending = (self.config.epochs > saved["epochs"] and state["epoch"] >= saved["epochs"]
                     and not saved.get("max_steps"))
        changed = [f"{name} {saved.get(name)!r} -> {getattr(self.config, name)!r}" for name in _RUN_DEFINING
                   if saved.get(name) != getattr(self.config, name) and not (name == "epochs" and extending)]
        if changed:
            raise UsageError(f"ddpkit: checkpoint {path} belongs to a different run ({', '.join(changed)}); "
                             "resuming it would mix two runs: use another --out or --no-resume")
        self._module().load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler and state["scheduler"]:
            self.scheduler.load_state_dict(state["scheduler"])
        self.sampler.load_state_dict(state["sampler"])
        self.accumulate.load_state_dict(state["accumulate"])
        self.epoch, self.step, self.history = state["epoch"], state["step"], state["history"]
        self.resumed_from = path
        if extending:
            self._stretch_schedule()
            self._log(f"continuing {path}, finished at epoch {self.epoch}, to epoch {self.config.epochs}"
                      + (f": the cosine schedule now spans {self.config.epochs} epochs, learning rate "
                         f"{self.optimizer.param_groups[0]['lr']:.4g} from here" if self.scheduler else ""))
        elif not self.done():
            self._log(f"resumed from {path}: epoch {self.epoch + 1}, optimizer step {self.step}")

    def _stretch_schedule(self) -> None:
        """Puts the cosine schedule of a finished run onto the new number of steps, at the current step
        (its saved state ends at the old length, where it would turn back up)."""
        if self.scheduler is None:
            return
        # Built with last_epoch = step - 1, the scheduler's initial step puts it at `step`; it keeps the
        # current learning rate there, so that is set to the curve's value, from which its later steps go on.
        self.scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(self.optimizer, T_max=self.total_steps,
                                                                    last_epoch=self.step - 1)
        for group in self.optimizer.param_groups:
            group["lr"] = group["initial_lr"] * (1 + math.cos(math.pi * self.step / self.total_steps)) / 2

    # -- training ------------------------------------------------------------------------------
    def done(self) -> bool:
        return self.step >= self.total_steps or self.epoch >= self.config.epochs

    def train_epoch(self, until_step: Optional[int] = None) -> Optional[dict]:
        """Trains to the end of the current epoch (or to optimizer step ``until_step``, or the last
        step), then checkpoints. A call after one that stopped at ``until_step`` within an epoch goes
        on with that epoch's next batch. The epoch's evaluation, and its record (returned, and added to
        ``history["epochs"]``), come at its end or at the last step only: a call that stops at
        ``until_step`` before either returns None."""
        config = self.config
        if self._epoch_batches is None:
            self.sampler.set_epoch(self.epoch)
            self._epoch_batches = iter(self.sampler)
        self.model.train()
        micro_batches = self.steps_per_epoch * config.accumulation_steps
        progress = self._progress_bar()
        started = time.perf_counter()
        loss_sum = torch.zeros(2, dtype=torch.float64)  # for the log: sum of losses, micro-batches
        for indices in self._epoch_batches:
            position = self.sampler.state_dict()["position"]  # 1-based index of this micro-batch
            if position > micro_batches:
                break  # the epoch's tail that does not fill a whole optimizer step
            generator = self._seed_micro_batch(self.epoch * micro_batches + position)
            x = self._transform(self.train_x[indices], generator).to(self.device)
            y = self.train_y[indices].to(self.device)
            t0 = time.perf_counter()
            loss = self.loss_fn(self.model(x), y)
            t1 = time.perf_counter()
            stepped = self.accumulate.backward(loss)
            t2 = time.perf_counter()
            loss_value = loss.item()
            loss_sum += torch.tensor([loss_value, 1.0], dtype=torch.float64)
            if not stepped:
                continue
            self.optimizer.step()
            if self.scheduler:
                self.scheduler.step()
            self.optimizer.zero_grad()
            self.step += 1
            record = {"step": self.step, "epoch": self.epoch, "local_loss": loss_value,
                      "lr": self.optimizer.param_groups[0]["lr"], "forward_s": t1 - t0, "backward_s": t2 - t1}
            if isinstance(self.model, DistributedDataParallel):
                stats = self.model.reducer_stats()
                record["comm_wait_s"] = stats["last_wait_us"] / 1e6
            if self.step % config.log_every == 0 or self.step == self.total_steps:
                comm.all_reduce(loss_sum)
                record["loss"] = float(loss_sum[0] / loss_sum[1])
                self._log(f"epoch {self.epoch + 1} step {self.step}/{self.total_steps} loss {record['loss']:.4f} "
                    f"lr {record['lr']:.4g}")
                loss_sum.zero_()
            self.history["steps"].append(record)
            if progress is not None:
                progress.update(1)
            if config.checkpoint_every and self.step % config.checkpoint_every == 0:
                self.save_checkpoint()
            if self.step >= self.total_steps or (until_step is not None and self.step >= until_step):
                break
        if progress is not None:
            progress.close()
        self._epoch_time_s += time.perf_counter() - started
        finished_epoch = self.sampler.state_dict()["position"] >= micro_batches
        if not (finished_epoch or self.done()):
            # A pause within the epoch: evaluating here would add a record an uninterrupted run has not.
            self.save_checkpoint()
            return None
        self._take_rank_0_buffers()
        result = evaluate(self._module(), self.test_x, self.test_y, self._eval_transform, config.eval_batch_size,
                          self.device)
        epoch_time, self._epoch_time_s = self._epoch_time_s, 0.0
        record = {"epoch": self.epoch, "step": self.step, "epoch_time_s": epoch_time, "test_loss": result["loss"],
                  "test_accuracy": result["accuracy"], "test_samples": result["samples"]}
        self._log(f"epoch {self.epoch + 1}: test loss {result['loss']:.4f} accuracy {100 * result['accuracy']:.2f}% "
            f"({result['samples']} samples), {epoch_time:.1f}s")
        self.history["epochs"].append(record)
        if finished_epoch:
            self.epoch += 1
            self._epoch_batches = None
        self.save_checkpoint()
        return record

    def _take_rank_0_buffers(self) -> None:
        """Gives every rank rank 0's buffers (plain BatchNorm's running statistics are each rank's own),
        so that the distributed evaluation scores the model that model.pt and the checkpoint hold."""
        if self.world_size > 1:
            with torch.no_grad():
                _broadcast_tensors(list(self._module().buffers()), None)  # one broadcast per dtype

    def _progress_bar(self):
        if self.rank != 0 or self.config.progress is False:
            return None
        from tqdm import tqdm
        done_in_epoch = self.step - self.epoch * self.steps_per_epoch
        desc = f"{self.progress_label} epoch {self.epoch + 1}/{self.config.epochs}".lstrip()
        return tqdm(total=self.steps_per_epoch, initial=max(0, done_in_epoch), desc=desc,
                    unit="step", leave=False, file=sys.stderr,
                    # A bar redrawn into a pipe or a log file turns into thousands of fragments.
                    disable=None if self.config.progress is None else False)

    def summary(self) -> dict:
        peak = torch.tensor([float(_peak_rss_bytes())], dtype=torch.float64)
        comm.all_reduce(peak, op="max")
        last = self.history["epochs"][-1] if self.history["epochs"] else {}
        return {"config": dataclasses.asdict(self.config), "world_size": self.world_size,
                "global_batch_size": self.global_batch, "micro_batch_per_rank": self.micro_batch,
                "batch_norm": self.batch_norm, "notes": self.notes, "final_test_accuracy": last.get("test_accuracy"),
                "final_test_loss": last.get("test_loss"), "peak_rss_bytes_max_over_ranks": int(peak),
                "history": self.history}

    def header(self) -> str:
        """What runs, in two lines: the pipeline, then the process group and how its collectives travel.

        Collective (``comm.resolved_transport``): every rank must call it."""
        transport = comm.resolved_transport()
        transport = {"shm": "shared memory", "process_group": "the process group's send/recv"}.get(transport, transport)
        backend = dist.get_backend()
        if self.config.impl == "ddpkit":
            ddp = "ddpkit.DistributedDataParallel"
            collectives = f"ddpkit's collectives over {transport}"
        else:
            # torch's DDP goes through the process group, whatever its backend; ddpkit's own collectives
            # serve the evaluation and the loss log.
            ddp = "torch.nn.parallel.DistributedDataParallel"
            collectives = (f"torch's DDP all-reduces gradients through the process group ({backend}); "
                           f"evaluation and loss logs use ddpkit's collectives over {transport}")
        # A run that --max-steps cuts short runs fewer epochs than --epochs asks for: say what will run.
        epochs = math.ceil(self.total_steps / self.steps_per_epoch)
        length = f"{self.total_steps} optimizer steps in {epochs} epoch{'' if epochs == 1 else 's'}"
        if self.total_steps < self.steps_per_epoch * self.config.epochs:
            length += (f" (--max-steps {self.config.max_steps} of --epochs {self.config.epochs}; "
                       f"{self.steps_per_epoch} steps an epoch)")
        return (f"training {self.config.model} on {self.config.dataset} with {ddp} and {self.batch_norm}: "
                f"micro-batch {self.micro_batch}/rank, accumulation {self.config.accumulation_steps}, global batch "
                f"{self.global_batch}, {length}\n"
                f"process group: backend {backend}, world size {self.world_size}, device "
                f"{self.device.type}; {collectives}")

    def run(self) -> dict:
        """Trains to the end, writes the model and the metrics, and returns the metrics. A run whose
        checkpoint has finished already trains nothing: it says so, and writes model.pt and
        metrics.json from the checkpoint only where they are missing (a run stopped between writing
        its last checkpoint and them)."""
        header = self.header()
        for note in self.notes:
            self._log(f"note: {note}")
        if self.done():
            summary = self.summary()
            finished = f"epoch {self.epoch}" if self.epoch >= self.config.epochs else f"optimizer step {self.step}"
            missing = [name for name in ("model.pt", "metrics.json")
                       if self.rank == 0 and self.out_dir and not (self.out_dir / name).exists()]
            if "model.pt" in missing:
                _save_atomically(self._module().state_dict(), self.out_dir / "model.pt")
            if "metrics.json" in missing:
                _write_json_atomically(summary, self.out_dir / "metrics.json")
            if missing:
                self._log(f"{self.resumed_from}: the run already finished at {finished}; wrote the missing "
                          f"{' and '.join(str(self.out_dir / name) for name in missing)} from it")
                return summary
            how = (f"pass --epochs {self.config.epochs + 1} (or more) to continue" if not self.config.max_steps
                   else "use another --out or --no-resume to train again")
            self._log(f"{self.resumed_from}: the run already finished at {finished}; nothing to do ({how})")
            return summary
        self._log(header)
        while not self.done():
            self.train_epoch()
        summary = self.summary()
        if self.rank == 0 and self.out_dir:
            _save_atomically(self._module().state_dict(), self.out_dir / "model.pt")
            _write_json_atomically(summary, self.out_dir / "metrics.json")
            self._log(f"wrote {self.out_dir / 'metrics.json'}, {self.out_dir / 'model.pt'} and "
                      f"{self.out_dir / 'checkpoint.pt'}")
        return summary


def _raise_if_any_rank_failed(error: Optional[str]) -> None:
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


def _one_line(message: str) -> str:
    message = " ".join(str(message).split())
    return message if message.startswith("ddpkit") else f"ddpkit: {message}"


def _fail(message: str, status: int, speaker: bool) -> None:
    if speaker:
        print(_one_line(message), file=sys.stderr, flush=True)
    sys.exit(status)


def main(argv: Optional[list[str]] = None) -> None:
    config, args = parse_args(argv)
    # Before the group exists the rank is what torchrun or --rank says.
    first = (args.rank if args.rank is not None else int(os.environ.get("RANK", "0"))) == 0
    try:
        info = init_from_args(args)
    except ValueError as error:
        _fail(str(error), 2, first)
    except dist.DistError as error:  # e.g. --master-addr/--master-port that cannot be reached or bound
        _fail(f"ddpkit: cannot set up the process group: {str(error).splitlines()[0] if str(error) else error!r}",
              1, first)
    try:
        Trainer(config, info).run()
    except UsageError as error:
        _fail(str(error), 1, info.rank == 0)
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
