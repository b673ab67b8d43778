"""Starting process groups: under torchrun, or across nodes by hand.

``init_distributed()`` reads torchrun's environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``), or takes ``master_addr/master_port/world_size/rank`` explicitly
for a launch without torchrun (one command per node, ``tcp://`` rendezvous). Worker processes started
from Python, each with its process group, are ``ddpkit.workers``' (``ddpkit.spawn``).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

DEFAULT_GROUP_TIMEOUT_S = float(os.environ.get("DDPKIT_GROUP_TIMEOUT", "300"))


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    backend: str


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"


def init_distributed(
    backend: str | None = None,
    *,
    master_addr: str | None = None,
    master_port: int | None = None,
    world_size: int | None = None,
    rank: int | None = None,
    timeout: float = DEFAULT_GROUP_TIMEOUT_S,
) -> DistInfo:
    """Initializes the default process group and returns this process's place in it.

    With ``master_addr`` it rendezvouses at ``tcp://master_addr:master_port`` with the given
    ``world_size`` and ``rank``; otherwise it expects torchrun's environment variables. Without either
    (plain ``python script.py``) it starts a group of one, so scripts also run single-process. The
    local rank, the CUDA device with NCCL, is ``LOCAL_RANK``, or without it ``rank % device_count``. A
    launch configuration that cannot work (arguments out of range, torchrun's variables half set) raises
    ``ValueError``.
    """
    backend = backend or default_backend()
    if dist.is_initialized():
        return _current_info()
    group_timeout = datetime.timedelta(seconds=timeout)
    if master_addr is not None:
        if world_size is None or rank is None:
            raise ValueError("ddpkit: master_addr needs world_size and rank")
        if not 0 <= rank < world_size:
            raise ValueError(f"ddpkit: rank {rank} is not in [0, world_size={world_size})")
        dist.init_process_group(
            backend,
            init_method=f"tcp://{master_addr}:{master_port}",
            world_size=world_size,
            rank=rank,
            timeout=group_timeout,
        )
        local_rank = _local_rank(rank)
    elif "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
        if missing:
            raise ValueError(f"ddpkit: RANK/WORLD_SIZE are set but {', '.join(missing)} is not; launch with torchrun")
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            dist.init_process_group(
                backend,
                store=_attempt_store(group_timeout),
                rank=int(os.environ["RANK"]),
                world_size=int(os.environ["WORLD_SIZE"]),
                timeout=group_timeout,
            )
        else:
            dist.init_process_group(backend, timeout=group_timeout)
        local_rank = _local_rank(int(os.environ["RANK"]))
    else:
        store = dist.HashStore()
        dist.init_process_group(backend, store=store, world_size=1, rank=0, timeout=group_timeout)
        local_rank = 0
    if "nccl" in backend:
        torch.cuda.set_device(local_rank)
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, backend)


def _local_rank(rank: int) -> int:
    """This process's index among those of its node, which picks its CUDA device: ``LOCAL_RANK`` where the
    launcher sets it (torchrun does), else ``rank % torch.cuda.device_count()`` (0 without CUDA), so that
    processes started by hand with consecutive ranks on one node take different GPUs."""
    if "LOCAL_RANK" in os.environ:
        return int(os.environ["LOCAL_RANK"])
    devices = torch.cuda.device_count()
    return rank % devices if devices else 0


def _attempt_store(timeout: datetime.timedelta) -> dist.Store:
    """torchrun's shared rendezvous store, with keys private to this restart attempt.

    Under torchrun the workers share the agent's store, and torch 2.13 does not separate the keys
    of successive restart attempts in it (pytorch/pytorch#135712): a restarted worker can read the
    gloo address a dead worker of the previous attempt published, and the new group then fails to
    connect or hangs. Prefixing every key with the attempt number keeps attempts apart.
    """
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        int(os.environ["WORLD_SIZE"]),
        is_master=False,
        timeout=timeout,
    )
    return dist.PrefixStore(f"ddpkit/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def _current_info() -> DistInfo:
    return DistInfo(dist.get_rank(), dist.get_world_size(), _local_rank(dist.get_rank()), dist.get_backend())
