"""The state dicts of ``ddpkit.ShardedOptimizer``: the consolidated form (what a plain optimizer over the same
parameters returns; loads at any world size) and the sharded form (one rank's part; loads at the same world
size and rank only). Kept apart from the optimizer's step, which never comes here.

A piece's state (Note [Shard layout]) is "piece-shaped" where it has the piece's shape (exp_avg,
momentum_buffer: one value per element); everything else (step) is a parameter's whole state, the same on
every piece of it, taken from the rank that holds the parameter's first element.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from . import comm

if TYPE_CHECKING:
    from .sharded_optimizer import ShardedOptimizer

SHARDED_FORMAT = 1


def _piece_shaped(value: Any, piece_shape: torch.Size) -> bool:
    return torch.is_tensor(value) and value.dim() > 0 and value.shape == piece_shape


def _parameter_shaped(value: Any, param: Tensor, key: str) -> bool:
    """Whether a consolidated state entry holds one value per element of ``param`` (a 0-dim parameter's
    "step" has its shape too, and is not one)."""
    if not torch.is_tensor(value) or value.shape != param.shape:
        return False
    return param.dim() > 0 or key != "step"


def _groups_with_indices(optimizer: ShardedOptimizer) -> list[dict]:
    groups, first = [], 0
    for group in optimizer.param_groups:
        count = len(group["params"])
        groups.append(
            {**{k: v for k, v in group.items() if k != "params"}, "params": list(range(first, first + count))}
        )
        first += count
    return groups


def consolidated_state_dict(optimizer: ShardedOptimizer) -> dict[str, Any]:
    """Every parameter's state whole (collective). The piece-shaped entries of each bucket are all-gathered
    one key at a time, in an order every rank computes alike from what every rank told the others."""
    group = optimizer.process_group
    state: dict[int, dict] = {}
    for group_params in optimizer.param_groups:
        for param in group_params["params"]:
            if not optimizer._is_sharded(param) and param in optimizer.optim.state:
                # a copy, as the gathered entries are (Note [Full state dicts are snapshots] in fsdp.py)
                state[optimizer._index[id(param)]] = copy.deepcopy(dict(optimizer.optim.state[param]))
    whole: dict[int, dict] = {}  # param index -> the entries that are not piece-shaped (from its first piece)
    keys: dict[tuple[int, int], dict[str, str]] = {}  # (set, bucket) -> piece-shaped key -> dtype
    for s, sharded_set in enumerate(optimizer._sets):
        for piece in sharded_set.pieces:
            piece_state = optimizer.optim.state.get(piece.tensor)
            if not piece_state:
                continue
            shaped = {k: str(v.dtype) for k, v in piece_state.items() if _piece_shaped(v, piece.tensor.shape)}
            keys.setdefault((s, piece.bucket), {}).update(shaped)
            if piece.offset == 0:
                whole[piece.index] = {k: v for k, v in piece_state.items() if k not in shaped}
    told: list = [None] * optimizer.world_size
    dist.all_gather_object(told, (whole, keys), group=group)
    all_keys: dict[tuple[int, int], dict[str, str]] = {}
    for their_whole, their_keys in told:
        for index, entries in their_whole.items():
            state[index] = dict(entries)
        for where, shaped in their_keys.items():
            all_keys.setdefault(where, {}).update(shaped)
    for (s, bucket), shaped in sorted(all_keys.items()):
        sharded_set = optimizer._sets[s]
        buffer_numel = sharded_set.layout[0][bucket]
        size = buffer_numel // optimizer.world_size
        members = [i for i, b in enumerate(sharded_set.bucket_of) if b == bucket]
        for key, dtype_name in sorted(shaped.items()):
            dtype = getattr(torch, dtype_name.removeprefix("torch."))
            shard = torch.zeros(size, dtype=dtype)
            for piece in sharded_set.pieces:
                value = optimizer.optim.state.get(piece.tensor, {}).get(key)
                if piece.bucket == bucket and value is not None:
                    shard.narrow(0, piece.shard_offset, piece.length).copy_(value)
            gathered = torch.empty(size * optimizer.world_size, dtype=dtype)
            comm.all_gather_into_tensor(gathered, shard, group=group)
            for i in members:
                param = sharded_set.params[i]
                index = optimizer._index[id(param)]
                if index in state:  # a parameter never stepped has no state, as with a plain optimizer
                    region = gathered.narrow(0, sharded_set.offsets[i], param.numel())
                    state[index][key] = region.view(param.shape).clone()
    ordered = {index: state[index] for index in sorted(state)}
    return {"state": ordered, "param_groups": _groups_with_indices(optimizer)}


def sharded_state_dict(optimizer: ShardedOptimizer) -> dict[str, Any]:
    return {
        "ddpkit_sharded": SHARDED_FORMAT,
        "world_size": optimizer.world_size,
        "rank": optimizer.rank,
        "layout": [s.layout for s in optimizer._sets],
        "param_groups": _groups_with_indices(optimizer),
        "optim": optimizer.optim.state_dict(),
    }


def _check_groups(optimizer: ShardedOptimizer, groups: list[dict], who: str) -> None:
    if len(groups) != len(optimizer.param_groups):
        raise ValueError(
            f"{who}: the state dict has {len(groups)} param groups, this optimizer {len(optimizer.param_groups)}"
        )
    for g, (saved, mine) in enumerate(zip(groups, optimizer.param_groups)):
        if len(saved["params"]) != len(mine["params"]):
            raise ValueError(
                f"{who}: param group {g} of the state dict has {len(saved['params'])} parameters, "
                f"this optimizer's {len(mine['params'])}"
            )


def _set_hyperparameters(optimizer: ShardedOptimizer, groups: list[dict]) -> None:
    for saved, mine in zip(groups, optimizer.param_groups):
        for key, value in saved.items():
            if key != "params":
                mine[key] = copy.deepcopy(value)


def load_consolidated(optimizer: ShardedOptimizer, state_dict: dict[str, Any]) -> None:
    who = "ddpkit.ShardedOptimizer.load_state_dict"
    if "state" not in state_dict or "param_groups" not in state_dict:
        raise ValueError(f"{who}: not an optimizer state dict (no 'state' and 'param_groups')")
    groups = state_dict["param_groups"]
    _check_groups(optimizer, groups, who)
    by_saved_index: dict[int, Tensor] = {}
    for saved, mine in zip(groups, optimizer.param_groups):
        by_saved_index.update(zip(saved["params"], mine["params"]))
    for saved_index, entries in state_dict["state"].items():
        param = by_saved_index.get(int(saved_index))
        if param is None:
            raise ValueError(f"{who}: state for parameter {saved_index}, which no param group holds")
        for key, value in entries.items():
            if torch.is_tensor(value) and value.dim() > 0 and value.shape != param.shape:
                raise ValueError(
                    f"{who}: state '{key}' of parameter {saved_index} has shape {tuple(value.shape)}, "
                    f"the parameter {tuple(param.shape)}"
                )
    saved_of = {id(param): int(i) for i, param in by_saved_index.items()}
    pieces = {id(piece.tensor): piece for s in optimizer._sets for piece in s.pieces}
    inner_state: dict[int, dict] = {}
    inner_groups = []
    position = 0
    for saved, inner_group in zip(groups, optimizer.optim.param_groups):
        indices = []
        for tensor in inner_group["params"]:
            piece = pieces.get(id(tensor))
            param = piece.param if piece is not None else tensor
            entries = state_dict["state"].get(saved_of[id(param)], state_dict["state"].get(str(saved_of[id(param)])))
            if entries:
                inner_state[position] = {
                    key: value.reshape(-1).narrow(0, piece.offset, piece.length).clone()
                    if piece is not None and _parameter_shaped(value, param, key)
                    else copy.deepcopy(value)
                    for key, value in entries.items()
                }
            indices.append(position)
            position += 1
        inner_groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": indices})
    optimizer.optim.load_state_dict({"state": inner_state, "param_groups": inner_groups})
    _set_hyperparameters(optimizer, groups)


def load_sharded(optimizer: ShardedOptimizer, state_dict: dict[str, Any]) -> None:
    who = "ddpkit.ShardedOptimizer.load_state_dict"
    if state_dict.get("ddpkit_sharded") != SHARDED_FORMAT:
        raise ValueError(
            f"{who}: a sharded state dict of format {state_dict.get('ddpkit_sharded')!r}, not {SHARDED_FORMAT}"
        )
    saved = (state_dict["world_size"], state_dict["rank"])
    if saved != (optimizer.world_size, optimizer.rank):
        raise ValueError(
            f"{who}: this sharded state dict is rank {saved[1]}'s of a world of {saved[0]}; this optimizer is rank "
            f"{optimizer.rank} of {optimizer.world_size}. A sharded state dict loads only where it was saved: load "
            "the consolidated state_dict() to change the world size"
        )
    if state_dict["layout"] != [s.layout for s in optimizer._sets]:
        raise ValueError(
            f"{who}: this sharded state dict was saved for other parameters or buckets (its layout differs)"
        )
    _check_groups(optimizer, state_dict["param_groups"], who)
    optimizer.optim.load_state_dict(state_dict["optim"])
    _set_hyperparameters(optimizer, state_dict["param_groups"])


__all__ = ["consolidated_state_dict", "load_consolidated", "load_sharded", "sharded_state_dict"]
