"""All-reduce, the other collectives and DDP across simulated hosts: ddpkit's hierarchical collectives against gloo.

    sudo .venv/bin/python benchmarks/bench_multihost.py            # about 7 minutes on 2 cores
    sudo .venv/bin/python benchmarks/bench_multihost.py --quick    # a smoke run, into results/quick/
    sudo .venv/bin/python benchmarks/bench_multihost.py --topologies 2x1 --collectives all_reduce \
        --candidates ddpkit ddpkit_star ddpkit_recursive_doubling gloo --output multihost_2x1_algorithms

Each host is a network and a mount namespace of this machine (ddpkit.testing.HostPool: a private
/dev/shm and hostname, a veth link to a bridge, a launcher of its own), so it needs root. Links run
unshaped ("unshaped"), shaped with tc's tbf ("1gbit"), or shaped and delayed ("1gbit-10ms": a rate
and a round trip; the hosts then sit behind a router that holds each packet half the round trip,
since this kernel has no netem; "unshaped-10ms" delays only). A last part names the hosts' TCP
congestion control where it is not this machine's default ("1gbit-10ms-reno"; a network namespace
takes only those net.ipv4.tcp_allowed_congestion_control lists):

    sudo .venv/bin/python benchmarks/bench_multihost.py --topologies 2x1 4x1 2x2 --links 1gbit-10ms 10gbit-1ms \
        --collectives all_reduce --candidates ddpkit ddpkit_kernel_buffers ddpkit_backend ddpkit_bf16 gloo \
        --sizes 1000000 16000000 --no-ddp --output multihost_delayed

Per (hosts, link,
collective, size) every candidate runs in the same repetitions, interleaved (common.interleave); per
repetition each candidate first synchronises through itself, then every rank times a batch of
back-to-back calls; the figure is the median over repetitions of the slowest rank. Candidates:
  ddpkit          ddpkit's collective, algorithm "auto" (hierarchical: the group spans hosts)
  ddpkit_flat     ddpkit's flat schedule over gloo's send/recv: the all-reduce's "halving_doubling",
                  the others' transport "process_group" (no hierarchy)
  ddpkit_bf16     ddpkit's collective with cross_host_dtype=torch.bfloat16 (Note [Compressed crossing])
  ddpkit_<name>   the all-reduce with algorithm <name> ("star", "recursive_doubling", ...)
  ddpkit_links_caller, ddpkit_links_send, ddpkit_links_both
                  ddpkit's collective on a group whose links move every frame on the caller's thread,
                  every exchange's sends on their sending thread, or its receives on their receiving
                  thread too (Note [Threads of the links]; DDPKIT_LINK_THREADS at the group's set-up,
                  a testing build's), whatever this machine's CPUs: what the threads gain where the
                  set-up starts them (ddpkit), and cost where it does not
  ddpkit_kernel_buffers
                  ddpkit's collective on a group whose links leave their send buffers to the kernel
                  (DDPKIT_LINK_SEND_BUFFER=0 at the group's set-up): what Note [Send buffers] gains
  ddpkit_send_buffer_<KiB>
                  the same with a send buffer of <KiB> KiB asked for: the sizes against each other
  ddpkit_backend  torch.distributed's collective on a group of the "ddpkit" backend
  ddpkit_backend_method
                  the all-reduce as the "ddpkit" group's own method, group.allreduce([t], options).wait(),
                  without torch.distributed's Python function around it: what that function costs
  ddpkit_torch_python
                  ddpkit's all-reduce after the statements torch.distributed's all_reduce runs around a
                  group's method (torch 2.13's: its checks and options), without their collective:
                  what that Python costs where every call resumes from a wait (the backend's bound)
  gloo            torch.distributed's collective on a gloo group (the baseline)
The size is the whole tensor: the all-reduce's, broadcast's and reduce's, the all-gather's output
and the reduce-scatter's input (float32). The broadcast's and the reduce's root is the last rank.
Then a DDP step across 2 hosts x 2 ranks on a communication-heavy model (8 linear layers 1024 wide,
8.4M parameters, batch 8 per rank, SGD): ddpkit's DDP, torch DDP on gloo, torch DDP on "ddpkit".
Results: benchmarks/results/multihost.json.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import ddpkit  # noqa: E402
from ddpkit.testing import HostPool, parse_link  # noqa: E402
from peers import timing  # noqa: E402
from records import MultihostCollectiveRecord, MultihostDdpRecord, MultihostRecord  # noqa: E402

CANDIDATES = ("ddpkit", "ddpkit_flat", "ddpkit_backend", "gloo")
COLLECTIVES = ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter")
DDP_CANDIDATES = ("ddpkit_ddp", "torch_ddp_gloo", "torch_ddp_ddpkit")


# --- run on every rank ------------------------------------------------------------------------------


def _groups():
    """The candidates' groups, made once per process: gloo and "ddpkit" groups over every rank."""
    global _GROUPS
    if "_GROUPS" not in globals():
        _GROUPS = {"gloo": dist.new_group(backend="gloo"), "ddpkit": dist.new_group(backend="ddpkit")}
    return _GROUPS


def link_setting(candidate: str) -> tuple[str, str] | None:
    """The environment variable, and its value, that the candidate's group's links are set up with (the
    threads', Note [Threads of the links]; the send buffer's, Note [Send buffers]); None for the others."""
    if candidate in ("ddpkit_links_caller", "ddpkit_links_send", "ddpkit_links_both"):
        return "DDPKIT_LINK_THREADS", candidate.rsplit("_", 1)[1]
    if candidate == "ddpkit_kernel_buffers":
        return "DDPKIT_LINK_SEND_BUFFER", "0"
    prefix = "ddpkit_send_buffer_"
    if candidate.startswith(prefix) and candidate[len(prefix) :].isdigit():
        return "DDPKIT_LINK_SEND_BUFFER", str(int(candidate[len(prefix) :]) * 1024)
    return None


def _links_group(candidate: str) -> dist.ProcessGroup:
    """A gloo group whose links ddpkit set up with the candidate's variable (link_setting), made once
    (every rank asks for the candidates in the same order, so the groups match)."""
    groups = _groups()
    if candidate not in groups:
        name, value = link_setting(candidate)
        os.environ[name] = value
        try:
            groups[candidate] = dist.new_group(backend="gloo")
            ddpkit.barrier(group=groups[candidate])  # the set-up, which reads it
        finally:
            del os.environ[name]
    return groups[candidate]


def user_call(candidate: str, collective: str, tensor: torch.Tensor, block: torch.Tensor) -> Callable[[], object]:
    """The call a user makes for ``candidate``'s ``collective``, bound once, for the timed loop: the loop
    then calls the library's own function with nothing of the benchmark's between (as
    allreduce_candidates.py's ``user_call``). ``block`` is this rank's 1/n of ``tensor`` (the all-gather's
    input, the reduce-scatter's output)."""
    groups = _groups()
    last = dist.get_world_size() - 1
    if candidate == "ddpkit_backend_method":
        assert collective == "all_reduce", f"{candidate} is the all-reduce's method"
        options = dist.AllreduceOptions()
        options.asyncOp = False
        return lambda: groups["ddpkit"].allreduce([tensor], options).wait()
    if candidate == "ddpkit_torch_python":
        assert collective == "all_reduce", f"{candidate} is the all-reduce's"
        return functools.partial(_torch_python_then_all_reduce, tensor, groups["gloo"])
    if candidate in ("gloo", "ddpkit_backend"):
        library, options = dist, {"group": groups["gloo" if candidate == "gloo" else "ddpkit"]}
    elif link_setting(candidate) is not None:
        library, options = ddpkit, {"group": _links_group(candidate)}
    else:
        library, options = ddpkit, {"group": groups["gloo"]}
        if candidate == "ddpkit_flat":
            options.update(algorithm="halving_doubling") if collective == "all_reduce" else options.update(
                transport="process_group"
            )
        elif candidate == "ddpkit_bf16":
            assert collective in ("all_reduce", "reduce_scatter"), f"{candidate} compresses sums only"
            options.update(cross_host_dtype=torch.bfloat16)
        elif candidate != "ddpkit":
            assert collective == "all_reduce", f"{candidate} names an all-reduce algorithm"
            options.update(algorithm=candidate[len("ddpkit_") :])
    arguments = {
        "all_reduce": (tensor,),
        "broadcast": (tensor,),
        "reduce": (tensor,),
        "all_gather": (tensor, block),
        "reduce_scatter": (block, tensor),
    }[collective]
    options.update({"broadcast": {"src": last}, "reduce": {"dst": last}}.get(collective, {}))
    function = getattr(
        library,
        {"all_gather": "all_gather_into_tensor", "reduce_scatter": "reduce_scatter_tensor"}.get(collective, collective),
    )
    return functools.partial(function, *arguments, **options)


def _torch_python_then_all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup) -> None:
    """The statements of torch.distributed's all_reduce (torch 2.13) before it calls the group's
    method, on a tensor and group that take none of their branches, then ddpkit's all-reduce."""
    c10d = dist.distributed_c10d
    if torch.overrides.has_torch_function((tensor,)):
        raise TypeError("a tensor subclass takes another path")
    c10d._check_single_tensor(tensor, "tensor")
    if c10d._rank_not_in_group(group) or tensor.is_complex():
        raise ValueError("not a path this candidate times")
    options = dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp.SUM
    options.asyncOp = False
    if group in c10d._world.pg_coalesce_state:
        raise ValueError("not a path this candidate times")
    ddpkit.all_reduce(tensor, group=group)


def thread_cpu_ns() -> dict:
    """CPU time so far of each of this process's threads, in nanoseconds, by thread id (/proc's
    schedstat)."""
    spent = {}
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/schedstat") as schedstat:
                spent[task] = int(schedstat.read().split()[0])
        except OSError:
            pass  # it ended meanwhile
    return spent


def timed(call: Callable[[], object], calls: int) -> dict:
    """This rank's seconds per call of ``call`` over ``calls`` back-to-back calls, the CPU seconds per
    call its process spent meanwhile (every thread: gloo's own threads count as ddpkit's do), and
    those of its busiest thread: the CPU one thread must get through per call however many cores the
    machine has (Note [Threads of the links])."""
    threads = thread_cpu_ns()
    cpu = time.process_time()  # after /proc's reading, which is not the call's CPU
    seconds = common.time_per_call(call, calls=calls)
    cpu_s = (time.process_time() - cpu) / calls
    busiest = max((spent - threads.get(task, 0) for task, spent in thread_cpu_ns().items()), default=0)
    return {"seconds": seconds, "cpu_s": cpu_s, "busiest_thread_cpu_s": busiest / 1e9 / calls}


def case_collective(collective: str, numel: int, reps: int, calls: int, candidates: list) -> dict:
    """Per candidate: this rank's repetitions, each ``timed``'s seconds and CPU seconds per call."""
    world_size = dist.get_world_size()
    numel -= numel % world_size  # whole blocks for the all-gather and the reduce-scatter
    tensor = torch.ones(numel)
    block = torch.ones(numel // world_size)
    sync, sync_block = torch.ones(world_size), torch.ones(1)
    timed_calls = {candidate: user_call(candidate, collective, tensor, block) for candidate in candidates}
    syncs = {candidate: user_call(candidate, collective, sync, sync_block) for candidate in candidates}
    for candidate in candidates:  # warm: set-up, connections, caches
        timed_calls[candidate]()

    def measure(candidate: str) -> dict:
        syncs[candidate]()
        return timed(timed_calls[candidate], calls)

    return common.interleave(candidates, reps, measure, warmup=1)


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(8):
        layers += [torch.nn.Linear(1024, 1024), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers)


def case_ddp(reps: int, steps: int, candidates: list) -> dict:
    groups = _groups()
    models = {
        "ddpkit_ddp": ddpkit.DistributedDataParallel(_mlp(), process_group=groups["gloo"]),
        "torch_ddp_gloo": torch.nn.parallel.DistributedDataParallel(_mlp(), process_group=groups["gloo"]),
        "torch_ddp_ddpkit": torch.nn.parallel.DistributedDataParallel(_mlp(), process_group=groups["ddpkit"]),
    }
    optimizers = {name: torch.optim.SGD(model.parameters(), lr=1e-3) for name, model in models.items()}
    x = torch.randn(8, 1024)

    def step(name: str) -> None:
        optimizers[name].zero_grad()
        models[name](x).square().mean().backward()
        optimizers[name].step()

    sync = torch.ones(1)

    def measure(name: str) -> dict:
        dist.all_reduce(sync, group=groups["gloo"])
        return timed(functools.partial(step, name), steps)

    return common.interleave(candidates, reps, measure, warmup=1)


# --- parent ---------------------------------------------------------------------------------------


def slowest(per_rank: list, candidate: str) -> list:
    """Per repetition, the slowest rank's seconds per call."""
    return timing.slowest_per_rep([[rep["seconds"] for rep in rank[candidate]] for rank in per_rank])


def cpu_figures(per_rank: list, candidate: str) -> dict:
    """The CPU the ranks spent per call, summed over ranks (all on this machine), median over
    repetitions; and its share of this machine's CPUs over the slowest rank's time: near 1, a
    candidate was bound by the CPUs the simulated hosts share, not by its link."""
    totals = [sum(column) for column in zip(*[[rep["cpu_s"] for rep in rank[candidate]] for rank in per_rank])]
    cpus = os.cpu_count() or 1
    busy = [total / (seconds * cpus) for total, seconds in zip(totals, slowest(per_rank, candidate))]
    busiest = [
        max(column) for column in zip(*[[rep["busiest_thread_cpu_s"] for rep in rank[candidate]] for rank in per_rank])
    ]
    return {
        "all_ranks_cpu_s": common.median(totals),
        "cpu_busy": common.median(busy),
        "busiest_thread_cpu_s": common.median(busiest),
    }


def parse_topology(topology: str) -> tuple[int, int]:
    """ "NxM": N simulated hosts of M ranks each."""
    try:
        hosts, ranks = (int(part) for part in topology.lower().split("x"))
    except ValueError:
        raise SystemExit(f"bench_multihost: a topology is HOSTSxRANKS, such as 4x2, got {topology!r}") from None
    if hosts < 2 or ranks < 1:
        raise SystemExit(f"bench_multihost: {topology}: at least 2 hosts of at least 1 rank each")
    return hosts, ranks


def ranks_per_host(topology: str) -> list:
    hosts, ranks = parse_topology(topology)
    return [ranks] * hosts


# Bits per second of a tc tbf rate as bench_multihost takes it ("1gbit", "10gbit", "500mbit").
RATE_UNITS = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3}


def link_bits_per_s(link: str):
    """The rate of a link named as --links takes it ("1gbit", "1gbit-10ms"); None where unshaped."""
    rate = parse_link(link)["rate"]
    for unit, scale in RATE_UNITS.items():
        if rate is not None and rate.endswith(unit):
            return float(rate[: -len(unit)]) * scale
    return None


def link_figures(hosts: int, numel: int, seconds: float, link: str) -> dict:
    """An all-reduce's bus bandwidth across hosts, 2(N-1)/N of its bytes per host link over its time
    (N hosts: what a bandwidth-optimal all-reduce moves over each host's link, whatever the ranks per
    host), and its fraction of the link's rate where the link is shaped."""
    bus = 4 * numel * 2 * (hosts - 1) / hosts / seconds  # bytes per second, float32
    rate = link_bits_per_s(link)
    return {"bus_bandwidth_GBps": bus / 1e9, "link_fraction": None if rate is None else bus * 8 / rate}


def calls_for(numel: int) -> int:
    return 16 if numel <= 10_000 else 4 if numel <= 100_000 else 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--topologies", nargs="+", default=["2x2", "2x1"], help="HOSTSxRANKS each, such as 3x1, 4x2, 8x1"
    )
    parser.add_argument(
        "--links",
        nargs="+",
        default=["unshaped", "10gbit", "1gbit"],
        help="RATE[-ROUNDTRIPms][-CONGESTION_CONTROL] each",
    )
    parser.add_argument("--collectives", nargs="+", choices=COLLECTIVES, default=list(COLLECTIVES))
    parser.add_argument(
        "--candidates",
        nargs="+",
        default=list(CANDIDATES),
        help="the all-reduce's; the other collectives take those of ddpkit, ddpkit_flat, "
        "ddpkit_backend and gloo among them (gloo is always measured)",
    )
    parser.add_argument(
        "--sizes", nargs="+", type=int, default=[1000, 100_000, 1_000_000, 16_000_000], help="the all-reduce's"
    )
    parser.add_argument(
        "--other-sizes", nargs="+", type=int, default=[1000, 1_000_000, 16_000_000], help="the other collectives'"
    )
    parser.add_argument(
        "--reps",
        type=int,
        default=25,
        help="the all-reduce's repetitions up to 1M floats (half above): its figures carry the bars",
    )
    parser.add_argument(
        "--other-reps", type=int, default=11, help="the other collectives' repetitions up to 1M floats (half above)"
    )
    parser.add_argument("--ddp-reps", type=int, default=10)
    parser.add_argument("--no-ddp", action="store_true", help="skip the DDP step")
    parser.add_argument("--output", default="multihost", help="results file name, without .json")
    parser.add_argument("--quick", action="store_true", help="2x2 unshaped, small sizes, few repetitions")
    args = parser.parse_args()
    if args.quick:
        args.topologies, args.links, args.sizes, args.other_sizes = ["2x2"], ["unshaped"], [1000, 100_000], [1000]
        args.reps, args.other_reps, args.ddp_reps = 3, 3, 2
    candidates = list(dict.fromkeys(args.candidates + ["gloo"]))
    reason = HostPool.unavailable(delayed=any(parse_link(link)["round_trip_ms"] for link in args.links))
    if reason:
        sys.exit(f"bench_multihost: {reason}")
    cases = importlib.import_module("bench_multihost")  # what the ranks can unpickle by name
    records = []
    for topology in args.topologies:
        hosts, _ = parse_topology(topology)
        for link in args.links:
            pool = HostPool(ranks_per_host(topology), group_timeout=600, timeout=3600, **parse_link(link))
            try:
                for collective in args.collectives:
                    names = candidates if collective == "all_reduce" else [c for c in candidates if c in CANDIDATES]
                    for numel in args.sizes if collective == "all_reduce" else args.other_sizes:
                        wanted = args.reps if collective == "all_reduce" else args.other_reps
                        reps = wanted if numel <= 1_000_000 else max(3, wanted // 2)
                        per_rank = pool.run(
                            cases.case_collective, collective, numel, reps, calls_for(numel), names, timeout=3600
                        )
                        gloo = common.median(slowest(per_rank, "gloo"))
                        row = []
                        for candidate in names:
                            stats = timing.time_stats(slowest(per_rank, candidate))
                            fields = dict(
                                topology=topology,
                                link=link,
                                numel=numel,
                                candidate=candidate,
                                median_s=stats["median_s"],
                                p25_s=stats["p25_s"],
                                p75_s=stats["p75_s"],
                                reps=reps,
                                batch=calls_for(numel),
                                ratio_to_gloo=stats["median_s"] / gloo,
                                **cpu_figures(per_rank, candidate),
                            )
                            if collective == "all_reduce":
                                row.append(
                                    MultihostRecord(**fields, **link_figures(hosts, numel, stats["median_s"], link))
                                )
                            else:
                                row.append(MultihostCollectiveRecord(collective=collective, **fields))
                        records += row
                        print(
                            f"{topology} {link} {collective} {numel}: "
                            + ", ".join(
                                f"{r.candidate} {common.seconds(r.median_s)} ({r.ratio_to_gloo:.2f}x, CPUs {r.cpu_busy:.0%} busy)"
                                for r in row
                            ),
                            flush=True,
                        )
                if topology == "2x2" and link == "unshaped" and not args.no_ddp:
                    per_rank = pool.run(cases.case_ddp, args.ddp_reps, 3, list(DDP_CANDIDATES), timeout=3600)
                    baseline = common.median(slowest(per_rank, "torch_ddp_gloo"))
                    for candidate in DDP_CANDIDATES:
                        times = slowest(per_rank, candidate)
                        stats = timing.time_stats(times)
                        records.append(
                            MultihostDdpRecord(
                                topology=topology,
                                link=link,
                                candidate=candidate,
                                median_s=stats["median_s"],
                                p25_s=stats["p25_s"],
                                p75_s=stats["p75_s"],
                                reps=len(times),
                                ratio_to_torch_ddp_gloo=stats["median_s"] / baseline,
                                **cpu_figures(per_rank, candidate),
                            )
                        )
            finally:
                pool.close()
    summary = {
        f"{r.topology} {r.link} numel={r.numel} {r.candidate}": r.ratio_to_gloo
        for r in records
        if isinstance(r, MultihostRecord) and r.candidate != "gloo"
    }
    summary.update(
        {
            f"{r.collective} {r.topology} {r.link} numel={r.numel} {r.candidate}": r.ratio_to_gloo
            for r in records
            if isinstance(r, MultihostCollectiveRecord) and r.candidate != "gloo"
        }
    )
    summary.update(
        {
            f"ddp {r.topology} {r.link} {r.candidate}": r.ratio_to_torch_ddp_gloo
            for r in records
            if isinstance(r, MultihostDdpRecord)
        }
    )
    path = common.write_results(
        args.output,
        backend="gloo",
        device_type="cpu",
        quick=args.quick,
        records=records,
        summary=summary,
        settings={
            "topologies": args.topologies,
            "links": args.links,
            "collectives": args.collectives,
            "sizes": args.sizes,
            "other_sizes": args.other_sizes,
            "reps": args.reps,
            "other_reps": args.other_reps,
            "ddp_reps": 0 if args.no_ddp else args.ddp_reps,
            "candidates": candidates,
            "ddp_candidates": [] if args.no_ddp else list(DDP_CANDIDATES),
            "dtype": "float32",
            "threads_per_process": 1,
            "hosts": "network + mount namespaces, veth to a bridge, tc tbf shaping; a delayed link (RATE-RTTms): "
            "each host behind a router that holds every packet half the round trip (ddpkit_tun_delay) "
            "(ddpkit.testing.HostPool)",
            "timing": "per repetition: one call of the candidate to synchronise, then a batch of back-to-back "
            "calls of the library's own function timed on every rank; slowest rank per repetition, "
            "median over interleaved repetitions",
            "cpu": "all_ranks_cpu_s: every rank's process CPU time per call (time.process_time, all threads), "
            "summed over ranks, median over repetitions; cpu_busy: that sum over (the slowest "
            "rank's time x this machine's CPUs), median over repetitions; busiest_thread_cpu_s: the CPU "
            "time per call of the busiest thread of any rank (/proc's schedstat), median over repetitions",
            "cpus": os.cpu_count(),
        },
    )
    print()
    table = {
        "headers": {
            "median_s": "median",
            "ratio_to_gloo": "/ gloo",
            "cpu_busy": "CPUs busy",
            "busiest_thread_cpu_s": "busiest thread",
            "link_fraction": "of link",
        },
        "formats": {
            "median_s": common.seconds,
            "ratio_to_gloo": common.times,
            "cpu_busy": lambda share: f"{share:.0%}",
            "busiest_thread_cpu_s": common.seconds,
            "link_fraction": lambda share: "-" if share is None else f"{share:.2f}",
        },
    }
    common.print_table(
        [r for r in records if isinstance(r, MultihostRecord)],
        [
            "topology",
            "link",
            "numel",
            "candidate",
            "median_s",
            "ratio_to_gloo",
            "link_fraction",
            "cpu_busy",
            "busiest_thread_cpu_s",
        ],
        align_left=["topology", "link", "candidate"],
        keys=4,
        **table,
    )
    others = [r for r in records if isinstance(r, MultihostCollectiveRecord)]
    if others:
        print()
        common.print_table(
            others,
            ["collective", "topology", "link", "numel", "candidate", "median_s", "ratio_to_gloo", "cpu_busy"],
            align_left=["collective", "topology", "link", "candidate"],
            keys=5,
            **table,
        )
    ddp = [r for r in records if isinstance(r, MultihostDdpRecord)]
    if ddp:
        print()
        common.print_table(
            ddp,
            ["topology", "candidate", "median_s", "ratio_to_torch_ddp_gloo"],
            headers={"median_s": "step", "ratio_to_torch_ddp_gloo": "/ torch DDP on gloo"},
            formats={"median_s": common.seconds, "ratio_to_torch_ddp_gloo": common.times},
            align_left=["topology", "candidate"],
        )
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
