"""Fault tolerance side by side: torchft on gloo, torchft on ddpkit, and torchrun --max-restarts with a
checkpoint (no torchft), in one run. Writes benchmarks/results/fault_tolerance.json.

    .venv/bin/python benchmarks/bench_fault_tolerance.py

For each torchft candidate (ProcessGroupGloo, ddpkit.torchft.ProcessGroupDdpkit; torchft's Manager,
DDP and optimizer wrappers; one lighthouse per run with the same settings for both):
  - steady state: the median step time of 2 replica groups training the 8.4M-parameter MLP (8 linear
    layers 1024 wide), without failures, with each of --steady-wrappers (torchft's DDP, whose hook
    waits for each bucket; torchft's DDP with ddpkit.torchft's hook, which does not; ddpkit's DDP
    with that hook); beside them the floor (unless --no-floor): the same manager, lighthouse, model and
    wrapper on torchft's ProcessGroupDummy, which communicates nothing, so that floor/gloo is the
    least ratio any process group could reach here (summary's ratios_floor_over_gloo);
  - kill: 3 replica groups of a small MLP with a stand-in compute per step; one is SIGKILLed mid-run
    and restarted --restart-delay later. Figures: death to the survivors' next committed step (the
    last survivor's), and its timeline: the failed collective noticed (the end of the first iteration
    discarded) and the next quorum in (the lighthouse's part), restart to the rejoined replica's first
    committed step, the steps lost (steps
    some replica had committed and no longer holds: always 0 under torchft) and the iterations the
    survivors did not commit in between.
The baseline is one torchrun job of 3 ranks (ddpkit backend and DDP, a checkpoint after every step,
--max-restarts 1): a rank kills itself, torchrun restarts the whole job, which resumes from the
checkpoint. Its kill and restart figures are measured from the same logs.
Each kill is repeated --repeats times, candidates interleaved; the medians are reported.
`--kill-wrappers` with no wrapper and `--no-baseline` leave the steady state alone:

    .venv/bin/python benchmarks/bench_fault_tolerance.py --steady-wrappers torchft-ddp --kill-wrappers --no-baseline

`--quick` is a smoke run (one repeat of shorter runs, into benchmarks/results/quick/), as run_all.sh --quick makes.

Across hosts (root: ddpkit.testing.torchft_hosts' simulated hosts), the steady step alone, one replica group
per host, links shaped to --link; writes fault_tolerance_hosts.json: torchft on gloo, on ddpkit, and on
ddpkit with its all-reduces crossing hosts in bfloat16 (ProcessGroupDdpkit(cross_host_dtype=...), Note
[Compressed crossing]), interleaved:

    sudo .venv/bin/python benchmarks/bench_fault_tolerance.py --hosts 4 --link 1gbit --steady-wrappers torchft-ddp

A delayed link ("1gbit-10ms": the hosts behind a router that holds each packet half the round trip, as
bench_multihost.py's) writes where --name says:

    sudo .venv/bin/python benchmarks/bench_fault_tolerance.py --hosts 2 --link 1gbit-10ms --steady-wrappers torchft-ddp \
        --name fault_tolerance_hosts_delayed
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ft_replica  # noqa: E402
import records  # noqa: E402
from common import results_dir, write_results  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def lighthouse(heartbeat_ms: int):
    from torchft._torchft import LighthouseServer

    return LighthouseServer(
        bind="[::]:0", min_replicas=1, join_timeout_ms=400, quorum_tick_ms=20, heartbeat_timeout_ms=heartbeat_ms
    )


def steady_state(pg: str, wrapper: str, steps: int, heartbeat_ms: int) -> dict:
    server = lighthouse(heartbeat_ms)
    with tempfile.TemporaryDirectory() as folder:
        groups = ft_replica.ReplicaGroups(
            Path(folder),
            server.address(),
            [
                "--pg",
                "dummy" if pg == "floor" else pg,
                "--wrapper",
                wrapper,
                "--model",
                "mlp8x1024",
                "--steps",
                str(steps),
            ],
            2,
        )
        try:
            groups.start_all()
            groups.wait_all(600)
        finally:
            groups.close()
            server.shutdown()
        steps = [r for replica in range(2) for r in groups.committed(replica) if r["step"] >= 3]
    return {
        "step_s": statistics.median(r["end"] - r["start"] for r in steps),
        "comm_s": statistics.median(r["comm_s"] for r in steps),
    }


def steady_across_hosts(candidate: str, wrapper: str, steps: int, hosts: int, link: str, heartbeat_ms: int) -> dict:
    """steady_state with one replica group per simulated host; `candidate` a HOSTS_CANDIDATES key."""
    from ddpkit.testing import parse_link, torchft_hosts

    pg, cross_host_dtype = HOSTS_CANDIDATES[candidate]
    with tempfile.TemporaryDirectory() as folder:
        with torchft_hosts(
            Path(folder), hosts, lambda replica: replica, heartbeat_ms=heartbeat_ms, **parse_link(link)
        ) as on_host:
            arguments = ["--pg", pg, "--wrapper", wrapper, "--model", "mlp8x1024", "--steps", str(steps)]
            groups = ft_replica.ReplicaGroups(
                Path(folder), "unused", [*arguments, "--cross-host-dtype", cross_host_dtype], hosts, launch=on_host
            )
            try:
                groups.start_all()
                groups.wait_all(600)
            finally:
                groups.close()
            steps = [r for replica in range(hosts) for r in groups.committed(replica) if r["step"] >= 3]
    return {
        "step_s": statistics.median(r["end"] - r["start"] for r in steps),
        "comm_s": statistics.median(r["comm_s"] for r in steps),
    }


# Across hosts: candidate -> (ft_replica.py's --pg, its --cross-host-dtype).
HOSTS_CANDIDATES = {
    "torchft-gloo": ("gloo", "none"),
    "torchft-ddpkit": ("ddpkit", "none"),
    "torchft-ddpkit-bf16": ("ddpkit", "bfloat16"),
}


def main_across_hosts(args) -> None:
    rows = []
    names = list(HOSTS_CANDIDATES)
    for repeat in range(args.repeats):
        order = names[repeat % len(names) :] + names[: repeat % len(names)]
        for wrapper in args.steady_wrappers:
            for candidate in order:
                steady = steady_across_hosts(
                    candidate, wrapper, args.steady_steps, args.hosts, args.link, args.heartbeat_ms
                )
                rows.append(
                    records.FaultToleranceRecord(
                        candidate=candidate,
                        measure="steady",
                        repeat=repeat,
                        wrapper=wrapper,
                        topology=f"{args.hosts}x1",
                        link=args.link,
                        **steady,
                    )
                )
                print(candidate, wrapper, "steady", steady, flush=True)
    summary = {}
    for wrapper in args.steady_wrappers:
        medians = {
            c: statistics.median(r.step_s for r in rows if r.candidate == c and r.wrapper == wrapper) for c in names
        }
        gloo = medians["torchft-gloo"]
        summary[wrapper] = {"median_step_s": medians, "over_gloo": {c: m / gloo for c, m in medians.items()}}
    output = Path(args.output) if args.output else results_dir(args.quick) / f"{args.name}.json"
    settings = {
        "hosts": args.hosts,
        "link": args.link,
        "repeats": args.repeats,
        "steady_steps": args.steady_steps,
        "heartbeat_ms": args.heartbeat_ms,
        "candidates": {c: {"pg": pg, "cross_host_dtype": d} for c, (pg, d) in HOSTS_CANDIDATES.items()},
        "replicas": "one replica group of one rank per simulated host (ddpkit.testing.torchft_hosts)",
    }
    path = write_results(
        args.name,
        backend="gloo",
        device_type="cpu",
        settings=settings,
        records=rows,
        summary=summary,
        quick=args.quick,
        directory=output.parent,
    )
    print(json.dumps(summary, indent=1))
    print(f"wrote {path}")


def kill_run(pg: str, wrapper: str, args) -> dict:
    server = lighthouse(args.heartbeat_ms)
    victim, count = 1, 3
    with tempfile.TemporaryDirectory() as folder:
        groups = ft_replica.ReplicaGroups(
            Path(folder),
            server.address(),
            ["--pg", pg, "--wrapper", wrapper, "--steps", str(args.kill_steps), "--compute", str(args.compute)],
            count,
        )
        try:
            groups.start_all()
            groups.wait_until(
                lambda: any(r["participants"] == count and r["step"] >= 5 for r in groups.committed(victim)),
                120,
                "a full quorum",
            )
            committed_before = {r: {x["step"] for x in groups.committed(r)} for r in range(count)}
            killed = time.time()
            groups.signal(victim, signal.SIGKILL)
            survivors = [r for r in range(count) if r != victim]
            groups.wait_until(
                lambda: all(any(x["end"] > killed for x in groups.committed(s)) for s in survivors),
                120,
                "the survivors' next commit",
            )
            time.sleep(args.restart_delay)
            restarted = time.time()
            groups.start(victim)
            groups.wait_until(
                lambda: any(x["incarnation"] == 2 for x in groups.committed(victim)),
                300,
                "the rejoined replica's first commit",
            )
            groups.wait_all(300)
            survivor_error = None
        except RuntimeError as error:  # a candidate that died: recorded, not fatal to the benchmark
            survivor_error = str(error)[-1500:]
        finally:
            groups.close()
            server.shutdown()
        if survivor_error:
            return {"failed": survivor_error}
        next_commit = max(min(x["end"] for x in groups.committed(s) if x["end"] > killed) for s in survivors)
        rejoin = min(x["end"] for x in groups.committed(victim) if x["incarnation"] == 2)
        ready = min(x["ready"] for x in groups.records(victim) if "ready" in x and x["incarnation"] == 2)
        final = {r: {x["step"] for x in groups.committed(r)} for r in survivors}
        lost = sum(len(committed_before[r] - final[r]) for r in survivors)
        uncommitted = sum(
            1 for s in survivors for x in groups.iterations(s) if x["start"] > killed - 1 and not x["committed"]
        )
        # The survivors' side of the timeline: the failed collective noticed (the first iteration that ended
        # discarded), then the next quorum (the lighthouse's heartbeat and join timeouts), then the commit.
        discarded = [
            [x["end"] for x in groups.iterations(s) if x["end"] > killed and not x["committed"]] for s in survivors
        ]
        noticed = max(min(ends) for ends in discarded) - killed if all(discarded) else None
        next_quorum = (
            max(min((x["end"], x["quorum"]) for x in groups.committed(s) if x["end"] > killed)[1] for s in survivors)
            - killed
        )
        timeline = sorted(
            (
                round(x["end"] - killed, 3),
                x["replica"],
                x["step"],
                x["committed"],
                x["participants"],
                round(x["quorum"] - killed, 3),
                round(x["start"] - killed, 3),
            )
            for r in range(count)
            for x in groups.iterations(r)
            if -0.3 < x["end"] - killed < 3
        )
    return {
        "death_to_next_commit_s": next_commit - killed,
        "noticed_s": noticed,
        "next_quorum_s": next_quorum,
        "restart_to_first_commit_s": rejoin - restarted,
        "ready_to_first_commit_s": rejoin - ready,
        "steps_lost": lost,
        "uncommitted_iterations": uncommitted,
        "timeline": timeline,
    }


def baseline_run(args) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        log = Path(folder) / "log.jsonl"
        env = {
            **os.environ,
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
            "OMP_NUM_THREADS": "1",
            "PET_MASTER_PORT": str(ft_replica.free_port()),
        }
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "3",
            "--max-restarts",
            "1",
            str(Path(ft_replica.__file__)),
            "--baseline",
            "--steps",
            str(args.kill_steps),
            "--compute",
            str(args.compute),
            "--kill-rank",
            "1",
            "--kill-step",
            "8",
            "--records",
            str(log),
            "--out",
            str(Path(folder) / "state.pt"),
        ]
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            return {"failed": (done.stdout + done.stderr)[-1500:]}
        records = [json.loads(line) for line in log.read_text().splitlines()]
    killed = next(r["killed"] for r in records if "killed" in r)
    second = {r["pid"]: r["launched"] for r in records if r.get("attempt") == 1}
    restart = min(second.values())
    steps = [r for r in records if "committed" in r]
    before = {r["step"] for r in steps if r["pid"] not in second}
    after = [r for r in steps if r["pid"] in second]
    first_after = min(r["end"] for r in after)
    restarted_from = min(r["step"] for r in after)
    # The restarted job's first step, counted from its first worker's start: the restart itself
    # (torchrun noticing the death, stopping the others, starting new workers) lies before it.
    return {
        "death_to_next_commit_s": first_after - killed,
        "restart_to_first_commit_s": first_after - restart,
        "ready_to_first_commit_s": first_after
        - min(r["ready"] for r in records if r.get("pid") in second and "ready" in r),
        "steps_lost": max(0, max(before) + 1 - restarted_from),
        "uncommitted_iterations": 0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steady-steps", type=int, default=20)
    parser.add_argument("--kill-steps", type=int, default=30)
    parser.add_argument("--compute", type=float, default=0.02, help="stand-in compute per step, seconds")
    parser.add_argument("--restart-delay", type=float, default=1.0)
    parser.add_argument("--heartbeat-ms", type=int, default=500, help="the lighthouse's heartbeat timeout")
    parser.add_argument(
        "--steady-wrappers",
        nargs="+",
        default=["torchft-ddp", "torchft-ddp-async", "ddpkit-ddp"],
        help="the wrappers whose steady step is measured (ft_replica.py --wrapper)",
    )
    parser.add_argument(
        "--kill-wrappers",
        nargs="*",
        default=["torchft-ddp", "ddpkit-ddp"],
        help="the wrappers whose kill is measured (none: no kill)",
    )
    parser.add_argument(
        "--no-floor",
        action="store_true",
        help="skip the steady state on torchft's ProcessGroupDummy (no communication)",
    )
    parser.add_argument("--no-baseline", action="store_true", help="skip the torchrun --max-restarts baseline")
    parser.add_argument("--quick", action="store_true", help="smoke run: one repeat of shorter runs")
    parser.add_argument("--hosts", type=int, help="the steady step across this many simulated hosts instead")
    parser.add_argument(
        "--link",
        default="1gbit",
        help='--hosts: the links\' tbf rate ("1gbit"), "unshaped", or a rate and a round trip ("1gbit-10ms")',
    )
    parser.add_argument("--name", default="fault_tolerance_hosts", help="--hosts: the results file, without .json")
    parser.add_argument(
        "--output",
        help="a path whose folder gets fault_tolerance.json (default: benchmarks/results/, its quick/ with --quick)",
    )
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.steady_steps, args.kill_steps = 1, 8, 20
    if args.hosts:
        return main_across_hosts(args)
    output = Path(args.output) if args.output else results_dir(args.quick) / "fault_tolerance.json"

    names = {
        "gloo": "torchft-gloo",
        "ddpkit": "torchft-ddpkit",
        "floor": "torchft-floor",
        "torchrun": "torchrun-restart",
    }
    rows = []
    for repeat in range(args.repeats):
        # Candidates interleaved, their order rotating: the machine's drift hits both alike.
        order = ["gloo", "ddpkit"] if repeat % 2 == 0 else ["ddpkit", "gloo"]
        # The floor in the steady state only (a kill has nothing to show on it), in the rotation too.
        steady_order = ["gloo", "ddpkit"] + ([] if args.no_floor else ["floor"])
        steady_order = steady_order[repeat % len(steady_order) :] + steady_order[: repeat % len(steady_order)]
        for wrapper in args.steady_wrappers:
            for pg in steady_order:
                steady = steady_state(pg, wrapper, args.steady_steps, args.heartbeat_ms)
                rows.append(
                    records.FaultToleranceRecord(
                        candidate=names[pg], measure="steady", repeat=repeat, wrapper=wrapper, **steady
                    )
                )
                print(names[pg], wrapper, "steady", steady, flush=True)
        for wrapper in args.kill_wrappers:
            for pg in order:
                kill = kill_run(pg, wrapper, args)
                rows.append(
                    records.FaultToleranceRecord(
                        candidate=names[pg], measure="kill", repeat=repeat, wrapper=wrapper, **kill
                    )
                )
                print(names[pg], wrapper, "kill", {k: v for k, v in kill.items() if k != "timeline"}, flush=True)
        if args.no_baseline:
            continue
        kill = baseline_run(args)
        rows.append(
            records.FaultToleranceRecord(
                candidate="torchrun-restart", measure="kill", repeat=repeat, wrapper="ddpkit-ddp", **kill
            )
        )
        print("torchrun-restart kill", kill, flush=True)

    summary: dict = {}
    for row in rows:
        key = f"{row.candidate}/{row.wrapper}/{row.measure}"
        summary.setdefault(key, []).append(row)
    medians: dict = {}
    for key, group in summary.items():
        ok = [r for r in group if r.failed is None]
        entry = {"runs": len(group), "failed_runs": len(group) - len(ok)}
        for field in (
            "step_s",
            "comm_s",
            "death_to_next_commit_s",
            "noticed_s",
            "next_quorum_s",
            "restart_to_first_commit_s",
            "ready_to_first_commit_s",
            "steps_lost",
            "uncommitted_iterations",
        ):
            values = [getattr(r, field) for r in ok if getattr(r, field) is not None]
            if values:
                entry[field + "_median"] = statistics.median(values)
        medians[key] = entry

    def ratio(key_ours: str, key_gloo: str, field: str) -> float | None:
        ours, gloo = medians.get(key_ours, {}).get(field), medians.get(key_gloo, {}).get(field)
        return ours / gloo if ours is not None and gloo else None

    medians["ratios_ddpkit_over_gloo"] = {
        # the same wrapper on both groups
        "steady_step": ratio("torchft-ddpkit/torchft-ddp/steady", "torchft-gloo/torchft-ddp/steady", "step_s_median"),
        "steady_comm": ratio("torchft-ddpkit/torchft-ddp/steady", "torchft-gloo/torchft-ddp/steady", "comm_s_median"),
        "steady_step_torchft_ddp_async": ratio(
            "torchft-ddpkit/torchft-ddp-async/steady", "torchft-gloo/torchft-ddp-async/steady", "step_s_median"
        ),
        "steady_step_ddpkit_ddp": ratio(
            "torchft-ddpkit/ddpkit-ddp/steady", "torchft-gloo/ddpkit-ddp/steady", "step_s_median"
        ),
        # what a torchft user on gloo gets by moving to ddpkit: torchft's DDP with ddpkit.torchft's hook on
        # ddpkit, against torchft's DDP as shipped on gloo
        "steady_step_async_on_ddpkit_vs_torchft_on_gloo": ratio(
            "torchft-ddpkit/torchft-ddp-async/steady", "torchft-gloo/torchft-ddp/steady", "step_s_median"
        ),
        "noticed_ddpkit_ddp": ratio(
            "torchft-ddpkit/ddpkit-ddp/kill", "torchft-gloo/ddpkit-ddp/kill", "noticed_s_median"
        ),
        "death_to_next_commit_ddpkit_ddp": ratio(
            "torchft-ddpkit/ddpkit-ddp/kill", "torchft-gloo/ddpkit-ddp/kill", "death_to_next_commit_s_median"
        ),
        "restart_to_first_commit_ddpkit_ddp": ratio(
            "torchft-ddpkit/ddpkit-ddp/kill", "torchft-gloo/ddpkit-ddp/kill", "restart_to_first_commit_s_median"
        ),
        "ready_to_first_commit_ddpkit_ddp": ratio(
            "torchft-ddpkit/ddpkit-ddp/kill", "torchft-gloo/ddpkit-ddp/kill", "ready_to_first_commit_s_median"
        ),
    }
    # The floor: a process group that communicates nothing, against gloo (ddpkit's ratio to gloo can go
    # no lower than the floor's), and ddpkit's step against it.
    medians["ratios_floor_over_gloo"] = {
        "steady_step": ratio("torchft-floor/torchft-ddp/steady", "torchft-gloo/torchft-ddp/steady", "step_s_median"),
        "steady_step_torchft_ddp_async": ratio(
            "torchft-floor/torchft-ddp-async/steady", "torchft-gloo/torchft-ddp-async/steady", "step_s_median"
        ),
        "steady_step_ddpkit_ddp": ratio(
            "torchft-floor/ddpkit-ddp/steady", "torchft-gloo/ddpkit-ddp/steady", "step_s_median"
        ),
        "steady_step_ddpkit_over_floor": ratio(
            "torchft-ddpkit/torchft-ddp/steady", "torchft-floor/torchft-ddp/steady", "step_s_median"
        ),
    }
    summary = medians
    settings = {
        k: getattr(args, k)
        for k in (
            "repeats",
            "steady_steps",
            "kill_steps",
            "compute",
            "restart_delay",
            "heartbeat_ms",
            "steady_wrappers",
            "kill_wrappers",
            "no_baseline",
            "no_floor",
            "quick",
        )
    }
    settings["lighthouse"] = {
        "min_replicas": 1,
        "join_timeout_ms": 400,
        "quorum_tick_ms": 20,
        "heartbeat_timeout_ms": args.heartbeat_ms,
    }
    write_results(
        "fault_tolerance",
        backend="ddpkit",
        device_type="cpu",
        settings=settings,
        records=rows,
        summary=summary,
        directory=output.parent,
    )
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
