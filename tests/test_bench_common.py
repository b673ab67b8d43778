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
    rows = [
        {"candidate": "ddpkit", "median_s": 42e-6, "memory": 3 * 2**20, "ratio": 0.5},
        {"candidate": "torch", "median_s": 1.5, "memory": None, "ratio": 1.0},
    ]
    common.print_table(
        rows,
        ["candidate", "median_s", "memory", "ratio"],
        align_left={"candidate"},
        headers={"median_s": "median"},
        formats={"median_s": common.seconds, "memory": common.mebibytes, "ratio": common.times},
    )
    assert capsys.readouterr().out.splitlines() == [
        "candidate   median   memory   ratio",
        "ddpkit     42.0 µs  3.0 MiB  0.500x",
        "torch       1.50 s           1.000x",
    ]
    assert [common.seconds(s) for s in (2e-6, 2e-3, 2.0)] == ["2.0 µs", "2.00 ms", "2.00 s"]


def test_a_wide_table_is_printed_in_parts_that_fit_and_repeat_the_row_names(capsys):
    columns = ["ranks", "candidate", *(f"column_{i}" for i in range(12))]
    rows = [
        {"ranks": n, "candidate": name, **{f"column_{i}": 1000.0 * i for i in range(12)}}
        for n in (2, 4)
        for name in ("ddpkit", "gloo")
    ]
    common.print_table(rows, columns, align_left={"candidate"}, keys=2)
    lines = capsys.readouterr().out.splitlines()
    assert max(map(len, lines)) <= common.TABLE_WIDTH
    parts = "\n".join(lines).split("\n\n")
    assert len(parts) > 1
    for part in parts:
        header, *body = part.splitlines()
        assert header.split()[:2] == ["ranks", "candidate"]
        assert [row.split()[:2] for row in body] == [["2", "ddpkit"], ["2", "gloo"], ["4", "ddpkit"], ["4", "gloo"]]
    shown = [title for part in parts for title in part.splitlines()[0].split()[2:]]
    assert shown == columns[2:]  # every column once, in order


def test_the_median_interval_is_the_binomial_one():
    assert common.median_interval(range(1, 11)) == (2, 9)  # n = 10: the 2nd and 9th of the sorted values
    assert common.median_interval([3, 1, 2]) == (1, 3)  # too few values for 95%: their whole range
    spread = common.ratio_spread([0.9, 0.8, 1.0, 0.85, 0.95, 0.9, 0.88, 0.92, 0.87, 0.91])
    assert spread["median"] == 0.9 and spread["pairs"] == 10 and spread["low"] <= 0.9 <= spread["high"]
    many = {"pairs": 40, "confidence": 0.95}
    assert "includes 1.0" in common.verdict({**many, "low": 0.9, "high": 1.1}, "ddpkit", "torch")
    assert common.verdict({**many, "low": 0.8, "high": 0.9}, "ddpkit", "torch") == "ddpkit faster"
    assert common.verdict({**many, "low": 1.1, "high": 1.2}, "ddpkit", "torch") == "ddpkit slower"
    few = common.ratio_spread([0.8, 0.9])  # no interval from two pairs: no verdict either
    assert "too few pairs" in common.verdict(few, "ddpkit", "torch") and "no interval" in common.spread_text(few)


def test_the_machine_load_counts_others_work_not_ours():
    load = common.MachineLoad()
    load.start()
    sum(i * i for i in range(2_000_000))  # our own work: not the others'
    result = load.stop()
    assert set(result) >= {"others_cpu_fraction", "steal_fraction", "load_average_1m_max", "loaded", "cpus"}
    assert result["others_cpu_fraction"] is None or 0 <= result["others_cpu_fraction"] <= 1
    assert common.load_text({**result, "loaded": True}).startswith("the machine was loaded")


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
