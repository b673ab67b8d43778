"""torchft's LocalSGD and DiLoCo (torchft.local_sgd) on ddpkit's process group, with a kill and a rejoin.

Three replica groups of one rank each (tests/ft_local_sgd_worker.py, under benchmarks/ft_replica.py's
harness) train with the algorithm on ``ddpkit.torchft.ProcessGroupDdpkit``; one dies mid-run, the
others go on without it, a replacement starts, heals from them and trains on with them. Every
synchronisation is logged (what each replica brought to the average and what it holds after), and the
test checks the whole run against a single-process replay: each round's local steps from where the
replica stood, each committed step's average over the replicas that took part, and torchft's promise
that the replicas which commit a step hold the same parameters, bit for bit.
"""

import functools
import signal
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

torchft = pytest.importorskip("torchft", reason="scripts/setup.sh installs torchft with the test extra")
from torchft._torchft import LighthouseServer  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
import ft_local_sgd_worker as worker  # noqa: E402
import ft_replica  # noqa: E402

STEPS = 1000  # an upper bound: the test sets the last step once the replacement is back
SYNC_EVERY = 4


@pytest.fixture
def lighthouse():
    server = LighthouseServer(
        bind="[::]:0", min_replicas=1, join_timeout_ms=400, quorum_tick_ms=20, heartbeat_timeout_ms=700
    )
    yield server.address()
    server.shutdown()


def tensor(values: list) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def same_bits(a: list, b: list) -> bool:
    return torch.equal(tensor(a), tensor(b))


def assert_average(after: list, contributions: list, divisor: int, what: str) -> None:
    """`after` is the sum of `contributions` divided by `divisor`. Within 1e-13: the quorum's sum of
    three float64 vectors rounds differently in another order (the process group's); a wrong member
    or divisor is off by orders of magnitude more (one replica's local steps move it by ~1e-2)."""
    expected = torch.stack([tensor(c) for c in contributions]).sum(0) / divisor
    torch.testing.assert_close(tensor(after), expected, rtol=1e-13, atol=1e-13, msg=what)


def kill_and_rejoin(
    tmp_path: Path,
    lighthouse: str,
    algorithm: str,
    where: str,
    count: int = 3,
    victim: int = 1,
    die_step: int = 3,
    extra: tuple = (),
) -> tuple:
    """Trains `count` replicas with `algorithm`; replica `victim` SIGKILLs itself in the round of step
    `die_step` (`where`: its local steps or its synchronisation); once the others have committed steps
    without it, a replacement starts (a spare started with the others, held before it joins until
    then); once it has committed a step with all of them, all stop a few steps on. Returns the harness
    and the last step."""
    groups = ft_replica.ReplicaGroups(
        tmp_path,
        lighthouse,
        [
            "--algorithm",
            algorithm,
            "--steps",
            str(STEPS),
            "--sync-every",
            str(SYNC_EVERY),
            "--compute",
            "0.02",
            "--die",
            str(victim),
            str(die_step),
            where,
            *extra,
        ],
        count,
        script=Path(worker.__file__),
    )
    survivors = [r for r in range(count) if r != victim]
    try:
        groups.start_all(spares=(victim,))
        groups.wait_until(lambda: groups.processes[victim].poll() is not None, 120, "the victim's death")
        assert groups.processes[victim].returncode == -signal.SIGKILL, groups.output(victim)
        groups.wait_until(
            lambda: all(sum(r["participants"] == count - 1 for r in groups.committed(s)) >= 2 for s in survivors),
            120,
            "steps committed without the killed replica",
        )
        groups.release(victim)
        groups.wait_until(
            lambda: any(r["incarnation"] == 2 and r["participants"] == count for r in groups.committed(victim)),
            120,
            "a step committed by the replacement",
        )
        last = max(r["step"] for r in groups.committed(victim)) + 2
        groups.stop_at(last)
        groups.wait_all(90)
    finally:
        groups.close()
    killed = [r for r in groups.records(victim) if "killed" in r]
    assert [(k["step"], k["where"]) for k in killed] == [(die_step, where)], killed
    return groups, last


def synchronisations(groups) -> list:
    return [r for replica in range(groups.count) for r in groups.records(replica) if "committed" in r]


def check_run(groups, last: int, die_step: int, fragments: int = 1) -> dict:
    """What any run of either algorithm must show; returns each committed step's records. A record's
    parameters are those of the fragment that its step synchronised (with one, the whole model)."""
    records = synchronisations(groups)
    committed: dict = {}
    for record in records:
        if record["committed"]:
            committed.setdefault(record["step"], []).append(record)
    assert sorted(committed) == list(range(last)), f"steps committed: {sorted(committed)}"
    for step, done in committed.items():
        # torchft's promise: the replicas that commit a step hold the same parameters after it.
        assert all(same_bits(r["after"], done[0]["after"]) for r in done), f"step {step}: replicas differ"
        assert len({r["participants"] for r in done}) == 1, f"step {step}: divisors {done}"
        # A replica that took part committed it: none took part in a step it then discarded.
        assert len([r for r in done if r["participating"]]) == done[0]["participants"], done
    members = {step: sorted(r["replica"] for r in done) for step, done in committed.items()}
    count = groups.count
    victim = next(r["replica"] for replica in range(count) for r in groups.records(replica) if "killed" in r)
    assert any(victim in m for s, m in members.items() if s < die_step), members
    assert any(len(m) == count - 1 for s, m in members.items() if s >= die_step), members
    assert members[last - 1] == list(range(count)), members
    healed = [r for r in records if r["healed"]]
    # The replacement healed from a peer (and so may a replica that missed the first quorum).
    assert any(r["replica"] == victim and r["incarnation"] == 2 for r in healed), healed
    # A replica that heals brings the parameters it loaded: a peer's, after that peer's local steps.
    for record in healed:
        peers = [r for r in records if r["step"] == record["step"] and not r["healed"]]
        assert any(same_bits(record["contribution"], p["local"]) for p in peers), record["step"]
    # Every replica ends right after the last step's commit, holding what it committed: the whole model
    # alike on every replica, or with several fragments, the fragment that step synchronised.
    for replica in range(count):
        final = torch.load(groups.folder / f"r{replica}.pt")
        assert final["step"] == last
        model = worker.build_model()
        model.load_state_dict(final["model"])
        part = worker.fragments(model, fragments)[(last - 1) % fragments]
        assert same_bits(worker.flat(part), committed[last - 1][0]["after"]), f"replica {replica} at the end"
    return committed


def replay_local_steps(groups, start_of: Callable[[dict | None, dict], list]) -> None:
    """Each synchronisation's local parameters are `SYNC_EVERY` SGD steps on the replica's batches from
    `start_of(previous record of this incarnation or None, record)`, bit for bit."""
    for replica in range(groups.count):
        previous = None
        for record in [r for r in groups.records(replica) if "committed" in r]:
            if previous is not None and previous["incarnation"] != record["incarnation"]:
                previous = None
            start = start_of(previous, record)
            local = worker.local_steps(start, replica, record["batch_step"], SYNC_EVERY)
            assert same_bits(local, record["local"]), f"replica {replica}, step {record['step']}: local steps"
            previous = record


@functools.cache
def initial() -> list:
    """The parameters every replica starts from (one seed)."""
    return worker.flat(worker.build_model())


def test_local_sgd_kill_and_rejoin(tmp_path, lighthouse):
    """LocalSGD: every `SYNC_EVERY` local steps the quorum averages the parameters. A replica killed in
    its synchronisation fails the others' all-reduce: they discard that step and keep their own
    parameters, as LocalSGD does, and average them at the next."""
    die_step = 3
    groups, last = kill_and_rejoin(tmp_path, lighthouse, "local-sgd", "sync", die_step=die_step)
    committed = check_run(groups, last, die_step)
    for step, done in committed.items():
        members = [r for r in done if r["participating"]]
        assert_average(
            done[0]["after"],
            [r["contribution"] for r in members],
            done[0]["participants"],
            f"step {step}: the average of {[r['replica'] for r in members]}",
        )
    discarded = [r for r in synchronisations(groups) if not r["committed"]]
    for record in discarded:  # LocalSGD leaves a discarded synchronisation's parameters as they were
        assert same_bits(record["after"], record["contribution"]), record["step"]
    assert {r["replica"] for r in discarded if r["step"] == die_step} == {0, 2}, (
        "the survivors' all-reduce failed on the dead peer and they discarded that step"
    )
    # A round starts where the last synchronisation left the replica (a fresh incarnation: the seed's model).
    replay_local_steps(groups, lambda previous, record: initial() if previous is None else previous["after"])


def check_outer_steps(groups, committed: dict, last: int, fragments: int) -> dict:
    """DiLoCo's replay over the committed steps: step s synchronises fragment s % `fragments`, whose outer
    optimizer (Nesterov momentum) steps its global parameters with the pseudo-gradient averaged over the
    step's participants (the global parameters minus what each brought). A discarded step puts the
    fragment's global parameters back. Returns each step's global parameters of the fragment it synchronised."""
    model = worker.build_model()
    parts = worker.fragments(model, fragments)
    outers = [worker.outer_optimizer(part) for part in parts]
    current = [worker.flat(part) for part in parts]
    global_at = {}
    for step in range(last):
        fragment, done = step % fragments, committed[step]
        assert all(r["fragment"] == fragment for r in done), done
        members = [r for r in done if r["participating"]]
        global_at[step] = current[fragment]
        start = tensor(current[fragment])
        worker.load_flat(parts[fragment], current[fragment])
        pseudo = torch.stack([start - tensor(r["contribution"]) for r in members]).sum(0) / done[0]["participants"]
        offset = 0
        for p in parts[fragment].parameters():
            p.grad = pseudo[offset : offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        outers[fragment].step()
        torch.testing.assert_close(
            tensor(done[0]["after"]),
            tensor(worker.flat(parts[fragment])),
            rtol=1e-13,
            atol=1e-13,
            msg=f"step {step}: the outer step over {[r['replica'] for r in members]}",
        )
        current[fragment] = done[0]["after"]
    for record in synchronisations(groups):
        if not record["committed"]:
            assert same_bits(record["after"], global_at[record["step"]]), f"discarded step {record['step']}"
    return global_at


def test_diloco_kill_and_rejoin(tmp_path, lighthouse):
    """DiLoCo: every `SYNC_EVERY` local steps the quorum averages the pseudo-gradients and the outer
    optimizer steps the global parameters, which every round starts from. A replica killed in its local
    steps leaves the next quorum; its replacement's first round starts from the seed's model and heals."""
    die_step = 3
    groups, last = kill_and_rejoin(tmp_path, lighthouse, "diloco", "local", die_step=die_step)
    committed = check_run(groups, last, die_step)
    global_at = check_outer_steps(groups, committed, last, fragments=1)
    replay_local_steps(groups, lambda previous, record: initial() if record["healed"] else global_at[record["step"]])


def test_streaming_diloco_kill_and_rejoin(tmp_path, lighthouse):
    """Streaming DiLoCo: two fragments (the two layers), each synchronised in turn every `SYNC_EVERY` / 2
    local steps, its all-reduce started a local step before it is awaited (fragment_sync_delay=1, so the
    all-reduce runs on ddpkit's engine thread while the next local step computes). A replica killed in
    a synchronisation fails the others' all-reduce: they discard that step and restore the fragment."""
    die_step = 3
    groups, last = kill_and_rejoin(
        tmp_path, lighthouse, "diloco", "sync", die_step=die_step, extra=("--fragments", "2", "--delay", "1")
    )
    committed = check_run(groups, last, die_step, fragments=2)
    check_outer_steps(groups, committed, last, fragments=2)
    discarded = [r for r in synchronisations(groups) if not r["committed"]]
    assert {r["replica"] for r in discarded if r["step"] == die_step} == {0, 2}
