"""The trainer's command line as a user meets it: --help, the installed entry point, finished runs, the
header and the closing line, the files' permissions."""

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from ddpkit.training.cli import parse_args

from helpers import make_trainer, needs_fashion_mnist

TINY = [
    "--dataset",
    "fashion_mnist",
    "--limit-train",
    "256",
    "--limit-test",
    "100",
    "--batch-size",
    "32",
    "--no-progress",
]


def help_entries(capsys) -> dict:
    """``--help``'s entries, option flags -> their help as one line (argparse wraps lines where it likes)."""
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--help"])
    assert exit_info.value.code == 0
    entries, flags = {}, None
    for line in capsys.readouterr().out.splitlines():
        if line.startswith("  -"):  # an entry: its flags, then its help on the same line or the next
            flags, _, rest = line.strip().partition("  ")
            entries[flags] = rest.strip()
        elif flags and line.startswith("    "):
            entries[flags] = f"{entries[flags]} {line.strip()}".strip()
        else:
            flags = None
    return entries


def test_help_shows_every_default_and_booleans_both_ways(capsys):
    entries = help_entries(capsys)
    for flags, default in [
        ("--epochs EPOCHS", "10"),
        ("--model {net,vgg11,resnet18,resnet34}", "net"),
        ("--impl {ddpkit,torch}", "ddpkit"),
        ("--lr LR", "0.05"),
        ("--dataset {cifar10,cifar100,fashion_mnist}", "fashion_mnist"),
        ("--accumulation-steps ACCUMULATION_STEPS", "1"),
        ("--optimizer {sgd,adamw}", "sgd"),
    ]:
        assert entries[flags].endswith(f"(default: {default})"), (flags, entries[flags])
    # A boolean reads as the pair it is, its default the value of the positive flag.
    for flag, default in [("sync-bn", True), ("resume", True), ("download", False)]:
        assert entries[f"--{flag}, --no-{flag}"].endswith(f"(default: {default})"), flag
    assert entries["--progress, --no-progress"].endswith("(default: when stderr is a terminal)")
    assert "cpu:ddpkit,cuda:nccl" in entries["--backend {gloo,nccl,ddpkit}"]
    # Every option says its default, or what happens without it.
    assert all(help_ for help_ in entries.values()), [flags for flags, help_ in entries.items() if not help_]


def test_boolean_flags_and_backend_maps_parse():
    config, args = parse_args(["--no-sync-bn", "--no-resume", "--backend", "cpu:ddpkit,cuda:nccl"])
    assert (config.sync_bn, config.resume, args.backend) == (False, False, "cpu:ddpkit,cuda:nccl")
    config, args = parse_args(["--sync-bn", "--backend", "ddpkit"])
    assert config.sync_bn and config.resume and args.backend == "ddpkit"


@pytest.mark.parametrize("backend", ["mpi", "cpu:mpi", "tpu:gloo", "cpu:ddpkit,"])
def test_unknown_backends_are_refused(capsys, backend):
    with pytest.raises(SystemExit):
        parse_args(["--backend", backend])
    assert (
        "choose from gloo, nccl, ddpkit, or map devices to them as in cpu:ddpkit,cuda:nccl" in capsys.readouterr().err
    )


def run_outside_the_repository(command, cwd, timeout=240):
    """``command`` in ``cwd`` with the usual umask and no repository on the module path."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(
        command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, preexec_fn=lambda: os.umask(0o022)
    )


@pytest.fixture(scope="module")
def newcomer_run(tmp_path_factory):
    """torchrun of the installed module outside the repository, as a newcomer types it: no --dataset, no
    --impl, no --out, no --no-progress, --max-steps shorter than --epochs, its output piped (not a terminal).
    Returns the finished process and the directory it ran in."""
    cwd = tmp_path_factory.mktemp("newcomer")
    result = run_outside_the_repository(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "-m",
            "ddpkit.training",
            "--limit-train",
            "256",
            "--limit-test",
            "100",
            "--batch-size",
            "32",
            "--epochs",
            "10",
            "--max-steps",
            "2",
        ],
        cwd=cwd,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result, cwd


@needs_fashion_mnist
def test_torchrun_trains_the_installed_module_outside_the_repository(newcomer_run):
    result, cwd = newcomer_run
    output = result.stdout + result.stderr
    out = Path("runs/latest")  # the default, under the directory it ran in
    assert (
        "process group: backend gloo, world size 2, device cpu; ddpkit's collectives over shared memory"
        in result.stdout
    ), output
    assert "with ddpkit.DistributedDataParallel and ddpkit.SyncBatchNorm" in result.stdout, output
    assert (
        result.stdout.strip().splitlines()[-1]
        == f"wrote {out / 'metrics.json'}, {out / 'model.pt'} and {out / 'checkpoint.pt'}"
    ), output
    for name in ("metrics.json", "model.pt", "checkpoint.pt"):
        assert stat.S_IMODE((cwd / out / name).stat().st_mode) == 0o644, name


@needs_fashion_mnist
def test_the_default_dataset_is_the_installed_one(newcomer_run):
    assert "training net on fashion_mnist with" in newcomer_run[0].stdout, newcomer_run[0].stdout


@needs_fashion_mnist
def test_the_header_says_how_many_epochs_max_steps_leaves(newcomer_run):
    assert "2 optimizer steps in 1 epoch (--max-steps 2 of --epochs 10; 4 steps an epoch)" in newcomer_run[0].stdout, (
        newcomer_run[0].stdout
    )


def case_header(argv: list[str]) -> str:
    return make_trainer(parse_args(argv)[0]).header()


@needs_fashion_mnist
def test_the_torch_header_names_torchs_ddp_path(pool, tmp_path):
    """--impl torch's header (the run that prints it is the newcomer's above, with ddpkit's DDP)."""
    argv = ["--impl", "torch", *TINY, "--out", str(tmp_path / "run")]
    for header in pool(2).run(case_header, argv, timeout=300):
        assert "with torch.nn.parallel.DistributedDataParallel and BatchNorm" in header, header
        assert (
            "process group: backend gloo, world size 2, device cpu; torch's DDP all-reduces gradients through the "
            "process group (gloo); evaluation and loss logs use ddpkit's collectives over shared memory"
        ) in header, header


@needs_fashion_mnist
def test_no_progress_bar_into_a_pipe(newcomer_run):
    stderr = newcomer_run[0].stderr
    assert "\r" not in stderr and "step/s" not in stderr, stderr


def test_parse_args_default_dataset_and_progress():
    config, _ = parse_args([])
    assert (config.dataset, config.progress) == ("fashion_mnist", None)
    assert parse_args(["--progress"])[0].progress is True and parse_args(["--no-progress"])[0].progress is False


@needs_fashion_mnist
def test_a_finished_run_says_so_and_more_epochs_continue_it(programs, tmp_path):
    """Three runs of ``python -m ddpkit.training`` outside the repository, forked from the module's interpreter that
    imported torch and ddpkit (tests/helpers.py's ProgramForker; the newcomer's torchrun starts fresh ones)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}

    def run_here(argv, cwd):
        return programs.run(["-m", "ddpkit.training", *argv], cwd=cwd, env=env, umask=0o022, timeout=240)

    command = [*TINY, "--out", "run"]
    first = run_here([*command, "--epochs", "1"], cwd=tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    metrics = (tmp_path / "run" / "metrics.json").read_bytes()

    again = run_here([*command, "--epochs", "1"], cwd=tmp_path)
    assert again.returncode == 0, again.stdout + again.stderr
    assert again.stdout.strip() == (
        "run/checkpoint.pt: the run already finished at epoch 1; nothing to do (pass --epochs 2 (or more) to continue)"
    ), again.stdout + again.stderr
    assert (tmp_path / "run" / "metrics.json").read_bytes() == metrics  # nothing rewritten

    longer = run_here([*command, "--epochs", "2"], cwd=tmp_path)
    assert longer.returncode == 0, longer.stdout + longer.stderr
    assert (
        "continuing run/checkpoint.pt, finished at epoch 1, to epoch 2: the cosine schedule now spans 2 "
        "epochs, learning rate 0.025 from here" in longer.stdout
    ), longer.stdout
    epochs = json.loads((tmp_path / "run" / "metrics.json").read_text())["history"]["epochs"]
    assert [e["epoch"] for e in epochs] == [0, 1]


def case_run_then_refused(argv: list[str], longer: list[str]) -> str:
    """Runs ``argv`` on this rank, then returns the error of running it again with ``longer`` instead."""
    from ddpkit.training.config import UsageError

    make_trainer(parse_args(argv)[0]).run()
    try:
        make_trainer(parse_args(longer)[0])
    except UsageError as error:
        return str(error)
    return "not refused"


@needs_fashion_mnist
def test_a_run_stopped_by_max_steps_refuses_more_epochs(pool, tmp_path):
    """Mid-run, a different length would change the schedule under the run: refused (how the program reports
    a refused checkpoint: tests/test_train.py::test_checkpoint_of_another_run_is_one_line)."""
    argv = [*TINY, "--out", str(tmp_path / "other")]
    error = pool(1).run(case_run_then_refused, [*argv, "--epochs", "2", "--max-steps", "3"], [*argv, "--epochs", "3"])
    assert "belongs to a different run (epochs 2 -> 3, max_steps 3 -> None)" in error[0], error
