"""Every way a short job on the "ddpkit" backend ends leaves its processes without an abort: no C++ thread
destroyed while joinable, no thread unwound through the interpreter's exit ("terminate called without
an active exception", SIGABRT). Each job is 2 ranks that run a script and end one way (forked from an
interpreter that imported torch and ddpkit; those of the last two tests: fresh interpreters). A child
forked from a rank neither hangs nor crashes on its parent's group, and leaves it working."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from helpers import communicate_all, free_port

JOB = textwrap.dedent(r"""
    import os, signal, sys, datetime, torch
    import torch.distributed as dist
    import ddpkit

    how, rank = sys.argv[1], int(os.environ["RANK"])
    dist.init_process_group("ddpkit", timeout=datetime.timedelta(seconds=20))
    big = torch.ones(2_000_000)
    for _ in range(3):
        dist.all_reduce(torch.ones(1000))
    # Asynchronous work with a Python callback on its future, outstanding as the job ends.
    works = [dist.all_reduce(big.clone(), async_op=True) for _ in range(4)]
    futures = [w.get_future().then(lambda f: f.value()) for w in works]
    if how == "normal":  # returns from the script without destroy_process_group
        futures[-1].wait()
    elif how == "callback_exit":  # sys.exit inside a future's callback
        dist.all_reduce(torch.ones(10), async_op=True).get_future().then(lambda f: sys.exit(3)).wait()
    elif how == "exception":  # an uncaught exception while the work is in flight
        raise RuntimeError("the job's own error")
    elif how == "os_exit":
        os._exit(0)
    elif how == "sigterm":
        os.kill(os.getpid(), signal.SIGTERM)
        signal.pause()
    elif how == "destroy":
        for f in futures:
            f.wait()
        dist.destroy_process_group()
""")

# What each way of ending returns: the exit status a job ended that way has anyway.
ENDINGS = {
    "normal": {0},
    "callback_exit": {0, 1, 3},
    "exception": {1},
    "os_exit": {0},
    "sigterm": {-signal.SIGTERM},
    "destroy": {0},
}


def start_job(script, how: str) -> list:
    port = free_port()
    ranks = []
    for rank in range(2):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
        }
        ranks.append(
            subprocess.Popen(
                [sys.executable, str(script), how],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
        )
    return ranks


def run_clean_job(tmp_path, name: str, text: str) -> list:
    """Runs `text` as a 2-rank job (`name` its first argument); each rank's output, every rank having
    exited 0."""
    script = tmp_path / f"{name}.py"
    script.write_text(text)
    ranks = start_job(script, name)
    outputs = communicate_all(ranks, timeout=120)
    for rank, (process, (out, err)) in enumerate(zip(ranks, outputs)):
        assert process.returncode == 0, f"rank {rank}: exit status {process.returncode}\n{out}\n{err[-2000:]}"
    return [out for out, _ in outputs]


def test_every_ending_is_clean(tmp_path, programs):
    # Each rank forked from programs' interpreter (torch and ddpkit imported, no group made), as the pools'
    # forkserver does: it runs the job as a script runs and ends as one (its interpreter finalizing, atexit's
    # handlers run), without the seconds a fresh interpreter takes to import torch, twelve times over.
    # The script is written once, before any rank starts: rewriting it per job let a starting rank read it
    # empty and exit 0 without a word, its peer left waiting (seen in CI).
    script = tmp_path / "job.py"
    script.write_text(JOB)
    started = {}
    for how in ENDINGS:
        job = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
        for rank in range(2):
            started[how, rank] = programs.start([script, how], env={**os.environ, **job, "RANK": str(rank)})
    deadline = time.monotonic() + 120
    failures = []
    for (how, rank), program in started.items():
        try:
            ended = programs.wait(program, timeout=max(1.0, deadline - time.monotonic()))
        except TimeoutError:  # every rank still running is killed with it
            failures.append(f"{how}, rank {rank}: still running (a hang at exit)")
            break
        if ended.returncode not in ENDINGS[how] or "terminate called" in ended.stderr or "Fatal Python" in ended.stderr:
            failures.append(f"{how}, rank {rank}: exit status {ended.returncode}\n{ended.stderr[-2000:]}")
    assert not failures, "\n".join(failures)


FORKED = textwrap.dedent(r"""
    import os, sys, datetime, torch
    import torch.distributed as dist
    import ddpkit

    dist.init_process_group("ddpkit", timeout=datetime.timedelta(seconds=20))
    works = [dist.all_reduce(torch.ones(100_000), async_op=True) for _ in range(3)]
    child = os.fork()
    if child == 0:  # the parent's group, its work outstanding: each use fails at once, naming the call
        for name, use in [("all_reduce", lambda: dist.all_reduce(torch.ones(10))),
                          ("wait", lambda: works[0].wait()),
                          ("send", lambda: dist.send(torch.ones(1), 1 - dist.get_rank()))]:
            try:
                use()
                print(f"{name}: no error", flush=True)
            except RuntimeError as error:
                print(f"{name}: {str(error).splitlines()[0]}", flush=True)
        dist.destroy_process_group()  # leaves the parent's threads, segment and sockets alone
        sys.exit(0)
    _, status = os.waitpid(child, 0)
    print("child exit status", os.waitstatus_to_exitcode(status), flush=True)
    for work in works:
        work.wait()
    total = torch.ones(10)
    dist.all_reduce(total)
    print("parent's group after the child", total[0].item(), flush=True)
    dist.destroy_process_group()
""")


def test_a_forked_child_cannot_use_its_parents_group_and_leaves_it_alone(tmp_path):
    """Note [Forked children]: in a child forked with a group's work in flight, a collective, a wait and a
    send each fail at once instead of hanging, destroying the group there neither crashes nor hangs, and
    the parent's group goes on."""
    for rank, out in enumerate(run_clean_job(tmp_path, "forked", FORKED)):
        lines = out.splitlines()
        for name in ("all_reduce", "wait", "send"):
            assert (
                f"{name}: ddpkit.{name} (rank {rank}): this process is a fork of the one that made the group"
                in "\n".join(lines)
            ), out
        assert "child exit status 0" in lines, out
        assert "parent's group after the child 2.0" in lines, out


DESTROYED = textwrap.dedent(r"""
    import atexit, os, sys
    # Registered before ddpkit's own handler, so it runs after it (atexit runs the last first).
    threads = lambda: len(os.listdir("/proc/self/task"))
    atexit.register(lambda: print("threads after ddpkit's exit handler", threads(), flush=True))
    import torch, torch.distributed as dist
    import ddpkit

    dist.init_process_group("gloo")
    tensor = torch.ones(10)
    ddpkit.all_reduce(tensor)  # an engine for the gloo group, which holds its backend
    dist.all_reduce(tensor)  # a work on gloo's own threads
    print("threads before", threads(), flush=True)
    dist.destroy_process_group()
""")


def test_a_destroyed_gloo_group_ends_its_threads_before_the_interpreter_finalizes(tmp_path):
    """Note [Exit paths]: the engine of a destroyed gloo group, and the gloo backend it holds, are freed by
    ddpkit's exit handler, so no gloo worker thread is left to drop a work's tensor, and ask for the
    GIL, while the interpreter finalizes (torch's race, pytorch/pytorch#190489: SIGABRT, seen once in
    CI's run of docs/ddp.md's ddp_hooks.py)."""
    for out in run_clean_job(tmp_path, "destroyed", DESTROYED):
        before = int(out.split("threads before ")[1].split()[0])
        after = int(out.split("threads after ddpkit's exit handler ")[1].split()[0])
        assert before > 1 and after == 1, out  # only the main thread is left


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))
