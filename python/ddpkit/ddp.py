"""Data-parallel training with a C++ gradient-bucketing reducer: a drop-in for torch's DDP.

``DistributedDataParallel`` wraps a module like ``torch.nn.parallel.DistributedDataParallel``:
rank 0's parameters and buffers are broadcast at construction, buffers again before each
training forward (``broadcast_buffers``), and when ``loss.backward()`` returns every rank holds
gradients averaged over all ranks. The reducer (``csrc/ddp/reducer.h``) fills flat buckets from
per-parameter autograd hooks and launches each bucket's all-reduce as soon as it is full, so
communication overlaps the rest of backward. Inside ``no_sync()`` nothing is communicated and
gradients accumulate locally; ``GradientAccumulation`` drives that for k micro-batches per step.
``register_comm_hook(state, hook)`` replaces the all-reduce with the caller's (as torch DDP's
does), for example torchft's fault-tolerant all-reduce (``ddpkit.torchft.allreduce_hook``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from . import comm

GRAD_SYNC_MODES = tuple(torch.ops.ddpkit.grad_sync_modes())  # from C++: csrc/ddp/reducer.h
DEFAULT_ALGORITHM = "auto"


def assign_buckets(
    sizes_bytes: list[int], kinds: list[int], cap_bytes: int, first_cap_bytes: int, included: list[bool] | None = None
) -> list[int]:
    """Bucket index per parameter, -1 where ``included[i]`` is False (default: all included); parameters of
    different ``kinds`` (small integers: dtype and device) never share a bucket. See Note [Bucket assignment]."""
    return torch.ops.ddpkit.assign_buckets(sizes_bytes, kinds, cap_bytes, first_cap_bytes, included)


class DistributedDataParallel(nn.Module):
    """Averages gradients of ``module`` across the ranks of ``process_group`` during backward.

    Args:
        module: the model; every rank must build the same parameters and buffers (checked).
        process_group: default: the world group.
        bucket_cap_mb: size of a gradient bucket; the first bucket is ``first_bucket_cap_mb``.
        broadcast_buffers: re-send rank 0's buffers before each forward in training mode.
        gradient_as_bucket_view: make ``param.grad`` a view of its bucket slot (no second copy of
            the gradients; Note [Gradient as bucket view]).
        grad_sync: "bucketed" (overlapped with backward), "per_parameter" (one all-reduce per
            gradient after backward) or "gather_scatter" (rank 0 gathers, averages and sends back).
        algorithm: the all-reduce: one of ddpkit's (``ddpkit.comm.ALGORITHMS``) or
            "process_group" for the group's own (gloo's ring, NCCL).
        init_sync: check that every rank built the same model and broadcast rank 0's parameters and
            buffers now. False where something else makes the replicas equal (torchft's Manager
            does at step 0, and its process group changes members): then the group is only needed
            by the built-in all-reduce, which ``register_comm_hook`` can replace before the first
            forward.
    """

    def __init__(
        self,
        module: nn.Module,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float = 25.0,
        broadcast_buffers: bool = True,
        gradient_as_bucket_view: bool = True,
        grad_sync: str = "bucketed",
        algorithm: str = DEFAULT_ALGORITHM,
        first_bucket_cap_mb: float = 1.0,
        init_sync: bool = True,
    ):
        super().__init__()
        if grad_sync not in GRAD_SYNC_MODES:
            raise ValueError(f"grad_sync must be one of {GRAD_SYNC_MODES}, got {grad_sync!r}")
        if algorithm not in comm.ALGORITHMS:
            raise ValueError(f"algorithm must be one of {comm.ALGORITHMS}, got {algorithm!r}")
        if bucket_cap_mb <= 0 or first_bucket_cap_mb <= 0:
            raise ValueError("bucket sizes must be positive")
        self.module = module
        self.process_group = process_group
        self.broadcast_buffers = broadcast_buffers
        self.grad_sync = grad_sync
        self.algorithm = algorithm
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self._comm_hook: _HookReducer | None = None
        self._reducer = None
        if init_sync:
            self._group_name = comm.group_name(process_group)
            self.world_size = dist.get_world_size(process_group)
            _check_same_model_on_every_rank(module, process_group)
            with torch.no_grad():
                _broadcast_tensors(list(module.parameters()) + list(module.buffers()), process_group)
        else:
            self._group_name = None
            self.world_size = None
            if broadcast_buffers:
                raise ValueError(
                    "ddpkit.DistributedDataParallel: init_sync=False needs broadcast_buffers=False "
                    "(what makes the replicas equal at the start keeps their buffers equal too)"
                )

        parameters = list(module.parameters())
        kinds: dict[tuple, int] = {}
        kind_of = [kinds.setdefault((p.dtype, p.device), len(kinds)) for p in parameters]
        self._bucket_of = assign_buckets(
            [p.numel() * p.element_size() for p in parameters],
            kind_of,
            int(bucket_cap_mb * 2**20),
            int(first_bucket_cap_mb * 2**20),
            included=[p.requires_grad for p in parameters],
        )
        if init_sync:
            self._build_reducer()

    def _build_reducer(self) -> None:
        if self._group_name is None:
            self._group_name = comm.group_name(self.process_group)
            self.world_size = dist.get_world_size(self.process_group)
        self._reducer = torch.classes.ddpkit.Reducer(
            parameters=list(self.module.parameters()),
            bucket_of_param=self._bucket_of,
            group_name=self._group_name,
            algorithm=self.algorithm,
            grad_sync=self.grad_sync,
            gradient_as_bucket_view=self.gradient_as_bucket_view,
        )

    def register_comm_hook(self, state: Any, hook: Callable | None = None) -> None:
        """Replaces the gradient all-reduce: ``hook(state, bucket)`` gets each flat gradient bucket (a
        tensor holding the local gradients of the bucket's parameters) as soon as it is full, in the
        same bucket order on every rank, and returns a ``torch.futures.Future`` whose value is the
        averaged bucket; at the end of backward the reducer waits for every future and writes the
        values back into ``param.grad``. Like torch DDP's: call it once, before the first forward; the
        hook averages (nothing divides by the world size for it). ``register_comm_hook(hook)`` with
        a one-argument ``hook(bucket)`` works too.
        """
        if self._comm_hook is not None:
            raise RuntimeError("ddpkit.DistributedDataParallel: register_comm_hook can only be called once")
        if self.grad_sync != "bucketed":
            raise ValueError(
                f"ddpkit.DistributedDataParallel: a communication hook takes grad_sync='bucketed', "
                f"got {self.grad_sync!r}"
            )
        if hook is None:
            state, hook = None, state
            call = hook
        else:

            def call(bucket: torch.Tensor, state=state, hook=hook):
                return hook(state, bucket)

        if not callable(call):
            raise TypeError("ddpkit.DistributedDataParallel.register_comm_hook: hook must be callable")
        if self._reducer is not None:
            self._reducer.set_sync(False)  # the built-in all-reduce stays silent from now on
        self._comm_hook = _HookReducer(list(self.module.parameters()), self._bucket_of, call)

    def forward(self, *inputs, **kwargs):
        if self._comm_hook is not None:
            return self.module(*inputs, **kwargs)
        if self._reducer is None:
            self._build_reducer()
        if self.training and torch.is_grad_enabled():
            self._reducer.prepare_for_forward()
        if self.broadcast_buffers and self.training and self.world_size > 1:
            buffers = list(self.module.buffers())
            if buffers:
                # Keeping the buffers' version counters, as torch's DDP does: a forward's graph may have
                # saved them (BatchNorm's running statistics), and a second forward before the backward
                # must not make that backward raise "modified by an inplace operation".
                with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(tuple(buffers)):
                    _broadcast_tensors(buffers, self.process_group)
        return self.module(*inputs, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally and communicate nothing."""
        if self._comm_hook is not None:
            previous = self._comm_hook.enabled
            self._comm_hook.enabled = False
            try:
                yield
            finally:
                self._comm_hook.enabled = previous
            return
        if self._reducer is None:
            self._build_reducer()
        previous = self._reducer.sync_enabled()
        self._reducer.set_sync(False)
        try:
            yield
        finally:
            self._reducer.set_sync(previous)

    def finish_gradient_synchronization(self) -> None:
        """Waits for the gradient all-reduces; they finish inside backward, so normally a no-op."""
        if self._reducer is not None:
            self._reducer.finalize()

    def reducer_stats(self) -> dict:
        """Counters of the reducer: synced backwards, gradient collectives, buckets, overlap."""
        if self._comm_hook is not None:
            return dict(self._comm_hook.stats)
        return dict(self._reducer.stats())

    def bucket_tensors(self) -> list[torch.Tensor]:
        if self._comm_hook is not None:
            return list(self._comm_hook.buckets)
        return list(self._reducer.buckets())


class _HookReducer:
    """The reducer of a DistributedDataParallel with a communication hook: the native reducer's bucket
    layout and launch order (last parameter first, a bucket as soon as its last gradient arrived,
    always in bucket order), with the hook in place of the native all-reduce. It is Python because
    the hook is: the native reducer calls only the engine."""

    def __init__(self, parameters: list, bucket_of: list, hook: Callable) -> None:
        self.enabled = True
        self.hook = hook
        self.stats = {"synced_backwards": 0, "collectives": 0, "buckets": 0}
        count = max(bucket_of, default=-1) + 1
        members: list = [[] for _ in range(count)]
        for index in reversed(range(len(parameters))):  # slot order of Note [Bucket assignment]
            if bucket_of[index] >= 0:
                members[bucket_of[index]].append(index)
        self.params = parameters
        self.members = members
        self.bucket_of = bucket_of
        self.buckets = [
            torch.zeros(
                sum(parameters[i].numel() for i in m), dtype=parameters[m[0]].dtype, device=parameters[m[0]].device
            )
            for m in members
        ]
        self.stats["buckets"] = len(self.buckets)
        self._pending: list = []
        self._futures: list = []
        self._next = 0
        self._in_backward = False
        self._index = {id(p): i for i, p in enumerate(parameters)}
        self._handles = [
            p.register_post_accumulate_grad_hook(self._ready) for i, p in enumerate(parameters) if bucket_of[i] >= 0
        ]

    def _start(self) -> None:
        self._in_backward = True
        self._pending = [len(m) for m in self.members]
        self._futures = [None] * len(self.buckets)
        self._seen = set()
        self._next = 0
        torch.autograd.Variable._execution_engine.queue_callback(self._finish)

    def _ready(self, param: torch.Tensor) -> None:
        if not self.enabled:
            return
        if not self._in_backward:
            self._start()
        index = self._index[id(param)]
        if index in self._seen:
            return
        self._seen.add(index)
        self._pending[self.bucket_of[index]] -= 1
        self._launch_full()

    def _launch_full(self) -> None:
        while self._next < len(self.buckets) and self._pending[self._next] == 0:
            self._launch(self._next)
            self._next += 1

    def _launch(self, b: int) -> None:
        bucket = self.buckets[b]
        offset = 0
        for i in self.members[b]:
            p = self.params[i]
            view = bucket[offset : offset + p.numel()]
            if p.grad is None:
                view.zero_()
            else:
                view.copy_(p.grad.reshape(-1))
            offset += p.numel()
        self.stats["collectives"] += 1
        self._futures[b] = self.hook(bucket)

    def _finish(self) -> None:
        # Parameters that got no gradient this backward contribute what they hold (Note [Unused parameters]).
        for b in range(len(self.buckets)):
            self._pending[b] = 0
        self._launch_full()
        self._in_backward = False
        with torch.no_grad():
            for b, future in enumerate(self._futures):
                value = future.wait()
                if isinstance(value, (list, tuple)):
                    value = value[0]
                bucket = self.buckets[b]
                offset = 0
                for i in self.members[b]:
                    p = self.params[i]
                    averaged = value[offset : offset + p.numel()].view_as(p)
                    if p.grad is None:
                        p.grad = averaged.clone()
                    else:
                        p.grad.copy_(averaged)
                    offset += p.numel()
                del bucket
        self._futures = []
        self.stats["synced_backwards"] += 1


class GradientAccumulation:
    """k micro-batches per optimizer step, with no gradient all-reduce on the first k-1.

    ``backward(loss)`` scales the loss by 1/k, runs backward under ``model.no_sync()`` except on
    every k-th call, and returns True exactly when the gradients are synchronised: then call
    ``optimizer.step()`` and ``optimizer.zero_grad()``. The gradient at the step is the average over
    all k × world_size micro-batches. Works with ddpkit's and torch's DistributedDataParallel.
    """

    def __init__(self, model: nn.Module, accumulation_steps: int):
        if accumulation_steps < 1:
            raise ValueError(f"accumulation_steps must be >= 1, got {accumulation_steps}")
        self.model = model
        self.accumulation_steps = accumulation_steps
        self.micro_step = 0

    def backward(self, loss: torch.Tensor) -> bool:
        self.micro_step += 1
        is_step = self.micro_step % self.accumulation_steps == 0
        context = contextlib.nullcontext() if is_step else self.model.no_sync()
        with context:
            (loss / self.accumulation_steps).backward()
        return is_step

    def state_dict(self) -> dict:
        return {"micro_step": self.micro_step}

    def load_state_dict(self, state: dict) -> None:
        self.micro_step = int(state["micro_step"])


def _broadcast_tensors(tensors: list[torch.Tensor], group: dist.ProcessGroup | None) -> None:
    """Copies rank 0's values into ``tensors`` on every rank: one ddpkit broadcast per dtype and device."""
    by_kind: dict[tuple, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_kind.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    for group_tensors in by_kind.values():
        flat = _flatten_dense_tensors([t.detach() for t in group_tensors])
        comm.broadcast(flat, src=0, group=group)
        for tensor, value in zip(group_tensors, _unflatten_dense_tensors(flat, group_tensors)):
            tensor.copy_(value)


def _check_same_model_on_every_rank(module: nn.Module, group: dist.ProcessGroup | None) -> None:
    """Raises on every rank, naming the first difference, when ranks built different models."""
    signature = [
        ("parameter", name, tuple(p.shape), str(p.dtype), p.requires_grad) for name, p in module.named_parameters()
    ]
    signature += [("buffer", name, tuple(b.shape), str(b.dtype), False) for name, b in module.named_buffers()]
    signatures: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(signatures, signature, group=group)
    reference = signatures[0]
    for rank, theirs in enumerate(signatures[1:], start=1):
        if theirs == reference:
            continue
        if len(theirs) != len(reference):
            raise ValueError(
                f"ddpkit.DistributedDataParallel: rank {rank} has {len(theirs)} parameters and buffers, "
                f"rank 0 has {len(reference)}; every rank must build the same model"
            )
        for mine, other in zip(reference, theirs):
            if mine != other:
                raise ValueError(
                    f"ddpkit.DistributedDataParallel: rank {rank}'s {other[0]} '{other[1]}' has shape {other[2]}, "
                    f"dtype {other[3]}, requires_grad={other[4]}; rank 0's '{mine[1]}' has shape {mine[2]}, "
                    f"dtype {mine[3]}, requires_grad={mine[4]}"
                )
