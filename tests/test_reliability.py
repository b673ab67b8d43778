"""Faults: a rank killed mid-collective or mid-training, restarts from checkpoints, crashes during a save.

The process-group timeout in these tests is short (``GROUP_TIMEOUT_S``). A dead peer is reported
at once to the ranks that talk to it (its sockets close with it); a rank that only waits for a
live peer which has itself given up learns of it at the group's timeout at the latest.
"""

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import ddpkit
from ddpkit.testing import WorkerFailure, WorkerPool
from ddpkit.training.data import FASHION_MNIST_ROOT

from helpers import make_trainer, uncompressed_fashion_mnist

REPO = Path(__file__).resolve().parent.parent
TRAIN = REPO / "train.py"
GROUP_TIMEOUT_S = 20
needs_fashion_mnist = pytest.mark.skipif(
    not Path(FASHION_MNIST_ROOT).is_dir(), reason="apt-get install dataset-fashion-mnist (scripts/setup.sh does)"
)


def processes_mentioning(marker: str) -> list[int]:
    """PIDs of live processes whose command line contains ``marker``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = next(line for line in (entry / "status").read_text().splitlines() if line.startswith("State:"))
        except (OSError, StopIteration):
            continue
        if marker in cmdline and "zombie" not in state:
            found.append(int(entry.name))
    return found


def children_of(pid: int) -> list[int]:
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        children.extend(int(c) for c in text)
    return children


# --- a rank dies in the middle of collectives ------------------------------------------------------


def case_die_during_collectives(victim: int, algorithm: str):
    rank = dist.get_rank()
    for iteration in range(10_000):
        tensor = torch.ones(10_000)
        if rank == victim and iteration == 20:
            os.kill(os.getpid(), signal.SIGKILL)
        ddpkit.all_reduce(tensor, algorithm=algorithm)
    return "survived"


def survivors_of_rank_1(case, *args) -> list:
    """Runs ``case`` on 3 ranks, of which rank 1 kills itself; returns the outcomes of ranks 0 and 2
    after checking that they ended within the group's timeout and left no process behind."""
    pool = WorkerPool(3, timeout=120, group_timeout=GROUP_TIMEOUT_S)
    started = time.monotonic()
    try:
        outcomes = pool.run(case, 1, *args, return_exceptions=True)
    finally:
        processes = list(pool._processes)
        pool.kill()
    elapsed = time.monotonic() - started
    assert elapsed < GROUP_TIMEOUT_S + 10, f"took {elapsed:.1f}s"
    assert isinstance(outcomes[1], WorkerFailure) and "exit code -9" in str(outcomes[1])
    assert not any(p.is_alive() for p in processes), "worker processes were left behind"
    for rank in (0, 2):
        assert isinstance(outcomes[rank], RuntimeError), outcomes[rank]
    return [outcomes[0], outcomes[2]]


@pytest.mark.parametrize("algorithm", ["ring", "direct", "auto", "process_group"])
def test_dead_rank_fails_every_other_rank_quickly(algorithm):
    for outcome in survivors_of_rank_1(case_die_during_collectives, algorithm):
        if algorithm != "process_group":
            # Over shared memory the liveness check names the dead rank, whichever peer a survivor waited on.
            assert "ddpkit.all_reduce" in str(outcome) and "rank 1 (pid" in str(outcome) and "died" in str(outcome), (
                outcome
            )


def case_die_while_the_peer_sleeps(async_op: bool):
    rank = dist.get_rank()
    ddpkit.all_reduce(torch.ones(1))  # the group's set-up, which waits for every rank, is behind us
    if rank == 1:
        time.sleep(0.3)  # rank 0 is asleep in the all-reduce's wait by now (not needed for the outcome)
        os.kill(os.getpid(), signal.SIGKILL)
    tensor = torch.ones(1000)
    if async_op:  # on the "ddpkit" backend, whose engine's thread runs the wait
        dist.all_reduce(tensor, async_op=True).wait()
    else:
        ddpkit.all_reduce(tensor)
    return "survived"


@pytest.mark.parametrize("async_op", [False, True], ids=["caller", "engine"])
def test_dead_rank_is_named_without_the_liveness_poll(async_op):
    """Note [Prompt death notice]: with rank 0's periodic liveness check off (the no_liveness_poll test
    fault) and a group timeout far beyond the pool's, rank 0 still names rank 1, killed while rank 0
    sleeps in a wait for it: the pidfd watch woke the wait. Without the watch rank 0 would sleep on
    until the pool gave up on it."""
    pool = WorkerPool(
        2,
        backend="ddpkit" if async_op else "gloo",
        timeout=60,
        group_timeout=600,
        env={"DDPKIT_TEST_FAULT": "no_liveness_poll:0"},
    )
    try:
        outcomes = pool.run(case_die_while_the_peer_sleeps, async_op, return_exceptions=True)
    finally:
        pool.kill()
    assert isinstance(outcomes[1], WorkerFailure) and "exit code -9" in str(outcomes[1]), outcomes[1]
    assert isinstance(outcomes[0], RuntimeError), outcomes[0]
    assert "rank 1 (pid" in str(outcomes[0]) and "died" in str(outcomes[0]), outcomes[0]


def case_leaves_exit_after_their_part(numel: int):
    """A reduce to rank 0 over shared-memory messages (a binomial tree: 1 -> 0 and 3 -> 2, then
    2 -> 0) whose leaves exit as soon as their call returns, while rank 2, late, keeps rank 0
    waiting for several liveness periods. Without the collective check's step, which waits for
    every rank, the leaves' small messages leave at once."""
    rank = dist.get_rank()
    tensor = torch.full((numel,), float(rank + 1))
    ddpkit.all_reduce(torch.ones(1))  # the group's set-up, which waits for every rank, is behind us
    if rank == 2:
        time.sleep(1.0)
    ddpkit.set_collective_checks(False)
    ddpkit.reduce(tensor, dst=0)
    ddpkit.set_collective_checks(True)
    if rank in (1, 3):
        os._exit(0)  # done with its part: no clean-up, as a program that ends here
    return tensor[:3].tolist() + [bool(torch.all(tensor == tensor[0]))]


def test_a_rank_that_exits_after_its_part_is_not_reported_dead():
    pool = WorkerPool(4, timeout=120, group_timeout=GROUP_TIMEOUT_S)
    try:
        outcomes = pool.run(case_leaves_exit_after_their_part, 1000, return_exceptions=True)
    finally:
        pool.kill()
    for rank in (1, 3):
        assert isinstance(outcomes[rank], WorkerFailure) and "exit code 0" in str(outcomes[rank]), outcomes[rank]
    assert outcomes[0] == [10.0, 10.0, 10.0, True], outcomes[0]  # 1 + 2 + 3 + 4
    assert outcomes[2] == [7.0, 7.0, 7.0, True], outcomes[2]  # 3 + 4: the inner node's partial sum


def case_die_during_training(victim: int):
    """DDP + SyncBatchNorm steps; the victim kills itself inside a backward, with buckets in flight."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = ddpkit.DistributedDataParallel(
        ddpkit.convert_sync_batchnorm(
            torch.nn.Sequential(
                torch.nn.Linear(64, 256),
                torch.nn.BatchNorm1d(256),
                torch.nn.ReLU(),
                torch.nn.Linear(256, 256),
                torch.nn.ReLU(),
                torch.nn.Linear(256, 10),
            )
        ),
        bucket_cap_mb=0.1,
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    step = 0

    def die_in_backward(grad):
        if rank == victim and step == 20:
            os.kill(os.getpid(), signal.SIGKILL)
        return grad

    first_layer = model.module[0].weight  # its gradient is among the last of the backward
    first_layer.register_hook(die_in_backward)
    for step in range(10_000):  # noqa: B007 - die_in_backward reads it
        optimizer.zero_grad()
        model(torch.randn(32, 64)).square().mean().backward()
        optimizer.step()
    return "survived"


def test_dead_rank_mid_training_fails_every_other_rank_quickly():
    for outcome in survivors_of_rank_1(case_die_during_training):
        assert "ddpkit." in str(outcome) and "rank 1 (pid" in str(outcome) and "died" in str(outcome), outcome


def exited(pid: int) -> bool:
    """True once ``pid`` has exited (a zombie counts: its parent has not reaped it yet)."""
    try:
        state = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("State:"))
    except (OSError, StopIteration):
        return True
    return "zombie" in state


@needs_fashion_mnist
def test_dead_worker_under_torchrun_stops_the_whole_job(tmp_path):
    out = tmp_path / "dead-worker-run"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "3",
        "--max-restarts",
        "0",
        "--monitor-interval",
        "1",
        str(TRAIN),
        "--dataset",
        "fashion_mnist",
        "--data-root",
        str(uncompressed_fashion_mnist(tmp_path / "fashion_mnist")),
        "--limit-train",
        "6000",
        "--batch-size",
        "16",
        "--epochs",
        "20",
        "--no-progress",
        "--checkpoint-every",
        "2",
        "--timeout",
        str(GROUP_TIMEOUT_S),
        "--out",
        str(out),
    ]
    launcher = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (out / "checkpoint.pt").exists():
            assert launcher.poll() is None, launcher.communicate()
            assert time.monotonic() < deadline, "training never checkpointed"
            time.sleep(0.1)
        workers = children_of(launcher.pid)
        assert len(workers) == 3, workers
        survivors = [workers[0], workers[2]]
        # torchrun SIGTERMs the survivors at its first poll after the death, which may come before they
        # have noticed it. Stopping the launcher meanwhile leaves the survivors alone with the dead peer,
        # which is what this test is about: they must notice and report it themselves.
        os.kill(launcher.pid, signal.SIGSTOP)
        try:
            killed_at = time.monotonic()
            os.kill(workers[1], signal.SIGKILL)
            while not all(exited(pid) for pid in survivors) and time.monotonic() < killed_at + GROUP_TIMEOUT_S + 30:
                time.sleep(0.05)
            survivors_stopped_after = time.monotonic() - killed_at
        finally:
            os.kill(launcher.pid, signal.SIGCONT)
        _, stderr = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode != 0
    assert survivors_stopped_after < GROUP_TIMEOUT_S + 30, survivors_stopped_after
    assert "exitcode" in stderr and "-9" in stderr, stderr[-2000:]
    messages = re.findall(r"RuntimeError: (ddpkit\.\w+ \(rank ([02]) of 3[^)]*\): .*)", stderr)
    assert {rank for _, rank in messages} == {"0", "2"}, stderr[-4000:]
    assert all("rank 1 (pid" in message and "died" in message for message, _ in messages), messages
    deadline = time.monotonic() + 10
    while processes_mentioning(str(out)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert processes_mentioning(str(out)) == [], "processes of the failed job are still running"


# --- restart without loss --------------------------------------------------------------------------


def training_options(out: Path, data_root: Path) -> list[str]:
    """train.py's options for the restart test: 16 optimizer steps an epoch, 2 epochs, a checkpoint every 4."""
    return [
        "--dataset",
        "fashion_mnist",
        "--data-root",
        str(data_root),
        "--model",
        "net",
        "--limit-train",
        "2048",
        "--limit-test",
        "512",
        "--batch-size",
        "32",
        "--accumulation-steps",
        "2",
        "--epochs",
        "2",
        "--checkpoint-every",
        "4",
        "--no-progress",
        "--timeout",
        str(GROUP_TIMEOUT_S),
        "--out",
        str(out),
    ]


def training_command(out: Path, data_root: Path, max_restarts: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "--max-restarts",
        str(max_restarts),
        str(TRAIN),
        *training_options(out, data_root),
    ]


def case_train_as_torchrun_does(argv: list[str]) -> None:
    """train.py's run of ``argv`` on this pool's ranks, each on one thread as torchrun starts its workers
    (OMP_NUM_THREADS=1): the same bits as the launched program."""
    from ddpkit.training.cli import parse_args

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        make_trainer(parse_args(argv)[0]).run()
    finally:
        torch.set_num_threads(threads)


def checkpoint_step(path: Path) -> int:
    try:
        return int(torch.load(path, map_location="cpu", weights_only=False)["step"])
    except Exception:  # noqa: BLE001 - absent, or replaced while reading: try again
        return -1


@needs_fashion_mnist
def test_killed_worker_resumes_from_checkpoint_and_ends_bitwise_equal(pool, tmp_path):
    """torchrun restarts the job after a worker is killed mid-training, the new workers resume from the last
    checkpoint, and the run ends with the bits of an uninterrupted run of the same options. That run trains
    on the session's pool, one thread a rank as torchrun's workers have: what needs torchrun here is the
    restart."""
    data_root = uncompressed_fashion_mnist(tmp_path / "fashion_mnist")
    pool(2).run(case_train_as_torchrun_does, training_options(tmp_path / "uninterrupted", data_root), timeout=300)

    out = tmp_path / "restarted"
    launcher = subprocess.Popen(
        training_command(out, data_root, 1), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 300
        # The first checkpoint (step 4 of 32) leaves the kill most of the run's time to land in.
        while checkpoint_step(out / "checkpoint.pt") < 4:
            assert launcher.poll() is None, launcher.communicate()
            assert time.monotonic() < deadline, "no checkpoint at step 4"
            time.sleep(0.02)
        os.kill(children_of(launcher.pid)[1], signal.SIGKILL)
        stdout, stderr = launcher.communicate(timeout=600)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 0, stderr[-3000:]
    assert "resumed from" in stdout, stdout[-3000:]
    expected = torch.load(tmp_path / "uninterrupted" / "model.pt")
    actual = torch.load(out / "model.pt")
    assert expected.keys() == actual.keys()
    for key in expected:
        assert torch.equal(actual[key], expected[key]), key


# --- a crash in the middle of writing a checkpoint --------------------------------------------------

CRASHING_SAVE = textwrap.dedent("""
    import os, sys, torch
    from pathlib import Path
    from ddpkit.training import checkpoints
    path = Path(sys.argv[1])
    checkpoints.save_atomically({"step": 1, "weights": torch.arange(10.0)}, path)

    def crash_half_way(obj, handle, *args, **kwargs):
        handle.write(b"PK\\x03\\x04 half a checkpoint")
        handle.flush()
        os._exit(17)  # the process dies mid-save: no cleanup, no exception handling

    checkpoints.torch.save = crash_half_way
    checkpoints.save_atomically({"step": 2, "weights": torch.zeros(10)}, path)
""")


def test_crash_during_save_keeps_the_previous_checkpoint(tmp_path):
    path = tmp_path / "checkpoint.pt"
    result = subprocess.run(
        [sys.executable, "-c", CRASHING_SAVE, str(path)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 17, result.stderr
    state = torch.load(path, weights_only=False)
    assert state["step"] == 1 and torch.equal(state["weights"], torch.arange(10.0))
    leftovers = [p.name for p in tmp_path.iterdir() if p.name != "checkpoint.pt"]
    assert all(name.startswith(".checkpoint.pt.") and name.endswith(".part") for name in leftovers), leftovers
