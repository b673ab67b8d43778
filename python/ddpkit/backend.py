"""The "ddpkit" torch.distributed backend: ``init_process_group(backend="ddpkit")``.

Importing ddpkit registers it, so any torch program, torch's own ``DistributedDataParallel`` and
``ZeroRedundancyOptimizer`` included, runs its CPU collectives on ddpkit's engine: shared memory
between the ranks of one host, ddpkit's message schedules over gloo across hosts, and ddpkit's
collective checks. What it implements and what it hands to gloo: Note [The ddpkit backend] in
csrc/backend/backend.h. CPU tensors only; ``backend="cpu:ddpkit,cuda:nccl"`` adds NCCL for CUDA.
"""

from __future__ import annotations

import datetime

import torch.distributed as dist

from . import _C

NAME = "ddpkit"


def _create(
    store: dist.Store, rank: int, world_size: int, timeout: datetime.timedelta, point_to_point: bool = True
) -> dist.Backend:
    # Two inner gloo backends on store prefixes of their own: one carries the engine's messages
    # across hosts and the delegated collectives, the other the program's own send/recv, whose tags
    # would otherwise meet the engine's. A caller that never sends (ddpkit.torchft's group, which
    # refuses send/recv unless asked) connects one only.
    gloo = dist.ProcessGroupGloo(dist.PrefixStore("ddpkit-gloo/", store), rank, world_size, timeout)
    gloo_p2p = (
        dist.ProcessGroupGloo(dist.PrefixStore("ddpkit-gloo-p2p/", store), rank, world_size, timeout)
        if point_to_point
        else gloo
    )
    return _C.Backend(store, rank, world_size, timeout, gloo, gloo_p2p)


def register() -> None:
    """Registers the backend with torch.distributed (idempotent; done on ``import ddpkit``)."""
    if dist.is_available() and NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(NAME, _create, devices=["cpu"])
