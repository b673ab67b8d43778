"""torchft's HSDP on ddpkit: FSDP2 inside each replica group, torchft's quorum across the groups, each
group on a simulated host of its own; a group killed mid-backward, a replacement that heals.

Each replica group (tests/ft_hsdp_worker.py, under benchmarks/ft_replica.py's harness) is two ranks on
one simulated host (ddpkit.testing.HostPool's namespaces): FSDP2 shards the model over them on the
"ddpkit" backend (shared memory inside the host), and FSDP2's all-reduce hook averages each
reduce-scattered gradient shard over the quorum through torchft's ManagedProcessGroup on
``ddpkit.torchft.ProcessGroupDdpkit`` (rank k of every group: one rank per host, ddpkit's path across
hosts), as torchtitan's fault tolerance does. One group dies in its backward (both ranks SIGKILLed
between two of its cross-host all-reduces), the others discard that step and go on; a replacement
group starts on the same host and heals each rank's shards from a peer group's. Every group's shards
and momentum end bitwise equal to each other and to a single-process replay of the logged membership.
"""

import signal
import sys
from pathlib import Path

import pytest
import torch

from helpers import needs_hosts, torchft_hosts

torchft = pytest.importorskip("torchft", reason="scripts/setup.sh installs torchft with the test extra")

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
import ft_hsdp_worker as worker  # noqa: E402
import ft_replica  # noqa: E402

STEPS = 1000  # an upper bound: the test sets the last step once the replacement is back
RANKS = 2


def shard(full: torch.Tensor, rank: int) -> torch.Tensor:
    """FSDP2's shard of `full` on `rank` (dim-0 chunks; these shapes divide evenly)."""
    return full.chunk(RANKS, dim=0)[rank]


@needs_hosts
def test_hsdp_kill_and_rejoin_across_simulated_hosts(tmp_path):
    count, victim, die_step = 3, 1, 4
    with torchft_hosts(tmp_path, count, lambda replica: replica) as on_host:
        groups = ft_replica.ReplicaGroups(
            tmp_path,
            "unused",
            ["--ranks", str(RANKS), "--steps", str(STEPS), "--compute", "0.05", "--die", str(victim), str(die_step)],
            count,
            launch=on_host,
            script=Path(worker.__file__),
        )
        survivors = [r for r in range(count) if r != victim]
        try:
            # The replacement group: its start-up beside the others', held until the death.
            groups.start_all(spares=(victim,), ranks=RANKS)
            groups.wait_until(lambda: groups.processes[victim].poll() is not None, 180, "the victim group's death")
            assert groups.processes[victim].returncode == -signal.SIGKILL, groups.output(victim)
            groups.wait_until(
                lambda: all(
                    sum(r["participants"] == count - 1 for r in groups.committed(s)) >= 2 * RANKS for s in survivors
                ),
                120,
                "steps committed without the killed group",
            )
            groups.release(victim)
            groups.wait_until(
                lambda: (
                    {
                        r["rank"]
                        for r in groups.committed(victim)
                        if r["incarnation"] == 2 and r["participants"] == count
                    }
                    == set(range(RANKS))
                ),
                180,
                "a step committed by both ranks of the replacement",
            )
            last = max(r["step"] for r in groups.committed(victim)) + 2
            groups.stop_at(last)
            groups.wait_all(90)
        finally:
            groups.close()

    killed = [r for r in groups.records(victim) if "killed" in r]
    assert [k["step"] for k in killed] == [die_step], killed
    # The survivors' all-reduces of that step failed on the dead group (ddpkit names the lost peer), and
    # every rank of theirs discarded the step (a group's ranks commit together).
    for replica in survivors:
        failed = [r for r in groups.iterations(replica) if r["step"] == die_step and not r["committed"]]
        assert {r["rank"] for r in failed} == set(range(RANKS)), failed
        assert any("ddpkit.all_reduce" in (r["errored"] or "") for r in failed), failed
    # Both ranks of a group decide alike: the same steps committed, in the same quorums.
    for replica in range(count):
        decided = {
            rank: [
                (r["step"], r["incarnation"], r["participants"], r["participating"])
                for r in groups.committed(replica)
                if r["rank"] == rank
            ]
            for rank in range(RANKS)
        }
        assert decided[0] == decided[1], f"replica {replica}: its ranks committed differently"
    members = ft_replica.membership(groups)
    assert sorted(members) == list(range(last)), f"steps committed: {sorted(members)}"
    assert any(victim in m for s, (m, n) in members.items() if s < die_step), members
    assert any(victim not in m for s, (m, n) in members.items() if s >= die_step), members
    assert members[last - 1] == (set(range(count)), count), members
    # The replacement healed (took no part in its first step) before it trained with the others.
    first = min(r["step"] for r in groups.committed(victim) if r["incarnation"] == 2)
    assert victim not in members[first][0], members[first]

    expected = worker.replay(members, last, RANKS)
    for replica in range(count):
        for rank in range(RANKS):
            final = torch.load(tmp_path / f"r{replica}.pt.rank{rank}")
            assert final["step"] == last
            for index, (param, momentum) in enumerate(zip(final["params"], final["momentum"])):
                what = f"replica {replica}, rank {rank}, parameter {index}"
                assert torch.equal(param, shard(expected["params"][index], rank)), what
                assert torch.equal(momentum, shard(expected["momentum"][index], rank)), f"{what}: momentum"
