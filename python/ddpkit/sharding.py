"""The shard layout of sharded data parallelism (ZeRO-1/2/3): which rank owns which elements of a flat buffer.

A flat buffer of T elements (parameters, or their gradients, back to back in an order every rank agrees on)
is split over N ranks into N equal contiguous shards of S = ceil(T / N) elements; the buffer is padded to
N·S elements (the padding zero, owned by no parameter) and rank r owns elements [r·S, min((r+1)·S, T)).
A parameter may straddle two ranks' shards; each owner holds a piece of it. The rules are C++ (Note
[Shard layout] in csrc/sharding/shard_layout.h), which the reducer and the sharded data-parallel classes
use; the functions here are their Python face, plus the views that turn a rank's pieces into tensors.

    >>> shard_size(10, 4), shard_range(10, 4, 3)
    (3, (9, 10))
    >>> shard_pieces([4, 6], world_size=2, rank=0)
    [ShardPiece(param=0, param_offset=0, length=4, shard_offset=0), ShardPiece(param=1, param_offset=0, length=1, shard_offset=4)]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from . import _C  # noqa: F401  (registers torch.ops.ddpkit.*)


class ShardPiece(NamedTuple):
    """The elements of parameter ``param`` (an index into the list given) that fall in one rank's shard:
    ``[param_offset, param_offset + length)`` of the flattened parameter, at ``shard_offset`` in the shard."""

    param: int
    param_offset: int
    length: int
    shard_offset: int


def shard_size(total: int, world_size: int) -> int:
    """S = ceil(total / world_size): the elements of every rank's shard, padding included."""
    return torch.ops.ddpkit.shard_size(total, world_size)


def shard_range(total: int, world_size: int, rank: int) -> tuple[int, int]:
    """The elements [begin, end) of a buffer of ``total`` elements that ``rank`` owns (begin == end: none)."""
    return tuple(torch.ops.ddpkit.shard_range(total, world_size, rank))


def shard_pieces(numels: Sequence[int], world_size: int, rank: int) -> list[ShardPiece]:
    """The pieces of ``rank``'s shard of a buffer holding parameters of ``numels`` elements back to back,
    in buffer order (a parameter of 0 elements has none)."""
    flat = torch.ops.ddpkit.shard_pieces(list(numels), world_size, rank)
    return [ShardPiece(*flat[i : i + 4]) for i in range(0, len(flat), 4)]


def padded_numel(total: int, world_size: int) -> int:
    """N·S: the elements of the padded buffer, what a reduce-scatter or all-gather of it moves."""
    return world_size * shard_size(total, world_size)


class PieceView(NamedTuple):
    """A piece of ``rank``'s shard as tensors: ``param_part`` views the parameter's elements of the
    piece (flattened), ``shard_part`` the same elements in the shard tensor given to ``piece_views``."""

    param: Tensor
    param_part: Tensor
    shard_part: Tensor
    piece: ShardPiece


def piece_views(tensors: Sequence[Tensor], shard: Tensor, world_size: int, rank: int) -> list[PieceView]:
    """Maps ``tensors`` (parameters, or their gradients: contiguous, laid out back to back in this order)
    to views of ``rank``'s ``shard`` (a 1-D tensor of at least the shard's elements): one PieceView per
    piece, in buffer order. Copying ``param_part`` into ``shard_part`` for every piece fills the shard."""
    total = sum(t.numel() for t in tensors)
    if shard.dim() != 1 or shard.numel() < shard_size(total, world_size):
        raise ValueError(
            f"ddpkit.sharding.piece_views: the shard must be a 1-D tensor of at least {shard_size(total, world_size)} "
            f"elements, got shape {tuple(shard.shape)}"
        )
    views = []
    for piece in shard_pieces([t.numel() for t in tensors], world_size, rank):
        tensor = tensors[piece.param]
        part = tensor.view(-1).narrow(0, piece.param_offset, piece.length)
        views.append(PieceView(tensor, part, shard.narrow(0, piece.shard_offset, piece.length), piece))
    return views
