"""The training pipeline: real short runs, distributed validation, resume, multi-node launch, CLI errors."""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ddpkit.training.cli import parse_args
from ddpkit.training.config import TrainConfig, UsageError
from ddpkit.training.data import FASHION_MNIST_ROOT, dataset_info, load_dataset, normalize
from ddpkit.training.evaluation import evaluate
from ddpkit.training.models import build_model
from ddpkit.training.train import main

from helpers import (
    TRAIN,
    free_port,
    make_trainer,
    needs_fashion_mnist,
    small_cli,
    uncompressed_fashion_mnist,
    write_cifar,
)

REPO = Path(__file__).resolve().parent.parent


# Where small_config's runs read Fashion-MNIST: the installed files uncompressed, once for the module.
UNCOMPRESSED = {}


@pytest.fixture(scope="module", autouse=True)
def uncompressed_fashion_mnist_for_small_config(tmp_path_factory):
    UNCOMPRESSED["root"] = str(uncompressed_fashion_mnist(tmp_path_factory.mktemp("fashion_mnist")))


def small_config(out_dir, **overrides) -> TrainConfig:
    settings = dict(
        dataset="fashion_mnist",
        data_root=UNCOMPRESSED.get("root"),
        model="net",
        epochs=1,
        batch_size=32,
        accumulation_steps=2,
        limit_train=4096,
        limit_test=1001,
        lr=0.05,
        log_every=1000,
        out_dir=str(out_dir) if out_dir is not None else None,
        progress=False,
        eval_batch_size=256,
    )
    settings.update(overrides)
    return TrainConfig(**settings)


def case_train(config: TrainConfig, until_step=None):
    trainer = make_trainer(config)
    if until_step is not None:
        while trainer.step < until_step:
            trainer.train_epoch(until_step=until_step)
        return None
    summary = trainer.run()
    return summary, {k: v.clone() for k, v in trainer._model_state().items()}


# --- training -------------------------------------------------------------------------------------


@needs_fashion_mnist
def test_short_real_run_learns(pool, tmp_path):
    summary, _ = pool(2).run(case_train, small_config(tmp_path / "run"), timeout=300)[0]
    steps = summary["history"]["steps"]
    first, last = steps[0]["local_loss"], sum(s["local_loss"] for s in steps[-5:]) / 5
    assert last < 0.6 * first, (first, last)
    assert summary["final_test_accuracy"] > 0.6  # chance is 0.1
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["final_test_accuracy"] == summary["final_test_accuracy"]
    assert (tmp_path / "run" / "model.pt").exists() and (tmp_path / "run" / "checkpoint.pt").exists()
    assert all(s["comm_wait_s"] >= 0 and s["forward_s"] > 0 for s in steps)


@needs_fashion_mnist
def test_ddpkit_and_torch_pipelines_match_with_plain_batchnorm(pool, tmp_path):
    losses = {}
    for impl in ("ddpkit", "torch"):
        config = small_config(
            tmp_path / impl,
            impl=impl,
            sync_bn=False,
            max_steps=4,
            model="vgg11",
            limit_train=512,
            limit_test=64,
            batch_size=8,
        )
        summary, _ = pool(2).run(case_train, config, timeout=300)[0]
        losses[impl] = torch.tensor([s["local_loss"] for s in summary["history"]["steps"]])
    torch.testing.assert_close(losses["ddpkit"], losses["torch"], atol=1e-4, rtol=1e-4)


@needs_fashion_mnist
def test_comm_hooks_train_with_every_rank_alike(pool, tmp_path):
    """--comm-hook: torch's allreduce_hook on a compressed "ddpkit" group (bf16_crossing: on one host
    nothing crosses, so it is the float32 run) and torch's bf16_compress_hook, which rounds."""
    results = {}
    for hook in ("none", "bf16_crossing", "bf16_compress"):
        config = small_config(tmp_path / hook, comm_hook=hook, sync_bn=False, max_steps=4, limit_test=64)
        results[hook] = pool(2).run(case_train, config, timeout=300)
        (_, first), (_, second) = results[hook]
        for key in first:
            assert torch.equal(first[key], second[key]), (hook, key)
    for key, value in results["none"][0][1].items():
        assert torch.equal(results["bf16_crossing"][0][1][key], value), key
    assert any(not torch.equal(results["bf16_compress"][0][1][k], v) for k, v in results["none"][0][1].items())


@needs_fashion_mnist
def test_resumed_run_equals_uninterrupted_run(pool, tmp_path):
    base = dict(epochs=2, limit_train=1024, checkpoint_every=5, model="net")  # 8 optimizer steps an epoch
    expected, uninterrupted = pool(2).run(case_train, small_config(tmp_path / "a", **base), timeout=300)[0]
    pool(2).run(case_train, small_config(tmp_path / "b", **base), until_step=12, timeout=300)  # stops mid-epoch 1
    summary, resumed = pool(2).run(case_train, small_config(tmp_path / "b", **base), timeout=300)[0]
    for key in uninterrupted:
        assert torch.equal(resumed[key], uninterrupted[key]), key
    # The same history too: one evaluation per epoch, none where the first launch stopped.
    fields_of = {"epochs": ("epoch", "step", "test_loss", "test_accuracy"), "steps": ("step", "local_loss")}
    for kind, fields in fields_of.items():
        assert [[record[f] for f in fields] for record in summary["history"][kind]] == [
            [record[f] for f in fields] for record in expected["history"][kind]
        ], kind
    errors = pool(2).run(case_resume_error, small_config(tmp_path / "b", **{**base, "lr": 0.1}), timeout=300)
    assert all("belongs to a different run (lr 0.05 -> 0.1)" in error for error in errors), errors


def case_resume_and_run(config: TrainConfig):
    """The optimizer's consolidated state right after resuming, then the finished run's summary."""
    trainer = make_trainer(config)
    state = trainer._optimizer_state()
    return trainer.step, state, trainer.run()


SHARDED_BASE = dict(max_steps=6, limit_test=64, global_batch_size=64, accumulation_steps=1, optimizer="adamw", lr=0.01)


@needs_fashion_mnist
def test_sharded_runs_have_ddps_bits(pool, tmp_path):
    """--shard optimizer, gradients and parameters (ZeRO-1/2/3) train with the bits of --shard none."""
    states = {}
    for shard in ("none", "optimizer", "gradients", "parameters"):
        config = small_config(tmp_path / shard, shard=shard, **SHARDED_BASE)
        states[shard] = pool(2).run(case_train, config, timeout=300)[0][1]
    for shard in ("optimizer", "gradients", "parameters"):
        assert all(torch.equal(states[shard][k], v) for k, v in states["none"].items()), shard


@needs_fashion_mnist
@pytest.mark.parametrize("shard", ["gradients", "parameters"])
def test_a_sharded_run_resumes_at_another_world_size(pool, tmp_path, shard):
    """A sharded run stopped at 2 ranks resumes at 4 from its consolidated checkpoint (the same samples per step: a
    fixed global batch), with the optimizer state it saved."""
    moved = small_config(tmp_path / f"moved_{shard}", shard=shard, checkpoint_every=3, **SHARDED_BASE)
    pool(2).run(case_train, moved, until_step=3, timeout=300)
    saved = torch.load(tmp_path / f"moved_{shard}" / "checkpoint.pt", weights_only=False)["optimizer"]
    for step, state, summary in pool(4).run(case_resume_and_run, moved, timeout=300):
        assert step == 3 and [record["step"] for record in summary["history"]["steps"]] == [1, 2, 3, 4, 5, 6]
        if shard == "parameters":  # its consolidated state is keyed by parameter name
            assert state["param_groups"][0]["params"] == saved["param_groups"][0]["params"]
            assert all(torch.equal(state["state"][n]["exp_avg"], v["exp_avg"]) for n, v in saved["state"].items())
            continue
        assert state["param_groups"] == saved["param_groups"]
        assert all(
            torch.equal(state["state"][i][k], v) for i, entries in saved["state"].items() for k, v in entries.items()
        )


def case_pause_within_an_epoch(config: TrainConfig, until_step: int):
    trainer = make_trainer(config)
    paused = trainer.train_epoch(until_step=until_step)
    record = trainer.train_epoch()
    return paused, record, trainer.step, trainer.epoch, trainer.history["epochs"], trainer._module().state_dict()


def case_one_epoch(config: TrainConfig):
    trainer = make_trainer(config)
    trainer.train_epoch()
    return trainer._module().state_dict()


@needs_fashion_mnist
def test_an_epoch_paused_at_until_step_goes_on_where_it_stopped(pool):
    config = small_config(None, epochs=2, limit_train=512, accumulation_steps=1, limit_test=100)
    # 512 samples over 2 ranks in batches of 32: 8 optimizer steps an epoch.
    paused, record, step, epoch, epochs, model = pool(2).run(case_pause_within_an_epoch, config, 3, timeout=300)[0]
    assert paused is None  # no evaluation of a part of an epoch
    assert (step, epoch) == (8, 1)
    assert [(e["epoch"], e["step"]) for e in epochs] == [(0, 8)] and record == epochs[0]
    expected = pool(2).run(case_one_epoch, config, timeout=300)[0]
    for key in expected:
        assert torch.equal(model[key], expected[key]), key


@needs_fashion_mnist
@pytest.mark.parametrize("impl", ["torch", "ddpkit"])
def test_reported_test_figures_are_those_of_model_pt_with_plain_batchnorm(pool, tmp_path, impl):
    """With plain BatchNorm each rank keeps running statistics of its own; model.pt holds rank 0's, and so
    must the model that the distributed evaluation scores."""
    config = small_config(
        tmp_path / "run",
        impl=impl,
        sync_bn=False,
        accumulation_steps=1,
        limit_train=1024,
        limit_test=500,
        eval_batch_size=100,
    )
    summary, _ = pool(2).run(case_train, config, timeout=300)[0]
    assert summary["batch_norm"] == "BatchNorm"
    info = dataset_info("fashion_mnist")
    model = build_model("net", info.channels, info.num_classes, info.image_size)
    model.load_state_dict(torch.load(tmp_path / "run" / "model.pt"))
    model.eval()
    images, labels = (t[:500] for t in load_dataset("fashion_mnist", train=False))
    with torch.no_grad():
        logits = model(normalize(images, info.mean, info.std))
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["final_test_accuracy"] == pytest.approx(
        float((logits.argmax(1) == labels).double().mean()), abs=1e-12
    )
    assert metrics["final_test_loss"] == pytest.approx(
        float(nn.functional.cross_entropy(logits.double(), labels)), rel=1e-6
    )


@needs_fashion_mnist
def test_a_finished_run_writes_the_results_it_was_stopped_before(pool, tmp_path):
    """A run killed after its last checkpoint but before model.pt and metrics.json: the next launch
    writes them from the checkpoint, as the first would have."""
    config = small_config(tmp_path / "run", limit_train=512, limit_test=100)
    pool(2).run(case_train, config, timeout=300)
    model_before = torch.load(tmp_path / "run" / "model.pt")
    metrics_before = json.loads((tmp_path / "run" / "metrics.json").read_text())
    for name in ("model.pt", "metrics.json"):
        (tmp_path / "run" / name).unlink()
    pool(2).run(case_train, config, timeout=300)
    model_after = torch.load(tmp_path / "run" / "model.pt")
    assert model_after.keys() == model_before.keys()
    for key in model_before:
        assert torch.equal(model_after[key], model_before[key]), key
    metrics_after = json.loads((tmp_path / "run" / "metrics.json").read_text())
    for metrics in (metrics_before, metrics_after):
        metrics.pop("peak_rss_bytes_max_over_ranks")  # the process's own, not the run's
    assert metrics_after == metrics_before


@needs_fashion_mnist
def test_augment_given_as_its_default_resumes_the_same_run(pool, tmp_path):
    config = small_config(tmp_path / "run", limit_train=512, limit_test=100, max_steps=2)
    pool(2).run(case_train, config, timeout=300)  # no --augment: off for Fashion-MNIST
    summary, _ = pool(2).run(
        case_train,
        small_config(tmp_path / "run", limit_train=512, limit_test=100, max_steps=2, augment=False),
        timeout=300,
    )[0]
    assert summary["config"]["augment"] is False  # stored as resolved
    # A checkpoint that stored the option as given (None) resumes with it given too.
    checkpoint = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)
    checkpoint["config"]["augment"] = None
    torch.save(checkpoint, tmp_path / "run" / "checkpoint.pt")
    pool(2).run(
        case_train,
        small_config(tmp_path / "run", limit_train=512, limit_test=100, max_steps=2, augment=False),
        timeout=300,
    )
    errors = pool(2).run(
        case_resume_error,
        small_config(tmp_path / "run", limit_train=512, limit_test=100, max_steps=2, augment=True),
        timeout=300,
    )
    assert all("belongs to a different run (augment False -> True)" in error for error in errors), errors


def case_download_once_per_node(root: Path, mirror: Path, events: Path):
    """Trainer setup with --download, downloading as torchvision does: straight to the final path, in
    pieces; every download and every load is logged to `events`."""
    from ddpkit.training import data

    rank = dist.get_rank()

    def log(event):
        with open(events, "a") as out:
            out.write(f"{event} {rank}\n")

    def download(source, into):
        log("download")
        payload = mirror.read_bytes()
        into.mkdir(parents=True, exist_ok=True)
        with open(into / source.archive, "wb") as out:
            out.write(payload[: len(payload) // 2])
            out.flush()
            time.sleep(1.0)
            out.write(payload[len(payload) // 2 :])
        log("downloaded")

    def load(*args, **kwargs):
        result = real_load(*args, **kwargs)
        log("loaded")
        return result

    real_download, real_load = data._download_cifar, data.load_cifar
    data._download_cifar, data.load_cifar = download, load
    try:
        config = small_config(
            None,
            dataset="cifar10",
            data_root=str(root),
            download=True,
            batch_size=2,
            accumulation_steps=1,
            limit_train=None,
            limit_test=None,
        )
        return len(make_trainer(config).data.train_x)
    finally:
        data._download_cifar, data.load_cifar = real_download, real_load


def test_download_by_local_rank_0_while_the_others_wait(pool, tmp_path):
    expected = write_cifar(tmp_path / "mirror", "cifar10", as_archive=True)
    events = tmp_path / "events"
    archive = tmp_path / "mirror" / "cifar-10-python.tar.gz"
    sizes = pool(2).run(case_download_once_per_node, tmp_path / "root", archive, events, timeout=300)
    assert sizes == [len(expected["train"][0])] * 2
    log = events.read_text().split("\n")[:-1]
    assert log[:2] == ["download 0", "downloaded 0"], log  # rank 1 neither downloads nor loads before that
    assert sorted(log[2:]) == ["loaded 0", "loaded 0", "loaded 1", "loaded 1"], log


def case_resume_error(config: TrainConfig):
    try:
        case_train(config)
    except ValueError as error:
        return str(error)
    return None


# --- distributed validation ----------------------------------------------------------------------


def make_eval_problem(count):
    generator = torch.Generator().manual_seed(7)
    images = torch.randint(0, 256, (count, 1, 6, 6), generator=generator, dtype=torch.uint8)
    labels = torch.randint(0, 5, (count,), generator=generator)
    torch.manual_seed(3)
    model = nn.Sequential(nn.Flatten(), nn.Linear(36, 16), nn.ReLU(), nn.Linear(16, 5))
    return model, images, labels


def transform(images):
    return images.float() / 255


def case_evaluate(count, batch_size):
    import ddpkit

    model, images, labels = make_eval_problem(count)
    ddpkit.reset_comm_counters()
    result = evaluate(model, images, labels, transform, batch_size, torch.device("cpu"))
    return result, ddpkit.comm_counters()["collectives"]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_distributed_validation_equals_single_process(pool, world_size):
    count = 1001  # divisible by none of 2, 3, 4
    model, images, labels = make_eval_problem(count)
    with torch.no_grad():
        logits = model(transform(images))
    expected_accuracy = float((logits.argmax(1) == labels).double().mean())
    expected_loss = float(nn.functional.cross_entropy(logits.double(), labels))
    results = pool(world_size).run(case_evaluate, count, 64)
    for result, collectives in results:  # every rank's, not rank 0's only
        assert collectives == 2  # the shards' scatter and the sums' all-reduce, both ddpkit's
        assert result == results[0][0]
        assert result["samples"] == count
        assert result["accuracy"] == pytest.approx(expected_accuracy, abs=1e-12)
        assert result["loss"] == pytest.approx(expected_loss, rel=1e-6)


# --- launching ------------------------------------------------------------------------------------


@needs_fashion_mnist
@pytest.mark.parametrize("backend", ["ddpkit"])  # gloo's launch is torch's own, tested there
def test_two_torchrun_launchers_as_two_nodes(tmp_path, backend):
    endpoint = f"127.0.0.1:{free_port()}"
    launchers = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--node_rank",
                str(node),
                "--nproc_per_node",
                "1",
                "--rdzv_backend",
                "c10d",
                "--rdzv_endpoint",
                endpoint,
                "--rdzv_id",
                f"two-nodes-{backend}",
                str(TRAIN),
                "--backend",
                backend,
                *small_cli(tmp_path / "run"),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in (0, 1)
    ]
    outputs = [launcher.communicate(timeout=240)[0] for launcher in launchers]
    codes = [launcher.returncode for launcher in launchers]
    assert codes == [0, 0], "\n".join(
        f"--- node {node} (exit {code}):\n{output[-6000:]}" for node, (code, output) in enumerate(zip(codes, outputs))
    )
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["world_size"] == 2
    assert sum("test loss" in output for output in outputs) == 1  # only rank 0 logs


@needs_fashion_mnist
def test_explicit_launch_without_torchrun(programs, tmp_path):
    """Two ranks started by hand with --master-addr, --master-port, --world-size and --rank (each train.py as its own
    program, forked from the module's interpreter that imported torch: tests/helpers.py's ProgramForker)."""
    port = str(free_port())
    options = ["--master-addr", "127.0.0.1", "--master-port", port, "--world-size", "2", *small_cli(tmp_path / "run")]
    ranks = [programs.start([TRAIN, *options, "--rank", str(rank)]) for rank in (0, 1)]
    outputs = [programs.wait(rank, timeout=240) for rank in ranks]
    assert [output.returncode for output in outputs] == [0, 0], outputs
    assert "test loss" in outputs[0].stdout + outputs[0].stderr
    assert "test loss" not in outputs[1].stdout + outputs[1].stderr
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["world_size"] == 2


# --- bad input ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--epochs", "0"], "--epochs: must be >= 1"),
        (["--batch-size", "-3"], "--batch-size: must be >= 1"),
        (["--lr", "0"], "--lr: must be > 0"),
        (["--dataset", "imagenet"], "--dataset: invalid choice"),
        (["--algorithm", "telepathy"], "--algorithm: invalid choice"),
        (["--checkpoint-every", "-1"], "--checkpoint-every must be >= 0"),
        (["--master-port", "70000"], "--master-port: port must be in 1..65535"),
    ],
)
def test_invalid_cli_values_are_argparse_errors(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_missing_cifar_names_the_expected_path(tmp_path):
    """The loader's error names where it looked (the program's one line of it, for CIFAR-100:
    test_missing_dataset_is_one_line)."""
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "cifar-10-batches-py"))):
        load_dataset("cifar10", root=tmp_path)


# --- user errors from the command line: one line, no traceback, non-zero exit -------------------


def run_cli(programs, *argv, env=None):
    """train.py ``argv`` as its own program (forked from the module's interpreter that imported torch and ddpkit:
    tests/helpers.py's ProgramForker; torchrun starts fresh interpreters of it in the tests that launch it)."""
    return programs.run([TRAIN, *argv], env=env)


def assert_one_line_error(result, status, expected):
    """Exit status, a single line on stderr holding `expected`, nothing on stdout, no traceback."""
    output = result.stdout + result.stderr
    assert result.returncode == status, output
    assert "Traceback" not in output, output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and expected in lines[0], output
    assert result.stdout.strip() == "", output


@pytest.mark.parametrize(
    "argv,expected",
    [
        (["--batch-size", "8", "--global-batch-size", "64"], "--batch-size and --global-batch-size are alternatives"),
        (["--impl", "torch", "--algorithm", "ring"], "--algorithm sets up ddpkit's DDP, not --impl torch's"),
        (
            ["--impl", "torch", "--grad-sync", "per_parameter", "--algorithm", "star"],
            "--grad-sync and --algorithm set up",
        ),
        (["--dataset", "fashion-mnist", "--download"], "--download fetches CIFAR only"),
        (["--world-size", "2", "--rank", "0"], "--world-size and --rank are for launching without torchrun"),
        (["--master-addr", "127.0.0.1", "--world-size", "2"], "--master-addr needs --world-size and --rank"),
        (["--master-addr", "127.0.0.1", "--world-size", "2", "--rank", "2"], "--rank 2 is not in [0, --world-size 2)"),
        (["--dataset", "mnist"], "--dataset: invalid choice: 'mnist'"),
        (["--epochs", "0"], "--epochs: must be >= 1"),
    ],
)
def test_bad_options_are_one_line(capsys, argv, expected):
    """The program's own main, in this process: each is refused while parsing, before any process group
    (the program in a process of its own: the next test)."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    captured = capsys.readouterr()
    assert exit_info.value.code == 2 and not dist.is_initialized()
    assert_one_line_error(subprocess.CompletedProcess(argv, 2, captured.out, captured.err), 2, expected)


def test_a_bad_option_is_one_line_from_the_program(programs):
    assert_one_line_error(run_cli(programs, "--dataset", "mnist"), 2, "--dataset: invalid choice: 'mnist'")


def test_torchrun_variables_without_master_are_one_line(programs, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    result = run_cli(programs, "--out", str(tmp_path / "out"), env={**env, "RANK": "0", "WORLD_SIZE": "1"})
    assert_one_line_error(result, 2, "RANK/WORLD_SIZE are set but MASTER_ADDR, MASTER_PORT is not")


def case_usage_error(argv: list[str]) -> str | None:
    """The UsageError of setting up train.py's run of ``argv`` on this rank, if any."""
    try:
        make_trainer(parse_args(argv)[0])
    except UsageError as error:
        return str(error)
    return None


ONE_SAMPLE = ["--dataset", "fashion_mnist", "--limit-train", "64", "--batch-size", "1", "--max-steps", "1"]
ONE_SAMPLE_ERROR = "--model net has BatchNorm1d, which in training normalises over the samples of"


@needs_fashion_mnist
@pytest.mark.parametrize("batch_norm", [["--no-sync-bn"], ["--impl", "torch"], []])
def test_one_sample_for_batch_norm_1d_is_refused(pool, tmp_path, batch_norm):
    """Plain BatchNorm with a micro-batch of 1, or synchronized over one rank: the first forward would raise."""
    error = pool(1).run(case_usage_error, [*ONE_SAMPLE, "--out", str(tmp_path / "out"), *batch_norm], timeout=300)[0]
    assert error and ONE_SAMPLE_ERROR in error and "use --batch-size 2 or more" in error, error


@needs_fashion_mnist
def test_one_sample_for_batch_norm_1d_is_one_line(programs, tmp_path):
    """The program's report of the error above (ddpkit's SyncBatchNorm over one rank, the default)."""
    result = run_cli(programs, *ONE_SAMPLE, "--no-progress", "--out", str(tmp_path / "out"))
    assert_one_line_error(result, 1, ONE_SAMPLE_ERROR)
    assert "use --batch-size 2 or more" in result.stderr


def test_missing_dataset_is_one_line(programs, tmp_path):
    result = run_cli(
        programs, "--dataset", "fashion-mnist", "--data-root", str(tmp_path / "nowhere"), "--out", str(tmp_path / "out")
    )
    assert_one_line_error(result, 1, f"Fashion-MNIST not found: directory {tmp_path / 'nowhere'} does not exist")
    result = run_cli(programs, "--dataset", "CIFAR-100", "--data-root", str(tmp_path), "--out", str(tmp_path / "out"))
    assert_one_line_error(result, 1, f"CIFAR-100 not found: expected the directory {tmp_path / 'cifar-100-python'}")


def test_global_batch_that_does_not_divide_is_one_line(programs, tmp_path):
    result = run_cli(
        programs,
        "--dataset",
        "fashion_mnist",
        "--global-batch-size",
        "63",
        "--accumulation-steps",
        "2",
        "--out",
        str(tmp_path / "out"),
    )
    assert_one_line_error(result, 1, "--global-batch-size 63 is not divisible by world size x --accumulation-steps")


@needs_fashion_mnist
def test_too_few_samples_is_one_line(programs, tmp_path):
    result = run_cli(
        programs,
        "--dataset",
        "fashion_mnist",
        "--limit-train",
        "10",
        "--batch-size",
        "32",
        "--out",
        str(tmp_path / "out"),
    )
    assert_one_line_error(result, 1, "10 samples over 1 ranks do not fill one batch of 32")


@needs_fashion_mnist
def test_checkpoint_of_another_run_is_one_line(pool, programs, tmp_path):
    out = str(tmp_path / "run")
    # The run whose checkpoint the program meets: train.py's run of the same options, on a rank of the pool.
    pool(1).run(case_train, parse_args([*small_cli(tmp_path / "run"), "--max-steps", "2"])[0], timeout=300)
    result = run_cli(programs, *small_cli(tmp_path / "run"), "--max-steps", "2", "--lr", "0.1")
    assert_one_line_error(result, 1, f"checkpoint {out}/checkpoint.pt belongs to a different run (lr 0.05 -> 0.1)")
    (tmp_path / "run" / "checkpoint.pt").write_bytes(b"not a checkpoint")
    result = run_cli(programs, *small_cli(tmp_path / "run"), "--max-steps", "2")
    assert_one_line_error(result, 1, f"checkpoint {out}/checkpoint.pt cannot be resumed")


def launch_two_ranks(programs, tmp_path, per_rank_argv):
    """train.py on 2 ranks started by hand, each its own program (tests/helpers.py's ProgramForker): each rank's
    exit status, stdout and stderr."""
    port = str(free_port())
    options = ["--master-addr", "127.0.0.1", "--master-port", port, "--world-size", "2", "--out", str(tmp_path / "out")]
    ranks = [programs.start([TRAIN, *options, "--rank", str(rank), *per_rank_argv[rank]]) for rank in (0, 1)]
    return [(result.returncode, result.stdout, result.stderr) for result in (programs.wait(r, 240) for r in ranks)]


@needs_fashion_mnist
@pytest.mark.parametrize("missing_on", [pytest.param((0, 1), marks=pytest.mark.slow), (1,)])
def test_distributed_user_error_is_one_line_from_rank_0(programs, tmp_path, missing_on):
    """Every rank stops with a non-zero status and only rank 0 speaks, also when only another rank
    lacks the dataset (it tells the others before any of them waits for it). Slow: (0, 1), every rank
    without it, which test_torchrun_user_error_is_reported_once_and_no_rank_prints_a_traceback checks
    under torchrun; (1,) is the harder case."""
    roots = [str(tmp_path / "nowhere") if rank in missing_on else FASHION_MNIST_ROOT for rank in (0, 1)]
    outcomes = launch_two_ranks(
        programs, tmp_path, [["--dataset", "fashion-mnist", "--data-root", root] for root in roots]
    )
    (status0, out0, err0), (status1, out1, err1) = outcomes
    assert (status0, status1) == (1, 1), outcomes
    assert "Traceback" not in out0 + err0 + out1 + err1, outcomes
    assert out1.strip() == "" and err1.strip() == "", outcomes
    lines = [line for line in err0.splitlines() if line.strip()]
    assert len(lines) == 1 and "Fashion-MNIST not found" in lines[0], outcomes
    assert lines[0].endswith("(on rank 1)") == (missing_on == (1,)), lines


@needs_fashion_mnist
def test_torchrun_user_error_is_reported_once_and_no_rank_prints_a_traceback(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            str(TRAIN),
            "--dataset",
            "fashion-mnist",
            "--data-root",
            str(tmp_path / "nowhere"),
            "--out",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert output.count("Fashion-MNIST not found") == 1, output
    # torchrun's own launcher reports the failed workers with a traceback of torch/distributed/run.py;
    # none comes from a worker (no frame of train.py or ddpkit).
    assert str(TRAIN) + '", line' not in output and not re.search(r'ddpkit/training/\w+\.py", line', output), output


@pytest.mark.parametrize(
    "spelling,name",
    [
        ("fashion_mnist", "fashion_mnist"),
        ("fashion-mnist", "fashion_mnist"),
        ("Fashion-MNIST", "fashion_mnist"),
        ("FashionMNIST", "fashion_mnist"),
        ("cifar10", "cifar10"),
        ("cifar-10", "cifar10"),
        ("CIFAR_100", "cifar100"),
    ],
)
def test_dataset_spellings(spelling, name):
    config, _ = parse_args(["--dataset", spelling])
    assert config.dataset == name
