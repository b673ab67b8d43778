"""Shared fixtures: one pool of gloo worker processes per world size for the whole session."""

import pytest

from ddpkit.launch import WorkerPool


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
