"""All-reduce and DDP across simulated hosts: ddpkit's hierarchical collectives against gloo.

    sudo .venv/bin/python benchmarks/bench_multihost.py            # about 25 minutes on 2 cores
    sudo .venv/bin/python benchmarks/bench_multihost.py --quick    # a smoke run, into results/quick/

Each host is a network and a mount namespace of this machine (ddpkit.testing.HostPool: a private
/dev/shm and hostname, a veth link to a bridge, a launcher of its own), so it needs root. Links run
unshaped and shaped with tc's tbf (no netem in this kernel: bandwidth only). Per (hosts, link, size)
every candidate runs in the same repetitions, interleaved (common.interleave); per repetition each
candidate first synchronises through itself, then every rank times a batch of back-to-back calls;
the figure is the median over repetitions of the slowest rank. Candidates:
  ddpkit          ddpkit.all_reduce, algorithm "auto" (hierarchical where some host holds several ranks)
  ddpkit_flat     ddpkit.all_reduce, algorithm "halving_doubling": ddpkit's schedule over gloo's send/recv
  ddpkit_backend  torch.distributed.all_reduce on a group of the "ddpkit" backend
  gloo            torch.distributed.all_reduce on a gloo group (the baseline)
Then a DDP step across 2 hosts x 2 ranks on a communication-heavy model (8 linear layers 1024 wide,
8.4M parameters, batch 8 per rank, SGD): ddpkit's DDP, torch DDP on gloo, torch DDP on "ddpkit".
Results: benchmarks/results/multihost.json.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from peers import timing  # noqa: E402
from records import MultihostDdpRecord, MultihostRecord  # noqa: E402

import ddpkit  # noqa: E402
from ddpkit.testing import HostPool  # noqa: E402

CANDIDATES = ("ddpkit", "ddpkit_flat", "ddpkit_backend", "gloo")
DDP_CANDIDATES = ("ddpkit_ddp", "torch_ddp_gloo", "torch_ddp_ddpkit")


# --- run on every rank ------------------------------------------------------------------------------

def _groups():
    """The candidates' groups, made once per process: gloo and "ddpkit" groups over every rank."""
    global _GROUPS
    if "_GROUPS" not in globals():
        _GROUPS = {"gloo": dist.new_group(backend="gloo"), "ddpkit": dist.new_group(backend="ddpkit")}
    return _GROUPS


def _call(candidate: str, tensor: torch.Tensor) -> None:
    groups = _groups()
    if candidate == "ddpkit":
        ddpkit.all_reduce(tensor, group=groups["gloo"])
    elif candidate == "ddpkit_flat":
        ddpkit.all_reduce(tensor, algorithm="halving_doubling", group=groups["gloo"])
    elif candidate == "ddpkit_backend":
        dist.all_reduce(tensor, group=groups["ddpkit"])
    else:
        dist.all_reduce(tensor, group=groups["gloo"])


def case_all_reduce(numel: int, reps: int, calls: int, candidates: list) -> dict:
    """Per candidate: this rank's seconds per call in each repetition."""
    tensor = torch.ones(numel)
    sync = torch.ones(1)
    for candidate in candidates:  # warm: set-up, connections, caches
        _call(candidate, tensor)

    def measure(candidate: str) -> float:
        _call(candidate, sync)
        return common.time_per_call(_call, candidate, tensor, calls=calls)

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

    def measure(name: str) -> float:
        dist.all_reduce(sync, group=groups["gloo"])
        return common.time_per_call(step, name, calls=steps)

    return common.interleave(candidates, reps, measure, warmup=1)


# --- parent ---------------------------------------------------------------------------------------

def slowest(per_rank: list, candidate: str) -> list:
    return timing.slowest_per_rep([rank[candidate] for rank in per_rank])


def calls_for(numel: int) -> int:
    return 16 if numel <= 10_000 else 4 if numel <= 100_000 else 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topologies", nargs="+", default=["2x2", "2x1"])
    parser.add_argument("--links", nargs="+", default=["unshaped", "10gbit", "1gbit"])
    parser.add_argument("--sizes", nargs="+", type=int, default=[1000, 100_000, 1_000_000, 16_000_000])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--ddp-reps", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="2x2 unshaped, small sizes, few repetitions")
    args = parser.parse_args()
    if args.quick:
        args.topologies, args.links, args.sizes, args.reps, args.ddp_reps = ["2x2"], ["unshaped"], [1000, 100_000], 3, 2
    reason = HostPool.unavailable()
    if reason:
        sys.exit(f"bench_multihost: {reason}")
    cases = importlib.import_module("bench_multihost")  # what the ranks can unpickle by name
    shapes = {"2x2": [2, 2], "2x1": [1, 1]}
    records, rows = [], []
    for topology in args.topologies:
        for link in args.links:
            pool = HostPool(shapes[topology], group_timeout=600, timeout=3600,
                            rate=None if link == "unshaped" else link)
            try:
                for numel in args.sizes:
                    reps = args.reps if numel <= 1_000_000 else max(3, args.reps // 3)
                    per_rank = pool.run(cases.case_all_reduce, numel, reps, calls_for(numel), list(CANDIDATES),
                                        timeout=3600)
                    gloo = common.median(slowest(per_rank, "gloo"))
                    for candidate in CANDIDATES:
                        times = slowest(per_rank, candidate)
                        stats = timing.time_stats(times)
                        record = MultihostRecord(topology=topology, link=link, numel=numel, candidate=candidate,
                                                 median_s=stats["median_s"], p25_s=stats["p25_s"],
                                                 p75_s=stats["p75_s"], reps=len(times), batch=calls_for(numel),
                                                 ratio_to_gloo=stats["median_s"] / gloo)
                        records.append(record)
                        rows.append(record)
                    print(f"{topology} {link} {numel}: " + ", ".join(
                        f"{r.candidate} {common.seconds(r.median_s)} ({r.ratio_to_gloo:.2f}x)" for r in rows[-4:]),
                        flush=True)
                if topology == "2x2" and link == "unshaped":
                    per_rank = pool.run(cases.case_ddp, args.ddp_reps, 3, list(DDP_CANDIDATES), timeout=3600)
                    baseline = common.median(slowest(per_rank, "torch_ddp_gloo"))
                    for candidate in DDP_CANDIDATES:
                        times = slowest(per_rank, candidate)
                        stats = timing.time_stats(times)
                        records.append(MultihostDdpRecord(topology=topology, link=link, candidate=candidate,
                                                          median_s=stats["median_s"], p25_s=stats["p25_s"],
                                                          p75_s=stats["p75_s"], reps=len(times),
                                                          ratio_to_torch_ddp_gloo=stats["median_s"] / baseline))
            finally:
                pool.close()
    summary = {f"{r.topology} {r.link} numel={r.numel} {r.candidate}": r.ratio_to_gloo
               for r in records if isinstance(r, MultihostRecord) and r.candidate != "gloo"}
    summary.update({f"ddp {r.topology} {r.link} {r.candidate}": r.ratio_to_torch_ddp_gloo
                    for r in records if isinstance(r, MultihostDdpRecord)})
    path = common.write_results(
        "multihost", backend="gloo", device_type="cpu", quick=args.quick, records=records, summary=summary,
        settings={"topologies": args.topologies, "links": args.links, "sizes": args.sizes, "reps": args.reps,
                  "ddp_reps": args.ddp_reps, "candidates": list(CANDIDATES), "ddp_candidates": list(DDP_CANDIDATES),
                  "dtype": "float32", "threads_per_process": 1,
                  "hosts": "network + mount namespaces, veth to a bridge, tc tbf shaping (ddpkit.testing.HostPool)",
                  "timing": "per repetition: one call of the candidate to synchronise, then a batch of back-to-back "
                            "calls timed on every rank; slowest rank per repetition, median over interleaved "
                            "repetitions"})
    print()
    common.print_table([r for r in records if isinstance(r, MultihostRecord)],
                       ["topology", "link", "numel", "candidate", "median_s", "ratio_to_gloo"],
                       headers={"median_s": "median", "ratio_to_gloo": "/ gloo"},
                       formats={"median_s": common.seconds, "ratio_to_gloo": common.times},
                       align_left=["topology", "link", "candidate"])
    ddp = [r for r in records if isinstance(r, MultihostDdpRecord)]
    if ddp:
        print()
        common.print_table(ddp, ["topology", "candidate", "median_s", "ratio_to_torch_ddp_gloo"],
                           headers={"median_s": "step", "ratio_to_torch_ddp_gloo": "/ torch DDP on gloo"},
                           formats={"median_s": common.seconds, "ratio_to_torch_ddp_gloo": common.times},
                           align_left=["topology", "candidate"])
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
