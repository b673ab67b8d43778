"""The shard layout (Note [Shard layout] in csrc/sharding/shard_layout.h): pure, one process."""

import random

import pytest
import torch

from ddpkit.sharding import ShardPiece, padded_numel, piece_views, shard_pieces, shard_range, shard_size

from helpers import bits


def test_shards_are_equal_contiguous_and_padded_at_the_end():
    assert [shard_size(t, 4) for t in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    assert [shard_range(10, 4, r) for r in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 10)]
    # T = 5 over 4 ranks: S = 2, the last rank owns nothing, the padding is 3 elements
    assert [shard_range(5, 4, r) for r in range(4)] == [(0, 2), (2, 4), (4, 5), (5, 5)]
    assert padded_numel(5, 4) == 8 and padded_numel(0, 3) == 0
    assert shard_range(0, 3, 2) == (0, 0)


def test_a_parameter_may_straddle_shards():
    # parameters of 4 and 6 elements over 2 ranks (S = 5): the second starts on rank 0
    assert shard_pieces([4, 6], 2, 0) == [ShardPiece(0, 0, 4, 0), ShardPiece(1, 0, 1, 4)]
    assert shard_pieces([4, 6], 2, 1) == [ShardPiece(1, 1, 5, 0)]
    # one parameter over three ranks, and an empty parameter, which has no piece
    assert shard_pieces([0, 7, 0], 3, 1) == [ShardPiece(1, 3, 3, 0)]
    assert shard_pieces([], 2, 0) == []


def test_the_ranks_pieces_cover_every_element_once():
    rng = random.Random(0)
    for _ in range(200):
        numels = [rng.choice([0, 1, 2, 3, 7, 64, 1000]) for _ in range(rng.randint(0, 8))]
        world_size = rng.randint(1, 9)
        total = sum(numels)
        owner = [None] * total
        for rank in range(world_size):
            begin, end = shard_range(total, world_size, rank)
            assert end - begin <= shard_size(total, world_size)
            covered = 0
            for piece in shard_pieces(numels, world_size, rank):
                assert piece.length > 0
                assert piece.shard_offset == covered
                start = sum(numels[: piece.param]) + piece.param_offset
                assert begin <= start and start + piece.length <= end
                for e in range(start, start + piece.length):
                    assert owner[e] is None
                    owner[e] = rank
                covered += piece.length
            assert covered == end - begin
        assert None not in owner, (numels, world_size)


def test_bad_arguments_are_named():
    with pytest.raises(RuntimeError, match="world_size must be >= 1"):
        shard_size(4, 0)
    with pytest.raises(RuntimeError, match="rank 2 of a world of 2"):
        shard_range(4, 2, 2)
    with pytest.raises(RuntimeError, match="parameter 1 has -1 elements"):
        shard_pieces([3, -1], 2, 0)


def test_piece_views_fill_and_read_a_shard():
    params = [torch.arange(6.0).view(2, 3), torch.arange(10.0, 14.0)]
    world_size = 3  # T = 10, S = 4
    gathered = torch.zeros(padded_numel(10, world_size))
    for rank in range(world_size):
        shard = gathered.narrow(0, rank * 4, 4)
        for view in piece_views(params, shard, world_size, rank):
            view.shard_part.copy_(view.param_part)
            assert view.param is params[view.piece.param]
    assert torch.equal(gathered[:10], torch.cat([p.view(-1) for p in params]))
    assert torch.equal(gathered[10:], torch.zeros(2))  # the padding
    with pytest.raises(ValueError, match="at least 4 elements"):
        piece_views(params, torch.zeros(3), world_size, 0)


@pytest.mark.parametrize(
    "optimizer, options",
    [
        (torch.optim.AdamW, {"weight_decay": 0.1}),
        (torch.optim.AdamW, {"foreach": True}),
        (torch.optim.AdamW, {"fused": True}),
        (torch.optim.Adam, {"amsgrad": True}),
        (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
    ],
)
def test_elementwise_optimizers_give_the_same_bits_on_pieces(optimizer, options):
    """Why the layout needs no alignment: a step on pieces cut anywhere (vectorised body and scalar tail
    falling elsewhere) gives the same bits as on the whole parameter."""
    numel, steps = 1000, 3
    start = torch.randn(numel, generator=torch.Generator().manual_seed(1))
    grads = [torch.randn(numel, generator=torch.Generator().manual_seed(2 + s)) for s in range(steps)]
    whole = start.clone().view(40, 25)
    reference = optimizer([whole], **options)
    for grad in grads:
        whole.grad = grad.view(40, 25).clone()
        reference.step()
    for cuts in ([1, 250], [7, 509], [13, 31, 999]):
        flat = start.clone()
        bounds = [0, *cuts, numel]
        pieces = [flat[a:b] for a, b in zip(bounds, bounds[1:])]
        sharded = optimizer(pieces, **options)
        for grad in grads:
            for piece, a, b in zip(pieces, bounds, bounds[1:]):
                piece.grad = grad[a:b].clone()
            sharded.step()
        assert torch.equal(bits(flat), bits(whole.view(-1))), cuts
