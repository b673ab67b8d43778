"""Starting process groups: under torchrun, SLURM's srun, mpirun, or across nodes by hand.

``init_distributed()`` finds this process's place in the job in the first of these that applies
(Note [Launchers], below, says why in this order):

1. explicit arguments: ``master_addr``, ``master_port``, ``world_size``, ``rank`` (one command per node,
   ``tcp://`` rendezvous);
2. torchrun's variables: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``;
3. SLURM's, in each task that ``srun`` starts: ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``; the
   rendezvous is ``MASTER_ADDR`` or else the first host of ``SLURM_JOB_NODELIST``, at ``MASTER_PORT`` or else
   a port derived from ``SLURM_JOB_ID``;
4. Open MPI's ``mpirun``: ``OMPI_COMM_WORLD_RANK``, ``OMPI_COMM_WORLD_SIZE``, ``OMPI_COMM_WORLD_LOCAL_RANK``;
5. MPICH's and Intel MPI's ``mpirun`` (Hydra), and other PMI launchers: ``PMI_RANK``, ``PMI_SIZE``,
   ``MPI_LOCALRANKID``;
6. none of them: a group of one, so that scripts also run as plain ``python script.py``.

No MPI launcher says where rank 0 is. Under 4 and 5 the rendezvous is ``MASTER_ADDR`` (at ``MASTER_PORT``,
29500 by default as torchrun's); without it a job whose tasks all run on this host (the launcher's local
size is its size) meets on 127.0.0.1, and any other raises. ``launch_from_environment`` is that reading, with
no rendezvous; ``DistInfo.launcher`` says which applied. Worker processes started from Python, each with its
process group, are ``ddpkit.workers``' (``ddpkit.spawn``).
"""

from __future__ import annotations

import datetime
import itertools
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

DEFAULT_GROUP_TIMEOUT_S = float(os.environ.get("DDPKIT_GROUP_TIMEOUT", "300"))

# Note [Launchers]
# ~~~~~~~~~~~~~~~~
# A launcher's variables are read in the order of the module's docstring, and the first launcher whose
# variables are there decides. Explicit arguments are the caller's own word. torchrun comes before the
# cluster launchers because it runs under them: `srun torchrun ...` and `mpirun torchrun ...` start
# workers that inherit the outer launcher's variables (SLURM_PROCID of the torchrun, not of the worker)
# beside torchrun's own, which are the workers' ranks. SLURM comes before the MPI launchers because srun
# itself sets PMI_RANK and PMI_SIZE for MPI programs (--mpi=pmi2), with the same values.
#
# A launcher's variables that say the job has more than one task are never read as a group of one: a
# job that cannot find its rendezvous raises on every task (each reads the same variables), naming what
# to set. Half a launcher's variables (a rank without a size, a size without a rank) raise too, but for
# SLURM_PROCID without SLURM_NTASKS: sbatch sets it in a batch script, which is one process. Tasks that
# find a rendezvous but cannot meet there raise when the group's timeout runs out, on every task, naming
# the address and where it came from. tests/test_launchers.py starts real processes with each launcher's
# variables and nothing else, on one host and across two simulated hosts.
LAUNCHERS = ("arguments", "torchrun", "slurm", "openmpi", "pmi", "none")

# A SLURM job's rendezvous port without MASTER_PORT: SLURM_PORT_BASE plus the job id modulo SLURM_PORT_SPAN,
# the same on every task of the job and below Linux's ephemeral ports (32768 and up), so that an outgoing
# connection of another program rarely holds it; two jobs on one node share it only if their ids agree in
# their last four digits.
SLURM_PORT_BASE, SLURM_PORT_SPAN = 15000, 10000
# torchrun's default --master_port, for the MPI launchers when MASTER_PORT is not set.
DEFAULT_MASTER_PORT = 29500


@dataclass(frozen=True)
class DistInfo:
    """This process's place in the default group, and what set it up: ``launcher`` is one of ``LAUNCHERS``
    (the module's docstring), or "existing" where the group was there before ``init_distributed``."""

    rank: int
    world_size: int
    local_rank: int
    backend: str
    launcher: str = "existing"


@dataclass(frozen=True)
class Launch:
    """What a launcher's variables say, before any rendezvous: this task's rank among ``world_size``, its
    index on its host where the launcher says it (else None), and the rendezvous address and port (None
    for torchrun, whose own ``env://`` rendezvous reads them, and for a group of one). ``address_from``
    names where the address came from, for error messages."""

    launcher: str
    rank: int
    world_size: int
    local_rank: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    address_from: str = ""


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"


def expand_slurm_nodelist(nodelist: str) -> list[str]:
    """The host names of a SLURM node list, in order, as ``scontrol show hostnames`` prints them.

    A list is names separated by commas; a name may hold bracketed ranges, each a comma-separated list of
    numbers and ``first-last`` spans whose numbers keep the first one's width: ``node[01-03,07],gpu-a1`` is
    node01, node02, node03, node07 and gpu-a1, and ``rack[1-2]-n[8-9]`` is rack1-n8, rack1-n9, rack2-n8 and
    rack2-n9. Anything else raises ``ValueError``.
    """
    items, depth, start = [], 0, 0
    for i, char in enumerate(nodelist):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth not in (0, 1):
            raise ValueError(f"ddpkit: SLURM node list {nodelist!r}: unbalanced brackets")
        if char == "," and depth == 0:
            items.append(nodelist[start:i])
            start = i + 1
    items.append(nodelist[start:])
    if depth != 0 or any(not item for item in items):
        raise ValueError(f"ddpkit: SLURM node list {nodelist!r}: unbalanced brackets or an empty name")
    hosts = []
    for item in items:
        parts = re.split(r"\[([^\]]*)\]", item)  # literal, ranges, literal, ranges, ..., literal
        choices = [[part] if i % 2 == 0 else _expand_ranges(part, nodelist) for i, part in enumerate(parts)]
        hosts.extend("".join(pieces) for pieces in itertools.product(*choices))
    return hosts


def _expand_ranges(ranges: str, nodelist: str) -> list[str]:
    numbers = []
    for span in ranges.split(","):
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", span)
        if not match or (match.group(2) is not None and int(match.group(2)) < int(match.group(1))):
            raise ValueError(f"ddpkit: SLURM node list {nodelist!r}: {span!r} is not a number or a range first-last")
        first, last = match.group(1), match.group(2) or match.group(1)
        numbers.extend(f"{n:0{len(first)}d}" for n in range(int(first), int(last) + 1))
    return numbers


def _integer(environ: Mapping[str, str], name: str) -> int:
    try:
        return int(environ[name])
    except ValueError:
        raise ValueError(f"ddpkit: {name}={environ[name]!r} is not an integer") from None


def _rank_and_size(environ: Mapping[str, str], launcher: str, rank_name: str, size_name: str) -> tuple[int, int]:
    """The rank and size a launcher's two variables give, or ValueError when only one is set or they disagree."""
    if (rank_name in environ) != (size_name in environ):
        present, missing = (rank_name, size_name) if rank_name in environ else (size_name, rank_name)
        raise ValueError(
            f"ddpkit: {present} is set but {missing} is not: {launcher}'s variables are half set. Start every "
            f"task through the launcher, or unset {present} to run a single process"
        )
    rank, size = _integer(environ, rank_name), _integer(environ, size_name)
    if not 0 <= rank < size:
        raise ValueError(f"ddpkit: {rank_name}={rank} is not in [0, {size_name}={size})")
    return rank, size


def _port(environ: Mapping[str, str], default: int | None) -> int | None:
    if "MASTER_PORT" not in environ:
        return default
    port = _integer(environ, "MASTER_PORT")
    if not 0 < port < 65536:
        raise ValueError(f"ddpkit: MASTER_PORT={port} is not a port (1..65535)")
    return port


def _slurm(environ: Mapping[str, str]) -> Launch:
    rank, size = _rank_and_size(environ, "SLURM", "SLURM_PROCID", "SLURM_NTASKS")
    local_rank = _integer(environ, "SLURM_LOCALID") if "SLURM_LOCALID" in environ else None
    if size == 1:
        return Launch("slurm", rank, size, local_rank)
    if "MASTER_ADDR" in environ:
        addr, address_from = environ["MASTER_ADDR"], "MASTER_ADDR"
    elif environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST"):
        name = "SLURM_JOB_NODELIST" if environ.get("SLURM_JOB_NODELIST") else "SLURM_NODELIST"
        addr, address_from = expand_slurm_nodelist(environ[name])[0], f"the first host of {name}"
    else:
        raise ValueError(
            f"ddpkit: SLURM says this job has {size} tasks, but neither MASTER_ADDR nor SLURM_JOB_NODELIST is set: "
            "set MASTER_ADDR to the address of rank 0's host (and MASTER_PORT to a free port there)"
        )
    job_id = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID")
    port = _port(environ, None)
    if port is None:
        if not job_id:
            raise ValueError(
                f"ddpkit: SLURM says this job has {size} tasks, but neither MASTER_PORT nor SLURM_JOB_ID is set: "
                "set MASTER_PORT to a free port on rank 0's host"
            )
        port = SLURM_PORT_BASE + int(job_id) % SLURM_PORT_SPAN
    return Launch("slurm", rank, size, local_rank, addr, port, address_from)


def _mpi(environ: Mapping[str, str], launcher: str, names: tuple[str, str, str, str]) -> Launch:
    rank_name, size_name, local_rank_name, local_size_name = names
    rank, size = _rank_and_size(environ, launcher, rank_name, size_name)
    local_rank = _integer(environ, local_rank_name) if local_rank_name in environ else None
    if size == 1:
        return Launch(launcher, rank, size, local_rank)
    port = _port(environ, DEFAULT_MASTER_PORT)
    if "MASTER_ADDR" in environ:
        return Launch(launcher, rank, size, local_rank, environ["MASTER_ADDR"], port, "MASTER_ADDR")
    if local_size_name in environ and _integer(environ, local_size_name) == size:
        return Launch(launcher, rank, size, local_rank, "127.0.0.1", port, f"this host ({local_size_name}={size})")
    raise ValueError(
        f"ddpkit: {launcher} says this job has {size} tasks ({size_name}), but not where rank 0 is: set "
        f"MASTER_ADDR to the address of rank 0's host (and MASTER_PORT, default {DEFAULT_MASTER_PORT}), e.g. "
        "mpirun -x MASTER_ADDR=HOST (Open MPI) or -genv MASTER_ADDR HOST (MPICH, Intel MPI)"
    )


_MPI_LAUNCHERS = {
    "openmpi": (
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
    ),
    "pmi": ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
}


def launch_from_environment(environ: Mapping[str, str] | None = None) -> Launch:
    """What the launchers' variables in ``environ`` (os.environ by default) say, in the order of the module's
    docstring: torchrun's, SLURM's, Open MPI's, PMI's, else a group of one (launcher "none"). Raises
    ValueError, naming what to set, for half-set variables and for a job of several tasks whose rendezvous
    cannot be found; no rendezvous is attempted."""
    environ = os.environ if environ is None else environ
    if "RANK" in environ or "WORLD_SIZE" in environ:
        rank, size = _rank_and_size(environ, "torchrun", "RANK", "WORLD_SIZE")
        missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if name not in environ]
        if missing:
            raise ValueError(f"ddpkit: RANK/WORLD_SIZE are set but {', '.join(missing)} is not; launch with torchrun")
        local_rank = _integer(environ, "LOCAL_RANK") if "LOCAL_RANK" in environ else None
        return Launch("torchrun", rank, size, local_rank)
    if "SLURM_NTASKS" in environ:  # without it, SLURM_PROCID is a batch script's one process (Note [Launchers])
        return _slurm(environ)
    for launcher, names in _MPI_LAUNCHERS.items():
        if names[0] in environ or names[1] in environ:
            return _mpi(environ, launcher, names)
    return Launch("none", 0, 1, 0)


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
    ``world_size`` and ``rank``; otherwise it reads the launchers' variables in the order of the module's
    docstring (torchrun, SLURM, Open MPI, PMI). Without any (plain ``python script.py``) it starts a group of
    one. The local rank, the CUDA device with NCCL, is the launcher's (``LOCAL_RANK``, ``SLURM_LOCALID``, ...),
    or without it ``rank % device_count``. A launch configuration that cannot work (arguments out of range,
    a launcher's variables half set, several tasks and no rendezvous address) raises ``ValueError`` on every
    task; tasks that cannot meet at the address they found raise ``torch.distributed.DistError`` once
    ``timeout`` seconds have passed, naming it.
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
        launch = Launch("arguments", rank, world_size, None, master_addr, master_port, "master_addr")
    else:
        launch = launch_from_environment()
    if launch.launcher == "torchrun":
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            dist.init_process_group(
                backend,
                store=_attempt_store(group_timeout),
                rank=launch.rank,
                world_size=launch.world_size,
                timeout=group_timeout,
            )
        else:
            dist.init_process_group(backend, timeout=group_timeout)
    elif launch.master_addr is None:  # a group of one
        dist.init_process_group(backend, store=dist.HashStore(), world_size=1, rank=0, timeout=group_timeout)
    else:
        _rendezvous(backend, launch, group_timeout)
    local_rank = launch.local_rank if launch.local_rank is not None else _local_rank(launch.rank)
    if "nccl" in backend:
        torch.cuda.set_device(local_rank)
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, backend, launch.launcher)


def _rendezvous(backend: str, launch: Launch, timeout: datetime.timedelta) -> None:
    """The group of ``launch``'s tasks at its ``tcp://`` address, or DistError naming the address and its source."""
    where = f"{launch.master_addr}:{launch.master_port}"
    try:
        socket.getaddrinfo(launch.master_addr, launch.master_port, type=socket.SOCK_STREAM)
    except OSError as error:
        raise ValueError(
            f"ddpkit: the rendezvous host {launch.master_addr!r} ({launch.address_from}) does not resolve "
            f"({error}); set MASTER_ADDR to the address of rank 0's host"
        ) from None
    try:
        dist.init_process_group(
            backend,
            init_method=f"tcp://{where}",
            world_size=launch.world_size,
            rank=launch.rank,
            timeout=timeout,
        )
    except dist.DistError as error:
        first_line = str(error).splitlines()[0].rstrip(".") if str(error) else repr(error)
        raise type(error)(
            f"ddpkit: task {launch.rank} of {launch.world_size} ({launch.launcher}) could not meet the others at "
            f"{where} ({launch.address_from}) within {timeout.total_seconds():g} s: {first_line}. Check that every "
            "task was started, or set MASTER_ADDR to the address of rank 0's host and MASTER_PORT to a free port there"
        ) from error


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
