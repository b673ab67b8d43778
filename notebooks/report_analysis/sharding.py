"""8b. Sharded data parallelism: ZeRO-1/2 (ddpkit.ShardedOptimizer on ddpkit's DDP, sharding.json) and ZeRO-3
(ddpkit.FullyShardedDataParallel, sharding_zero3.json; its peak memory at the 100M model, sharding_memory.json)
against ddpkit's DDP and torch's ways (benchmarks/bench_sharding.py)."""

from __future__ import annotations

from IPython.display import Markdown

from .formatting import mib, ratio, step_time
from .output import command, display, table

# The step-time targets: (candidate, baseline) -> the largest ratio, at 2 processes and the 25M model.
TIME_TARGETS = {
    ("zero1", "ddpkit_ddp"): 0.85,
    ("zero2", "ddpkit_ddp"): 0.8,
    ("zero1", "torch_zero_ddpkit"): 0.9,
    ("zero3", "ddpkit_ddp"): 1.0,
    ("zero3", "fsdp2_ddpkit"): 0.75,
    ("zero3", "fsdp2_gloo"): 0.45,
}
RSS_TARGET = 0.7  # ZeRO-3's peak memory against ddpkit DDP's, at 2 processes and the 100M model
BYTES_TARGET = 1.5  # ZeRO-3's bytes sent per step against ddpkit DDP's
STATE_TOLERANCE = 0.05  # model state within 5% of the ZeRO paper's bytes per parameter
ZERO = ("zero1", "zero2", "zero3", "zero3_bf16")
NAMES = {
    "ddpkit_ddp": "ddpkit DDP",
    "zero1": "ZeRO-1 (ShardedOptimizer, full gradients)",
    "zero2": "ZeRO-2 (ShardedOptimizer)",
    "zero3": "ZeRO-3 (FullyShardedDataParallel)",
    "zero3_bf16": "ZeRO-3, bfloat16 compute",
    "torch_zero_ddpkit": "torch ZeroRedundancyOptimizer on ddpkit DDP",
    "fsdp2_ddpkit": "torch FSDP2 on ddpkit",
    "fsdp2_gloo": "torch FSDP2 on gloo",
    "torch_ddp_gloo": "torch DDP on gloo",
}
# The results files, and the stages the report takes from each.
FILES = {
    "sharding": "ZeRO-1 and ZeRO-2",
    "sharding_zero3": "ZeRO-3",
    "sharding_memory": "ZeRO-3's peak memory, the 100M model",
}


def _where(r) -> str:
    return f"{r.topology} hosts" if r.topology else f"{r.world_size} on one host"


def sharding(R: dict) -> None:
    """For each of sharding.json (ZeRO-1/2), sharding_zero3.json (ZeRO-3) and sharding_memory.json (ZeRO-3's
    peak memory): the command, step time, model state, peak memory and bytes sent of every candidate it
    measured (tables), then each target in words; a sentence for a file the folder does not hold."""
    for name, stages in FILES.items():
        display(Markdown(f"### {stages}"))
        if name not in R:
            display(
                Markdown(
                    f"No `{name}.json` in this results folder, so {stages} are not shown: "
                    "`benchmarks/run_all.sh` runs `benchmarks/bench_sharding.py` that measures them."
                )
            )
            continue
        _results(R, name)


def _results(R: dict, name: str) -> None:
    command(R, name)
    records = R[name]["records"]
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
                "peak / DDP's": r.peak_rss_bytes / base.peak_rss_bytes if base else None,
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
            "peak / DDP's": ratio,
            "across hosts per step": mib,
            "max |param diff| vs DDP": lambda v: f"{v:.1e}",
        },
    )
    display(
        Markdown(
            "Step: the slowest rank's, median over repetitions, every candidate rebuilt and timed in turn in the "
            "same processes (one thread each). Model state: the storage of parameters, gradients and AdamW's "
            "state on the largest rank, after a backward; expected: the ZeRO paper's bytes per parameter "
            "(DDP 16, ZeRO-1 4+4+8/N, ZeRO-2 4+12/N, ZeRO-3 and FSDP2 16/N). Peak memory: the process's peak "
            "resident memory with that candidate alone. Across hosts: ddpkit's own count of the bytes a rank sent "
            "between the simulated hosts in a step (inside a host it uses shared memory)."
        )
    )
    sent = [r for r in records if r.phase == "bytes"]
    if sent:
        base = {r.world_size: r for r in sent if r.candidate == "ddpkit_ddp"}
        gathers = {(r.world_size, r.candidate): r.gather_bytes_per_forward for r in sent if r.gather_bytes_per_forward}
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
                    "all-gathers of one forward": gathers.get((r.world_size, r.candidate)),
                }
                for r in sent
            ],
            [
                "processes",
                "candidate",
                "bytes per step",
                "bytes per parameter",
                "/ DDP's",
                "all-gathers of one forward",
            ],
            {
                "bytes per step": mib,
                "bytes per parameter": lambda v: f"{v:.3f}",
                "/ DDP's": ratio,
                "all-gathers of one forward": mib,
            },
        )
        display(
            Markdown(
                "Bytes sent per rank in one step, the largest rank's, counted by ddpkit over messages "
                "(DDPKIT_TRANSPORT=process_group; ddpkit's DDP all-reducing with its ring, so that ddpkit moves "
                "every byte). An all-reduce sends 2(N-1)/N of the model's bytes, as a reduce-scatter of the "
                "gradients and an all-gather of the parameters together do; ZeRO-3 gathers each layer again "
                "before its backward. All-gathers of one forward: ZeRO-3's bytes over a forward without "
                "a graph, every layer gathered once."
            )
        )
    display(Markdown("\n".join(f"- {line}" for line in _targets(timed, sent))))


def _targets(timed: list, sent: list) -> list[str]:
    """Each target whose candidate the results hold, in words, with every ratio measured for it."""
    lines = []
    by = {(r.topology, r.world_size, r.model, r.candidate): r for r in timed}
    for (candidate, baseline), target in TIME_TARGETS.items():
        found = []
        for (topology, n, model, name), r in sorted(by.items(), key=str):
            base = by.get((topology, n, model, baseline))
            if name == candidate and base:
                found.append((r.median_step_s / base.median_step_s, f"{model} {_where(r)}", (topology, n, model)))
        if not found:
            continue
        main = [value for value, _, key in found if key == (None, 2, "25M")]
        verdict = f" — {'met' if main[0] <= target else 'not met'}" if main else " — not measured at 2 processes, 25M"
        lines.append(
            f"**{NAMES[candidate]} / {NAMES[baseline]}** step time (target ≤ {target}× at 2 processes, 25M)"
            + verdict
            + ": "
            + ", ".join(f"{value:.2f}× at {where}" for value, where, _ in found)
            + "."
        )
    states = [r for r in timed if r.expected_bytes_per_param and r.candidate in ZERO]
    if states:
        within = all(
            abs(r.model_state_bytes_per_param / r.expected_bytes_per_param - 1) <= STATE_TOLERANCE for r in states
        )
        lines.append(
            "**Model state** of "
            + " and ".join(NAMES[c] for c in ZERO if any(r.candidate == c for r in states))
            + f" (target: within 5% of the expected bytes per parameter) — {'met' if within else 'not met'}: "
            + ", ".join(
                f"{r.candidate} {r.model_state_bytes_per_param:.2f} of {r.expected_bytes_per_param:g} "
                f"({r.model} at {_where(r)})"
                for r in states
            )
            + "."
        )
    peaks = []
    for r in timed:
        base = by.get((r.topology, r.world_size, r.model, "ddpkit_ddp"))
        if r.candidate.startswith("zero3") and base:
            peaks.append((r, r.peak_rss_bytes / base.peak_rss_bytes))
    if peaks:
        main = [
            value
            for r, value in peaks
            if (r.candidate, r.topology, r.world_size, r.model) == ("zero3", None, 2, "100M")
        ]
        verdict = f"{'met' if main[0] <= RSS_TARGET else 'not met'}" if main else "not measured at 2 processes, 100M"
        lines.append(
            f"**Peak memory** of ZeRO-3 / ddpkit DDP's (target ≤ {RSS_TARGET}× at 2 processes, 100M) — {verdict}: "
            + ", ".join(f"{r.candidate} {value:.2f}× ({r.model} at {_where(r)})" for r, value in peaks)
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
        zero3 = [r for r in sent if r.candidate.startswith("zero3") and r.world_size in base]
        if zero3:
            ratios = [r.bytes_sent_per_step / base[r.world_size].bytes_sent_per_step for r in zero3]
            within = all(value <= BYTES_TARGET for r, value in zip(zero3, ratios) if r.candidate == "zero3")
            lines.append(
                f"**Bytes sent** by ZeRO-3 per step (target ≤ {BYTES_TARGET}× DDP's) — {'met' if within else 'not met'}: "
                + ", ".join(f"{r.candidate} {value:.3f}× at {r.world_size}" for r, value in zip(zero3, ratios))
                + "."
            )
        gathers = {(r.world_size, r.candidate): r.gather_bytes_per_forward for r in sent if r.gather_bytes_per_forward}
        halves = [
            (n, gathers[(n, "zero3_bf16")] / gathers[(n, "zero3")])
            for n in sorted({n for n, _ in gathers})
            if (n, "zero3") in gathers and (n, "zero3_bf16") in gathers
        ]
        if halves:
            lines.append(
                "**bfloat16 compute's parameter all-gathers** against float32's, one forward (target: half) — "
                + f"{'met' if all(abs(value - 0.5) <= 0.005 for _, value in halves) else 'not met'}: "
                + ", ".join(f"{value:.3f}× at {n}" for n, value in halves)
                + "."
            )
    return lines
