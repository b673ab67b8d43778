"""The package notebooks/report_analysis on its own: provenance, formatting and sections on small synthetic
results, with no notebook and no kernel (tests/test_report.py executes the notebook)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import IPython.display
import matplotlib.pyplot as plt
import pytest

from notebooks import report_analysis as analysis
from notebooks.report_analysis import data_parallel, formatting, hosts, torch_backend
from notebooks.report_analysis.results import commit_of, provenance_problem, report_commit

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def shown(monkeypatch):
    """What the module displays, in order: the IPython objects (Markdown, HTML) and, for each plt.show, the
    figure shown (then closed)."""
    shown = []
    monkeypatch.setattr(IPython.display, "display", shown.append)  # where report_analysis.output sends them

    def show(*args, **kwargs):
        shown.append(plt.gcf())
        plt.close("all")

    monkeypatch.setattr(plt, "show", show)
    return shown


def text(shown) -> str:
    return "\n".join(item.data for item in shown if hasattr(item, "data"))


def environment(commit="c0ffee", date="2026-01-01T10:00:00", **fields):
    return {"environment": {"git_commit": commit, "date": date, "command": "python bench.py", **fields}}


def results(**documents):
    """R with every expected result of commit c0ffee, and ``documents`` over them."""
    return {**{name: environment() for name in analysis.EXPECTED}, **documents}


def test_importing_reads_and_draws_nothing(tmp_path):
    script = (
        "import matplotlib; matplotlib.use('Agg'); import matplotlib.pyplot as plt; "
        "import notebooks.report_analysis; assert not plt.get_fignums()"
    )
    env = {**os.environ, "DDPKIT_REPORT_RESULTS": str(tmp_path / "absent")}
    subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, check=True)


def test_results_folder_is_the_environment_s_or_the_repository_s(monkeypatch, tmp_path):
    monkeypatch.delenv("DDPKIT_REPORT_RESULTS", raising=False)
    assert analysis.results_folder() == REPO / "benchmarks" / "results"
    monkeypatch.setenv("DDPKIT_REPORT_RESULTS", str(tmp_path))
    assert analysis.results_folder() == tmp_path


def test_load_results_reads_every_expected_result_and_the_optional_ones_present(tmp_path):
    committed = REPO / "benchmarks" / "results"
    for name in analysis.EXPECTED + ["latency"]:
        shutil.copy(committed / f"{name}.json", tmp_path)
    R = analysis.load_results(tmp_path)
    assert list(R) == analysis.EXPECTED + ["latency"]
    assert all(hasattr(record, "to_dict") for record in R["allreduce"]["records"])  # typed by records.py
    (tmp_path / "ddp.json").unlink()
    with pytest.raises(FileNotFoundError):
        analysis.load_results(tmp_path)


def test_commit_of_splits_off_the_dirty_mark():
    assert commit_of(environment("abc123")) == ("abc123", False)
    assert commit_of(environment("abc123-dirty")) == ("abc123", True)
    assert commit_of(environment(None)) == ("unknown", False)


def test_the_report_commit_is_the_one_of_most_expected_results():
    first, *others = analysis.EXPECTED
    R = results(**{first: environment("badbeef")}, latency=environment("badbeef"))  # optional ones do not count
    assert report_commit(R) == "c0ffee"
    R = results(**{name: environment("badbeef-dirty") for name in others[:4]})
    assert report_commit(R) == "badbeef"  # a dirty tree still counts for its commit


def test_a_tie_goes_to_the_commit_of_the_latest_result():
    half = len(analysis.EXPECTED) // 2
    older = {name: environment("older", "2026-01-01T10:00:00") for name in analysis.EXPECTED[:half]}
    newer = {name: environment("newer", "2026-01-02T10:00:00") for name in analysis.EXPECTED[half:]}
    assert report_commit({**older, **newer}) == "newer"
    # whichever results come first in the list
    older = {name: environment("older", "2026-01-01T10:00:00") for name in analysis.EXPECTED[half:]}
    newer = {name: environment("newer", "2026-01-02T10:00:00") for name in analysis.EXPECTED[:half]}
    assert report_commit({**older, **newer}) == "newer"


def test_provenance_problem_names_another_commit_and_a_dirty_tree():
    R = results(
        ddp=environment("c0ffee-dirty"), backend=environment("badbeef1234567"), training=environment("badbeef-dirty")
    )
    assert provenance_problem(R, "allreduce") is None
    assert provenance_problem(R, "ddp") == (
        "the tree it was measured from had uncommitted changes, so no commit holds the code that produced it"
    )
    assert provenance_problem(R, "backend") == (
        "it was measured at commit `badbeef123`, not at `c0ffee` like this report"
    )
    assert provenance_problem(R, "training").startswith(
        "it was measured at commit `badbeef`, not at `c0ffee` like this report and the tree it was"
    )


def test_provenance_states_the_commit_and_warns_once_per_problem(shown):
    analysis.provenance(results())
    assert "These results were measured at commit `c0ffee`" in text(shown)
    assert "Every result comes from that commit" in text(shown) and "⚠" not in text(shown)
    shown.clear()
    analysis.provenance(results(ddp=environment("c0ffee-dirty")))
    assert text(shown).count("⚠") == 1 and "`ddp.json`: the tree it was measured from" in text(shown)
    assert "Every result comes from that commit" not in text(shown)


@pytest.mark.parametrize(
    "format, value, expected",
    [
        (formatting.us, 12.4e-6, "12 µs"),
        (formatting.us_tenths, 12.34e-6, "12.3 µs"),
        (formatting.ms, 0.01234, "12.3 ms"),
        (formatting.step_time, 0.0015, "1.5 ms"),
        (formatting.step_time, 0.00099, "990 µs"),
        (formatting.call_time, 2.5e-6, "2.5 µs"),
        (formatting.call_time, 0.00125, "1.25 ms"),
        (formatting.mib, 3 * 2**20, "3.0 MiB"),
        (formatting.kib, 2048, "2 KiB"),
        (formatting.ratio, 0.854, "0.85×"),
        (formatting.floats, 1000, "1k"),
        (formatting.floats, 16_000_000, "16M"),
        (formatting.floats, 100_000, "100k"),
        (formatting.floats, 1500, "1,500"),
        (formatting.floats, 999, "999"),
        (formatting.minute, "2026-01-02T03:04:05.6", "2026-01-02 03:04"),
    ],
)
def test_formats(format, value, expected):
    assert format(value) == expected


def test_html_table_formats_by_column_and_leaves_missing_values_empty():
    rows = [{"a": 1.23456, "b": 2e-6, "c": "x"}, {"a": None, "b": 1e-3}]
    html = formatting.html_table(rows, ["c", "a", "b"], {"b": formatting.us})
    assert html == (
        "<table><thead><tr><th>c</th><th>a</th><th>b</th></tr></thead><tbody>"
        "<tr><td>x</td><td>1.23</td><td>2 µs</td></tr><tr><td></td><td></td><td>1000 µs</td></tr>"
        "</tbody></table>"
    )


def ddp_step(candidate, median, p25, p75, model="resnet", accumulation=1):
    return SimpleNamespace(
        candidate=candidate,
        model=model,
        accumulation=accumulation,
        median_step_s=median,
        p25_step_s=p25,
        p75_step_s=p75,
    )


def test_below_floor_is_none_unless_a_step_is_faster_than_the_floor():
    assert (
        data_parallel.below_floor([ddp_step("floor", 0.010, 0.009, 0.011), ddp_step("ddpkit", 0.012, 0.011, 0.013)])
        is None
    )
    assert data_parallel.below_floor([ddp_step("ddpkit", 0.005, 0.004, 0.006)]) is None  # no floor measured


def test_below_floor_tells_a_tie_from_a_difference():
    floor = ddp_step("floor", 0.010, 0.009, 0.011)
    tie = data_parallel.below_floor(
        [floor, ddp_step("torch_ddpkit", 0.0095, 0.0090, 0.0120)], names={"torch_ddpkit": "torch DDP on ddpkit"}
    )
    assert tie.startswith(
        "Below the floor: `torch DDP on ddpkit` resnet, accumulation 1: 9.5 ms (middle half "
        "9.0 ms–12.0 ms) against the floor's 10.0 ms (9.0 ms–11.0 ms)."
    )
    assert "In every case the middle halves of the repetitions overlap" in tie
    apart = data_parallel.below_floor([floor, ddp_step("ddpkit", 0.005, 0.004, 0.006)])
    assert "In 1 of them the middle halves do not overlap" in apart


def test_target_row_is_decided_by_the_worst_point():
    row = hosts.target_row("t", {"1k": 0.4, "16M": 0.7}, 0.6, ["1k", "1M", "16M"])
    assert (row["result"], row["worst"], row["measured at"], row["not measured at"]) == (
        "not met",
        "0.70× (16M)",
        "1k, 16M",
        "1M",
    )
    assert hosts.target_row("t", {"1k": 0.4}, 0.6)["result"] == "met"
    row = hosts.target_row("t", {}, 0.6, ["1k"])
    assert (row["result"], row["worst"], row["measured at"]) == ("not measured", "", "—")


def test_skip_reasons_and_code_spans():
    assert torch_backend.skip_reason("Need at least 2 CUDA devices") == "CUDA"
    assert torch_backend.skip_reason("NCCL only") == "NCCL or MPI only"
    assert torch_backend.skip_reason("Test requires world size of 4") == "another world size"
    assert torch_backend.skip_reason("see https://github.com/pytorch/pytorch/issues/1") == "disabled upstream"
    assert torch_backend.skip_reason("no reason") == "other"
    assert formatting.code_html("`a<b` & c") == "<code>a&lt;b</code> &amp; c"


def test_collective_checks_on_a_synthetic_result(shown):
    R = results(
        allreduce_checks={
            **environment(),
            "records": [],
            "summary": {
                "checked_over_unchecked": {"n=2 numel=1000": 1.2, "n=4 numel=1000": 1.1, "n=8 numel=1000": 1.6}
            },
        }
    )
    analysis.collective_checks(R)
    assert shown[0].data == "Produced by `python bench.py` on 2026-01-01 10:00 UTC."
    assert "<td>n=2 numel=1000</td><td>1.20×</td>" in shown[1].data
    assert "cost a median 1.20× (range 1.10–1.60×)" in shown[2].data
    assert len(shown) == 3


def test_a_section_warns_about_a_result_of_another_commit(shown):
    R = results(
        allreduce_checks={
            **environment("badbeef"),
            "records": [],
            "summary": {"checked_over_unchecked": {"n=2 numel=1000": 1.2}},
        }
    )
    analysis.collective_checks(R)
    assert "⚠ `allreduce_checks.json`: it was measured at commit `badbeef`" in text(shown)
    assert "Run `bash benchmarks/run_all.sh` on a clean checkout" in text(shown)


def test_allreduce_memory_draws_one_line_per_candidate_at_the_largest_size(shown):
    records = [
        SimpleNamespace(kind="memory", candidate=c, numel=numel, world_size=n, peak_memory_increase_bytes=n * numel * 4)
        for c in ("ddpkit", "gloo")
        for numel in (1000, 4_000_000)
        for n in (2, 4)
    ]
    analysis.allreduce_memory(results(allreduce={**environment(), "records": records}))
    (figure,) = shown
    (ax,) = figure.axes
    assert [line.get_label() for line in ax.get_lines()] == ["ddpkit", "gloo"]
    assert list(ax.get_lines()[0].get_xdata()) == [2, 4]
    assert "4,000,000 floats" in ax.get_title()


@pytest.mark.parametrize(
    "section, sentence",
    [
        (analysis.latency, "No `latency.json` in this results folder"),
        (analysis.gpu, "No GPU results in this results folder (`syncbn_cuda.json`, `ddp_cuda.json`)."),
        (analysis.multihost, "No `multihost.json` in this results folder"),
        (analysis.torch_stack, "No `torch_stack.json` in this results folder"),
        (analysis.multihost_hosts, "No `multihost_hosts.json` in this results folder"),
        (analysis.multihost_unshaped, "No `multihost_unshaped.json` in this results folder"),
        (analysis.compression, "No `compression.json` in this results folder"),
        (analysis.fault_tolerance_hosts, "No `fault_tolerance_hosts.json` in this results folder"),
        (analysis.multihost_delayed, "No `multihost_delayed.json` in this results folder"),
        (analysis.multihost_delayed_4x1, "No `multihost_delayed_4x1_16M.json` in this results folder"),
        (analysis.fault_tolerance_hosts_delayed, "No `fault_tolerance_hosts_delayed.json` in this results folder"),
    ],
)
def test_a_missing_optional_result_is_one_sentence(shown, section, sentence):
    section(results())
    assert len(shown) == 1 and shown[0].data.startswith(sentence)


def test_a_delayed_link_is_named_in_words():
    assert analysis.hosts.link_label("1gbit-10ms") == "1 Gbit/s, 10 ms round trip"
    assert analysis.hosts.link_label("unshaped-2.5ms") == "unshaped link, 2.5 ms round trip"
    assert analysis.hosts.link_label("10gbit") == "10 Gbit/s"
    assert analysis.hosts.link_label("1gbit-10ms-reno") == "1 Gbit/s, 10 ms round trip, reno in the hosts"


def test_the_multihost_targets_show_nothing_without_the_result(shown):
    analysis.multihost_targets(results())
    assert shown == []


def test_torch_suite_missing_is_a_sentence_naming_the_file(shown, tmp_path):
    analysis.torch_suite(REPO / "docs" / "absent.json")
    assert shown[0].data.startswith("No `docs/absent.json`, so torch's own distributed test suite")
    shown.clear()
    analysis.torch_suite(tmp_path / "absent.json")
    assert f"No `{tmp_path / 'absent.json'}`" in shown[0].data


def test_torch_suite_on_a_synthetic_suite(shown, tmp_path):
    def run(**outcomes):
        return {
            "records": {name: {"outcome": outcome, "summary": f"{outcome} `x`"} for name, outcome in outcomes.items()},
            "counts": {"passed": sum(o == "passed" for o in outcomes.values())},
            "seconds": 120,
        }

    suite = {
        "tests": 3,
        "world_size": 2,
        "date": "2026-01-01T10:00:00",
        "git_commit": "c0ffee",
        "ddpkit_commit": "c0ffee",
        "torch_version": "2.11",
        "runs": {"gloo": run(a="passed", b="passed", c="skipped"), "ddpkit": run(a="passed", b="failed", c="skipped")},
        "differences": [{"test": "b", "reason": "uses `gloo` internals", "kind": "torch"}],
    }
    (tmp_path / "suite.json").write_text(json.dumps(suite))
    analysis.torch_suite(tmp_path / "suite.json")
    out = text(shown)
    assert 'gloo passes 2 tests and "ddpkit" 1: 1 pass on gloo only, none on "ddpkit" only.' in out
    assert "<td>uses <code>gloo</code> internals</td><td>torch's own code</td>" in out
    assert "Skipped on both backends: 1 tests, by the reason the suite gives: other 1" in out
