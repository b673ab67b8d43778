"""Shared fixtures: one pool of gloo worker processes per world size for the whole session, pools of
simulated hosts per module, and the check that the session leaves nothing behind."""

import os
from pathlib import Path

import pytest

from ddpkit.testing import HostPool, WorkerPool

from helpers import HOSTS_GROUP_TIMEOUT_S, TOPOLOGIES, ProgramForker, shm_names

# torchft's Rust side logs at INFO to stderr from its own threads (the lighthouse's quorum ticks), also between
# tests, where pytest captures nothing: its lines landed among pytest's progress. It reads RUST_LOG when
# torchft is imported; warnings and errors still show.
os.environ.setdefault("RUST_LOG", "warn")

# Processes of this session (this pytest and everything it started), seen so far: what a leftover
# must come from to count as this session's, so that another job on the host never fails the suite.
_SESSION_PIDS: set = set()


def _descendants(pid: int) -> set:
    found, stack = set(), [pid]
    while stack:
        parent = stack.pop()
        try:
            tasks = list(Path(f"/proc/{parent}/task").iterdir())
        except OSError:
            continue
        for task in tasks:
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            for child in children:
                if child not in found:
                    found.add(child)
                    stack.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        state = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("State:"))
    except (OSError, StopIteration):
        return False
    return "zombie" not in state


@pytest.fixture(autouse=True)
def _record_session_processes():
    yield
    _SESSION_PIDS.update(_descendants(os.getpid()))


@pytest.fixture(scope="session", autouse=True)
def nothing_left_behind():
    """After the whole suite (pools closed, killed ranks included): no process this session started is
    still running (the multiprocessing helpers excepted), and no shared-memory name a process of this
    session created is in /dev/shm. Only this session's: another job on the host never fails it."""
    _SESSION_PIDS.add(os.getpid())
    yield
    helpers = ("multiprocessing.forkserver", "multiprocessing.resource_tracker")
    left = []
    for pid in _descendants(os.getpid()):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if _alive(pid) and not any(helper in command for helper in helpers):
            left.append((pid, command[:160]))
    assert not left, f"processes this session started are still running: {left}"
    named = shm_names(_SESSION_PIDS | _descendants(os.getpid()))
    assert not named, f"shared-memory names this session created are in /dev/shm: {sorted(named)}"


@pytest.fixture(scope="session")
def pool():
    """``pool(n)`` returns a live ``WorkerPool`` of n gloo ranks, started on first use.

    A case that fails kills its pool; the next ``pool(n)`` call starts a fresh one.
    """
    pools: dict[int, WorkerPool] = {}

    def get(world_size: int, group_timeout: float = 30.0) -> WorkerPool:
        key = world_size
        if key not in pools:
            pools[key] = WorkerPool(world_size, timeout=180.0, group_timeout=group_timeout)
        return pools[key]

    yield get
    for worker_pool in pools.values():
        worker_pool.close()


@pytest.fixture(scope="module")
def pools():
    """``pools(backend, n, group_timeout=30, **env)``: a live WorkerPool of n ranks whose world group is
    ``backend`` (one per backend, world size, group timeout and environment), made on first use in a module
    and closed at its end. A case that fails kills its pool; the next call starts a fresh one."""
    made = {}

    def get(backend, world_size, group_timeout=30.0, **env):
        key = (backend, world_size, group_timeout, tuple(sorted(env.items())))
        if key not in made:
            made[key] = WorkerPool(world_size, backend=backend, timeout=60.0, group_timeout=group_timeout, env=env)
        return made[key]

    yield get
    for worker_pool in made.values():
        worker_pool.close()


@pytest.fixture(scope="module")
def programs(tmp_path_factory):
    """A ProgramForker for the module: ``programs.run(argv, ...)`` runs a program as a fresh interpreter would."""
    forker = ProgramForker(tmp_path_factory.mktemp("programs"))
    yield forker
    forker.close()


@pytest.fixture(scope="module")
def hosts():
    """``hosts(name, backend="gloo")``: a live HostPool of the topology ``name`` (TOPOLOGIES), made on
    first use in a module and closed at its end (a pool of simulated hosts holds a launcher and ranks
    per host); then every host's private /dev/shm must be empty (what shm_names checks on this
    machine, made stricter: a host's /dev/shm holds nothing but what its ranks left)."""
    pools = {}

    def get(name, backend="gloo"):
        key = (name, backend)
        if key not in pools:
            pools[key] = HostPool(TOPOLOGIES[name], backend=backend, group_timeout=HOSTS_GROUP_TIMEOUT_S)
        return pools[key]

    yield get
    for pool in pools.values():
        pool.close()
        assert all(left == [] for left in pool.leftovers.values()), f"left in /dev/shm: {pool.leftovers}"
