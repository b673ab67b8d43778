"""ddpkit: data-parallel training for PyTorch, built from point-to-point messages.

Importing ddpkit loads its C++ extension, which registers the ``torch.ops.ddpkit`` custom ops and
the ``"ddpkit"`` torch.distributed backend. The library is ``comm``, ``syncbn``, ``ddp``, ``sharding``
(the shard layout) and ``sharded_optimizer`` (ZeRO-1/2), ``backend`` and ``launch``, with ``workers``
(``spawn``: run a function on N fresh processes that share a process group; ``WorkerPool``: keep them for
many calls). ``ddpkit.testing`` is the multi-process harness of the
tests and benchmarks (simulated hosts, engine timing), and ``ddpkit.training`` the training application
(datasets, models, trainer): the library imports neither.
``ddpkit.__version__`` is the installed distribution's version (pyproject.toml's).
"""

import atexit as _atexit
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _distribution_version

import torch
import torch.distributed  # noqa: F401  (before _C: its backend class derives from torch's)

from . import _C  # registers torch.ops.ddpkit.*
from .backend import Options
from .backend import register as _register_backend
from .comm import (
    all_gather_into_tensor,
    all_gather_single,
    all_reduce,
    barrier,
    broadcast,
    collective_checks_enabled,
    comm_counters,
    gather,
    reduce,
    reduce_scatter_single,
    reduce_scatter_tensor,
    reset_comm_counters,
    scatter,
    set_collective_checks,
)
from .ddp import DistributedDataParallel, GradientAccumulation
from .fsdp import FullyShardedDataParallel
from .launch import init_distributed
from .sharded_optimizer import ShardedOptimizer
from .syncbn import SyncBatchNorm, convert_sync_batchnorm, sync_batch_norm
from .workers import spawn

_register_backend()
# Before the interpreter finalizes: no thread of ddpkit's may take the GIL after that (Note [Exit paths]).
_atexit.register(_C.prepare_for_exit)

try:
    __version__ = _distribution_version("ddpkit")
except PackageNotFoundError:  # the package imported from a source tree that pip never installed
    __version__ = "0+unknown"

__all__ = [
    "DistributedDataParallel",
    "FullyShardedDataParallel",
    "GradientAccumulation",
    "Options",
    "ShardedOptimizer",
    "SyncBatchNorm",
    "all_gather_into_tensor",
    "all_gather_single",
    "all_reduce",
    "barrier",
    "broadcast",
    "collective_checks_enabled",
    "comm_counters",
    "convert_sync_batchnorm",
    "gather",
    "init_distributed",
    "reduce",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "reset_comm_counters",
    "scatter",
    "set_collective_checks",
    "spawn",
    "sync_batch_norm",
]
