"""``ddpkit.init_distributed()`` under the launchers clusters run (Note [Launchers] in python/ddpkit/launch.py):
SLURM's node lists, what each launcher's variables say, and real processes (tests/launcher_worker.py) started
with one launcher's variables and nothing else, as srun and mpirun start them."""

import json
import os
import random
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ddpkit.launch import SLURM_PORT_BASE, SLURM_PORT_SPAN, DistInfo, Launch, expand_slurm_nodelist
from ddpkit.launch import launch_from_environment as read
from ddpkit.testing import HostPool

from helpers import (
    HOSTS_GROUP_TIMEOUT_S,
    REPO,
    ProgramForker,
    communicate_all,
    documented_mpirun,
    free_port,
    needs_fashion_mnist,
    needs_hosts,
)

WORKER = Path(__file__).resolve().parent / "launcher_worker.py"
# Every variable a launcher sets: the tasks this module starts get only those their phase names.
LAUNCHER_NAMES = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK"}
LAUNCHER_PREFIXES = ("SLURM_", "OMPI_", "PMI_", "PMIX_", "MPI_LOCAL", "TORCHELASTIC_", "HYDRA_")


# --- SLURM's node lists ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "nodelist, hosts",
    [
        ("node07", ["node07"]),
        ("a1,b2,c3", ["a1", "b2", "c3"]),
        ("node[01-04,07],gpu-a1", ["node01", "node02", "node03", "node04", "node07", "gpu-a1"]),
        ("node[8-10]", ["node8", "node9", "node10"]),
        ("node[08-10]", ["node08", "node09", "node10"]),
        ("n[1-2],m[5],x", ["n1", "n2", "m5", "x"]),
        ("rack[1-2]-n[8-9]", ["rack1-n8", "rack1-n9", "rack2-n8", "rack2-n9"]),
        ("gpu[3]-ib", ["gpu3-ib"]),
    ],
)
def test_slurm_node_lists_expand_as_scontrol_shows_them(nodelist, hosts):
    assert expand_slurm_nodelist(nodelist) == hosts


@pytest.mark.parametrize(
    "nodelist", ["node[1-", "node1]", "node[3-1]", "node[a-b]", "node[1-2-3]", "a,,b", "", "n[[1]]"]
)
def test_a_malformed_node_list_raises(nodelist):
    with pytest.raises(ValueError, match="SLURM node list"):
        expand_slurm_nodelist(nodelist)


# --- what the variables say --------------------------------------------------------------------------

SRUN = {
    "SLURM_PROCID": "3",
    "SLURM_NTASKS": "4",
    "SLURM_LOCALID": "1",
    "SLURM_JOB_ID": "4123456",
    "SLURM_JOB_NODELIST": "node[01-02]",
}
TORCHRUN = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "h0", "MASTER_PORT": "29400"}
OPEN_MPI = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}
MPICH = {"PMI_RANK": "2", "PMI_SIZE": "3", "MPI_LOCALRANKID": "0"}


def test_each_launcher_read_alone():
    assert read({}) == Launch("none", 0, 1, 0)
    assert read(SRUN) == Launch(
        "slurm", 3, 4, 1, "node01", SLURM_PORT_BASE + 3456, "the first host of SLURM_JOB_NODELIST"
    )
    assert read({**SRUN, "MASTER_ADDR": "10.0.0.9", "MASTER_PORT": "2222"}) == Launch(
        "slurm", 3, 4, 1, "10.0.0.9", 2222, "MASTER_ADDR"
    )
    assert read(TORCHRUN) == Launch("torchrun", 1, 2, 1)
    # One host (the local size is the size): 127.0.0.1, at torchrun's default port unless MASTER_PORT says.
    assert read({**OPEN_MPI, "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}) == Launch(
        "openmpi", 1, 2, 1, "127.0.0.1", 29500, "this host (OMPI_COMM_WORLD_LOCAL_SIZE=2)"
    )
    assert read({**MPICH, "MPI_LOCALNRANKS": "1", "MASTER_ADDR": "h0", "MASTER_PORT": "3000"}) == Launch(
        "pmi", 2, 3, 0, "h0", 3000, "MASTER_ADDR"
    )
    # A job of one task needs no rendezvous.
    assert read({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}) == Launch("slurm", 0, 1)
    assert read({"PMI_RANK": "0", "PMI_SIZE": "1"}) == Launch("pmi", 0, 1)


def test_the_documented_order_decides():
    # srun torchrun / mpirun torchrun: the workers inherit the outer launcher's variables; torchrun's are theirs.
    assert read({**SRUN, **OPEN_MPI, **TORCHRUN}).launcher == "torchrun"
    # srun --mpi=pmi2 sets PMI_RANK/PMI_SIZE beside SLURM's.
    assert read({**SRUN, **MPICH}).launcher == "slurm"
    assert read({**OPEN_MPI, **MPICH, "MASTER_ADDR": "h0"}).launcher == "openmpi"
    # A batch script's one process has SLURM_PROCID without SLURM_NTASKS (sbatch without --ntasks).
    assert read({"SLURM_PROCID": "0", "SLURM_JOB_ID": "7"}).launcher == "none"


@pytest.mark.parametrize(
    "environ, message",
    [
        ({"RANK": "0"}, "RANK is set but WORLD_SIZE is not"),
        ({"WORLD_SIZE": "2"}, "WORLD_SIZE is set but RANK is not"),
        ({"RANK": "0", "WORLD_SIZE": "2"}, "MASTER_ADDR, MASTER_PORT is not; launch with torchrun"),
        ({"SLURM_NTASKS": "2"}, "SLURM_NTASKS is set but SLURM_PROCID is not"),
        ({"OMPI_COMM_WORLD_RANK": "1"}, "OMPI_COMM_WORLD_RANK is set but OMPI_COMM_WORLD_SIZE is not"),
        ({"PMI_SIZE": "2"}, "PMI_SIZE is set but PMI_RANK is not"),
        ({"PMI_RANK": "2", "PMI_SIZE": "2"}, r"PMI_RANK=2 is not in \[0, PMI_SIZE=2\)"),
        ({"SLURM_PROCID": "x", "SLURM_NTASKS": "2"}, "SLURM_PROCID='x' is not an integer"),
        # several tasks, and nowhere to meet
        ({**SRUN, "SLURM_JOB_NODELIST": ""}, "neither MASTER_ADDR nor SLURM_JOB_NODELIST is set: set MASTER_ADDR"),
        ({**SRUN, "SLURM_JOB_ID": ""}, "neither MASTER_PORT nor SLURM_JOB_ID is set: set MASTER_PORT"),
        ({**SRUN, "MASTER_PORT": "70000"}, "MASTER_PORT=70000 is not a port"),
        (OPEN_MPI, "openmpi says this job has 2 tasks .* set MASTER_ADDR"),
        ({**MPICH, "MPI_LOCALNRANKS": "2"}, "pmi says this job has 3 tasks .* set MASTER_ADDR"),
    ],
)
def test_half_set_variables_and_a_job_with_nowhere_to_meet_raise(environ, message):
    with pytest.raises(ValueError, match=message):
        read(environ)


def test_distinfo_keeps_its_positional_fields():
    info = DistInfo(1, 2, 0, "gloo")
    assert (info.rank, info.world_size, info.local_rank, info.backend, info.launcher) == (1, 2, 0, "gloo", "existing")


# --- real processes, as a launcher starts them -----------------------------------------------------------


def bare_environment() -> dict:
    """This process's environment without any launcher's variables."""
    return {
        name: value
        for name, value in os.environ.items()
        if name not in LAUNCHER_NAMES and not name.startswith(LAUNCHER_PREFIXES)
    }


def free_slurm_job_id() -> str:
    """A job id whose derived port (SLURM_PORT_BASE + id % SLURM_PORT_SPAN) is free on this host now."""
    for _ in range(200):
        job_id = random.randrange(10**6, 10**7)
        with socket.socket() as s:
            try:
                s.bind(("", SLURM_PORT_BASE + job_id % SLURM_PORT_SPAN))
            except OSError:
                continue
            return str(job_id)
    raise RuntimeError("no free port in the SLURM range")


def srun(ntasks: int, job_id: str, nodelist: str, first: int = 0) -> list[dict]:
    """The variables srun gives tasks first..first+ntasks-1 of one node: SLURM's and nothing else."""
    return [
        {
            "SLURM_PROCID": str(task),
            "SLURM_NTASKS": str(ntasks),
            "SLURM_LOCALID": str(task),
            "SLURM_NODEID": "0",
            "SLURM_NNODES": "1",
            "SLURM_JOB_ID": job_id,
            "SLURM_JOB_NODELIST": nodelist,
        }
        for task in range(first, first + ntasks)
    ]


def open_mpi(size: int, port: int) -> list[dict]:
    return [
        {
            "OMPI_COMM_WORLD_RANK": str(rank),
            "OMPI_COMM_WORLD_SIZE": str(size),
            "OMPI_COMM_WORLD_LOCAL_RANK": str(rank),
            "OMPI_COMM_WORLD_LOCAL_SIZE": str(size),
            "MASTER_PORT": str(port),
        }
        for rank in range(size)
    ]


def mpich(size: int, port: int) -> list[dict]:
    return [
        {"PMI_RANK": str(r), "PMI_SIZE": str(size), "MPI_LOCALRANKID": str(r), "MPI_LOCALNRANKS": str(size)}
        | {"MASTER_PORT": str(port)}
        for r in range(size)
    ]


def run_tasks(programs, phases_per_task: list[list[dict]], timeout: float = 120) -> list[list[dict]]:
    """Each task's phases (tests/launcher_worker.py) on a process of its own, forked from the module's interpreter
    that imported torch and ddpkit (tests/helpers.py's ProgramForker); each task's results."""
    started = [programs.start([WORKER, json.dumps(phases)], env=bare_environment()) for phases in phases_per_task]
    results = []
    for task in started:
        finished = programs.wait(task, timeout)
        assert finished.returncode == 0, finished.stderr
        results.append([json.loads(line) for line in finished.stdout.splitlines() if line.startswith("{")])
    return results


def group(environments: list[dict], backend: str = "gloo", timeout: float = 30.0) -> list[dict]:
    return [{"env": env, "backend": backend, "timeout": timeout} for env in environments]


def test_launchers_variables_alone_form_one_group_on_one_host(programs):
    """4 processes, each given one launcher's variables and nothing else, phase after phase: srun of 4 tasks
    (on the "ddpkit" backend), then srun of 2 beside Open MPI's mpirun of 2, then MPICH's of 2 beside a job
    whose variables say 2 tasks and no address, then srun of 4 whose node list names no host that resolves."""
    host = socket.gethostname()
    srun4, srun2 = srun(4, free_slurm_job_id(), host), srun(2, free_slurm_job_id(), host)
    ompi, pmi = open_mpi(2, free_port()), mpich(2, free_port())
    nowhere = [{k: v for k, v in env.items() if k != "OMPI_COMM_WORLD_LOCAL_SIZE"} for env in open_mpi(2, 1)]
    unresolved = srun(4, "7", "nosuchnode[1-2].invalid")
    phases = [
        group(srun4, "ddpkit"),
        group(srun2) + group(ompi),
        group(pmi) + group(nowhere),
        group(unresolved),
    ]
    tasks = run_tasks(programs, [[phase[task] for phase in phases] for task in range(4)])
    formed = {  # per phase, the (launcher, rank, size, local rank, sum) of each task
        phase: [tuple(t[phase].get(k) for k in ("launcher", "rank", "world_size", "local_rank", "sum")) for t in tasks]
        for phase in range(3)
    }
    assert formed[0] == [("slurm", r, 4, r, 10.0) for r in range(4)]
    assert formed[1] == [("slurm", r, 2, r, 3.0) for r in range(2)] + [("openmpi", r, 2, r, 3.0) for r in range(2)]
    assert formed[2][:2] == [("pmi", r, 2, r, 3.0) for r in range(2)]
    for task in (2, 3):
        assert "ValueError: ddpkit: openmpi says this job has 2 tasks" in tasks[task][2]["error"]
        assert "set MASTER_ADDR" in tasks[task][2]["error"]
    for task in range(4):  # never a group of one: every task raises at once
        assert "does not resolve" in tasks[task][3]["error"] and "nosuchnode1.invalid" in tasks[task][3]["error"]
        assert tasks[task][3]["seconds"] < 30


# --- across 2 simulated hosts -----------------------------------------------------------------------------


def on_two_hosts(tmp_path: Path, phases_per_task: list[list[dict]], timeout: float = 120) -> list[list[dict]]:
    """Tasks 0-1 on simulated host 0 and 2-3 on host 1 (HostPool's network: its namespaces and bridge), each
    host with its own /dev/shm, hostname (node1, node2) and /etc/hosts naming both; each task's results."""
    pool = HostPool([2, 2])
    names = tmp_path / "hosts"
    names.write_text(f"127.0.0.1 localhost\n{HostPool.SUBNET}.1 node1\n{HostPool.SUBNET}.2 node2\n")
    launchers = []
    try:
        pool._make_network()  # the hosts alone: these tasks are not the pool's ranks
        forker = ProgramForker.write_script(tmp_path / "forker.py")
        env = {**bare_environment(), "GLOO_SOCKET_IFNAME": "dkh"}
        for host in range(2):
            # The host's two tasks forked from one interpreter that imported torch and ddpkit (ProgramForker's).
            requests = tmp_path / f"host{host}.requests"
            requests.write_text(
                "".join(
                    json.dumps(
                        ProgramForker.request(
                            [WORKER, json.dumps(phases_per_task[task])],
                            tmp_path / f"task{task}.out",
                            tmp_path / f"task{task}.err",
                            env=env,
                        )
                    )
                    + "\n"
                    for task in (2 * host, 2 * host + 1)
                )
            )
            script = (
                f"mount -t tmpfs tmpfs /dev/shm && mount --bind {names} /etc/hosts && hostname node{host + 1} && "
                f"{shlex.quote(sys.executable)} {forker} < {requests} > /dev/null"
            )
            launchers.append(
                subprocess.Popen(
                    pool._on_host(host, script),
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    start_new_session=True,
                )
            )
        communicate_all(launchers, timeout)
    finally:
        pool.kill()
    results = []
    for task in range(4):
        out = (tmp_path / f"task{task}.out").read_text()
        results.append([json.loads(line) for line in out.splitlines() if line.startswith("{")])
        assert len(results[-1]) == len(phases_per_task[task]), (tmp_path / f"task{task}.err").read_text()
    return results


@needs_hosts
def test_launchers_variables_alone_form_one_group_across_two_hosts(tmp_path):
    """srun of 4 tasks (2 per node, "ddpkit" backend: shared memory inside a host, its ring across), Open MPI's
    mpirun of 4 with MASTER_ADDR, then srun of 2 (one per node) whose node list names node 2 first, where
    nobody listens: both tasks raise once the timeout has passed."""
    job_id = str(random.randrange(10**6, 10**7))
    slurm = [
        {
            "SLURM_PROCID": str(task),
            "SLURM_NTASKS": "4",
            "SLURM_LOCALID": str(task % 2),
            "SLURM_NODEID": str(task // 2),
            "SLURM_NNODES": "2",
            "SLURM_JOB_ID": job_id,
            "SLURM_JOB_NODELIST": "node[1-2]",
        }
        for task in range(4)
    ]
    ompi = [
        {
            "OMPI_COMM_WORLD_RANK": str(task),
            "OMPI_COMM_WORLD_SIZE": "4",
            "OMPI_COMM_WORLD_LOCAL_RANK": str(task % 2),
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
            "MASTER_ADDR": "node1",
            "MASTER_PORT": "29411",
        }
        for task in range(4)
    ]
    # rank 0 on node 1, rank 1 on node 2 (tasks 0 and 2); the list names node 2 first
    reversed_list = {
        task: {**slurm[0], "SLURM_PROCID": str(task // 2), "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "node[2,1]"}
        for task in (0, 2)
    }
    timeout = 5.0
    slurm_phase, ompi_phase = group(slurm, "ddpkit", HOSTS_GROUP_TIMEOUT_S), group(ompi, "gloo", HOSTS_GROUP_TIMEOUT_S)
    nowhere = {task: group([env], timeout=timeout) for task, env in reversed_list.items()}
    tasks = on_two_hosts(tmp_path, [[slurm_phase[t], ompi_phase[t], *nowhere.get(t, [])] for t in range(4)])
    fields = ("launcher", "rank", "world_size", "local_rank", "sum")
    assert [tuple(t[0][k] for k in fields) for t in tasks] == [("slurm", r, 4, r % 2, 10.0) for r in range(4)]
    assert [tuple(t[1][k] for k in fields) for t in tasks] == [("openmpi", r, 4, r % 2, 10.0) for r in range(4)]
    for task in reversed_list:
        error, seconds = tasks[task][2]["error"], tasks[task][2]["seconds"]
        assert "could not meet the others at node2:" in error and "the first host of SLURM_JOB_NODELIST" in error
        assert timeout <= seconds < 4 * timeout, seconds


# --- a real mpirun (MPICH's Hydra) against torchrun ----------------------------------------------------------


def one_short_epoch() -> list[str]:
    """docs/clusters.md's one-host mpirun command's train.py and options, without its --out."""
    argv = documented_mpirun()
    argv = argv[argv.index("train.py") :]
    out = argv.index("--out")
    return argv[:out] + argv[out + 2 :]


@needs_fashion_mnist
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="apt-get install mpich (scripts/setup.sh does)")
@pytest.mark.parametrize("n", [2, pytest.param(4, marks=pytest.mark.slow)])  # 4: the same path, for make test-full
def test_mpirun_trains_as_torchrun_does(tmp_path, n):
    """train.py for one short epoch (docs/clusters.md's command) under MPICH's mpirun and under torchrun, with
    n processes: the same model, bit for bit, and the same losses. Both jobs run at once."""
    jobs = {}
    jobs["torchrun", n] = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(n)]
    jobs["torchrun", n] += ["--master_port", str(free_port())]
    jobs["mpirun", n] = ["mpirun", "-n", str(n), "-genv", "MASTER_PORT", str(free_port()), sys.executable]
    processes = {
        (launcher, n): subprocess.Popen(
            [*argv, *one_short_epoch(), "--out", str(tmp_path / f"{launcher}{n}")],
            cwd=REPO,
            env=bare_environment(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for (launcher, n), argv in jobs.items()
    }
    outputs = dict(zip(processes, communicate_all(list(processes.values()), timeout=240)))
    for job, process in processes.items():
        assert process.returncode == 0, f"{job}: {outputs[job][0][-4000:]}"
    runs = {launcher: tmp_path / f"{launcher}{n}" for launcher in ("torchrun", "mpirun")}
    metrics = {launcher: json.loads((run / "metrics.json").read_text()) for launcher, run in runs.items()}
    assert metrics["mpirun"]["world_size"] == metrics["torchrun"]["world_size"] == n
    losses = {
        launcher: ([s["local_loss"] for s in m["history"]["steps"]], m["final_test_loss"], m["final_test_accuracy"])
        for launcher, m in metrics.items()
    }
    assert losses["mpirun"] == losses["torchrun"]
    models = {launcher: torch.load(run / "model.pt") for launcher, run in runs.items()}
    assert models["mpirun"].keys() == models["torchrun"].keys()
    assert all(torch.equal(models["mpirun"][k], models["torchrun"][k]) for k in models["torchrun"])
    assert sum("test loss" in line for line in outputs["mpirun", n][0].splitlines()) == 1  # rank 0 logs
