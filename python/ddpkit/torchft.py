"""ddpkit as torchft's process group: per-step fault tolerance on ddpkit's engine.

torchft (PyTorch's fault-tolerant training: replica groups, a lighthouse that forms a quorum every
step, live recovery of a joining replica) reconfigures its process group on every quorum change.
``ProcessGroupDdpkit`` is that process group with ddpkit's backend inside, as torchft's own
``ProcessGroupGloo`` is with gloo: each ``configure`` builds a fresh "ddpkit" backend on the quorum's
store prefix, so replicas on one host reduce through shared memory and replicas on several hosts
through ddpkit's hierarchy, and a peer that dies is named at once instead of after a timeout.

A collective that fails (a peer died, stopped past the timeout, or the group was aborted) never
raises into torchft's code: its Work completes with the tensors as they are, and ``errored()``
returns the error until the next ``configure``. The ``Manager`` reads ``errored()`` in
``should_commit()``, so the step is discarded and the next quorum goes on without the lost peer.
``model.register_comm_hook(manager, allreduce_hook)`` plugs the manager's all-reduce into
``ddpkit.DistributedDataParallel`` (or torch DDP); ``ddpkit.torchft.DistributedDataParallel`` is
torchft's DDP wrapper with that hook. The hook does not wait: each bucket's all-reduce overlaps the
rest of backward.

Needs torchft (``pip install --no-deps torchft``; scripts/setup.sh installs it with the test extra).
See docs/fault_tolerance.md.
"""

from __future__ import annotations

import datetime
import os
import queue
import socket
import threading
import urllib.parse
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

try:
    from torchft.ddp import DistributedDataParallel as _TorchftDDP
    from torchft.process_group import ProcessGroupWrapper
except ImportError as error:  # pragma: no cover - exercised only without torchft
    raise ImportError(
        "ddpkit.torchft needs torchft, which is not installed: `pip install --no-deps torchft "
        "opentelemetry-api opentelemetry-sdk opentelemetry-exporter-otlp` (its declared dependencies would "
        "replace the CPU torch; scripts/setup.sh does this for the test extra)"
    ) from error

from . import backend as _backend

if TYPE_CHECKING:
    from torchft.manager import Manager

__all__ = ["DistributedDataParallel", "ProcessGroupDdpkit", "allreduce_hook", "check_lighthouse"]


class ProcessGroupDdpkit(ProcessGroupWrapper):
    """A reconfigurable ddpkit process group for ``torchft.Manager(pg=...)``: under torchft's DDP, its
    LocalSGD and DiLoCo (``torchft.local_sgd``), and HSDP (FSDP2 inside a replica group, whose
    all-reduce hook averages the gradient shards over the quorum through torchft's
    ``ManagedProcessGroup``; docs/fault_tolerance.md).

    Args:
        timeout: bounds every collective (a peer that stops answering fails it after this long) and
            the connection to each quorum's store. Give it the manager's ``timeout``.
        point_to_point: carry the program's own ``send``/``recv`` (torchft's ``PGTransport``), on a
            second inner gloo group that each quorum then connects too. Off by default (torchft's
            default checkpoint transport is HTTP): a quorum change connects one group, and ``send``
            and ``recv`` raise.
        cross_host_dtype: torch.bfloat16 or torch.float16 sends the replicas' float32 all-reduces
            across hosts in that dtype (ddpkit.Options; Note [Compressed crossing]). None: exact.
    """

    def __init__(
        self,
        timeout: datetime.timedelta = datetime.timedelta(seconds=60),
        point_to_point: bool = False,
        cross_host_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(timeout=timeout)
        self._point_to_point = point_to_point
        self._options = _backend.Options(cross_host_dtype=cross_host_dtype)
        self._error_lock = threading.Lock()
        self._error: Exception | None = None
        self._generation = 0
        self._registered: str | None = None

    @property
    def group_name(self) -> str:
        """The registered name of the current quorum's group: ddpkit's own collectives on this group
        (``ddpkit.SyncBatchNorm(process_group=pg)``, ``ddpkit.all_reduce(t, group=pg)``) run on the
        quorum's engine, in one order with the manager's all-reduces. They raise on a failure, as
        anywhere: report it with ``manager.report_error(error)`` to discard the step."""
        if self._registered is None:
            raise ValueError("ProcessGroupDdpkit: not configured yet (the manager configures it at its first quorum)")
        return self._registered

    def getBackendName(self) -> str:
        return "torchft-ddpkit"

    def configure(
        self,
        store_addr: str,
        replica_id: str,
        rank: int,
        world_size: int,
        quorum_id: int | None = None,
        group_rank: int | None = None,
        group_world_size: int | None = None,
        global_ranks: list[int] | None = None,
    ) -> None:
        # An error belongs to the group it happened in: the new quorum starts clean, and a late report
        # from the old group's work (its generation) is dropped.
        with self._error_lock:
            self._error = None
            self._generation += 1
        super().configure(
            store_addr, replica_id, rank, world_size, quorum_id, group_rank, group_world_size, global_ranks
        )

    def _create_pg(self, store: dist.Store, rank: int, world_size: int) -> dist.ProcessGroup:
        pg = dist.ProcessGroup(store, rank, world_size)
        pg._set_default_backend(dist.ProcessGroup.BackendType.CUSTOM)
        inner = _backend._create(
            store, rank, world_size, self._timeout, point_to_point=self._point_to_point, options=self._options
        )
        pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.CUSTOM, inner)
        # The engine names its group in every error; the quorum id tells the quorums apart (alike on
        # every rank of one quorum, as the name must be).
        name = f"torchft-ddpkit-q{self._quorum_id if self._quorum_id is not None else 0}"
        if self._group_rank is not None:
            name += f"-r{self._group_rank}"
        pg._set_group_name(name)
        # Registered, so that ddpkit's ops resolve it by name (group_name); the previous quorum's went
        # in abort(), so a name is registered once at a time.
        torch._C._distributed_c10d._unregister_process_group(name)
        torch._C._distributed_c10d._register_process_group(name, pg)
        self._registered = name
        return pg

    def send(self, tensors: list, dst_rank: int, tag: int) -> dist.Work:
        self._check_point_to_point("send")
        return super().send(tensors, dst_rank, tag)

    def recv(self, tensors: list, src_rank: int, tag: int) -> dist.Work:
        self._check_point_to_point("recv")
        return super().recv(tensors, src_rank, tag)

    def _check_point_to_point(self, what: str) -> None:
        if not self._point_to_point:
            raise RuntimeError(
                f"ProcessGroupDdpkit.{what}: this group carries collectives only; make it with "
                f"ProcessGroupDdpkit(point_to_point=True) for send/recv (torchft's PGTransport)"
            )

    def abort(self, errored: bool = True) -> None:
        if self._registered is not None:
            torch._C._distributed_c10d._unregister_process_group(self._registered)
            self._registered = None
        pg = self._pg
        if pg is not None:
            # Outstanding work of the old quorum fails instead of waiting out the timeout.
            try:
                pg.abort()
            except RuntimeError:
                pass
        super().abort(errored=errored)

    def errored(self) -> Exception | None:
        with self._error_lock:
            return self._error

    def _report(self, error: Exception, generation: int) -> None:
        with self._error_lock:
            if self._error is None and generation == self._generation:
                self._error = error

    def _wrap_work(self, work: dist.Work, opts: object) -> dist.Work:
        return _ReportingWork(self, work, self._generation)


class _ReportingWork(dist._Work):
    """A collective's Work that reports its failure to the group (``errored()``) instead of raising,
    and whose future is settled when ``wait()`` returns (torchft chains callbacks right after it and
    expects them to run at once)."""

    def __init__(self, pg: ProcessGroupDdpkit, work: dist.Work, generation: int) -> None:
        super().__init__()
        self._pg = pg
        self._work = work
        self._generation = generation

    def _settled(self) -> torch.futures.Future:
        return self._work.get_future()

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        try:
            self._work.wait()
            self._settled().wait()
        except Exception as error:  # noqa: BLE001  (any failure of the collective is the group's)
            self._pg._report(error, self._generation)
            return False
        return True

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def is_success(self) -> bool:
        return self._pg.errored() is None and self._work.is_success()

    def get_future(self) -> torch.futures.Future:
        pg, work, generation = self._pg, self._work, self._generation

        def reported(future: torch.futures.Future) -> Any:
            try:
                return future.value()
            except Exception as error:  # noqa: BLE001
                pg._report(error, generation)
                return work.result()

        return self._settled().then(reported)


# Note [An asynchronous manager hook]
# torchft 0.2.0's manager.allreduce() starts the collective and returns a Work whose public wait()
# builds the continuations (the division by the participants, the error report through the
# manager's wrap_future) only once the collective is done: its chain reads a loop variable that is
# right only if each callback runs at once, so a chain built on a pending collective fails its
# `assert managed_fut._callback` (the first try's failure of issue 42), and its get_future() is a
# placeholder until wait() has run. torchft's own DDP hook therefore waits inside the hook, and each
# bucket's all-reduce blocks backward until it is done. allreduce_hook instead hands the Work to one
# waiter thread per process, which calls the public wait() for each Work in launch order and settles
# the future the hook returned at once: the all-reduces overlap the rest of backward, the reducer
# waits for the futures where it waits for its own all-reduces, and nothing but torchft's public API
# is used (so no torchft internals to check). The manager starts the collective as a sum (its quorum
# checks, a healing replica's zeroed bucket, a launch failure reported), and the waiter divides by the
# participants counted at launch, as the manager's own average does. tests/test_torchft.py's hook
# test checks the future is pending at return, the average and the report; bench_fault_tolerance.py's
# steady step measures the gain.


class _WorkWaiter:
    """Waits for the manager's Works in the order they were submitted, on one daemon thread per process
    (started at first use, and again in a forked child, which inherits no threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue | None = None
        self._pid: int | None = None

    def submit(self, work: dist.Work, finish: Callable[[bool], torch.Tensor]) -> torch.futures.Future:
        """A future settled with ``finish(work.wait())`` once the waiter thread got to ``work``."""
        future: torch.futures.Future = torch.futures.Future()
        with self._lock:
            if self._pid != os.getpid():
                self._queue = queue.SimpleQueue()
                threading.Thread(target=self._run, args=(self._queue,), name="ddpkit-torchft-hook", daemon=True).start()
                self._pid = os.getpid()
            self._queue.put((work, finish, future))
        return future

    @staticmethod
    def _run(works: queue.SimpleQueue) -> None:
        while True:
            work, finish, future = works.get()
            try:
                result = finish(work.wait())
            except BaseException as error:  # noqa: BLE001  (the reducer waits for this future: settle it)
                future.set_exception(error)
            else:
                future.set_result(result)


_waiter = _WorkWaiter()


# torch DDP's register_comm_hook rejects any annotation of `bucket` but dist.GradBucket and any return
# annotation but Future[Tensor] (this module's annotations are strings): they are left out.
def allreduce_hook(manager: Manager, bucket):
    """The communication hook of a data-parallel wrapper under torchft: averages each gradient
    bucket over the replicas of the manager's quorum (``manager.allreduce``) and returns at once a
    future that the collective's completion settles, so the bucket's all-reduce overlaps the rest
    of backward (Note [An asynchronous manager hook]). ``model.register_comm_hook(manager,
    allreduce_hook)`` for ddpkit's DDP or torch DDP (a ``GradBucket``; a bare tensor works too);
    ``ddpkit.torchft.DistributedDataParallel`` is torchft's DDP wrapper with this hook.

    A failed all-reduce never fails the future: the manager's wait reports the error
    (``should_commit()`` then discards the step) and the future is settled with the bucket as it is."""
    tensor = bucket.buffer() if isinstance(bucket, dist.GradBucket) else bucket
    work = manager.allreduce(tensor, reduce_op=dist.ReduceOp.SUM)
    participants = manager.num_participants()

    def average(succeeded: bool) -> torch.Tensor:
        return tensor.div_(participants) if succeeded else tensor

    return _waiter.submit(work, average)


class DistributedDataParallel(_TorchftDDP):
    """torchft's ``DistributedDataParallel(manager, module)`` with ``allreduce_hook`` as its
    communication hook: the same wrapper, whose bucket all-reduces overlap backward instead of each
    blocking it (Note [An asynchronous manager hook]). Works on any torchft process group."""

    _comm_hook = staticmethod(allreduce_hook)


def check_lighthouse(address: str | None = None, timeout: float = 10.0) -> str:
    """Returns the lighthouse's address (default: TORCHFT_LIGHTHOUSE) once it accepts a connection, or
    raises RuntimeError saying which address was tried and how to start one: torchft's manager would
    otherwise retry its connection until its own timeout and fail with a transport error."""
    address = address or os.environ.get("TORCHFT_LIGHTHOUSE")
    if not address:
        raise RuntimeError(
            "ddpkit.torchft: no lighthouse address: set TORCHFT_LIGHTHOUSE=http://HOST:PORT (start "
            "one with `torchft_lighthouse --min_replicas 1 --bind [::]:29510`)"
        )
    parsed = urllib.parse.urlparse(address if "://" in address else f"http://{address}")
    host, port = parsed.hostname, parsed.port
    if host is None or port is None:
        raise RuntimeError(f"ddpkit.torchft: TORCHFT_LIGHTHOUSE={address!r} is not http://HOST:PORT")
    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except OSError as error:
        raise RuntimeError(
            f"ddpkit.torchft: the lighthouse at {address} is unreachable ({error}); start it first "
            f"(`torchft_lighthouse --min_replicas 1 --bind [::]:{port}`) or fix TORCHFT_LIGHTHOUSE"
        ) from None
    return address
