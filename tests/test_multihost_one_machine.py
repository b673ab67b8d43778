"""Groups spanning hosts on one machine split into hosts by DDPKIT_TEST_HOSTS (the testing build's): the
broad matrix of collectives, the ring across many hosts, hierarchical collectives and their messages,
and checks and faults across hosts, in ordinary worker pools that need no root. The same on simulated
hosts in namespaces: test_multihost.py. See Note [Topology] and Note [Hierarchical collectives] in
csrc/comm/.
"""

import pytest
import torch
import torch.distributed as dist

import ddpkit
from ddpkit.testing import WorkerFailure, WorkerPool

from helpers import (
    BACKEND_ONE_RANK_REJECTS,
    ONE_RANK_REJECTS,
    call_each_then_all_reduce,
    case_all_reduces,
    case_every_collective,
    case_mismatch,
    check_every_collective,
    error_and_untouched,
    rank_input,
)
from helpers import HOSTS_GROUP_TIMEOUT_S as GROUP_TIMEOUT_S


@pytest.mark.parametrize("labels", ["a,a,b,b", "a,b,b,b", "a,a,b,b,c,c"])
def test_every_collective_with_test_hosts_is_exact_with_identical_bits(labels):
    ranks_per_host = [labels.split(",").count(label) for label in dict.fromkeys(labels.split(","))]
    with WorkerPool(len(labels.split(",")), timeout=300, group_timeout=60, env={"DDPKIT_TEST_HOSTS": labels}) as pool:
        per_rank = pool.run(case_every_collective, [0, 1, 7, 1001, 300_003], timeout=300)
    check_every_collective(per_rank, ranks_per_host)


def case_ring_collectives(numels):
    """case_every_collective's keys for the collectives the ring across hosts runs, in float32 and int64."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    out = {"topology": ddpkit.comm.topology()}
    for dtype in (torch.float32, torch.int64):
        for numel in numels:
            for op in ("sum", "max"):
                tensor = rank_input(rank, numel, integer=True).to(dtype)
                ddpkit.all_reduce(tensor, op=op)
                out[("all_reduce", str(dtype), numel, op, "auto")] = tensor
            gathered = torch.empty(world_size * numel, dtype=dtype)
            ddpkit.all_gather_into_tensor(gathered, rank_input(rank, numel, integer=True).to(dtype))
            out[("all_gather", str(dtype), numel)] = gathered
            scattered = torch.empty(numel, dtype=dtype)
            ddpkit.reduce_scatter_tensor(scattered, rank_input(rank, world_size * numel, integer=True).to(dtype))
            out[("reduce_scatter", str(dtype), numel)] = scattered
    return out


def test_eight_hosts_are_exact_with_identical_bits():
    """The ring across hosts (Note [A ring across hosts]) at eight hosts of one rank: blocks of uneven
    sizes, some empty (7 elements over 8 ranks), every result exact and alike on every rank."""
    labels = ",".join("abcdefgh")
    with WorkerPool(8, timeout=600, group_timeout=120, env={"DDPKIT_TEST_HOSTS": labels}) as pool:
        per_rank = pool.run(case_ring_collectives, [7, 100_003], timeout=600)
    check_every_collective(per_rank, [1] * 8)


def test_blocks_of_megabytes_are_exact_with_identical_bits():
    """The ring across hosts (Note [A ring across hosts]) on blocks of several MiB, many parts each: a
    third of 4,000,003 elements (uneven blocks) in float32 and in int64, exact and alike on every rank."""
    with WorkerPool(3, timeout=600, group_timeout=120, env={"DDPKIT_TEST_HOSTS": "a,b,c"}) as pool:
        per_rank = pool.run(case_ring_collectives, [4_000_003], timeout=600)
    check_every_collective(per_rank, [1] * 3)


def case_collectives_and_their_messages(numel):
    """Every collective that crosses hosts hierarchically, in place and not, some ops, and the
    point-to-point messages ddpkit sent meanwhile."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    ddpkit.barrier()  # the group's set-up, before counting
    ddpkit.reset_comm_counters()
    out = {}
    tensor = rank_input(rank, numel, integer=True)
    ddpkit.broadcast(tensor, src=world_size - 1)
    out["broadcast"] = tensor
    for op in ("sum", "mean", "max"):
        for dst in (0, world_size - 1):
            tensor = rank_input(rank, numel, integer=True)
            ddpkit.reduce(tensor, dst=dst, op=op)
            out[("reduce", op, dst)] = tensor if rank == dst else None
        scattered = torch.empty(numel)
        ddpkit.reduce_scatter_tensor(scattered, rank_input(rank, world_size * numel, integer=True), op=op)
        out[("reduce_scatter", op)] = scattered
    whole = rank_input(rank, world_size * numel, integer=True)
    mine = whole[rank * numel : (rank + 1) * numel]
    ddpkit.reduce_scatter_tensor(mine, whole)  # the output is this rank's block of the input
    out[("reduce_scatter", "sum", "in place")] = mine.clone()
    gathered = torch.empty(world_size * numel, dtype=torch.float64)
    ddpkit.all_gather_into_tensor(gathered, rank_input(rank, numel, integer=True).double())
    out["all_gather"] = gathered
    gathered = torch.zeros(world_size * numel, dtype=torch.int32)
    gathered[rank * numel : (rank + 1) * numel] = rank_input(rank, numel, integer=True).int()
    ddpkit.all_gather_into_tensor(gathered, gathered[rank * numel : (rank + 1) * numel])  # in place
    out[("all_gather", "in place")] = gathered
    ddpkit.barrier()
    return out, ddpkit.comm_counters()["messages_sent"]


@pytest.mark.parametrize("labels", ["a,a,b,b", "a,b,b,b", "b,a,b,a"])
@pytest.mark.parametrize("numel", [1001, 30_001])  # every collective in one round across hosts; none
def test_collectives_across_hosts_are_exact_and_send_what_the_note_says(labels, numel):
    # Note [Hierarchical collectives] and Note [One round across hosts]: shared memory inside each
    # host; across hosts one message to the partner for the check (carrying the data where it fits),
    # then, for larger tensors, one frame over the socket links between the two hosts for the
    # broadcast and the reduce, and a swap of blocks for the all-gather and the reduce-scatter.
    world_size = 4
    with WorkerPool(world_size, timeout=120, group_timeout=60, env={"DDPKIT_TEST_HOSTS": labels}) as pool:
        per_rank = pool.run(case_collectives_and_their_messages, numel)
    inputs = torch.stack([rank_input(r, numel, integer=True).double() for r in range(world_size)])
    wide = torch.stack([rank_input(r, world_size * numel, integer=True).double() for r in range(world_size)])
    reduced = {"sum": inputs.sum(0), "mean": inputs.mean(0), "max": inputs.amax(0)}
    reduced_wide = {"sum": wide.sum(0), "mean": wide.mean(0), "max": wide.amax(0)}
    for rank, (out, messages) in enumerate(per_rank):
        assert torch.equal(out["broadcast"], inputs[3].float())
        for op in ("sum", "mean", "max"):
            for dst in (0, world_size - 1):
                if rank == dst:
                    torch.testing.assert_close(out[("reduce", op, dst)].double(), reduced[op], rtol=1e-6, atol=0)
            block = reduced_wide[op][rank * numel : (rank + 1) * numel]
            torch.testing.assert_close(out[("reduce_scatter", op)].double(), block, rtol=1e-6, atol=0)
        assert torch.equal(
            out[("reduce_scatter", "sum", "in place")].double(), reduced_wide["sum"][rank * numel : (rank + 1) * numel]
        )
        assert torch.equal(out["all_gather"], inputs.reshape(-1))
        assert torch.equal(out[("all_gather", "in place")], inputs.reshape(-1).int())
        if labels != "a,b,b,b":
            # Equal hosts: 14 collectives (a broadcast, 6 reduces, 4 reduce-scatters, 2 all-gathers,
            # a barrier), one check message to the one partner each. Larger than a round carries,
            # the reduces off the root's host send their slice (3 of 6), and every reduce-scatter
            # and all-gather one frame of its swap (Note [Hierarchical collectives]).
            # The larger broadcast: its root sends its partner on the other host the tensor.
            assert messages == 14 + (0 if numel == 1001 else 3 + 4 + 2 + (rank == 3)), (rank, messages)


@pytest.mark.parametrize("labels", ["a,a,b,b", "a,b,b,b"])
def test_a_mismatch_of_any_hierarchical_collective_raises_on_every_rank(labels):
    with WorkerPool(4, timeout=120, group_timeout=60, env={"DDPKIT_TEST_HOSTS": labels}) as pool:
        for collective in ("broadcast", "reduce", "all_gather", "reduce_scatter"):
            outcomes = pool.run(case_mismatch, 3, collective)
            for rank, (error, after) in enumerate(outcomes):
                assert error is not None and "mismatched" in error and "rank 3" in error, (collective, rank, error)
                assert after == 6, (collective, rank)


# Rank 1 asks for another algorithm than its peers: a flat schedule's check must meet the
# hierarchical one (Note [One round across hosts]), small and large.
ALGORITHM_DIFFERS = {
    "all_reduce_ring": lambda rank: ddpkit.all_reduce(torch.ones(8), algorithm="ring" if rank == 1 else "auto"),
    "large_all_reduce_star": lambda rank: ddpkit.all_reduce(
        torch.ones(100_000), algorithm="star" if rank == 1 else "auto"
    ),
    "all_gather_ring": lambda rank: ddpkit.all_gather_into_tensor(
        torch.empty(4 * 8), torch.ones(8), algorithm="ring" if rank == 1 else "auto"
    ),
}
ONE_RANK_DIFFERS = {
    **ONE_RANK_REJECTS,
    **BACKEND_ONE_RANK_REJECTS,
    **ALGORITHM_DIFFERS,
    "torch_op": lambda rank: ddpkit.reduce_scatter_tensor(  # test_hardening's, for 4 ranks
        torch.empty(2), torch.ones(8), op=dist.ReduceOp.PRODUCT if rank == 1 else "sum"
    ),
}


def case_one_rank_differs(kinds):
    return call_each_then_all_reduce(ONE_RANK_DIFFERS, kinds)


@pytest.mark.parametrize("labels", ["a,b,a,b", "a,b,b,b"])
def test_one_rank_rejecting_or_choosing_another_algorithm_across_hosts_raises_everywhere(labels):
    # Rank 1 is on the second host: the center of the check's round is on the first. Its rejections
    # (ddpkit's ops, SyncBatchNorm, the "ddpkit" backend's) take the check every collective of the
    # group takes, so they meet their peers' hierarchical collectives instead of waiting for them.
    with WorkerPool(4, backend="ddpkit", timeout=120, group_timeout=60, env={"DDPKIT_TEST_HOSTS": labels}) as pool:
        outcomes = pool.run(case_one_rank_differs, sorted(ONE_RANK_DIFFERS))
    for rank, out in enumerate(outcomes):
        for kind in sorted(ONE_RANK_DIFFERS):
            error, after = out[kind]
            assert error is not None and (rank == 1 or "rank 1" in error), f"rank {rank}, {kind}: {error}"
            assert after == 1111.0, f"rank {rank}, {kind}: the next all-reduce paired wrongly ({after})"


def case_all_reduce_twice():
    outcomes = []
    for _ in range(2):
        try:
            tensor = torch.ones(1000)
            ddpkit.all_reduce(tensor)
            outcomes.append(float(tensor[0]))
        except RuntimeError as error:
            outcomes.append(str(error))
    return outcomes


def test_links_that_fail_in_one_cross_subgroup_fail_the_set_up_on_every_rank():
    # Hosts a (ranks 0, 1) and b (ranks 2, 3): the links of local rank 1's subgroup {1, 3} fail (rank 3
    # cannot listen); those of {0, 2} work. Ranks 0 and 2 once went on into the collective and waited
    # for 1 and 3 until the group's timeout (60 s, beyond the run's 40), and the next call paired a
    # set-up with a collective.
    env = {"DDPKIT_TEST_HOSTS": "a,a,b,b", "DDPKIT_TEST_FAULT": "links_cannot_listen:3"}
    with WorkerPool(4, timeout=120, group_timeout=60, env=env) as pool:
        outcomes = pool.run(case_all_reduce_twice, timeout=40)
    for rank, calls in enumerate(outcomes):
        for call, outcome in enumerate(calls):
            assert isinstance(outcome, str), f"rank {rank}, call {call}: {outcome}"
            expected = (
                "links_cannot_listen"
                if rank == 3
                else "rank 3 could not listen"
                if rank == 1
                else "rank 1, rank 3 could not set up its steps across hosts"
            )
            assert expected in outcome, f"rank {rank}, call {call}: {outcome}"


def case_rank_2_rejects_with_checks_off():
    """Checks off; rank 2 rejects its all-reduce (a 4-element int64 mean) and goes on to the next one.
    Each rank's outcome of both calls: the error, or the sum."""
    rank = dist.get_rank()
    ddpkit.barrier()  # the group's set-up
    ddpkit.set_collective_checks(False)
    outcomes = []
    try:
        for value in (1.0, 10.0):
            tensor = torch.full((4,), value * (rank + 1))
            if rank == 2 and value == 1.0:
                tensor = tensor.long()  # a mean of integers: rejected on this rank alone
            try:
                ddpkit.all_reduce(tensor, op="mean" if rank == 2 and value == 1.0 else "sum")
                outcomes.append(float(tensor[0]))
            except RuntimeError as error:
                outcomes.append(str(error))
    finally:
        ddpkit.set_collective_checks(True)
    return outcomes


def test_a_rank_rejecting_with_checks_off_between_unequal_hosts_stops_its_host():
    # Hosts a (rank 0) and b (ranks 1-3): rank 2's rejection must stop host b's shared memory, else
    # its next all-reduce would take the step its host's ranks wait in, and they would return a sum
    # with another call's data in it.
    with WorkerPool(4, timeout=120, group_timeout=20, env={"DDPKIT_TEST_HOSTS": "a,b,b,b"}) as pool:
        outcomes = pool.run(case_rank_2_rejects_with_checks_off, timeout=100)
    for rank, (first, second) in enumerate(outcomes):
        assert isinstance(first, str), f"rank {rank} returned {first} from a collective rank 2 never joined"
        assert isinstance(second, str) or second == 100.0, f"rank {rank}: {second}"


def test_a_rank_dying_in_its_hosts_step_of_a_small_all_reduce_is_named_on_every_host():
    # Rank 3 dies between the check's step inside host b and the host's all-reduce: rank 2, its host's
    # other rank, still sends the check's round its words naming rank 3, so rank 0 on host a, which
    # waits for rank 2 in that round, names rank 3 instead of waiting out the timeout for rank 2.
    env = {"DDPKIT_TEST_HOSTS": "a,a,b,b", "DDPKIT_TEST_FAULT": "die_in_host_step:3"}
    with WorkerPool(4, timeout=120, group_timeout=GROUP_TIMEOUT_S, env=env) as pool:
        outcomes = pool.run(case_all_reduces, return_exceptions=True)
    assert isinstance(outcomes[3], WorkerFailure)
    for rank in (0, 1, 2):
        assert isinstance(outcomes[rank], RuntimeError), f"rank {rank}: {outcomes[rank]!r}"
        assert "rank 3" in str(outcomes[rank]) and "timed out" not in str(outcomes[rank]).lower(), (
            f"rank {rank}: {outcomes[rank]}"
        )


# --- what a collective across hosts must leave untouched --------------------------------------------


def case_disagreeing_small_all_reduce(culprit, how):
    """Every rank all-reduces a small tensor of its rank + 1; ``culprit`` passes another size
    ("size") or arguments it rejects ("rejects": an integer mean). This rank's error and tensor."""
    rank = dist.get_rank()
    odd = rank == culprit
    tensor = torch.full((1000 + (odd and how == "size"),), float(rank + 1))
    op = "sum"
    if odd and how == "rejects":
        tensor, op = tensor.long(), "mean"
    try:
        ddpkit.all_reduce(tensor, op=op)
        error = None
    except RuntimeError as exc:
        error = str(exc)
    after = torch.ones(10)
    ddpkit.all_reduce(after)  # the group survives
    return error, tensor.double().unique().tolist(), after[0].item()


@pytest.mark.parametrize("how", ["size", "rejects"])
def test_a_small_all_reduce_another_host_disagrees_with_leaves_every_tensor_as_it_was(how):
    # Note [Collective checks]: a disagreement moves no data. Host a's ranks agree with each other, so
    # their host's all-reduce runs before the round across hosts meets host b's culprit; it runs on a
    # copy, so host a's tensors still hold their own values when every rank raises.
    with WorkerPool(4, timeout=120, group_timeout=60, env={"DDPKIT_TEST_HOSTS": "a,a,b,b"}) as pool:
        outcomes = pool.run(case_disagreeing_small_all_reduce, 3, how)
    for rank, (error, values, after) in enumerate(outcomes):
        assert error is not None, f"rank {rank} did not raise"
        assert values == [float(rank + 1)], f"rank {rank}: its tensor became {values}"
        assert after == 4.0


def test_a_rank_dying_in_a_large_all_reduce_is_reported_on_the_other_host_at_once():
    # Rank 3 dies after the check, before host b's reduce-scatter. Rank 2, its host's other rank,
    # raises there, alive; it breaks its links across hosts, so rank 0, its partner on host a, which
    # waits for rank 2's frame of the swap, raises at once instead of at the links' timeout.
    env = {"DDPKIT_TEST_HOSTS": "a,a,b,b", "DDPKIT_TEST_FAULT": "die_in_host_data_step:3"}
    with WorkerPool(4, timeout=120, group_timeout=GROUP_TIMEOUT_S, env=env) as pool:
        outcomes = pool.run(case_all_reduces, 2, 100_000, return_exceptions=True)
    assert isinstance(outcomes[3], WorkerFailure)
    for rank in (0, 1, 2):
        assert isinstance(outcomes[rank], RuntimeError), f"rank {rank}: {outcomes[rank]!r}"
        assert "timed out" not in str(outcomes[rank]).lower(), f"rank {rank}: {outcomes[rank]}"
    assert "rank 2" in str(outcomes[0]) or "rank 1" in str(outcomes[0]), str(outcomes[0])


# --- the check in front of the swap between two hosts of one rank -------------------------------------

IN_FRONT = 300_001  # larger than the check's round carries: the all-reduce crosses in the swap


def _reduce_scatter(numel):
    output = torch.empty(numel)
    ddpkit.reduce_scatter_tensor(output, torch.ones(2 * numel))
    return output


# Rank 0's call and rank 1's, disagreeing: each pair meets the other call's frame in front of a swap,
# in the center's round (small calls, a broadcast: rank 0 is the center), or crossing alone.
DISAGREEING_CALLS = {
    "sizes": (lambda t: ddpkit.all_reduce(t), lambda t: ddpkit.all_reduce(torch.ones(IN_FRONT + 1))),
    "ops": (lambda t: ddpkit.all_reduce(t), lambda t: ddpkit.all_reduce(t, op="max")),
    "small_at_the_center": (lambda t: ddpkit.all_reduce(torch.ones(1000)), lambda t: ddpkit.all_reduce(t)),
    "small_at_the_partner": (lambda t: ddpkit.all_reduce(t), lambda t: ddpkit.all_reduce(torch.ones(1000))),
    "broadcast_at_the_center": (
        lambda t: ddpkit.broadcast(torch.ones(IN_FRONT), src=0),
        lambda t: ddpkit.all_reduce(t),
    ),
    "broadcast_at_the_partner": (
        lambda t: ddpkit.all_reduce(t),
        lambda t: ddpkit.broadcast(torch.ones(IN_FRONT), src=0),
    ),
    "empty": (lambda t: ddpkit.all_reduce(t), lambda t: ddpkit.all_reduce(torch.ones(0))),
    "rejected": (lambda t: ddpkit.all_reduce(t), lambda t: ddpkit.all_reduce(torch.ones(IN_FRONT).long(), op="mean")),
    "reduce_scatter": (lambda t: ddpkit.all_reduce(t), lambda t: _reduce_scatter(IN_FRONT)),
    "crossing": (
        lambda t: ddpkit.all_reduce(t, cross_host_dtype=torch.bfloat16),
        lambda t: ddpkit.all_reduce(t),
    ),
}


def case_check_in_front(kinds):
    """Per kind: this rank's call of DISAGREEING_CALLS[kind] on a tensor of rank + 1 (its error, and
    whether the tensor still holds its values), then agreeing calls that cross in the swap with the
    check in front (a sum, a bfloat16 crossing, a reduce-scatter): the stream stayed in step."""
    rank = dist.get_rank()
    out = {"topology": ddpkit.comm.topology()}
    for kind in kinds:
        error, untouched = error_and_untouched(DISAGREEING_CALLS[kind][rank], IN_FRONT)
        total = torch.full((IN_FRONT,), float(rank + 1))
        ddpkit.all_reduce(total)
        crossed = torch.full((IN_FRONT,), float(rank + 1))
        ddpkit.all_reduce(crossed, op="mean", cross_host_dtype=torch.bfloat16)
        out[kind] = (
            error,
            untouched,
            total.unique().tolist(),
            crossed.unique().tolist(),
            _reduce_scatter(IN_FRONT).unique().tolist(),
        )
    return out


def test_the_check_in_front_of_a_swap_raises_alike_and_leaves_the_stream_in_step():
    # Note [A check in front of the swap]: between two hosts of one rank each, both ranks raise on every
    # disagreement, whichever way the other call checks (in front of its own swap, in the center's
    # round, alone), nothing of the other's data is reduced into a tensor, and every later call
    # agrees (a frame left half read would put every later one out of step).
    with WorkerPool(2, timeout=120, group_timeout=60, env={"DDPKIT_TEST_HOSTS": "a,b"}) as pool:
        per_rank = pool.run(case_check_in_front, sorted(DISAGREEING_CALLS))
    for rank, out in enumerate(per_rank):
        assert len(out.pop("topology").hosts) == 2
        for kind, (error, untouched, total, crossed, scattered) in out.items():
            assert error is not None and "timed out" not in error, f"rank {rank}, {kind}: {error}"
            assert kind == "rejected" or "mismatched collectives" in error, f"rank {rank}, {kind}: {error}"
            assert untouched, f"rank {rank}, {kind}: the tensor changed"
            assert (total, crossed, scattered) == ([3.0], [1.5], [2.0]), f"rank {rank}, {kind}"
