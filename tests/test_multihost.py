"""Groups spanning hosts: topology, hierarchical collectives, checks and faults across hosts.

Real hosts are simulated with namespaces (ddpkit.testing.HostPool: a network and a mount namespace
per host, a private /dev/shm and hostname each, veth links to a bridge, one launcher per host); they
need root, as CI has. The broad matrix also runs inside an ordinary worker pool split into hosts by
DDPKIT_TEST_HOSTS (csrc/comm/faults.h), which needs nothing. See Note [Topology] and Note
[Hierarchical collectives] in csrc/comm/.
"""

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

import ddpkit
from ddpkit.testing import HostPool, WorkerFailure, WorkerPool

from helpers import (
    BACKEND_ONE_RANK_REJECTS,
    ONE_RANK_REJECTS,
    TOPOLOGIES,
    call_each_then_all_reduce,
    ieee_extremum,
    needs_hosts,
    rank_input,
)
from helpers import HOSTS_GROUP_TIMEOUT_S as GROUP_TIMEOUT_S

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64)


def expected_hosts(ranks_per_host):
    hosts, first = [], 0
    for count in ranks_per_host:
        hosts.append(tuple(range(first, first + count)))
        first += count
    return tuple(hosts)


# --- cases run on every rank ----------------------------------------------------------------------


def case_every_collective(numels, group=None):
    """Every collective, dtype and size; integer-valued inputs, so that every result is exact."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    on = {"group": group}
    out = {"topology": ddpkit.comm.topology(group)}
    for dtype in DTYPES:
        ops = ("sum", "max", "min") + (("mean",) if dtype.is_floating_point else ())
        sizes = numels if dtype == torch.float32 else numels[:3]
        for numel in sizes:
            for op in ops:
                for algorithm in ("auto", "ring"):
                    tensor = rank_input(rank, numel, integer=True).to(dtype)
                    ddpkit.all_reduce(tensor, op=op, algorithm=algorithm, **on)
                    out[("all_reduce", str(dtype), numel, op, algorithm)] = tensor
            for root in (0, world_size - 1):
                tensor = rank_input(rank, numel, integer=True).to(dtype)
                ddpkit.broadcast(tensor, src=root, **on)
                out[("broadcast", str(dtype), numel, root)] = tensor
                tensor = rank_input(rank, numel, integer=True).to(dtype)
                ddpkit.reduce(tensor, dst=root, **on)
                out[("reduce", str(dtype), numel, root)] = tensor if rank == root else None
            gathered = torch.empty(world_size * numel, dtype=dtype)
            ddpkit.all_gather_into_tensor(gathered, rank_input(rank, numel, integer=True).to(dtype), **on)
            out[("all_gather", str(dtype), numel)] = gathered
            scattered = torch.empty(numel, dtype=dtype)
            ddpkit.reduce_scatter_tensor(scattered, rank_input(rank, world_size * numel, integer=True).to(dtype), **on)
            out[("reduce_scatter", str(dtype), numel)] = scattered
    ddpkit.barrier(**on)
    return out


def reference_of(key, world_size):
    kind, dtype_name, numel = key[0], key[1], key[2]
    dtype = next(d for d in DTYPES if str(d) == dtype_name)
    inputs = torch.stack([rank_input(r, numel, integer=True).to(dtype).double() for r in range(world_size)])
    if kind == "all_reduce":
        op = key[3]
        reduced = {"sum": inputs.sum(0), "max": inputs.amax(0), "min": inputs.amin(0), "mean": inputs.mean(0)}[op]
        return reduced.to(dtype)
    if kind == "broadcast":
        return inputs[key[3]].to(dtype)
    if kind == "reduce":
        return inputs.sum(0).to(dtype)
    if kind == "all_gather":
        return inputs.reshape(-1).to(dtype)
    raise KeyError(kind)


def check_every_collective(per_rank, ranks_per_host):
    world_size = len(per_rank)
    for rank, out in enumerate(per_rank):
        assert out["topology"].hosts == expected_hosts(ranks_per_host), out["topology"]
        for key, tensor in out.items():
            if key == "topology" or tensor is None:
                continue
            if key[0] == "reduce_scatter":
                numel, dtype = key[2], next(d for d in DTYPES if str(d) == key[1])
                inputs = torch.stack(
                    [rank_input(r, world_size * numel, integer=True).to(dtype).double() for r in range(world_size)]
                )
                expected = inputs.sum(0)[rank * numel : (rank + 1) * numel].to(dtype)
            else:
                expected = reference_of(key, world_size)
            if key[0] == "all_reduce" and key[3] == "mean" and key[1] in (str(torch.float16), str(torch.bfloat16)):
                torch.testing.assert_close(tensor, expected, rtol=1e-2, atol=1e-2, msg=str(key))
            elif key[0] == "all_reduce" and key[3] == "mean":
                torch.testing.assert_close(tensor, expected, rtol=1e-6, atol=1e-5, msg=str(key))
            else:
                assert torch.equal(tensor, expected), (rank, key)
            if key[0] in ("all_reduce", "broadcast", "all_gather"):
                assert torch.equal(tensor.view(-1).view(torch.uint8), per_rank[0][key].view(-1).view(torch.uint8)), (
                    f"{key}: rank {rank}'s bits differ from rank 0's"
                )


def case_mismatch(culprit, collective="all_reduce"):
    """Rank ``culprit`` calls ``collective`` with another size (another root for broadcast and
    reduce; the broadcast's on the last host, so that the ranks disagree on the root's host): this
    rank's error, or None, then the group's next all-reduce."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    odd = rank == culprit
    try:
        if collective == "all_reduce":
            ddpkit.all_reduce(torch.ones(1000 + odd))
        elif collective == "broadcast":
            ddpkit.broadcast(torch.ones(10), src=world_size - 1 if odd else 0)
        elif collective == "reduce":
            ddpkit.reduce(torch.ones(10), dst=1 if odd else 0)
        elif collective == "all_gather":
            ddpkit.all_gather_into_tensor(torch.empty(world_size * (10 + odd)), torch.ones(10 + odd))
        else:
            ddpkit.reduce_scatter_tensor(torch.empty(10 + odd), torch.ones(world_size * (10 + odd)))
        error = None
    except RuntimeError as exc:
        error = str(exc)
    after = torch.full((10_000,), float(rank))
    ddpkit.all_reduce(after)  # the group survives a detected mismatch
    return error, after[0].item()


def case_die(victim, numel=100_000):
    rank = dist.get_rank()
    for iteration in range(10_000):
        if rank == victim and iteration == 20:
            os.kill(os.getpid(), signal.SIGKILL)
        ddpkit.all_reduce(torch.ones(numel))
    return None


# --- simulated hosts --------------------------------------------------------------------------------


@needs_hosts
@pytest.mark.parametrize("name", sorted(TOPOLOGIES))
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


@needs_hosts
@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("ranks_per_host", [[1, 1, 1], [1, 1, 1, 1]], ids=["3x1", "4x1"])
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
    """This process's threads of the links, by name (link_thread.cpp names them)."""
    names = []
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/comm") as comm:
            names.append(comm.read().strip())
    return {name: names.count(name) for name in ("ddpkit-send", "ddpkit-recv")}


def case_on_each_thread(numels, windowed_numel):
    """case_every_collective and compressed sums on a group per DDPKIT_LINK_THREADS setting, sums
    and a reduce-scatter whose ring steps receive through a window (Note [Receiving windows]) at
    ``windowed_numel`` (None: not), and the threads of the links each group started."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    out = {}
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
        results["started"] = {name: count - before[name] for name, count in link_threads().items()}
        out[threads] = results
    del os.environ["DDPKIT_LINK_THREADS"]
    return out


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
    started = {"caller": (0, 0), "send": (1, 0), "both": (1, 1)}
    for rank, out in enumerate(per_rank):
        for threads in THREADS:
            count = out[threads].pop("started")
            assert (count["ddpkit-send"], count["ddpkit-recv"]) == started[threads], (rank, threads, count)
            for key, tensor in out["caller"].items():
                if isinstance(tensor, torch.Tensor):
                    theirs = out[threads][key].view(-1).view(torch.uint8)
                    assert torch.equal(theirs, tensor.view(-1).view(torch.uint8)), (rank, threads, key)
    check_every_collective(
        [{key: value for key, value in out["both"].items() if key[0] != "compressed"} for out in per_rank],
        ranks_per_host,
    )


def case_rank_2_stays_away(numel, away_s):
    """Rank 2 sleeps through a large all-reduce of the others, with checks off, so that the ring's
    data steps (not the check's round) wait for it; returns what the others raised."""
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
    # names rank 2, as rank 0, whose receiving thread waits for rank 2's frame, does.
    timeout_s = 3.0
    env = {"DDPKIT_TEST_HOSTS": "a,b,c", "DDPKIT_LINK_THREADS": threads}
    with WorkerPool(3, timeout=120, group_timeout=timeout_s, env=env) as pool:
        outcomes = pool.run(case_rank_2_stays_away, 12_000_000, 3 * timeout_s, return_exceptions=True)
    for rank in (0, 1):
        error = outcomes[rank]
        assert isinstance(error, str) and "waiting for rank 2" in error, f"rank {rank}: {error!r}"


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
            expected = swapped_reference(op, [swap_input(r, numel, dtype) for r in range(world_size)])
            assert_reduced_as_the_note_says(tensor, expected, op, what)
            for rank in range(1, world_size):
                theirs = per_rank[rank][(collective, dtype_name, op)]
                assert torch.equal(theirs.view(torch.uint8), tensor.view(torch.uint8)), (
                    f"{what}: rank {rank}'s bits differ from rank 0's"
                )
        elif collective == "reduce_scatter":
            expected = swapped_reference(op, [swap_input(r, world_size * numel, dtype) for r in range(world_size)])
            for rank in range(world_size):
                assert_reduced_as_the_note_says(
                    per_rank[rank][(collective, dtype_name, op)],
                    expected[rank * numel : (rank + 1) * numel],
                    op,
                    f"{what} rank {rank}",
                )
        else:
            expected = swapped_reference(op, [swap_input(r, numel, dtype) for r in range(world_size)])
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


# --- one machine split by DDPKIT_TEST_HOSTS -----------------------------------------------------------


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


def case_all_reduces(count=5, numel=1000):
    for _ in range(count):
        ddpkit.all_reduce(torch.ones(numel))


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
