"""ZeRO-1 and ZeRO-2: ``ShardedOptimizer`` keeps the optimizer state of a balanced, contiguous slice of the
flattened parameters on each rank, and with ddpkit's DDP only that slice's averaged gradients.

    model = ddpkit.DistributedDataParallel(net)
    optimizer = ddpkit.ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)  # ZeRO-2
    optimizer = ddpkit.ShardedOptimizer(model.parameters(), torch.optim.AdamW, shard_gradients=False, lr=1e-3)  # ZeRO-1

Each rank runs the wrapped torch optimizer's own update on its shard (Note [Shard layout]: the parameters of
each bucket back to back, split into N equal contiguous blocks), then every bucket's parameters are
all-gathered in place (Note [Sharded parameters]). Built on parameters that a ddpkit
``DistributedDataParallel`` synchronises (construct the optimizer after the DDP), it takes that DDP's
buckets and switches its reducer to reduce-scattering them (Note [Sharded gradients]): a step then sends
what DDP's does and the shard holds DDP's bits. Built on other parameters (alone, or under torch's DDP),
it steps this rank's slice of their ``.grad`` and all-gathers (ZeRO-1 with one more all-gather than DDP).

Note [Sharded optimizer and reducer]
The coupling is one call: the optimizer asks ``ddpkit.ddp.synchronising_ddp(params)`` for the ddpkit DDP
that synchronises its parameters, and ``DistributedDataParallel._shard_gradients(stage)`` rebuilds that
DDP's reducer with ``shard="optimizer"`` (ZeRO-1) or ``"gradients"`` (ZeRO-2) over the same buckets.
The optimizer then lays its parameters out with ShardedParameters over that DDP's parameter list and
bucket assignment, so the reducer's gradient shard b and the optimizer's parameter shard b hold the same
elements, and each piece of the inner optimizer gets a fixed view of the gradient shard as its ``.grad``.
Nothing runs per parameter on the way: backward's reduce-scatters and the step's all-gathers are queued
from C++; Python only hands the inner optimizer its pieces. The optimizer learns that a synchronised
backward ran from the reducer's ``synced_backwards`` counter: a step after ``zero_grad()`` with no
synchronised backward since finds no gradient, as a plain optimizer after ``zero_grad()`` does. Every
trainable parameter the DDP synchronises must be in the optimizer (a gradient shard nobody steps would be
lost); parameters the DDP leaves out (frozen when it was built) or that are not the DDP's are kept whole and
stepped on every rank from their own ``.grad`` (Note [Replicated parameters]).

Note [Replicated parameters]
Parameters that do not require grad when the optimizer is built (frozen, or fixed), and, under a ddpkit
DDP, those it does not synchronise, are not sharded: every rank keeps them whole and the inner optimizer
steps them like any plain optimizer, from their own ``.grad`` (None while frozen, so never), which keeps
"unfreeze later" working as with a plain optimizer. A parameter frozen after the optimizer was built stays
sharded; its pieces get no gradient while it is frozen, so it is not stepped (the reducer leaves its
gradient alone, Note [Frozen after wrapping]).

Note [Gathering during the forward]
With ``overlap_gather=True`` (under a ddpkit DDP), ``step()`` queues the all-gathers and returns, and a
forward pre-hook on every module that holds parameters waits for their buckets' all-gathers, so the
gathers of later layers travel while the first layers compute (the gathers run last bucket first: the
first parameters of the model). What else reads parameters waits first: the next ``step()``, the
optimizer's and the module's ``state_dict()``, ``wait_for_parameters()``; but code that reads a parameter
directly (``p.data``, a module computing with another module's parameter before that module's forward)
would read it half gathered. So it is off by default, as Megatron's ``overlap_param_gather``: ``step()``
returns with every parameter gathered. Without a DDP there are no modules to hook, and ``step()`` always
waits.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from . import _C, comm  # noqa: F401  (_C: registers torch.classes.ddpkit.*)
from . import ddp as _ddp
from ._sharded_state import consolidated_state_dict, load_consolidated, load_sharded, sharded_state_dict

__all__ = ["ShardedOptimizer"]


class _Piece:
    """One piece of this rank's shard (Note [Shard layout]) as the inner optimizer sees it: ``tensor`` views
    the parameter buffer's elements, ``gradient`` the reducer's gradient shard's (None without a reducer)."""

    __slots__ = ("tensor", "param", "index", "offset", "length", "bucket", "shard_offset", "gradient")

    def __init__(self, tensor, param, index, offset, length, bucket, shard_offset, gradient):
        self.tensor = tensor
        self.param = param
        self.index = index  # the parameter's index in the optimizer (param_groups order)
        self.offset = offset  # the piece's first element in the flattened parameter
        self.length = length
        self.bucket = bucket
        self.shard_offset = shard_offset  # its first element in the bucket's shard
        self.gradient = gradient


class _ShardedSet:
    """Parameters laid out together by one ShardedParameters (the DDP's, or one param group's set)."""

    def __init__(self, native, params, bucket_of, pieces: list[_Piece], ddp=None):
        self.native = native
        self.params = params  # what ShardedParameters was given, in its order
        self.bucket_of = list(bucket_of)
        self.offsets = list(native.offsets())  # each parameter's first element in its bucket (-1: not laid out)
        self.pieces = pieces
        # The coupled DDP (gradients from its reducer's shards), and the reducer generation coupled with.
        self.ddp = weakref.ref(ddp) if ddp is not None else None
        self.generation = ddp._reducer_generation if ddp is not None else None
        # Bucket numels and parameter numels: what a sharded state dict checks.
        self.layout = [[b.numel() for b in native.buffers()], [p.numel() for p in params]]
        self.zeroed_at = 0  # the reducer's synced_backwards at the latest zero_grad()

    @property
    def coupled(self) -> bool:
        return self.ddp is not None

    @property
    def reducer(self):
        """The coupled DDP's reducer, still the one whose gradient shards the pieces view."""
        ddp = self.ddp()
        if ddp is None or ddp._reducer_generation != self.generation:
            raise RuntimeError(
                "ddpkit.ShardedOptimizer: the DistributedDataParallel it was built on is gone, or another "
                "ShardedOptimizer has been built on it since (one sharded optimizer per DDP)"
            )
        return ddp._reducer


class ShardedOptimizer(torch.optim.Optimizer):
    """ZeRO-1/2: the optimizer state, and with ddpkit's DDP the averaged gradients, sharded over the ranks.

    Args:
        params: parameters or param groups, as for any torch optimizer.
        optimizer_class: the torch optimizer each rank runs on its shard; its update must be elementwise
            (SGD, Adam, AdamW, ...: checked, on every rank, with a step on pieces of a parameter against a
            step on the whole parameter).
        process_group: default: the coupled DDP's group, else the world group.
        shard_gradients: under a ddpkit DDP, keep only this rank's shard of the averaged gradients
            (ZeRO-2, default) or the full gradient buckets (ZeRO-1). Without one, gradients are not
            sharded whatever this says.
        bucket_cap_mb: without a DDP, the size of the buffers parameters are gathered in.
        overlap_gather: under a ddpkit DDP, let the parameters' all-gathers run into the next forward,
            each module waiting for its own (Note [Gathering during the forward]: code that reads
            parameters elsewhere calls ``wait_for_parameters()`` first). Default: ``step()`` returns with
            every parameter gathered.
        **defaults: the optimizer's hyperparameters (``lr=...``).

    ``optim`` is this rank's inner optimizer (over its pieces); ``param_groups`` are the wrapper's, with every
    hyperparameter of the inner class, which LR schedulers read and write and ``step()`` hands on.
    ``state_dict()`` (collective: every rank calls it) returns the consolidated form, the one a plain
    ``optimizer_class`` over the same parameters would return, which loads at any world size (and into a
    plain optimizer); ``sharded_state_dict()`` this rank's part only, which loads at the same world size and
    rank. ``load_state_dict`` takes either.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        optimizer_class: type[torch.optim.Optimizer],
        process_group: dist.ProcessGroup | None = None,
        shard_gradients: bool = True,
        bucket_cap_mb: float = 25.0,
        overlap_gather: bool = False,
        **defaults: Any,
    ):
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise TypeError(
                f"ddpkit.ShardedOptimizer: optimizer_class must be a torch.optim.Optimizer subclass, got {optimizer_class!r}"
            )
        if bucket_cap_mb <= 0:
            raise ValueError(f"ddpkit.ShardedOptimizer: bucket_cap_mb must be positive, got {bucket_cap_mb}")
        _check_elementwise(optimizer_class, defaults)
        self._initialized = False
        super().__init__(params, defaults)
        self.optimizer_class = optimizer_class
        self._bucket_cap_bytes = int(bucket_cap_mb * 2**20)
        self._sets: list[_ShardedSet] = []
        self._sharded_ids: set[int] = set()  # the parameters laid out in a set (the others: replicated)
        self._hooks: list = []
        all_params = [p for group in self.param_groups for p in group["params"]]
        self._index = {id(p): i for i, p in enumerate(all_params)}
        if len(self._index) != len(all_params):
            raise ValueError("ddpkit.ShardedOptimizer: a parameter appears twice in the parameter groups")

        ddp = _ddp.synchronising_ddp(all_params)
        if ddp is not None:
            group = ddp.process_group
            if process_group is not None and comm.group_name(process_group) != comm.group_name(group):
                raise ValueError(
                    "ddpkit.ShardedOptimizer: process_group must be the group of the ddpkit DistributedDataParallel "
                    "that synchronises these parameters"
                )
            process_group = group
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        _check_same_on_every_rank(self.param_groups, process_group, "ddpkit.ShardedOptimizer")
        if ddp is not None:
            self._couple(ddp, shard_gradients, all_params)
        else:
            sharded = [p for p in all_params if p.requires_grad]
            if sharded:
                self._sets.append(self._standalone_set(sharded))
        self._overlap = overlap_gather and ddp is not None
        self.optim = optimizer_class([self._inner_group(group) for group in self.param_groups], **defaults)
        self._copy_hyperparameters_back()
        self._initialized = True

    # --- construction --------------------------------------------------------------------------------

    def _couple(self, ddp, shard_gradients: bool, all_params: list[Tensor]) -> None:
        """Note [Sharded optimizer and reducer]."""
        ddp_params = list(ddp.module.parameters())
        synchronised = [p for p, b in zip(ddp_params, ddp._bucket_of) if b >= 0]
        missing = [p for p in synchronised if id(p) not in self._index]
        if missing:
            names = {id(p): n for n, p in ddp.module.named_parameters()}
            raise ValueError(
                f"ddpkit.ShardedOptimizer: the ddpkit DistributedDataParallel synchronises {len(missing)} trainable "
                f"parameter(s) this optimizer does not hold (first: '{names[id(missing[0])]}'); its gradient shards "
                "would be stepped by no one: give the optimizer every trainable parameter of the model"
            )
        reducer = ddp._shard_gradients("gradients" if shard_gradients else "optimizer")
        native = torch.classes.ddpkit.ShardedParameters(ddp_params, ddp._bucket_of, comm.group_name(ddp.process_group))
        gradient_shards = list(reducer.gradient_shards())
        self._sets.append(self._make_set(native, ddp_params, ddp._bucket_of, gradient_shards, reducer, ddp))
        self._hook_modules(ddp, native, ddp_params)

    def _standalone_set(self, params: list[Tensor]) -> _ShardedSet:
        kinds: dict[tuple, int] = {}
        bucket_of = _ddp.assign_buckets(
            [p.numel() * p.element_size() for p in params],
            [kinds.setdefault((p.dtype, p.device), len(kinds)) for p in params],
            self._bucket_cap_bytes,
            self._bucket_cap_bytes,
        )
        native = torch.classes.ddpkit.ShardedParameters(params, bucket_of, comm.group_name(self.process_group))
        return self._make_set(native, params, bucket_of, None, None, None)

    def _make_set(
        self, native, params: list[Tensor], bucket_of: list[int], gradient_shards, reducer, ddp
    ) -> _ShardedSet:
        shards = list(native.shards())
        if gradient_shards is not None:
            sizes = [s.numel() for s in shards], [g.numel() for g in gradient_shards]
            if sizes[0] != sizes[1]:
                raise RuntimeError(f"ddpkit.ShardedOptimizer: parameter and gradient shards differ: {sizes}")
        flat = native.pieces()
        pieces = []
        for k in range(0, len(flat), 5):
            bucket, param_index, offset, length, shard_offset = flat[k : k + 5]
            param = params[param_index]
            tensor = shards[bucket].narrow(0, shard_offset, length)
            gradient = None if gradient_shards is None else gradient_shards[bucket].narrow(0, shard_offset, length)
            pieces.append(_Piece(tensor, param, self._index[id(param)], offset, length, bucket, shard_offset, gradient))
        sharded_set = _ShardedSet(native, params, bucket_of, pieces, ddp)
        if reducer is not None:
            sharded_set.zeroed_at = _synced_backwards(reducer)
        self._sharded_ids.update(id(p) for p, b in zip(params, bucket_of) if b >= 0)
        return sharded_set

    def _inner_group(self, group: dict) -> dict:
        """The inner optimizer's group for wrapper group ``group``: this rank's pieces of its sharded
        parameters, then its replicated ones (Note [Replicated parameters])."""
        members = {id(p) for p in group["params"]}
        pieces = [piece.tensor for s in self._sets for piece in s.pieces if id(piece.param) in members]
        replicated = [p for p in group["params"] if not self._is_sharded(p)]
        return {**{k: v for k, v in group.items() if k != "params"}, "params": pieces + replicated}

    def _is_sharded(self, param: Tensor) -> bool:
        return id(param) in self._sharded_ids

    def _copy_hyperparameters_back(self) -> None:
        # The inner class's defaults for every key the caller did not give: what LR schedulers and a
        # consolidated state dict read (a plain optimizer's groups hold them all).
        for mine, inner in zip(self.param_groups, self.optim.param_groups):
            for key, value in inner.items():
                if key != "params":
                    mine[key] = value

    def _hook_modules(self, ddp, native, ddp_params: list[Tensor]) -> None:
        """Note [Gathering during the forward]: each module waits for its own parameters' buckets."""
        bucket_of = {id(p): b for p, b in zip(ddp_params, ddp._bucket_of) if b >= 0}
        for module in ddp.module.modules():
            buckets = {bucket_of[id(p)] for p in module.parameters(recurse=False) if id(p) in bucket_of}
            if not buckets:
                continue
            lowest = min(buckets)  # gathered last of them (the engine runs them last bucket first)
            self._hooks.append(module.register_forward_pre_hook(_BucketWait(native, lowest)))
        self._hooks.append(ddp.module.register_state_dict_pre_hook(_AllWait(self)))

    # --- the step ----------------------------------------------------------------------------------------

    def wait_for_parameters(self) -> None:
        """Returns once the latest step's all-gathers have arrived (Note [Gathering during the forward])."""
        for sharded_set in self._sets:
            sharded_set.native.wait_all()

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Steps this rank's shard with the inner optimizer, then all-gathers the parameters."""
        loss = None
        if closure is not None:
            self.wait_for_parameters()
            with torch.enable_grad():
                loss = closure()
        self.wait_for_parameters()
        for mine, inner in zip(self.param_groups, self.optim.param_groups):
            for key, value in mine.items():
                if key != "params":
                    inner[key] = value
        for sharded_set in self._sets:
            _attach_gradients(sharded_set)
        self.optim.step()
        for sharded_set in self._sets:
            sharded_set.native.gather()
        if not self._overlap:
            self.wait_for_parameters()
        return loss

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> Tensor:
        """Scales the gradients the next ``step()`` uses so that their 2-norm over all parameters (all ranks'
        shards together) is at most ``max_norm``, as ``torch.nn.utils.clip_grad_norm_`` does for a plain
        optimizer's (whose ``param.grad`` a sharded one leaves None); returns the norm before clipping.
        A collective: every rank calls it, after backward and before ``step()``."""
        self.wait_for_parameters()
        squares = torch.zeros((), dtype=torch.float64)
        gradients = []
        for sharded_set in self._sets:
            _attach_gradients(sharded_set)
            gradients += [piece.tensor.grad for piece in sharded_set.pieces if piece.tensor.grad is not None]
        replicated = [
            p.grad for g in self.param_groups for p in g["params"] if not self._is_sharded(p) and p.grad is not None
        ]
        for grad in gradients + (replicated if self.rank == 0 else []):  # a replicated one counted once
            squares += grad.detach().double().square().sum()
        comm.all_reduce(squares, group=self.process_group)
        norm = squares.sqrt().float()
        scale = max_norm / (float(norm) + 1e-6)
        if scale < 1:
            for grad in gradients + replicated:
                grad.mul_(scale)
        return norm

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for sharded_set in self._sets:
            if not sharded_set.coupled:
                continue
            if set_to_none:
                sharded_set.zeroed_at = _synced_backwards(sharded_set.reducer)
            else:
                for shard in sharded_set.reducer.gradient_shards():
                    shard.zero_()

    def add_param_group(self, param_group: dict) -> None:
        """Adds a group of parameters (collective: every rank adds the same); they are laid out in buffers
        of their own, sharded from their ``.grad`` as without a DDP."""
        if not self._initialized:  # torch.optim.Optimizer.__init__'s own calls
            super().add_param_group(param_group)
            return
        self.wait_for_parameters()
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            _check_same_on_every_rank(self.param_groups, self.process_group, "ddpkit.ShardedOptimizer.add_param_group")
            first = len(self._index)
            for i, p in enumerate(group["params"]):
                self._index[id(p)] = first + i
            sharded = [p for p in group["params"] if p.requires_grad]
            if sharded:
                self._sets.append(self._standalone_set(sharded))
            self.optim.add_param_group(self._inner_group(group))
        except Exception:
            self.param_groups.pop()
            for p in group["params"]:
                self._index.pop(id(p), None)
            raise
        for key, value in self.optim.param_groups[-1].items():
            if key != "params":
                group[key] = value

    # --- state dicts -------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The consolidated state dict (a collective: every rank calls it, every rank gets it): what a plain
        ``optimizer_class`` over the same parameters returns, full tensors shaped like the parameters."""
        self.wait_for_parameters()
        return consolidated_state_dict(self)

    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's part: its inner optimizer's state dict with the layout it belongs to (local)."""
        self.wait_for_parameters()
        return sharded_state_dict(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a consolidated state dict (of any world size, or a plain optimizer's) or this rank's sharded
        one (same world size, rank and layout); checks everything before changing anything."""
        self.wait_for_parameters()
        if state_dict.get("ddpkit_sharded"):
            load_sharded(self, state_dict)
        else:
            load_consolidated(self, state_dict)

    def __repr__(self) -> str:
        return f"ShardedOptimizer({self.optimizer_class.__name__}, world_size={self.world_size}, rank={self.rank})"


class _BucketWait:
    """A forward pre-hook: waits for one bucket's all-gather (Note [Gathering during the forward])."""

    def __init__(self, native, bucket: int):
        self.native = native
        self.bucket = bucket

    def __call__(self, module: nn.Module, args) -> None:
        if self.native.pending():
            self.native.wait(self.bucket)


class _AllWait:
    def __init__(self, optimizer: ShardedOptimizer):
        self.optimizer = weakref.ref(optimizer)

    def __call__(self, *args, **kwargs) -> None:
        optimizer = self.optimizer()
        if optimizer is not None:
            optimizer.wait_for_parameters()


def _synced_backwards(reducer) -> int:
    return int(reducer.stats()["synced_backwards"])


def _attach_gradients(sharded_set: _ShardedSet) -> None:
    """Each piece's ``.grad`` for this step: the reducer's gradient shard (when a synchronised backward ran
    since zero_grad()), or this rank's slice of the parameter's own ``.grad``; None for a frozen parameter."""
    if sharded_set.coupled:
        synced = _synced_backwards(sharded_set.reducer) > sharded_set.zeroed_at
        for piece in sharded_set.pieces:
            piece.tensor.grad = piece.gradient if synced and piece.param.requires_grad else None
        return
    for piece in sharded_set.pieces:
        grad = piece.param.grad
        piece.tensor.grad = None if grad is None else grad.reshape(-1).narrow(0, piece.offset, piece.length)


def _check_elementwise(
    optimizer_class: type,
    defaults: dict,
    who: str = "ddpkit.ShardedOptimizer",
    consequence: str = "its state cannot be sharded",
) -> None:
    """Refuses, on every rank alike, an optimizer whose step on pieces of a parameter differs from its step
    on the whole parameter (LBFGS, factored or matrix-shaped state), since its state cannot be sharded
    (``who`` and ``consequence`` word the error for ShardedOptimizer or FullyShardedDataParallel)."""
    name = f"{optimizer_class.__module__}.{optimizer_class.__qualname__}"
    generator = torch.Generator().manual_seed(0)
    start = torch.randn(4, 6, generator=generator)
    grads = [torch.randn(4, 6, generator=generator) for _ in range(2)]
    cuts = (0, 7, 24)
    try:
        whole = start.clone()
        reference = optimizer_class([whole], **defaults)
        flat = start.clone().view(-1)
        pieces = [flat[a:b] for a, b in zip(cuts, cuts[1:])]
        sharded = optimizer_class(pieces, **defaults)
        for grad in grads:
            whole.grad = grad.clone()
            reference.step()
            for piece, a, b in zip(pieces, cuts, cuts[1:]):
                piece.grad = grad.view(-1)[a:b].clone()
            sharded.step()
        reason = None
        for piece in pieces:
            for key, value in sharded.state[piece].items():
                if torch.is_tensor(value) and value.dim() > 0 and value.shape != piece.shape:
                    reason = (
                        f"its state '{key}' has shape {tuple(value.shape)} for a piece of shape {tuple(piece.shape)}"
                    )
        if reason is None and not torch.equal(whole.view(-1), flat):
            reason = "a step on pieces of a parameter moves it differently from a step on the whole parameter"
    except Exception as exc:  # noqa: BLE001 - any failure on the probe means it cannot be sharded
        reason = f"a step on pieces of a parameter failed: {type(exc).__name__}: {exc}"
    if reason is not None:
        raise ValueError(
            f"{who}: {name} does not update each element on its own ({reason}), so {consequence}; use an "
            "elementwise optimizer (SGD, Adam, AdamW, ...)"
        )


def _check_same_on_every_rank(param_groups: list[dict], group: dist.ProcessGroup | None, who: str) -> None:
    """Raises on every rank, naming the first difference, where ranks hold different parameters."""
    signature = [
        [(tuple(p.shape), str(p.dtype), p.requires_grad) for p in g["params"]] + [len(g["params"])]
        for g in param_groups
    ]
    signatures: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(signatures, signature, group=group)
    for rank, theirs in enumerate(signatures[1:], start=1):
        if theirs == signatures[0]:
            continue
        if len(theirs) != len(signatures[0]):
            raise ValueError(f"{who}: rank {rank} has {len(theirs)} param groups, rank 0 has {len(signatures[0])}")
        for g, (mine, other) in enumerate(zip(signatures[0], theirs)):
            if mine == other:
                continue
            for i, (a, b) in enumerate(zip(mine, other)):
                if a != b:
                    raise ValueError(
                        f"{who}: parameter {i} of param group {g} differs between ranks: rank 0 has "
                        f"(shape, dtype, requires_grad) {a}, rank {rank} has {b}"
                    )
            raise ValueError(
                f"{who}: param group {g} holds {mine[-1]} parameters on rank 0, {other[-1]} on rank {rank}"
            )
