"""Every script of examples/ runs as its docstring says and checks its own results. The docs show some of
them whole; tests/test_readme.py checks that those blocks are the files as they are."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import EXAMPLES, documented_commands, free_port

REPO = Path(__file__).resolve().parent.parent
# The framework guides' examples need their framework, which the test extras install (make setup does).
NEEDS = {"lightning_ddpkit": "lightning", "accelerate_ddpkit": "accelerate"}
# Examples run as documented by a test of their own: fault_tolerance (a lighthouse and one torchrun per
# replica group) by tests/test_torchft.py, ray_train_ddpkit (plain python: Ray starts the workers) by
# tests/test_ray_train.py.
OWN_TEST = {"fault_tolerance", "ray_train_ddpkit"}


def test_there_are_the_examples():
    assert [path.stem for path in EXAMPLES] == [
        "accelerate_ddpkit",
        "checkpoint_dcp",
        "collectives",
        "compile_functional",
        "ddp_accumulation",
        "elastic_restart",
        "fault_tolerance",
        "fully_sharded",
        "lightning_ddpkit",
        "pipelining_gpipe",
        "ray_train_ddpkit",
        "sharded_optimizer",
        "syncbn",
        "torch_ddp_on_ddpkit",
    ]


@pytest.mark.parametrize("path", [p for p in EXAMPLES if p.stem not in OWN_TEST], ids=lambda path: path.stem)
def test_example_runs_as_documented(path):
    needed = NEEDS.get(path.stem)
    if needed and importlib.util.find_spec(needed) is None:
        pytest.skip(f"{needed} is not installed: make setup installs it, with the test extra")
    commands = documented_commands(path)
    assert len(commands) == 1, f"{path.name}: its docstring should give one torchrun command"
    command = commands[0]
    assignments = command[: command.index("torchrun")]
    command = command[len(assignments) :]
    assert command[-1] == f"examples/{path.name}"
    # torchrun's default port may be taken by another job on the machine; PET_MASTER_PORT is how torchrun
    # reads --master_port from the environment, so the command itself stays as documented.
    env = {**os.environ, "PET_MASTER_PORT": str(free_port()), **dict(a.split("=", 1) for a in assignments)}
    # torchrun as the module of this interpreter: the same program as .venv/bin/torchrun.
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", *command[1:]],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    # The last line, from rank 0 once every check has passed on every rank.
    assert result.stdout.strip().splitlines()[-1].startswith(f"{path.stem}: "), output
