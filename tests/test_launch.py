"""The worker pool and spawn helper (results, re-raised exceptions, timeouts, no orphans), and the
library apart from the training application."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import ddpkit
from ddpkit.launch import _local_rank, init_distributed
from ddpkit.testing import RemoteTraceback, WorkerPool


def case_rank_and_size():
    return dist.get_rank(), dist.get_world_size(), os.environ["RANK"]


def case_raise_on(rank_to_fail):
    if dist.get_rank() == rank_to_fail:
        raise KeyError(f"rank {rank_to_fail} was told to fail")
    return "fine"


def case_sleep(seconds):
    time.sleep(seconds)


def test_spawn_returns_every_rank_result_in_order():
    assert ddpkit.spawn(case_rank_and_size, 3) == [(0, 3, "0"), (1, 3, "1"), (2, 3, "2")]


def test_a_failing_rank_is_reraised_with_its_traceback():
    with pytest.raises(KeyError, match="rank 1 was told to fail") as info:
        ddpkit.spawn(case_raise_on, 3, 1)
    assert isinstance(info.value.__cause__, RemoteTraceback)
    assert "Traceback of rank 1" in str(info.value.__cause__) and "case_raise_on" in str(info.value.__cause__)


def case_fail_while_others_wait(rank_to_fail, seconds):
    if dist.get_rank() == rank_to_fail:
        raise KeyError(f"rank {rank_to_fail} was told to fail")
    time.sleep(seconds)


def test_a_failing_rank_kills_the_others_at_once():
    pool = WorkerPool(3, timeout=600)
    pool.start()
    processes = list(pool._processes)
    started = time.monotonic()
    with pytest.raises(KeyError, match="rank 1 was told to fail"):
        pool.run(case_fail_while_others_wait, 1, 300)
    assert time.monotonic() - started < 60, "the pool waited for the sleeping ranks"  # they sleep 300 s
    assert not any(p.is_alive() for p in processes)
    pool.close()


def test_return_exceptions_collects_every_outcome():
    outcomes = ddpkit.spawn(case_raise_on, 2, 0, return_exceptions=True)
    assert isinstance(outcomes[0], KeyError) and outcomes[1] == "fine"


def test_timeout_kills_the_pool():
    pool = WorkerPool(2, timeout=2)
    pool.start()
    processes = list(pool._processes)
    with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] did not finish"):
        pool.run(case_sleep, 60)
    assert not any(p.is_alive() for p in processes)
    assert pool.run(case_rank_and_size, timeout=60)[1][0] == 1  # the next run starts fresh workers
    pool.close()


def test_explicit_launch_arguments_are_checked():
    with pytest.raises(ValueError, match="master_addr needs world_size and rank"):
        init_distributed(master_addr="127.0.0.1", master_port=29500)
    with pytest.raises(ValueError, match=r"rank 3 is not in \[0, world_size=2\)"):
        init_distributed(master_addr="127.0.0.1", master_port=29500, world_size=2, rank=3)


def test_local_rank_picks_a_gpu_per_process_without_a_launcher(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert [_local_rank(rank) for rank in range(6)] == [0, 1, 2, 3, 0, 1]  # rank % device_count
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert _local_rank(3) == 0  # no GPU to pick
    monkeypatch.setenv("LOCAL_RANK", "2")  # torchrun's word is final
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert _local_rank(5) == 2


@pytest.fixture(scope="module")
def fresh_imports() -> list[str]:
    """What a fresh interpreter has loaded (this test process has imported everything already): the
    ddpkit.testing modules after ``import ddpkit``, then the ddpkit.training modules after importing the
    library's launcher and test harness too."""
    code = (
        "import sys, ddpkit\n"
        "print(','.join(sorted(m for m in sys.modules if m.startswith('ddpkit.testing'))))\n"
        "import ddpkit.launch, ddpkit.testing\n"
        "print(','.join(sorted(m for m in sys.modules if m.startswith('ddpkit.training'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return out.stdout.split("\n")[:2]


def test_the_library_imports_without_the_training_application(fresh_imports):
    assert fresh_imports[1] == ""


def test_spawn_is_the_public_workers_and_import_ddpkit_leaves_the_test_harness_unloaded(fresh_imports):
    import ddpkit.workers

    assert ddpkit.spawn is ddpkit.workers.spawn and "spawn" in ddpkit.__all__
    assert fresh_imports[0] == ""


def test_one_training_entry_point():
    import ddpkit.training
    import ddpkit.training.train

    assert ddpkit.training.main is ddpkit.training.train.main
    root = Path(__file__).resolve().parent.parent
    assert "from ddpkit.training import main" in (root / "train.py").read_text()
    assert "[project.scripts]" not in (root / "pyproject.toml").read_text()
