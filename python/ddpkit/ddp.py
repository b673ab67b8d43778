"""Data-parallel training with a C++ gradient-bucketing reducer: a drop-in for torch's DDP.

``DistributedDataParallel`` wraps a module like ``torch.nn.parallel.DistributedDataParallel``:
rank 0's parameters and buffers are broadcast at construction, buffers again before each
training forward (``broadcast_buffers``), and when ``loss.backward()`` returns every rank holds
gradients averaged over all ranks. The reducer (``csrc/ddp/reducer.h``) fills flat buckets from
per-parameter autograd hooks and launches each bucket's all-reduce as soon as it is full, so
communication overlaps the rest of backward. Inside ``no_sync()`` nothing is communicated and
gradients accumulate locally; ``GradientAccumulation`` drives that for k micro-batches per step.
``register_comm_hook(state, hook)`` replaces each bucket's all-reduce inside the same reducer (as
torch DDP's does): torch's hooks (compression, PowerSGD) and torchft's fault-tolerant all-reduce
(``ddpkit.torchft.allreduce_hook``) run unchanged.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.utils.weak import WeakIdKeyDictionary

from . import _C, comm

GRAD_SYNC_MODES = tuple(torch.ops.ddpkit.grad_sync_modes())  # from C++: csrc/ddp/reducer.h
# What a synchronised backward leaves of the gradients (Note [Sharded gradients] in csrc/ddp/reducer.h).
GRADIENT_SHARDING = tuple(torch.ops.ddpkit.gradient_sharding_modes())
DEFAULT_ALGORITHM = "auto"


def assign_buckets(
    sizes_bytes: list[int], kinds: list[int], cap_bytes: int, first_cap_bytes: int, included: list[bool] | None = None
) -> list[int]:
    """Bucket index per parameter, -1 where ``included[i]`` is False (default: all included); parameters of
    different ``kinds`` (small integers: dtype and device) never share a bucket. See Note [Bucket assignment]."""
    return torch.ops.ddpkit.assign_buckets(sizes_bytes, kinds, cap_bytes, first_cap_bytes, included)


# Each parameter a ddpkit DDP synchronises -> a weak reference to that DDP: how a ShardedOptimizer built on
# the parameters finds the reducer to shard (Note [Sharded optimizer and reducer]).
_SYNCHRONISED_BY: WeakIdKeyDictionary = WeakIdKeyDictionary()


def synchronising_ddp(params: Iterable[torch.Tensor]) -> DistributedDataParallel | None:
    """The live ddpkit DistributedDataParallel that synchronises any of ``params`` (None: none does); raises
    where two different ones do."""
    found = None
    for param in params:
        ref = _SYNCHRONISED_BY.get(param)
        ddp = ref() if ref is not None else None
        if ddp is None:
            continue
        if found is not None and ddp is not found:
            raise ValueError("ddpkit: these parameters are synchronised by two different DistributedDataParallel")
        found = ddp
    return found


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
        self._reducer = None
        self._reducer_generation = 0  # bumped whenever the reducer is rebuilt (_shard_gradients)
        self.gradient_sharding = "none"  # GRADIENT_SHARDING: a ShardedOptimizer sets it
        self._has_comm_hook = False
        self.world_size: int | None = None
        if not init_sync and broadcast_buffers:
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
        myself = weakref.ref(self)
        for param, bucket in zip(parameters, self._bucket_of):
            if bucket >= 0:
                _SYNCHRONISED_BY[param] = myself
        if init_sync:
            self._build_reducer(with_group=True)
            _check_same_model_on_every_rank(module, process_group)
            with torch.no_grad():
                broadcast_tensors(list(module.parameters()) + list(module.buffers()), process_group)

    def _build_reducer(self, with_group: bool) -> None:
        """The native reducer; ``with_group=False`` where only a communication hook will reduce (the
        group of init_sync=False may not be formed yet: torchft's before its first quorum)."""
        group_name = None
        if with_group:
            group_name = comm.group_name(self.process_group)
            self.world_size = dist.get_world_size(self.process_group)
        self._reducer = torch.classes.ddpkit.Reducer(
            parameters=list(self.module.parameters()),
            bucket_of_param=self._bucket_of,
            group_name=group_name,
            algorithm=self.algorithm,
            grad_sync=self.grad_sync,
            gradient_as_bucket_view=self.gradient_as_bucket_view,
            shard=self.gradient_sharding,
        )
        self._reducer_generation += 1

    def _shard_gradients(self, sharding: str):
        """Rebuilds the reducer to reduce-scatter its buckets (Note [Sharded gradients]); returns it. Called by
        ddpkit.ShardedOptimizer (Note [Sharded optimizer and reducer]), outside backward."""
        if sharding not in GRADIENT_SHARDING:
            raise ValueError(f"gradient sharding must be one of {GRADIENT_SHARDING}, got {sharding!r}")
        if self._has_comm_hook:
            raise ValueError(
                "ddpkit.DistributedDataParallel: a communication hook replaces each bucket's all-reduce, and a "
                "ShardedOptimizer makes the buckets reduce-scattered instead: use one or the other"
            )
        if self.world_size is None:
            raise ValueError("ddpkit.DistributedDataParallel: a ShardedOptimizer needs a DDP built with init_sync=True")
        self.gradient_sharding = sharding
        self._reducer = None  # the old reducer's hooks go with it, before the new one registers its own
        self._build_reducer(with_group=True)
        return self._reducer

    def _native_reducer(self):
        if self._reducer is None:
            self._build_reducer(with_group=True)
        return self._reducer

    def register_comm_hook(self, state: Any, hook: Callable) -> None:
        """Replaces each bucket's all-reduce by ``hook(state, bucket)``, as torch DDP's
        ``register_comm_hook``: ``bucket`` is a ``torch.distributed.GradBucket`` (``buffer()``,
        ``index()``, ``is_last()``, ``parameters()``, ``gradients()``, ``set_buffer()``) and the hook
        returns a ``torch.futures.Future`` whose value is the reduced bucket. The reducer calls it once
        per bucket, where it would launch that bucket's all-reduce (in the same bucket order on every
        rank), and waits for its future where it would wait for the all-reduce: everything else
        (unused and frozen parameters, ``no_sync()``, ``gradient_as_bucket_view``, a backward that
        raised) works as without a hook (Note [Communication hooks] in csrc/ddp/reducer.h). torch's
        hooks run unchanged (``torch.distributed.algorithms.ddp_comm_hooks``: ``allreduce_hook``,
        ``fp16_compress_hook``, ``bf16_compress_hook``, the compress wrappers, PowerSGD), and so does
        torchft's manager (``ddpkit.torchft.allreduce_hook``). The hook averages: gradients enter the
        bucket unscaled. Once, before the first backward, with grad_sync="bucketed".
        """
        if not callable(hook):
            raise TypeError(
                f"ddpkit.DistributedDataParallel.register_comm_hook: hook must be callable, got {type(hook).__name__}"
            )
        if self._reducer is None:  # init_sync=False: the hook may be all that communicates
            self._build_reducer(with_group=False)
        _C.register_comm_hook(self._reducer, state, hook)
        self._has_comm_hook = True

    def forward(self, *inputs, **kwargs):
        reducer = self._native_reducer()
        if self.training and torch.is_grad_enabled():
            reducer.prepare_for_forward()
        if self.broadcast_buffers and self.training and self.world_size > 1:
            buffers = list(self.module.buffers())
            if buffers:
                # Keeping the buffers' version counters, as torch's DDP does: a forward's graph may have
                # saved them (BatchNorm's running statistics), and a second forward before the backward
                # must not make that backward raise "modified by an inplace operation".
                with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(tuple(buffers)):
                    broadcast_tensors(buffers, self.process_group)
        return self.module(*inputs, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally and communicate nothing."""
        reducer = self._native_reducer()
        previous = reducer.sync_enabled()
        reducer.set_sync(False)
        try:
            yield
        finally:
            reducer.set_sync(previous)

    def finish_gradient_synchronization(self) -> None:
        """Waits for the gradient all-reduces; they finish inside backward, so normally a no-op."""
        if self._reducer is not None:
            self._reducer.finalize()

    def reducer_stats(self) -> dict:
        """Counters of the reducer: synced backwards, gradient collectives, buckets, overlap."""
        return dict(self._native_reducer().stats())

    def bucket_tensors(self) -> list[torch.Tensor]:
        return list(self._native_reducer().buckets())


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


def broadcast_tensors(tensors: list[torch.Tensor], group: dist.ProcessGroup | None = None) -> None:
    """Copies rank 0's values into ``tensors`` on every rank of ``group`` (default: the world group): one
    ddpkit broadcast per dtype and device. Collective. What the wrapper does to parameters and buffers
    at construction and to buffers before a forward, for any list of tensors (a trainer gives every rank
    rank 0's BatchNorm statistics before a distributed evaluation)."""
    by_kind: dict[tuple, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_kind.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    for group_tensors in by_kind.values():
        flat = _flatten_dense_tensors([t.detach() for t in group_tensors])
        comm.broadcast(flat, src=0, group=group)
        for tensor, value in zip(group_tensors, _unflatten_dense_tensors(flat, group_tensors)):
            tensor.copy_(value)


def _check_same_model_on_every_rank(
    module: nn.Module, group: dist.ProcessGroup | None, owner: str = "ddpkit.DistributedDataParallel"
) -> None:
    """Raises on every rank, naming the first difference, when ranks built different models (``owner``: the
    class whose construction checks)."""
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
                f"{owner}: rank {rank} has {len(theirs)} parameters and buffers, "
                f"rank 0 has {len(reference)}; every rank must build the same model"
            )
        for mine, other in zip(reference, theirs):
            if mine != other:
                raise ValueError(
                    f"{owner}: rank {rank}'s {other[0]} '{other[1]}' has shape {other[2]}, "
                    f"dtype {other[3]}, requires_grad={other[4]}; rank 0's '{mine[1]}' has shape {mine[2]}, "
                    f"dtype {mine[3]}, requires_grad={mine[4]}"
                )
