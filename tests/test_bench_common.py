"""benchmarks/common.py's interleaving and timing helpers (no timing is asserted)."""

import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import common  # noqa: E402


def test_interleave_rotates_the_order_and_drops_the_warmup():
    calls = []

    def measure_one(name):
        calls.append(name)
        return f"{name}{len(calls)}"

    results = common.interleave(["a", "b", "c"], 2, measure_one, warmup=2)
    assert calls == ["a", "b", "c", "b", "c", "a", "c", "a", "b", "a", "b", "c"]
    assert results == {"a": ["a8", "a10"], "b": ["b9", "b11"], "c": ["c7", "c12"]}


def test_interleave_without_warmup_keeps_every_repetition():
    results = common.interleave(("x", "y"), 3, lambda name: name)
    assert results == {"x": ["x"] * 3, "y": ["y"] * 3}
    assert common.interleave(["only"], 0, lambda name: 1 / 0) == {"only": []}


def test_time_per_call_makes_the_calls_back_to_back():
    seen = []
    seconds = common.time_per_call(seen.append, "call", calls=5)
    assert seen == ["call"] * 5
    assert isinstance(seconds, float)


def test_a_smoke_run_never_writes_where_the_measured_results_are(monkeypatch, tmp_path):
    monkeypatch.delenv("DDPKIT_RESULTS_DIR", raising=False)
    assert common.results_dir(quick=False) == BENCHMARKS / "results"
    assert common.results_dir(quick=True) == BENCHMARKS / "results" / "quick"
    monkeypatch.setenv("DDPKIT_RESULTS_DIR", str(tmp_path))
    assert common.results_dir(quick=True) == common.results_dir(quick=False) == tmp_path


def test_tables_print_values_with_their_units(capsys):
    rows = [{"candidate": "ddpkit", "median_s": 42e-6, "memory": 3 * 2**20, "ratio": 0.5},
            {"candidate": "torch", "median_s": 1.5, "memory": None, "ratio": 1.0}]
    common.print_table(rows, ["candidate", "median_s", "memory", "ratio"], align_left={"candidate"},
                       headers={"median_s": "median"},
                       formats={"median_s": common.seconds, "memory": common.mebibytes, "ratio": common.times})
    assert capsys.readouterr().out.splitlines() == [
        "candidate   median   memory   ratio",
        "ddpkit     42.0 µs  3.0 MiB  0.500x",
        "torch       1.50 s           1.000x",
    ]
    assert [common.seconds(s) for s in (2e-6, 2e-3, 2.0)] == ["2.0 µs", "2.00 ms", "2.00 s"]


def test_a_commit_is_dirty_for_changed_code_not_for_the_results_the_benchmarks_write(monkeypatch, tmp_path):
    # run_all.sh writes the results one after the other: each must still name the clean commit.
    import subprocess

    def git(*args):
        return subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True, text=True).stdout

    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "notebooks").mkdir()
    for path in ("code.py", "benchmarks/results/ddp.json", "notebooks/report.ipynb"):
        (tmp_path / path).write_text("before\n")
    git("init", "-q")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one")
    head = git("rev-parse", "HEAD").strip()
    monkeypatch.setattr(common, "REPO_ROOT", tmp_path)
    monkeypatch.delenv("DDPKIT_GIT_COMMIT", raising=False)
    (tmp_path / "benchmarks" / "results" / "ddp.json").write_text("after\n")
    (tmp_path / "notebooks" / "report.ipynb").write_text("after\n")
    assert common._git_commit() == head
    (tmp_path / "code.py").write_text("after\n")
    assert common._git_commit() == head + "-dirty"
