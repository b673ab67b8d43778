"""One replica group of torchft's HSDP on ddpkit: FSDP2 over the group's ranks, torchft across the
groups. The worker of tests/test_torchft_hsdp.py, started by benchmarks/ft_replica.py's
ReplicaGroups (its environment, start gate, stop file, incarnations and records).

The process the harness starts is the replica group's rank 0: once it has imported what they run, it
forks the other ``--ranks`` - 1 ranks (no rank imports torch again), in its own process group (one
SIGKILL of that group takes the whole replica group, as a host that dies does), and holds the group's
store at MASTER_ADDR:MASTER_PORT. Each rank:

- joins the replica group's process group on the "ddpkit" backend (shared memory inside the host)
  and shards the model over it with FSDP2 (``fully_shard`` on a one-dimensional device mesh);
- has its own ``torchft.Manager`` (group rank k of the replica group) on ``ProcessGroupDdpkit``, whose
  quorum joins rank k of every replica group (one rank per host: ddpkit's path across hosts);
- averages each reduce-scattered gradient shard over the quorum from FSDP2's all-reduce hook through
  torchft's ``ManagedProcessGroup`` (what torchtitan's fault tolerance does), and steps through
  ``torchft.optim.OptimizerWrapper``;
- heals, when it joins, rank k's shards of the parameters and momentum from rank k of a peer group.

Gradients are rounded to a multiple of 2**-30 inside the forward (``GridLinear``: FSDP2 computes them on
its unsharded parameters, which a hook on the sharded ones never sees), parameters are float64, and
FSDP2's reduction of float64 divides by the group's size (2) before its sum: so every sum is exact in any
order and a single-process replay of the logged membership gives the same bits.
``--die REPLICA STEP``: that replica's first incarnation kills its whole group (SIGKILL) from rank 0's
all-reduce hook as it launches the second shard's cross-group all-reduce of that step's backward.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import sys
import time
from pathlib import Path


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2, help="ranks per replica group")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--compute", type=float, default=0.0, help="seconds of stand-in compute per step")
    parser.add_argument("--timeout", type=float, default=10.0, help="manager and process-group timeout, seconds")
    parser.add_argument("--die", type=int, nargs=2, default=(-1, -1), metavar=("REPLICA", "STEP"))
    parser.add_argument("--records", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--rank", type=int, default=0, help="(rank 0 sets it for the others)")
    return parser.parse_args()


if __name__ == "__main__":
    ARGS = parse_args()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import ft_replica  # noqa: E402

GRID = ft_replica.GRID


class _RoundGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return torch.round(grad.clamp(-256.0, 256.0) * GRID) / GRID


class GridLinear(nn.Linear):
    """nn.Linear whose parameters' gradients come out rounded to ft_replica's grid."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, _RoundGrad.apply(self.weight), _RoundGrad.apply(self.bias))


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        GridLinear(ft_replica.FEATURES, ft_replica.HIDDEN), nn.ReLU(), GridLinear(ft_replica.HIDDEN, ft_replica.CLASSES)
    ).double()


def make_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=2.0**-4, momentum=0.5)


def batch(replica: int, rank: int, ranks: int, step: int) -> tuple:
    return ft_replica.batch("tiny", replica * ranks + rank, step, exact=True)


def replay(members: dict, steps: int, ranks: int) -> dict:
    """The single-process replay of a membership schedule (step -> (replicas, divisor)): each step's
    gradient is the sum over its replicas and their ranks of each rank's gradient on its batch,
    divided by the ranks (FSDP2's average inside a group) and by the divisor (the manager's)."""
    model = build_model()
    optimizer = make_optimizer(model.parameters())
    for step in range(steps):
        replicas, divisor = sorted(members[step][0]), members[step][1]
        total = [torch.zeros_like(p) for p in model.parameters()]
        for replica in replicas:
            for rank in range(ranks):
                model.zero_grad(set_to_none=True)
                ft_replica.loss_of(model, *batch(replica, rank, ranks, step)).backward()
                for t, p in zip(total, model.parameters()):
                    t += p.grad
        for t, p in zip(total, model.parameters()):
            p.grad = t / ranks / divisor
        optimizer.step()
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "momentum": [optimizer.state[p]["momentum_buffer"] for p in model.parameters()],
    }


def fork_ranks(args: argparse.Namespace) -> list:
    """Rank 0, the process the harness starts, forks the others (after the imports: a replica group's
    start-up, and a replacement's, is mostly imports); the pids of those, or [] in a forked rank, which
    leaves with ``args.rank`` and its environment set as its rank's."""
    others = []
    for rank in range(1, args.ranks):
        pid = os.fork()
        if pid == 0:
            os.environ.update(
                RANK=str(rank), WORLD_SIZE=str(args.ranks), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(args.ranks)
            )
            args.rank = rank
            return []
        others.append(pid)
    return others


def join_ranks(ranks: list, timeout: float) -> None:
    """Rank 0's end: the other ranks' exit; one that failed fails the group."""
    deadline = time.monotonic() + timeout
    for rank, pid in enumerate(ranks, start=1):
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        if done[0] == 0:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            status = "still running"
        else:
            status = os.waitstatus_to_exitcode(done[1])
        if status != 0:
            raise RuntimeError(f"rank {rank} of the replica group ended with {status}")


def train(args: argparse.Namespace) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.distributed.tensor import DTensor
    from torchft import Manager
    from torchft.optim import OptimizerWrapper
    from torchft.process_group import ManagedProcessGroup

    import ddpkit  # noqa: F401  (the "ddpkit" backend)
    from ddpkit.torchft import ProcessGroupDdpkit

    others = fork_ranks(args) if args.rank == 0 else []

    replica, rank, ranks = int(os.environ["REPLICA_GROUP_ID"]), args.rank, args.ranks
    incarnation = int(os.environ.get("FT_INCARNATION", "1"))
    addr, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"])
    timeout = datetime.timedelta(seconds=args.timeout)
    # Rank 0 holds the replica group's store: the process group's and the managers' keys.
    store = dist.TCPStore(addr, port, ranks, is_master=rank == 0, wait_for_workers=False, timeout=timeout * 3)
    dist.init_process_group(
        "ddpkit", store=dist.PrefixStore("replica-group/", store), rank=rank, world_size=ranks, timeout=timeout
    )
    mesh = init_device_mesh("cpu", (ranks,))
    model = build_model()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = make_optimizer(model.parameters())

    # The group rank's shards, as plain tensors: what a healing rank k loads from rank k of a peer group.
    def state_dict() -> dict:
        momentum = [optimizer.state[p].get("momentum_buffer") for p in model.parameters()]
        return {
            "params": [p.to_local() for p in model.parameters()],
            "momentum": [None if m is None else m.to_local() for m in momentum],
        }

    def load_state_dict(state: dict) -> None:
        with torch.no_grad():
            for p, shard, momentum in zip(model.parameters(), state["params"], state["momentum"]):
                p.to_local().copy_(shard)
                if momentum is None:
                    optimizer.state[p].pop("momentum_buffer", None)
                else:
                    optimizer.state[p]["momentum_buffer"] = DTensor.from_local(
                        momentum.clone(), p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
                    )

    pg = ProcessGroupDdpkit(timeout=timeout)
    ft_replica.held_until_released()
    manager = Manager(
        pg=pg,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        **ft_replica.manager_options(replica, rank, ranks, addr, port, timeout),
    )
    replicate = ManagedProcessGroup(manager)
    replicate.register("dp_replicate")  # as torchtitan does: a registered group, for functional collectives
    dying = (replica, incarnation) == (args.die[0], 1) and rank == 0
    launched = [0]

    def all_reduce_hook(shard: torch.Tensor) -> None:
        launched[0] += 1
        if dying and manager.current_step() == args.die[1] and launched[0] == 2:
            log.write(json.dumps({"killed": time.time(), "replica": replica, "step": args.die[1]}) + "\n")
            os.killpg(0, signal.SIGKILL)  # every rank of this replica group
        dist.all_reduce(shard, group=replicate, op=dist.ReduceOp.AVG)

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_all_reduce_hook(all_reduce_hook)
    optim = OptimizerWrapper(manager, optimizer)

    log = open(args.records, "a", buffering=1)
    log.write(
        json.dumps(
            {"ready": time.time(), "replica": replica, "rank": rank, "pid": os.getpid(), "incarnation": incarnation}
        )
        + "\n"
    )
    gate = os.environ.get("FT_START_GATE")
    if gate:
        Path(f"{gate}.{replica}.{rank}").touch()
        while not Path(gate).exists():
            time.sleep(0.01)
    stop_file = Path(os.environ["FT_STOP_FILE"]) if os.environ.get("FT_STOP_FILE") else None
    steps = args.steps
    while manager.current_step() < steps:
        if stop_file is not None and stop_file.exists():
            steps = int(stop_file.read_text() or steps)
            if manager.current_step() >= steps:
                break
        started = time.time()
        launched[0] = 0
        optim.zero_grad()
        manager.wait_quorum()  # a joining replica's step is the quorum's once it is in
        step = manager.current_step()
        if args.compute:
            time.sleep(args.compute)
        ft_replica.loss_of(model, *batch(replica, rank, ranks, step)).backward()
        optim.step()
        log.write(
            json.dumps(
                {
                    "replica": replica,
                    "rank": rank,
                    "pid": os.getpid(),
                    "incarnation": incarnation,
                    "step": step,
                    "committed": manager.current_step() > step,
                    "participating": manager.is_participating(),
                    "participants": manager.num_participants(),
                    "start": started,
                    "end": time.time(),
                    "errored": repr(manager.errored()) if manager.errored() else None,
                }
            )
            + "\n"
        )
    momentum = [optimizer.state[p]["momentum_buffer"].to_local() for p in model.parameters()]
    torch.save(
        {"params": [p.to_local() for p in model.parameters()], "momentum": momentum, "step": manager.current_step()},
        f"{args.out}.rank{rank}",
    )
    manager.shutdown(wait=False)
    pg.shutdown()
    dist.destroy_process_group()
    log.close()
    join_ranks(others, args.timeout * 3)
    del store
    ft_replica.exit_without_finalizing()


if __name__ == "__main__":
    train(ARGS)
