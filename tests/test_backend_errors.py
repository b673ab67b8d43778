"""The "ddpkit" backend's errors: mismatched calls and bad arguments raise on every rank with a message
that names the call, and the group stays usable; what the backend does not do raises clearly."""

import pytest
import torch
import torch.distributed as dist

from helpers import RED, caught, quiet, run_on_a_fresh_pool

# --- mismatched calls -------------------------------------------------------------------------


def _mismatched_async(rank):
    dist.all_reduce(torch.ones(5 + (rank == 1)), async_op=True).wait()


MISMATCHED_CALLS = {
    "numel": lambda rank: dist.all_reduce(torch.ones(5 + (rank == 1))),
    "collective": lambda rank: dist.all_reduce(torch.ones(5)) if rank == 1 else dist.broadcast(torch.ones(5), src=0),
    "dtype": lambda rank: dist.all_reduce(torch.ones(5, dtype=torch.float64 if rank == 1 else torch.float32)),
    "op": lambda rank: dist.all_reduce(torch.ones(5), op=RED.MAX if rank == 1 else RED.SUM),
    "root": lambda rank: dist.broadcast(torch.ones(5), src=1 if rank == 1 else 0),
    "all_gather_into_tensor": lambda rank: dist.all_gather_into_tensor(
        torch.empty(3 * (4 + (rank == 1))), torch.ones(4 + (rank == 1))
    ),
    "all_gather_list": lambda rank: dist.all_gather(
        [torch.empty(2 + (rank == 1)) for _ in range(3)], torch.ones(2 + (rank == 1))
    ),
    "async": _mismatched_async,
}

MISMATCH_MESSAGES = {
    "numel": "rank 1 passed elements 6, rank 0 passed elements 5",
    "collective": "rank 1 passed collective all_reduce, rank 0 passed collective broadcast",
    "dtype": "rank 1 passed dtype Double, rank 0 passed dtype Float",
    "op": "rank 1 passed op max, rank 0 passed op sum",
    "root": "rank 1 passed root 1, rank 0 passed root 0",
    "all_gather_into_tensor": "rank 1 passed elements 5, rank 0 passed elements 4",
    "all_gather_list": "rank 1 passed elements 3, rank 0 passed elements 2",
    "async": "rank 1 passed elements 6, rank 0 passed elements 5",
}


def case_mismatch(kind):
    rank = dist.get_rank()
    error = caught(lambda: MISMATCHED_CALLS[kind](rank))
    # the group is still usable: synchronously and asynchronously
    after = torch.full((1001,), float(rank))
    dist.all_reduce(after)
    later = torch.full((7,), float(rank))
    dist.all_reduce(later, op=RED.MAX, async_op=True).wait()
    return error, after, later


@pytest.mark.parametrize("kind", sorted(MISMATCHED_CALLS))
def test_mismatched_calls_raise_on_every_rank(pools, kind):
    world_size = 3
    outcomes = pools("ddpkit", world_size).run(case_mismatch, kind, timeout=30)
    for rank, (error, after, later) in enumerate(outcomes):
        assert error is not None, f"rank {rank} did not raise"
        assert "mismatched collectives" in error and MISMATCH_MESSAGES[kind] in error, error
        assert torch.equal(after, torch.full((1001,), float(sum(range(world_size)))))
        assert torch.equal(later, torch.full((7,), float(world_size - 1)))


def _coalesced(call, *args):
    """`call(*args)` inside torch's coalescing manager, which hands the backend its coalesced form."""
    with dist._coalescing_manager():
        quiet(call, *args)


# Calls whose backend operation shares its collective check's kind with another call (the kind is
# named after one of them): each mismatched by a size or dtype on rank 1. The torch.distributed name
# of the call, then the kind the check compares.
NAMED_MISMATCHES = {
    "all_gather": (
        "all_gather_into_tensor",
        lambda rank: dist.all_gather([torch.empty(2 + rank) for _ in range(2)], torch.ones(2 + rank)),
    ),
    "reduce_scatter": (
        "reduce_scatter_tensor",
        lambda rank: dist.reduce_scatter(torch.empty(2 + rank), [torch.ones(2 + rank) for _ in range(2)]),
    ),
    "all_gather_into_tensor_coalesced": (
        "all_gather_into_tensor",
        lambda rank: _coalesced(dist.all_gather_into_tensor, torch.empty(2 * (2 + rank)), torch.ones(2 + rank)),
    ),
    "reduce_scatter_tensor_coalesced": (
        "reduce_scatter_tensor",
        lambda rank: _coalesced(dist.reduce_scatter_tensor, torch.empty(2 + rank), torch.ones(2 * (2 + rank))),
    ),
    "all_reduce_coalesced": ("all_reduce", lambda rank: _coalesced(dist.all_reduce, torch.ones(2 + rank))),
    # delegated to gloo, after the same check
    "all_gather_coalesced": (
        "all_gather_into_tensor",
        lambda rank: quiet(
            dist.all_gather_coalesced, [[torch.empty(2 + rank)] for _ in range(2)], [torch.ones(2 + rank)]
        ),
    ),
    "all_to_all_single": (
        "all_to_all",
        lambda rank: dist.all_to_all_single(
            torch.empty(2, dtype=torch.float64 if rank else torch.float32),
            torch.ones(2, dtype=torch.float64 if rank else torch.float32),
        ),
    ),
}


def case_named_mismatch(name):
    rank = dist.get_rank()
    error = caught(lambda: NAMED_MISMATCHES[name][1](rank))
    after = torch.full((3,), float(rank))
    dist.all_reduce(after)
    return error, after


@pytest.mark.parametrize("name", sorted(NAMED_MISMATCHES))
def test_mismatch_errors_name_the_call(pools, name):
    """On every rank the error starts with the name of the call made, not with that of the kind of
    collective its check compares (which all_gather shares with all_gather_into_tensor, ...)."""
    kind = NAMED_MISMATCHES[name][0]
    outcomes = pools("ddpkit", 2).run(case_named_mismatch, name, timeout=30)
    for rank, (error, after) in enumerate(outcomes):
        assert error is not None, f"rank {rank} did not raise"
        assert f"ddpkit.{name}: ranks called mismatched collectives: rank 1 passed " in error, error
        assert f"ddpkit.{kind}:" not in error, error
        assert torch.equal(after, torch.full((3,), 1.0)), f"rank {rank}: the group is not usable afterwards"


def case_uneven_split_mismatch():
    """Rank 1 sends one row to itself but expects two from itself, and three rows to rank 0, which expects two."""
    rank = dist.get_rank()
    output = torch.full((6,), -1.0)
    send = [3, 1, 2] if rank == 1 else [2, 2, 2]
    error = caught(lambda: dist.all_to_all_single(output, torch.arange(6.0) + 10 * rank, [2, 2, 2], send))
    after = torch.full((5,), float(rank))
    dist.all_reduce(after)
    return error, output, after


def test_all_to_all_split_mismatch_raises_on_every_rank(pools):
    outcomes = pools("ddpkit", 3).run(case_uneven_split_mismatch, timeout=30)
    problems = []
    for rank, (error, output, after) in enumerate(outcomes):
        if error is None:
            problems.append(f"rank {rank} did not raise (its output: {output.tolist()})")
        elif "frame #0" in error or "Exception raised from" in error:
            problems.append(f"rank {rank}'s error carries a C++ stack trace: {error[:400]!r}")
        if not torch.equal(after, torch.full((5,), 3.0)):
            problems.append(f"rank {rank}: the group is not usable afterwards")
    assert not problems, "\n".join(problems)


def mismatch_problems(outcomes, expected_everywhere=None, expected_on=None):
    """What is wrong with per-rank (error, error afterwards, tensor afterwards) outcomes."""
    problems = []
    for rank, outcome in enumerate(outcomes):
        if isinstance(outcome, BaseException):
            problems.append(f"rank {rank} failed outside the case: {outcome!r}")
            continue
        error, after_error, after = outcome
        expected = (expected_on or {}).get(rank, expected_everywhere)
        if error is None:
            problems.append(f"rank {rank} did not raise")
        elif expected is not None and expected not in error:
            problems.append(f"rank {rank} raised {error[:300]!r}, expected it to say {expected!r}")
        if after_error is not None:
            problems.append(f"rank {rank}: the next all_reduce failed: {after_error[:300]!r}")
        elif not torch.equal(after, torch.full((3,), 3.0)):
            problems.append(f"rank {rank}: the next all_reduce gave {after.tolist()}")
    return problems


def case_then_all_reduce(table, kind):
    """Runs globals()[table][kind] (a dict of lambdas cannot be pickled), then an all_reduce."""
    rank = dist.get_rank()
    error = caught(lambda: globals()[table][kind](rank))
    after = torch.full((3,), float(rank))
    after_error = caught(lambda: dist.all_reduce(after))
    return error, after_error, after


ROOT_ARGUMENT_ERRORS = {
    "gather_short_list": lambda rank: dist.gather(torch.ones(2), [torch.empty(2)] * 2 if rank == 0 else None, dst=0),
    "scatter_short_list": lambda rank: dist.scatter(torch.empty(2), [torch.ones(2)] * 2 if rank == 0 else None, src=0),
    "gather_wrong_sizes": lambda rank: dist.gather(torch.ones(2), [torch.empty(3)] * 3 if rank == 0 else None, dst=0),
}


@pytest.mark.parametrize("kind", sorted(ROOT_ARGUMENT_ERRORS))
def test_bad_arguments_on_the_root_raise_on_every_rank(kind):
    """The root's list of the wrong length or sizes: like all_gather's (rejected inside the collective,
    on every rank), not an error on the root alone that leaves the others waiting and the group broken."""
    outcomes = run_on_a_fresh_pool(case_then_all_reduce, "ROOT_ARGUMENT_ERRORS", kind)
    what = kind.split("_")[0]
    problems = mismatch_problems(outcomes, expected_everywhere="rank 0 rejected its arguments", expected_on={0: what})
    assert not problems, "\n".join(problems)


LIST_ARGUMENT_ERRORS = {
    # a wrong list with an empty input once passed the collective's size check and read past the list
    "all_gather_empty_list_everywhere": lambda rank: dist.all_gather([], torch.empty(0)),
    "all_gather_short_list_on_rank_1": lambda rank: dist.all_gather(
        [torch.empty(0)] * (2 if rank == 1 else 3), torch.empty(0)
    ),
    # delegated to gloo, which checks the input on rank 1 alone: the others waited for it
    "reduce_scatter_tensor_short_input_on_rank_1": lambda rank: quiet(
        dist.reduce_scatter_tensor, torch.empty(2), torch.ones(4 if rank == 1 else 6), op=RED.PRODUCT
    ),
    # PRODUCT is delegated to gloo, which checks the list on rank 1 alone: the others waited for it
    "reduce_scatter_short_list_on_rank_1": lambda rank: dist.reduce_scatter(
        torch.empty(2), [torch.ones(2)] * (2 if rank == 1 else 3), op=RED.PRODUCT
    ),
    "all_gather_coalesced_short_list_on_rank_1": lambda rank: quiet(
        dist.all_gather_coalesced, [[torch.empty(2)] for _ in range(2 if rank == 1 else 3)], [torch.ones(2)]
    ),
}


@pytest.mark.parametrize("kind", sorted(LIST_ARGUMENT_ERRORS))
def test_bad_lists_raise_on_every_rank(kind):
    outcomes = run_on_a_fresh_pool(case_then_all_reduce, "LIST_ARGUMENT_ERRORS", kind)
    if kind.endswith("everywhere"):
        problems = mismatch_problems(
            outcomes, expected_everywhere="takes a list of one tensor per rank of the group (3)"
        )
    else:
        problems = mismatch_problems(
            outcomes,
            expected_everywhere="rank 1 rejected its arguments",
            expected_on={
                1: "expected world size times the output's 2"
                if "tensor" in kind
                else "per rank of the group (3), got 2"
            },
        )
    assert not problems, "\n".join(problems)


MIXED_CALLS = {
    # rank 1's PRODUCT is delegated to gloo, the others' SUM runs on ddpkit's engine
    "own_and_delegated": lambda rank: dist.all_reduce(torch.ones(5), op=RED.PRODUCT if rank == 1 else RED.SUM),
}


def test_mismatch_with_a_delegated_op_raises_on_every_rank():
    outcomes = run_on_a_fresh_pool(case_then_all_reduce, "MIXED_CALLS", "own_and_delegated")
    problems = mismatch_problems(outcomes, expected_everywhere="mismatched collectives")
    assert not problems, "\n".join(problems)


# --- what the backend does not do: clear errors ------------------------------------------------

UNSUPPORTED_CALLS = {
    "avg_of_integers_on_one_rank": lambda rank: dist.all_reduce(
        torch.ones(4, dtype=torch.int64) if rank == 1 else torch.ones(4), op=RED.AVG
    ),
    "non_contiguous_all_to_all_single": lambda rank: dist.all_to_all_single(
        torch.empty(6, 2).t(), torch.ones(6, 2).t()
    ),
    "avg_of_integers": lambda rank: dist.all_reduce(torch.ones(4, dtype=torch.int64), op=RED.AVG),
    "premul_sum": lambda rank: dist.all_reduce(torch.ones(4), op=dist._make_nccl_premul_sum(2.0)),
    "int16": lambda rank: dist.all_reduce(torch.ones(4, dtype=torch.int16)),
}

UNSUPPORTED_MESSAGES = {
    "avg_of_integers_on_one_rank": "ddpkit.all_reduce: rank 1 rejected its arguments",
    "non_contiguous_all_to_all_single": "ddpkit.all_to_all_single: takes contiguous tensors",
    "avg_of_integers": "ddpkit.all_reduce: op 'mean' needs a floating-point tensor, got Long",
    "premul_sum": "Cannot use ReduceOp.PREMUL_SUM with Gloo",  # delegated: gloo's error
    "int16": "Invalid scalar type",  # delegated: gloo's error (gloo has no int16)
}


def case_unsupported(kind):
    rank = dist.get_rank()
    error = caught(lambda: UNSUPPORTED_CALLS[kind](rank))
    after = torch.full((3,), float(rank))
    dist.all_reduce(after)
    return error, after


@pytest.mark.parametrize("kind", sorted(UNSUPPORTED_CALLS))
def test_unsupported_calls_raise_clearly(pools, kind):
    outcomes = pools("ddpkit", 3).run(case_unsupported, kind, timeout=30)
    for rank, (error, after) in enumerate(outcomes):
        assert error is not None, f"rank {rank} did not raise"
        if kind == "avg_of_integers_on_one_rank" and rank == 1:
            assert UNSUPPORTED_MESSAGES["avg_of_integers"] in error, error
        else:
            assert UNSUPPORTED_MESSAGES[kind] in error, error
        assert torch.equal(after, torch.full((3,), 3.0)), "the group must stay usable"


def test_registered_for_cpu_only():
    """No GPU here: check the registration that makes torch refuse CUDA tensors on a "ddpkit" group."""
    assert "DDPKIT" in dist.Backend._plugins
    assert dist.Backend.backend_capability["ddpkit"] == ["cpu"]
