"""Where a CUDA step's time goes: ddpkit's SyncBatchNorm and DDP beside torch's, under torch.profiler.

    python3 scripts/gpu_profile.py syncbn     # world size 1: ddpkit.SyncBatchNorm vs torch's BatchNorm
    python3 scripts/gpu_profile.py ddp        # 2 ranks sharing GPU 0 over gloo: ddpkit DDP vs torch DDP (Net)

Issue 44's diagnosis tool for the GPU bars that bench_syncbn.py and bench_ddp.py judge: per
candidate it prints the host time of a step (CPU wall clock, the stream synchronized around the
loop), the device time (CUDA events), the number of kernel launches per step, and torch.profiler's
table of the ops and kernels with the most self CPU and CUDA time. Needs a CUDA torch and ddpkit
built with its CUDA kernels (scripts/gpu_checks.sh build).
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.profiler import ProfilerActivity, profile

STEPS = 50
WARMUP = 20


def timed(step, steps: int = STEPS) -> tuple[float, float]:
    """(host seconds per step, device seconds per step) over `steps` steps after a warm-up."""
    for _ in range(WARMUP):
        step()
    torch.cuda.synchronize()
    start_event, end_event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start = time.perf_counter()
    start_event.record()
    for _ in range(steps):
        step()
    end_event.record()
    host = (time.perf_counter() - start) / steps
    torch.cuda.synchronize()
    return host, start_event.elapsed_time(end_event) / 1000 / steps


def profiled(name: str, step, steps: int = 10) -> None:
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = sum(e.count for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    print(f"--- {name}: {kernels / steps:.1f} device events per step")
    print(events.table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=60))
    print(events.table(sort_by="self_cuda_time_total", row_limit=8, max_name_column_width=60))


def syncbn() -> None:
    import ddpkit

    device = torch.device("cuda")
    for shape in [(32, 128), (64, 1024), (32, 256, 32, 32)]:
        features = shape[1]
        x = torch.randn(shape, device=device, requires_grad=True)
        grad = torch.randn(shape, device=device)
        layers = {
            "ddpkit": ddpkit.SyncBatchNorm(features).to(device),
            "torch": (torch.nn.BatchNorm1d if len(shape) == 2 else torch.nn.BatchNorm2d)(features).to(device),
        }
        print(f"=== SyncBatchNorm world size 1, shape {shape}")
        results = {}
        for name, layer in layers.items():

            def step(layer=layer):
                layer(x).backward(grad)

            results[name] = timed(step)
        for _ in range(2):  # interleave once more: the first pass warms the clocks
            for name, layer in layers.items():

                def step(layer=layer):
                    layer(x).backward(grad)

                results[name] = min(results[name], timed(step))
        for name, (host, dev) in results.items():
            print(f"{name:8s} host {host * 1e6:8.1f} us/step   device {dev * 1e6:8.1f} us/step")
        print(
            f"ratio ddpkit/torch: host {results['ddpkit'][0] / results['torch'][0]:.3f}, "
            f"device {results['ddpkit'][1] / results['torch'][1]:.3f}"
        )
        for name, layer in layers.items():

            def step(layer=layer):
                layer(x).backward(grad)

            profiled(f"{name} {shape}", step)


def _ddp_worker(rank: int, port: int) -> None:
    import ddpkit
    from ddpkit.training.models import build_model

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    for model_name, batch in [("net", 64), ("resnet18", 16)]:
        torch.manual_seed(0)
        wrapped = {
            "ddpkit": ddpkit.DistributedDataParallel(
                build_model(model_name, in_channels=3, num_classes=100, image_size=32).to(device)
            ),
            "torch": torch.nn.parallel.DistributedDataParallel(
                build_model(model_name, in_channels=3, num_classes=100, image_size=32).to(device), device_ids=[device]
            ),
        }
        x = torch.randn(batch, 3, 32, 32, device=device)
        y = torch.randint(0, 100, (batch,), device=device)
        loss_fn = torch.nn.CrossEntropyLoss()
        results = {}
        for _ in range(3):
            for name, model in wrapped.items():

                def step(model=model):
                    loss_fn(model(x), y).backward()
                    model.zero_grad(set_to_none=True)

                dist.barrier()
                t = timed(step, steps=30)
                results[name] = min(results.get(name, t), t)
        if rank == 0:
            print(f"=== DDP {model_name} batch {batch}/rank, 2 ranks on one GPU (gloo)")
            for name, (host, dev) in results.items():
                print(f"{name:8s} host {host * 1e3:8.3f} ms/step   device {dev * 1e3:8.3f} ms/step")
            print(f"ratio ddpkit/torch: {results['ddpkit'][0] / results['torch'][0]:.3f}")
        for name, model in wrapped.items():

            def step(model=model):
                loss_fn(model(x), y).backward()
                model.zero_grad(set_to_none=True)

            dist.barrier()
            if rank == 0:
                profiled(f"DDP {name} {model_name}", step, steps=5)
            else:
                for _ in range(5):
                    step()
                torch.cuda.synchronize()
    dist.barrier()
    dist.destroy_process_group()


def ddp() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_ddp_worker, args=(port,), nprocs=2, join=True)


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("gpu_profile.py: torch sees no CUDA device")
    for what in sys.argv[1:] or ["syncbn", "ddp"]:
        {"syncbn": syncbn, "ddp": ddp}[what]()
