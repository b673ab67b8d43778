"""The sequential print under real torchrun, compared byte for byte with the expected text."""

import subprocess
import sys
from pathlib import Path

import pytest

from ddpkit.sequential_print import expected_output, iteration_order

SCRIPT = Path(__file__).resolve().parent.parent / "sequential_print.py"


def launch(world_size: int, *args: str) -> str:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={world_size}",
        str(SCRIPT),
        *args,
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_expected_output_format():
    assert expected_output(3, num_iter=2) == "Process 0\nProcess 1\nProcess 2\n---\nProcess 0\nProcess 1\nProcess 2\n"
    assert expected_output(1, num_iter=3) == "Process 0\n---\nProcess 0\n---\nProcess 0\n"
    assert expected_output(2, num_iter=0) == ""
    assert iteration_order(1, 3, "alternating") == [2, 1, 0]
    assert iteration_order(1, 3, "ascending_descending") == [0, 1, 2, 2, 1, 0]


# Each launch costs seconds of start-up (torchrun and every rank import torch), so make test keeps them few: one
# rank (no message at all), 8 ranks over a hundred iterations (the most ranks racing, the most often) and 3 ranks
# in the order that has a rank print twice in a row. Slow (make test-full): world sizes 2 and 4 of the same path,
# which test_hundred_iterations_in_one_launch covers with more ranks and the same (default) order.
@pytest.mark.parametrize(
    "world_size", [1, pytest.param(2, marks=pytest.mark.slow), pytest.param(4, marks=pytest.mark.slow)]
)
def test_torchrun_output_is_deterministic(world_size):
    assert launch(world_size) == expected_output(world_size)


def test_hundred_iterations_in_one_launch():
    assert launch(8, "--num-iter", "100") == expected_output(8, num_iter=100)


# Slow: "descending" and "alternating", whose runs ascending_descending covers: every iteration descends after
# it ascends, so a rank prints twice in a row within an iteration (the last) and across its end (rank 0).
@pytest.mark.parametrize(
    "order",
    [
        pytest.param("descending", marks=pytest.mark.slow),
        pytest.param("alternating", marks=pytest.mark.slow),
        "ascending_descending",
    ],
)
def test_other_orders(order):
    assert launch(3, "--num-iter", "4", "--order", order) == expected_output(3, num_iter=4, order=order)
