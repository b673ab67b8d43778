"""The README's commands as a newcomer types them after `make main`: each names a program of the
virtual environment or a make target, its script exists, and the trainer accepts its options."""

import re
import shlex
from pathlib import Path

import pytest

from ddpkit.training.train import parse_args

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()


def commands() -> list[list[str]]:
    """Every command of the README's bash blocks, as argv without its trailing comment."""
    found = []
    for block in re.findall(r"```bash\n(.*?)```", README, flags=re.DOTALL):
        for line in block.splitlines():
            line = line.split("  #")[0].strip()
            if line and not line.startswith("#"):
                found.append(shlex.split(line))
    return found


def test_the_first_two_commands_are_make_main_and_make_test():
    assert commands()[:2] == [["make", "main"], ["make", "test"]]


@pytest.mark.parametrize("argv", commands(), ids=lambda argv: " ".join(argv)[:60])
def test_each_command_runs_from_the_repository_as_written(argv):
    program = argv[0]
    if program == "make":
        assert re.search(rf"^{argv[1]}:", (REPO / "Makefile").read_text(), flags=re.MULTILINE)
        return
    if program == "bash":
        assert (REPO / argv[1]).is_file()
        return
    if program.startswith("~/ddpkit-env/") or program == "python3":  # installing into an environment of one's own
        return
    # Anything else is the virtual environment's: after `make main`, nothing else has torch and ddpkit.
    assert program in (".venv/bin/python", ".venv/bin/torchrun"), f"{program}: say .venv/bin/{program}"
    scripts = [arg for arg in argv[1:] if arg.endswith(".py")]
    if argv[1:3] == ["-m", "pytest"]:
        assert all((REPO / path).is_file() for path in argv[3:] if path.startswith("tests/"))
        return
    assert scripts and (REPO / scripts[0]).is_file(), argv
    if scripts[0] == "train.py" and "--help" not in argv:
        parse_args(argv[argv.index("train.py") + 1:])  # exits (and fails the test) on an option it does not know


def test_training_commands_do_not_resume_each_others_runs():
    """A run continues the checkpoint in its --out directory: two different runs need two directories."""
    outs = []
    for argv in commands():
        if "train.py" in argv and "--help" not in argv:
            config, _ = parse_args(argv[argv.index("train.py") + 1:])
            outs.append(config.out_dir)
    assert len(outs) >= 3 and len(set(outs)) == len(outs), outs
