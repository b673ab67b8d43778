"""The committed benchmark results follow the schema, and the committed report notebook executes."""

import json
import re
from pathlib import Path

import nbformat
import pytest

from notebooks import report
from notebooks import report_analysis as analysis

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
NOTEBOOK = REPO / "notebooks" / "report.ipynb"
ENVIRONMENT_FIELDS = {
    "command",
    "git_commit",
    "date",
    "hostname",
    "torch_version",
    "python_version",
    "backend",
    "device_type",
    "cpu_model",
    "cpu_count",
    "gpu",
}


@pytest.mark.parametrize("name", analysis.EXPECTED + [n for n in analysis.OPTIONAL if (RESULTS / f"{n}.json").exists()])
def test_results_exist_and_follow_the_schema(name):
    document = json.loads((RESULTS / f"{name}.json").read_text())
    assert document["schema_version"] == 1
    assert document["benchmark"] == name
    assert ENVIRONMENT_FIELDS <= document["environment"].keys()
    assert document["environment"]["command"] and document["environment"]["torch_version"]
    assert isinstance(document["settings"], dict) and document["settings"]
    assert isinstance(document["records"], list) and document["records"]
    # A record says how many processes it ran: world_size, or (multihost.json) topology, "<hosts>x<ranks per host>",
    # or (fault_tolerance.json) its measure, whose replica groups of one rank the benchmark fixes (2 steady, 3 kill).
    assert all(
        isinstance(record, dict)
        and (
            "world_size" in record
            or re.fullmatch(r"\d+x\d+", record.get("topology", ""))
            or record.get("measure") in ("steady", "kill")
        )
        for record in document["records"]
    )
    assert isinstance(document["summary"], dict) and document["summary"]


# Run before the report's cells: every figure shown must have a legend entry for each of its lines.
LEGEND_CHECK = r"""
import matplotlib.pyplot as plt
UNLEGENDED = []
_show = plt.show
def _show_checking_legends(*args, **kwargs):
    figure = plt.gcf()
    legends = [*figure.legends, *(axis.get_legend() for axis in figure.axes)]
    labels = {text.get_text() for legend in legends if legend is not None for text in legend.get_texts()}
    for axis in figure.axes:
        for line in axis.get_lines():
            # "_nolegend_": matplotlib's own lines, such as the caps of error bars.
            if len(line.get_xdata()) and line.get_label() != "_nolegend_" and line.get_label() not in labels:
                UNLEGENDED.append(f"{axis.get_title() or axis.get_ylabel()}: {line.get_label()}")
    _show(*args, **kwargs)
plt.show = _show_checking_legends
"""


def outputs_of(notebook):
    return [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.get("outputs", [])]


def text_of(outputs) -> str:
    return "\n".join(
        str(o.get("data", {}).get("text/markdown", "")) + str(o.get("data", {}).get("text/html", "")) for o in outputs
    )


def execute_checked(kernel_folder, results):
    """The committed notebook as run with the kernel in ``kernel_folder`` on ``results``: no error, every figure
    shown has a legend entry for each of its lines, every plot rendered, no timestamps recorded. Its outputs."""
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    notebook.cells.insert(1, nbformat.v4.new_code_cell(LEGEND_CHECK))
    notebook.cells.append(nbformat.v4.new_code_cell("assert not UNLEGENDED, UNLEGENDED"))
    outputs = outputs_of(report.execute(notebook, results, timeout=120, kernel_folder=kernel_folder))
    assert not [o for o in outputs if o.get("output_type") == "error"], [
        o.get("evalue") for o in outputs if o.get("output_type") == "error"
    ]
    assert not [c.id for c in notebook.cells if "execution" in c.metadata], "executing recorded timestamps"
    # every plot rendered: one per section, two in the all-reduce's, one more each for multihost.json,
    # fault_tolerance.json, multihost_hosts.json, multihost_unshaped.json, compression.json (its loss curves),
    # multihost_delayed.json and multihost_delayed_4x1_16M.json where they exist
    optional_plots = (
        "multihost",
        "fault_tolerance",
        "multihost_hosts",
        "multihost_unshaped",
        "compression",
        "multihost_delayed",
        "multihost_delayed_4x1_16M",
    )
    assert sum(1 for o in outputs if "image/png" in o.get("data", {})) == 6 + sum(
        (RESULTS / f"{name}.json").exists() for name in optional_plots
    )
    return outputs


# Jupyter, JupyterLab and VS Code start the kernel in the notebook's own folder (the next test runs it there);
# report.py at the root. Slow (make test-full): test_the_report_warns_about_results_of_other_commits executes the
# same notebook on the same results (but two commits recorded) with the same checks, its kernel in notebooks/,
# where the first cell looks one folder further up for the root than here.
@pytest.mark.slow
def test_committed_notebook_executes_without_errors():
    execute_checked(REPO, RESULTS)


def results_copy(tmp_path, commits: dict, names=None):
    """The committed results (of names: by default every one the report reads) with their recorded commits replaced
    (name -> git_commit; the others: "c0ffee")."""
    tmp_path.mkdir()
    for name in analysis.EXPECTED + analysis.OPTIONAL if names is None else names:
        path = RESULTS / f"{name}.json"
        if not path.exists():
            continue
        document = json.loads(path.read_text())
        document["environment"]["git_commit"] = commits.get(path.stem, "c0ffee")
        (tmp_path / path.name).write_text(json.dumps(document))
    return tmp_path


def test_the_report_warns_about_results_of_other_commits(tmp_path):
    """The committed notebook with the kernel in notebooks/ (as Jupyter's front ends start it), on the committed
    results with other commits recorded: it runs as at the root, and warns."""
    results = results_copy(tmp_path / "mixed", {"ddp": "c0ffee-dirty", "backend": "badbeef"})
    text = text_of(execute_checked(REPO / "notebooks", results))
    assert text.count("These results were measured at commit `c0ffee`") == 1
    assert "`ddp.json`: the tree it was measured from had uncommitted changes" in text
    assert "`backend.json`: it was measured at commit `badbeef`, not at `c0ffee`" in text
    assert text.count("⚠") == 4  # each of the two once at the top and once in its section
    assert "Every result comes from that commit" not in text


def test_the_optional_results_missing_are_a_sentence_each_and_one_commit_is_stated_once(tmp_path):
    notebook = report.execute(report.build(), results_copy(tmp_path / "expected", {}, analysis.EXPECTED), timeout=120)
    outputs = outputs_of(notebook)
    assert not [o for o in outputs if o.get("output_type") == "error"]
    text = text_of(outputs)
    assert text.count("These results were measured at commit `c0ffee`") == 1
    assert "⚠" not in text and "Every result comes from that commit" in text
    assert "No GPU results in this results folder" in text
    assert "No `multihost.json` in this results folder" in text
    assert "No `torch_stack.json` in this results folder" in text
    assert "No `latency.json` in this results folder" in text
    assert "No `fault_tolerance.json` in this results folder" in text
    assert "No `sharding.json` in this results folder" in text
    assert "No `sharding_zero3.json` in this results folder" in text


def test_the_report_reads_only_what_run_all_produces():
    run_all = (REPO / "benchmarks" / "run_all.sh").read_text()
    scripts = {
        "allreduce": "bench_allreduce.py",
        "allreduce_checks": "--output allreduce_checks",
        "syncbn": "bench_syncbn.py",
        "ddp": "bench_ddp.py",
        "training": "bench_training.py",
        "backend": "bench_backend.py",
        "syncbn_cuda": 'bench_syncbn.py "${QUICK[@]}" --device cuda',
        "ddp_cuda": 'bench_ddp.py "${QUICK[@]}" --device cuda',
        "allreduce_16core": "--output allreduce_16core",
        "torch_stack": 'bench_torch_stack.py "${QUICK[@]}"',
        "multihost": 'bench_multihost.py "${QUICK[@]}"',
        "latency": 'bench_latency.py "${QUICK[@]}"',
        "fault_tolerance": 'bench_fault_tolerance.py "${QUICK[@]}"',
        "multihost_hosts": "--output multihost_hosts",
        "multihost_unshaped": "--output multihost_unshaped",
        "compression": 'bench_compression.py "${QUICK[@]}"',
        "fault_tolerance_hosts": "--hosts 4 --link 1gbit",
        "sharding": 'bench_sharding.py "${QUICK[@]}"',
        "multihost_delayed": "--output multihost_delayed\n",
        "multihost_delayed_4x1_16M": "--output multihost_delayed_4x1_16M",
        "fault_tolerance_hosts_delayed": "--name fault_tolerance_hosts_delayed",
        "sharding_zero3": "--output sharding_zero3",
        "sharding_memory": "--output sharding_memory",
    }
    assert set(analysis.EXPECTED + analysis.OPTIONAL) == scripts.keys()
    assert all(command in run_all for command in scripts.values())
    # The one input from outside the results folder: torch's suite, which scripts/run_torch_suite.py writes.
    suite = Path(analysis.SUITE)
    assert f'"{suite.parent}" / "{suite.name}"' in (REPO / "scripts" / "run_torch_suite.py").read_text()
    # Nothing from outside the repository: no absolute path, no option that reads an earlier run's file.
    assert "/tmp" not in run_all and "--ddp-from" not in (REPO / "benchmarks" / "bench_backend.py").read_text()


def test_the_notebook_speaks_plainly():
    # The prose is report.py's cells; the sentences computed when it runs are report_analysis's.
    sources = "\n".join(
        [cell.source for cell in report.build().cells]
        + [path.read_text() for path in sorted(Path(analysis.__file__).parent.glob("*.py"))]
    )
    assert "Note [" not in sources
    assert not re.search(r"\bbars?\b[^(]", sources.replace("ax.bar(", "").replace("time_ax.bar(", "")), (
        "say target, not bar"
    )


def test_the_code_cells_are_calls_into_the_module():
    """No analysis in the notebook's cells: each code cell after the setup is one call of a report_analysis
    function, each function once."""
    code = [cell.source for cell in report.build().cells if cell.cell_type == "code"]
    assert code[0] == report.SETUP
    called = []
    for source in code[1:]:
        match = re.fullmatch(r"analysis\.(\w+)\((R?)\)", source)
        assert match, source
        assert callable(getattr(analysis, match[1])), source
        called.append(match[1])
    assert len(called) == len(set(called))


def test_committed_notebook_is_the_built_one():
    built = report.build()
    committed = nbformat.read(NOTEBOOK, as_version=4)
    assert [(c.id, c.source) for c in committed.cells] == [(c.id, c.source) for c in built.cells], (
        "notebooks/report.ipynb is stale: run python -m notebooks.report"
    )
    assert not [c.id for c in committed.cells if "execution" in c.metadata], "timestamps in the committed report"


def test_a_rebuild_from_the_same_results_leaves_the_file_alone(tmp_path):
    """Running report.py must not dirty the tree when nothing it shows has changed."""
    assert nbformat.writes(report.build()) == nbformat.writes(report.build())  # no random cell ids
    path = tmp_path / "report.ipynb"
    assert report.write_if_changed(report.build(), path)
    before = path.stat().st_mtime_ns
    assert not report.write_if_changed(report.build(), path)
    assert path.stat().st_mtime_ns == before
    changed = report.build()
    changed.cells[0].source += " "
    assert report.write_if_changed(changed, path)
    assert nbformat.read(path, as_version=4).cells[0].source == changed.cells[0].source
