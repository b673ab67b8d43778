"""Worker processes with a live process group (as torch's ``common_distributed``): ``spawn`` and ``WorkerPool``.

``spawn(fn, n, *args)`` runs ``fn(*args)`` once on ``n`` fresh processes that share a process group, and
returns their results in rank order. ``WorkerPool`` keeps N such processes and runs functions on all of them,
call after call (the tests and benchmarks run on pools). A failing rank's exception is re-raised in the
parent with its remote traceback; on a failure or a timeout every worker is killed, so nothing is left
behind. ``ddpkit.testing`` builds its simulated hosts (``HostPool``) on these pools.
"""

from __future__ import annotations

import ctypes
import datetime
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import signal
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


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


def _return_freed_memory() -> None:
    """Gives the memory the last task freed back to the system (glibc's malloc_trim; elsewhere nothing).

    A pool's ranks live for a whole test session, and glibc keeps what a task's many mid-sized
    tensors occupied in its arenas once they are freed: after tasks that return every algorithm's
    results (tests/test_block_collectives.py), each rank kept most of its largest task's memory
    (smaps_rollup's Pss_Anon), and the suite's pools together exhausted a small machine's. Trimming
    after each task keeps a rank at what it still holds."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


# How long a pool's ranks may take to start, all together (see _worker_main).
SETUP_TIMEOUT_S = 180.0


def _worker_main(
    rank: int,
    world_size: int,
    store_port: int,
    backend: str,
    group_timeout: float,
    threads: int,
    env: dict,
    conn: multiprocessing.connection.Connection,
    master_addr: str = "127.0.0.1",
    local: tuple = (None, None),
) -> None:
    _die_with_parent()
    os.environ.update(env)
    local_rank, local_size = (rank, world_size) if local[0] is None else local
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(local_rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(local_size),
            "MASTER_ADDR": master_addr,
            "MASTER_PORT": str(store_port),
        }
    )
    torch.set_num_threads(threads)
    # torch read TORCH_DISTRIBUTED_DEBUG when the forkserver imported it, before `env` was applied
    dist.set_debug_level_from_env()
    import ddpkit  # noqa: F401  (registers the ops before any task runs)

    try:
        # Every rank is started before the group's own timeout runs: on a loaded machine processes
        # start seconds apart, and the group's rendezvous waits only `group_timeout` for the last one
        # (a short one, where a test waits for a failure). A rank that never starts still ends the
        # wait, at SETUP_TIMEOUT_S.
        store = dist.TCPStore(
            master_addr,
            store_port,
            world_size,
            is_master=False,
            timeout=datetime.timedelta(seconds=max(group_timeout, SETUP_TIMEOUT_S)),
        )
        if store.add("ddpkit.workers/started", 1) == world_size:
            store.set("ddpkit.workers/all_started", "")
        store.wait(["ddpkit.workers/all_started"])
        store.set_timeout(datetime.timedelta(seconds=group_timeout))
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=group_timeout)
        )
    except BaseException as exc:  # report, then exit: the parent kills the pool
        conn.send(_error_message(exc))
        return
    conn.send(("ready", None))
    while True:
        try:
            task = conn.recv()
        except EOFError:
            break
        except Exception as exc:  # a task this process cannot unpickle (a function it cannot import)
            conn.send(_error_message(exc))
            continue
        if task is None:
            break
        fn, args, kwargs = task
        try:
            result = fn(*args, **kwargs)
            message = ("ok", result)
            conn.send(message)
        except BaseException as exc:
            conn.send(_error_message(exc))
        task = fn = args = kwargs = result = message = None  # the task's objects, freed before the trim
        _return_freed_memory()
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


def _rebuild_exception(rank: int, payload: bytes | None, summary: str, text: str) -> BaseException:
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

    def __init__(
        self,
        world_size: int,
        backend: str = "gloo",
        timeout: float = 120.0,
        group_timeout: float = 60.0,
        threads: int | None = None,
        env: dict | None = None,
    ):
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
        self._store = dist.TCPStore(
            "127.0.0.1",
            0,
            self.world_size + 1,
            is_master=True,
            timeout=datetime.timedelta(seconds=self.group_timeout),
            wait_for_workers=False,
        )
        for rank in range(self.world_size):
            parent_conn, child_conn = ctx.Pipe()
            process = ctx.Process(
                target=_worker_main,
                daemon=True,
                name=f"ddpkit-rank{rank}",
                args=(
                    rank,
                    self.world_size,
                    self._store.port,
                    self.backend,
                    self.group_timeout,
                    self.threads,
                    self.env,
                    child_conn,
                ),
            )
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
        self._ask_workers_to_exit()
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

    def __enter__(self) -> WorkerPool:
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # -- work -----------------------------------------------------------------------------------
    def run(
        self, fn: Callable, *args: Any, timeout: float | None = None, return_exceptions: bool = False, **kwargs: Any
    ) -> list:
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
                raise TimeoutError(
                    f"ddpkit.workers.WorkerPool: ranks {sorted(pending)} did not finish within the timeout; "
                    "the pool was killed"
                )
            waitables = {conn: rank for rank, conn in pending.items()}
            waitables.update({self._sentinel(rank): rank for rank in pending if self._sentinel(rank) is not None})
            for item in multiprocessing.connection.wait(list(waitables), remaining):
                rank = waitables[item]
                if rank not in pending:
                    continue  # its pipe and its sentinel were both ready
                conn = pending[rank]
                message = receive(rank) if item is conn or conn.poll() else None
                del pending[rank]
                if message is None:
                    error: BaseException = WorkerFailure(
                        f"rank {rank} died ({self._fate(rank)}) before reporting a result"
                    )
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

    def _ask_workers_to_exit(self) -> None:
        for conn in self._conns:
            try:
                conn.send(None)
            except (OSError, BrokenPipeError):
                pass

    def _sentinel(self, rank: int):
        """What becomes ready when ``rank``'s process ends (besides its connection), or None."""
        return self._processes[rank].sentinel

    def _fate(self, rank: int) -> str:
        process = self._processes[rank]
        process.join(5)
        return f"exit code {process.exitcode}"


def spawn(
    fn: Callable,
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout: float = 120.0,
    group_timeout: float = 60.0,
    return_exceptions: bool = False,
    **kwargs: Any,
) -> list:
    """Runs ``fn(*args, **kwargs)`` once on ``world_size`` fresh processes; returns per-rank results."""
    pool = WorkerPool(world_size, backend=backend, timeout=timeout, group_timeout=group_timeout)
    try:
        return pool.run(fn, *args, return_exceptions=return_exceptions, **kwargs)
    finally:
        pool.close()
