"""The send buffers of ddpkit's links across hosts (Note [Send buffers] in csrc/comm/links/send_buffers.h).

First one machine split into hosts by DDPKIT_TEST_HOSTS: the links are the same TCP connections as
between real hosts, over a round trip of microseconds, and the kernel reports each socket's send
buffer. Then three simulated hosts behind a router that delays every packet (HostPool's
round_trip_ms): a long path, a short one that grows longer, and a rank that dies across it.
"""

import datetime
import importlib.util
import os
import signal
import socket
import time

import pytest
import torch
import torch.distributed as dist

import ddpkit
from ddpkit.testing import HostPool, WorkerFailure, WorkerPool

from helpers import HOSTS_GROUP_TIMEOUT_S, case_every_collective, check_every_collective, error_and_untouched

HOSTS = "a,b,c"
NUMEL = 300_000  # past the check's round: the ring's frames cross the links
SMALL_BUFFER = 256 << 10  # kLinkSendBufferBytes


def stream_send_buffers():
    """The send buffer the kernel books for each of this process's TCP sockets."""
    buffers = []
    for name in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=os.dup(int(name)))
        except OSError:
            continue
        with sock:
            if sock.type == socket.SOCK_STREAM and sock.family in (socket.AF_INET, socket.AF_INET6):
                buffers.append(sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF))
    return buffers


def booked(requested):
    """What the kernel books for a send buffer of `requested` bytes: twice it, capped at net.core.wmem_max."""
    with open("/proc/sys/net/core/wmem_max") as f:
        return 2 * min(requested, int(f.read()))


def case_sum_then_send_buffers(setting):
    """Sets DDPKIT_LINK_SEND_BUFFER (None: unset) before the links' set-up, all-reduces across the
    hosts, and returns the sum's correctness, the booked buffer the setting asks for, the send
    buffers of this rank's TCP sockets and what its links say they chose."""
    if setting is not None:
        os.environ["DDPKIT_LINK_SEND_BUFFER"] = setting
    tensor = torch.full((NUMEL,), float(dist.get_rank() + 1))
    ddpkit.all_reduce(tensor)
    size = dist.get_world_size()
    exact = torch.equal(tensor, torch.full((NUMEL,), float(size * (size + 1) // 2)))
    requested = SMALL_BUFFER if setting is None else int(setting)
    return exact, booked(requested), stream_send_buffers(), ddpkit.comm_counters()["links"]


def run_case(setting):
    with WorkerPool(3, timeout=120, group_timeout=60, env={"DDPKIT_TEST_HOSTS": HOSTS}) as pool:
        return pool.run(case_sum_then_send_buffers, setting, timeout=60)


def test_each_link_over_a_short_path_asks_for_the_small_send_buffer():
    # Each rank's two links (one to each other host) book the small buffer; gloo's own sockets are
    # left to the kernel.
    for rank, (exact, expected, buffers, links) in enumerate(run_case(None)):
        assert exact, f"rank {rank}"
        assert buffers.count(expected) == 2, f"rank {rank}: send buffers {buffers}, expected two of {expected}"
        assert sorted(link["peer"] for link in links) == [r for r in range(3) if r != rank], links
        for link in links:
            assert link["choice"] == "short path" and link["grown"] == 0, f"rank {rank}: {link}"
            assert link["requested_bytes"] == SMALL_BUFFER and link["send_buffer_bytes"] == expected, link


def test_ddpkit_link_send_buffer_sets_every_links_buffer():
    for rank, (exact, expected, buffers, links) in enumerate(run_case("300000")):
        assert exact, f"rank {rank}"
        assert buffers.count(expected) == 2, f"rank {rank}: send buffers {buffers}, expected two of {expected}"
        for link in links:
            assert link["choice"] == "DDPKIT_LINK_SEND_BUFFER" and link["requested_bytes"] == 300000, link


def case_rank_1_asks_for_a_bad_buffer():
    if dist.get_rank() == 1:
        os.environ["DDPKIT_LINK_SEND_BUFFER"] = "lots"
    try:
        ddpkit.all_reduce(torch.ones(NUMEL))
    except RuntimeError as error:
        return str(error)
    return None


def test_a_send_buffer_that_is_not_a_number_raises_on_every_host():
    with WorkerPool(3, timeout=120, group_timeout=60, env={"DDPKIT_TEST_HOSTS": HOSTS}) as pool:
        outcomes = pool.run(case_rank_1_asks_for_a_bad_buffer, timeout=60)
    assert "DDPKIT_LINK_SEND_BUFFER=lots is not a number of bytes" in (outcomes[1] or ""), outcomes[1]
    for rank in (0, 2):
        assert "rank 1 could not listen" in (outcomes[rank] or ""), f"rank {rank}: {outcomes[rank]}"


def test_the_set_up_keeps_the_small_buffer_only_where_it_holds_the_path():
    # 10 Gbit/s: the small buffer holds about 200 us of it; 100 Gbit/s across 50 us wants more.
    assert ddpkit.comm.choose_send_buffer(100, 10**10) == "short path"
    assert ddpkit.comm.choose_send_buffer(1000, 10**10) == "long path"
    assert ddpkit.comm.choose_send_buffer(10_000, 10**9) == "long path"
    assert ddpkit.comm.choose_send_buffer(50, 10**11) == "long path"
    with pytest.raises(RuntimeError, match="the rate > 0"):
        ddpkit.comm.choose_send_buffer(100, 0)


# --- a delayed path: simulated hosts behind a router that holds every packet (HostPool's round_trip_ms) ----

ROUND_TRIP_MS = 4.0
GROWN_ROUND_TRIP_MS = 20.0
needs_delayed_hosts = pytest.mark.skipif(
    HostPool.unavailable(delayed=True) is not None, reason=str(HostPool.unavailable(delayed=True))
)


@pytest.fixture(scope="module")
def delayed():
    """Three simulated hosts of one rank, every packet between two of them delayed ROUND_TRIP_MS / 2.
    The tests below share it in order; the last kills a rank."""
    pool = HostPool([1, 1, 1], group_timeout=HOSTS_GROUP_TIMEOUT_S, round_trip_ms=ROUND_TRIP_MS)
    yield pool
    pool.close()


def case_fastest_small_all_reduce(calls):
    tensor = torch.ones(1)
    fastest = float("inf")
    for _ in range(calls):
        start = time.perf_counter()
        dist.all_reduce(tensor)
        fastest = min(fastest, time.perf_counter() - start)
    return fastest


@needs_delayed_hosts
def test_a_delayed_pool_takes_at_least_its_round_trip(delayed):
    # gloo's all-reduce of one float across three hosts needs a round trip at least: a bound the
    # delay sets, which no load on this machine can undercut.
    for rank, fastest in enumerate(delayed.run(case_fastest_small_all_reduce, 5)):
        assert fastest >= ROUND_TRIP_MS / 1e3, f"rank {rank}: {fastest * 1e3:.2f} ms"


def case_small_messages_and_a_torchft_quorum(store_prefix):
    """Collectives whose messages each fit one segment longer than an Ethernet frame (the check's
    round of ddpkit.all_reduce, gloo's ring), and, where torchft is installed, a quorum's
    ProcessGroupDdpkit as torchft's manager configures it (on the pool's store) all-reducing a small
    and a large vector: whether every sum was exact and what the group reported."""
    size = dist.get_world_size()
    outcomes = {}
    for name, numel, reduce in (("ddpkit, one round", 1024, ddpkit.all_reduce), ("gloo", 4096, dist.all_reduce)):
        tensor = torch.full((numel,), float(dist.get_rank() + 1))
        reduce(tensor)
        outcomes[name] = torch.equal(tensor, torch.full((numel,), float(size * (size + 1) // 2)))
    if importlib.util.find_spec("torchft") is None:
        return outcomes
    from ddpkit.torchft import ProcessGroupDdpkit

    pg = ProcessGroupDdpkit(timeout=datetime.timedelta(seconds=HOSTS_GROUP_TIMEOUT_S))
    store = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}/{store_prefix}"
    pg.configure(store, f"replica_{dist.get_rank()}", dist.get_rank(), size)
    try:
        for numel in (1024, NUMEL):
            tensor = torch.full((numel,), float(dist.get_rank() + 1))
            pg.allreduce([tensor], dist.AllreduceOptions()).wait()
            outcomes[f"torchft, {numel}"] = torch.equal(tensor, torch.full((numel,), float(size * (size + 1) // 2)))
        outcomes["torchft errored"] = pg.errored()
    finally:
        pg.shutdown()
    return outcomes


@needs_delayed_hosts
def test_small_messages_and_torchft_quorums_cross_a_delayed_path(delayed):
    # A message of a few KiB leaves a host as one segment longer than 1500 bytes: every link of the
    # path must carry the routed MTU, or it is lost on every retransmission (torchft's quorums on
    # ProcessGroupDdpkit never committed a step across delayed links, their first bucket's all-reduce
    # riding the check's round). Bulk transfers pass either way, as offload bursts.
    for rank, outcomes in enumerate(delayed.run(case_small_messages_and_a_torchft_quorum, "small-messages")):
        assert outcomes.pop("torchft errored", None) is None, f"rank {rank}: {outcomes}"
        assert outcomes and all(outcomes.values()), f"rank {rank}: {outcomes}"


def exact_all_reduces(numel, times, group=None, until=None):
    """`times` all-reduces of `numel` floats across the hosts (fewer where `until()` comes true
    first); whether every sum was exact."""
    size = dist.get_world_size(group)
    exact = True
    for _ in range(times):
        tensor = torch.arange(numel, dtype=torch.float32) + dist.get_rank(group)
        ddpkit.all_reduce(tensor, group=group)
        exact &= torch.equal(tensor, torch.arange(numel, dtype=torch.float32) * size + size * (size - 1) // 2)
        if until is not None and until():
            break
    return exact


def case_links_of_a_new_group(numel, times):
    """Links made now, for a new group of every rank (kept for the next case), after `times` all-reduces
    of `numel` floats on it: whether they were exact, and what the new links chose."""
    global GROUP
    before = len(ddpkit.comm_counters()["links"])
    GROUP = dist.new_group(backend="gloo")
    exact = exact_all_reduces(numel, times, GROUP)
    return exact, ddpkit.comm_counters()["links"][before:]


@needs_delayed_hosts
def test_links_across_a_long_path_leave_their_buffer_to_the_kernel_and_stay_exact(delayed):
    # The kernel grows the buffer of the link each rank sends its ring steps on past the small one;
    # the link it only receives on sends too little to grow.
    for rank, (exact, links) in enumerate(delayed.run(case_links_of_a_new_group, 1_000_000, 2)):
        assert exact, f"rank {rank}"
        assert len(links) == 2, links
        for link in links:
            assert link["choice"] == "long path" and link["requested_bytes"] == 0, f"rank {rank}: {link}"
            assert link["round_trip_us"] >= ROUND_TRIP_MS * 1e3, f"rank {rank}: {link}"
        assert max(link["send_buffer_bytes"] for link in links) > booked(SMALL_BUFFER), f"rank {rank}: {links}"


def case_a_short_path_that_grows_longer(numel, times):
    """The last case's group's links after up to `times` all-reduces of `numel` floats, stopping once
    a link of this rank has grown: whether they were exact, and what the links chose."""

    def links():
        return ddpkit.comm_counters()["links"][-2:]  # the last group's, made last

    exact = exact_all_reduces(numel, times, GROUP, until=lambda: any(link["grown"] for link in links()))
    return exact, links()


def set_min_rtt_window(seconds):
    """TCP's smallest round trip forgets samples older than this (net.ipv4.tcp_min_rtt_wlen, this
    host's network namespace): a path that grows longer shows after it, not after five minutes."""
    with open("/proc/sys/net/ipv4/tcp_min_rtt_wlen", "w") as f:
        f.write(str(seconds))


@needs_delayed_hosts
def test_a_short_path_keeps_the_small_buffer_and_grows_it_once_the_path_is_long(delayed):
    # Undelayed (through the same router), the links of a new group keep the small buffer, also
    # through large all-reduces; once the path's round trip grows, large all-reduces find the buffer
    # holding each rank's sending link back, and it grows. The sums stay exact throughout.
    delayed.run(set_min_rtt_window, 1)
    delayed.set_round_trip(0)
    try:
        for rank, (exact, links) in enumerate(delayed.run(case_links_of_a_new_group, 1_000_000, 2)):
            assert exact, f"rank {rank}"
            for link in links:
                assert link["choice"] == "short path" and link["grown"] == 0, f"rank {rank}: {link}"
                assert link["send_buffer_bytes"] == booked(SMALL_BUFFER), f"rank {rank}: {link}"
        delayed.set_round_trip(GROWN_ROUND_TRIP_MS)
        time.sleep(1.2)  # past the window: the smallest round trip is now the long path's
        for rank, (exact, links) in enumerate(delayed.run(case_a_short_path_that_grows_longer, 1_000_000, 6)):
            assert exact, f"rank {rank}"
            grown = [link for link in links if link["grown"]]
            assert grown, f"rank {rank}: {links}"
            for link in grown:
                assert link["choice"] == "grown" and link["requested_bytes"] >= 2 * SMALL_BUFFER, link
                assert link["send_buffer_bytes"] > booked(SMALL_BUFFER), link
    finally:
        delayed.set_round_trip(ROUND_TRIP_MS)


RING_NUMEL = 4_500_000  # past kTwoShotsMaxBytes: the ring, its check crossing alone first

# Rank 1's call against the others', each disagreeing: in front of the first of two shots against
# in front of its own (another size), against the check's round among every partner (a small call, a
# broadcast), and crossing alone (an empty one, one that takes the ring).
DISAGREEING_ON_LONG_PATHS = {
    "sizes": lambda t: ddpkit.all_reduce(torch.ones(NUMEL + 1)),
    "small": lambda t: ddpkit.all_reduce(torch.ones(1000)),
    "broadcast": lambda t: ddpkit.broadcast(t, src=1),
    "empty": lambda t: ddpkit.all_reduce(torch.ones(0)),
    "ring": lambda t: ddpkit.all_reduce(torch.ones(RING_NUMEL)),
}


def case_long_paths(numels, kinds):
    """Every collective across the long paths (case_every_collective), then per kind of
    DISAGREEING_ON_LONG_PATHS: this rank's error, whether its tensor kept its values, and the sum of
    the group's next all-reduce."""
    rank = dist.get_rank()
    out = {"every": case_every_collective(numels)}
    ring = {"crossed": torch.full((NUMEL,), float(rank + 1)), "large": torch.full((RING_NUMEL,), float(rank + 1))}
    ddpkit.all_reduce(ring["crossed"], cross_host_dtype=torch.bfloat16)  # the compressed crossing keeps the ring
    ddpkit.all_reduce(ring["large"])
    out["on_the_ring"] = [tensor.unique().tolist() for tensor in ring.values()]
    for kind in kinds:
        error, untouched = error_and_untouched(
            DISAGREEING_ON_LONG_PATHS[kind] if rank == 1 else ddpkit.all_reduce, NUMEL
        )
        after = torch.full((NUMEL,), float(rank + 1))
        ddpkit.all_reduce(after)
        out[kind] = (error, untouched, after.unique().tolist())
    return out


@needs_delayed_hosts
def test_collectives_across_long_paths_take_two_shots_exactly_and_raise_alike(delayed):
    # Note [Two shots across hosts] and Note [A check in front of the swap] among three hosts: every
    # collective exact with the same bits on every rank; a disagreement raises on every rank, whichever
    # way each call checks, moves nothing into a tensor, and leaves the stream in step.
    per_rank = delayed.run(case_long_paths, [0, 1, 1001, 300_003], sorted(DISAGREEING_ON_LONG_PATHS), timeout=300)
    check_every_collective([out.pop("every") for out in per_rank], [1, 1, 1])
    for rank, out in enumerate(per_rank):
        assert out.pop("on_the_ring") == [[6.0], [6.0]], f"rank {rank}"
        for kind, (error, untouched, after) in out.items():
            assert error is not None and "mismatched collectives" in error, f"rank {rank}, {kind}: {error}"
            assert untouched, f"rank {rank}, {kind}: the tensor changed"
            assert after == [6.0], f"rank {rank}, {kind}: {after}"


def case_rank_1_dies_in_large_all_reduces():
    for iteration in range(1000):
        if dist.get_rank() == 1 and iteration == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        ddpkit.all_reduce(torch.ones(1_000_000))


@needs_delayed_hosts
def test_a_rank_that_dies_across_a_delayed_path_is_named_on_every_host(delayed):
    outcomes = delayed.run(
        case_rank_1_dies_in_large_all_reduces, return_exceptions=True, timeout=4 * HOSTS_GROUP_TIMEOUT_S
    )
    assert isinstance(outcomes[1], WorkerFailure)
    for rank in (0, 2):
        assert isinstance(outcomes[rank], RuntimeError), f"rank {rank}: {outcomes[rank]!r}"
        assert "rank 1" in str(outcomes[rank]) and "timed out" not in str(outcomes[rank]).lower(), (
            f"rank {rank}: {outcomes[rank]}"
        )
