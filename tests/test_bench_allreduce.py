"""The pure parts of benchmarks/bench_allreduce.py (with its allreduce_candidates.py, allreduce_peers.py and
allreduce_summary.py) and benchmarks/peers/timing.py (no timing is asserted)."""

import argparse
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import allreduce_candidates as candidates  # noqa: E402
import allreduce_peers  # noqa: E402
import allreduce_summary  # noqa: E402
import bench_allreduce  # noqa: E402
from peers import timing  # noqa: E402


def test_settle_runs_whole_batches_until_every_rank_agrees():
    calls, asked = [], []

    def agree(done):  # another rank's clock: agreement comes at the third check, whatever this rank says
        asked.append(done)
        return len(asked) == 3

    timing.settle(lambda: calls.append(1), agree, calls_per_check=5, seconds=3600)
    assert len(calls) == 15 and asked == [False, False, False]
    calls.clear()
    asked.clear()
    timing.settle(lambda: calls.append(1), lambda done: asked.append(done) or done, calls_per_check=2, seconds=0)
    assert len(calls) == 2 and asked == [True]


def test_candidates_that_spin_and_sleep_run_in_separate_processes():
    assert candidates.process_sets(["ddpkit", "ddpkit_ring_pg", "gloo", "floor"]) == [
        ["ddpkit"],
        ["ddpkit_ring_pg", "gloo", "floor"],
    ]
    assert candidates.process_sets(["ddpkit:ring:shm", "ddpkit:ring:shm:unchecked", "gloo"]) == [
        ["ddpkit:ring:shm", "ddpkit:ring:shm:unchecked"],
        ["gloo"],
    ]
    assert candidates.process_sets(["gloo"]) == [["gloo"]]


def test_merge_keeps_points_of_either_run():
    a = [{"times": {("ddpkit", 1): [1.0]}, "accuracy": {("ddpkit", 1): 0.1}, "cpus": {("ddpkit", 1): [0]}}]
    b = [
        {
            "times": {("ddpkit", 1): [2.0], ("gloo", 1): [3.0]},
            "accuracy": {("ddpkit", 1): 0.3, ("gloo", 1): 0.2},
            "cpus": {("ddpkit", 1): [1], ("gloo", 1): [0]},
        }
    ]
    assert bench_allreduce.merge(a, b) == [
        {
            "times": {("ddpkit", 1): [1.0, 2.0], ("gloo", 1): [3.0]},
            "accuracy": {("ddpkit", 1): 0.3, ("gloo", 1): 0.2},
            "cpus": {("ddpkit", 1): [0, 1], ("gloo", 1): [0]},
        }
    ]


def test_reps_sharing_a_cpu_counts_ranks_doubled_up():
    # two ranks on 2 CPUs: the second repetition began with both on CPU 1
    assert bench_allreduce.reps_sharing_a_cpu([[0, 1, 1], [1, 1, 0]], cpus=2) == 1
    # four ranks on 2 CPUs share them always, which is not counted; on one CPU they are
    assert bench_allreduce.reps_sharing_a_cpu([[0, 0], [1, 0], [0, 0], [1, 0]], cpus=2) == 1


def test_batch_and_reps_plan():
    assert [timing.batch_size(n) for n in (1_000, 10_000, 100_000, 1_000_000, 64_000_000)] == [16, 16, 4, 1, 1]
    assert timing.reps_for(1_000, 2, 30) == 30
    assert timing.reps_for(1_000_000, 2, 30) == 15
    assert timing.reps_for(16_000_000, 8, 30) == 7
    assert timing.reps_for(64_000_000, 8, 30) == 5
    assert timing.reps_for(1_000, 32, 30) == 7
    assert timing.reps_for(64_000_000, 8, 5) == 3  # never fewer than 3 ...
    assert timing.reps_for(1_000, 2, 2) == 2  # ... unless fewer were asked for
    assert timing.split_reps(7, 2) == [4, 3] and timing.split_reps(1, 2) == [1]


def test_plan_reps_cuts_to_the_budget():
    assert timing.plan_reps(0.01, 30, None) == (30, False)
    assert timing.plan_reps(0.01, 30, 5.0) == (30, False)
    assert timing.plan_reps(1.0, 30, 5.0) == (5, True)
    assert timing.plan_reps(60.0, 30, 5.0) == (1, True)  # at least one repetition


def test_stats_and_bus_bandwidth():
    assert timing.slowest_per_rep([[1.0, 5.0, 3.0], [2.0, 1.0, 3.5]]) == [2.0, 5.0, 3.5]
    with pytest.raises(ValueError):
        timing.slowest_per_rep([[1.0], [1.0, 2.0]])
    stats = timing.time_stats([4.0, 1.0, 3.0, 2.0, 5.0])
    assert stats == {"median_s": 3.0, "p25_s": 2.0, "p75_s": 4.0, "reps": 5}
    assert timing.bus_bandwidth_GBps(4_000_000, 0.001, 2) == pytest.approx(4.0)
    assert timing.bus_bandwidth_GBps(4_000_000, 0.001, 4) == pytest.approx(6.0)
    assert timing.bus_bandwidth_GBps(4_000_000, 0.001, 1) is None


def test_candidate_names():
    assert candidates.parse_candidate("ddpkit").algorithm == "auto"
    assert candidates.parse_candidate("ddpkit").transport is None  # ddpkit's default, whatever it is
    ring = candidates.parse_candidate("ddpkit_ring_pg")
    assert (ring.algorithm, ring.effective_transport) == ("ring", "process_group")
    unchecked = candidates.parse_candidate("ddpkit:auto:process_group:unchecked")
    assert (unchecked.algorithm, unchecked.transport, unchecked.checked) == ("auto", "process_group", False)
    assert candidates.parse_candidate("ddpkit:ring:default").transport is None
    assert candidates.parse_candidate("mpich").implementation == "mpich"
    with pytest.raises(argparse.ArgumentTypeError):
        candidates.parse_candidate("nccl")
    if not candidates.HAS_TRANSPORT:  # no candidate may claim a transport this ddpkit does not have
        with pytest.raises(argparse.ArgumentTypeError):
            candidates.parse_candidate("ddpkit:ring:shm")


def _record(n, numel, candidate, median, cut_off=False):
    """A time record of one repetition at ``median`` seconds (None: not measured)."""
    parsed = candidates.parse_candidate(candidate)
    if median is None:
        return candidates.time_record(
            parsed, n, numel, [], status="not measured: test", batch=1, cut_off=cut_off, max_abs_error_of_mean=None
        )
    return candidates.time_record(
        parsed, n, numel, [median], batch=1, reps_planned=1, cut_off=cut_off, max_abs_error_of_mean=None
    )


def test_summary_bars():
    records = []
    for n in (2, 4, 8):
        for numel in candidates.GRID_SIZES:
            records += [
                _record(n, numel, "gloo", 1.0),
                _record(n, numel, "ddpkit", 0.1 if n < 8 else 0.25),
                _record(n, numel, "floor", 0.05),
            ]
    records += [
        _record(2, 1_000, "mpich", 0.05),
        _record(2, 1_000, "deepspeed", 0.02),
        _record(2, 1_000, "ddpkit:ring:process_group", 2.0),
        _record(2, 1_000, "ddpkit:ring:process_group:unchecked", 1.6),
        _record(4, 64_000_000, "mpich", None, cut_off=True),
    ]
    summary = allreduce_summary.summarize(records)
    assert summary["ddpkit_over_gloo_max"] == pytest.approx(0.25)
    assert summary["ddpkit_over_gloo_bar_met"] is False
    assert "n=8 numel=64000000" not in summary["ddpkit_over_gloo"]  # the bar stops at 16M
    assert summary["ddpkit_over_best_peer_n2"] == {
        "numel=1000": {"ratio": pytest.approx(5.0), "best_peer": "deepspeed"}
    }
    assert set(summary["ddpkit_over_floor_n2"]) == {"numel=1000000", "numel=16000000", "numel=64000000"}
    assert summary["ddpkit_over_floor_bar_met"] is True
    assert summary["checked_over_unchecked"] == {"ddpkit:ring:process_group ws=2 n=1000": pytest.approx(1.25)}
    assert summary["cut_off_points"] == ["mpich n=4 numel=64000000"]


def test_a_quick_run_is_summarized_as_the_grid_it_ran(capsys):
    records = [
        _record(n, numel, candidate, median)
        for n in (2, 4)
        for numel in (1_000, 100_000, 1_000_000)
        for candidate, median in (("gloo", 1.0), ("ddpkit", 0.1))
    ]
    summary = allreduce_summary.summarize(records)
    assert summary["ddpkit_over_gloo_measured"] == "n in {2, 4} x 1k-1M floats"
    assert summary["ddpkit_over_gloo_bar_met"] is None  # within the target where run, but 6 of its 15 points
    allreduce_summary.print_summary(records, summary)
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("ddpkit / gloo"))
    assert line.startswith("ddpkit / gloo at n in {2, 4} x 1k-1M floats: worst 0.100x"), line
    assert line.endswith("; target <= 0.2x at n in {2, 4, 8} x 1k-16M floats: not checked, 6 of its 15 points run")
    assert (
        allreduce_summary.grid_text([(2, 1_000), (4, 1_000), (2, 10_000)])
        == "n in {2, 4} x 1k-10k floats (3 of those points)"
    )


def test_peer_records_keep_missing_points():
    points = [
        {
            "numel": 1_000,
            "world_size": 4,
            "times_s": [3e-6, 1e-6, 2e-6],
            "batch": 16,
            "reps_planned": 30,
            "cut_off": True,
            "warmup_s": 4e-6,
            "max_abs_error_of_mean": 1e-7,
            "library": "MPICH 4.1.2",
        }
    ]
    records = allreduce_peers.peer_records("mpich", 4, [1_000, 64_000_000], points, "job time limit (250 s)")
    measured, missing = records
    assert measured.median_s == 2e-6 and measured.cut_off and measured.reps == 3
    assert measured.bus_bandwidth_GBps == pytest.approx(4000 / 2e-6 * 1.5 / 1e9)
    assert (measured.library, measured.status) == ("MPICH 4.1.2", "measured")
    assert missing.median_s is None and missing.status == "not measured: job time limit (250 s)"
    assert "reps_planned" not in missing.to_dict() and missing.to_dict()["bus_bandwidth_GBps"] is None


def test_a_peers_jobs_pool_their_repetitions_per_size():
    def point(numel, times, cut_off=False, error=1e-7):
        return {
            "numel": numel,
            "world_size": 2,
            "times_s": times,
            "batch": 16,
            "reps_planned": len(times),
            "cut_off": cut_off,
            "warmup_s": 4e-6,
            "max_abs_error_of_mean": error,
            "library": "MPICH 4.1.2",
        }

    first = [point(1_000, [1e-6, 2e-6]), point(10_000, [5e-6])]
    second = [point(1_000, [3e-6], cut_off=True, error=2e-7), point(100_000, [9e-6])]
    merged = {p["numel"]: p for p in allreduce_peers.merge_points(first, second)}
    assert merged[1_000]["times_s"] == [1e-6, 2e-6, 3e-6] and merged[1_000]["reps_planned"] == 3
    assert merged[1_000]["cut_off"] and merged[1_000]["max_abs_error_of_mean"] == 2e-7
    assert merged[10_000]["times_s"] == [5e-6] and merged[100_000]["times_s"] == [9e-6]
    assert first[0]["times_s"] == [1e-6, 2e-6]  # the inputs stay as they were
