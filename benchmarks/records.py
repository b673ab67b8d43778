"""The records of benchmarks/results/*.json, typed: one frozen dataclass per kind of record.

The benchmark scripts build their records as these classes, ``common.write_results`` writes each
one's ``to_dict()``, and the report (notebooks/report_analysis) reads them back with ``load_records``. A
record's JSON keys are its field names. A field without a default is always written (``null`` where
it has no value); a field made by ``optional()`` is one that only some records have (a peer's
``library``, a SyncBatchNorm candidate that does not run at that world size): it is None when
absent and then left out of the JSON (also where a script measured it as None: the CUDA
SyncBatchNorm runs have no ``rss_`` figures, which older files wrote as ``null``). A key
that no field knows is an error, so that a script and the report cannot drift apart unnoticed.

Pure Python (no torch): the report's kernel and the tests import it on its own.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

_LEFT_OUT_WHEN_NONE = "left_out_when_none"


def optional() -> Any:
    """A field that only some records have: None by default, and then not written."""
    return field(default=None, metadata={_LEFT_OUT_WHEN_NONE: True})


class Record:
    """What every record class shares: its JSON object, and reading one back."""

    def to_dict(self) -> dict:
        data = dataclasses.asdict(self)
        for f in dataclasses.fields(self):
            if f.metadata.get(_LEFT_OUT_WHEN_NONE) and data[f.name] is None:
                del data[f.name]
        return data

    @classmethod
    def from_dict(cls, data: dict) -> Record:
        """The record of a JSON object; raises ValueError on a key no field knows or a required one missing."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(data.keys() - fields.keys())
        if unknown:
            raise ValueError(f"{cls.__name__} has no field {', '.join(unknown)} (benchmarks/records.py)")
        missing = sorted(
            name
            for name, f in fields.items()
            if f.init
            and name not in data
            and f.default is dataclasses.MISSING
            and f.default_factory is dataclasses.MISSING
        )
        if missing:
            raise ValueError(f"{cls.__name__} lacks {', '.join(missing)}")
        for name, f in fields.items():
            if not f.init and name in data and data[name] != f.default:  # the "kind" the class stands for
                raise ValueError(f"{cls.__name__} has {name} {f.default!r}, not {data[name]!r}")
        return cls(**{name: value for name, value in data.items() if fields[name].init})


def _kind(value: str) -> Any:
    """The ``kind`` of a class whose records all carry it (the results files that mix kinds)."""
    return field(default=value, init=False)


# -- bench_allreduce.py: allreduce.json, allreduce_checks.json -------------------------------------------


@dataclass(frozen=True, kw_only=True)
class AllreduceTimeRecord(Record):
    """One candidate at one (world size, vector size): time per call of the slowest rank, over repetitions."""

    world_size: int
    numel: int
    candidate: str
    kind: str = _kind("time")
    implementation: str  # ddpkit, gloo, floor, mpich, deepspeed
    algorithm: str | None  # ddpkit's algorithm argument
    transport: str | None  # ddpkit's transport, its default resolved
    checked: bool | None  # ddpkit's Note [Collective checks]
    resolved_algorithm: str | None = optional()  # what "auto" chose, where ddpkit can tell (process group)
    median_s: float | None  # None: not measured (see status)
    p25_s: float | None
    p75_s: float | None
    reps: int
    status: str  # "measured", or "not measured: <why>"
    algorithm_bandwidth_GBps: float | None
    bus_bandwidth_GBps: float | None  # None for the floor and at one process
    batch: int  # back-to-back calls per repetition
    reps_planned: int | None = optional()
    cut_off: bool  # fewer repetitions ran than planned (a peer's time budget; not measured)
    warmup_s: float | None = optional()  # a peer's warm-up repetition, which planned its repetitions
    library: str | None = optional()  # a peer's library version
    reps_sharing_a_cpu: int | None = optional()  # in-process: repetitions begun with ranks doubled up on a CPU
    max_abs_error_of_mean: float | None


@dataclass(frozen=True, kw_only=True)
class AllreduceMemoryRecord(Record):
    """Peak resident-set increase of one warm all-reduce, the maximum over ranks."""

    world_size: int
    numel: int
    candidate: str
    kind: str = _kind("memory")
    peak_memory_increase_bytes: int
    input_bytes: int


# -- bench_backend.py: backend.json (and DdpRecord with kind "ddp") ---------------------------------------


@dataclass(frozen=True, kw_only=True)
class CollectiveRecord(Record):
    """One collective through one candidate (gloo, the "ddpkit" backend, ddpkit's own function)."""

    kind: str = _kind("collective")
    collective: str
    candidate: str
    world_size: int
    numel: int
    bytes: int
    median_s: float
    p25_s: float
    p75_s: float
    reps: int
    busbw_GBps: float


@dataclass(frozen=True, kw_only=True)
class LayerRecord(Record):
    """One all-reduce through one layer of the torch.distributed stack."""

    kind: str = _kind("layers")
    layer: str
    world_size: int
    numel: int
    median_s: float
    reps: int


# -- bench_ddp.py: ddp.json, ddp_cuda.json ----------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class DdpRecord(Record):
    """One DDP candidate on one (model, accumulation): step time and peak memory."""

    kind: Literal["ddp"] | None = optional()  # only in backend.json, beside its other kinds
    world_size: int
    model: str
    batch_per_rank: int
    accumulation: int
    candidate: str
    # The candidate's settings (bench_ddp.run_config's ``candidates``).
    impl: str
    algorithm: str | None = optional()
    backend: str | None = optional()
    env: dict | None = optional()
    hook: str | None = optional()  # a communication hook of torch's ddp_comm_hooks.default_hooks, by name
    median_step_s: float
    p25_step_s: float
    p75_step_s: float
    steps_timed: int
    peak_memory_bytes: int
    reducer_stats: dict | None
    # Named after run_config's reference candidate: torch (bench_ddp.py), torch_gloo (bench_backend.py).
    max_param_diff_vs_torch_after_2_steps: float | None = optional()
    max_param_diff_vs_torch_gloo_after_2_steps: float | None = optional()


# -- bench_syncbn.py: syncbn.json, syncbn_cuda.json -------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class SyncBatchNormRecord(Record):
    """One input shape at one world size. Per candidate (bench_syncbn.py's settings.candidates, present
    where it ran): ``t_<name>`` the median step time, ``alloc_<name>`` and ``rss_<name>`` its memory."""

    world_size: int
    shape: list[int]
    features: int
    global_batch: int
    local_batch: int
    threads_per_rank: int
    kernels: str
    repetitions: int
    steps_per_repetition: int | None = optional()  # timed back to back in one repetition (absent: 1)
    t_ddpkit: float | None = optional()
    t_ddpkit_pg: float | None = optional()
    t_ddpkit_unchecked: float | None = optional()
    t_torch_bn_local: float | None = optional()
    t_torch_syncbn: float | None = optional()
    t_ddpkit_local: float | None = optional()
    t_gloo_two_all_reduces: float | None = optional()
    t_torch_emulated: float | None = optional()
    alloc_ddpkit: int | None = optional()
    rss_ddpkit: int | None = optional()
    alloc_ddpkit_pg: int | None = optional()
    rss_ddpkit_pg: int | None = optional()
    alloc_ddpkit_unchecked: int | None = optional()
    rss_ddpkit_unchecked: int | None = optional()
    alloc_torch_bn_local: int | None = optional()
    rss_torch_bn_local: int | None = optional()
    alloc_torch_syncbn: int | None = optional()
    rss_torch_syncbn: int | None = optional()
    t_floor: float | None = optional()  # CPU, world size > 1: torch BatchNorm + two gloo all-reduces
    # ddpkit against the baseline (bench_syncbn.summarize): torch.nn.SyncBatchNorm on CUDA; on CPU torch's
    # BatchNorm on the local batch alone (files without steps_per_repetition divided by t_floor instead)
    ratio: float
    ratio_pg: float | None = optional()
    ratio_unchecked: float | None = optional()
    ratio_emulated: float | None = optional()
    ratio_local_compute: float | None = optional()
    ratio_pg_vs_emulated: float | None = optional()
    ratio_floor: float | None = optional()  # CPU, world size > 1: t_ddpkit / t_floor
    # The 95% interval of `ratio`'s median over the repetitions' paired ratios (common.ratio_spread);
    # absent in files written before it was recorded.
    ratio_low: float | None = optional()
    ratio_high: float | None = optional()
    alloc_extra: int
    alloc_extra_per_channel: float


# -- bench_training.py: training.json, and the short run of `make main` (runs/main/training.json) -------


@dataclass(frozen=True, kw_only=True)
class TrainingRecord(Record):
    """One pipeline's whole training run.

    ``sync_bn`` and ``batch_norm`` say what ran: ``batch_norm`` is ``Trainer.batch_norm``
    ("BatchNorm" for plain batch norm, "ddpkit.SyncBatchNorm", "torch.nn.SyncBatchNorm"). Files
    written before it was recorded lack it, and there torch's CPU pipeline has ``sync_bn`` true (what
    it was asked for) beside a note that it ran plain BatchNorm: ``synchronized`` and ``label`` read
    both kinds right.
    """

    candidate: str
    impl: str
    shard: str | None = optional()  # train.py's --shard where not "none" (bench_training.py --shard)
    sync_bn: bool
    batch_norm: str | None = optional()
    world_size: int
    notes: list[str]
    global_batch: int
    optimizer_steps: int
    epochs: list[dict]  # ddpkit.training.Trainer.train_epoch's records, one per epoch
    final_test_accuracy: float
    final_test_loss: float
    median_epoch_time_s: float
    peak_rss_bytes: int
    loss_curve: list[float]  # rank 0's loss at every optimizer step (its last micro-batch)
    # The timed blocks in the order run (absent before they were): training seconds, optimizer steps.
    block_times_s: list[float] | None = optional()
    block_steps: list[int] | None = optional()

    @property
    def synchronized(self) -> bool:
        """Whether the run's BatchNorm layers synchronized their statistics across ranks."""
        if self.batch_norm is not None:
            return self.batch_norm != "BatchNorm"
        return self.sync_bn and not any("plain BatchNorm" in note for note in self.notes)

    @property
    def label(self) -> str:
        """The pipeline in words, e.g. "ddpkit DDP, plain BatchNorm" or "torch DDP, torch.nn.SyncBatchNorm"."""
        sharded = f" + ShardedOptimizer ({self.shard})" if self.shard else ""
        if not self.synchronized:
            return f"{self.impl} DDP{sharded}, plain BatchNorm"
        return f"{self.impl} DDP{sharded}, {self.batch_norm or ('ddpkit.SyncBatchNorm' if self.impl == 'ddpkit' else 'torch.nn.SyncBatchNorm')}"

    @property
    def epoch_times_s(self) -> list[float]:
        return [epoch["epoch_time_s"] for epoch in self.epochs]


# -- bench_multihost.py: multihost.json ------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class MultihostRecord(Record):
    """One all-reduce candidate across simulated hosts at one size: time per call of the slowest rank."""

    kind: str = _kind("multihost_all_reduce")
    topology: str  # "2x2": hosts x ranks per host
    link: str  # "unshaped", or the tbf rate ("1gbit")
    numel: int
    candidate: str  # ddpkit, ddpkit_flat, ddpkit_backend, gloo; ddpkit_<algorithm> by name
    median_s: float
    p25_s: float
    p75_s: float
    reps: int
    batch: int  # back-to-back calls per repetition
    ratio_to_gloo: float
    # The CPU the ranks spent per call, summed over them (all run on this machine), and its share of
    # the machine's CPUs over the slowest rank's time (near 1: bound by the shared CPUs, not the link).
    # Files before these fields lack them.
    all_ranks_cpu_s: float | None = optional()
    cpu_busy: float | None = optional()
    # 2(N-1)/N of the bytes per host link (N hosts) over the time, and its fraction of the link's
    # rate where tbf shapes it (None unshaped). Files before these fields lack them.
    bus_bandwidth_GBps: float | None = optional()
    link_fraction: float | None = optional()
    # The CPU per call of the busiest thread of any rank: what no number of cores takes below it.
    # Files before this field lack it.
    busiest_thread_cpu_s: float | None = optional()


@dataclass(frozen=True, kw_only=True)
class MultihostCollectiveRecord(Record):
    """One candidate of another collective across simulated hosts at one size (the whole tensor: the
    broadcast's and the reduce's, the all-gather's output, the reduce-scatter's input)."""

    kind: str = _kind("multihost_collective")
    collective: str  # broadcast, reduce, all_gather, reduce_scatter
    topology: str
    link: str
    numel: int
    candidate: str  # ddpkit, ddpkit_flat, ddpkit_backend, gloo
    median_s: float
    p25_s: float
    p75_s: float
    reps: int
    batch: int
    ratio_to_gloo: float
    # as MultihostRecord's
    all_ranks_cpu_s: float | None = optional()
    cpu_busy: float | None = optional()
    busiest_thread_cpu_s: float | None = optional()


@dataclass(frozen=True, kw_only=True)
class MultihostDdpRecord(Record):
    """One DDP candidate's step across simulated hosts, slowest rank."""

    kind: str = _kind("multihost_ddp")
    topology: str
    link: str
    candidate: str  # ddpkit_ddp, torch_ddp_gloo, torch_ddp_ddpkit
    median_s: float
    p25_s: float
    p75_s: float
    reps: int
    ratio_to_torch_ddp_gloo: float
    all_ranks_cpu_s: float | None = optional()  # per step; as MultihostRecord's
    cpu_busy: float | None = optional()
    busiest_thread_cpu_s: float | None = optional()


# -- bench_torch_stack.py: torch_stack.json -----------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class TorchStackRecord(Record):
    """One workload on one candidate at one world size: step time (the slowest rank's, over repetitions)."""

    kind: str = _kind("torch_stack")
    workload: str  # fsdp2, ddp_powerSGD, ddp_fp16, tp_mlp
    candidate: str  # gloo, ddpkit; floor (tp_mlp: a mesh of one rank, no communication)
    world_size: int
    model: str  # e.g. "mlp 6x2048"
    batch_per_rank: int
    median_step_s: float
    p25_step_s: float
    p75_step_s: float
    reps: int
    steps_per_rep: int
    max_param_diff_vs_gloo: float  # after the warm-up steps (tp_mlp: output and gradients of a step)
    peak_rss_bytes: int | None = optional()  # fsdp2: the candidate alone, max over ranks
    peak_rss_increase_bytes: int | None = optional()  # over the RSS before the model was built


# -- bench_sharding.py: sharding.json ----------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ShardingRecord(Record):
    """One candidate of bench_sharding.py (sharding_candidates.CANDIDATES) at one world size and model: step
    time, model state, peak RSS (phases one_host and hosts), or ddpkit's bytes sent per step (phase bytes)."""

    kind: str = _kind("sharding")
    phase: str  # one_host, bytes, hosts
    candidate: str  # ddpkit_ddp, zero1, zero2, torch_zero_ddpkit, fsdp2_ddpkit, fsdp2_gloo, torch_ddp_gloo, ...
    world_size: int
    topology: str | None = optional()  # hosts: "2x2"
    model: str  # "25M" (six Linear 2048x2048), "100M" (six 4096x4096)
    params: int
    batch_per_rank: int
    median_step_s: float | None = optional()  # the slowest rank's, median over repetitions
    p25_step_s: float | None = optional()
    p75_step_s: float | None = optional()
    reps: int | None = optional()
    steps_per_rep: int | None = optional()
    model_state_bytes: int | None = optional()  # parameters, gradients, optimizer state (largest rank)
    model_state_bytes_per_param: float | None = optional()
    expected_bytes_per_param: float | None = optional()  # the ZeRO paper's, where the issue sets a bar
    transfer_bytes: int | None = optional()  # ZeRO-2's pool of gradient transfer buffers
    peak_rss_bytes: int | None = optional()  # VmHWM of the candidate alone in its processes (largest rank)
    peak_rss_increase_bytes: int | None = optional()  # over the RSS when it was built
    bytes_sent_per_step: float | None = optional()  # ddpkit's counters, largest rank (hosts: what crosses)
    bytes_sent_per_param: float | None = optional()
    algorithm: str | None = optional()  # phase bytes: ddpkit DDP's all-reduce algorithm
    max_param_diff_vs_ddp: float | None = optional()  # after the warm-up, against ddpkit DDP's parameters
    # ZeRO-3, phase bytes: ddpkit's bytes over one forward without a graph (every unit all-gathered once)
    gather_bytes_per_forward: float | None = optional()


# -- bench_latency.py: latency.json ------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class LatencyRecord(Record):
    """One layer of a small all-reduce's call path, looped back to back (bench_latency.STAGES)."""

    kind: str = _kind("latency")
    stage: str  # e.g. "c++ engine", "python ddpkit.all_reduce"
    loop: str  # where the loop runs: "c++" (no Python, no dispatcher) or "python"
    world_size: int
    numel: int  # float32 values all-reduced (0 for stages that move none)
    median_s: float  # per call: the slowest rank's, median over repetitions
    p25_s: float
    p75_s: float
    reps: int
    calls_per_rep: int


# -- bench_fault_tolerance.py: fault_tolerance.json -------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class FaultToleranceRecord(Record):
    """One measurement of a fault-tolerance candidate: "steady" (no failure) or "kill" (one replica, or
    for the torchrun baseline one rank, SIGKILLed mid-run and restarted)."""

    kind: str = _kind("fault_tolerance")
    candidate: str  # "torchft-gloo", "torchft-ddpkit", "torchft-floor", "torchrun-restart"
    measure: str  # "steady" or "kill"
    repeat: int
    # the DDP wrapper: "torchft-ddp", "torchft-ddp-async" (ddpkit.torchft's) or "ddpkit-ddp" (its comm hook)
    wrapper: str | None = optional()
    # across simulated hosts (fault_tolerance_hosts.json): "4x1", one replica group per host, and the links
    topology: str | None = optional()
    link: str | None = optional()
    step_s: float | None = optional()  # steady: median step time of the 8.4M-parameter MLP
    comm_s: float | None = optional()  # steady: median time per step in the gradient all-reduces
    death_to_next_commit_s: float | None = optional()  # kill: to the survivors' next committed step
    restart_to_first_commit_s: float | None = optional()  # kill: restart to its first committed step
    ready_to_first_commit_s: float | None = optional()  # kill: the same from its manager's start (imports done)
    steps_lost: int | None = optional()  # kill: steps a replica had committed and no longer holds
    uncommitted_iterations: int | None = optional()  # kill: survivors' iterations not committed meanwhile
    failed: str | None = optional()  # the candidate's failure, when it did not survive the kill
    # kill, both the last survivor's (s after the kill): its first iteration ended and discarded after
    # the kill (the failed collective noticed), and the quorum of its next committed step (the lighthouse's part)
    noticed_s: float | None = optional()
    next_quorum_s: float | None = optional()
    # kill: [s after the kill at the iteration's end, replica, step, committed, participants, its quorum
    # in (s after the kill), its start (s after the kill)]
    timeline: list | None = optional()


# -- bench_compression.py: compression.json -----------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class CompressionRecord(Record):
    """One training run across simulated hosts with one way of sending its gradients (``comm_hook``:
    ddpkit.training's COMM_HOOKS), the others' configuration and seed alike."""

    kind: str = _kind("compression_training")
    comm_hook: str  # "none" (float32), "bf16_crossing" (Note [Compressed crossing]), "bf16_compress" (torch's)
    topology: str  # "2x2": hosts x ranks per host
    link: str  # "unshaped", or the tbf rate ("1gbit")
    epochs: list[dict]  # ddpkit.training.Trainer.train_epoch's records, one per epoch
    final_test_accuracy: float
    final_test_loss: float
    median_epoch_time_s: float
    loss_curve: list[float]  # rank 0's loss at every optimizer step
    accuracy_minus_fp32_points: float  # final test accuracy against the "none" run's, in points


# -- bench_import.py: import_torch.json ---------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ImportTimeRecord(Record):
    """``import torch`` in fresh interpreters, with torch's backend autoload on (ddpkit's entry point runs) or off."""

    kind: str = _kind("import_time")
    candidate: str  # "autoload" or "no_autoload" (TORCH_DEVICE_BACKEND_AUTOLOAD=0)
    median_s: float
    p25_s: float
    p75_s: float
    reps: int
    extension_loaded: bool  # whether ddpkit's C++ extension was loaded once the import returned


# A record with a "kind" is of the class of its kind; a record without one, of the class of its file.
BY_KIND: dict[str, type[Record]] = {
    "time": AllreduceTimeRecord,
    "memory": AllreduceMemoryRecord,
    "collective": CollectiveRecord,
    "layers": LayerRecord,
    "ddp": DdpRecord,
    "multihost_all_reduce": MultihostRecord,
    "multihost_ddp": MultihostDdpRecord,
    "multihost_collective": MultihostCollectiveRecord,
    "torch_stack": TorchStackRecord,
    "sharding": ShardingRecord,
    "latency": LatencyRecord,
    "fault_tolerance": FaultToleranceRecord,
    "compression_training": CompressionRecord,
    "import_time": ImportTimeRecord,
}
BY_BENCHMARK: dict[str, type[Record]] = {"syncbn": SyncBatchNormRecord, "ddp": DdpRecord, "training": TrainingRecord}


def load_records(source: str | Path | dict, without_kind: type[Record] | None = None) -> list[Record]:
    """The typed records of a results file, given its path or its parsed JSON document.

    A record without a ``kind`` is of ``without_kind``, by default of the class ``BY_BENCHMARK`` gives
    the benchmark's name up to its first "_" (syncbn_cuda: syncbn; ddp_cuda: ddp).
    Raises ValueError, naming the file and the record, on a record that does not fit its class.
    """
    if isinstance(source, dict):
        document, where = source, f"results {source.get('benchmark')!r}"
    else:
        document, where = json.loads(Path(source).read_text()), str(source)
    family = str(document.get("benchmark", "")).split("_")[0]
    records = []
    for index, data in enumerate(document["records"]):
        if "kind" in data:
            cls = BY_KIND.get(data["kind"])
            if cls is None:
                raise ValueError(f"{where}, record {index}: unknown kind {data['kind']!r} (benchmarks/records.py)")
        else:
            cls = without_kind or BY_BENCHMARK.get(family)
            if cls is None:
                raise ValueError(
                    f"{where}, record {index}: no kind, and no record class for benchmark "
                    f"{document.get('benchmark')!r} (pass without_kind)"
                )
        try:
            records.append(cls.from_dict(data))
        except ValueError as error:
            raise ValueError(f"{where}, record {index}: {error}") from None
    return records
