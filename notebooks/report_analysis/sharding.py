"""8b. Sharded data parallelism: ZeRO-1/2 (ddpkit.ShardedOptimizer on ddpkit's DDP) against ddpkit's DDP and
torch's ways (benchmarks/bench_sharding.py)."""

from __future__ import annotations

from IPython.display import Markdown

from .formatting import mib, ratio, step_time
from .output import command, display, table

# The step-time targets: (candidate, baseline) -> the largest ratio, at 2 processes and the 25M model.
TIME_TARGETS = {("zero1", "ddpkit_ddp"): 0.85, ("zero2", "ddpkit_ddp"): 0.8, ("zero1", "torch_zero_ddpkit"): 0.9}
STATE_TOLERANCE = 0.05  # model state within 5% of the ZeRO paper's bytes per parameter
NAMES = {
    "ddpkit_ddp": "ddpkit DDP",
    "zero1": "ZeRO-1 (ShardedOptimizer, full gradients)",
    "zero2": "ZeRO-2 (ShardedOptimizer)",
    "torch_zero_ddpkit": "torch ZeroRedundancyOptimizer on ddpkit DDP",
    "fsdp2_ddpkit": "torch FSDP2 on ddpkit",
    "fsdp2_gloo": "torch FSDP2 on gloo",
    "torch_ddp_gloo": "torch DDP on gloo",
}


def _where(r) -> str:
    return f"{r.topology} hosts" if r.topology else f"{r.world_size} on one host"


def sharding(R: dict) -> None:
    """Step time, model state, peak memory and bytes sent of every candidate (tables), then each target in
    words; a sentence where the folder has no sharding.json."""
    if "sharding" not in R:
        display(
            Markdown(
                "No `sharding.json` in this results folder, so ZeRO-1/2 are not shown: `.venv/bin/python "
                "benchmarks/bench_sharding.py` measures them."
            )
        )
        return
    command(R, "sharding")
    records = R["sharding"]["records"]
    timed = [r for r in records if r.median_step_s is not None]
    ddp = {(r.topology, r.world_size, r.model): r for r in timed if r.candidate == "ddpkit_ddp"}
    rows = []
    for r in timed:
        base = ddp.get((r.topology, r.world_size, r.model))
        rows.append(
            {
                "processes": _where(r),
                "model": f"{r.model} ({r.params / 1e6:.1f}M)",
                "candidate": NAMES.get(r.candidate, r.candidate),
                "step": r.median_step_s,
                "step / DDP's": r.median_step_s / base.median_step_s if base else None,
                "model state, bytes per parameter": r.model_state_bytes_per_param,
                "expected": r.expected_bytes_per_param,
                "peak memory": r.peak_rss_bytes,
                "across hosts per step": r.bytes_sent_per_step,
                "max |param diff| vs DDP": r.max_param_diff_vs_ddp,
            }
        )
    table(
        rows,
        list(rows[0]) if rows else [],
        {
            "step": step_time,
            "step / DDP's": ratio,
            "model state, bytes per parameter": lambda v: f"{v:.2f}",
            "expected": lambda v: f"{v:g}",
            "peak memory": mib,
            "across hosts per step": mib,
            "max |param diff| vs DDP": lambda v: f"{v:.1e}",
        },
    )
    display(
        Markdown(
            "Step: the slowest rank's, median over repetitions, every candidate rebuilt and timed in turn in the "
            "same processes (one thread each). Model state: the storage of parameters, gradients and AdamW's "
            "state on the largest rank, after a backward; expected: the ZeRO paper's bytes per parameter "
            "(DDP 16, ZeRO-1 4+4+8/N, ZeRO-2 4+12/N, FSDP2 16/N). Peak memory: the process's peak resident "
            "memory with that candidate alone. Across hosts: ddpkit's own count of the bytes a rank sent "
            "between the simulated hosts in a step (inside a host it uses shared memory)."
        )
    )
    sent = [r for r in records if r.phase == "bytes"]
    if sent:
        base = {r.world_size: r for r in sent if r.candidate == "ddpkit_ddp"}
        table(
            [
                {
                    "processes": r.world_size,
                    "candidate": NAMES.get(r.candidate, r.candidate),
                    "bytes per step": r.bytes_sent_per_step,
                    "bytes per parameter": r.bytes_sent_per_param,
                    "/ DDP's": r.bytes_sent_per_step / base[r.world_size].bytes_sent_per_step
                    if r.world_size in base
                    else None,
                }
                for r in sent
            ],
            ["processes", "candidate", "bytes per step", "bytes per parameter", "/ DDP's"],
            {"bytes per step": mib, "bytes per parameter": lambda v: f"{v:.3f}", "/ DDP's": ratio},
        )
        display(
            Markdown(
                "Bytes sent per rank in one step, the largest rank's, counted by ddpkit over messages "
                "(DDPKIT_TRANSPORT=process_group; ddpkit's DDP all-reducing with its ring, so that ddpkit moves "
                "every byte). An all-reduce sends 2(N-1)/N of the model's bytes, as a reduce-scatter of the "
                "gradients and an all-gather of the parameters together do."
            )
        )
    display(Markdown("\n".join(f"- {line}" for line in _targets(timed, sent))))


def _targets(timed: list, sent: list) -> list[str]:
    lines = []
    by = {(r.topology, r.world_size, r.model, r.candidate): r for r in timed}
    for (candidate, baseline), target in TIME_TARGETS.items():
        found = []
        for (topology, n, model, name), r in sorted(by.items(), key=str):
            base = by.get((topology, n, model, baseline))
            if name == candidate and base:
                found.append((r.median_step_s / base.median_step_s, f"{model} {_where(r)}", (topology, n, model)))
        main = [value for value, _, key in found if key == (None, 2, "25M")]
        verdict = f" — {'met' if main[0] <= target else 'not met'}" if main else " — not measured at 2 processes, 25M"
        lines.append(
            f"**{NAMES[candidate]} / {NAMES[baseline]}** step time (target ≤ {target}× at 2 processes, 25M)"
            + verdict
            + ": "
            + ", ".join(f"{value:.2f}× at {where}" for value, where, _ in found)
            + "."
        )
    states = [r for r in timed if r.expected_bytes_per_param and r.candidate in ("zero1", "zero2")]
    if states:
        within = all(
            abs(r.model_state_bytes_per_param / r.expected_bytes_per_param - 1) <= STATE_TOLERANCE for r in states
        )
        lines.append(
            f"**Model state** of ZeRO-1 and ZeRO-2 (target: within 5% of the expected bytes per parameter) — "
            f"{'met' if within else 'not met'}: "
            + ", ".join(
                f"{r.candidate} {r.model_state_bytes_per_param:.2f} of {r.expected_bytes_per_param:g} at {_where(r)}"
                for r in states
            )
            + "."
        )
    if sent:
        base = {r.world_size: r for r in sent if r.candidate == "ddpkit_ddp"}
        zero = [r for r in sent if r.candidate in ("zero1", "zero2") and r.world_size in base]
        if zero:
            ratios = [r.bytes_sent_per_step / base[r.world_size].bytes_sent_per_step for r in zero]
            lines.append(
                "**Bytes sent** by ZeRO-1 and ZeRO-2 per step (target: DDP's): "
                + ", ".join(f"{r.candidate} {value:.4f}× at {r.world_size}" for r, value in zip(zero, ratios))
                + " (the padding of each bucket to a multiple of the processes is the difference)."
            )
    return lines
