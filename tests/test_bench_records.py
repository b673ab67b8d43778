"""benchmarks/records.py: every committed results file reads into the typed records and writes back the same."""

import dataclasses
import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import records  # noqa: E402

RESULTS = sorted((BENCHMARKS / "results").glob("*.json"))
CLASSES = {
    "allreduce": {records.AllreduceTimeRecord, records.AllreduceMemoryRecord},
    "allreduce_checks": {records.AllreduceTimeRecord},
    "allreduce_16core": {records.AllreduceTimeRecord},  # --memory-sizes left empty: no memory records
    "allreduce_whole_16core": {records.AllreduceTimeRecord},
    "allreduce_peers_n2": {records.AllreduceTimeRecord},
    "allreduce_small_n2": {records.AllreduceTimeRecord},
    "backend": {records.CollectiveRecord, records.LayerRecord, records.DdpRecord},
    "ddp": {records.DdpRecord},
    "ddp_cuda": {records.DdpRecord},
    "ddp_hooks": {records.DdpRecord},
    "syncbn": {records.SyncBatchNormRecord},
    "syncbn_cuda": {records.SyncBatchNormRecord},
    "training": {records.TrainingRecord},
    "torch_stack": {records.TorchStackRecord},
    "multihost": {records.MultihostRecord, records.MultihostCollectiveRecord, records.MultihostDdpRecord},
    "multihost_hosts": {records.MultihostRecord},  # --collectives all_reduce --no-ddp
    "multihost_16core": {records.MultihostRecord},  # the GPU machine's 16 cores (also multihost_16core_3x1_4x2.json)
    "multihost_link_threads_2core": {records.MultihostRecord},
    "multihost_unshaped": {records.MultihostRecord},  # a release build (compare_builds.sh's venv of 10bd288)
    "multihost_delayed": {records.MultihostRecord},  # --links 1gbit-10ms (issue 65)
    "multihost_delayed_4x1_16M": {records.MultihostRecord},  # 4x1, 16M floats, BBR and reno (issue 65)
    "multihost_16core_link_threads": {records.MultihostRecord},  # scripts/gpu_checks.sh multihost, from 2026-11-28 on
    "latency": {records.LatencyRecord},
    "fault_tolerance": {records.FaultToleranceRecord},
    "compression": {records.CompressionRecord},
    "fault_tolerance_hosts": {records.FaultToleranceRecord},
    "fault_tolerance_hosts_delayed": {records.FaultToleranceRecord},  # --link 1gbit-10ms (issue 65)
    "fault_tolerance_hosts_delayed_4x1": {records.FaultToleranceRecord},
    "import_torch": {records.ImportTimeRecord},
    "sharding": {records.ShardingRecord},  # ZeRO-1/2 and their baselines (issue 60)
    "sharding_zero3": {records.ShardingRecord},
    "sharding_memory": {records.ShardingRecord},  # ZeRO-3's peak memory, the 100M model
}


def _left_out_when_none(record) -> set:
    return {f.name for f in dataclasses.fields(record) if f.metadata.get(records._LEFT_OUT_WHEN_NONE)}


@pytest.mark.parametrize("path", RESULTS, ids=lambda path: path.name)
def test_committed_results_round_trip(path):
    document = json.loads(path.read_text())
    typed = records.load_records(path)
    assert {type(record) for record in typed} == CLASSES[document["benchmark"]]
    for raw, record in zip(document["records"], typed, strict=True):
        # The one change a round trip may make: an optional field recorded as null is left out.
        expected = {k: v for k, v in raw.items() if not (v is None and k in _left_out_when_none(record))}
        assert list(record.to_dict().items()) == list(expected.items())  # the keys in the files' order
        assert json.loads(json.dumps(record.to_dict())) == expected


def test_a_parsed_document_reads_as_its_file():
    path = BENCHMARKS / "results" / "syncbn.json"
    assert records.load_records(json.loads(path.read_text())) == records.load_records(path)


def _document(benchmark, *rows):
    return {"benchmark": benchmark, "records": list(rows)}


LAYER = {"kind": "layers", "layer": "dist.all_reduce", "world_size": 2, "numel": 1000, "median_s": 1e-5, "reps": 3}


def test_schema_drift_is_an_error():
    assert records.load_records(_document("backend", LAYER)) == [
        records.LayerRecord(layer="dist.all_reduce", world_size=2, numel=1000, median_s=1e-5, reps=3)
    ]
    with pytest.raises(ValueError, match=r"record 1: LayerRecord has no field p99_s"):
        records.load_records(_document("backend", LAYER, {**LAYER, "p99_s": 1.0}))
    with pytest.raises(ValueError, match=r"LayerRecord lacks median_s, reps"):
        records.load_records(_document("backend", {k: v for k, v in LAYER.items() if k not in ("median_s", "reps")}))
    with pytest.raises(ValueError, match=r"unknown kind 'jitter'"):
        records.load_records(_document("backend", {**LAYER, "kind": "jitter"}))
    with pytest.raises(ValueError, match=r"no kind, and no record class for benchmark 'mystery'"):
        records.load_records(_document("mystery", {"world_size": 2}))


def test_records_without_a_kind_take_the_class_of_their_benchmark():
    training = json.loads((BENCHMARKS / "results" / "training.json").read_text())
    renamed = {**training, "benchmark": "cifar100_resnet18"}
    with pytest.raises(ValueError):
        records.load_records(renamed)
    assert records.load_records(renamed, without_kind=records.TrainingRecord) == records.load_records(training)


def test_optional_fields_are_left_out_when_none_and_required_ones_written():
    record = records.DdpRecord(
        world_size=2,
        model="net",
        batch_per_rank=64,
        accumulation=1,
        candidate="torch",
        impl="torch",
        median_step_s=0.1,
        p25_step_s=0.1,
        p75_step_s=0.1,
        steps_timed=4,
        peak_memory_bytes=1,
        reducer_stats=None,
        max_param_diff_vs_torch_after_2_steps=0.0,
    )
    data = record.to_dict()
    assert data["reducer_stats"] is None and data["max_param_diff_vs_torch_after_2_steps"] == 0.0
    assert not {"kind", "algorithm", "backend", "env", "max_param_diff_vs_torch_gloo_after_2_steps"} & data.keys()
    assert dataclasses.replace(record, kind="ddp").to_dict()["kind"] == "ddp"
    with pytest.raises(dataclasses.FrozenInstanceError):
        record.model = "resnet18"


def test_training_records_say_which_batch_norm_ran():
    # The committed training.json names the BatchNorm each pipeline ran (like for like on CPU, where
    # torch has no SyncBatchNorm: both DDPs on plain BatchNorm, ddpkit's SyncBatchNorm a row of its own).
    by_candidate = {r.candidate: r for r in records.load_records(BENCHMARKS / "results" / "training.json")}
    assert by_candidate["torch"].batch_norm == "BatchNorm" and not by_candidate["torch"].synchronized
    assert by_candidate["torch"].label == "torch DDP, plain BatchNorm"
    assert by_candidate["ddpkit"].label == "ddpkit DDP, plain BatchNorm"
    assert by_candidate["ddpkit_sync_bn"].label == "ddpkit DDP, ddpkit.SyncBatchNorm"
    record = by_candidate["torch"]
    assert (
        dataclasses.replace(record, sync_bn=True, batch_norm="torch.nn.SyncBatchNorm").label
        == "torch DDP, torch.nn.SyncBatchNorm"
    )
    # Records from before batch_norm was recorded: torch's CPU pipeline said sync_bn True beside its
    # note that it ran plain BatchNorm.
    older = dataclasses.replace(
        record, sync_bn=True, batch_norm=None, notes=["torch.nn.SyncBatchNorm needs CUDA: plain BatchNorm on CPU"]
    )
    assert not older.synchronized and older.label == "torch DDP, plain BatchNorm"
    assert "batch_norm" not in older.to_dict()
