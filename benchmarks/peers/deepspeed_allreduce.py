"""DeepSpeed's CPU shared-memory all-reduce (``deepspeed.comm.inference_all_reduce``) on float32 vectors.

    DS_ACCELERATOR=cpu LOCAL_SIZE=4 torchrun --standalone --nproc_per_node 4 \\
        benchmarks/peers/deepspeed_allreduce.py --sizes 1000 100000 --reps 30 --out /tmp/ds.jsonl

Launched by ``bench_allreduce.py`` (which sets both variables, and removes the ``/dev/shm/deepspeed_*``
segments the job leaves behind). DeepSpeed takes its shared-memory path only with
``DS_ACCELERATOR=cpu``, ``LOCAL_SIZE`` equal to the world size (torchrun does not set it), its
``deepspeed_shm_comm`` op built (g++, JIT, cached under ``TORCH_EXTENSIONS_DIR``; install.sh builds
it once) and an AVX2 CPU; otherwise ``inference_all_reduce`` silently falls back to
``torch.distributed.all_reduce``. This script checks all four and refuses to run rather than
measure gloo under DeepSpeed's name.

Per size, as mpich_allreduce.py: correctness (integer-valued inputs sum exactly), the error of the
mean (sum / n), a warm-up repetition that plans how many repetitions fit in ``--point-budget``,
then repetitions of ``timing.batch_size(numel)`` back-to-back calls, each repetition preceded by a
one-float ``inference_all_reduce`` (the transport under test as the barrier). The slowest rank per
repetition comes from a gloo all-reduce with MAX after the loop. Rank 0 appends one JSON object
per size to ``--out``.
"""

from __future__ import annotations

import json
import os
import time

import torch

import timing  # benchmarks/peers/timing.py (the script's own directory is on sys.path)


def main() -> None:
    args = timing.parse_peer_args(__doc__.split("\n\n")[0])

    if os.environ.get("DS_ACCELERATOR") != "cpu":
        raise SystemExit("deepspeed_allreduce.py: set DS_ACCELERATOR=cpu (DeepSpeed's shm all-reduce is CPU-only)")
    torch.set_num_threads(1)
    import deepspeed
    import deepspeed.comm as ds_comm

    deepspeed.init_distributed(dist_backend="gloo")
    rank, n = ds_comm.get_rank(), ds_comm.get_world_size()
    backend = ds_comm.comm.cdb
    problems = []
    if int(os.environ.get("LOCAL_SIZE", "0")) != n:
        problems.append(f"LOCAL_SIZE={os.environ.get('LOCAL_SIZE')} is not the world size {n}")
    if getattr(backend, "shm_comm_op", None) is None:
        problems.append("DeepSpeed's deepspeed_shm_comm op is not loaded")
    if getattr(backend, "shm_vector_kernel_level", 0) < 1:
        problems.append("this CPU lacks AVX2 for DeepSpeed's float32 shm kernel")
    if not hasattr(torch.ops, "deepspeed") or not hasattr(torch.ops.deepspeed, "inference_all_reduce_"):
        problems.append("torch.ops.deepspeed.inference_all_reduce_ is not registered")
    if problems:
        raise SystemExit(
            "deepspeed_allreduce.py: DeepSpeed would fall back to torch.distributed.all_reduce: " + "; ".join(problems)
        )

    def all_reduce(tensor: torch.Tensor) -> None:
        ds_comm.inference_all_reduce(tensor, op=ds_comm.ReduceOp.SUM)

    flag = torch.ones(1)
    for numel in args.sizes:
        # Correctness: integer-valued inputs reduce exactly.
        tensor = torch.arange(numel, dtype=torch.float32) % 1000 + rank
        all_reduce(tensor)
        expected = (torch.arange(numel, dtype=torch.float32) % 1000) * n + n * (n - 1) / 2
        wrong = torch.tensor([0 if torch.equal(tensor, expected) else 1])
        del expected
        torch.distributed.all_reduce(wrong, op=torch.distributed.ReduceOp.MAX)
        if wrong.item():
            raise SystemExit(f"deepspeed_allreduce.py: inference_all_reduce returned a wrong sum, numel={numel}, n={n}")
        # Accuracy of the mean: the sum divided by n (the shm kernel only sums).
        error = None
        if numel <= args.accuracy_max_numel:
            inputs = torch.randn(n, numel, generator=torch.Generator().manual_seed(numel))
            exact = inputs.double().mean(0)
            tensor = inputs[rank].clone()
            all_reduce(tensor)
            tensor /= n
            worst = torch.tensor([float((tensor.double() - exact).abs().max())], dtype=torch.float64)
            torch.distributed.all_reduce(worst, op=torch.distributed.ReduceOp.MAX)
            error = worst.item()
            del inputs, exact
        # Timing.
        base = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
        tensor = base.clone()
        batch = timing.batch_size(numel)
        wanted = timing.reps_for(numel, n, args.reps)

        def one_rep() -> float:
            tensor.copy_(base)
            all_reduce(flag)  # synchronise through the shm transport itself
            start = time.perf_counter()
            for _ in range(batch):
                all_reduce(tensor)
            return (time.perf_counter() - start) / batch

        def agree(done: bool) -> bool:
            flag.fill_(float(done))
            all_reduce(flag)
            return flag.item() > 0

        timing.settle(lambda: all_reduce(tensor), agree, batch)
        first = torch.tensor([one_rep()], dtype=torch.float64)
        torch.distributed.all_reduce(first, op=torch.distributed.ReduceOp.MAX)
        reps, cut_off = timing.plan_reps(first.item() * batch, wanted, args.point_budget)
        times = torch.tensor([one_rep() for _ in range(reps)], dtype=torch.float64)
        torch.distributed.all_reduce(times, op=torch.distributed.ReduceOp.MAX)
        if rank == 0:
            record = {
                "numel": numel,
                "world_size": n,
                "times_s": times.tolist(),
                "batch": batch,
                "reps_planned": wanted,
                "cut_off": cut_off,
                "warmup_s": first.item(),
                "max_abs_error_of_mean": error,
                "library": f"deepspeed {deepspeed.__version__}",
            }
            with args.out.open("a") as f:
                f.write(json.dumps(record) + "\n")
        base = tensor = None  # frees them before the next size (the closures above hold their cells)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
