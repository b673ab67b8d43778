"""The reduction family and the split rules, in one process (csrc/comm/reduction/reduce_kernel.h, reduction/split.h).

Every loop of the family (the pairs that the message schedules combine, the sources loop of the
shared-memory collectives, in place or not) must give the same bits for every op and dtype, and those
bits must be torch's: a sum as torch's additions in rank order, a mean as that sum divided by the
number of ranks with torch's division (Note [One reduction family]: the mean is divided in one place),
max and min as IEEE 754-2019 maximum/minimum (Note [Reductions]). The ops are those of the testing
build (csrc/testing/reductions.cpp).
"""

import pytest
import torch

import ddpkit  # noqa: F401  (registers the op libraries)

from helpers import bits, ieee_extremum

FLOATS = [torch.float32, torch.float64]
INTS = [torch.int32, torch.int64]
LOOPS = ["pairs", "sources", "sources_in_place"]
# Crosses the sources loop's blocks (16 KiB): a partial block at the end, for both element sizes.
NUMEL = 3 * 4096 + 5


def family(inputs, op, loop):
    return torch.ops.ddpkit_testing.reduce_with_family(inputs, op, loop)


def rank_inputs(ranks, dtype, seed, special=True):
    """One tensor per rank; floating point ones salted with NaNs, infinities and zeros of both signs."""
    generator = torch.Generator().manual_seed(seed)
    if not dtype.is_floating_point:
        return [torch.randint(-1000, 1000, (NUMEL,), generator=generator, dtype=dtype) for _ in range(ranks)]
    inputs = [torch.randn(NUMEL, generator=generator, dtype=dtype) * 100 for _ in range(ranks)]
    if special:
        values = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0], dtype=dtype)
        for tensor in inputs:
            where = torch.randint(0, NUMEL, (NUMEL // 8,), generator=generator)
            tensor[where] = values[torch.randint(0, len(values), (len(where),), generator=generator)]
    return inputs


def expected(inputs, op):
    if op in ("sum", "mean"):
        total = inputs[0].clone()
        for tensor in inputs[1:]:
            total = total + tensor
        return total / len(inputs) if op == "mean" and len(inputs) > 1 else total
    return ieee_extremum(inputs, op)


def assert_same_bits(actual, wanted, what):
    assert actual.dtype == wanted.dtype, what
    if actual.dtype.is_floating_point:
        nan = torch.isnan(wanted)
        assert torch.equal(torch.isnan(actual), nan), what
        assert torch.equal(bits(actual)[~nan], bits(wanted)[~nan]), what
    else:
        assert torch.equal(actual, wanted), what


@pytest.mark.parametrize("ranks", [1, 2, 3, 5])
@pytest.mark.parametrize("dtype", FLOATS + INTS, ids=str)
@pytest.mark.parametrize("op", ["sum", "mean", "max", "min"])
def test_the_reduction_family_matches_torch_in_every_loop(op, dtype, ranks):
    if op == "mean" and not dtype.is_floating_point:
        pytest.skip("an integer mean is rejected before it reduces (next test)")
    inputs = rank_inputs(ranks, dtype, seed=ranks * 100 + len(op))
    wanted = expected(inputs, op)
    results = {loop: family(inputs, op, loop) for loop in LOOPS}
    for loop, result in results.items():
        assert_same_bits(result, wanted, (op, dtype, ranks, loop))
        # A sum's NaN payloads are the compiler's (Note [One reduction family]); every other bit is the loops'.
        assert_same_bits(result, results["pairs"], (op, dtype, ranks, loop))
    if op in ("max", "min") and dtype.is_floating_point:
        nan = torch.isnan(wanted)
        canonical = bits(torch.tensor([float("nan")], dtype=dtype))
        assert nan.any() and torch.equal(bits(results["pairs"])[nan].unique(), canonical), "one quiet NaN"


def test_the_mean_is_the_sum_divided_once_with_torchs_division():
    for dtype in FLOATS:
        for ranks in (2, 3, 7):
            inputs = rank_inputs(ranks, dtype, seed=ranks, special=False)
            total = family(inputs, "sum", "pairs")
            for loop in LOOPS:
                assert torch.equal(bits(family(inputs, "mean", loop)), bits(total / ranks)), (dtype, ranks, loop)


@pytest.mark.parametrize("dtype", INTS, ids=str)
def test_an_integer_mean_never_reaches_the_family(dtype):
    inputs = rank_inputs(2, dtype, seed=0)
    for loop in LOOPS:
        with pytest.raises(RuntimeError, match="integer mean"):
            family(inputs, "mean", loop)


@pytest.mark.parametrize("numel", [0, 1, 2, 5, 7, 1000, 1001, 100_003])
@pytest.mark.parametrize("parts", [1, 2, 3, 4, 8])
def test_the_split_rules(numel, parts):
    balanced = torch.ops.ddpkit_testing.split_starts(numel, parts, "balanced")
    lengths = [b - a for a, b in zip(balanced, balanced[1:])]
    assert balanced[0] == 0 and balanced[-1] == numel
    # The first numel % parts pieces one element longer, consecutive pieces covering the vector.
    assert lengths == [numel // parts + (i < numel % parts) for i in range(parts)]
    padded = torch.ops.ddpkit_testing.split_starts(numel, parts, "padded")
    length = -(-numel // parts)
    # Equal pieces of ceil(numel / parts), padded past the end by less than one element per piece.
    assert padded == [i * length for i in range(parts + 1)]
    assert numel <= padded[-1] < numel + parts
