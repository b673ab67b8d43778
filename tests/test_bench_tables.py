"""Every table a benchmark prints fits a 100-column terminal or log, shown on the committed results."""

import contextlib
import io
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
sys.path.insert(0, str(REPO / "benchmarks"))
import allreduce_summary  # noqa: E402
import bench_backend  # noqa: E402
import bench_ddp  # noqa: E402
import bench_syncbn  # noqa: E402
import bench_torch_stack  # noqa: E402
import bench_training  # noqa: E402
import common  # noqa: E402
from records import TrainingRecord, load_records  # noqa: E402


def training(records, summary):
    # Results written before the blocks were timed lack the ratio's spread and the machine's load.
    spread = common.ratio_spread([0.81, 0.83, 0.8, 0.82])
    summary = {**summary, "time_ratio": spread, "machine_load": {"others_cpu_fraction": None}}
    summary["ddpkit_sync_bn_vs_torch"] = {**summary.get("ddpkit_sync_bn_vs_torch", {}), "time_ratio": spread}
    records = [TrainingRecord.from_dict(r.to_dict()) for r in records]
    bench_training.print_comparison(records, {r.candidate: r for r in records}, summary)


PRINTERS = {
    "allreduce": lambda records, summary: allreduce_summary.print_summary(
        records, allreduce_summary.summarize(records)
    ),
    "syncbn": lambda records, summary: bench_syncbn.print_summary(records, summary, cuda=False),
    "syncbn_cuda": lambda records, summary: bench_syncbn.print_summary(records, summary, cuda=True),
    "ddp": lambda records, summary: bench_ddp.print_summary(records, reference="torch"),
    "backend": lambda records, summary: bench_backend.print_summary(records),
    "torch_stack": lambda records, summary: bench_torch_stack.print_summary(records),
    "training": training,
}


@pytest.mark.parametrize("name", [name for name in PRINTERS if (RESULTS / f"{name}.json").exists()])
def test_printed_tables_fit_100_columns(name, monkeypatch):
    tables = []
    original = common.print_table

    def capturing(*args, **kwargs):
        with contextlib.redirect_stdout(io.StringIO()) as out:
            original(*args, **kwargs)
        tables.append(out.getvalue())

    monkeypatch.setattr(common, "print_table", capturing)
    monkeypatch.setattr(bench_syncbn, "print_table", capturing)
    document = json.loads((RESULTS / f"{name}.json").read_text())
    records = load_records(document, without_kind=TrainingRecord if name == "training" else None)
    with contextlib.redirect_stdout(io.StringIO()):
        PRINTERS[name](records, document["summary"])
    assert tables
    wide = [line for table in tables for line in table.splitlines() if len(line) > common.TABLE_WIDTH]
    assert not wide, "\n".join(wide)
