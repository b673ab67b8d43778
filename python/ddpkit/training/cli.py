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
import dataclasses
import os
import sys
from pathlib import Path

from .. import comm
from ..ddp import GRAD_SYNC_MODES
from ..launch import DEFAULT_GROUP_TIMEOUT_S, DistInfo, init_distributed
from .config import COMM_HOOKS, SHARD_MODES, TrainConfig
from .data import DATA_ROOT, DATASETS, FASHION_MNIST_ROOT, dataset_name
from .models import MODELS


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
                "cpu:ddpkit,cuda:nccl)"
            )
    return text


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the process-group flags: the backend, and launching one process per node without torchrun."""
    group = parser.add_argument_group("process group (under torchrun, only --backend and --timeout apply)")
    group.add_argument(
        "--backend",
        type=backend_argument,
        metavar="{" + ",".join(BACKENDS) + "}",
        help="torch.distributed backend (default: nccl with CUDA, else gloo); 'ddpkit' runs torch's "
        "own collectives on ddpkit's engine. A device map such as cpu:ddpkit,cuda:nccl is "
        "accepted too",
    )
    group.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_GROUP_TIMEOUT_S,
        help="process-group timeout in seconds (a dead peer is reported within it)",
    )
    group.add_argument("--master-addr", help="launch without torchrun: address of rank 0's node")
    group.add_argument(
        "--master-port",
        type=port_number,
        default=29500,
        help="launch without torchrun: a free TCP port on rank 0's node",
    )
    group.add_argument("--world-size", type=positive_int, help="launch without torchrun: total number of processes")
    group.add_argument("--rank", type=non_negative_int, help="launch without torchrun: this process's rank")


def init_from_args(args: argparse.Namespace) -> DistInfo:
    """``init_distributed`` with the flags of ``add_launch_arguments``."""
    return init_distributed(
        backend=args.backend,
        master_addr=args.master_addr,
        master_port=args.master_port,
        world_size=args.world_size,
        rank=args.rank,
        timeout=args.timeout,
    )


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


def _program_name() -> str | None:
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
        raise argparse.ArgumentTypeError(
            f"invalid choice: {text!r} (choose from {', '.join(sorted(DATASETS))}; "
            "'-' and '_' alike, e.g. fashion-mnist)"
        ) from None


def parse_args(argv: list[str] | None = None) -> tuple[TrainConfig, argparse.Namespace]:
    defaults = TrainConfig()
    parser = _Parser(
        prog=_program_name(), description=__doc__.split("\n\n")[0], formatter_class=_HelpFormatter, epilog=_EPILOG
    )
    parser.add_argument(
        "--dataset",
        type=_dataset_argument,
        default=defaults.dataset,
        metavar="{" + ",".join(sorted(DATASETS)) + "}",
        help="fashion-mnist, cifar-10 and the like are accepted too",
    )
    parser.add_argument(
        "--data-root",
        help=f"where the dataset lives (default: for CIFAR $DDPKIT_DATA, else {DATA_ROOT} under the "
        f"current directory; for Fashion-MNIST $DDPKIT_FASHION_MNIST, else {FASHION_MNIST_ROOT}, "
        "where apt-get install dataset-fashion-mnist puts it)",
    )
    parser.add_argument(
        "--download",
        action=argparse.BooleanOptionalAction,
        default=defaults.download,
        help="download CIFAR into --data-root if it is missing (md5-checked)",
    )
    parser.add_argument("--model", choices=MODELS, default=defaults.model, help="the network")
    parser.add_argument(
        "--impl",
        choices=("ddpkit", "torch"),
        default=defaults.impl,
        help="ddpkit: ddpkit.DistributedDataParallel and ddpkit.SyncBatchNorm; torch: "
        "torch.nn.parallel.DistributedDataParallel and torch.nn.SyncBatchNorm (CUDA only: "
        "plain BatchNorm on CPU)",
    )
    parser.add_argument(
        "--sync-bn",
        action=argparse.BooleanOptionalAction,
        default=defaults.sync_bn,
        help="synchronize BatchNorm statistics across ranks (--no-sync-bn: plain BatchNorm)",
    )
    parser.add_argument(
        "--grad-sync",
        choices=GRAD_SYNC_MODES,
        help=f"how ddpkit's DDP averages gradients, --impl ddpkit only (default: {defaults.grad_sync})",
    )
    parser.add_argument(
        "--algorithm",
        choices=comm.ALGORITHMS,
        help=f"ddpkit's all-reduce algorithm, --impl ddpkit only (default: {defaults.algorithm})",
    )
    parser.add_argument(
        "--comm-hook",
        choices=COMM_HOOKS,
        default=defaults.comm_hook,
        help="a communication hook on the DDP: bf16_crossing sends the gradients' bytes across hosts in "
        "bfloat16 (ddpkit.Options), bf16_compress is torch's bf16_compress_hook (every step, in bfloat16)",
    )
    parser.add_argument(
        "--shard",
        choices=SHARD_MODES,
        default=defaults.shard,
        help="what the ranks shard (docs/sharding.md): optimizer = ZeRO-1, gradients = ZeRO-2 "
        "(ddpkit.ShardedOptimizer), parameters = ZeRO-3 (ddpkit.FullyShardedDataParallel); the bits of none, "
        "less memory",
    )
    parser.add_argument(
        "--epochs",
        type=positive_int,
        default=defaults.epochs,
        help="epochs to train (a larger value continues a finished run)",
    )
    parser.add_argument(
        "--batch-size", type=positive_int, help=f"samples per rank and micro-batch (default: {defaults.batch_size})"
    )
    parser.add_argument(
        "--global-batch-size", type=positive_int, help="samples per optimizer step over all ranks (sets --batch-size)"
    )
    parser.add_argument(
        "--accumulation-steps",
        type=positive_int,
        default=defaults.accumulation_steps,
        help="micro-batches per optimizer step; gradients are all-reduced on the last one only",
    )
    parser.add_argument("--optimizer", choices=("sgd", "adamw"), default=defaults.optimizer, help="the optimizer")
    parser.add_argument("--lr", type=positive_float, default=defaults.lr, help="peak learning rate")
    parser.add_argument("--momentum", type=float, default=defaults.momentum, help="SGD momentum")
    parser.add_argument("--weight-decay", type=float, default=defaults.weight_decay, help="weight decay")
    parser.add_argument(
        "--schedule",
        choices=("cosine", "constant"),
        default=defaults.schedule,
        help="learning-rate schedule over all optimizer steps",
    )
    parser.add_argument(
        "--augment",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="random crop + flip (default: on for CIFAR, off for Fashion-MNIST)",
    )
    parser.add_argument("--seed", type=int, default=defaults.seed, help="seed of weights, data order and augmentation")
    parser.add_argument(
        "--log-every", type=positive_int, default=defaults.log_every, help="optimizer steps between loss lines"
    )
    parser.add_argument(
        "--eval-batch-size",
        type=positive_int,
        default=defaults.eval_batch_size,
        help="samples per rank and batch in evaluation",
    )
    parser.add_argument("--limit-train", type=positive_int, help="use only the first N training samples")
    parser.add_argument("--limit-test", type=positive_int, help="use only the first N test samples")
    parser.add_argument("--max-steps", type=positive_int, help="stop after N optimizer steps")
    parser.add_argument(
        "--out", dest="out_dir", default=defaults.out_dir, help="directory of metrics.json, model.pt and checkpoint.pt"
    )
    parser.add_argument(
        "--checkpoint-every",
        type=int,
        default=defaults.checkpoint_every,
        help="optimizer steps between checkpoints (0: after every epoch only)",
    )
    parser.add_argument(
        "--resume",
        action=argparse.BooleanOptionalAction,
        default=defaults.resume,
        help="continue from <out>/checkpoint.pt if it exists (--no-resume: start afresh and overwrite it)",
    )
    parser.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=defaults.progress,
        help="a progress bar per epoch on stderr (default: when stderr is a terminal)",
    )
    add_launch_arguments(parser)
    args = parser.parse_args(argv)
    if args.checkpoint_every < 0:
        parser.error("--checkpoint-every must be >= 0")
    # Options that do not go together (each alone is fine).
    if args.batch_size is not None and args.global_batch_size is not None:
        parser.error("--batch-size and --global-batch-size are alternatives: give one")
    if args.impl == "torch":
        given = [
            flag
            for flag, value in (("--grad-sync", args.grad_sync), ("--algorithm", args.algorithm))
            if value is not None
        ]
        if given:
            parser.error(
                f"{' and '.join(given)} set{'' if len(given) > 1 else 's'} up ddpkit's DDP, not --impl torch's"
            )
    if args.download and not args.dataset.startswith("cifar"):
        parser.error(
            f"--download fetches CIFAR only; {args.dataset} comes from `apt-get install dataset-fashion-mnist`"
        )
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
