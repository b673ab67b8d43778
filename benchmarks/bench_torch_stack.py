"""What torch builds on torch.distributed, on the "ddpkit" backend against gloo (CPU, one host; issue 25).

    python benchmarks/bench_torch_stack.py           # FSDP2 at 2 and 4 processes, DDP hooks and TP at 2
    python benchmarks/bench_torch_stack.py --quick   # a smoke run (small model, few repetitions)
    python benchmarks/bench_torch_stack.py --workloads fsdp2 --world-sizes 2

Every workload runs both candidates side by side in the same processes: the pool's world group is
"ddpkit" and every rank also makes a gloo group of the same ranks; each candidate is one copy of the
model (same seed, same data) placed on its group, and the repetitions interleave the candidates
(``common.interleave``: order rotating). A repetition synchronises the ranks with a barrier on the
candidate's own group, then times ``--steps`` back-to-back steps on the host clock
(``common.time_per_call``); its figure is the slowest rank's time per step, and the figure reported
is the median over repetitions, with ddpkit/gloo ratios.

  * ``fsdp2``: ``fully_shard`` per linear layer and on the root, on ``DeviceMesh.from_group(group, "cpu")``,
    AdamW; a model whose gradients dominate the step (``--fsdp-layers`` linear layers ``--fsdp-width``
    wide, batch ``--fsdp-batch`` per rank). At ``--world-sizes``.
  * ``ddp_powerSGD`` / ``ddp_fp16``: torch DDP with ``powerSGD_hook`` (rank ``--powersgd-rank``,
    ``start_powerSGD_iter=2``, warm start and error feedback, one bucket: with several, the hook's
    second all-reduce races the next bucket's first one, see tests/test_torch_stack.py) and with
    ``fp16_compress_hook`` (default buckets), SGD, the same model family (``--ddp-layers`` x ``--ddp-width``).
  * ``tp_mlp``: a tensor-parallel MLP (``ColwiseParallel`` then ``RowwiseParallel``, ``--tp-width`` in and
    out, 4x hidden, batch ``--tp-batch``, the same input on every rank): forward + backward only; its
    messages are small. A third candidate, ``floor``, runs the same model on a mesh of this rank alone:
    the step without communication, i.e. the least any backend could reach.

Before timing, the copies take the same warm-up steps from the same weights and their parameters (TP:
the output and gradients of a step) must agree (max |difference| from gloo recorded; the run stops
above 1e-3 for ddpkit). Peak memory (FSDP2 only): each
candidate alone in fresh processes whose world group is that backend (peak RSS is per process, so
side-by-side copies cannot be told apart), the warm-up plus ``--steps`` steps; recorded as the peak
RSS and its increase over the RSS before the model was built, the largest over ranks.
Results: benchmarks/results/torch_stack.json (``--quick``: results/quick/); ``summary`` holds the
ratios and the issue's bars (FSDP2 <= 0.6x gloo, TP MLP <= 0.5x gloo).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import ddpkit  # noqa: E402,F401
from ddpkit.testing import WorkerPool  # noqa: E402
from records import TorchStackRecord  # noqa: E402

CANDIDATES = ("gloo", "ddpkit")
# tp_mlp also runs "floor": the same model on a mesh of this rank alone, no partner to wait for (what the step
# costs without communication: the bound on what any backend can save there).
EXTRA = {"tp_mlp": ("floor",)}
WORKLOADS = ("fsdp2", "ddp_powerSGD", "ddp_fp16", "tp_mlp")
BARS = {"fsdp2": 0.6, "tp_mlp": 0.5}


# --- on every rank ---------------------------------------------------------------------------------------

_state: dict = {}


def mlp(width: int, layers: int) -> nn.Sequential:
    modules: list[nn.Module] = []
    for index in range(layers):
        modules.append(nn.Linear(width, width))
        if index < layers - 1:
            modules.append(nn.ReLU())
    return nn.Sequential(*modules)


def _groups() -> dict:
    """Each candidate's group: the "ddpkit" world group, a gloo group of the same ranks, and ("floor") a gloo
    group of this rank alone."""
    if "groups" not in _state:
        if dist.get_backend() != "ddpkit":
            raise RuntimeError(f"the pool's world group must be ddpkit, not {dist.get_backend()}")
        alone, _ = dist.new_subgroups_by_enumeration([[rank] for rank in range(dist.get_world_size())], backend="gloo")
        _state["groups"] = {"ddpkit": dist.group.WORLD, "gloo": dist.new_group(backend="gloo"), "floor": alone}
    return _state["groups"]


def candidates_of(workload: str) -> tuple:
    return CANDIDATES + EXTRA.get(workload, ())


def _batch(step: int, batch: int, width: int, same_on_every_rank: bool = False) -> torch.Tensor:
    rank = 0 if same_on_every_rank else dist.get_rank()
    return torch.randn(batch, width, generator=torch.Generator().manual_seed(1000 * step + rank))


def _full(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.detach()
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).clone()


class Candidate:
    """One copy of a workload's model on one group; ``step()`` is one training (or TP forward+backward) step."""

    def __init__(self, workload: str, group, settings: dict):
        from torch.distributed.device_mesh import DeviceMesh

        self.workload, self.group, self.settings, self.steps = workload, group, settings, 0
        torch.manual_seed(0)
        if workload == "fsdp2":
            from torch.distributed.fsdp import fully_shard

            self.width, self.batch = settings["fsdp_width"], settings["fsdp_batch"]
            model = mlp(self.width, settings["fsdp_layers"])
            mesh = DeviceMesh.from_group(group, "cpu")
            for layer in model:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            self.model = model
            self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        elif workload in ("ddp_powerSGD", "ddp_fp16"):
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
            from torch.nn.parallel import DistributedDataParallel as DDP

            self.width, self.batch = settings["ddp_width"], settings["ddp_batch"]
            module = mlp(self.width, settings["ddp_layers"])
            if workload == "ddp_powerSGD":
                one_bucket_mb = 2 * sum(p.numel() * p.element_size() for p in module.parameters()) / 2**20
                self.model = DDP(module, process_group=group, bucket_cap_mb=one_bucket_mb)
                state = powerSGD_hook.PowerSGDState(
                    process_group=group, start_powerSGD_iter=2, matrix_approximation_rank=settings["powersgd_rank"]
                )
                self.model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
            else:
                self.model = DDP(module, process_group=group)
                self.model.register_comm_hook(group, default_hooks.fp16_compress_hook)
            self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        elif workload == "tp_mlp":
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            self.width, self.batch = settings["tp_width"], settings["tp_batch"]
            model = nn.Sequential(
                nn.Linear(self.width, 4 * self.width), nn.ReLU(), nn.Linear(4 * self.width, self.width)
            )
            self.model = parallelize_module(
                model, DeviceMesh.from_group(group, "cpu"), {"0": ColwiseParallel(), "2": RowwiseParallel()}
            )
            self.optimizer = None
        else:
            raise ValueError(workload)
        # the data of every step, made once: the timed loop only trains
        self.data = [_batch(step, self.batch, self.width, same_on_every_rank=workload == "tp_mlp") for step in range(8)]

    def step(self) -> None:
        x = self.data[self.steps % len(self.data)]
        self.steps += 1
        loss = self.model(x).square().mean()
        loss.backward()
        if self.optimizer is not None:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=False)
        else:  # TP: forward + backward only; drop the gradients for the next step
            for p in self.model.parameters():
                p.grad = None

    def check_vector(self) -> torch.Tensor:
        """What must agree between candidates: the parameters (after the same steps); for TP, which never
        updates them, the output and the gradients of one step."""
        module = self.model.module if hasattr(self.model, "module") else self.model
        if self.workload != "tp_mlp":
            return torch.cat([_full(p).flatten() for p in module.parameters()])
        y = self.model(self.data[0])
        y.square().mean().backward()
        vector = torch.cat([_full(y).flatten()] + [_full(p.grad).flatten() for p in module.parameters()])
        for p in module.parameters():
            p.grad = None
        return vector


def build(workload: str, settings: dict, warmup: int) -> dict:
    """The candidates of ``workload`` on their groups, ``warmup`` identical steps each; returns each one's max
    |difference| from gloo in ``check_vector`` (on this rank)."""
    groups = _groups()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _state["candidates"] = {name: Candidate(workload, groups[name], settings) for name in candidates_of(workload)}
        for candidate in _state["candidates"].values():
            for _ in range(warmup):
                candidate.step()
        vectors = {name: candidate.check_vector() for name, candidate in _state["candidates"].items()}
    return {name: float((vector - vectors["gloo"]).abs().max()) for name, vector in vectors.items()}


def measure(reps: int, steps: int) -> dict:
    """This rank's seconds per step of each candidate in each repetition (interleaved, order rotating)."""
    candidates, groups = _state["candidates"], _groups()

    def measure_one(name: str) -> float:
        # the floor's group is this rank alone: it synchronises the ranks over gloo instead
        dist.barrier(group=groups["gloo" if name == "floor" else name])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return common.time_per_call(candidates[name].step, calls=steps)

    return common.interleave(list(candidates), reps, measure_one)


def release() -> None:
    _state.pop("candidates", None)


def memory_alone(settings: dict, warmup: int, steps: int) -> dict:
    """FSDP2 alone on the world group (of this pool's backend): peak RSS, and its increase over the RSS
    before the model was built."""
    before = common.peak_rss_bytes()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        candidate = Candidate("fsdp2", dist.group.WORLD, settings)
        for _ in range(warmup + steps):
            candidate.step()
    peak = common.peak_rss_bytes()
    return {"peak_rss_bytes": peak, "peak_rss_increase_bytes": peak - before}


# --- the parent --------------------------------------------------------------------------------------------


def model_name(workload: str, settings: dict) -> tuple[str, int]:
    if workload == "fsdp2":
        return f"mlp {settings['fsdp_layers']}x{settings['fsdp_width']}", settings["fsdp_batch"]
    if workload.startswith("ddp"):
        return f"mlp {settings['ddp_layers']}x{settings['ddp_width']}", settings["ddp_batch"]
    return f"mlp {settings['tp_width']}-{4 * settings['tp_width']}-{settings['tp_width']}", settings["tp_batch"]


def run_workload(
    workload: str, world_size: int, settings: dict, reps: int, steps: int, warmup: int
) -> list[TorchStackRecord]:
    names = candidates_of(workload)
    with WorkerPool(world_size, backend="ddpkit", timeout=1800, group_timeout=300) as pool:
        per_rank_diffs = pool.run(build, workload, settings, warmup)
        diffs = {name: max(rank[name] for rank in per_rank_diffs) for name in names}
        if diffs["ddpkit"] > 1e-3:
            raise AssertionError(
                f"{workload} at n={world_size}: ddpkit differs from gloo by {diffs['ddpkit']} "
                f"after {warmup} identical steps"
            )
        per_rank = pool.run(measure, reps, steps)
        pool.run(release)
    memory = {}
    if workload == "fsdp2":
        for name in CANDIDATES:
            with WorkerPool(world_size, backend=name, timeout=1800, group_timeout=300) as pool:
                outcomes = pool.run(memory_alone, settings, warmup, steps)
            memory[name] = {key: max(outcome[key] for outcome in outcomes) for key in outcomes[0]}
    model, batch = model_name(workload, settings)
    records = []
    for name in names:
        slowest = [max(rank[name][rep] for rank in per_rank) for rep in range(reps)]
        quartiles = statistics.quantiles(slowest, n=4) if len(slowest) > 1 else [slowest[0]] * 3
        records.append(
            TorchStackRecord(
                workload=workload,
                candidate=name,
                world_size=world_size,
                model=model,
                batch_per_rank=batch,
                median_step_s=common.median(slowest),
                p25_step_s=quartiles[0],
                p75_step_s=quartiles[2],
                reps=reps,
                steps_per_rep=steps,
                max_param_diff_vs_gloo=diffs[name],
                **memory.get(name, {}),
            )
        )
    return records


def summarize(records: list[TorchStackRecord]) -> dict:
    by = {(r.workload, r.world_size, r.candidate): r for r in records}
    summary: dict = {}
    for (workload, n, candidate), r in sorted(by.items()):
        if candidate == "floor":
            summary[f"{workload} n={n}: floor/gloo time"] = r.median_step_s / by[(workload, n, "gloo")].median_step_s
        if candidate != "ddpkit":
            continue
        base = by[(workload, n, "gloo")]
        ratio = r.median_step_s / base.median_step_s
        summary[f"{workload} n={n}: ddpkit/gloo time"] = ratio
        if workload in BARS:
            summary[f"{workload} n={n}: meets the bar (<= {BARS[workload]}x)"] = ratio <= BARS[workload]
        if r.peak_rss_increase_bytes is not None and base.peak_rss_increase_bytes:
            summary[f"{workload} n={n}: ddpkit/gloo peak RSS increase"] = (
                r.peak_rss_increase_bytes / base.peak_rss_increase_bytes
            )
        summary[f"{workload} n={n}: max |param diff| vs gloo"] = r.max_param_diff_vs_gloo
    return summary


def print_summary(records: list[TorchStackRecord]) -> None:
    base = {(r.workload, r.world_size): r for r in records if r.candidate == "gloo"}
    floor = {(r.workload, r.world_size): r.median_step_s for r in records if r.candidate == "floor"}
    rows = []
    for r in records:
        if r.candidate != "ddpkit":
            continue
        g = base[(r.workload, r.world_size)]
        lowest = floor.get((r.workload, r.world_size))
        rows.append(
            {
                "workload": r.workload,
                "ranks": r.world_size,
                "model": r.model,
                "batch": r.batch_per_rank,
                "gloo": g.median_step_s,
                "ddpkit": r.median_step_s,
                "ratio": r.median_step_s / g.median_step_s,
                "bar": f"<= {BARS[r.workload]}x" if r.workload in BARS else "",
                "gloo_mem": g.peak_rss_increase_bytes,
                "ddpkit_mem": r.peak_rss_increase_bytes,
                "mem_ratio": (
                    r.peak_rss_increase_bytes / g.peak_rss_increase_bytes
                    if r.peak_rss_increase_bytes is not None and g.peak_rss_increase_bytes
                    else None
                ),
                "floor": lowest,
                "floor_ratio": lowest / g.median_step_s if lowest is not None else None,
                "diff": r.max_param_diff_vs_gloo,
            }
        )
    print(
        "\ntorch's stack on the ddpkit backend against gloo: median step time of the slowest rank (interleaved "
        "repetitions); floor: the step on a mesh of one rank (no communication); FSDP2 memory: peak RSS increase, "
        "each candidate alone"
    )
    common.print_table(
        rows,
        [
            "workload",
            "ranks",
            "model",
            "batch",
            "gloo",
            "ddpkit",
            "ratio",
            "bar",
            "floor",
            "floor_ratio",
            "gloo_mem",
            "ddpkit_mem",
            "mem_ratio",
            "diff",
        ],
        align_left={"workload", "model", "bar"},
        keys=2,
        headers={
            "gloo": "gloo step",
            "ddpkit": "ddpkit step",
            "ratio": "ddpkit/gloo",
            "floor": "floor step",
            "floor_ratio": "floor/gloo",
            "gloo_mem": "gloo mem",
            "ddpkit_mem": "ddpkit mem",
            "mem_ratio": "mem ddpkit/gloo",
            "diff": "max |param diff|",
        },
        formats={
            "gloo": common.seconds,
            "ddpkit": common.seconds,
            "ratio": common.times,
            "floor": common.seconds,
            "floor_ratio": common.times,
            "gloo_mem": common.mebibytes,
            "ddpkit_mem": common.mebibytes,
            "mem_ratio": common.times,
            "diff": lambda v: f"{v:.1e}",
        },
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4], help="FSDP2's (default 2 4)")
    parser.add_argument("--other-world-sizes", type=int, nargs="+", default=[2], help="DDP's and TP's (default 2)")
    parser.add_argument("--reps", type=int, default=15, help="interleaved repetitions per candidate")
    parser.add_argument("--steps", type=int, default=2, help="steps per repetition (TP: 20 times as many)")
    parser.add_argument("--warmup", type=int, default=3, help="identical steps before the check and the timing")
    parser.add_argument("--fsdp-width", type=int, default=2048)
    parser.add_argument("--fsdp-layers", type=int, default=6)
    parser.add_argument("--fsdp-batch", type=int, default=8)
    parser.add_argument("--ddp-width", type=int, default=1024)
    parser.add_argument("--ddp-layers", type=int, default=6)
    parser.add_argument("--ddp-batch", type=int, default=16)
    parser.add_argument("--powersgd-rank", type=int, default=4)
    parser.add_argument("--tp-width", type=int, default=256)
    parser.add_argument("--tp-batch", type=int, default=8)
    parser.add_argument("--quick", action="store_true", help="a smoke run: small models, 3 repetitions, n=2")
    parser.add_argument("--output", default="torch_stack")
    args = parser.parse_args()
    if args.quick:
        args.world_sizes, args.other_world_sizes, args.reps, args.warmup = [2], [2], 3, 3
        args.fsdp_width, args.fsdp_layers, args.ddp_width, args.ddp_layers = 512, 3, 256, 3
    settings = {
        key: getattr(args, key)
        for key in (
            "fsdp_width",
            "fsdp_layers",
            "fsdp_batch",
            "ddp_width",
            "ddp_layers",
            "ddp_batch",
            "powersgd_rank",
            "tp_width",
            "tp_batch",
        )
    }
    records: list[TorchStackRecord] = []
    for workload in args.workloads:
        for world_size in args.world_sizes if workload == "fsdp2" else args.other_world_sizes:
            started = time.monotonic()
            steps = args.steps * (20 if workload == "tp_mlp" else 1)
            records += run_workload(workload, world_size, settings, args.reps, steps, args.warmup)
            print(f"{workload} at {world_size} processes: measured in {time.monotonic() - started:.0f} s", flush=True)
    summary = summarize(records)
    path = common.write_results(
        args.output,
        backend="ddpkit vs gloo",
        device_type="cpu",
        settings={
            **settings,
            "workloads": args.workloads,
            "world_sizes": args.world_sizes,
            "other_world_sizes": args.other_world_sizes,
            "reps": args.reps,
            "steps_per_rep": args.steps,
            "tp_steps_per_rep": 20 * args.steps,
            "warmup": args.warmup,
            "candidates": list(CANDIDATES),
            "extra_candidates": {k: list(v) for k, v in EXTRA.items()},
            "timing": "slowest rank per repetition, median over repetitions; "
            "candidates interleaved in the same processes",
            "memory": "FSDP2 only: each candidate alone in fresh processes, peak RSS "
            "and its increase over the RSS before the model, max over ranks",
        },
        records=records,
        summary=summary,
        quick=args.quick,
    )
    print_summary(records)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
