"""The "ddpkit" torch.distributed backend: ``init_process_group(backend="ddpkit")``.

Importing ddpkit registers it, and so does importing torch (torch's backend autoload entry point,
python/_ddpkit_autoload, which loads ddpkit when a group is first created on it), so any torch program, torch's own ``DistributedDataParallel`` and
``ZeroRedundancyOptimizer`` included, runs its CPU collectives on ddpkit's engine: shared memory
between the ranks of one host, ddpkit's message schedules over gloo across hosts, and ddpkit's
collective checks. What it implements and what it hands to gloo: Note [The ddpkit backend] in
csrc/backend/backend.h. CPU tensors only; ``backend="cpu:ddpkit,cuda:nccl"`` adds NCCL for CUDA.
"""

from __future__ import annotations

import dataclasses
import datetime

import torch
import torch.distributed as dist

from . import _C
from .comm import wire_format

NAME = "ddpkit"


@dataclasses.dataclass(frozen=True)
class Options:
    """The "ddpkit" backend's options, passed as ``pg_options`` to ``init_process_group`` or ``new_group``.

    ``cross_host_dtype``: torch.bfloat16 or torch.float16 sends the float32 sums and means of
    ``all_reduce`` and ``reduce_scatter_single`` across hosts in that dtype, half the bytes, so that
    torch DDP, FSDP2 and torchft on this backend get it; the steps inside a host keep full precision
    (Note [Compressed crossing] in csrc/comm/core/wire_format.h). None, the default: exact."""

    cross_host_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        wire_format(self.cross_host_dtype)  # raises ValueError for any other dtype


def _create(
    store: dist.Store,
    rank: int,
    world_size: int,
    timeout: datetime.timedelta,
    point_to_point: bool = True,
    options: Options | None = None,
) -> dist.Backend:
    # Two inner gloo backends on store prefixes of their own: one carries the engine's messages
    # across hosts and the delegated collectives, the other the program's own send/recv, whose tags
    # would otherwise meet the engine's. A caller that never sends (ddpkit.torchft's group, which
    # refuses send/recv unless asked) connects one only.
    if options is not None and not isinstance(options, Options):
        raise TypeError(f"ddpkit backend: pg_options must be a ddpkit.Options, got {type(options).__name__}")
    gloo = dist.ProcessGroupGloo(dist.PrefixStore("ddpkit-gloo/", store), rank, world_size, timeout)
    gloo_p2p = (
        dist.ProcessGroupGloo(dist.PrefixStore("ddpkit-gloo-p2p/", store), rank, world_size, timeout)
        if point_to_point
        else gloo
    )
    wire = wire_format((options or Options()).cross_host_dtype)
    return _C.Backend(store, rank, world_size, timeout, gloo, gloo_p2p, wire)


def _create_with_options(backend_options, options: Options | None) -> dist.Backend:
    """torch.distributed's extended creator: its _DistributedBackendOptions and the caller's pg_options."""
    return _create(
        backend_options.store,
        backend_options.group_rank,
        backend_options.group_size,
        backend_options.timeout,
        options=options,
    )


def register() -> None:
    """Registers the backend with torch.distributed (idempotent; done on ``import ddpkit``)."""
    if dist.is_available() and NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(NAME, _create_with_options, extended_api=True, devices=["cpu"])
