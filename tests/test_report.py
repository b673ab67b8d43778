"""The committed benchmark results follow the schema, and the committed report notebook executes."""

import importlib.util
import json
import shutil
from pathlib import Path

import nbformat
import pytest

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
NOTEBOOK = REPO / "notebooks" / "report.ipynb"
ENVIRONMENT_FIELDS = {"command", "git_commit", "date", "hostname", "torch_version", "python_version", "backend",
                      "device_type", "cpu_model", "cpu_count", "gpu"}


def load_report_module():
    spec = importlib.util.spec_from_file_location("report", REPO / "notebooks" / "report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


report = load_report_module()


@pytest.mark.parametrize("name", report.EXPECTED + [n for n in report.OPTIONAL if (RESULTS / f"{n}.json").exists()])
def test_results_exist_and_follow_the_schema(name):
    document = json.loads((RESULTS / f"{name}.json").read_text())
    assert document["schema_version"] == 1
    assert document["benchmark"] == name
    assert ENVIRONMENT_FIELDS <= document["environment"].keys()
    assert document["environment"]["command"] and document["environment"]["torch_version"]
    assert isinstance(document["settings"], dict) and document["settings"]
    assert isinstance(document["records"], list) and document["records"]
    assert all(isinstance(record, dict) and "world_size" in record for record in document["records"])
    assert isinstance(document["summary"], dict) and document["summary"]


def test_committed_notebook_executes_without_errors(tmp_path):
    copy = tmp_path / "report.ipynb"
    shutil.copy(NOTEBOOK, copy)
    notebook = report.execute(nbformat.read(copy, as_version=4), RESULTS, timeout=120)
    outputs = [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    assert sum(1 for o in outputs if "image/png" in o.get("data", {})) == 6  # every plot rendered


def test_committed_notebook_is_the_built_one():
    built = report.build()
    committed = nbformat.read(NOTEBOOK, as_version=4)
    assert [c.source for c in committed.cells] == [c.source for c in built.cells], \
        "notebooks/report.ipynb is stale: run python notebooks/report.py"
