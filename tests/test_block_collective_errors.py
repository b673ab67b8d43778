"""all_gather_into_tensor and reduce_scatter_tensor refusing what they cannot run (Note [Collective
checks] in csrc/comm/checks/root_verdict.h): mismatched calls raise on every rank, naming the difference; bad
arguments raise clearly; an algorithm one rank cannot run is reported on every rank, and every
collective that takes an algorithm validates it alike. After each, the group stays usable. Their
results: test_block_collectives.py.
"""

import pytest
import torch
import torch.distributed as dist

import ddpkit
from ddpkit.testing import WorkerPool

from helpers import caught

TRANSPORTS = ["shm", "process_group"]
LARGE = 600_000  # float32 elements per block: 2.4 MB, ten 256 KiB slots (kSlotBytes in csrc/comm/shm/segment.cpp)


# --- cases that run on every rank ----------------------------------------------------------------


def block_mismatch_call(kind, rank, transport):
    """The call rank `rank` makes for mismatch `kind`: rank 1 differs from ranks 0 and 2."""
    n = dist.get_world_size()
    odd = rank == 1

    def gather(numel=1000, dtype=torch.float32, algorithm="auto"):
        return lambda: ddpkit.all_gather_into_tensor(
            torch.zeros(n * numel, dtype=dtype),
            torch.ones(numel, dtype=dtype),
            algorithm=algorithm,
            transport=transport,
        )

    def scatter(numel=1000, dtype=torch.float32, op="sum", algorithm="auto"):
        return lambda: ddpkit.reduce_scatter_tensor(
            torch.zeros(numel, dtype=dtype),
            torch.ones(n * numel, dtype=dtype),
            op=op,
            algorithm=algorithm,
            transport=transport,
        )

    return {
        "gather_numel": gather(numel=1000 + odd),
        "gather_large_numel": gather(numel=LARGE + odd),
        "scatter_numel": scatter(numel=1000 + odd),
        "scatter_large_numel": scatter(numel=LARGE + odd),
        "gather_dtype": gather(dtype=torch.float64 if odd else torch.float32),
        "scatter_dtype": scatter(dtype=torch.float64 if odd else torch.float32),
        "scatter_op": scatter(op="max" if odd else "sum"),
        "gather_algorithm": gather(algorithm="ring" if odd else "auto"),
        "scatter_algorithm": scatter(algorithm="ring" if odd else "auto"),
        "gather_vs_scatter": scatter() if odd else gather(),
        "gather_vs_all_reduce": (lambda: ddpkit.all_reduce(torch.ones(1000), transport=transport)) if odd else gather(),
        "scatter_vs_barrier": (lambda: ddpkit.barrier(transport=transport)) if odd else scatter(),
        "gather_output_size_on_one_rank": (
            lambda: ddpkit.all_gather_into_tensor(torch.zeros(n * 8 + 1), torch.ones(8), transport=transport)
        )
        if odd
        else gather(numel=8),
        "scatter_input_size_on_one_rank": (
            lambda: ddpkit.reduce_scatter_tensor(torch.zeros(8), torch.ones(n * 8 - 1), transport=transport)
        )
        if odd
        else scatter(numel=8),
    }[kind]


def case_mismatch(kind, transport):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    assert ddpkit.collective_checks_enabled()
    error = caught(block_mismatch_call(kind, rank, transport))
    # The group is still usable: all three collectives, through the same transport.
    gathered = torch.empty(world_size * 300_000)
    ddpkit.all_gather_into_tensor(gathered, torch.full((300_000,), float(rank)), transport=transport)
    scattered = torch.empty(1000)
    ddpkit.reduce_scatter_tensor(scattered, torch.full((world_size * 1000,), float(rank)), transport=transport)
    ddpkit.barrier(transport=transport)
    reduced = torch.full((1000,), float(rank))
    ddpkit.all_reduce(reduced, transport=transport)
    return error, gathered, scattered, reduced


BAD_CALLS = {
    "gather_output_too_small": lambda n, t: ddpkit.all_gather_into_tensor(
        torch.empty(n * 4 - 1), torch.ones(4), transport=t
    ),
    "scatter_input_too_large": lambda n, t: ddpkit.reduce_scatter_tensor(
        torch.empty(4), torch.ones(n * 4 + 1), transport=t
    ),
    "gather_dtypes_differ": lambda n, t: ddpkit.all_gather_into_tensor(
        torch.empty(n * 4, dtype=torch.float64), torch.ones(4), transport=t
    ),
    "scatter_dtypes_differ": lambda n, t: ddpkit.reduce_scatter_tensor(
        torch.empty(4, dtype=torch.float64), torch.ones(n * 4), transport=t
    ),
    # overlapping, but no rank's own block (which would be the accepted in-place form)
    "gather_aliased": lambda n, t: (lambda out: ddpkit.all_gather_into_tensor(out, out[1:5], transport=t))(
        torch.ones(n * 4)
    ),
    "scatter_aliased": lambda n, t: (lambda inp: ddpkit.reduce_scatter_tensor(inp[1:5], inp, transport=t))(
        torch.ones(n * 4)
    ),
    "gather_non_contiguous": lambda n, t: ddpkit.all_gather_into_tensor(
        torch.empty(n * 4, 4), torch.ones(4, 4).t(), transport=t
    ),
    "scatter_non_contiguous_output": lambda n, t: ddpkit.reduce_scatter_tensor(
        torch.empty(4, 4).t(), torch.ones(n * 4, 4), transport=t
    ),
    "scatter_mean_of_integers": lambda n, t: ddpkit.reduce_scatter_tensor(
        torch.empty(4, dtype=torch.int64), torch.ones(n * 4, dtype=torch.int64), op="mean", transport=t
    ),
    "scatter_unsupported_dtype": lambda n, t: ddpkit.reduce_scatter_tensor(
        torch.empty(4, dtype=torch.bool), torch.ones(n * 4, dtype=torch.bool), transport=t
    ),
    "scatter_unsupported_torch_op": lambda n, t: ddpkit.reduce_scatter_tensor(
        torch.empty(4), torch.ones(n * 4), op=dist.ReduceOp.PRODUCT, transport=t
    ),
    "gather_not_a_block_algorithm": lambda n, t: ddpkit.all_gather_into_tensor(
        torch.empty(n * 4), torch.ones(4), algorithm="star", transport=t
    ),
    "scatter_not_a_block_algorithm": lambda n, t: ddpkit.reduce_scatter_tensor(
        torch.empty(4), torch.ones(n * 4), algorithm="butterfly", transport=t
    ),
    "gather_unknown_algorithm": lambda n, t: ddpkit.all_gather_into_tensor(
        torch.empty(n * 4), torch.ones(4), algorithm="telepathy", transport=t
    ),
}

BAD_ARGUMENT_MESSAGES = {
    "gather_output_too_small": "ddpkit.all_gather_into_tensor: the output must have world size (2) times the "
    "elements of the input (4), got 7",
    "scatter_input_too_large": "ddpkit.reduce_scatter_tensor: the input must have world size (2) times the "
    "elements of the output (4), got 9",
    "gather_dtypes_differ": "ddpkit.all_gather_into_tensor: input and output must have the same dtype and device, "
    "got Float on cpu and Double on cpu",
    "scatter_dtypes_differ": "ddpkit.reduce_scatter_tensor: input and output must have the same dtype and device, "
    "got Float on cpu and Double on cpu",
    "gather_aliased": "ddpkit.all_gather_into_tensor: output and input must not share memory, except an input "
    "that is this rank's block of the output",
    "scatter_aliased": "ddpkit.reduce_scatter_tensor: output and input must not share memory, except an output "
    "that is this rank's block of the input",
    "gather_non_contiguous": "ddpkit.all_gather_into_tensor: expected a contiguous tensor",
    "scatter_non_contiguous_output": "ddpkit.reduce_scatter_tensor: expected a contiguous tensor",
    "scatter_mean_of_integers": "ddpkit.reduce_scatter_tensor: op 'mean' needs a floating-point tensor, got Long",
    "scatter_unsupported_dtype": "ddpkit.reduce_scatter_tensor: unsupported dtype Bool",
    "scatter_unsupported_torch_op": "unknown reduce op 'product'",
    "gather_not_a_block_algorithm": "ddpkit.all_gather_into_tensor: algorithm must be 'auto', 'ring', "
    "'halving_doubling', 'direct' or 'hierarchical', got 'star'",
    "scatter_not_a_block_algorithm": "ddpkit.reduce_scatter_tensor: algorithm must be 'auto', 'ring', "
    "'halving_doubling', 'direct' or 'hierarchical', got 'butterfly'",
    "gather_unknown_algorithm": "unknown algorithm 'telepathy'",
}


def case_bad_arguments(kinds, transport):
    """Every rank makes the same bad call; after each, the group must still work."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    out = {}
    for kind in kinds:
        error = caught(lambda: BAD_CALLS[kind](world_size, transport))
        output = torch.empty(world_size * 10)
        ddpkit.all_gather_into_tensor(output, torch.full((10,), float(rank)), transport=transport)
        out[kind] = (error, output)
    return out


def case_direct_over_process_group():
    rank, world_size = dist.get_rank(), dist.get_world_size()
    errors = [
        caught(
            lambda: ddpkit.all_gather_into_tensor(
                torch.empty(world_size * 4), torch.ones(4), algorithm="direct", transport="process_group"
            )
        ),
        caught(
            lambda: ddpkit.reduce_scatter_tensor(
                torch.empty(4), torch.ones(world_size * 4), algorithm="direct", transport="process_group"
            )
        ),
    ]
    output = torch.empty(world_size * 4)
    ddpkit.all_gather_into_tensor(output, torch.full((4,), float(rank)), transport="process_group")
    return errors, output


def case_algorithm_unusable_on_one_rank(collective, algorithm, transport):
    """Rank 1 alone passes an algorithm the block collectives cannot run here; the others pass "auto"."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    chosen = algorithm if rank == 1 else "auto"
    if collective == "all_gather":
        error = caught(
            lambda: ddpkit.all_gather_into_tensor(
                torch.empty(world_size * 8), torch.ones(8), algorithm=chosen, transport=transport
            )
        )
    else:
        error = caught(
            lambda: ddpkit.reduce_scatter_tensor(
                torch.empty(8), torch.ones(world_size * 8), algorithm=chosen, transport=transport
            )
        )
    output = torch.empty(world_size * 8)
    after = caught(lambda: ddpkit.all_gather_into_tensor(output, torch.full((8,), float(rank)), transport=transport))
    return error, after, output


def case_algorithm_on_every_collective(algorithm, transport, alone):
    """Every collective that takes an algorithm, asked for ``algorithm`` over ``transport`` on the
    whole group or (``alone``) on a group of this rank alone: each one's error, or None."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    singles = [dist.new_group([r]) for r in range(world_size)]
    group, n = (singles[rank], 1) if alone else (None, world_size)
    errors = {
        "all_reduce": caught(
            lambda: ddpkit.all_reduce(torch.ones(4), algorithm=algorithm, group=group, transport=transport)
        ),
        "all_gather_into_tensor": caught(
            lambda: ddpkit.all_gather_into_tensor(
                torch.empty(n * 4), torch.ones(4), group=group, algorithm=algorithm, transport=transport
            )
        ),
        "reduce_scatter_tensor": caught(
            lambda: ddpkit.reduce_scatter_tensor(
                torch.empty(4), torch.ones(n * 4), group=group, algorithm=algorithm, transport=transport
            )
        ),
    }
    for single in singles:
        dist.destroy_process_group(single)
    return errors


# --- tests ---------------------------------------------------------------------------------------


MISMATCH_MESSAGES = {
    "gather_numel": "rank 1 passed elements 1001, rank 0 passed elements 1000",
    "gather_large_numel": f"rank 1 passed elements {LARGE + 1}, rank 0 passed elements {LARGE}",
    "scatter_numel": "rank 1 passed elements 1001, rank 0 passed elements 1000",
    "scatter_large_numel": f"rank 1 passed elements {LARGE + 1}, rank 0 passed elements {LARGE}",
    "gather_dtype": "rank 1 passed dtype Double, rank 0 passed dtype Float",
    "scatter_dtype": "rank 1 passed dtype Double, rank 0 passed dtype Float",
    "scatter_op": "rank 1 passed op max, rank 0 passed op sum",
    "gather_algorithm": "rank 1 passed algorithm ring, rank 0 passed algorithm auto",
    "scatter_algorithm": "rank 1 passed algorithm ring, rank 0 passed algorithm auto",
    "gather_vs_scatter": "rank 1 passed collective reduce_scatter_tensor, rank 0 passed collective "
    "all_gather_into_tensor",
    "gather_vs_all_reduce": "rank 1 passed collective all_reduce, rank 0 passed collective all_gather_into_tensor",
    "scatter_vs_barrier": "rank 1 passed collective barrier, rank 0 passed collective reduce_scatter_tensor",
    "gather_output_size_on_one_rank": "rank 1 rejected its arguments",
    "scatter_input_size_on_one_rank": "rank 1 rejected its arguments",
}
OWN_ERRORS = {  # what rank 1, which rejected its own arguments, says instead
    "gather_output_size_on_one_rank": "ddpkit.all_gather_into_tensor: the output must have world size (3) times "
    "the elements of the input (8), got 25",
    "scatter_input_size_on_one_rank": "ddpkit.reduce_scatter_tensor: the input must have world size (3) times "
    "the elements of the output (8), got 23",
}


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("kind", sorted(MISMATCH_MESSAGES))
def test_mismatched_calls_raise_on_every_rank(pool, kind, transport):
    world_size = 3
    outcomes = pool(world_size).run(case_mismatch, kind, transport)
    for rank, (error, gathered, scattered, reduced) in enumerate(outcomes):
        assert error is not None, f"rank {rank} did not raise for {kind}"
        expected = OWN_ERRORS[kind] if rank == 1 and kind in OWN_ERRORS else MISMATCH_MESSAGES[kind]
        assert expected in error, f"rank {rank}: {error}"
        # and the group survived
        assert torch.equal(gathered, torch.arange(world_size, dtype=torch.float32).repeat_interleave(300_000))
        assert torch.equal(scattered, torch.full((1000,), float(sum(range(world_size)))))
        assert torch.equal(reduced, torch.full((1000,), float(sum(range(world_size)))))


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_bad_arguments_raise_clearly(pool, transport):
    world_size = 2
    results = pool(world_size).run(case_bad_arguments, sorted(BAD_CALLS), transport)
    for rank, out in enumerate(results):
        for kind, (error, output) in out.items():
            assert error is not None, f"rank {rank} did not raise for {kind}"
            assert BAD_ARGUMENT_MESSAGES[kind] in error, f"rank {rank}, {kind}: {error}"
            assert torch.equal(output, torch.arange(world_size, dtype=torch.float32).repeat_interleave(10)), kind


@pytest.mark.parametrize(
    "collective, algorithm, transport",
    [
        ("all_gather", "star", "shm"),
        ("reduce_scatter", "direct", "process_group"),
        ("reduce_scatter", "halving_doubling", "process_group"),  # 3 ranks: not a power of two
    ],
)
def test_an_algorithm_only_one_rank_cannot_run_is_reported_on_every_rank(collective, algorithm, transport):
    """Note [Collective checks]: a rank that rejects its own arguments still takes part in the check,
    so that the others fail at once, saying which rank, and the group stays usable; an algorithm
    the block collectives cannot run here is such an argument. A fresh pool with a short group
    timeout: a rank left waiting for the header of a peer that never sends it fails only then."""
    world_size = 3
    worker_pool = WorkerPool(world_size, timeout=120, group_timeout=5)
    try:
        outcomes = worker_pool.run(case_algorithm_unusable_on_one_rank, collective, algorithm, transport)
    finally:
        worker_pool.close()
    what = "all_gather_into_tensor" if collective == "all_gather" else "reduce_scatter_tensor"
    own = {
        "star": f"ddpkit.{what}: algorithm must be 'auto', 'ring', 'halving_doubling', 'direct' or "
        "'hierarchical', got 'star'",
        "direct": f"ddpkit.{what}: algorithm 'direct' needs the shared-memory transport",
        "halving_doubling": f"ddpkit.{what}: algorithm 'halving_doubling' needs a power-of-two world size, got 3",
    }[algorithm]
    seen = "\n".join(
        f"rank {rank}: {error!r}; afterwards: {after!r}" for rank, (error, after, _) in enumerate(outcomes)
    )
    for rank, (error, after, output) in enumerate(outcomes):
        expected = own if rank == 1 else "rank 1 rejected its arguments"
        assert error is not None and expected in error, f"rank {rank} should say {expected!r}; got:\n{seen}"
        assert after is None, f"rank {rank}: the group is unusable afterwards:\n{seen}"
        assert torch.equal(output, torch.arange(world_size, dtype=torch.float32).repeat_interleave(8))


def test_direct_needs_shared_memory(pool):
    world_size = 2
    for errors, output in pool(world_size).run(case_direct_over_process_group):
        for error in errors:
            assert error is not None and "algorithm 'direct' needs the shared-memory transport" in error, error
        assert torch.equal(output, torch.arange(world_size, dtype=torch.float32).repeat_interleave(4))


@pytest.mark.parametrize("algorithm", ["direct", "hierarchical"])
def test_an_algorithm_is_validated_alike_by_every_collective(pool, algorithm):
    """Note [Algorithms a rank can run]: 'direct' and 'hierarchical' run on a group of one rank, which
    moves nothing, for every collective that takes an algorithm (the all-reduce once refused
    'hierarchical' there while the all-gather took it); where the group cannot run them, every
    collective refuses them with the same words."""
    for errors in pool(2).run(case_algorithm_on_every_collective, algorithm, "process_group", True):
        assert errors == {what: None for what in errors}, errors
    needs = {
        "direct": "algorithm 'direct' needs the shared-memory transport",
        "hierarchical": "algorithm 'hierarchical' needs a group spanning hosts",
    }[algorithm]
    for errors in pool(2).run(case_algorithm_on_every_collective, algorithm, "process_group", False):
        for what, error in errors.items():
            assert error is not None and f"ddpkit.{what}: {needs}" in error, (what, error)
