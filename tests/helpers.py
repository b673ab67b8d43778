"""What more than one test module uses: inputs and their references, errors and bits as tests compare
them, the "ddpkit" backend's comparison with gloo, the calls one rank rejects, every collective across
hosts and its check, ports, programs forked from an interpreter that imported torch, the training
script's small runs, Fashion-MNIST uncompressed, CIFAR archives, the examples' commands, and the leak check.

Test modules import from here, never from each other (a test module imported by another runs its
module-level code twice and couples their fixtures)."""

import ast
import functools
import gzip
import io
import json
import os
import pickle
import re
import select
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

import ddpkit
from ddpkit.comm import ONE_HOST_ALGORITHMS
from ddpkit.testing import HostPool, WorkerPool, torchft_hosts  # noqa: F401  (torchft_hosts: the tests' import)
from ddpkit.training.data import FASHION_MNIST_ROOT

REPO = Path(__file__).resolve().parent.parent
TRAIN = REPO / "train.py"
EXAMPLES = sorted((REPO / "examples").glob("*.py"))

# Simulated hosts (conftest's ``hosts`` fixture): namespaces need root, as CI has.
needs_hosts = pytest.mark.skipif(HostPool.unavailable() is not None, reason=str(HostPool.unavailable()))
HOSTS_GROUP_TIMEOUT_S = 15.0
TOPOLOGIES = {"2x2": [2, 2], "2x1": [1, 1], "3x1": [1, 1, 1], "1+3": [1, 3]}


# --- the leak check ------------------------------------------------------------------------------


def shm_names(pids=None) -> set:
    """Names in /dev/shm that ddpkit made ("ddpkit-<pid>-..."), of the processes ``pids`` if given.

    ddpkit's segments are anonymous (Note [Shared-memory segment]): they vanish with the last process
    that maps them, so a name here is the one thing a process can leave behind. conftest's session
    check applies it (and its ``hosts`` fixture asks each simulated host's private /dev/shm to be
    empty); tests of set-up and teardown add their own in-process measure (memfd mappings and
    descriptors, threads)."""
    shm = Path("/dev/shm")
    names = set()
    for entry in shm.iterdir() if shm.is_dir() else []:
        match = re.match(r"ddpkit-(\d+)-", entry.name)
        if match and (pids is None or int(match.group(1)) in pids):
            names.add(entry.name)
    return names


# --- collective inputs and their float64 references ----------------------------------------------


def rank_input(rank, numel, dtype=torch.float32, integer=False, seed=0):
    generator = torch.Generator().manual_seed(seed * 1000 + rank)
    if integer:
        return torch.randint(-1000, 1000, (numel,), generator=generator).to(dtype)
    return torch.randn(numel, generator=generator, dtype=torch.float64).to(dtype)


def all_inputs(world_size, numel, **kwargs):
    return torch.stack([rank_input(r, numel, **kwargs).double() for r in range(world_size)])


@functools.cache  # a test compares many ranks' and algorithms' results with one reference (never changed in place)
def reference(world_size, numel, op, **kwargs):
    stacked = all_inputs(world_size, numel, **kwargs)
    return {"sum": stacked.sum(0), "mean": stacked.mean(0), "max": stacked.amax(0), "min": stacked.amin(0)}[op]


def algorithms_for(transport: str) -> list[str]:
    # "direct" reads peers' slots: shared memory only.
    return [a for a in ONE_HOST_ALGORITHMS if transport == "shm" or a != "direct"]


# --- errors and bits, as tests compare them --------------------------------------------------------


def attempt(fn, *args, **kwargs) -> tuple:
    """(None, ``fn(*args, **kwargs)``'s result), or (the exception it raised as "Type: message", None)."""
    try:
        return None, fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the test reads the message
        return f"{type(exc).__name__}: {exc}", None


def caught(fn, *args, **kwargs):
    """The exception ``fn(*args, **kwargs)`` raised, as "Type: message", or None where it returned."""
    return attempt(fn, *args, **kwargs)[0]


_INTEGER_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(tensor):
    """The tensor's elements as the integers of their bits, for comparisons where NaN must equal NaN
    (of the same payload) and -0.0 differ from 0.0."""
    return tensor.view(_INTEGER_OF_WIDTH[tensor.element_size()])


def ieee_extremum(inputs, op):
    """Note [Reductions]'s max or min ("max", "min") over the ranks' ``inputs``, as IEEE 754-2019's
    maximum and minimum: the quiet NaN where any input is NaN, and +0 above -0."""
    stacked = torch.stack(inputs)
    result = stacked.amax(0) if op == "max" else stacked.amin(0)
    if not stacked.dtype.is_floating_point:
        return result
    zeros = stacked == 0
    signed = torch.signbit(stacked)
    if op == "max":  # +0 where any zero operand is +0
        zero = torch.where((zeros & ~signed).any(0), 0.0, -0.0).to(stacked.dtype)
    else:  # -0 where any zero operand is -0
        zero = torch.where((zeros & signed).any(0), -0.0, 0.0).to(stacked.dtype)
    result = torch.where(result == 0, zero, result)
    return torch.where(torch.isnan(stacked).any(0), torch.tensor(float("nan"), dtype=stacked.dtype), result)


# --- the "ddpkit" backend against gloo (tests/test_backend_*.py) ------------------------------------

RED = dist.ReduceOp
_GLOO = None


def gloo_group():
    """A gloo group of every rank, made once per worker (collectively, on the first call)."""
    global _GLOO
    if _GLOO is None:
        _GLOO = dist.new_group(backend="gloo")
    return _GLOO


def values(rank, shape, dtype=torch.float32, salt=0, low=-50, high=51):
    """Integer-valued inputs: sums over 5 ranks (|x| <= 250) are exact in every dtype, bfloat16 included."""
    generator = torch.Generator().manual_seed(salt * 1000 + rank)
    return torch.randint(low, high, shape, generator=generator).to(dtype)


def both(fn):
    """(fn on the "ddpkit" world group, fn on the gloo group)."""
    return fn(None), fn(gloo_group())


def quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


def all_reduced(tensor, op, group):
    dist.all_reduce(tensor, op=op, group=group)
    return tensor


def batch(rank, step, size=16):
    """Rank ``rank``'s batch at ``step``: ``size`` samples of 8 features, and labels in 0..3."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(size, 8, generator=generator), torch.randint(0, 4, (size,), generator=generator)


def assert_same(ours, theirs, key, exact=True):
    if isinstance(ours, torch.Tensor):
        assert isinstance(theirs, torch.Tensor), key
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, (key, ours.dtype, ours.shape, theirs.shape)
        if exact:
            assert torch.equal(ours, theirs), f"{key}: ddpkit {ours} != gloo {theirs}"
        else:
            torch.testing.assert_close(ours, theirs, msg=str(key))
    elif isinstance(ours, (list, tuple)):
        assert isinstance(theirs, (list, tuple)) and len(ours) == len(theirs), (key, ours, theirs)
        for a, b in zip(ours, theirs):
            assert_same(a, b, key, exact)
    else:
        assert ours == theirs, (key, ours, theirs)


def check_against_gloo(per_rank):
    for rank, results in enumerate(per_rank):
        for key, (ours, theirs) in results.items():
            # a mean is one division away from gloo's sum / n: within one rounding of it
            exact = not (key == "reduce_scatter_tensor_avg" or (isinstance(key, tuple) and key[0] == "all_reduce_avg"))
            assert_same(ours, theirs, (rank, key), exact=exact)


def run_on_a_fresh_pool(fn, *args):
    """fn on 3 fresh "ddpkit" ranks with a short group timeout, for calls that may hang or break the group."""
    worker_pool = WorkerPool(3, backend="ddpkit", timeout=60.0, group_timeout=5.0)
    try:
        return worker_pool.run(fn, *args, timeout=40, return_exceptions=True)
    finally:
        worker_pool.close()


# --- one rank rejects its arguments: every rank raises, the next call pairs ------------------------


def _syncbn_bad_weight(rank):
    name = dist.group.WORLD.group_name
    weight = torch.ones(4 if rank != 1 else 5)
    torch.ops.ddpkit.sync_batch_norm(torch.randn(8, 4), weight, None, None, None, True, 0.1, 1e-5, "auto", name)


def _a2a_bad_splits(rank):
    n = dist.get_world_size()
    output, data = torch.empty(n * 2), torch.ones(n * 2)
    splits = [2] * n if rank != 1 else [3] * n
    dist.all_to_all_single(output, data, output_split_sizes=[2] * n, input_split_sizes=splits)


def _coalesced_gather_bad_sizes(rank):
    n = dist.get_world_size()
    with dist._coalescing_manager():
        dist.all_gather_into_tensor(torch.empty(n * 3 + (rank == 1)), torch.ones(3))


ONE_RANK_REJECTS = {
    "op": lambda rank: ddpkit.all_reduce(torch.ones(8), op="prod" if rank == 1 else "sum"),
    "algorithm": lambda rank: ddpkit.all_reduce(torch.ones(8), algorithm="telepathy" if rank == 1 else "auto"),
    "transport": lambda rank: ddpkit.all_reduce(torch.ones(8), transport="pigeon" if rank == 1 else "auto"),
    "torch_op": lambda rank: ddpkit.reduce_scatter_tensor(
        torch.empty(2), torch.ones(4), op=dist.ReduceOp.PRODUCT if rank == 1 else "sum"
    ),
    "meta": lambda rank: ddpkit.broadcast(torch.ones(8, device="meta" if rank == 1 else "cpu"), src=0),
    "syncbn_weight": _syncbn_bad_weight,
}


BACKEND_ONE_RANK_REJECTS = {
    "all_to_all_splits": _a2a_bad_splits,
    "coalesced_all_gather": _coalesced_gather_bad_sizes,
}


def call_each_then_all_reduce(calls, kinds):
    """Per kind: this rank's error from ``calls[kind](rank)``, or None, then the group's next
    all-reduce of 10**rank."""
    rank = dist.get_rank()
    out = {}
    for kind in kinds:
        try:
            calls[kind](rank)
            error = None
        except (RuntimeError, ValueError) as exc:
            error = str(exc)
        after = torch.full((1000,), 10.0**rank)
        ddpkit.all_reduce(after)
        out[kind] = (error, after[0].item())
    return out


def error_and_untouched(call, numel):
    """``call(tensor)`` on a tensor of ``numel`` elements of this rank + 1: its error, or None, and
    whether the tensor still holds its values (a call that raised must have moved nothing into it)."""
    rank = dist.get_rank()
    tensor = torch.full((numel,), float(rank + 1))
    try:
        call(tensor)
        error = None
    except RuntimeError as exc:
        error = str(exc)
    return error, bool((tensor == rank + 1).all())


# --- every collective across hosts, and a mismatch of one (test_multihost*.py) ------------------------


DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64)


def expected_hosts(ranks_per_host):
    hosts, first = [], 0
    for count in ranks_per_host:
        hosts.append(tuple(range(first, first + count)))
        first += count
    return tuple(hosts)


def case_every_collective(numels, group=None):
    """Every collective, dtype and size; integer-valued inputs, so that every result is exact."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    on = {"group": group}
    out = {"topology": ddpkit.comm.topology(group)}
    for dtype in DTYPES:
        ops = ("sum", "max", "min") + (("mean",) if dtype.is_floating_point else ())
        sizes = numels if dtype == torch.float32 else numels[:3]
        for numel in sizes:
            for op in ops:
                for algorithm in ("auto", "ring"):
                    tensor = rank_input(rank, numel, integer=True).to(dtype)
                    ddpkit.all_reduce(tensor, op=op, algorithm=algorithm, **on)
                    out[("all_reduce", str(dtype), numel, op, algorithm)] = tensor
            for root in (0, world_size - 1):
                tensor = rank_input(rank, numel, integer=True).to(dtype)
                ddpkit.broadcast(tensor, src=root, **on)
                out[("broadcast", str(dtype), numel, root)] = tensor
                tensor = rank_input(rank, numel, integer=True).to(dtype)
                ddpkit.reduce(tensor, dst=root, **on)
                out[("reduce", str(dtype), numel, root)] = tensor if rank == root else None
            gathered = torch.empty(world_size * numel, dtype=dtype)
            ddpkit.all_gather_into_tensor(gathered, rank_input(rank, numel, integer=True).to(dtype), **on)
            out[("all_gather", str(dtype), numel)] = gathered
            scattered = torch.empty(numel, dtype=dtype)
            ddpkit.reduce_scatter_tensor(scattered, rank_input(rank, world_size * numel, integer=True).to(dtype), **on)
            out[("reduce_scatter", str(dtype), numel)] = scattered
    ddpkit.barrier(**on)
    return out


def reference_of(key, world_size, inputs=None):
    """The expected result of case_every_collective's ``key`` (the whole reduced tensor for a reduce-scatter),
    from ``inputs``, the ranks' inputs stacked in float64, when given."""
    kind, dtype_name, numel = key[0], key[1], key[2]
    dtype = next(d for d in DTYPES if str(d) == dtype_name)
    if inputs is None:
        width = world_size * numel if kind == "reduce_scatter" else numel
        inputs = torch.stack([rank_input(r, width, integer=True).to(dtype).double() for r in range(world_size)])
    if kind == "all_reduce":
        op = key[3]
        reduced = {"sum": inputs.sum, "max": inputs.amax, "min": inputs.amin, "mean": inputs.mean}[op](0)
        return reduced.to(dtype)
    if kind == "broadcast":
        return inputs[key[3]].to(dtype)
    if kind in ("reduce", "reduce_scatter"):
        return inputs.sum(0).to(dtype)
    if kind == "all_gather":
        return inputs.reshape(-1).to(dtype)
    raise KeyError(kind)


def check_every_collective(per_rank, ranks_per_host):
    """Every rank's results of case_every_collective exact, and alike where every rank holds the whole
    result. Key by key: each key's reference is computed once for all ranks, from the ranks' inputs
    generated once for the keys of one dtype and size (the check costs the parent little beside the ranks)."""
    world_size = len(per_rank)
    for rank, out in enumerate(per_rank):
        assert out["topology"].hosts == expected_hosts(ranks_per_host), out["topology"]
        assert out.keys() == per_rank[0].keys(), f"rank {rank}'s results differ from rank 0's in their keys"
    inputs = {}  # only the last dtype and width's
    for key in per_rank[0]:
        if key == "topology":
            continue
        numel, dtype = key[2], next(d for d in DTYPES if str(d) == key[1])
        width = world_size * numel if key[0] == "reduce_scatter" else numel
        if (dtype, width) not in inputs:
            stacked = [rank_input(r, width, integer=True).to(dtype).double() for r in range(world_size)]
            inputs = {(dtype, width): torch.stack(stacked)}
        reference = reference_of(key, world_size, inputs[dtype, width])
        for rank, out in enumerate(per_rank):
            tensor = out[key]
            if tensor is None:
                continue
            expected = reference[rank * numel : (rank + 1) * numel] if key[0] == "reduce_scatter" else reference
            if key[0] == "all_reduce" and key[3] == "mean":
                # within a rounding of the exact mean; equal is close at once (half precision's closeness is slow)
                if not torch.equal(tensor, expected):
                    half = key[1] in (str(torch.float16), str(torch.bfloat16))
                    tolerances = {"rtol": 1e-2, "atol": 1e-2} if half else {"rtol": 1e-6, "atol": 1e-5}
                    torch.testing.assert_close(tensor, expected, **tolerances, msg=str(key))
                assert torch.equal(bits(tensor), bits(per_rank[0][key])), (
                    f"{key}: rank {rank}'s bits differ from rank 0's"
                )
            elif key[0] in ("all_reduce", "broadcast", "all_gather"):
                # the reference's bits: exact, and the same bits on every rank
                assert torch.equal(bits(tensor), bits(expected)), f"{key}: rank {rank}'s bits are not the reference's"
            else:
                assert torch.equal(tensor, expected), (rank, key)


def case_mismatch(culprit, collective="all_reduce"):
    """Rank ``culprit`` calls ``collective`` with another size (another root for broadcast and
    reduce; the broadcast's on the last host, so that the ranks disagree on the root's host): this
    rank's error, or None, then the group's next all-reduce."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    odd = rank == culprit
    try:
        if collective == "all_reduce":
            ddpkit.all_reduce(torch.ones(1000 + odd))
        elif collective == "broadcast":
            ddpkit.broadcast(torch.ones(10), src=world_size - 1 if odd else 0)
        elif collective == "reduce":
            ddpkit.reduce(torch.ones(10), dst=1 if odd else 0)
        elif collective == "all_gather":
            ddpkit.all_gather_into_tensor(torch.empty(world_size * (10 + odd)), torch.ones(10 + odd))
        else:
            ddpkit.reduce_scatter_tensor(torch.empty(10 + odd), torch.ones(world_size * (10 + odd)))
        error = None
    except RuntimeError as exc:
        error = str(exc)
    after = torch.full((10_000,), float(rank))
    ddpkit.all_reduce(after)  # the group survives a detected mismatch
    return error, after[0].item()


def case_all_reduces(count=5, numel=1000):
    for _ in range(count):
        ddpkit.all_reduce(torch.ones(numel))


# --- processes: ports, train.py, the examples --------------------------------------------------------


def communicate_all(processes: list, timeout: float) -> list[tuple[str, str]]:
    """Each process's (stdout, stderr), waiting up to `timeout` seconds for each; however that ends, none is
    left running (each started with start_new_session=True: its whole session is killed)."""
    try:
        return [process.communicate(timeout=timeout) for process in processes]
    finally:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


# The interpreter ProgramForker starts: it imports torch and ddpkit once, then forks each program asked of it
# (one JSON line on stdin: argv, cwd, env, umask and the files for stdout and stderr) and answers with its pid;
# asked {"wait": pid}, it answers with that program's exit status once it has ended; at the end of its input it
# waits for every program still running (so a file of requests runs them side by side). The child runs the script or
# module as `python ARGV` does, as __main__ with sys.argv and sys.path[0] set, and ends as a script ends: an
# uncaught exception prints its traceback and exits 1, sys.exit's code is the status, and the interpreter
# finalizes (atexit's handlers run).
_FORKER = textwrap.dedent(r"""
    import json, os, runpy, sys
    import torch, ddpkit

    for line in sys.stdin:
        request = json.loads(line)
        if "wait" in request:
            print(json.dumps(os.waitstatus_to_exitcode(os.waitpid(request["wait"], 0)[1])), flush=True)
            continue
        pid = os.fork()
        if pid == 0:
            os.chdir(request["cwd"])
            os.umask(request["umask"])
            os.environ.clear()
            os.environ.update(request["env"])
            for fd, path in ((0, os.devnull), (1, request["out"]), (2, request["err"])):
                opened = os.open(path, os.O_RDONLY if fd == 0 else os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(opened, fd)
                os.close(opened)
            if request["argv"][0] == "-m":
                sys.argv, sys.path[0] = request["argv"][1:], os.getcwd()
                runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
            else:
                sys.argv, sys.path[0] = request["argv"], os.path.dirname(os.path.abspath(request["argv"][0]))
                runpy.run_path(sys.argv[0], run_name="__main__")
            sys.exit(0)  # the script's end
        print(json.dumps(pid), flush=True)
    while True:
        try:
            os.wait()
        except ChildProcessError:
            break
""")


class ProgramForker:
    """Runs programs as ``python SCRIPT ARGS`` (or ``python -m MODULE ARGS``) runs them, each a process of its own,
    forked from one interpreter that imported torch and ddpkit (as the pools' forkserver does): a program's run,
    its output and exit status, without the seconds a fresh interpreter takes to import torch each time. For the
    tests of what a program does; a launcher under test starts fresh interpreters."""

    def __init__(self, folder: Path):
        self.folder, self.runs, self.process = folder, 0, None
        self.write_script(folder / "forker.py")

    def _ask(self, request: dict, timeout: float):
        if self.process is None or self.process.poll() is not None:  # the first request, or after a timeout
            self.close()
            self.process = subprocess.Popen(
                [sys.executable, str(self.folder / "forker.py")],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=open(self.folder / "forker.err", "w"),  # noqa: SIM115 - the process holds it
                text=True,
                start_new_session=True,
            )
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        ready, _, _ = select.select([self.process.stdout], [], [], timeout)
        line = self.process.stdout.readline() if ready else ""
        if not line:  # every program still running goes with the forker's session
            self.close()
            raise TimeoutError(f"{request}: no answer within {timeout} s ({(self.folder / 'forker.err').read_text()})")
        return json.loads(line)

    def start(self, argv: list, cwd=None, env=None, umask=None) -> tuple:
        """Starts ``argv`` (a script's path or ``-m MODULE``, then its arguments) in ``cwd`` with ``env`` and
        ``umask`` (by default this process's); the handle that wait takes."""
        self.runs += 1
        out, err = (self.folder / f"{self.runs}.{name}" for name in ("out", "err"))
        pid = self._ask(self.request(argv, out, err, cwd, env, umask), timeout=60)
        return argv, pid, out, err

    @staticmethod
    def request(argv: list, out: Path, err: Path, cwd=None, env=None, umask=None) -> dict:
        """The forker's request to run ``argv`` (see start), its stdout and stderr written to ``out`` and ``err``."""
        if umask is None:
            umask = os.umask(0)
            os.umask(umask)
        return {
            "argv": [str(a) for a in argv],
            "cwd": str(cwd or os.getcwd()),
            "env": dict(env or os.environ),
            "umask": umask,
            "out": str(out),
            "err": str(err),
        }

    @staticmethod
    def write_script(path: Path) -> Path:
        """The forker's program at ``path``: ``python PATH < REQUESTS`` runs a file of requests side by side."""
        path.write_text(_FORKER)
        return path

    def wait(self, started: tuple, timeout=120) -> subprocess.CompletedProcess:
        """The started program's exit status and output once it has ended (within ``timeout`` seconds, or it is
        killed, with every other program running, and TimeoutError raised)."""
        argv, pid, out, err = started
        status = self._ask({"wait": pid}, timeout)
        return subprocess.CompletedProcess(argv, status, out.read_text(), err.read_text())

    def run(self, argv: list, cwd=None, env=None, umask=None, timeout=120) -> subprocess.CompletedProcess:
        return self.wait(self.start(argv, cwd, env, umask), timeout)

    def close(self):
        if self.process is None:
            return
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        self.process.stdin.close()
        self.process.stdout.close()
        self.process = None


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


needs_fashion_mnist = pytest.mark.skipif(
    not Path(FASHION_MNIST_ROOT).is_dir(), reason="apt-get install dataset-fashion-mnist (scripts/setup.sh does)"
)


def uncompressed_fashion_mnist(directory: Path) -> Path:
    """``directory`` holding Fashion-MNIST's four IDX files uncompressed: the installed data, which a run
    then loads without inflating the gzip streams (about half a second of CPU on every rank of every run)."""
    directory.mkdir(parents=True, exist_ok=True)
    for packed in Path(FASHION_MNIST_ROOT).glob("*-ubyte.gz"):
        with gzip.open(packed, "rb") as source, open(directory / packed.stem, "wb") as target:
            shutil.copyfileobj(source, target)
    return directory


def make_trainer(config):
    """train.py's Trainer of ``config`` on this pool rank's process group, as the program makes it."""
    from ddpkit.launch import DistInfo
    from ddpkit.training.train import Trainer

    return Trainer(config, DistInfo(dist.get_rank(), dist.get_world_size(), dist.get_rank(), "gloo"))


def small_cli(out_dir):
    return [
        "--dataset",
        "fashion_mnist",
        "--limit-train",
        "1024",
        "--limit-test",
        "500",
        "--batch-size",
        "32",
        "--max-steps",
        "4",
        "--epochs",
        "1",
        "--no-progress",
        "--out",
        str(out_dir),
    ]


def documented_mpirun() -> list[str]:
    """docs/clusters.md's one-host mpirun command, the one of its mpirun commands that runs here, as argv:
    tests/test_launchers.py runs it (with 2 processes, and 4 in make test-full, against torchrun),
    tests/test_readme.py does not."""
    lines = [
        line
        for line in (REPO / "docs" / "clusters.md").read_text().splitlines()
        if line.startswith("mpirun -n 2 .venv/bin/python train.py ")
    ]
    assert len(lines) == 1, lines
    return shlex.split(lines[0])


def documented_commands(path: Path) -> list[list[str]]:
    """The torchrun lines of the example's docstring, as argv (environment assignments first, if any):
    one for most examples, one per launch for those of several (fault_tolerance)."""
    docstring = ast.get_docstring(ast.parse(path.read_text()))
    return [
        shlex.split(line.strip())
        for line in docstring.splitlines()
        if re.fullmatch(r"([A-Z_]+=\S+ )*torchrun .* examples/\w+\.py", line.strip())
    ]


# --- CIFAR archives in the official format ----------------------------------------------------------

CIFAR_LAYOUT = {
    # name: (top directory, archive, train members, test members, label key, classes)
    "cifar10": (
        "cifar-10-batches-py",
        "cifar-10-python.tar.gz",
        [f"data_batch_{i}" for i in range(1, 6)],
        ["test_batch"],
        b"labels",
        10,
    ),
    "cifar100": ("cifar-100-python", "cifar-100-python.tar.gz", ["train"], ["test"], b"fine_labels", 100),
}


def cifar_batch(n: int, label_key: bytes, classes: int, rng) -> tuple[bytes, np.ndarray, np.ndarray]:
    """A pickled batch in the official format, and the images [n, 3, 32, 32] and labels it encodes."""
    images = rng.integers(0, 256, (n, 3, 32, 32), dtype=np.uint8)
    labels = rng.integers(0, classes, n)
    # Each row is the red plane, then the green, then the blue, each row-major.
    rows = np.stack([np.concatenate([image[0].ravel(), image[1].ravel(), image[2].ravel()]) for image in images])
    batch = {
        b"batch_label": b"training batch",
        b"data": rows,
        label_key: labels.tolist(),
        b"filenames": [b"img_%d.png" % i for i in range(n)],
    }
    if label_key == b"fine_labels":
        batch[b"coarse_labels"] = (labels // 5).tolist()
    return pickle.dumps(batch, protocol=2), images, labels


def write_cifar(root: Path, name: str, as_archive: bool, seed: int = 0, skip: tuple = ()) -> dict:
    top, archive, train_members, test_members, label_key, classes = CIFAR_LAYOUT[name]
    rng = np.random.default_rng(seed)
    files, expected = {}, {}
    for split, members in (("train", train_members), ("test", test_members)):
        parts = []
        for member in members:
            payload, images, labels = cifar_batch(int(rng.integers(2, 5)), label_key, classes, rng)
            if member not in skip:
                files[f"{top}/{member}"] = payload
            parts.append((images, labels))
        expected[split] = (np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]))
    files[f"{top}/batches.meta" if name == "cifar10" else f"{top}/meta"] = pickle.dumps({b"label_names": []}, 2)
    root.mkdir(parents=True, exist_ok=True)
    if as_archive:
        with tarfile.open(root / archive, "w:gz") as tar:
            for member, payload in files.items():
                info = tarfile.TarInfo(member)
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))
    else:
        for member, payload in files.items():
            (root / member).parent.mkdir(parents=True, exist_ok=True)
            (root / member).write_bytes(payload)
    return expected


# --- SyncBatchNorm against BatchNorm (test_syncbn*.py, test_cuda.py) --------------------------------


def even_sizes(batch, world_size):
    return [len(chunk) for chunk in torch.arange(batch).tensor_split(world_size)]


def shard(x, sizes, rank):
    start = sum(sizes[:rank])
    return x[start : start + sizes[rank]], start


def forward_backward(layer, x, start, half, memory_format=torch.contiguous_format):
    """One step on a shard starting at global index `start`: loss = sum of all outputs of the first
    `half` samples of the global batch. Returns output, input gradient and the comm counters of the
    forward and of the backward."""
    x = x.detach().clone(memory_format=memory_format).requires_grad_()
    ddpkit.reset_comm_counters()
    y = layer(x)
    forward = ddpkit.comm_counters()
    ddpkit.reset_comm_counters()
    y[: max(0, min(start + len(x), half) - start)].sum().backward()
    backward = ddpkit.comm_counters()
    return y.detach(), x.grad, forward, backward


def batch_norm_reference(x, layer, half):
    """`layer` (torch's BatchNorm, usually float64) on the whole batch `x` with loss = sum of the first
    `half` samples' outputs: output and input gradient."""
    x = x.detach().clone().requires_grad_()
    y = layer(x)
    y[:half].sum().backward()
    return y.detach(), x.grad


def small_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1),
        torch.nn.BatchNorm2d(8),
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Linear(8 * 6 * 6, 16),
        torch.nn.BatchNorm1d(16),
        torch.nn.Sequential(torch.nn.Linear(16, 4), torch.nn.BatchNorm1d(4, affine=False, momentum=None)),
    )


# --- DDP test models (test_ddp.py and test_ddp_hooks.py) ------------------------------------------------


class UnusedBranchNet(nn.Module):
    """``rare`` is used only when asked (rank 0's data, in the tests); ``never`` by nobody."""

    def __init__(self, features: int):
        super().__init__()
        self.body = nn.Linear(features, 4)
        self.rare = nn.Linear(features, 4)
        self.never = nn.Linear(features, 4)

    def forward(self, x, use_rare=False):
        out = self.body(x)
        return out + self.rare(x) if use_rare else out


class BufferNet(nn.Module):
    """One layer and a buffer that forward leaves alone (a test makes it drift across ranks)."""

    def __init__(self, features: int):
        super().__init__()
        self.fc = nn.Linear(features, 4)
        self.register_buffer("counter", torch.zeros(3))

    def forward(self, x):
        return self.fc(x)


class FailingBackward(torch.autograd.Function):
    """The identity whose backward raises: a backward that fails below a model's last layer."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("injected failure in backward")
