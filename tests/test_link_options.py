"""The socket options of ddpkit's links across hosts (Note [Send buffers] in csrc/comm/links/socket_links.h).

One machine split into hosts by DDPKIT_TEST_HOSTS: the links are the same TCP connections as between
real hosts, and the kernel reports each socket's send buffer.
"""

import os
import socket
import time

import pytest
import torch
import torch.distributed as dist

import ddpkit
from ddpkit.testing import HostPool, WorkerPool

from helpers import HOSTS_GROUP_TIMEOUT_S

HOSTS = "a,b,c"
NUMEL = 300_000  # past the check's round: the ring's frames cross the links


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


def case_sum_then_send_buffers(setting):
    """Sets DDPKIT_LINK_SEND_BUFFER (None: unset) before the links' set-up, all-reduces across the
    hosts, and returns the sum's correctness, the booked buffer the setting asks for (the kernel books
    twice the request, capped at net.core.wmem_max) and the send buffers of this rank's TCP sockets."""
    if setting is not None:
        os.environ["DDPKIT_LINK_SEND_BUFFER"] = setting
    tensor = torch.full((NUMEL,), float(dist.get_rank() + 1))
    ddpkit.all_reduce(tensor)
    size = dist.get_world_size()
    exact = torch.equal(tensor, torch.full((NUMEL,), float(size * (size + 1) // 2)))
    with open("/proc/sys/net/core/wmem_max") as f:
        cap = int(f.read())
    requested = 256 << 10 if setting is None else int(setting)
    return exact, 2 * min(requested, cap), stream_send_buffers()


def run_case(setting):
    with WorkerPool(3, timeout=120, group_timeout=60, env={"DDPKIT_TEST_HOSTS": HOSTS}) as pool:
        return pool.run(case_sum_then_send_buffers, setting, timeout=60)


def test_each_link_asks_for_a_small_send_buffer_by_default():
    # Each rank's two links (one to each other host) book the buffer the Note chooses; gloo's own
    # sockets are left to the kernel.
    for rank, (exact, booked, buffers) in enumerate(run_case(None)):
        assert exact, f"rank {rank}"
        assert buffers.count(booked) == 2, f"rank {rank}: send buffers {buffers}, expected two of {booked}"


def test_ddpkit_link_send_buffer_sets_the_links_buffer():
    for rank, (exact, booked, buffers) in enumerate(run_case("300000")):
        assert exact, f"rank {rank}"
        assert buffers.count(booked) == 2, f"rank {rank}: send buffers {buffers}, expected two of {booked}"


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


# --- a delayed path: simulated hosts behind a router that holds every packet (HostPool's round_trip_ms) ----

ROUND_TRIP_MS = 4.0
needs_delayed_hosts = pytest.mark.skipif(
    HostPool.unavailable(delayed=True) is not None, reason=str(HostPool.unavailable(delayed=True))
)


@pytest.fixture(scope="module")
def delayed():
    """Three simulated hosts of one rank, every packet between two of them delayed ROUND_TRIP_MS / 2."""
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
