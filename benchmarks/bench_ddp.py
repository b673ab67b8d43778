"""DDP: ddpkit's bucketing reducer against torch.nn.parallel.DistributedDataParallel.

    python benchmarks/bench_ddp.py            # week-4 Net and ResNet-18 on CIFAR-shaped data, accumulation 1 and 4
    python benchmarks/bench_ddp.py --quick    # a smoke run
    python benchmarks/bench_ddp.py --device cuda   # the ranks share GPU 0 over gloo: ddp_cuda.json
    python benchmarks/bench_ddp.py --accumulation 1 --candidates ddpkit ddpkit_allreduce_hook ddpkit_fp16_hook torch_allreduce_hook torch_fp16_hook --output ddp_hooks

Each candidate trains in its own pool of ``--world-size`` processes (so that peak memory is its
own): ddpkit DDP with its default all-reduce, ddpkit DDP over the group's own all-reduce,
torch DDP (``no_sync`` on accumulation micro-batches), and ``floor``: the same steps with no
gradient communication at all, the least any data-parallel wrapper could take. Communication hooks
(issue 50): torch's ``allreduce_hook`` and ``fp16_compress_hook`` registered on ddpkit's DDP, in a
world group on the "ddpkit" backend (the hook's ``dist.all_reduce`` runs on ddpkit's engine), and on
torch DDP over gloo; their bars (``BARS``, in each hook candidate's summary entry): ddpkit's DDP with
``allreduce_hook`` at most 1.05x ddpkit's DDP without a hook, and each hook on ddpkit's DDP no slower
than the same hook on torch DDP.

All start from the same weights and see the same synthetic batches; after a few steps their
parameters must agree (else the run stops; ``floor`` does not average, so it is exempt) before
anything is timed. Timing: blocks of steps alternate between the candidates (order rotating,
``common.interleave``); a step is k micro-batches of forward+backward plus the optimizer step, its
time is the slowest rank's, the figure is the median step. Memory: peak RSS, the largest over the
ranks (``max_memory_allocated`` on GPU). Results: benchmarks/results/ddp.json.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import ddpkit  # noqa: E402
from ddpkit.testing import WorkerPool  # noqa: E402
from ddpkit.training.models import build_model  # noqa: E402
from peers import timing  # noqa: E402
from records import DdpRecord  # noqa: E402

CANDIDATES = {
    "ddpkit": {"impl": "ddpkit", "algorithm": ddpkit.ddp.DEFAULT_ALGORITHM},
    "ddpkit_pg": {"impl": "ddpkit", "algorithm": "process_group"},
    "torch": {"impl": "torch"},
    "floor": {"impl": "floor"},
    "ddpkit_allreduce_hook": {"impl": "ddpkit", "hook": "allreduce_hook", "backend": "ddpkit"},
    "ddpkit_fp16_hook": {"impl": "ddpkit", "hook": "fp16_compress_hook", "backend": "ddpkit"},
    "torch_allreduce_hook": {"impl": "torch", "hook": "allreduce_hook"},
    "torch_fp16_hook": {"impl": "torch", "hook": "fp16_compress_hook"},
}
# A hook candidate's step time over each baseline's, and the most it may be (issue 50's bars).
BARS = {
    "ddpkit_allreduce_hook": {"ddpkit": 1.05, "torch_allreduce_hook": 1.0},
    "ddpkit_fp16_hook": {"torch_fp16_hook": 1.0},
}

_state: dict = {}  # per worker process: the model under test and its data


class WithoutCommunication(torch.nn.Module):
    """The floor: the model trained with the same steps and no gradient communication at all."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *args):
        return self.module(*args)

    def no_sync(self):
        return contextlib.nullcontext()


def _device(device_type: str) -> torch.device:
    """Rank r uses GPU r % device_count: on one GPU every rank shares it (gloo only; NCCL refuses)."""
    if device_type == "cuda":
        device = torch.device("cuda", dist.get_rank() % torch.cuda.device_count())
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def build(
    candidate: dict, model_name: str, batch: int, accumulation: int, num_classes: int, device_type: str = "cpu"
) -> None:
    device = _device(device_type)
    torch.manual_seed(0)
    model = build_model(model_name, in_channels=3, num_classes=num_classes, image_size=32).to(device)
    if candidate["impl"] == "ddpkit":
        wrapped = ddpkit.DistributedDataParallel(
            model, algorithm=candidate.get("algorithm", ddpkit.ddp.DEFAULT_ALGORITHM)
        )
    elif candidate["impl"] == "floor":
        wrapped = WithoutCommunication(model)
    else:
        wrapped = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device] if device.type == "cuda" else None
        )
    if candidate.get("hook"):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        wrapped.register_comm_hook(None, getattr(default_hooks, candidate["hook"]))  # the world group
    generator = torch.Generator().manual_seed(1 + dist.get_rank())
    batches = [
        (
            torch.randn(batch, 3, 32, 32, generator=generator).to(device),
            torch.randint(0, num_classes, (batch,), generator=generator).to(device),
        )
        for _ in range(accumulation)
    ]
    _state.update(
        model=wrapped,
        optimizer=torch.optim.SGD(wrapped.parameters(), lr=0.01, momentum=0.9),
        accumulate=ddpkit.GradientAccumulation(wrapped, accumulation),
        batches=batches,
        device=device,
    )


def steps(count: int) -> list[float]:
    model, optimizer, accumulate, batches = (
        _state["model"],
        _state["optimizer"],
        _state["accumulate"],
        _state["batches"],
    )
    loss_fn = torch.nn.CrossEntropyLoss()
    times = []
    for _ in range(count):
        if _state["device"].type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for x, y in batches:
            stepped = accumulate.backward(loss_fn(model(x), y))
        assert stepped
        optimizer.step()
        optimizer.zero_grad()
        if _state["device"].type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times


def parameters_now() -> torch.Tensor:
    return torch.cat([p.detach().flatten().cpu() for p in _state["model"].parameters()])


def finish() -> dict:
    if _state["device"].type == "cuda":
        peak = torch.cuda.max_memory_allocated(_state["device"])
    else:
        peak = common.peak_rss_bytes()
    stats = _state["model"].reducer_stats() if hasattr(_state["model"], "reducer_stats") else None
    return {"peak_memory_bytes": peak, "reducer_stats": stats}


def run_config(
    model_name: str,
    batch: int,
    accumulation: int,
    world_size: int,
    blocks: int,
    steps_per_block: int,
    backend: str,
    device_type: str = "cpu",
    candidates: dict = CANDIDATES,
    reference: str = "torch",
) -> list[DdpRecord]:
    """Times ``candidates`` (name -> settings: ``impl``, and ``algorithm``, ``backend`` (overrides ``backend``),
    ``env`` (set in the candidate's processes) where given; the records repeat them) against ``reference``."""
    pools = {
        name: WorkerPool(
            world_size,
            backend=candidate.get("backend", backend),
            timeout=3600,
            group_timeout=600,
            env=candidate.get("env"),
        )
        for name, candidate in candidates.items()
    }
    try:
        for name, pool in pools.items():
            pool.run(build, candidates[name], model_name, batch, accumulation, 100, device_type)
        # Correctness first: two identical steps from identical weights must give the same parameters.
        checks = {}
        for name, pool in pools.items():
            pool.run(steps, 2)
            checks[name] = pool.run(parameters_now)[0]
        for name, params in checks.items():
            if candidates[name]["impl"] == "floor":
                continue  # no averaging: its parameters differ by design
            error = float((params - checks[reference]).abs().max())
            if error > 1e-3:
                raise AssertionError(f"{name} diverged from {reference} after 2 steps: max |diff| = {error}")
        names = list(pools)

        def run_block(name: str) -> list[float]:
            """The block's step times, each the slowest rank's."""
            return timing.slowest_per_rep(pools[name].run(steps, steps_per_block))

        block_times = common.interleave(names, blocks, run_block)
        times = {name: [seconds for block in block_times[name] for seconds in block] for name in names}
        finals = {name: pool.run(finish) for name, pool in pools.items()}
    finally:
        for pool in pools.values():
            pool.close()
    records = []
    for name in names:
        ordered = sorted(times[name])
        records.append(
            DdpRecord(
                world_size=world_size,
                model=model_name,
                batch_per_rank=batch,
                accumulation=accumulation,
                candidate=name,
                **candidates[name],
                median_step_s=common.median(times[name]),
                p25_step_s=ordered[len(ordered) // 4],
                p75_step_s=ordered[(3 * len(ordered)) // 4],
                steps_timed=len(times[name]),
                peak_memory_bytes=max(r["peak_memory_bytes"] for r in finals[name]),
                reducer_stats=finals[name][0]["reducer_stats"],
                **{
                    f"max_param_diff_vs_{reference}_after_2_steps": float(
                        (checks[name] - checks[reference]).abs().max()
                    )
                },
            )
        )
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--models", nargs="+", default=["net", "resnet18"])
    parser.add_argument("--accumulation", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--blocks", type=int, default=18, help="alternating blocks per candidate")
    parser.add_argument(
        "--candidates",
        nargs="+",
        choices=list(CANDIDATES),
        default=list(CANDIDATES),
        help="default: all; torch (the reference) is always measured",
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--output", help="results file name, without .json (default: ddp, or ddp_cuda on cuda)")
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cuda: rank r on GPU r %% device_count; results go to ddp_cuda.json",
    )
    parser.add_argument(
        "--backend",
        choices=("gloo", "nccl"),
        default=None,
        help="default: gloo on CPU or when the ranks share a GPU, else nccl",
    )
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_ddp: --device cuda, but torch sees no CUDA device")
    backend = args.backend or (
        "nccl" if args.device == "cuda" and torch.cuda.device_count() >= args.world_size else "gloo"
    )
    batch_for = {"net": 64, "resnet18": 16, "resnet34": 16, "vgg11": 32}
    steps_for = {"net": 10, "resnet18": 2, "resnet34": 2, "vgg11": 3}
    if args.quick:
        args.models, args.blocks = ["net"], 2
    candidates = {name: CANDIDATES[name] for name in CANDIDATES if name in args.candidates or name == "torch"}
    if args.device == "cuda":  # the hooks' world group on the "ddpkit" backend is CPU-only here
        candidates = {name: c for name, c in candidates.items() if c.get("backend") != "ddpkit"}

    def write(records: list[DdpRecord]) -> tuple[Path, dict]:
        """The results so far, rewritten after every configuration so that a run cut short keeps them."""
        summary = {}
        for record in records:
            if record.candidate == "torch":
                continue

            def of(candidate: str) -> DdpRecord | None:
                return next(
                    (
                        r
                        for r in records
                        if r.candidate == candidate
                        and r.model == record.model
                        and r.accumulation == record.accumulation
                    ),
                    None,
                )

            torch_record = of("torch")
            key = f"{record.candidate} {record.model} acc={record.accumulation}"
            summary[key] = {
                "time_ratio": record.median_step_s / torch_record.median_step_s,
                "memory_ratio": record.peak_memory_bytes / torch_record.peak_memory_bytes,
            }
            bars = {
                baseline: {
                    "time_ratio": record.median_step_s / of(baseline).median_step_s,
                    "bar": bar,
                    "met": record.median_step_s / of(baseline).median_step_s <= bar,
                }
                for baseline, bar in BARS.get(record.candidate, {}).items()
                if of(baseline) is not None
            }
            if bars:
                summary[key]["bars"] = bars
        path = common.write_results(
            args.output or ("ddp_cuda" if args.device == "cuda" else "ddp"),
            backend=backend,
            device_type=args.device,
            settings={
                "world_size": args.world_size,
                "models": args.models,
                "accumulation": args.accumulation,
                "blocks": args.blocks,
                "candidates": list(candidates),
                "bars": BARS,
                "batch_per_rank": {m: batch_for[m] for m in args.models},
                "steps_per_block": {m: steps_for[m] for m in args.models},
                "threads_per_process": max(1, (torch.get_num_threads()) // args.world_size),
                "data": "synthetic CIFAR-shaped batches (3x32x32, 100 classes)",
                "memory": "peak RSS per process (max over ranks); GPU: max_memory_allocated",
            },
            records=records,
            summary=summary,
            quick=args.quick,
        )
        return path, summary

    records = []
    for model_name in args.models:
        for accumulation in args.accumulation:
            started = time.monotonic()
            records += run_config(
                model_name,
                batch_for[model_name],
                accumulation,
                args.world_size,
                args.blocks,
                steps_for[model_name],
                backend,
                args.device,
                candidates,
            )
            print(
                f"{model_name} accumulation {accumulation}: measured in {time.monotonic() - started:.0f} s", flush=True
            )
            path, summary = write(records)
    print_summary(records, reference="torch")
    for key, entry in summary.items():
        for baseline, bar in entry.get("bars", {}).items():
            print(
                f"{key}: {bar['time_ratio']:.3f}x {baseline} (bar <= {bar['bar']}x: "
                f"{'met' if bar['met'] else 'NOT met'})"
            )
    print(f"wrote {path}")


def print_summary(records: list[DdpRecord], reference: str) -> None:
    """Every candidate's step time (median, interquartile range) and peak memory, with its ratios to ``reference``'s."""
    base = {(r.model, r.accumulation): r for r in records if r.candidate == reference}
    rows = [
        {
            **r.to_dict(),
            "time_ratio": r.median_step_s / base[(r.model, r.accumulation)].median_step_s,
            "memory_ratio": r.peak_memory_bytes / base[(r.model, r.accumulation)].peak_memory_bytes,
        }
        for r in records
    ]
    print(
        f"\nDDP step (forward + backward of every micro-batch + optimizer step; median of the slowest rank) against "
        f"{reference}; floor: the same steps without any gradient communication"
    )
    common.print_table(
        rows,
        [
            "model",
            "accumulation",
            "candidate",
            "median_step_s",
            "p25_step_s",
            "p75_step_s",
            "time_ratio",
            "peak_memory_bytes",
            "memory_ratio",
        ],
        align_left={"candidate"},
        keys=3,
        headers={
            "median_step_s": "median step",
            "p25_step_s": "p25",
            "p75_step_s": "p75",
            "time_ratio": f"time/{reference}",
            "peak_memory_bytes": "peak memory",
            "memory_ratio": f"memory/{reference}",
        },
        formats={
            "median_step_s": common.seconds,
            "p25_step_s": common.seconds,
            "p75_step_s": common.seconds,
            "time_ratio": common.times,
            "peak_memory_bytes": common.mebibytes,
            "memory_ratio": common.times,
        },
    )


if __name__ == "__main__":
    main()
