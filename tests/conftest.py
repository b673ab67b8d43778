"""Shared fixtures: one pool of gloo worker processes per world size for the whole session."""

from pathlib import Path

import pytest

from ddpkit.testing import WorkerPool


def _ddpkit_segments() -> set:
    shm = Path("/dev/shm")
    return {p.name for p in shm.iterdir() if p.name.startswith("ddpkit-")} if shm.is_dir() else set()


@pytest.fixture(scope="session", autouse=True)
def no_shared_memory_left_behind():
    """After the whole suite (pools closed, killed ranks included) no ddpkit segment is in /dev/shm:
    names are unlinked as soon as every rank has mapped them (Note [Shared-memory segment])."""
    before = _ddpkit_segments()
    yield
    left = _ddpkit_segments() - before
    assert not left, f"shared-memory segments left in /dev/shm: {sorted(left)}"


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
