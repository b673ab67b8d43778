"""torch's own distributed test suite, at a backend chosen by the environment (issue 25, item 5).

    BACKEND=ddpkit python -m pytest tests/torch_suite.py -k test_all_reduce_sum      # one test, on ddpkit
    BACKEND=gloo   python -m pytest tests/torch_suite.py                             # all of it, on gloo
    python scripts/run_torch_suite.py                     # both backends, the table of differences

``torch.testing._internal.distributed.distributed_test`` (shipped in the wheel) defines the suite as
``DistributedTest._DistTestBase`` over ``TestDistBackend``; torch runs it through
``test/distributed/test_distributed_spawn.py``, which the wheel lacks. ``TestDistBackendWithFork``
below is that runner, with forked rather than spawned ranks (this process has imported torch and
ddpkit already, so a rank starts in milliseconds instead of seconds).

Environment (read once, at import): ``BACKEND`` (default ``ddpkit``), ``WORLD_SIZE`` (default 2),
``DISTRIBUTED_TESTS_DEFAULT_TIMEOUT`` (seconds a test may take before its ranks are killed; default
here 120, torch's 300), ``INIT_METHOD`` (default a ``file://`` in a fresh temporary folder: torch runs the
suite at both ``env://`` and ``file://``, and one test, ``test_barrier_timeout_global``, runs only at
``file://``). ``TestDistBackend.setUp`` makes the rest (``TEMP_DIR`` with its ``barrier``
folder, ``INIT_METHOD``) for every test.

The suite gates many tests on the backend's name. So that "ddpkit" runs every test gloo runs:
  * "ddpkit" joins ``DistTestCases.backend_feature["plugin"]``, ``["ddp"]`` and ``["subgroup"]``
    before the suite's classes are built (their decorators read the sets then);
  * the suite's module constant ``BACKEND`` is, for "ddpkit", a ``GlooAlike`` string: its text is
    "ddpkit" (``str()``, ``.lower()``, what ``init_process_group`` and ``new_group`` get through
    ``dist.Backend``) but it compares and hashes as "gloo", so the literal gates ``BACKEND == "gloo"``,
    ``BACKEND != "gloo"``, ``BACKEND in [...]`` and ``require_backend_is_available({"gloo"})`` (timeouts,
    monitored barrier, coalesced all-reduce, object collectives, sparse all-reduce, gloo's batched
    send/recv, the gloo-only branches inside tests) treat ddpkit as the drop-in for gloo it claims to
    be. The constant is read from ``os.environ`` while the module executes, so ``os.environ``'s class
    is swapped for that one import (nothing of torch's files is edited).
"""

from __future__ import annotations

import atexit
import multiprocessing.connection
import os
import shutil
import sys
import tempfile
import threading
import time

os.environ.setdefault("BACKEND", "ddpkit")
os.environ.setdefault("WORLD_SIZE", "2")
os.environ.setdefault("DISTRIBUTED_TESTS_DEFAULT_TIMEOUT", "120")
# torch runs the suite at both env:// and file://; file:// opens test_barrier_timeout_global too.
if "INIT_METHOD" not in os.environ:
    _init_dir = tempfile.mkdtemp(prefix="torch_suite_")
    atexit.register(shutil.rmtree, _init_dir, ignore_errors=True)  # this process only: forked ranks end in os._exit
    os.environ["INIT_METHOD"] = "file://" + os.path.join(_init_dir, "shared_init_file")

import torch  # noqa: E402
import torch.multiprocessing  # noqa: E402
from torch.testing._internal.common_distributed import DistTestCases, get_timeout  # noqa: E402

import ddpkit  # noqa: E402,F401  (registers the "ddpkit" backend here and so in every forked rank)

SUITE_MODULE = "torch.testing._internal.distributed.distributed_test"
PLUGIN = "ddpkit"
FEATURE_SETS = ("plugin", "ddp", "subgroup")


class GlooAlike(str):
    """A backend name whose text is its own but which compares and hashes as "gloo" (module docstring)."""

    def __eq__(self, other: object) -> bool:
        return str.__eq__(self, other) is True or other == "gloo"

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    def __hash__(self) -> int:
        return hash("gloo")  # so that `BACKEND in {"gloo"}` holds (a set looks up by hash first)


class _EnvironWithGlooAlikeBackend(type(os.environ)):  # type: ignore[misc]
    def __getitem__(self, key):
        value = super().__getitem__(key)
        return GlooAlike(value) if key == "BACKEND" and value == PLUGIN else value


def _import_suite():
    if SUITE_MODULE in sys.modules:
        return sys.modules[SUITE_MODULE]
    for feature in FEATURE_SETS:
        DistTestCases.backend_feature[feature].add(PLUGIN)
    environ_class = type(os.environ)
    os.environ.__class__ = _EnvironWithGlooAlikeBackend
    try:
        import importlib

        module = importlib.import_module(SUITE_MODULE)
    finally:
        os.environ.__class__ = environ_class
    return module


_suite = _import_suite()
BACKEND: str = _suite.BACKEND
if BACKEND == PLUGIN and not isinstance(BACKEND, GlooAlike):  # pragma: no cover - the import did not see the swap
    raise RuntimeError(f"{SUITE_MODULE} was imported before tests/torch_suite.py: its gloo gates stay closed")


class TestDistBackendWithFork(_suite.TestDistBackend, _suite.DistributedTest._DistTestBase):
    """torch's ``TestDistBackendWithSpawn``, with forked ranks, which meet at a barrier and are joined without
    polling.

    torch's barrier between the ranks (``distributed_test.Barrier``: files in a folder, looked at every 0.1 s)
    runs twice a test at least, and its join looks at the ranks every 0.1 s: a fixed wait in every test. Here the
    ranks share a semaphore barrier made before they are forked (a class attribute: each rank's test object is a
    new one), with torch's barrier's timeout and error, and the join first waits on the ranks' sentinels."""

    _ranks_barrier = None

    def setUp(self):
        super().setUp()
        type(self)._ranks_barrier = torch.multiprocessing.get_context("fork").Barrier(int(self.world_size))
        self._start_processes(torch.multiprocessing.get_context("fork").Process)

    def _barrier(self, wait_for=None, timeout=10):
        if wait_for not in (None, int(self.world_size)):
            return super()._barrier(wait_for=wait_for, timeout=timeout)
        try:
            self._ranks_barrier.wait(timeout)
        except threading.BrokenBarrierError:
            raise RuntimeError("barrier timeout") from None

    def _join_processes(self, fn) -> None:
        # Until every rank has exited, or one has exited with the code on which torch's join stops the others.
        deadline = time.monotonic() + get_timeout(self.id())
        running = list(self.processes)
        while running and time.monotonic() < deadline:
            multiprocessing.connection.wait([p.sentinel for p in running], deadline - time.monotonic())
            running = [p for p in running if p.exitcode is None]
            if any(p.exitcode == self.TEST_ERROR_EXIT_CODE for p in self.processes):
                break
        super()._join_processes(fn)


def test_names() -> list[str]:
    """Every test of the suite, in definition order of ``unittest``'s loader (sorted by name)."""
    import unittest

    return list(unittest.TestLoader().getTestCaseNames(TestDistBackendWithFork))


if __name__ == "__main__":
    from torch.testing._internal.common_utils import run_tests

    run_tests()
