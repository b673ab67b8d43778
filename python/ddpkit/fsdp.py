"""ZeRO-3: parameters, gradients and optimizer state sharded over the ranks (``FullyShardedDataParallel``).

``FullyShardedDataParallel(module)`` splits ``module`` into units (by default each layer: each module holding a
parameter of its own above ``persistence_threshold`` elements) and keeps of each unit's parameters only this
rank's shard, a contiguous 1/N of the unit's flat buffer (Note [Shard layout] in csrc/sharding/shard_layout.h).
A unit is all-gathered before its forward and again before its backward, the next unit's gather travelling
while the current one computes, and its gradients are reduce-scattered as soon as its backward has produced
them, on ddpkit's own collectives (shared memory inside a host, the ring across hosts). Any torch optimizer built
on ``parameters()`` steps only this rank's pieces: each parameter is its original ``nn.Parameter`` object, whose
data is now a 1-D view of its piece of the shard (possibly empty). Small parameters stay whole on every rank
and are all-reduced (DeepSpeed's persistence threshold). With ``compute_dtype`` (torch.bfloat16 or
torch.float16) the units are cast to it before they are gathered, so forward and backward compute in it and
the gathers carry its bytes, while the optimizer updates the float32 shards and gradients are reduced in
float32. The native part, what is gathered when and how gradients are reduced, is csrc/fsdp/fully_sharded.h.

    model = ddpkit.FullyShardedDataParallel(build_model(), compute_dtype=torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss_fn(model(x), y).backward()   # gradients of this rank's pieces, averaged over the ranks
    optimizer.step()
    torch.save(model.state_dict(), "model.pt")   # full tensors, the unwrapped module's names (a collective)
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils import _pytree as pytree

from . import comm
from .ddp import _check_same_model_on_every_rank, broadcast_tensors
from .sharded_optimizer import _check_elementwise

WHO = "ddpkit.FullyShardedDataParallel"
# Parameters of at most this many elements stay whole on every rank (DeepSpeed's
# stage3_param_persistence_threshold, whose default this is): Note [Persistent parameters].
DEFAULT_PERSISTENCE_THRESHOLD = 100_000
COMPUTE_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)

UnitPolicy = Callable[[nn.Module], bool] | Iterable[type]


# The optimizers found elementwise at their first step (those that step no sharded parameter too).
_checked_optimizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_step_check: Any = None  # the handle of the step pre-hook below, registered by the first wrapper


def _check_optimizer_before_its_first_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """torch.optim's global step pre-hook: an optimizer that steps pieces of sharded parameters must update each
    element on its own (the probe ShardedOptimizer runs at construction), checked at its first step, before it
    changes anything; every rank builds the same optimizer, so every rank raises alike."""
    if optimizer in _checked_optimizers:
        return
    if any(getattr(p, "_ddpkit_sharded_piece", False) for group in optimizer.param_groups for p in group["params"]):
        accepted = inspect.signature(type(optimizer)).parameters
        defaults = optimizer.defaults
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values()):
            defaults = {k: v for k, v in defaults.items() if k in accepted}  # AdamW's defaults hold one it refuses
        _check_elementwise(type(optimizer), defaults, WHO, "it cannot step the pieces of sharded parameters")
    _checked_optimizers[optimizer] = True


class _Unit:
    """A module whose forward gathers a unit (``index``: its native unit; None where every parameter it
    registers is persistent or owned by another unit), and what its forward swaps on its modules."""

    def __init__(self, module: nn.Module):
        self.module = module
        self.index: int | None = None
        self.params: list[nn.Parameter] = []  # the parameters it owns, in registration order
        self.modules: list[nn.Module] = []  # its modules that register parameters (not nested units')
        self.compute: list[dict] = []  # per module: name -> compute parameter
        self.masters: list[dict] = []  # per module: name -> master (original) parameter

    def use_compute(self) -> None:
        for module, compute in zip(self.modules, self.compute):
            module._parameters.update(compute)

    def use_masters(self) -> None:
        for module, masters in zip(self.modules, self.masters):
            module._parameters.update(masters)


class _PreBackward(torch.autograd.Function):
    """Identity on a unit's outputs whose backward first gathers the unit (Note [Sharded units])."""

    @staticmethod
    def forward(ctx, state, index, *tensors):
        ctx.state, ctx.index = state, index
        return tensors

    @staticmethod
    def backward(ctx, *grads):
        ctx.state.pre_backward(ctx.index)
        return (None, None, *grads)


def _before_backward(output: Any, state, index: int) -> Any:
    """``output`` with its tensors that require grad passed through _PreBackward."""
    leaves, spec = pytree.tree_flatten(output)
    positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor) and leaf.requires_grad]
    if not positions:
        return output
    wrapped = _PreBackward.apply(state, index, *(leaves[i] for i in positions))
    for i, tensor in zip(positions, wrapped):
        leaves[i] = tensor
    return pytree.tree_unflatten(leaves, spec)


def _policy(units: UnitPolicy | None, threshold: int) -> Callable[[nn.Module], bool]:
    if units is None:
        return lambda module: any(p is not None and p.numel() > threshold for p in module._parameters.values())
    if callable(units):
        return units
    types = tuple(units)
    if not all(isinstance(t, type) for t in types):
        raise TypeError(f"{WHO}: units must be a callable(module) -> bool or module classes, got {units!r}")
    return lambda module: isinstance(module, types)


def _group_wire(group: dist.ProcessGroup | None) -> str:
    """The wire format a "ddpkit" group's ``ddpkit.Options(cross_host_dtype=...)`` asked for ("exact" for
    any other group)."""
    group = group if group is not None else dist.distributed_c10d._get_default_group()
    try:
        backend = group._get_backend(torch.device("cpu"))
    except RuntimeError:
        return "exact"
    return getattr(backend, "cross_host_wire", "exact")


class FullyShardedDataParallel(nn.Module):
    """Trains ``module`` with its parameters, gradients and optimizer state sharded over the ranks (ZeRO-3).

    Args:
        module: the model; every rank must build the same parameters and buffers (checked), whose values
            are rank 0's after construction (broadcast, as ddpkit's DistributedDataParallel does).
        compute_dtype: None (compute in the parameters' dtype), or torch.bfloat16 / torch.float16: units are
            cast to it before they are gathered and forward and backward compute in it, while the optimizer
            updates the float32 shards and gradients are converted to float32, averaged and reduced in it.
        process_group: default: the world group.
        units: which modules are units: a callable(module) -> bool, or module classes (each instance is a
            unit, e.g. a transformer's block). Default: each module holding a parameter of its own above
            ``persistence_threshold`` elements (each layer). Parameters of no unit, or shared between
            units, belong to the wrapped module's own unit, gathered for the whole step.
        persistence_threshold: parameters of at most this many elements stay whole on every rank and are
            all-reduced instead (Note [Persistent parameters] in csrc/fsdp/fully_sharded.h).
        broadcast_buffers: re-send rank 0's buffers before each training forward.
        cross_host_dtype: torch.bfloat16 or torch.float16 sends the gradient reductions across hosts in that
            dtype (Note [Compressed crossing]); default: the group's ``ddpkit.Options``, else exact.
    """

    def __init__(
        self,
        module: nn.Module,
        compute_dtype: torch.dtype | None = None,
        process_group: dist.ProcessGroup | None = None,
        units: UnitPolicy | None = None,
        persistence_threshold: int = DEFAULT_PERSISTENCE_THRESHOLD,
        broadcast_buffers: bool = True,
        cross_host_dtype: torch.dtype | None = None,
    ):
        super().__init__()
        if compute_dtype is not None and compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"{WHO}: compute_dtype must be None or one of {COMPUTE_DTYPES}, got {compute_dtype!r}")
        if persistence_threshold < 0:
            raise ValueError(f"{WHO}: persistence_threshold must be >= 0, got {persistence_threshold}")
        self.module = module
        self.process_group = process_group
        self.compute_dtype = compute_dtype
        self.broadcast_buffers = broadcast_buffers
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        _check_same_model_on_every_rank(module, process_group, owner=WHO)
        with torch.no_grad():
            broadcast_tensors(list(module.buffers()), process_group)
        # How gradient reductions cross hosts: a name of ddpkit.comm.WIRE_FORMATS.
        self.cross_host_wire = (
            _group_wire(process_group) if cross_host_dtype is None else comm.wire_format(cross_host_dtype)
        )
        self._state = torch.classes.ddpkit.FullyShardedState(
            comm.group_name(process_group), compute_dtype, self.cross_host_wire
        )
        self._build_units(_policy(units, persistence_threshold), persistence_threshold)
        global _step_check
        if _step_check is None:
            _step_check = register_optimizer_step_pre_hook(_check_optimizer_before_its_first_step)

    # --- construction -----------------------------------------------------------------------------

    def _build_units(self, is_unit: Callable[[nn.Module], bool], threshold: int) -> None:
        root = _Unit(self.module)
        self._units: list[_Unit] = [root]
        unit_of: dict[nn.Module, _Unit] = {}

        def visit(module: nn.Module, current: _Unit) -> None:
            if module in unit_of:
                return
            if module is not self.module and is_unit(module):
                current = _Unit(module)
                self._units.append(current)
            unit_of[module] = current
            for child in module.children():
                visit(child, current)

        visit(self.module, root)
        # Every registration of every parameter, in registration order; a parameter's owner is the one unit
        # all its registrations are in, else the root.
        registrations: list[tuple[nn.Module, str, nn.Parameter]] = []
        units_of: dict[int, set] = {}
        for module, unit in unit_of.items():
            for name, param in module._parameters.items():
                if param is not None:
                    registrations.append((module, name, param))
                    units_of.setdefault(id(param), set()).add(id(unit))
        persistent: list[nn.Parameter] = []
        seen: set[int] = set()
        for module, _, param in registrations:
            if id(param) in seen:
                continue
            seen.add(id(param))
            if param.numel() <= threshold:
                persistent.append(param)
            else:
                owner = unit_of[module] if len(units_of[id(param)]) == 1 else root
                owner.params.append(param)

        compute_of: dict[int, nn.Parameter] = {}
        self._shape_of: dict[int, torch.Size] = {}  # id(param) -> its shape before it was sharded
        # id(param) -> its piece on this rank: (first element in the parameter, length, first element in the shard)
        self._pieces: dict[int, tuple[int, int, int]] = {}
        self._sharded: list[tuple[int, list[nn.Parameter]]] = []  # (native index, parameters)
        self._unit_of: dict[int, tuple[int, int]] = {}  # id(param) -> (its sharded unit's index in _sharded, position)
        for unit in self._units:
            if unit.params:
                unit.index = self._add(unit.params, sharded=True, keep=unit is root, compute_of=compute_of)
                for position, param in enumerate(unit.params):
                    self._unit_of[id(param)] = (len(self._sharded), position)
                self._sharded.append((unit.index, unit.params))
        self._persistent = persistent
        if persistent:
            self._add(persistent, sharded=False, keep=False, compute_of=compute_of)
        for unit in self._units:
            by_module: dict[nn.Module, tuple[dict, dict]] = {}
            for module, name, param in registrations:
                if unit_of[module] is unit:
                    compute, masters = by_module.setdefault(module, ({}, {}))
                    compute[name], masters[name] = compute_of[id(param)], param
            unit.modules = list(by_module)
            unit.compute = [c for c, _ in by_module.values()]
            unit.masters = [m for _, m in by_module.values()]
        for unit in self._units[1:]:
            unit.module.register_forward_pre_hook(self._hook_pre_forward(unit))
            # always_call: also after a forward that raised, and after a recomputation that activation
            # checkpointing stops early (torch.utils.checkpoint's early stop raises inside the forward).
            unit.module.register_forward_hook(self._hook_post_forward(unit), always_call=True)

    def _add(self, params: list[nn.Parameter], sharded: bool, keep: bool, compute_of: dict) -> int:
        """One native unit over ``params``: their data become views of its master, and a compute parameter
        (a leaf over its compute buffer) stands for each in forward."""
        with torch.no_grad():
            index = self._state.add_unit(list(params), sharded, keep)
        masters = self._state.master_views(index)
        computes = []
        for param, master, view in zip(params, masters, self._state.compute_views(index)):
            self._shape_of[id(param)] = param.shape
            param.data = master
            compute = nn.Parameter(view, requires_grad=param.requires_grad)
            compute_of[id(param)] = compute
            computes.append(compute)
        if sharded:
            pieces = self._state.pieces(index)
            for param in params:
                self._pieces[id(param)] = (0, 0, 0)
                param._ddpkit_sharded_piece = True  # its optimizer must be elementwise (checked at its first step)
            for i in range(0, len(pieces), 4):
                self._pieces[id(params[pieces[i]])] = (pieces[i + 1], pieces[i + 2], pieces[i + 3])
        self._state.attach(index, computes, list(params))
        return index

    # --- training ---------------------------------------------------------------------------------

    def _hook_pre_forward(self, unit: _Unit):
        def hook(module, args):
            if unit.index is not None:
                self._state.pre_forward(unit.index)
            unit.use_compute()

        return hook

    def _hook_post_forward(self, unit: _Unit):
        def hook(module, args, output):
            unit.use_masters()
            if unit.index is None:
                return output
            self._state.post_forward(unit.index)
            return _before_backward(output, self._state, unit.index) if torch.is_grad_enabled() else output

        return hook

    def forward(self, *inputs, **kwargs):
        graph = torch.is_grad_enabled()
        self._state.begin_forward(graph)
        if self.broadcast_buffers and self.training and self.world_size > 1:
            buffers = list(self.module.buffers())
            if buffers:
                # As DDP's (ddp.py): the version counters of buffers a graph may have saved are kept.
                with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(tuple(buffers)):
                    broadcast_tensors(buffers, self.process_group)
        if self.compute_dtype is not None:
            # As FSDP2's MixedPrecisionPolicy(cast_forward_inputs=True): floating inputs in the compute dtype.
            inputs, kwargs = pytree.tree_map_only(
                torch.Tensor, lambda t: t.to(self.compute_dtype) if t.is_floating_point() else t, (inputs, kwargs)
            )
        root = self._units[0]
        if root.index is not None:
            self._state.pre_forward(root.index)
        root.use_compute()
        try:
            output = self.module(*inputs, **kwargs)
        finally:
            root.use_masters()
        if root.index is not None:
            self._state.post_forward(root.index)
            if graph:
                output = _before_backward(output, self._state, root.index)
        self._state.end_forward()
        return output

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate unsharded gradients locally (each unit's whole gradient: more
        memory) and communicate no gradient; the first backward after it reduces the sum."""
        previous = self._state.sync_enabled()
        self._state.set_sync(False)
        try:
            yield
        finally:
            self._state.set_sync(previous)

    def finish_gradient_synchronization(self) -> None:
        """Waits for the gradient reductions; they finish inside backward, so normally a no-op."""
        self._state.finalize()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clips the gradients of ``parameters()`` as ``torch.nn.utils.clip_grad_norm_`` clips whole gradients:
        the norm is over every rank's pieces (and the persistent parameters once), a collective; returns it.
        ``torch.nn.utils.clip_grad_norm_`` on ``parameters()`` would see this rank's pieces alone, and each rank
        would clip by another norm."""
        norm_type = float(norm_type)
        sharded = [p.grad for _, params in self._sharded for p in params if p.grad is not None]
        whole = [p.grad for p in self._persistent if p.grad is not None]
        norms = [torch.linalg.vector_norm(g.detach(), norm_type, dtype=torch.float64) for g in sharded]
        local = torch.stack(norms) if norms else torch.zeros(1, dtype=torch.float64)
        whole_norms = [torch.linalg.vector_norm(g.detach(), norm_type, dtype=torch.float64) for g in whole]
        persistent = torch.stack(whole_norms) if whole_norms else torch.zeros(1, dtype=torch.float64)
        if norm_type == float("inf"):
            total = local.max().reshape(1)
            comm.all_reduce(total, op="max", group=self.process_group)
            total = torch.maximum(total[0], persistent.max())
        else:
            total = local.pow(norm_type).sum().reshape(1)
            comm.all_reduce(total, group=self.process_group)
            total = (total[0] + persistent.pow(norm_type).sum()).pow(1.0 / norm_type)
        coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for grad in sharded + whole:
            grad.detach().mul_(coefficient.to(grad.dtype))
        return total.to(torch.float32)

    def sharding_stats(self) -> dict:
        """Counters of the native state: gathers (and those queued ahead), reductions, synced backwards."""
        return dict(self._state.stats())

    # --- state dicts ------------------------------------------------------------------------------

    def _full_tensors(self) -> dict[int, torch.Tensor]:
        """id(parameter) -> its whole value (an all-gather of every sharded unit: a collective)."""
        full = {}
        for index, params in self._sharded:
            master = self._state.master(index)
            gathered = master.new_empty(self.world_size * master.numel())
            comm.all_gather_into_tensor(gathered, master, group=self.process_group)
            offset = 0
            for param, shape in zip(params, self._shapes(params)):
                numel = shape.numel()
                full[id(param)] = gathered[offset : offset + numel].view(shape).clone()
                offset += numel
        for param in self._persistent:
            full[id(param)] = param.detach().clone()
        return full

    def _shapes(self, params: list[nn.Parameter]) -> list[torch.Size]:
        return [self._shape_of[id(p)] for p in params]

    def state_dict(self, *, destination=None, prefix: str = "", keep_vars: bool = False) -> dict:
        """The unwrapped module's state dict with every parameter whole (a collective: every rank calls it and
        gets it). A snapshot (Note [Full state dicts are snapshots]): its parameters are copies, and so are its
        buffers unless ``keep_vars``."""
        full = self._full_tensors()
        out = {} if destination is None else destination
        for key, value in self.module.state_dict(keep_vars=True).items():
            out[prefix + key] = (
                full[id(value)] if id(value) in full else (value if keep_vars else value.detach().clone())
            )
        return out

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Loads a state dict of whole tensors under the unwrapped module's names (``state_dict()``'s, or the
        unwrapped module's own): each rank takes its pieces. No communication."""
        if assign:
            raise ValueError(f"{WHO}.load_state_dict: assign=True would replace the sharded parameters")
        params = dict(self.module.named_parameters(remove_duplicate=False))
        pieces = {}
        for key, value in state_dict.items():
            param = params.get(key)
            if param is not None and id(param) in self._pieces:
                first, length, _ = self._pieces[id(param)]
                expected = self._shape_of[id(param)]
                if value.shape != expected:
                    raise ValueError(
                        f"{WHO}.load_state_dict: '{key}' has shape {tuple(value.shape)}, expected {tuple(expected)}"
                    )
                value = value.reshape(-1)[first : first + length]
            pieces[key] = value
        return self.module.load_state_dict(pieces, strict=strict)

    def _names(self) -> dict[int, str]:
        """id(parameter) -> its name in the unwrapped module (the first, for a shared one)."""
        return {id(p): name for name, p in self.module.named_parameters()}

    def _is_piece_state(self, param: torch.Tensor, value: Any) -> bool:
        """Whether ``value``, an optimizer state of ``param``, holds one value per element of its piece."""
        return (
            id(param) in self._pieces
            and isinstance(value, torch.Tensor)
            and value.dim() == 1
            and value.numel() == self._pieces[id(param)][1]
        )

    # Note [Full state dicts are snapshots]
    # state_dict() and optim_state_dict() hand out copies of every tensor, and load_optim_state_dict() keeps
    # copies of what it loads, where torch's Module.state_dict() and Optimizer.state_dict() share the live
    # tensors. The sharded parameters' whole tensors and states are new tensors (gathered) anyway; sharing the
    # rest (the persistent parameters' states, every "step", the buffers) would let the next steps change a
    # dict taken earlier in those entries only, which ones depending on the persistence threshold. The
    # copies cost the persistent parameters' size, which the threshold keeps small. Tests: tests/test_fsdp.py's
    # test_full_state_dicts_are_snapshots_that_training_on_leaves_alone, and tests/test_train.py's
    # test_a_sharded_run_resumes_at_another_world_size (a consolidated state read after training on).

    def optim_state_dict(self, optimizer: torch.optim.Optimizer) -> dict:
        """The state dict of ``optimizer`` (built on ``parameters()``) with every per-element state whole and
        parameters named as in the unwrapped module, as torch's ``get_optimizer_state_dict(model, optimizer,
        options=StateDictOptions(full_state_dict=True))`` gives: ``load_optim_state_dict`` loads it at any world
        size. A snapshot (Note [Full state dicts are snapshots]). A collective (an all-gather per sharded unit
        and state)."""
        names = self._names()
        params = [p for group in optimizer.param_groups for p in group["params"]]
        own = optimizer.state_dict()
        state_of = {id(p): own["state"].get(i) for i, p in enumerate(params)}
        out_state: dict[str, dict] = {}
        for param in params:
            if state_of[id(param)] is not None:
                out_state[names[id(param)]] = {
                    key: copy.deepcopy(value)
                    for key, value in state_of[id(param)].items()
                    if not self._is_piece_state(param, value)
                }
        # Every rank gathers the same states of each unit: their names are agreed first (one round).
        keys = []
        for _, unit_params in self._sharded:
            found = {
                k for p in unit_params for k, v in (state_of.get(id(p)) or {}).items() if self._is_piece_state(p, v)
            }
            keys.append(sorted(found))
        everyone: list = [None] * self.world_size
        dist.all_gather_object(everyone, keys, group=self.process_group)
        if any(theirs != keys for theirs in everyone):
            raise RuntimeError(f"{WHO}.optim_state_dict: the ranks' optimizers hold different states: {everyone}")
        for (index, unit_params), unit_keys in zip(self._sharded, keys):
            _, shard = self._state.layout(index)
            for key in unit_keys:
                values = [state_of[id(p)][key] for p in unit_params if state_of.get(id(p)) and key in state_of[id(p)]]
                flat = values[0].new_zeros(shard)
                for param in unit_params:
                    _, length, shard_offset = self._pieces[id(param)]
                    if length and state_of.get(id(param)) and key in state_of[id(param)]:
                        flat[shard_offset : shard_offset + length] = state_of[id(param)][key]
                gathered = flat.new_empty(self.world_size * shard)
                comm.all_gather_into_tensor(gathered, flat, group=self.process_group)
                offset = 0
                for param in unit_params:
                    shape = self._shape_of[id(param)]
                    if names[id(param)] in out_state:
                        out_state[names[id(param)]][key] = gathered[offset : offset + shape.numel()].view(shape).clone()
                    offset += shape.numel()
        groups = []
        for group, own_group in zip(optimizer.param_groups, own["param_groups"]):
            groups.append({**own_group, "params": [names[id(p)] for p in group["params"]]})
        return {"state": out_state, "param_groups": groups}

    def load_optim_state_dict(self, optimizer: torch.optim.Optimizer, state_dict: dict) -> None:
        """Loads ``optim_state_dict``'s output (saved at any world size) into ``optimizer``, built on
        ``parameters()`` with the same parameter groups: each rank takes copies of its pieces and of the rest
        (Note [Full state dicts are snapshots]). No communication."""
        names = self._names()
        params = [p for group in optimizer.param_groups for p in group["params"]]
        index_of = {names[id(p)]: i for i, p in enumerate(params)}
        state = {}
        for name, values in state_dict["state"].items():
            if name not in index_of:
                raise KeyError(f"{WHO}.load_optim_state_dict: '{name}' is not a parameter of this optimizer")
            param = params[index_of[name]]
            converted = {}
            for key, value in values.items():
                if (
                    id(param) in self._pieces
                    and isinstance(value, torch.Tensor)
                    and value.shape == self._shape_of[id(param)]
                ):
                    first, length, _ = self._pieces[id(param)]
                    value = value.reshape(-1)[first : first + length].clone()
                else:
                    value = copy.deepcopy(value)
                converted[key] = value
            state[index_of[name]] = converted
        groups = []
        for group in state_dict["param_groups"]:
            missing = [n for n in group["params"] if n not in index_of]
            if missing:
                raise KeyError(f"{WHO}.load_optim_state_dict: parameters {missing} are not in this optimizer")
            groups.append({**group, "params": [index_of[n] for n in group["params"]]})
        optimizer.load_state_dict({"state": state, "param_groups": groups})

    # --- torch.distributed.checkpoint -------------------------------------------------------------

    def _as_sharded_tensor(self, param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        """``local`` (this rank's piece of ``param``, or a state of it) as a ShardedTensor over the flattened
        parameter: every rank's piece in its global metadata (the shard layout is pure, so no round is needed)."""
        from torch.distributed._shard.metadata import ShardMetadata
        from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
        from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

        from .sharding import shard_pieces

        unit, position = self._unit_of[id(param)]
        numels = [self._shape_of[id(p)].numel() for p in self._sharded[unit][1]]
        pieces = []
        for rank in range(self.world_size):
            for piece in shard_pieces(numels, self.world_size, rank):
                if piece.param == position:
                    pieces.append(ShardMetadata([piece.param_offset], [piece.length], f"rank:{rank}/cpu"))
        mine = [p for p in pieces if p.placement.rank() == self.rank]
        metadata = ShardedTensorMetadata(pieces, torch.Size([numels[position]]), TensorProperties(dtype=local.dtype))
        shards = [Shard(local, mine[0])] if mine else []
        return ShardedTensor._init_from_local_shards_and_global_metadata(
            shards, metadata, process_group=self.process_group
        )

    def sharded_state_dict(self) -> dict:
        """A state dict for ``torch.distributed.checkpoint`` under the unwrapped module's names: each sharded
        parameter a ShardedTensor over its flattened elements whose local shard is this rank's piece itself,
        the rest (persistent parameters, buffers) the tensors themselves, so ``dcp.save`` writes every piece
        once and ``dcp.load`` into it loads in place, at any world size::

            dcp.save(model.sharded_state_dict(), checkpoint_id=path)
            dcp.load(model.sharded_state_dict(), checkpoint_id=path)
        """
        out = {}
        for key, value in self.module.state_dict(keep_vars=True).items():
            out[key] = self._as_sharded_tensor(value, value.detach()) if id(value) in self._pieces else value.detach()
        return out

    def sharded_optim_state_dict(self, optimizer: torch.optim.Optimizer) -> dict:
        """``optim_state_dict``'s layout with each per-element state a ShardedTensor over its parameter's
        flattened elements (this rank's piece its local shard), for ``torch.distributed.checkpoint``; load
        what dcp.load filled with ``load_sharded_optim_state_dict``. An optimizer that never stepped gets its
        state first (torch's own DCP helper: a step with zero gradients and learning rates). No communication."""
        from torch.distributed.checkpoint.state_dict import _init_optim_state

        _init_optim_state(optimizer)
        names = self._names()
        params = [p for group in optimizer.param_groups for p in group["params"]]
        own = optimizer.state_dict()
        state = {}
        for i, param in enumerate(params):
            if i not in own["state"]:
                continue
            state[names[id(param)]] = {
                key: self._as_sharded_tensor(param, value) if self._is_piece_state(param, value) else value
                for key, value in own["state"][i].items()
            }
        groups = [
            {**own_group, "params": [names[id(p)] for p in group["params"]]}
            for group, own_group in zip(optimizer.param_groups, own["param_groups"])
        ]
        return {"state": state, "param_groups": groups}

    def load_sharded_optim_state_dict(self, optimizer: torch.optim.Optimizer, state_dict: dict) -> None:
        """Loads ``sharded_optim_state_dict``'s layout (after ``dcp.load`` filled it) into ``optimizer``."""
        names = self._names()
        params = [p for group in optimizer.param_groups for p in group["params"]]
        index_of = {names[id(p)]: i for i, p in enumerate(params)}
        state = {}
        for name, values in state_dict["state"].items():
            converted = {}
            for key, value in values.items():
                if hasattr(value, "local_shards"):  # a ShardedTensor: this rank's piece, or none
                    shards = value.local_shards()
                    value = shards[0].tensor if shards else torch.empty(0, dtype=value.dtype)
                converted[key] = value
            state[index_of[name]] = converted
        groups = [{**group, "params": [index_of[n] for n in group["params"]]} for group in state_dict["param_groups"]]
        optimizer.load_state_dict({"state": state, "param_groups": groups})
