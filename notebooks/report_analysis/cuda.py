"""5. On a GPU: CUDA SyncBatchNorm, DDP on CUDA, and the CPU all-reduce on the GPU machine's cores."""

from __future__ import annotations

from IPython.display import Markdown

from .formatting import call_time, ms, ratio
from .output import command, display, table


def gpu(R: dict) -> None:
    """The GPU results: CUDA SyncBatchNorm against torch's, DDP on CUDA, and the CPU all-reduce on the GPU machine's
    cores, each where its file is present; a sentence where there is no GPU result at all."""
    if "syncbn_cuda" not in R:
        display(Markdown("No GPU results in this results folder (`syncbn_cuda.json`, `ddp_cuda.json`)."))
    else:
        g = R["syncbn_cuda"]
        command(R, "syncbn_cuda")
        device = g["environment"]["gpu"]
        display(
            Markdown(
                f"GPU: {device['gpu_name']}, driver {device['gpu_driver']}, CUDA {device['cuda_version']}, "
                f"torch {g['environment']['torch_version']}."
            )
        )
        rows = []
        for r in g["records"]:
            synchronized = r.t_torch_syncbn is not None  # world size 2; at 1 the baseline is torch's CUDA BatchNorm
            baseline = r.t_torch_syncbn if synchronized else r.t_torch_bn_local
            base_alloc = r.alloc_torch_syncbn if synchronized else r.alloc_torch_bn_local
            rows.append(
                {
                    "world size": r.world_size,
                    "shape": "x".join(map(str, r.shape)),
                    "ddpkit": r.t_ddpkit,
                    "ddpkit (process_group)": r.t_ddpkit_pg,
                    "torch": baseline,
                    "baseline": "nn.SyncBatchNorm" if synchronized else "BatchNorm (cuDNN)",
                    "ratio": r.ratio,
                    "memory ratio": r.alloc_ddpkit / base_alloc,
                }
            )
        table(
            rows,
            ["world size", "shape", "ddpkit", "ddpkit (process_group)", "torch", "baseline", "ratio", "memory ratio"],
            {
                "ddpkit": ms,
                "ddpkit (process_group)": ms,
                "torch": ms,
                "ratio": ratio,
                "memory ratio": lambda x: f"{x:.4f}×",
            },
        )
    if "ddp_cuda" in R:
        command(R, "ddp_cuda")
        device = R["ddp_cuda"]["environment"]["gpu"]
        display(Markdown(f"GPU: {device['gpu_name']} (each GPU file names its own card and commit)."))
        rows = [
            {"candidate": k, "time / torch DDP": v["time_ratio"], "memory / torch DDP": v["memory_ratio"]}
            for k, v in R["ddp_cuda"]["summary"].items()
        ]
        table(
            rows,
            ["candidate", "time / torch DDP", "memory / torch DDP"],
            {"time / torch DDP": ratio, "memory / torch DDP": ratio},
        )
    if "allreduce_16core" in R:
        c = R["allreduce_16core"]
        command(R, "allreduce_16core")
        env = c["environment"]
        display(
            Markdown(
                f"**CPU all-reduce on the GPU machine's cores**, not this report's machine: "
                f"{env['cpu_model']}, {env['cpu_count']} cores (the machine lent with the "
                f"{env['gpu']['gpu_name']}). Every rank has a core of its own up to 16 ranks, where the other "
                "CPU tables share 2. ddpkit (shared memory), gloo, the memory floor and MPICH's "
                "`MPI_Allreduce`, float32, median of the slowest rank."
            )
        )
        med = {
            (r.world_size, r.numel, r.candidate): r.median_s for r in c["records"] if r.kind == "time" and r.median_s
        }
        rows = []
        for n, numel in sorted({(n, numel) for n, numel, _ in med}):
            row = {"n": n, "floats": numel, **{k: med.get((n, numel, k)) for k in ("ddpkit", "gloo", "mpich", "floor")}}
            if row["ddpkit"] and row["gloo"]:
                row["ddpkit / gloo"] = row["ddpkit"] / row["gloo"]
            if row["ddpkit"] and row["mpich"]:
                row["ddpkit / MPICH"] = row["ddpkit"] / row["mpich"]
            rows.append(row)
        table(
            rows,
            ["n", "floats", "ddpkit", "gloo", "mpich", "floor", "ddpkit / gloo", "ddpkit / MPICH"],
            {
                "ddpkit": call_time,
                "gloo": call_time,
                "mpich": call_time,
                "floor": call_time,
                "ddpkit / gloo": ratio,
                "ddpkit / MPICH": ratio,
            },
        )
