"""Groups spanning simulated hosts: topology, hierarchical collectives, the links' threads, and checks
and faults across hosts.

Real hosts are simulated with namespaces (ddpkit.testing.HostPool: a network and a mount namespace
per host, a private /dev/shm and hostname each, veth links to a bridge, one launcher per host); they
need root, as CI has. The broad matrix also runs inside an ordinary worker pool split into hosts by
DDPKIT_TEST_HOSTS (test_multihost_one_machine.py), which needs nothing. See Note [Topology] and Note
[Hierarchical collectives] in csrc/comm/.
"""

import functools
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

import ddpkit
from ddpkit.testing import HostPool, WorkerFailure, WorkerPool

from helpers import HOSTS_GROUP_TIMEOUT_S as GROUP_TIMEOUT_S
from helpers import (
    TOPOLOGIES,
    case_all_reduces,
    case_every_collective,
    case_mismatch,
    check_every_collective,
    ieee_extremum,
    needs_hosts,
    rank_input,
)


def case_die(victim, numel=100_000):
    rank = dist.get_rank()
    for iteration in range(10_000):
        if rank == victim and iteration == 20:
            os.kill(os.getpid(), signal.SIGKILL)
        ddpkit.all_reduce(torch.ones(numel))
    return None


# --- simulated hosts --------------------------------------------------------------------------------


# 2x1 (two hosts of one rank) takes the paths of 2x2's step across hosts and of 3x1's and 1+3's
# hosts of one rank: make test-full runs it.
@needs_hosts
@pytest.mark.parametrize(
    "name", [pytest.param(name, marks=pytest.mark.slow) if name == "2x1" else name for name in sorted(TOPOLOGIES)]
)
def test_every_collective_across_hosts_is_exact_with_identical_bits(hosts, name):
    per_rank = hosts(name).run(case_every_collective, [0, 1, 1001, 300_003], timeout=300)
    check_every_collective(per_rank, TOPOLOGIES[name])


@needs_hosts
def test_a_mismatch_on_another_host_raises_on_every_rank_of_every_host(hosts):
    world_size = sum(TOPOLOGIES["2x2"])
    outcomes = hosts("2x2").run(case_mismatch, 3)
    for error, after in outcomes:
        assert (
            error is not None
            and "ranks called mismatched collectives: rank 3 passed elements 1001, rank" in error
            and "passed elements 1000" in error
        ), error
        assert after == sum(range(world_size))


@needs_hosts
def test_a_rank_killed_on_one_host_is_reported_on_every_host():
    pool = HostPool([2, 2], group_timeout=GROUP_TIMEOUT_S)
    try:
        outcomes = pool.run(case_die, 2, return_exceptions=True, timeout=4 * GROUP_TIMEOUT_S)
    finally:
        pool.close()
    assert isinstance(outcomes[2], WorkerFailure)
    for rank in (0, 1, 3):
        assert isinstance(outcomes[rank], RuntimeError), f"rank {rank}: {outcomes[rank]!r}"
        # its host's other rank watches its pid, its partners lose their connection to it, and rank 0,
        # which gathers every rank's collective check, tells the others
        assert "rank 2" in str(outcomes[rank]), f"rank {rank}: {outcomes[rank]}"


@needs_hosts
def test_a_rank_killed_on_a_third_host_is_reported_by_both_others():
    # Note [One round across hosts]: the center of the check's round (rank 0) tells the partner still
    # waiting for its reply which rank failed.
    pool = HostPool([1, 1, 1], group_timeout=GROUP_TIMEOUT_S)
    try:
        outcomes = pool.run(case_die, 2, 1000, return_exceptions=True, timeout=4 * GROUP_TIMEOUT_S)
    finally:
        pool.close()
    assert isinstance(outcomes[2], WorkerFailure)
    for rank in (0, 1):
        assert isinstance(outcomes[rank], RuntimeError), f"rank {rank}: {outcomes[rank]!r}"
        assert "rank 2" in str(outcomes[rank]), f"rank {rank}: {outcomes[rank]}"


# DDPKIT_LINK_THREADS (the testing build's): every frame on the caller's thread, every exchange's
# sends on the links' sending thread, or its receives on their receiving thread too, whatever this
# machine's CPUs (Note [Threads of the links]).
THREADS = ("caller", "send", "both")


# Each way of moving the frames once, on a ring of three hosts and of four (every pair of them costs
# a pool of simulated hosts, which CI's time cannot hold).
@needs_hosts
@pytest.mark.parametrize(
    "ranks_per_host,threads",
    [([1, 1, 1], "send"), ([1, 1, 1, 1], "caller"), ([1, 1, 1, 1], "both")],
    ids=["3x1-send", "4x1-caller", "4x1-both"],
)
def test_a_rank_killed_in_the_middle_of_a_ring_step_is_named_on_every_host(ranks_per_host, threads):
    # Rank 1 dies as its second ring step across hosts starts (die_in_ring_step): its partners have
    # finished the first step with it. The ring's neighbours lose their connection to it (on the
    # links' threads where they move the frames); every other rank learns which rank failed, not a
    # timeout.
    env = {"DDPKIT_TEST_FAULT": "die_in_ring_step:1", "DDPKIT_LINK_THREADS": threads}
    pool = HostPool(ranks_per_host, group_timeout=GROUP_TIMEOUT_S, env=env)
    try:
        outcomes = pool.run(case_all_reduces, 3, 1_000_000, return_exceptions=True, timeout=4 * GROUP_TIMEOUT_S)
    finally:
        pool.close()
    assert isinstance(outcomes[1], WorkerFailure)
    for rank in [0, *range(2, len(ranks_per_host))]:
        assert isinstance(outcomes[rank], RuntimeError), f"rank {rank}: {outcomes[rank]!r}"
        assert "rank 1" in str(outcomes[rank]) and "timed out" not in str(outcomes[rank]).lower(), (
            f"rank {rank}: {outcomes[rank]}"
        )


def link_threads():
    """This process's threads of the links, by name (links/link_thread.cpp names them)."""
    names = []
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/comm") as comm:
            names.append(comm.read().strip())
    return {name: names.count(name) for name in ("ddpkit-send", "ddpkit-recv")}


def case_on_each_thread(numels, windowed_numel):
    """case_every_collective and compressed sums on a group per DDPKIT_LINK_THREADS setting, sums
    and a reduce-scatter whose ring steps receive through a window (Note [Receiving windows]) at
    ``windowed_numel`` (None: not): the caller's thread's results, the keys whose bits each other
    setting gives differently (compared here: the results of one setting travel to the parent, not
    three), and the threads of the links each group started."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    callers, differ, started = None, {}, {}
    for threads in THREADS:
        os.environ["DDPKIT_LINK_THREADS"] = threads
        before = link_threads()
        group = dist.new_group(backend="gloo")
        results = case_every_collective(numels, group)
        for numel in numels:
            tensor = rank_input(rank, numel)
            ddpkit.all_reduce(tensor, group=group, cross_host_dtype=torch.bfloat16)
            results[("compressed", numel)] = tensor
        if windowed_numel is not None:
            for dtype in (torch.float32, torch.int64):
                tensor = rank_input(rank, windowed_numel, integer=True).to(dtype)
                ddpkit.all_reduce(tensor, group=group)
                results[("all_reduce", str(dtype), windowed_numel, "sum", "windowed")] = tensor
            scattered = torch.empty(windowed_numel)
            ddpkit.reduce_scatter_tensor(
                scattered, rank_input(rank, world_size * windowed_numel, integer=True), group=group
            )
            results[("reduce_scatter", str(torch.float32), windowed_numel)] = scattered
        started[threads] = {name: count - before[name] for name, count in link_threads().items()}
        if callers is None:
            callers = results
        differ[threads] = [
            key
            for key, tensor in callers.items()
            if isinstance(tensor, torch.Tensor)
            and not (
                isinstance(results.get(key), torch.Tensor)
                and torch.equal(results[key].view(-1).view(torch.uint8), tensor.view(-1).view(torch.uint8))
            )
        ]
    del os.environ["DDPKIT_LINK_THREADS"]
    return callers, differ, started


@needs_hosts
@pytest.mark.parametrize("ranks_per_host", [[1, 1, 1], [2, 2]], ids=["3x1", "2x2"])
def test_the_links_threads_are_exact_and_give_the_callers_bits(ranks_per_host):
    # The ring (3x1, whose blocks of a third of 1,000,003 floats arrive through a window that wraps,
    # on the receiving thread too) and the swap (2x2, whose reductions wait for the frame sent to
    # the same peer, and whose frames stay whole), exact, and bit for bit what the caller's thread
    # alone gives, compressed sums included.
    windowed_numel = 1_000_003 if len(ranks_per_host) > 2 else None
    pool = HostPool(ranks_per_host, group_timeout=GROUP_TIMEOUT_S)
    try:
        per_rank = pool.run(case_on_each_thread, [1001, 300_003], windowed_numel, timeout=300)
    finally:
        pool.close()
    expected_started = {"caller": (0, 0), "send": (1, 0), "both": (1, 1)}
    for rank, (_, differ, started) in enumerate(per_rank):
        for threads in THREADS:
            count = started[threads]
            assert (count["ddpkit-send"], count["ddpkit-recv"]) == expected_started[threads], (rank, threads, count)
            assert differ[threads] == [], (
                f"rank {rank}: {threads} gives other bits than the caller's thread for {differ[threads]}"
            )
    # every setting's bits are the caller's: its results, exact, are every setting's
    check_every_collective(
        [{key: value for key, value in callers.items() if key[0] != "compressed"} for callers, _, _ in per_rank],
        ranks_per_host,
    )


def case_rank_2_stays_away(numel, away_s):
    """Rank 2 sleeps through a large all-reduce of the others, with checks off, so that the ring's
    data steps (not the check's round) wait for it; returns what the others raised. (Awake again,
    rank 2 waits for the pool's next task, its links open, until the others have raised.)"""
    ddpkit.set_collective_checks(False)
    ddpkit.all_reduce(torch.ones(4))  # the group's set-up, with every rank here
    if dist.get_rank() == 2:
        time.sleep(away_s)
        return None
    try:
        ddpkit.all_reduce(torch.ones(numel))
    except RuntimeError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("threads", THREADS)
def test_a_ring_step_waiting_out_a_rank_that_stays_away_names_it(threads):
    # Rank 1's frame to rank 2 is larger than the sockets hold, so its sending thread (where it sends
    # on one) is blocked in the middle of it when rank 1 gives up: the caller stops the threads and
    # names rank 2, as rank 0, whose receiving thread waits for rank 2's frame, does. Whichever of the
    # two gives up first tells the other (Note [News of a failure]): rank 1 reads rank 0's stream
    # all through the ring's one exchange (Note [A streaming ring]), so it may learn of rank 2 from
    # rank 0 before its own timeout.
    timeout_s = 3.0
    env = {"DDPKIT_TEST_HOSTS": "a,b,c", "DDPKIT_LINK_THREADS": threads}
    with WorkerPool(3, timeout=120, group_timeout=timeout_s, env=env) as pool:
        outcomes = pool.run(case_rank_2_stays_away, 12_000_000, timeout_s, return_exceptions=True)
    for rank in (0, 1):
        error = outcomes[rank]
        assert isinstance(error, str), f"rank {rank}: {error!r}"
        assert "waiting for rank 2" in error or f"rank 2 failed or died (rank {1 - rank} reported it)" in error, (
            f"rank {rank}: {error!r}"
        )


def case_swapped_blocks(numel):
    """Large all-reduces, reduce-scatters and reduces whose step across two hosts goes over the socket
    links (Note [Socket links]): random floats with NaNs and signed zeros on some ranks, and integers,
    for every op."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    out = {}
    for dtype in (torch.float32, torch.float64, torch.int32, torch.int64):
        ops = ("sum", "max", "min") + (("mean",) if dtype.is_floating_point else ())
        for op in ops:
            tensor = swap_input(rank, numel, dtype)
            ddpkit.all_reduce(tensor, op=op)
            out[("all_reduce", str(dtype), op)] = tensor
            scattered = torch.empty(numel, dtype=dtype)
            ddpkit.reduce_scatter_tensor(scattered, swap_input(rank, world_size * numel, dtype), op=op)
            out[("reduce_scatter", str(dtype), op)] = scattered
            tensor = swap_input(rank, numel, dtype)
            ddpkit.reduce(tensor, dst=world_size - 1, op=op)  # the root on the second host
            out[("reduce", str(dtype), op)] = tensor if rank == world_size - 1 else None
    return out


def swap_input(rank, numel, dtype):
    if not dtype.is_floating_point:
        return rank_input(rank, numel, integer=True).to(dtype)
    tensor = rank_input(rank, numel).to(dtype)
    tensor[rank::7] = float("nan")  # a NaN on one rank only, at places that differ by rank
    tensor[5::11] = 0.0 if rank % 2 else -0.0  # +0 against -0
    return tensor


@functools.cache
def swap_inputs(world_size, numel, dtype):
    """Every rank's swap_input, made once for all of a test's references (which never change them)."""
    return [swap_input(rank, numel, dtype) for rank in range(world_size)]


def swapped_reference(op, inputs):
    """Note [Reductions]'s result of `op` over `inputs`, in float64 for the sum and the mean."""
    if op in ("max", "min"):
        return ieee_extremum(inputs, op)
    expected = inputs[0].double()
    for other in inputs[1:]:
        expected = expected + other.double()
    return expected / len(inputs) if op == "mean" else expected


def assert_reduced_as_the_note_says(tensor, expected, op, what):
    if op in ("sum", "mean"):
        atol = 1e-6 if op == "mean" else 1e-5  # the sum of 4 ranks' N(0, 1) floats, then over 4
        torch.testing.assert_close(tensor.double(), expected, rtol=1e-6, atol=atol, equal_nan=True, msg=what)
        return
    floating = tensor.dtype.is_floating_point
    assert not floating or torch.equal(tensor.isnan(), expected.isnan()), what
    keep = ~tensor.isnan() if floating else torch.ones_like(tensor, dtype=torch.bool)
    assert torch.equal(tensor[keep].view(-1), expected[keep].view(-1)), what
    assert not floating or torch.equal(torch.signbit(tensor[keep]), torch.signbit(expected[keep])), what


@needs_hosts
@pytest.mark.parametrize("name", ["2x1", "2x2"])
def test_two_hosts_swap_large_blocks_with_every_op_and_identical_bits(hosts, name):
    numel = 100_003  # larger than one round across hosts carries, and odd
    per_rank = hosts(name).run(case_swapped_blocks, numel, timeout=300)
    world_size = len(per_rank)
    for (collective, dtype_name, op), tensor in per_rank[0].items():
        dtype = getattr(torch, dtype_name.split(".")[-1])
        what = f"{collective} {dtype_name} {op}"
        if collective == "all_reduce":
            expected = swapped_reference(op, swap_inputs(world_size, numel, dtype))
            assert_reduced_as_the_note_says(tensor, expected, op, what)
            for rank in range(1, world_size):
                theirs = per_rank[rank][(collective, dtype_name, op)]
                assert torch.equal(theirs.view(torch.uint8), tensor.view(torch.uint8)), (
                    f"{what}: rank {rank}'s bits differ from rank 0's"
                )
        elif collective == "reduce_scatter":
            expected = swapped_reference(op, swap_inputs(world_size, world_size * numel, dtype))
            for rank in range(world_size):
                assert_reduced_as_the_note_says(
                    per_rank[rank][(collective, dtype_name, op)],
                    expected[rank * numel : (rank + 1) * numel],
                    op,
                    f"{what} rank {rank}",
                )
        else:
            expected = swapped_reference(op, swap_inputs(world_size, numel, dtype))
            assert_reduced_as_the_note_says(per_rank[-1][(collective, dtype_name, op)], expected, op, what)


def case_all_reduce_sum(numel):
    tensor = torch.full((numel,), float(dist.get_rank() + 1))
    ddpkit.all_reduce(tensor)
    return tensor


@needs_hosts
def test_stray_connections_at_the_links_set_up_are_closed_and_the_ranks_still_link():
    # Note [Socket links]: rank 0 accepts rank 1's link; a connection naming rank 1 with a wrong token
    # and one sending junk come first (the fault stray_links), and must not take rank 1's place
    # (set-up also raises unless it rejected both).
    pool = HostPool([1, 1], group_timeout=GROUP_TIMEOUT_S, env={"DDPKIT_TEST_FAULT": "stray_links:0"})
    try:
        outcomes = pool.run(case_all_reduce_sum, 100_000)
    finally:
        pool.close()
    for tensor in outcomes:
        assert torch.equal(tensor, torch.full((100_000,), 3.0))


def all_reduce_on_two_hosts_with_fault(fault):
    """Each rank's outcome of one small all-reduce across 2 hosts x 1 rank with DDPKIT_TEST_FAULT set:
    the run's 40 s are shorter than the group's timeout (60 s), so a rank that waits it out fails."""
    pool = HostPool([1, 1], group_timeout=60.0, env={"DDPKIT_TEST_FAULT": fault})
    try:
        return pool.run(case_all_reduce_sum, 1000, return_exceptions=True, timeout=40)
    finally:
        pool.close()


@needs_hosts
def test_a_rank_that_cannot_listen_for_its_links_is_named_on_both_hosts_at_once():
    # Rank 1 fails before the set-up's all-gather of addresses (the fault links_cannot_listen): it
    # still joins it, announcing no address, so rank 0 raises naming it instead of waiting out the
    # group's timeout (60 s, beyond the run's 40).
    outcomes = all_reduce_on_two_hosts_with_fault("links_cannot_listen:1")
    assert isinstance(outcomes[1], RuntimeError) and "links_cannot_listen" in str(outcomes[1]), outcomes[1]
    assert isinstance(outcomes[0], RuntimeError) and "rank 1 could not listen" in str(outcomes[0]), outcomes[0]


@needs_hosts
def test_a_frame_of_another_collective_raises_on_both_hosts_at_once():
    # Rank 1's first frame over the links carries the previous collective's number (the fault
    # stale_link_frame): rank 0 must refuse it, not read it as this collective's, and rank 1 must
    # learn at once that rank 0 gave up, not at the group's timeout.
    outcomes = all_reduce_on_two_hosts_with_fault("stale_link_frame:1")
    assert isinstance(outcomes[0], RuntimeError) and "rank 1 sent a frame of collective" in str(outcomes[0]), outcomes[
        0
    ]
    assert isinstance(outcomes[1], RuntimeError) and "rank 0" in str(outcomes[1]), outcomes[1]


# --- what a collective across hosts must leave untouched --------------------------------------------


def case_half_precision_broadcast_bits(numel):
    """A float16 and a bfloat16 broadcast from the last rank of tensors holding arbitrary 16-bit
    patterns (NaNs with payloads and signs among them): every rank's bits afterwards, and the root's
    before."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    out = {}
    for dtype in (torch.float16, torch.bfloat16):
        generator = torch.Generator().manual_seed(7)
        bits = torch.randint(-(2**15), 2**15, (numel,), dtype=torch.int16, generator=generator)
        bits[:4] = torch.tensor([0x7FC1, -0x0001, 0x7E01, -0x003F], dtype=torch.int16)  # NaNs of both signs
        tensor = (bits if rank == world_size - 1 else torch.zeros_like(bits)).view(dtype)
        ddpkit.broadcast(tensor, src=world_size - 1)
        out[str(dtype)] = (tensor.view(torch.int16).clone(), bits)
    return out


@needs_hosts
@pytest.mark.parametrize("numel", [1001, 40_000])  # in the check's round; over the links (80 KB)
def test_a_half_precision_broadcast_across_hosts_moves_its_bits_unchanged(hosts, numel):
    # A broadcast reduces nothing: the root's bits, NaN payloads included, reach every rank, and the
    # root's own tensor keeps them (no float32 working copy on the way).
    for rank, out in enumerate(hosts("2x2").run(case_half_precision_broadcast_bits, numel)):
        for dtype, (received, sent) in out.items():
            assert torch.equal(received, sent), f"rank {rank}, {dtype}"
