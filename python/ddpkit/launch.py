"""Starting process groups: under torchrun, across nodes by hand, and inside tests and benchmarks.

* ``init_distributed()`` reads torchrun's environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
  ``MASTER_ADDR``, ``MASTER_PORT``), or takes ``master_addr/master_port/world_size/rank`` explicitly
  for a launch without torchrun (one command per node, ``tcp://`` rendezvous).
* ``WorkerPool`` keeps N worker processes with a live process group and runs functions on all of
  them; ``spawn`` is a one-shot pool. A failing rank's exception is re-raised in the parent with its
  remote traceback; on a failure or a timeout every worker is killed, so nothing is left behind.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import signal
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Optional

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


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the CS744-style flags for launching one process per node without torchrun."""
    group = parser.add_argument_group("launch without torchrun (one command per node)")
    group.add_argument("--master-addr", help="address of rank 0's node (enables explicit launch)")
    group.add_argument("--master-port", type=port_number, default=29500, help="free TCP port on rank 0's node")
    group.add_argument("--world-size", type=positive_int, help="total number of processes")
    group.add_argument("--rank", type=non_negative_int, help="this process's rank")
    group.add_argument("--backend", choices=("gloo", "nccl", "ddpkit", "cpu:ddpkit,cuda:nccl"),
                       help="torch.distributed backend (default: nccl with CUDA, else gloo); 'ddpkit' runs "
                            "torch's own collectives on ddpkit's (ddpkit.backend)")
    group.add_argument("--timeout", type=float, default=DEFAULT_GROUP_TIMEOUT_S,
                       help="process-group timeout in seconds (a dead peer is reported within it)")


def init_from_args(args: argparse.Namespace) -> DistInfo:
    """``init_distributed`` with the flags of ``add_launch_arguments``."""
    return init_distributed(backend=args.backend, master_addr=args.master_addr, master_port=args.master_port,
                            world_size=args.world_size, rank=args.rank, timeout=args.timeout)


def init_distributed(backend: Optional[str] = None, *, master_addr: Optional[str] = None,
                     master_port: Optional[int] = None, world_size: Optional[int] = None,
                     rank: Optional[int] = None, timeout: float = DEFAULT_GROUP_TIMEOUT_S) -> DistInfo:
    """Initializes the default process group and returns this process's place in it.

    With ``master_addr`` it rendezvouses at ``tcp://master_addr:master_port`` with the given
    ``world_size`` and ``rank``; otherwise it expects torchrun's environment variables. Without either
    (plain ``python script.py``) it starts a group of one, so scripts also run single-process.
    """
    backend = backend or default_backend()
    if dist.is_initialized():
        return _current_info()
    group_timeout = datetime.timedelta(seconds=timeout)
    if master_addr is not None:
        if world_size is None or rank is None:
            raise ValueError("ddpkit: --master-addr needs --world-size and --rank")
        if not 0 <= rank < world_size:
            raise ValueError(f"ddpkit: rank {rank} is not in [0, world_size={world_size})")
        dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}",
                                world_size=world_size, rank=rank, timeout=group_timeout)
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    elif "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
        if missing:
            raise RuntimeError(f"ddpkit: RANK/WORLD_SIZE are set but {', '.join(missing)} is not; launch with torchrun")
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            dist.init_process_group(backend, store=_attempt_store(group_timeout), rank=int(os.environ["RANK"]),
                                    world_size=int(os.environ["WORLD_SIZE"]), timeout=group_timeout)
        else:
            dist.init_process_group(backend, timeout=group_timeout)
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    else:
        store = dist.HashStore()
        dist.init_process_group(backend, store=store, world_size=1, rank=0, timeout=group_timeout)
        local_rank = 0
    if "nccl" in backend:
        torch.cuda.set_device(local_rank)
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, backend)


def _attempt_store(timeout: datetime.timedelta) -> dist.Store:
    """torchrun's shared rendezvous store, with keys private to this restart attempt.

    Under torchrun the workers share the agent's store, and torch 2.13 does not separate the keys
    of successive restart attempts in it (pytorch/pytorch#135712): a restarted worker can read the
    gloo address a dead worker of the previous attempt published, and the new group then fails to
    connect or hangs. Prefixing every key with the attempt number keeps attempts apart.
    """
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]),
                          is_master=False, timeout=timeout)
    return dist.PrefixStore(f"ddpkit/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def _current_info() -> DistInfo:
    return DistInfo(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")),
                    dist.get_backend())


# argparse types shared by ddpkit's command lines


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


# ----------------------------------------------------------------------------------------------
# Worker pools for tests and benchmarks


class RemoteTraceback(Exception):
    """The traceback of an exception raised in a worker, attached as the ``__cause__`` of the re-raise."""

    def __str__(self) -> str:
        return "\n" + self.args[0]


class WorkerFailure(RuntimeError):
    """A worker died, timed out, or raised an exception that could not be sent back as itself."""


def _die_with_parent() -> None:
    # Linux only: SIGKILL this worker when its parent (the pool's forkserver) goes away, so a parent
    # killed without cleanup leaves no orphans behind.
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
    except OSError:
        pass


def _worker_main(rank: int, world_size: int, store_port: int, backend: str, group_timeout: float,
                 threads: int, env: dict, conn: multiprocessing.connection.Connection) -> None:
    _die_with_parent()
    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                       "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(store_port)})
    torch.set_num_threads(threads)
    import ddpkit  # noqa: F401  (registers the ops before any task runs)

    try:
        store = dist.TCPStore("127.0.0.1", store_port, world_size, is_master=False,
                              timeout=datetime.timedelta(seconds=group_timeout))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=group_timeout))
    except BaseException as exc:  # report, then exit: the parent kills the pool
        conn.send(_error_message(exc))
        return
    conn.send(("ready", None))
    while True:
        try:
            task = conn.recv()
        except EOFError:
            break
        if task is None:
            break
        fn, args, kwargs = task
        try:
            result = fn(*args, **kwargs)
            message = ("ok", result)
            conn.send(message)
        except BaseException as exc:
            conn.send(_error_message(exc))
    try:
        dist.destroy_process_group()
    except Exception:
        pass


def _error_message(exc: BaseException) -> tuple:
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        payload = pickle.dumps(exc)
        pickle.loads(payload)
    except Exception:
        payload = None
    return ("error", (payload, f"{type(exc).__name__}: {exc}", text))


def _rebuild_exception(rank: int, payload: Optional[bytes], summary: str, text: str) -> BaseException:
    exc = pickle.loads(payload) if payload is not None else WorkerFailure(f"rank {rank}: {summary}")
    exc.__cause__ = RemoteTraceback(f'Traceback of rank {rank}:\n"""\n{text}"""')
    return exc


class WorkerPool:
    """``world_size`` worker processes sharing a process group, reused across ``run`` calls.

    ``run(fn, *args)`` calls ``fn(*args)`` on every rank (inside it, ``torch.distributed`` is
    initialized) and returns the per-rank results in rank order. ``fn`` must be picklable (a
    module-level function). If any rank raises, dies or the call exceeds ``timeout`` seconds, the
    pool is killed (workers first get SIGTERM, then SIGKILL) and the first failing rank's exception
    is re-raised here, or all ranks' outcomes are returned with ``return_exceptions=True``. The next
    ``run`` starts fresh workers.
    """

    def __init__(self, world_size: int, backend: str = "gloo", timeout: float = 120.0,
                 group_timeout: float = 60.0, threads: Optional[int] = None, env: Optional[dict] = None):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.backend = backend
        self.timeout = timeout
        self.group_timeout = group_timeout
        self.threads = threads or max(1, (os.cpu_count() or 1) // world_size)
        self.env = dict(env or {})
        self._processes: list = []
        self._conns: list = []
        self._store = None

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        if self._processes:
            return
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "ddpkit"])
        # The parent owns the rendezvous store for the pool's lifetime: no free-port race.
        self._store = dist.TCPStore("127.0.0.1", 0, self.world_size + 1, is_master=True,
                                    timeout=datetime.timedelta(seconds=self.group_timeout),
                                    wait_for_workers=False)
        for rank in range(self.world_size):
            parent_conn, child_conn = ctx.Pipe()
            process = ctx.Process(target=_worker_main, daemon=True, name=f"ddpkit-rank{rank}",
                                  args=(rank, self.world_size, self._store.port, self.backend,
                                        self.group_timeout, self.threads, self.env, child_conn))
            process.start()
            child_conn.close()
            self._processes.append(process)
            self._conns.append(parent_conn)
        try:
            self._collect(time.monotonic() + max(self.timeout, 60.0))
        except BaseException:
            self.kill()
            raise

    def close(self) -> None:
        """Asks workers to exit cleanly, then kills any that do not."""
        for conn in self._conns:
            try:
                conn.send(None)
            except (OSError, BrokenPipeError):
                pass
        deadline = time.monotonic() + 10
        for process in self._processes:
            process.join(max(0.0, deadline - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        for process in self._processes:
            if process.is_alive():
                process.terminate()
        for process in self._processes:
            process.join(2)
            if process.is_alive():
                process.kill()
                process.join(2)
        for conn in self._conns:
            conn.close()
        self._processes, self._conns, self._store = [], [], None

    def __enter__(self) -> "WorkerPool":
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # -- work -----------------------------------------------------------------------------------
    def run(self, fn: Callable, *args: Any, timeout: Optional[float] = None, return_exceptions: bool = False,
            **kwargs: Any) -> list:
        self.start()
        task = (fn, args, kwargs)
        for conn in self._conns:
            conn.send(task)
        deadline = time.monotonic() + (timeout if timeout is not None else self.timeout)
        try:
            return self._collect(deadline, return_exceptions=return_exceptions)
        except BaseException:
            self.kill()
            raise

    def _collect(self, deadline: float, return_exceptions: bool = False) -> list:
        results: list = [None] * self.world_size
        pending = dict(enumerate(self._conns))
        failed = False

        def receive(rank: int):
            """The rank's message, or None if it died (its pipe closed) before sending one."""
            try:
                return pending[rank].recv()
            except (EOFError, OSError):
                return None

        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"ddpkit.WorkerPool: ranks {sorted(pending)} did not finish within the timeout; "
                                   "the pool was killed")
            waitables = {conn: rank for rank, conn in pending.items()}
            waitables.update({self._processes[rank].sentinel: rank for rank in pending})
            for item in multiprocessing.connection.wait(list(waitables), remaining):
                rank = waitables[item]
                if rank not in pending:
                    continue  # its pipe and its sentinel were both ready
                conn = pending[rank]
                message = receive(rank) if item is conn or conn.poll() else None
                del pending[rank]
                if message is None:
                    process = self._processes[rank]
                    process.join(5)
                    error: BaseException = WorkerFailure(
                        f"rank {rank} died (exit code {process.exitcode}) before reporting a result")
                else:
                    status, value = message
                    if status != "error":
                        results[rank] = value
                        continue
                    error = _rebuild_exception(rank, *value)
                if not return_exceptions:
                    raise error
                results[rank], failed = error, True
        if failed:
            self.kill()
        return results


def spawn(fn: Callable, world_size: int, *args: Any, backend: str = "gloo", timeout: float = 120.0,
          group_timeout: float = 60.0, return_exceptions: bool = False, **kwargs: Any) -> list:
    """Runs ``fn(*args, **kwargs)`` once on ``world_size`` fresh processes; returns per-rank results."""
    pool = WorkerPool(world_size, backend=backend, timeout=timeout, group_timeout=group_timeout)
    try:
        return pool.run(fn, *args, return_exceptions=return_exceptions, **kwargs)
    finally:
        pool.close()

