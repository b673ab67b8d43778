"""One replica group of torchft's LocalSGD or (Streaming) DiLoCo (``torchft.local_sgd``) on ddpkit's
process group: the worker of tests/test_torchft_local_sgd.py, started by benchmarks/ft_replica.py's
ReplicaGroups (its environment, start gate, stop file and incarnations).

A replica trains a float64 model with plain SGD (no optimizer state, so that a round's local steps
depend on its start only), every gradient rounded to a multiple of 2**-30 (ft_replica's --exact), and
synchronises every ``--sync-every`` local steps: LocalSGD averages the parameters over the quorum,
DiLoCo averages the pseudo-gradients (the global parameters minus the local ones) and applies them with
its outer optimizer. With ``--fragments 2`` (Streaming DiLoCo) each layer is a fragment, synchronised in
turn every ``--sync-every``/2 local steps, its all-reduce started ``--delay`` local steps before it is
awaited. Each synchronisation appends one JSON line to --records: the step the manager decided on and
whether it committed, the fragment, the quorum's participants, the fragment's parameters the replica
brought to the average (its own when the all-reduce started, or the peer's it healed from) and its
parameters afterwards. The test replays the local steps and each step's average from these lines.

``--die REPLICA STEP WHERE`` makes the first incarnation of replica REPLICA SIGKILL itself in the round
of manager step STEP: halfway through its local steps ("local"), or as it launches the synchronisation's
second all-reduce ("sync": the survivors' all-reduces then fail on a dead peer). A kill at a known point
keeps every average the survivors commit in the records.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import ft_replica  # noqa: E402

INNER_LR = 2.0**-4


def build_model() -> nn.Module:
    """The model every replica starts from (one seed), gradients rounded to ft_replica's grid."""
    model = ft_replica.build_model("tiny", exact=True)
    ft_replica.round_gradients(model)
    return model


def inner_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=INNER_LR)


def outer_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """DiLoCo's outer optimizer as its paper and torchtitan set it: Nesterov momentum."""
    return torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)


def batch(replica: int, step: int, inner: int) -> tuple:
    """Replica `replica`'s batch for local step `inner` of the round that ends in manager step `step`."""
    generator = torch.Generator().manual_seed(100_000 * replica + 100 * step + inner)
    x = torch.randn(ft_replica.BATCH, ft_replica.FEATURES, generator=generator, dtype=torch.float64)
    y = torch.randn(ft_replica.BATCH, ft_replica.CLASSES, generator=generator, dtype=torch.float64)
    return x, y


def fragments(model: nn.Module, count: int) -> list:
    """The model's fragments for (Streaming) DiLoCo: the whole model, or each of its two linear layers."""
    if count == 1:
        return [model]
    layers = [m for m in model if isinstance(m, nn.Linear)]
    if count != len(layers):
        raise ValueError(f"the model has {len(layers)} linear layers, not {count}")
    return layers


def flat(model: nn.Module) -> list:
    return [v for p in model.parameters() for v in p.detach().reshape(-1).tolist()]


def load_flat(model: nn.Module, values: list) -> None:
    with torch.no_grad():
        torch.nn.utils.vector_to_parameters(torch.tensor(values, dtype=torch.float64), model.parameters())


def local_steps(start: list, replica: int, step: int, count: int) -> list:
    """The replay of one round's local steps: `count` SGD steps from the parameters `start`."""
    model = build_model()
    load_flat(model, start)
    optimizer = inner_optimizer(model)
    for inner in range(count):
        optimizer.zero_grad(set_to_none=True)
        ft_replica.loss_of(model, *batch(replica, step, inner)).backward()
        optimizer.step()
    return flat(model)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algorithm", choices=["local-sgd", "diloco"], required=True)
    parser.add_argument("--sync-every", type=int, default=3)
    parser.add_argument("--fragments", type=int, default=1, help="DiLoCo's model fragments (2: Streaming DiLoCo)")
    parser.add_argument("--delay", type=int, default=0, help="DiLoCo's fragment_sync_delay (local steps)")
    parser.add_argument("--steps", type=int, default=20, help="the manager step (synchronisations) to stop at")
    parser.add_argument("--compute", type=float, default=0.0, help="seconds of stand-in compute per local step")
    parser.add_argument("--timeout", type=float, default=10.0, help="manager and process-group timeout, seconds")
    parser.add_argument(
        "--die",
        nargs=3,
        default=("-1", "-1", "local"),
        metavar=("REPLICA", "STEP", "WHERE"),
        help="that replica's first incarnation SIGKILLs itself in that step's round, in its "
        "local steps or in its synchronisation",
    )
    parser.add_argument("--records", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    from torchft import Manager
    from torchft.local_sgd import DiLoCo, LocalSGD

    from ddpkit.torchft import ProcessGroupDdpkit

    replica = int(os.environ["REPLICA_GROUP_ID"])
    incarnation = int(os.environ.get("FT_INCARNATION", "1"))
    addr, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"])
    timeout = datetime.timedelta(seconds=args.timeout)
    store = dist.TCPStore(addr, port, 1, is_master=True, wait_for_workers=False, timeout=timeout)

    model = build_model()
    parts = fragments(model, args.fragments)
    optimizer = inner_optimizer(model)
    healed_from: list = []  # each fragment's parameters a heal loaded, in the synchronisation that healed

    def load_state_dict(state: dict) -> None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
        healed_from.append([flat(part) for part in parts])

    def state_dict() -> dict:
        # A copy as of the quorum: torchft's HTTP transport serves CPU tensors as they are when the healing
        # peer reads them, and with --delay this replica takes a local step before its commit ends serving.
        return copy.deepcopy({"model": model.state_dict(), "optim": optimizer.state_dict()})

    class RecordingManager(Manager):
        """torchft's Manager, remembering what its last should_commit decided, and for which step."""

        decided: tuple = (-1, False)

        def should_commit(self, timeout=None) -> bool:
            step = self.current_step()
            committed = super().should_commit(timeout)
            self.decided = (step, committed)
            return committed

    die_replica, die_step, die_where = int(args.die[0]), int(args.die[1]), args.die[2]
    dying = replica == die_replica and incarnation == 1

    def die(where: str) -> None:
        log.write(json.dumps({"killed": time.time(), "replica": replica, "step": die_step, "where": where}) + "\n")
        os.kill(os.getpid(), signal.SIGKILL)

    class DyingGroup(ProcessGroupDdpkit):
        """ddpkit's group, whose replica --die ... sync dies as it launches its second all-reduce of the round."""

        launched = 0

        def allreduce(self, tensors: list, opts: object) -> dist.Work:
            if dying and die_where == "sync" and manager.current_step() == die_step:
                self.launched += 1
                if self.launched == 2:
                    die("sync")
            return super().allreduce(tensors, opts)

    pg = DyingGroup(timeout=timeout)
    ft_replica.held_until_released()
    # use_async_quorum=False: DiLoCo requires it, and torchtitan uses it for both algorithms (a
    # joining replica heals at the synchronisation's quorum, before it averages).
    manager = RecordingManager(
        pg=pg,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        use_async_quorum=False,
        **ft_replica.manager_options(replica, 0, 1, addr, port, timeout),
    )
    if args.algorithm == "local-sgd":
        algorithm = LocalSGD(manager, model, optimizer, sync_every=args.sync_every)
    else:
        algorithm = DiLoCo(
            manager,
            parts,
            optimizer,
            [outer_optimizer(part) for part in parts],
            sync_every=args.sync_every,
            fragment_sync_delay=args.delay,
        )

    log = open(args.records, "a", buffering=1)
    log.write(
        json.dumps({"ready": time.time(), "replica": replica, "pid": os.getpid(), "incarnation": incarnation}) + "\n"
    )
    gate = os.environ.get("FT_START_GATE")
    if gate:
        Path(f"{gate}.{replica}.0").touch()
        while not Path(gate).exists():
            time.sleep(0.01)

    # A round: the local steps between two synchronisations (of one fragment, with several). The
    # algorithm's quorum and all-reduce start `--delay` local steps before the round's end, where it
    # reads what each replica brings to the average.
    period = args.sync_every // args.fragments
    round_: dict = {"inner": 0, "start": time.time()}

    def before_sync(_optimizer, _args, _kwargs) -> None:
        # Runs after each local step, before the algorithm's own hook (registered after this one).
        round_["inner"] += 1
        if dying and die_where == "local" and manager.current_step() == die_step and round_["inner"] == period // 2:
            die("local")
        if round_["inner"] == period - args.delay:
            round_["local"] = [flat(part) for part in parts]
            healed_from.clear()

    def after_sync(_optimizer, _args, _kwargs) -> None:
        if round_["inner"] != period:
            return
        step, committed = manager.decided
        fragment = step % args.fragments  # the one DiLoCo synchronised (its _current_fragment)
        brought = healed_from[-1] if healed_from else round_["local"]
        log.write(
            json.dumps(
                {
                    "replica": replica,
                    "incarnation": incarnation,
                    "pid": os.getpid(),
                    "step": step,
                    "committed": committed,
                    "fragment": fragment,
                    "batch_step": round_["batch_step"],
                    "participating": manager.is_participating(),
                    "participants": manager.num_participants(),
                    "healed": bool(healed_from),
                    "local": round_["local"][fragment],
                    "contribution": brought[fragment],
                    "after": flat(parts[fragment]),
                    "start": round_["start"],
                    "end": time.time(),
                    "errored": repr(manager.errored()) if manager.errored() else None,
                }
            )
            + "\n"
        )
        round_.update(inner=0, start=time.time())

    hooks = [optimizer.register_step_post_hook(before_sync)]
    stop_file = Path(os.environ["FT_STOP_FILE"]) if os.environ.get("FT_STOP_FILE") else None
    steps = args.steps
    with algorithm:
        hooks.append(optimizer.register_step_post_hook(after_sync))
        while manager.current_step() < steps:
            if stop_file is not None and stop_file.exists() and round_["inner"] == 0:
                steps = int(stop_file.read_text() or steps)
                if manager.current_step() >= steps:
                    break
            step = manager.current_step()
            if round_["inner"] == 0:
                round_["batch_step"] = step
            optimizer.zero_grad(set_to_none=True)
            if args.compute:
                time.sleep(args.compute)
            ft_replica.loss_of(model, *batch(replica, round_["batch_step"], round_["inner"])).backward()
            optimizer.step()  # the algorithm's hook synchronises after every --sync-every of these
    for hook in hooks:
        hook.remove()
    torch.save({"model": model.state_dict(), "step": manager.current_step()}, args.out)
    manager.shutdown(wait=False)
    pg.shutdown()
    del store
    log.close()
    ft_replica.exit_without_finalizing()


if __name__ == "__main__":
    main()
