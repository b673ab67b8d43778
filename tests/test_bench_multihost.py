"""The pure parts of benchmarks/bench_multihost.py (no timing is asserted; the hosts are not started)."""

import importlib.util
import sys
from pathlib import Path

import pytest

from ddpkit.testing import parse_link

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

spec = importlib.util.spec_from_file_location("bench_multihost", BENCHMARKS / "bench_multihost.py")
bench = importlib.util.module_from_spec(spec)
sys.modules["bench_multihost"] = bench
spec.loader.exec_module(bench)


def per_rank(*ranks):
    """Results as case_collective returns them from each rank: candidate -> repetitions (the busiest
    thread's CPU: a fifth of the process's)."""
    return [{"c": [{"seconds": s, "cpu_s": c, "busiest_thread_cpu_s": c / 5} for s, c in rank]} for rank in ranks]


def test_slowest_rank_per_repetition_and_cpu_summed_over_ranks(monkeypatch):
    monkeypatch.setattr(bench.os, "cpu_count", lambda: 2)
    ranks = per_rank([(1.0, 0.5), (2.0, 1.0), (3.0, 0.5)], [(1.5, 1.5), (1.0, 3.0), (2.0, 0.5)])
    assert bench.slowest(ranks, "c") == [1.5, 2.0, 3.0]
    figures = bench.cpu_figures(ranks, "c")
    assert figures["all_ranks_cpu_s"] == 2.0  # median of 2.0, 4.0, 1.0
    assert figures["cpu_busy"] == pytest.approx(2.0 / (1.5 * 2))  # median of 2/3, 1, 1/6
    assert figures["busiest_thread_cpu_s"] == pytest.approx(1.5 / 5)  # the busier rank's per repetition: 1.5, 3.0, 0.5
    with pytest.raises(ValueError, match="different numbers of repetitions"):
        bench.slowest(per_rank([(1.0, 0.0)], [(1.0, 0.0), (1.0, 0.0)]), "c")


def test_the_timed_call_is_the_librarys_own_function(monkeypatch):
    groups = {"gloo": object(), "ddpkit": object()}
    monkeypatch.setattr(bench, "_groups", lambda: groups)
    monkeypatch.setattr(bench.dist, "get_world_size", lambda: 4)
    tensor, block = object(), object()
    call = bench.user_call("gloo", "broadcast", tensor, block)
    assert (call.func, call.args, call.keywords) == (
        bench.dist.broadcast,
        (tensor,),
        {"group": groups["gloo"], "src": 3},
    )
    call = bench.user_call("ddpkit_backend", "reduce_scatter", tensor, block)
    assert (call.func, call.args, call.keywords) == (
        bench.dist.reduce_scatter_tensor,
        (block, tensor),
        {"group": groups["ddpkit"]},
    )
    call = bench.user_call("ddpkit", "all_reduce", tensor, block)
    assert (call.func, call.args, call.keywords) == (bench.ddpkit.all_reduce, (tensor,), {"group": groups["gloo"]})
    call = bench.user_call("ddpkit_flat", "all_gather", tensor, block)
    assert (call.func, call.args, call.keywords) == (
        bench.ddpkit.all_gather_into_tensor,
        (tensor, block),
        {"group": groups["gloo"], "transport": "process_group"},
    )
    call = bench.user_call("ddpkit_flat", "all_reduce", tensor, block)
    assert call.keywords == {"group": groups["gloo"], "algorithm": "halving_doubling"}
    call = bench.user_call("ddpkit_bf16", "all_reduce", tensor, block)
    assert call.keywords == {"group": groups["gloo"], "cross_host_dtype": bench.torch.bfloat16}
    call = bench.user_call("ddpkit_star", "all_reduce", tensor, block)
    assert call.keywords == {"group": groups["gloo"], "algorithm": "star"}
    call = bench.user_call("ddpkit", "reduce", tensor, block)
    assert (call.func, call.keywords) == (bench.ddpkit.reduce, {"group": groups["gloo"], "dst": 3})


def test_the_torch_python_candidate_runs_torchs_statements_then_ddpkits_all_reduce(monkeypatch):
    groups = {"gloo": object(), "ddpkit": object()}
    monkeypatch.setattr(bench, "_groups", lambda: groups)
    monkeypatch.setattr(bench.dist, "get_world_size", lambda: 4)
    calls = []
    monkeypatch.setattr(bench.ddpkit, "all_reduce", lambda tensor, group: calls.append((tensor, group)))
    tensor = bench.torch.ones(3)
    bench.user_call("ddpkit_torch_python", "all_reduce", tensor, None)()
    assert len(calls) == 1 and calls[0][0] is tensor and calls[0][1] is groups["gloo"]
    with pytest.raises(ValueError, match="not a path"):  # torch's function views a complex tensor as real
        bench.user_call("ddpkit_torch_python", "all_reduce", bench.torch.ones(3, dtype=bench.torch.complex64), None)()


def test_the_links_candidates_name_the_variable_their_group_is_set_up_with():
    assert bench.link_setting("ddpkit_links_both") == ("DDPKIT_LINK_THREADS", "both")
    assert bench.link_setting("ddpkit_kernel_buffers") == ("DDPKIT_LINK_SEND_BUFFER", "0")
    assert bench.link_setting("ddpkit_send_buffer_384") == ("DDPKIT_LINK_SEND_BUFFER", str(384 * 1024))
    for other in ("ddpkit", "ddpkit_send_buffer_", "ddpkit_send_buffer_big", "ddpkit_star", "gloo"):
        assert bench.link_setting(other) is None, other


def test_any_topology_and_its_link_figures():
    assert bench.ranks_per_host("4x2") == [2, 2, 2, 2]
    assert bench.ranks_per_host("8x1") == [1] * 8
    for bad in ("4", "1x2", "4x0", "axb"):
        with pytest.raises(SystemExit):
            bench.parse_topology(bad)
    # 4 hosts, 16M floats in 0.8 s: 2·3/4 of 64 MB per host link, 0.96 of a 1 Gbit/s link.
    figures = bench.link_figures(4, 16_000_000, 0.8, "1gbit")
    assert figures["bus_bandwidth_GBps"] == pytest.approx(0.12)
    assert figures["link_fraction"] == pytest.approx(0.96)
    assert bench.link_figures(2, 1000, 1e-3, "unshaped")["link_fraction"] is None
    assert bench.link_bits_per_s("10gbit") == 1e10
    assert bench.link_bits_per_s("1gbit-10ms") == 1e9
    assert bench.link_bits_per_s("unshaped-10ms") is None


def test_a_delayed_link_is_a_rate_and_a_round_trip():
    plain = {"congestion_control": None}
    assert parse_link("1gbit-10ms") == {"rate": "1gbit", "round_trip_ms": 10.0, **plain}
    assert parse_link("unshaped-2.5ms") == {"rate": None, "round_trip_ms": 2.5, **plain}
    assert parse_link("10gbit") == {"rate": "10gbit", "round_trip_ms": None, **plain}
    assert parse_link("unshaped") == {"rate": None, "round_trip_ms": None, **plain}
    assert parse_link("1gbit-10ms-reno") == {"rate": "1gbit", "round_trip_ms": 10.0, "congestion_control": "reno"}
    assert parse_link("1gbit-bbr") == {"rate": "1gbit", "round_trip_ms": None, "congestion_control": "bbr"}
    with pytest.raises(ValueError, match="round trip is in ms"):
        parse_link("1gbit-10s")
    with pytest.raises(ValueError, match="CONGESTION_CONTROL"):
        parse_link("1gbit-10ms-reno-bbr")
