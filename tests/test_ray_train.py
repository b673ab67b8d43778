"""Ray Train on the "ddpkit" backend: examples/ray_train_ddpkit.py as its docstring runs it (one local Ray
cluster of 2 CPUs, 2 workers, torch's DDP through Ray's prepare_model and ddpkit's DDP, each checked
against torch's DDP on gloo in the same workers, bit for bit). The workers' process group is created by
Ray from the name "ddpkit" before any code of the example runs: torch's backend autoload entry point."""

import importlib.util
import subprocess
import sys

import pytest

from helpers import EXAMPLES, REPO, communicate_all

EXAMPLE = next(path for path in EXAMPLES if path.stem == "ray_train_ddpkit")


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="make setup installs Ray (the ray extra)")
def test_ray_train_example_runs_as_documented():
    assert f".venv/bin/python examples/{EXAMPLE.name}" in EXAMPLE.read_text()  # its docstring's command
    # A session of its own: whatever Ray leaves running goes with it (communicate_all kills the session).
    process = subprocess.Popen(
        [sys.executable, str(EXAMPLE)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    [(out, err)] = communicate_all([process], timeout=300)
    assert process.returncode == 0, err[-6000:]
    assert out.strip().splitlines()[-1].startswith("ray_train_ddpkit: "), out + err[-3000:]
