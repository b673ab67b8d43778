"""SyncBatchNorm forward+backward: time and memory of ddpkit's layer against torch's.

The setup of the week-4 assignment: features {128, 256, 512, 1024} x global batch {32, 64} of
(B, C) inputs, plus a convolution-shaped input ((32, 64, 32, 32) on CPU, (32, 256, 32, 32) on CUDA),
the global batch split evenly across the workers; every step is forward + backward with a fixed
random output gradient.

* --device cuda (default when CUDA is available): every worker uses GPU rank % device_count, so
  on one GPU the ranks share it; the backend is gloo unless --backend nccl (one GPU per rank).
  The baseline is torch.nn.SyncBatchNorm; ddpkit runs with algorithm="process_group" (the group's
  all-reduce; gloo stages CUDA tensors through the host) and "auto" (ddpkit's own collective on a
  host copy, over shared memory: Note [Device tensors on a host group]); --cuda-algorithms picks.
  World size 1: every configuration, ddpkit's CUDA kernels against torch's CUDA BatchNorm. Steps
  are timed with CUDA events on the current stream; memory is torch.cuda.max_memory_allocated.
  Results go to syncbn_cuda.json (with the GPU's name and driver), never over the CPU results.
* CPU (gloo), where torch has no SyncBatchNorm: the baseline is torch's BatchNorm1d/2d
  forward+backward on the local batch alone, no communication at all (ratio = ddpkit / that: what
  synchronizing costs on top of a plain batch norm). A secondary column keeps the older baseline,
  the floor of torch's own parts: that BatchNorm plus one gloo all-reduce of 2C+1 and one of 2C
  float64 values (ratio_floor = ddpkit / (BatchNorm + two gloo all-reduces)).
* World size 1 (no torch.distributed): ddpkit's local kernels against torch's CPU batch norm.

A repetition times --steps forward+backward steps back to back (20 for (B, C) inputs, 3 for the
convolution shape), as a training loop runs them, and divides by the steps: the barrier before it
skews only its first step's start, never the steps in between. Candidates are interleaved within
every repetition (in a rotating order, after a barrier: ``common.interleave``; the first 10
repetitions, 2 with --quick, are a warm-up and dropped); a repetition's time is the slowest rank's,
and the figure reported is the median over repetitions. On CPU in a group, the candidates that wait
on gloo (``SLEEPING``: ddpkit over the process group, the two gloo all-reduces, the emulated step)
run in a second set of processes, meeting in a gloo barrier; the others, the local BatchNorm every
ratio divides by among them, meet in ddpkit's shared-memory all-reduce.
Outputs and input gradients are checked against BatchNorm on the whole batch before timing.

    python benchmarks/bench_syncbn.py            # full run, writes benchmarks/results/syncbn.json
    python benchmarks/bench_syncbn.py --quick    # smoke run (few configurations and repetitions)
    python benchmarks/bench_syncbn.py --device cuda   # one GPU, world sizes 1 and 2 (gloo): syncbn_cuda.json
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import ddpkit  # noqa: E402
from common import interleave, median, print_table, write_results  # noqa: E402
from ddpkit.testing import WorkerPool  # noqa: E402
from peers import timing  # noqa: E402
from records import SyncBatchNormRecord  # noqa: E402

FEATURES = (128, 256, 512, 1024)
BATCHES = (32, 64)
CONV_SHAPE = (32, 64, 32, 32)
CONV_SHAPE_CUDA = (32, 256, 32, 32)
TARGET_RATIO_DISTRIBUTED = 1.15
TARGET_RATIO_LOCAL = 1.0
CHECK_ATOL = 1e-3

# The memory pass runs torch.profiler once per layer and step, and its kineto library writes a
# "profiler_start"/"profiler_stop" line to stderr each time (hundreds per run; its level "USDT" is
# above ERROR, so only KINETO_LOG_LEVEL=6 silences it). Set before any worker starts, so they inherit it.
os.environ.setdefault("KINETO_LOG_LEVEL", "6")

MEMORY_METHOD = (
    "Per rank, after the timed repetitions, one more forward+backward of each layer: "
    "'alloc' = peak bytes allocated through torch's CPU allocator during the step above what was live "
    "before it (running sum of the allocation/free records of torch.profiler(profile_memory=True)): "
    "output, saved statistics, input/weight/bias gradients and temporaries. ddpkit's kernels also keep "
    "O(threads * C) float64 scratch in std::vector outside torch's allocator, not counted here. "
    "'rss' = growth of the peak resident set (VmHWM after resetting it through /proc/self/clear_refs) "
    "during the step, with glibc's mmap threshold pinned to 64 KiB (mallopt) so that large blocks are "
    "mapped and unmapped individually rather than recycled. The maximum over ranks is reported. On CUDA: "
    "torch.cuda.max_memory_allocated growth during the step."
)


# ----------------------------------------------------------------------------------------------
# Measurements (run on every rank, or in this process for world size 1)


def _device(device_type: str) -> torch.device:
    if device_type == "cuda":
        rank = dist.get_rank() if dist.is_initialized() else 0
        torch.cuda.set_device(rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _batch_norm(shape, **kwargs) -> torch.nn.Module:
    return (torch.nn.BatchNorm1d if len(shape) == 2 else torch.nn.BatchNorm2d)(shape[1], **kwargs)


def _step(layer: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor) -> Callable[[], None]:
    def run() -> None:
        layer(x).backward(grad)

    return run


def _clear_grads(x: torch.Tensor, layers) -> None:
    x.grad = None
    for layer in layers:
        layer.zero_grad(set_to_none=True)


def _pin_mmap_threshold() -> None:
    libc = ctypes.CDLL("libc.so.6")
    m_mmap_threshold = -3
    libc.mallopt(m_mmap_threshold, 64 * 1024)


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _memory(run: Callable[[], None], device: torch.device, reset: Callable[[], None]) -> dict:
    reset()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        run()
        torch.cuda.synchronize(device)
        return {"alloc": torch.cuda.max_memory_allocated(device) - before, "rss": None}
    Path("/proc/self/clear_refs").write_text("5")
    rss_before = _status_kib("VmRSS")
    run()
    rss = (_status_kib("VmHWM") - rss_before) * 1024
    reset()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    records = sorted(
        (e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
    )
    live = peak = 0
    for _, nbytes in records:
        live += nbytes
        peak = max(peak, live)
    return {"alloc": peak, "rss": rss}


def _cuda_kernels() -> str:
    """What CUDA tensors run: ddpkit's own kernels, or the ATen-generic code of a build without them."""
    has = torch._C._dispatch_has_kernel_for_dispatch_key("ddpkit::sync_batch_norm", "CUDA")
    return "cuda (hand-written kernels)" if has else "aten (cuda; built without CUDA kernels)"


def _timer(device: torch.device) -> Callable[[Callable[[], None]], float]:
    """Seconds one call takes: CUDA events on the current stream, else the host clock."""
    if device.type == "cuda":

        def timed(fn: Callable[[], None]) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3

        return timed

    def timed_host(fn: Callable[[], None]) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    return timed_host


# The CPU candidates that wait asleep on gloo's sockets. In a group they run in a set of processes of
# their own: measured in the same processes, right after them, ddpkit's step and torch's plain
# BatchNorm both took longer (2 workers, (32, 128), --quick --reps 60: ddpkit 85.4 against 72.1 us,
# BatchNorm 67.6 against 61.4; with only gloo's barrier before each repetition 81.5 and 67.3), as
# bench_allreduce.py found for its candidates that spin on shared memory.
SLEEPING = ("ddpkit_pg", "gloo_two_all_reduces", "torch_emulated")


def measure(
    x_global: torch.Tensor,
    grad_global: torch.Tensor,
    reps: int,
    warmup: int,
    check_only: bool = False,
    device_type: str = "cpu",
    cuda_algorithms: tuple = ("process_group",),
    steps: int = 1,
    names=None,
) -> dict:
    """Times the candidates on this rank's shard, ``steps`` back-to-back steps per repetition; returns
    per-repetition seconds per step, memory and the outputs and input gradients of the first ddpkit
    step (for the correctness check). ``names``: only these candidates (None: every one but, on CPU
    in a group, those of SLEEPING)."""
    distributed = dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    device = _device(device_type)
    x = x_global.tensor_split(world)[rank].to(device).requires_grad_()
    grad = grad_global.tensor_split(world)[rank].to(device)
    features = x.shape[1]

    layers = {}
    # On CUDA in a group, "auto" only where asked (--cuda-algorithms).
    if not (distributed and device.type == "cuda") or "auto" in cuda_algorithms:
        layers["ddpkit"] = ddpkit.SyncBatchNorm(features, affine=True, algorithm="auto").to(device)
    comm: dict[str, Callable[[], None]] = {}
    if distributed:
        layers["ddpkit_pg"] = ddpkit.SyncBatchNorm(features, affine=True, algorithm="process_group").to(device)
    if distributed and device.type == "cpu":
        layers["ddpkit_unchecked"] = ddpkit.SyncBatchNorm(features, affine=True, algorithm="auto")
    if device.type == "cuda" and distributed:
        layers["torch_syncbn"] = torch.nn.SyncBatchNorm(features).to(device)
    else:
        layers["torch_bn_local"] = _batch_norm(x.shape).to(device)
    if distributed and device.type == "cpu":
        forward_buffer = torch.zeros(2 * features + 1, dtype=torch.float64)
        backward_buffer = torch.zeros(2 * features, dtype=torch.float64)

        def two_all_reduces() -> None:
            dist.all_reduce(forward_buffer)
            dist.all_reduce(backward_buffer)

        comm["gloo_two_all_reduces"] = two_all_reduces

        # The same work as one SyncBatchNorm step built from torch's parts (its result is not a
        # synchronized batch norm): local BatchNorm forward, all-reduce, backward, all-reduce.
        def emulated() -> None:
            y = layers["torch_bn_local"](x)
            dist.all_reduce(forward_buffer)
            y.backward(grad)
            dist.all_reduce(backward_buffer)

        comm["torch_emulated"] = emulated

    candidates = {name: _step(layer, x, grad) for name, layer in layers.items()}
    if distributed:
        # ddpkit's local kernels alone on this rank's batch (the op without a group): its compute.
        local = layers.get("ddpkit", layers["ddpkit_pg"])
        candidates["ddpkit_local"] = lambda: torch.ops.ddpkit.sync_batch_norm(
            x, local.weight, local.bias, local.running_mean, local.running_var, True, 0.1, local.eps, "auto", None
        )[0].backward(grad)
    candidates.update(comm)

    _clear_grads(x, layers.values())
    check = {}
    for name in [n for n in layers if n.startswith("ddpkit")]:
        y = layers[name](x)
        y.backward(grad)
        check[name] = (y.detach().cpu(), x.grad.detach().cpu())
        _clear_grads(x, layers.values())
    if check_only:
        return {"check": check}

    if distributed and device.type == "cpu":
        wanted = names if names is not None else [n for n in candidates if n not in SLEEPING]
        candidates = {name: step for name, step in candidates.items() if name in wanted}
    timed = _timer(device)
    # Before each repetition the ranks meet through the set's own transport: ddpkit's shared memory,
    # or gloo where the set waits on gloo anyway (and on CUDA).
    flag = torch.ones(1)
    meet_in_gloo = device.type == "cuda" or any(name in SLEEPING for name in candidates)

    def measure_one(name: str) -> float:
        _clear_grads(x, layers.values())
        if distributed:
            if meet_in_gloo:
                dist.barrier()
            else:
                ddpkit.all_reduce(flag.fill_(1.0))
        _sync(device)
        step = candidates[name]

        def back_to_back() -> None:  # gradients accumulate across the steps, alike for every candidate
            for _ in range(steps):
                step()

        # "ddpkit_unchecked" runs its whole batch with Note [Collective checks] off, switched outside the
        # timed region: switching around every step timed the switch (two calls), not the checks. Every
        # rank runs the same candidate at the same time, so they agree.
        unchecked = name == "ddpkit_unchecked"
        if unchecked:
            ddpkit.set_collective_checks(False)
        try:
            return timed(back_to_back) / steps
        finally:
            if unchecked:
                ddpkit.set_collective_checks(True)

    times = interleave(list(candidates), reps, measure_one, warmup=warmup)

    if device.type == "cpu":
        _pin_mmap_threshold()
    memory = {}
    if names is None:  # the memory of every layer is measured once, with the first set
        memory = {
            name: _memory(_step(layer, x, grad), device, lambda: _clear_grads(x, layers.values()))
            for name, layer in layers.items()
        }
    return {
        "times": times,
        "memory": memory,
        "check": check,
        "threads": torch.get_num_threads(),
        "kernels": ddpkit.syncbn.cpu_kernels() if device.type == "cpu" else _cuda_kernels(),
    }


# ----------------------------------------------------------------------------------------------
# Driver


def reference(x: torch.Tensor, grad: torch.Tensor):
    layer = _batch_norm(x.shape)
    x = x.clone().requires_grad_()
    y = layer(x)
    y.backward(grad)
    return y.detach(), x.grad


def inputs(shape, seed: int):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)


def summarize(per_rank: list, world_size: int, shape, steps: int) -> SyncBatchNormRecord:
    """One record from every rank's results: per-repetition max over ranks, then the median."""
    names = per_rank[0]["times"].keys()
    per_rep = {name: timing.slowest_per_rep([rank["times"][name] for rank in per_rank]) for name in names}
    step = {name: median(times) for name, times in per_rep.items()}
    memory = {
        name: {
            key: (
                max(rank["memory"][name][key] for rank in per_rank)
                if per_rank[0]["memory"][name][key] is not None
                else None
            )
            for key in ("alloc", "rss")
        }
        for name in per_rank[0]["memory"]
    }
    # The record's fields by name: the per-candidate ones are named after the candidates.
    record = {
        "world_size": world_size,
        "shape": list(shape),
        "features": shape[1],
        "global_batch": shape[0],
        "local_batch": -(-shape[0] // world_size),
        "threads_per_rank": per_rank[0]["threads"],
        "kernels": per_rank[0]["kernels"],
        "repetitions": len(next(iter(per_rank[0]["times"].values()))),
        "steps_per_repetition": steps,
    }
    for name, seconds in step.items():
        record[f"t_{name}"] = seconds
    for name, values in memory.items():
        record[f"alloc_{name}"] = values["alloc"]
        record[f"rss_{name}"] = values["rss"]
    if "t_torch_syncbn" in record:
        main = "ddpkit" if "t_ddpkit" in record else "ddpkit_pg"  # CUDA over gloo: "auto" only when asked
        record["ratio"] = record[f"t_{main}"] / record["t_torch_syncbn"]
        record["ratio_pg"] = record["t_ddpkit_pg"] / record["t_torch_syncbn"]
        record["alloc_extra"] = record[f"alloc_{main}"] - record["alloc_torch_syncbn"]
    elif world_size > 1:
        # The headline: what synchronizing costs over torch's plain BatchNorm on the same local batch.
        local = record["t_torch_bn_local"]
        floor = local + record["t_gloo_two_all_reduces"]
        record["t_floor"] = floor
        record["ratio"] = record["t_ddpkit"] / local
        record["ratio_pg"] = record["t_ddpkit_pg"] / local
        record["ratio_unchecked"] = record["t_ddpkit_unchecked"] / local
        record["ratio_emulated"] = record["t_torch_emulated"] / local
        record["ratio_local_compute"] = record["t_ddpkit_local"] / local
        record["ratio_pg_vs_emulated"] = record["t_ddpkit_pg"] / record["t_torch_emulated"]
        record["ratio_floor"] = record["t_ddpkit"] / floor
        record["alloc_extra"] = record["alloc_ddpkit"] - record["alloc_torch_bn_local"]
    else:
        record["ratio"] = record["t_ddpkit"] / record["t_torch_bn_local"]
        record["alloc_extra"] = record["alloc_ddpkit"] - record["alloc_torch_bn_local"]
    record["alloc_extra_per_channel"] = record["alloc_extra"] / shape[1]
    # The headline ratio's spread: the repetitions are interleaved, so repetition i of ddpkit and of
    # its baseline ran side by side, and their ratio is one draw of `ratio`.
    if "t_torch_syncbn" in record:
        pair = ("ddpkit" if "t_ddpkit" in record else "ddpkit_pg", "torch_syncbn")
    else:
        pair = ("ddpkit", "torch_bn_local")
    spread = common.ratio_spread(a / b for a, b in zip(per_rep[pair[0]], per_rep[pair[1]], strict=True))
    record["ratio_low"], record["ratio_high"] = spread["low"], spread["high"]
    return SyncBatchNormRecord(**record)


def check_outputs(per_rank: list, x: torch.Tensor, grad: torch.Tensor) -> float:
    y_ref, grad_ref = reference(x, grad)
    worst = 0.0
    for name in per_rank[0]["check"]:
        y = torch.cat([rank["check"][name][0] for rank in per_rank])
        dx = torch.cat([rank["check"][name][1] for rank in per_rank])
        error = max((y - y_ref).abs().max().item(), (dx - grad_ref).abs().max().item())
        if error > CHECK_ATOL:
            raise AssertionError(f"{name} on {tuple(x.shape)}: max error {error:.3g} against BatchNorm > {CHECK_ATOL}")
        worst = max(worst, error)
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke run: two configurations, few repetitions")
    parser.add_argument(
        "--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: cuda when torch sees a GPU, else cpu"
    )
    parser.add_argument(
        "--backend",
        choices=("gloo", "nccl"),
        default="gloo",
        help="CUDA only: gloo (default; ranks may share one GPU) or nccl (one GPU per rank)",
    )
    parser.add_argument(
        "--cuda-algorithms",
        nargs="+",
        choices=("process_group", "auto"),
        default=["process_group", "auto"],
        help="CUDA in a group: ddpkit's all-reduce algorithms to time",
    )
    parser.add_argument("--world-sizes", type=int, nargs="+", default=None, help="default: 2 4 on CPU, 2 on CUDA")
    parser.add_argument("--reps", type=int, default=None, help="repetitions per candidate (default 100; conv 40)")
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="forward+backward steps back to back per repetition (default 20; conv 3)",
    )
    parser.add_argument(
        "--local-threads",
        type=int,
        nargs="+",
        default=[1, 2],
        help="torch.set_num_threads values for the world-size-1 comparison (CPU)",
    )
    args = parser.parse_args()

    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if cuda and not torch.cuda.is_available():
        parser.error(f"--device cuda: torch {torch.__version__} sees no CUDA device")
    device_type = "cuda" if cuda else "cpu"
    backend = args.backend if cuda else "gloo"
    world_sizes = args.world_sizes or ([2] if cuda else [2, 4])
    cuda_algorithms = tuple(args.cuda_algorithms)
    conv_shape = CONV_SHAPE_CUDA if cuda else CONV_SHAPE
    configs = [(b, f) for f in FEATURES for b in BATCHES]
    if args.quick:
        configs = [(32, 128), (64, 1024)]
    shapes = configs + [conv_shape if not args.quick else (8, 16, 16, 16)]
    reps_2d = args.reps or (10 if args.quick else 100)
    reps_conv = args.reps or (5 if args.quick else 40)
    steps_2d, steps_conv = (args.steps, args.steps) if args.steps else (20, 3)
    warmup = 2 if args.quick else 10

    records = []
    worst_error = 0.0
    options = {"device_type": device_type, "cuda_algorithms": cuda_algorithms}
    for world_size in world_sizes:
        measured = {}
        pool = WorkerPool(world_size, backend=backend, timeout=3600)
        try:
            for seed, shape in enumerate(shapes):
                x, grad = inputs(shape, seed)
                reps, steps = (reps_conv, steps_conv) if len(shape) == 4 else (reps_2d, steps_2d)
                print(f"world_size={world_size} shape={shape} reps={reps} steps={steps}", flush=True)
                worst_error = max(
                    worst_error, check_outputs(pool.run(measure, x, grad, 0, 0, True, **options), x, grad)
                )
                measured[shape] = pool.run(measure, x, grad, reps, warmup, steps=steps, **options)
        finally:
            pool.close()
        if not cuda:  # the candidates that sleep on sockets, in processes of their own
            pool = WorkerPool(world_size, backend=backend, timeout=3600)
            try:
                for seed, shape in enumerate(shapes):
                    x, grad = inputs(shape, seed)
                    reps, steps = (reps_conv, steps_conv) if len(shape) == 4 else (reps_2d, steps_2d)
                    print(
                        f"world_size={world_size} shape={shape} reps={reps} steps={steps} ({', '.join(SLEEPING)})",
                        flush=True,
                    )
                    sleeping = pool.run(measure, x, grad, reps, warmup, steps=steps, names=SLEEPING, **options)
                    for mine, theirs in zip(measured[shape], sleeping):
                        mine["times"].update(theirs["times"])
            finally:
                pool.close()
        for shape in shapes:
            records.append(summarize(measured[shape], world_size, shape, steps_conv if len(shape) == 4 else steps_2d))

    # World size 1: on CPU two shapes per thread count; on CUDA every configuration, once.
    local_shapes = [(64, 1024), CONV_SHAPE] if not args.quick else [(64, 1024), (8, 16, 16, 16)]
    local_threads = args.local_threads
    if cuda:
        local_shapes, local_threads = shapes, [torch.get_num_threads()]
    for threads in local_threads:
        torch.set_num_threads(threads)
        for seed, shape in enumerate(local_shapes):
            x, grad = inputs(shape, 100 + seed)
            reps, steps = (reps_conv, steps_conv) if len(shape) == 4 else (reps_2d, steps_2d)
            print(f"world_size=1 threads={threads} shape={shape} reps={reps} steps={steps}", flush=True)
            worst_error = max(worst_error, check_outputs([measure(x, grad, 0, 0, True, **options)], x, grad))
            records.append(summarize([measure(x, grad, reps, warmup, steps=steps, **options)], 1, shape, steps))

    distributed = [r for r in records if r.world_size > 1]
    two = [r for r in distributed if r.world_size == 2]
    local = [r for r in records if r.world_size == 1]

    def ratios(key: str) -> list[float]:
        """The 2-worker records' ``key`` ratio, where they have it."""
        return [getattr(r, key) for r in two if getattr(r, key) is not None]

    def worst(key: str):
        return max(ratios(key), default=None)

    def within(key: str) -> int:
        return sum(ratio <= TARGET_RATIO_DISTRIBUTED for ratio in ratios(key))

    summary = {
        "max_check_error": worst_error,
        "target_ratio_distributed": TARGET_RATIO_DISTRIBUTED,
        "target_ratio_local": TARGET_RATIO_LOCAL,
        "max_ratio_2_workers": worst("ratio"),
        "max_ratio_pg_2_workers": worst("ratio_pg"),
        "configs_within_target_2_workers": within("ratio"),
        "configs_within_target_pg_2_workers": within("ratio_pg"),
        "max_ratio_unchecked_2_workers": worst("ratio_unchecked"),
        "configs_within_target_unchecked_2_workers": within("ratio_unchecked"),
        "max_ratio_emulated_2_workers": worst("ratio_emulated"),
        "max_ratio_local_compute_2_workers": worst("ratio_local_compute"),
        "max_ratio_pg_vs_emulated_2_workers": worst("ratio_pg_vs_emulated"),
        "max_ratio_floor_2_workers": worst("ratio_floor"),
        "configs_within_target_floor_2_workers": within("ratio_floor"),
        "configs_2_workers": len(two),
        "local_ratios": {f"{tuple(r.shape)} threads={r.threads_per_rank}": r.ratio for r in local},
        "max_alloc_extra_per_channel_bytes": max(r.alloc_extra_per_channel for r in records),
    }
    settings = {
        "configs_global_batch_x_features": configs,
        "conv_shape": list(shapes[-1]),
        "world_sizes": world_sizes,
        "repetitions_2d": reps_2d,
        "repetitions_conv": reps_conv,
        "warmup": warmup,
        "quick": args.quick,
        "steps_per_repetition_2d": steps_2d,
        "steps_per_repetition_conv": steps_conv,
        "local_threads": local_threads,
        "threads_per_rank": "cpu_count // world_size (recorded per record)",
        "affine": True,
        "dtype": "float32",
        "input_split": "global batch split evenly across ranks (tensor_split)",
        "gradient": "fixed standard-normal output gradient; step = layer(x).backward(grad)",
        "timing": "a repetition = steps_per_repetition forward+backward steps back to back, divided by the steps; "
        "candidates interleaved in a rotating order after a barrier; per repetition the slowest rank; "
        "median over repetitions; on CPU in a group the candidates that wait on gloo in processes of "
        "their own (a gloo barrier), the others meeting in ddpkit's all-reduce",
        "device": device_type,
        "backend": backend,
        "cuda_algorithms": list(cuda_algorithms) if cuda else None,
        "gpus": "every rank on GPU rank % device_count (one GPU: all ranks share it)" if cuda else None,
        "timing_clock": "CUDA events on the current stream around each step" if cuda else "time.perf_counter",
        "baseline": f"torch.nn.SyncBatchNorm over {backend}; world size 1: torch's CUDA BatchNorm"
        if cuda
        else "torch BatchNorm fwd+bwd on the local batch alone (ratio, ratio_pg, ratio_unchecked); "
        "ratio_floor: against floor = that BatchNorm + gloo all_reduce of 2C+1 and 2C float64",
        "candidates": {
            "ddpkit": "ddpkit.SyncBatchNorm(algorithm='auto')",
            "ddpkit_pg": "ddpkit.SyncBatchNorm(algorithm='process_group'): the group's own all-reduce",
            "ddpkit_unchecked": "ddpkit.SyncBatchNorm(algorithm='auto') with Note [Collective checks] off: "
            "what the header round trip costs",
            "torch_bn_local": "torch.nn.BatchNorm1d/2d on the local batch (no communication)",
            "ddpkit_local": "ddpkit::sync_batch_norm on the local batch without a group (no communication)",
            "gloo_two_all_reduces": "torch.distributed.all_reduce of 2C+1 then 2C float64",
            "torch_emulated": "torch BatchNorm forward, all_reduce(2C+1), backward, all_reduce(2C) in one step: "
            "the floor's parts interleaved as in a real step (not a synchronized result)",
            "torch_syncbn": "torch.nn.SyncBatchNorm (CUDA only)",
            "torch_bn_local (CUDA, world size 1)": "torch.nn.BatchNorm1d/2d on the GPU (cuDNN or ATen's kernels)",
        },
        "memory_method": MEMORY_METHOD,
    }
    path = write_results(
        "syncbn_cuda" if cuda else "syncbn",
        backend=backend,
        device_type=device_type,
        settings=settings,
        records=records,
        summary=summary,
        quick=args.quick,
    )
    print_summary(records, summary, cuda)
    print(f"wrote {path}")


def print_summary(records: list[SyncBatchNormRecord], summary: dict, cuda: bool) -> None:
    """Times per forward+backward step, their ratios to the baseline, memory, and the targets."""
    baseline = "torch.nn.SyncBatchNorm" if cuda else "torch's BatchNorm on the local batch"
    rows = []
    for r in records:
        row = {**r.to_dict(), "shape": "x".join(map(str, r.shape))}
        if r.world_size == 1:
            row["baseline"] = r.t_torch_bn_local  # the local kernels against torch's BatchNorm
        else:
            row["baseline"] = r.t_torch_syncbn if cuda else r.t_torch_bn_local
        row["alloc_baseline"] = r.alloc_torch_syncbn if r.alloc_torch_syncbn is not None else r.alloc_torch_bn_local
        rows.append(row)
    columns = [
        "world_size",
        "shape",
        "threads_per_rank",
        "t_ddpkit",
        "t_ddpkit_pg",
        "t_ddpkit_unchecked",
        "baseline",
        "ratio",
        "ratio_pg",
        "ratio_unchecked",
        "ratio_floor",
        "ratio_local_compute",
        "alloc_ddpkit",
        "alloc_baseline",
        "alloc_extra_per_channel",
    ]
    print(
        f"\nSyncBatchNorm forward + backward per step (steps back to back, median of the slowest rank); baseline: "
        f"{baseline} at world size > 1, torch's BatchNorm at world size 1"
        + ("" if cuda else "; auto/(BN+2 gloo): against the older floor, BatchNorm plus two gloo all-reduces")
    )
    print_table(
        rows,
        [c for c in columns if any(row.get(c) is not None for row in rows)],
        keys=3,
        headers={
            "world_size": "ranks",
            "threads_per_rank": "threads",
            "t_ddpkit": "ddpkit auto",
            "t_ddpkit_pg": "ddpkit process_group",
            "t_ddpkit_unchecked": "auto unchecked",
            "ratio": "auto/baseline",
            "ratio_pg": "pg/baseline",
            "ratio_unchecked": "unchecked/baseline",
            "ratio_floor": "auto/(BN+2 gloo)",
            "ratio_local_compute": "local kernels/BN",
            "alloc_ddpkit": "ddpkit memory",
            "alloc_baseline": "baseline memory",
            "alloc_extra_per_channel": "extra per channel",
        },
        formats={
            "t_ddpkit": common.seconds,
            "t_ddpkit_pg": common.seconds,
            "t_ddpkit_unchecked": common.seconds,
            "baseline": common.seconds,
            "ratio": common.times,
            "ratio_pg": common.times,
            "ratio_unchecked": common.times,
            "ratio_floor": common.times,
            "ratio_local_compute": common.times,
            "alloc_ddpkit": _kibibytes,
            "alloc_baseline": _kibibytes,
            "alloc_extra_per_channel": lambda v: f"{v:.1f} B",
        },
    )

    def worst_with_interval(world_size: int) -> str:
        """The worst ratio among the records of `world_size`, with its 95% interval where recorded."""
        worst = max((r for r in records if r.world_size == world_size), key=lambda r: r.ratio)
        if worst.ratio_low is None:
            return f"{worst.ratio:.3f}x"
        return f"{worst.ratio:.3f}x [{worst.ratio_low:.3f}, {worst.ratio_high:.3f}]"

    configs = summary["configs_2_workers"]
    if configs:
        print(
            f"at 2 workers, ddpkit auto within {TARGET_RATIO_DISTRIBUTED}x the baseline in "
            f"{summary['configs_within_target_2_workers']} of {configs} configurations (worst "
            f"{worst_with_interval(2)}, with its 95% interval over the repetitions); process_group in "
            f"{summary['configs_within_target_pg_2_workers']} "
            f"(worst {summary['max_ratio_pg_2_workers']:.3f}x)"
            + (
                ""
                if cuda
                else f"; against BatchNorm plus two gloo all-reduces, auto within it in "
                f"{summary['configs_within_target_floor_2_workers']} (worst {summary['max_ratio_floor_2_workers']:.3f}x)"
            )
        )
    if summary["local_ratios"]:
        local = summary["local_ratios"].values()
        print(
            f"world size 1: ddpkit's kernels take {min(local):.3f}x-{max(local):.3f}x the time of torch's BatchNorm "
            f"(target {TARGET_RATIO_LOCAL}x; worst {worst_with_interval(1)})"
        )
    print(
        f"memory: at most {summary['max_alloc_extra_per_channel_bytes']:.1f} bytes per channel above the baseline's; "
        f"largest difference from BatchNorm on the whole batch: {summary['max_check_error']:.2e}"
    )


def _kibibytes(value: float) -> str:
    return f"{value / 2**10:.0f} KiB"


if __name__ == "__main__":
    main()
