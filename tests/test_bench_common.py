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
