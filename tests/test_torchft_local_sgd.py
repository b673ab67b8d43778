"""torchft's LocalSGD and DiLoCo (torchft.local_sgd) on ddpkit's process group, with a kill and a rejoin.

Three replica groups of one rank each (tests/ft_local_sgd_worker.py, under benchmarks/ft_replica.py's
harness) train with the algorithm on ``ddpkit.torchft.ProcessGroupDdpkit``; one dies mid-run, the
others go on without it, a replacement starts, heals from them and trains on with them. Every
synchronisation is logged (what each replica brought to the average and what it holds after), and the
test checks the whole run against a single-process replay: each round's local steps from where the
replica stood, each committed step's average over the replicas that took part, and torchft's promise
that the replicas which commit a step hold the same parameters, bit for bit.
"""

import signal
import sys
from pathlib import Path

import pytest
import torch

torchft = pytest.importorskip("torchft", reason="scripts/setup.sh installs torchft with the test extra")
from torchft._torchft import LighthouseServer  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
import ft_replica  # noqa: E402

import ft_local_sgd_worker as worker  # noqa: E402

STEPS = 1000  # an upper bound: the test sets the last step once the replacement is back
SYNC_EVERY = 4


@pytest.fixture
def lighthouse():
    server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=400, quorum_tick_ms=20,
                              heartbeat_timeout_ms=700)
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


def kill_and_rejoin(tmp_path: Path, lighthouse: str, algorithm: str, where: str, count: int = 3,
                    victim: int = 1, die_step: int = 3) -> tuple:
    """Trains `count` replicas with `algorithm`; replica `victim` SIGKILLs itself in the round of step
    `die_step` (`where`: its local steps or its synchronisation); once the others have committed steps
    without it, a replacement starts; once it has committed a step with all of them, all stop a few
    steps on. Returns the harness and the last step."""
    groups = ft_replica.ReplicaGroups(
        tmp_path, lighthouse, ["--algorithm", algorithm, "--steps", str(STEPS), "--sync-every", str(SYNC_EVERY),
                               "--compute", "0.02", "--die", str(victim), str(die_step), where],
        count, script=Path(worker.__file__))
    survivors = [r for r in range(count) if r != victim]
    try:
        groups.start_all()
        groups.wait_until(lambda: groups.processes[victim].poll() is not None, 120, "the victim's death")
        assert groups.processes[victim].returncode == -signal.SIGKILL, groups.output(victim)
        groups.wait_until(lambda: all(sum(r["participants"] == count - 1 for r in groups.committed(s)) >= 2
                                      for s in survivors), 120, "steps committed without the killed replica")
        groups.start(victim)
        groups.wait_until(lambda: any(r["incarnation"] == 2 and r["participants"] == count
                                      for r in groups.committed(victim)), 120, "a step committed by the replacement")
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


def check_run(groups, last: int, die_step: int) -> dict:
    """What any run of either algorithm must show; returns each committed step's records."""
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
    assert healed and all(r["incarnation"] == 2 for r in healed), "the replacement healed from a peer"
    # A replica that heals brings the parameters it loaded: a peer's, after that peer's local steps.
    for record in healed:
        peers = [r for r in records if r["step"] == record["step"] and not r["healed"]]
        assert any(same_bits(record["contribution"], p["local"]) for p in peers), record["step"]
    finals = {r: torch.load(groups.folder / f"r{r}.pt") for r in range(count)}
    assert all(f["step"] == last for f in finals.values())
    for replica, final in finals.items():
        for name, value in final["model"].items():
            assert torch.equal(value, finals[0]["model"][name]), f"replica {replica}: {name} differs at the end"
    return committed


def replay_local_steps(groups, start_of: callable) -> None:
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


INITIAL = None


def initial() -> list:
    global INITIAL
    if INITIAL is None:
        INITIAL = worker.flat(worker.build_model())
    return INITIAL


@pytest.mark.parametrize("where", ["sync", "local"])
def test_local_sgd_kill_and_rejoin(tmp_path, lighthouse, where):
    """LocalSGD: every `SYNC_EVERY` local steps the quorum averages the parameters. A replica killed in
    its synchronisation fails the others' all-reduce (they discard that step and keep their own
    parameters, as LocalSGD does), or killed in its local steps simply leaves the next quorum."""
    die_step = 3
    groups, last = kill_and_rejoin(tmp_path, lighthouse, "local-sgd", where, die_step=die_step)
    committed = check_run(groups, last, die_step)
    for step, done in committed.items():
        members = [r for r in done if r["participating"]]
        assert_average(done[0]["after"], [r["contribution"] for r in members], done[0]["participants"],
                       f"step {step}: the average of {[r['replica'] for r in members]}")
    discarded = [r for r in synchronisations(groups) if not r["committed"]]
    for record in discarded:  # LocalSGD leaves a discarded synchronisation's parameters as they were
        assert same_bits(record["after"], record["contribution"]), record["step"]
    if where == "sync":
        assert {r["replica"] for r in discarded if r["step"] == die_step} == {0, 2}, \
            "the survivors' all-reduce failed on the dead peer and they discarded that step"
    # A round starts where the last synchronisation left the replica (a fresh incarnation: the seed's model).
    replay_local_steps(groups, lambda previous, record: initial() if previous is None else previous["after"])


def test_diloco_kill_and_rejoin(tmp_path, lighthouse):
    """DiLoCo: the quorum averages the pseudo-gradients (global parameters minus local ones) and its outer
    optimizer (Nesterov momentum) steps the global parameters; a discarded step restores them. The
    replay runs the outer optimizer over the committed steps, from the same start."""
    die_step = 3
    groups, last = kill_and_rejoin(tmp_path, lighthouse, "diloco", "sync", die_step=die_step)
    committed = check_run(groups, last, die_step)
    model = worker.build_model()
    outer = worker.outer_optimizer(model)
    global_at = {0: initial()}
    for step in range(last):
        done = committed[step]
        members = [r for r in done if r["participating"]]
        start = tensor(global_at[step])
        worker.load_flat(model, global_at[step])
        pseudo = torch.stack([start - tensor(r["contribution"]) for r in members]).sum(0) / done[0]["participants"]
        offset = 0
        for p in model.parameters():
            p.grad = pseudo[offset:offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        outer.step()
        torch.testing.assert_close(tensor(done[0]["after"]), tensor(worker.flat(model)), rtol=1e-13, atol=1e-13,
                                   msg=f"step {step}: the outer step over {[r['replica'] for r in members]}")
        global_at[step + 1] = done[0]["after"]
    discarded = [r for r in synchronisations(groups) if not r["committed"]]
    for record in discarded:  # a discarded step puts the global parameters back
        assert same_bits(record["after"], global_at[record["step"]]), record["step"]
    assert {r["replica"] for r in discarded if r["step"] == die_step} == {0, 2}
    # Every round starts from the global parameters of the step it synchronises, except a replacement's
    # first, which starts from the seed's model and is then healed.
    replay_local_steps(groups, lambda previous, record: initial() if record["healed"] else global_at[record["step"]])
