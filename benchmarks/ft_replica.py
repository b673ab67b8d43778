"""One replica group's training process under torchft: the worker of tests/test_torchft.py and
benchmarks/bench_fault_tolerance.py (docs/fault_tolerance.md has the user-facing example).

Each process is rank RANK of a replica group of WORLD_SIZE ranks (torchrun's variables; without
torchrun, rank 0 hosts the group's store at MASTER_ADDR:MASTER_PORT), replica REPLICA_GROUP_ID,
and trains under ``torchft.Manager`` with the lighthouse at TORCHFT_LIGHTHOUSE until the manager's
step reaches --steps. Every iteration appends one JSON line to --records (what a test replays and a
benchmark times); at the end the model and optimizer state go to --out.

    TORCHFT_LIGHTHOUSE=http://host:29510 REPLICA_GROUP_ID=0 torchrun --nproc-per-node 1 \\
        benchmarks/ft_replica.py --pg ddpkit --steps 20 --records /tmp/r0.jsonl --out /tmp/r0.pt

--wrapper picks the data-parallel wrapper: torchft's DistributedDataParallel ("torchft-ddp", whose
hook waits for each bucket), the same with ddpkit.torchft's hook, which does not wait
("torchft-ddp-async"), ddpkit's with the manager's all-reduce as its communication hook
(ddpkit.torchft.allreduce_hook, "ddpkit-ddp"), or ddpkit's with a
SyncBatchNorm layer whose statistics the manager's quorum shares ("ddpkit-syncbn"). With --exact
(the tests), parameters are float64 and every gradient is rounded to a multiple of 2**-30 before it
is reduced, so that a sum over replicas is exact in any order and a single-process replay of the
same membership schedule gives the same bits.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

LAUNCHED = time.time()  # a (re)started worker's start, torch imported
GRID = 2.0**30
FEATURES, HIDDEN, CLASSES, BATCH = 8, 16, 4, 16


def build_model(kind: str, exact: bool, syncbn: bool = False) -> nn.Module:
    torch.manual_seed(0)
    if kind == "tiny":
        layers: list = [nn.Linear(FEATURES, HIDDEN)]
        if syncbn:
            layers.append(nn.BatchNorm1d(HIDDEN))
        layers += [nn.ReLU(), nn.Linear(HIDDEN, CLASSES)]
        model = nn.Sequential(*layers)
    elif kind == "mlp8x1024":  # the communication-heavy model: 8 linear layers 1024 wide, 8.4M parameters
        model = nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(1024, 1024), nn.ReLU())][:-1])
    else:
        raise ValueError(f"unknown model {kind!r}")
    return model.double() if exact else model


def batch(kind: str, replica: int, step: int, exact: bool) -> tuple:
    """Replica `replica`'s batch at `step`: the same on every run (a replay's too)."""
    generator = torch.Generator().manual_seed(1000 * replica + step)
    width, out = (FEATURES, CLASSES) if kind == "tiny" else (1024, 1024)
    dtype = torch.float64 if exact else torch.float32
    x = torch.randn(BATCH, width, generator=generator, dtype=dtype)
    y = torch.randn(BATCH, out, generator=generator, dtype=dtype)
    return x, y


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(x) - y) ** 2).mean()


def round_gradients(model: nn.Module) -> None:
    """Rounds every gradient to a multiple of 2**-30 as autograd produces it (before any wrapper reduces it)."""
    for p in model.parameters():
        p.register_hook(lambda g: torch.round(g.clamp(-256.0, 256.0) * GRID) / GRID)


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=2.0**-4, momentum=0.5)


def manager_options(
    replica: int, rank: int, world_size: int, addr: str, port: int, timeout: datetime.timedelta
) -> dict:
    """torchft.Manager's settings as this script's replicas and the tests' workers run it: replica group
    ``replica``'s ``rank`` of ``world_size``, one replica enough for a quorum, its store at ``addr``:``port``,
    timeouts from ``timeout`` (the quorum's three times it), no initial sync (every replica builds the
    same model from one seed), and the address its peers reach its manager at
    (ddpkit.testing.torchft_hosts' FT_HOSTNAME: a simulated host's name resolves nowhere)."""
    return dict(
        min_replica_size=1,
        replica_id=f"replica_{replica}",
        timeout=timeout,
        quorum_timeout=timeout * 3,
        connect_timeout=timeout,
        store_addr=addr,
        store_port=port,
        rank=rank,
        world_size=world_size,
        init_sync=False,
        hostname=os.environ.get("FT_HOSTNAME", socket.gethostname()),
    )


def baseline(args) -> None:
    """The no-torchft baseline: one torchrun job of all ranks on the "ddpkit" backend with ddpkit's DDP,
    a checkpoint after every step, resumed from it when torchrun (--max-restarts) restarts the job;
    rank --kill-rank kills itself before step --kill-step of the first attempt."""
    import ddpkit

    rank = int(os.environ["RANK"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    with open(args.records, "a") as log:
        log.write(json.dumps({"launched": LAUNCHED, "attempt": attempt, "pid": os.getpid()}) + "\n")
    timeout = datetime.timedelta(seconds=args.timeout)
    world_size = int(os.environ["WORLD_SIZE"])
    # torchrun's agent keeps its store across restarts: an attempt of its own keys, so that the restarted
    # job never reads the first attempt's addresses (pytorch/pytorch#135712).
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False, timeout=timeout
    )
    dist.init_process_group(
        "ddpkit", store=dist.PrefixStore(f"attempt{attempt}/", store), rank=rank, world_size=world_size, timeout=timeout
    )
    model = build_model(args.model, args.exact)
    optimizer = make_optimizer(model)
    checkpoint = Path(args.out).with_suffix(".ckpt")
    step = 0
    if checkpoint.exists():
        state = torch.load(checkpoint)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
        step = state["step"]
    wrapped = ddpkit.DistributedDataParallel(model, broadcast_buffers=False)
    first_attempt = attempt == 0
    log = open(args.records, "a", buffering=1)
    log.write(json.dumps({"ready": time.time(), "pid": os.getpid()}) + "\n")
    while step < args.steps:
        if first_attempt and rank == args.kill_rank and step == args.kill_step:
            log.write(json.dumps({"killed": time.time(), "step": step}) + "\n")
            os.kill(os.getpid(), signal.SIGKILL)
        started = time.time()
        optimizer.zero_grad()
        x, y = batch(args.model, rank, step, args.exact)
        if args.compute:
            time.sleep(args.compute)
        loss_of(wrapped, x, y).backward()
        optimizer.step()
        step += 1
        if rank == 0:
            partial = checkpoint.with_suffix(".tmp")
            torch.save({"model": model.state_dict(), "optim": optimizer.state_dict(), "step": step}, partial)
            os.replace(partial, checkpoint)
        dist.barrier()
        log.write(
            json.dumps(
                {
                    "replica": rank,
                    "rank": rank,
                    "pid": os.getpid(),
                    "step": step - 1,
                    "committed": True,
                    "participating": True,
                    "participants": dist.get_world_size(),
                    "start": started,
                    "end": time.time(),
                    "errored": None,
                }
            )
            + "\n"
        )
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", action="store_true", help="torchrun --max-restarts with a checkpoint, no torchft")
    parser.add_argument("--kill-rank", type=int, default=-1)
    parser.add_argument("--kill-step", type=int, default=-1)
    # "dummy": torchft's ProcessGroupDummy, which communicates nothing (its all-reduce leaves each replica's
    # gradient as it is): the benchmark's floor, everything of a step but the communication
    parser.add_argument("--pg", choices=["gloo", "ddpkit", "dummy"], default="ddpkit")
    parser.add_argument(
        "--wrapper", choices=["torchft-ddp", "torchft-ddp-async", "ddpkit-ddp", "ddpkit-syncbn"], default="torchft-ddp"
    )
    parser.add_argument("--model", choices=["tiny", "mlp8x1024"], default="tiny")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--compute", type=float, default=0.0, help="seconds of stand-in compute per step")
    parser.add_argument("--timeout", type=float, default=10.0, help="manager and process-group timeout, seconds")
    parser.add_argument("--exact", action="store_true")
    parser.add_argument(
        "--cross-host-dtype",
        choices=["none", "bfloat16"],
        default="none",
        help="--pg ddpkit: the replicas' all-reduces cross hosts in bfloat16 (Note [Compressed crossing])",
    )
    parser.add_argument("--records", required=True, help="the JSON lines log (a test replays it)")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.baseline:
        return baseline(args)

    from torchft import Manager
    from torchft.ddp import DistributedDataParallel as TorchftDDP
    from torchft.optim import OptimizerWrapper
    from torchft.process_group import ProcessGroupDummy, ProcessGroupGloo

    import ddpkit
    from ddpkit.torchft import ProcessGroupDdpkit, allreduce_hook

    replica = int(os.environ.get("REPLICA_GROUP_ID", "0"))
    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    addr, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"])
    timeout = datetime.timedelta(seconds=args.timeout)
    store = None
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":  # torchrun's agent already serves it
        store = dist.TCPStore(addr, port, world_size, is_master=rank == 0, wait_for_workers=False, timeout=timeout)

    syncbn = args.wrapper == "ddpkit-syncbn"
    model = build_model(args.model, args.exact, syncbn=syncbn)
    if args.exact:
        round_gradients(model)
    optimizer = make_optimizer(model)
    if args.pg == "dummy":
        pg = ProcessGroupDummy(0, 1)  # its configure() ignores the quorum's rank and size
    else:
        cross_host_dtype = torch.bfloat16 if args.cross_host_dtype == "bfloat16" else None
        pg = (
            ProcessGroupDdpkit(timeout=timeout, cross_host_dtype=cross_host_dtype)
            if args.pg == "ddpkit"
            else ProcessGroupGloo(timeout=timeout)
        )

    def load_state_dict(state: dict) -> None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])

    def state_dict() -> dict:
        return {"model": model.state_dict(), "optim": optimizer.state_dict()}

    held_until_released()
    manager = Manager(
        pg=pg,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        # A healing replica's forward moves the shared statistics: it must run on the state it
        # heals to, which the manager then loads at the quorum instead of at the commit.
        use_async_quorum=not syncbn,
        **manager_options(replica, rank, world_size, addr, port, timeout),
    )
    log = open(args.records, "a", buffering=1)
    # Interpreter and imports done, manager up: a restart's own start-up ends here.
    incarnation = int(os.environ.get("FT_INCARNATION", "1"))  # which start of this replica (the harness counts)
    log.write(
        json.dumps({"ready": time.time(), "replica": replica, "pid": os.getpid(), "incarnation": incarnation}) + "\n"
    )
    gate = os.environ.get("FT_START_GATE")
    if gate:  # every replica heartbeating before the first quorum, so that it holds them all
        Path(f"{gate}.{replica}.{rank}").touch()
        while not Path(gate).exists():
            time.sleep(0.01)
    # This step's time inside the gradient hooks: the whole all-reduce for a hook that waits, only
    # its launch for one that does not (then the rest overlaps backward or is waited for at its end).
    comm_seconds = [0.0]

    def timed(hook):
        def run(state, bucket):
            started = time.perf_counter()
            try:
                return hook(state, bucket)
            finally:
                comm_seconds[0] += time.perf_counter() - started

        return run

    if args.wrapper in ("torchft-ddp", "torchft-ddp-async"):
        base = TorchftDDP if args.wrapper == "torchft-ddp" else ddpkit.torchft.DistributedDataParallel
        wrapped = type("TimedDDP", (base,), {"_comm_hook": staticmethod(timed(base._comm_hook))})(manager, model)
    else:
        if syncbn:
            model = ddpkit.convert_sync_batchnorm(model, process_group=pg)
        wrapped = ddpkit.DistributedDataParallel(model, process_group=pg, broadcast_buffers=False, init_sync=False)
        wrapped.register_comm_hook(manager, timed(allreduce_hook))
    optim = OptimizerWrapper(manager, optimizer)

    stop_file = Path(os.environ["FT_STOP_FILE"]) if os.environ.get("FT_STOP_FILE") else None
    steps = args.steps
    while manager.current_step() < steps:
        if stop_file is not None and stop_file.exists():  # the harness's last step, alike for every replica
            steps = int(stop_file.read_text() or steps)
            if manager.current_step() >= steps:
                break
        started = time.time()
        comm_seconds[0] = 0.0
        optim.zero_grad()
        # The step this iteration computes: a joining replica's manager moves to the quorum's step
        # once the quorum is in (wait_quorum), and the batch is that step's.
        manager.wait_quorum()
        quorum = time.time()  # the quorum is in: the lighthouse's part of the iteration is over
        step = manager.current_step()
        x, y = batch(args.model, replica, step, args.exact)
        if args.compute:
            time.sleep(args.compute)
        # A discarded step must leave no trace, and a forward moves the batch-norm running statistics:
        # they go back to where the step found them unless it commits.
        buffers = [b.clone() for b in model.buffers()] if syncbn else []
        try:
            loss_of(wrapped, x, y).backward()
        except RuntimeError as error:  # SyncBatchNorm's collectives raise when a peer is lost
            manager.report_error(error)
        optim.step()
        committed = manager.current_step() > step
        if not committed:
            with torch.no_grad():
                for buffer, saved in zip(model.buffers(), buffers):
                    buffer.copy_(saved)
        log.write(
            json.dumps(
                {
                    "replica": replica,
                    "rank": rank,
                    "pid": os.getpid(),
                    "incarnation": incarnation,
                    "step": step,
                    "committed": committed,
                    "participating": manager.is_participating(),
                    "participants": manager.num_participants(),
                    "start": started,
                    "quorum": quorum,
                    "end": time.time(),
                    "comm_s": comm_seconds[0],
                    "errored": repr(manager.errored()) if manager.errored() else None,
                }
            )
            + "\n"
        )
    if args.out:
        torch.save(
            {"model": model.state_dict(), "optim": optimizer.state_dict(), "step": manager.current_step()}, args.out
        )
    manager.shutdown(wait=False)
    pg.shutdown()
    del store
    log.close()
    exit_without_finalizing()


# --- the harness: replica groups as their own processes, and the replay -----------------------------


def exit_without_finalizing() -> None:
    """Ends a worker whose files are written and closed, its manager and group shut down, without the
    interpreter's finalization: tearing down torch's modules takes about a second of CPU per process,
    and the tests start dozens of workers (ddpkit's segments are anonymous: nothing is left behind)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def held_until_released() -> None:
    """A spare (ReplicaGroups.spare) waits here until the harness releases it: a worker calls it once
    its start-up is done (imports, and its model and optimizer: torch's optimizers import torch._dynamo,
    seconds), before its manager joins the lighthouse."""
    gate = os.environ.get("FT_RELEASE")
    while gate and not Path(gate).exists():
        time.sleep(0.01)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ReplicaGroups:
    """``count`` replica groups of one rank each, each its own process (and session, so that a kill
    takes its whole process group), started as ``python ft_replica.py ARGS`` against ``lighthouse``.
    Each incarnation of replica r logs to ``folder/r{r}.jsonl`` (appended) and writes its output to
    ``folder/r{r}.{incarnation}.out``. ``script`` is another worker that keeps this one's protocol
    (its environment, the start gate, the stop file, a spare's release (held_until_released), one
    JSON line per iteration)."""

    def __init__(
        self,
        folder: Path,
        lighthouse: str,
        args: list,
        count: int,
        env: dict | None = None,
        launch: Callable[[int, list, dict], tuple] | None = None,
        script: Path | None = None,
    ):
        self.folder, self.lighthouse, self.args, self.count = Path(folder), lighthouse, list(args), count
        self.script = str(script or __file__)
        self.env = env or {}
        # (replica, argv, env) -> (argv, env) as started: a simulated host's namespaces, say.
        self.launch = launch or (lambda replica, argv, env: (argv, env))
        self.processes: dict = {}
        self.spares: dict = {}  # replica -> (its next incarnation's process, held; the file that releases it)
        self.incarnations = {r: 0 for r in range(count)}
        self.stop_file = self.folder / "stop"
        self.env["FT_STOP_FILE"] = str(self.stop_file)

    def stop_at(self, step: int) -> None:
        """Every replica ends once its manager reaches `step` (the same last step for all)."""
        partial = self.stop_file.with_suffix(".tmp")
        partial.write_text(str(step))
        os.replace(partial, self.stop_file)

    def start(self, replica: int) -> subprocess.Popen:
        self.processes[replica] = self._launch(replica, {})
        return self.processes[replica]

    def spare(self, replica: int) -> None:
        """Starts `replica`'s next incarnation now, held after its imports and before it joins (its
        manager) until `release`: a restart whose start-up overlaps the run (a test's; a benchmark that
        times the start-up restarts with `start`)."""
        gate = self.folder / f"release.{replica}.{self.incarnations[replica] + 1}"
        self.spares[replica] = (self._launch(replica, {"FT_RELEASE": str(gate)}), gate)

    def release(self, replica: int) -> subprocess.Popen:
        """The spare of `replica` goes on: it joins as the replica's next incarnation."""
        process, gate = self.spares.pop(replica)
        self.processes[replica] = process
        gate.touch()
        return process

    def _launch(self, replica: int, extra_env: dict) -> subprocess.Popen:
        self.incarnations[replica] += 1
        env = {
            **os.environ,
            "REPLICA_GROUP_ID": str(replica),
            "FT_INCARNATION": str(self.incarnations[replica]),
            "RANK": "0",
            "WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()),
            "TORCHFT_LIGHTHOUSE": self.lighthouse,
            "OMP_NUM_THREADS": "1",
            **self.env,
            **extra_env,
        }
        env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
        out = open(self.folder / f"r{replica}.{self.incarnations[replica]}.out", "w")
        argv, env = self.launch(
            replica,
            [
                sys.executable,
                self.script,
                *self.args,
                "--records",
                str(self.log_path(replica)),
                "--out",
                str(self.folder / f"r{replica}.pt"),
            ],
            env,
        )
        process = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        out.close()
        return process

    def start_all(self, timeout: float = 300, spares: tuple = (), ranks: int = 1) -> None:
        """Starts every replica and lets them train together once all have their manager (each of its
        `ranks` ranks has one); and a spare of each replica in `spares` (`spare`), whose start-up then
        overlaps theirs."""
        gate = self.folder / "gate"
        self.env["FT_START_GATE"] = str(gate)
        for replica in range(self.count):
            self.start(replica)
        for replica in spares:
            self.spare(replica)
        self.wait_until(
            lambda: all((self.folder / f"gate.{r}.{k}").exists() for r in range(self.count) for k in range(ranks)),
            timeout,
            "every replica's manager",
        )
        gate.touch()

    def log_path(self, replica: int) -> Path:
        return self.folder / f"r{replica}.jsonl"

    def records(self, replica: int) -> list:
        path = self.log_path(replica)
        if not path.exists():
            return []
        lines = path.read_text().splitlines()
        return [json.loads(line) for line in lines if line.endswith("}")]

    def output(self, replica: int) -> str:
        return "\n".join(
            f"--- replica {replica}, incarnation {i}:\n" + (self.folder / f"r{replica}.{i}.out").read_text()[-3000:]
            for i in range(1, self.incarnations[replica] + 1)
        )

    def signal(self, replica: int, sig: int = signal.SIGKILL) -> None:
        try:
            os.killpg(self.processes[replica].pid, sig)
        except ProcessLookupError:
            pass
        if sig == signal.SIGKILL:
            self.processes[replica].wait()

    def wait_until(self, condition: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            running = [*self.processes.items(), *((r, process) for r, (process, _) in self.spares.items())]
            for replica, process in running:
                if process.poll() not in (None, 0, -signal.SIGKILL):
                    raise RuntimeError(
                        f"replica {replica} failed (exit status {process.returncode}) while "
                        f"waiting for {what}:\n{self.output(replica)}"
                    )
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"no {what} within {timeout} s:\n" + "\n".join(self.output(r) for r in range(self.count))
                )
            time.sleep(0.02)

    def committed(self, replica: int) -> list:
        return [r for r in self.records(replica) if r.get("committed")]

    def iterations(self, replica: int) -> list:
        return [r for r in self.records(replica) if "committed" in r]

    def wait_all(self, timeout: float) -> None:
        """Waits for every live replica to exit, raising with its output when one fails."""
        deadline = time.monotonic() + timeout
        for replica, process in self.processes.items():
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise TimeoutError(f"replica {replica} still runs after {timeout} s:\n{self.output(replica)}") from None
            if process.returncode != 0:
                raise RuntimeError(f"replica {replica} exited with {process.returncode}:\n{self.output(replica)}")

    def close(self) -> None:
        for process in [*self.processes.values(), *(process for process, _ in self.spares.values())]:
            if process.poll() is None:
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            process.wait()


def membership(groups: ReplicaGroups) -> dict:
    """Step -> (the replicas whose gradient it summed, the number it divided by): those that took part in
    it and committed it (a healing replica takes no part: torchft zeroes its gradient), and the manager's
    number of participants, which every replica that committed the step must agree on."""
    members: dict = {}
    counts: dict = {}
    for replica in range(groups.count):
        for record in groups.committed(replica):
            members.setdefault(record["step"], set())
            if record["participating"]:
                members[record["step"]].add(replica)
            counts.setdefault(record["step"], set()).add(record["participants"])
    for step, seen in counts.items():
        assert len(seen) == 1, f"step {step}: the replicas that committed it divided by {seen}"
    return {step: (members[step], counts[step].pop()) for step in members}


def replay(members: dict, steps: int, model_kind: str = "tiny", syncbn: bool = False) -> dict:
    """The single-process replay of a membership schedule (--exact): each step's gradient is the sum
    over its members of each member's own gradient on its batch, divided by its number of participants."""
    model = build_model(model_kind, exact=True, syncbn=syncbn)
    round_gradients(model)
    optimizer = make_optimizer(model)
    for step in range(steps):
        replicas, divisor = sorted(members[step][0]), members[step][1]
        total = [torch.zeros_like(p) for p in model.parameters()]
        for replica in replicas:
            model.zero_grad(set_to_none=True)
            loss_of(model, *batch(model_kind, replica, step, exact=True)).backward()
            for t, p in zip(total, model.parameters()):
                t += p.grad
        for t, p in zip(total, model.parameters()):
            p.grad = t / divisor
        optimizer.step()
    return {"model": model.state_dict(), "optim": optimizer.state_dict()}


if __name__ == "__main__":
    main()
