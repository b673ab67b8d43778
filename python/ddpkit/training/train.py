"""The trainer: one rank's training run, set up and run by named steps that read top to bottom (as
nanoGPT's train.py does), and ``main``, the program (its command line: ``cli.py``).

Set-up (``Trainer.__init__``): the run's settings (``config.resolve_config``), this rank's data
(``run_data.load_data_on_every_rank``: with ``--download``, local rank 0 first), the model with the
BatchNorm the run asks for, its data-parallel wrapper, the optimizer and the learning-rate schedule
(``model_setup``), and the checkpoint it continues (``checkpoints``). Then ``Trainer.run`` trains epoch
by epoch (``Trainer.train_epoch``), evaluates after each on every rank together
(``evaluation.evaluate``), checkpoints, and writes the model and the metrics.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from .. import comm
from ..ddp import DistributedDataParallel, GradientAccumulation, broadcast_tensors
from ..fsdp import FullyShardedDataParallel
from ..launch import DistInfo
from .checkpoints import check_same_run, read_checkpoint, save_atomically, write_json_atomically
from .cli import init_from_args, parse_args
from .config import TrainConfig, UsageError, resolve_config
from .data import dataset_info, normalize, random_crop_flip
from .evaluation import evaluate
from .model_setup import (
    batch_norm_of,
    check_batch_norm_has_samples,
    convert_batch_norm,
    count_total_steps,
    make_optimizer,
    make_scheduler,
    wrap_data_parallel,
)
from .models import build_model
from .run_data import load_data_on_every_rank


def log(*parts) -> None:
    """Prints on rank 0 only."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*parts, flush=True)


# ----------------------------------------------------------------------------------------------
# Training


def _peak_rss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class Trainer:
    """One rank's training run. ``run()`` trains to the end; ``train_epoch()`` does one epoch."""

    def __init__(self, config: TrainConfig, info: DistInfo):
        self.config = config = resolve_config(config)
        self.rank, self.world_size = info.rank, info.world_size
        self.progress_label = ""  # put before "epoch N" on the progress bar
        self.verbose = True  # rank 0 logs progress lines (a caller that reports itself turns them off)
        self.device = torch.device("cuda", info.local_rank) if "nccl" in info.backend else torch.device("cpu")
        self.info = dataset_info(config.dataset)
        self.out_dir = Path(config.out_dir) if config.out_dir else None

        self.data = load_data_on_every_rank(config, info)

        torch.manual_seed(config.seed)
        model = build_model(config.model, self.info.channels, self.info.num_classes, self.info.image_size)
        self.batch_norm, self.notes = batch_norm_of(config, self.device)
        check_batch_norm_has_samples(model, config, self.batch_norm, self.data.micro_batch, self.world_size)
        model = convert_batch_norm(model, self.batch_norm).to(self.device)
        self.model = wrap_data_parallel(model, config, self.device)

        self.optimizer = make_optimizer(self.model, config)
        self.total_steps = count_total_steps(self.data.steps_per_epoch, config)
        self.scheduler = make_scheduler(self.optimizer, config, self.total_steps)
        self.accumulate = GradientAccumulation(self.model, config.accumulation_steps)
        self.loss_fn = nn.CrossEntropyLoss()

        self.epoch = 0
        self.step = 0
        self.history: dict = {"epochs": [], "steps": []}
        self.resumed_from: Path | None = None  # the checkpoint this run continues, if any
        self._epoch_batches: Iterator[torch.Tensor] | None = None  # the epoch a train_epoch paused in
        self._epoch_time_s = 0.0  # training time of the current epoch so far, over the calls that ran it
        if config.resume:
            self._resume()

    def _log(self, *parts) -> None:
        if self.verbose:
            log(*parts)

    # -- data ----------------------------------------------------------------------------------
    def _transform(self, images: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        if generator is not None and self.config.augment:
            images = random_crop_flip(images, padding=4, generator=generator)
        return normalize(images, self.info.mean, self.info.std)

    def _eval_transform(self, images: torch.Tensor) -> torch.Tensor:
        return normalize(images, self.info.mean, self.info.std)

    def _seed_micro_batch(self, micro_index: int) -> torch.Generator:
        # Note: every random draw of a micro-batch (dropout, augmentation) comes from seeds that are
        # a function of (seed, rank, micro-batch), so a resumed run replays them without saved states.
        seed = (self.config.seed * 1_000_003 + self.rank * 10_007 + micro_index) % (2**63)
        torch.manual_seed(seed)
        return torch.Generator().manual_seed(seed + 1)

    # -- checkpoints ---------------------------------------------------------------------------
    def _module(self) -> nn.Module:
        return self.model.module

    def _fully_sharded(self) -> bool:
        return isinstance(self.model, FullyShardedDataParallel)

    def _model_state(self) -> dict:
        """The unwrapped model's state dict, every tensor whole: a collective under --shard parameters (the
        wrapper gathers its shards), so every rank calls it."""
        return self.model.state_dict() if self._fully_sharded() else self._module().state_dict()

    def _optimizer_state(self) -> dict:
        """The optimizer's state dict, consolidated (a collective with a ShardedOptimizer or under --shard
        parameters, whose state is keyed by parameter name: FullyShardedDataParallel.optim_state_dict)."""
        return self.model.optim_state_dict(self.optimizer) if self._fully_sharded() else self.optimizer.state_dict()

    def checkpoint_state(self) -> dict:
        return {
            "config": dataclasses.asdict(self.config),
            "world_size": self.world_size,
            "model": self._model_state(),
            "optimizer": self._optimizer_state(),
            "scheduler": self.scheduler.state_dict() if self.scheduler else None,
            "sampler": self.data.sampler.state_dict(),
            "accumulate": self.accumulate.state_dict(),
            "epoch": self.epoch,
            "step": self.step,
            "history": self.history,
        }

    def save_checkpoint(self) -> None:
        if not self.out_dir:
            return
        # On every rank: a ShardedOptimizer's state_dict() and FullyShardedDataParallel's state dicts
        # consolidate their shards (collectives).
        state = self.checkpoint_state()
        if self.rank == 0:
            save_atomically(state, self.out_dir / "checkpoint.pt")

    def _resume(self) -> None:
        path = self.out_dir / "checkpoint.pt" if self.out_dir else None
        # With a fixed global batch, every optimizer step takes the same samples at any world size
        # (ShardedBatches), and the optimizer's state dict is whole (a ShardedOptimizer's consolidated one).
        state = read_checkpoint(
            path, self.rank, self.world_size, any_world_size=self.config.global_batch_size is not None
        )
        if state is None:
            return
        extending = check_same_run(state, self.config, path)
        if self._fully_sharded():  # whole tensors: each rank takes its pieces, at any world size
            self.model.load_state_dict(state["model"])
            self.model.load_optim_state_dict(self.optimizer, state["optimizer"])
        else:
            self._module().load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler and state["scheduler"]:
            self.scheduler.load_state_dict(state["scheduler"])
        self.data.sampler.load_state_dict(state["sampler"])
        self.accumulate.load_state_dict(state["accumulate"])
        self.epoch, self.step, self.history = state["epoch"], state["step"], state["history"]
        self.resumed_from = path
        if extending:
            self._stretch_schedule()
            self._log(
                f"continuing {path}, finished at epoch {self.epoch}, to epoch {self.config.epochs}"
                + (
                    f": the cosine schedule now spans {self.config.epochs} epochs, learning rate "
                    f"{self.optimizer.param_groups[0]['lr']:.4g} from here"
                    if self.scheduler
                    else ""
                )
            )
        elif not self.done():
            self._log(f"resumed from {path}: epoch {self.epoch + 1}, optimizer step {self.step}")

    def _stretch_schedule(self) -> None:
        """Puts the cosine schedule of a finished run onto the new number of steps, at the current step
        (its saved state ends at the old length, where it would turn back up)."""
        if self.scheduler is None:
            return
        # Built with last_epoch = step - 1, the scheduler's initial step puts it at `step`; it keeps the
        # current learning rate there, so that is set to the curve's value, from which its later steps go on.
        self.scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(
            self.optimizer, T_max=self.total_steps, last_epoch=self.step - 1
        )
        for group in self.optimizer.param_groups:
            group["lr"] = group["initial_lr"] * (1 + math.cos(math.pi * self.step / self.total_steps)) / 2

    # -- training ------------------------------------------------------------------------------
    def done(self) -> bool:
        return self.step >= self.total_steps or self.epoch >= self.config.epochs

    def train_epoch(self, until_step: int | None = None) -> dict | None:
        """Trains to the end of the current epoch (or to optimizer step ``until_step``, or the last
        step), then checkpoints. A call after one that stopped at ``until_step`` within an epoch goes
        on with that epoch's next batch. The epoch's evaluation, and its record (returned, and added to
        ``history["epochs"]``), come at its end or at the last step only: a call that stops at
        ``until_step`` before either returns None."""
        if self._epoch_batches is None:
            self.data.sampler.set_epoch(self.epoch)
            self._epoch_batches = iter(self.data.sampler)
        self.model.train()
        micro_batches = self.data.steps_per_epoch * self.config.accumulation_steps
        progress = self._progress_bar()
        started = time.perf_counter()
        loss_sum = torch.zeros(2, dtype=torch.float64)  # for the log: sum of losses, micro-batches
        for indices in self._epoch_batches:
            position = self.data.sampler.state_dict()["position"]  # 1-based index of this micro-batch
            if position > micro_batches:
                break  # the epoch's tail that does not fill a whole optimizer step
            loss_value, stepped, forward_s, backward_s = self._forward_backward(
                indices, self.epoch * micro_batches + position
            )
            loss_sum += torch.tensor([loss_value, 1.0], dtype=torch.float64)
            if not stepped:
                continue
            self._optimizer_step(loss_value, loss_sum, forward_s, backward_s)
            if progress is not None:
                progress.update(1)
            if self.config.checkpoint_every and self.step % self.config.checkpoint_every == 0:
                self.save_checkpoint()
            if self.step >= self.total_steps or (until_step is not None and self.step >= until_step):
                break
        if progress is not None:
            progress.close()
        self._epoch_time_s += time.perf_counter() - started
        finished_epoch = self.data.sampler.state_dict()["position"] >= micro_batches
        if not (finished_epoch or self.done()):
            # A pause within the epoch: evaluating here would add a record an uninterrupted run has not.
            self.save_checkpoint()
            return None
        return self._end_epoch(finished_epoch)

    def _forward_backward(self, indices: torch.Tensor, micro_index: int) -> tuple[float, bool, float, float]:
        """One micro-batch's forward and backward: (its loss, whether the backward completed an optimizer
        step's gradients, the forward's seconds, the backward's)."""
        generator = self._seed_micro_batch(micro_index)
        x = self._transform(self.data.train_x[indices], generator).to(self.device)
        y = self.data.train_y[indices].to(self.device)
        t0 = time.perf_counter()
        loss = self.loss_fn(self.model(x), y)
        t1 = time.perf_counter()
        stepped = self.accumulate.backward(loss)
        t2 = time.perf_counter()
        return loss.item(), stepped, t1 - t0, t2 - t1

    def _optimizer_step(self, loss_value: float, loss_sum: torch.Tensor, forward_s: float, backward_s: float) -> None:
        """Steps the optimizer and the schedule, and records the step (logging the mean loss of the
        micro-batches since the last log line, all ranks', every --log-every steps)."""
        self.optimizer.step()
        if self.scheduler:
            self.scheduler.step()
        self.optimizer.zero_grad()
        self.step += 1
        record = {
            "step": self.step,
            "epoch": self.epoch,
            "local_loss": loss_value,
            "lr": self.optimizer.param_groups[0]["lr"],
            "forward_s": forward_s,
            "backward_s": backward_s,
        }
        if isinstance(self.model, DistributedDataParallel):
            stats = self.model.reducer_stats()
            record["comm_wait_s"] = stats["last_wait_us"] / 1e6
        if self.step % self.config.log_every == 0 or self.step == self.total_steps:
            comm.all_reduce(loss_sum)
            record["loss"] = float(loss_sum[0] / loss_sum[1])
            self._log(
                f"epoch {self.epoch + 1} step {self.step}/{self.total_steps} loss {record['loss']:.4f} "
                f"lr {record['lr']:.4g}"
            )
            loss_sum.zero_()
        self.history["steps"].append(record)

    def _end_epoch(self, finished_epoch: bool) -> dict:
        """The evaluation at an epoch's end (or at the run's last step), its record, and the checkpoint."""
        self._take_rank_0_buffers()
        result = evaluate(
            self.model if self._fully_sharded() else self._module(),
            self.data.test_x,
            self.data.test_y,
            self._eval_transform,
            self.config.eval_batch_size,
            self.device,
        )
        epoch_time, self._epoch_time_s = self._epoch_time_s, 0.0
        record = {
            "epoch": self.epoch,
            "step": self.step,
            "epoch_time_s": epoch_time,
            "test_loss": result["loss"],
            "test_accuracy": result["accuracy"],
            "test_samples": result["samples"],
        }
        self._log(
            f"epoch {self.epoch + 1}: test loss {result['loss']:.4f} accuracy {100 * result['accuracy']:.2f}% "
            f"({result['samples']} samples), {epoch_time:.1f}s"
        )
        self.history["epochs"].append(record)
        if finished_epoch:
            self.epoch += 1
            self._epoch_batches = None
        self.save_checkpoint()
        return record

    def _take_rank_0_buffers(self) -> None:
        """Gives every rank rank 0's buffers (plain BatchNorm's running statistics are each rank's own),
        so that the distributed evaluation scores the model that model.pt and the checkpoint hold."""
        if self.world_size > 1:
            with torch.no_grad():
                broadcast_tensors(list(self._module().buffers()))  # one broadcast per dtype

    def _progress_bar(self):
        if self.rank != 0 or self.config.progress is False:
            return None
        from tqdm import tqdm

        done_in_epoch = self.step - self.epoch * self.data.steps_per_epoch
        desc = f"{self.progress_label} epoch {self.epoch + 1}/{self.config.epochs}".lstrip()
        return tqdm(
            total=self.data.steps_per_epoch,
            initial=max(0, done_in_epoch),
            desc=desc,
            unit="step",
            leave=False,
            file=sys.stderr,
            # A bar redrawn into a pipe or a log file turns into thousands of fragments.
            disable=None if self.config.progress is None else False,
        )

    # -- the whole run -------------------------------------------------------------------------
    def summary(self) -> dict:
        peak = torch.tensor([float(_peak_rss_bytes())], dtype=torch.float64)
        comm.all_reduce(peak, op="max")
        last = self.history["epochs"][-1] if self.history["epochs"] else {}
        return {
            "config": dataclasses.asdict(self.config),
            "world_size": self.world_size,
            "global_batch_size": self.data.global_batch,
            "micro_batch_per_rank": self.data.micro_batch,
            "batch_norm": self.batch_norm,
            "notes": self.notes,
            "final_test_accuracy": last.get("test_accuracy"),
            "final_test_loss": last.get("test_loss"),
            "peak_rss_bytes_max_over_ranks": int(peak),
            "history": self.history,
        }

    def header(self) -> str:
        """What runs, in two lines: the pipeline, then the process group and how its collectives travel.

        Collective (``comm.resolved_transport``): every rank must call it."""
        transport = comm.resolved_transport()
        transport = {"shm": "shared memory", "process_group": "the process group's send/recv"}.get(transport, transport)
        backend = dist.get_backend()
        if self.config.impl == "ddpkit":
            ddp = "ddpkit.DistributedDataParallel"
            collectives = f"ddpkit's collectives over {transport}"
        else:
            # torch's DDP goes through the process group, whatever its backend; ddpkit's own collectives
            # serve the evaluation and the loss log.
            ddp = "torch.nn.parallel.DistributedDataParallel"
            collectives = (
                f"torch's DDP all-reduces gradients through the process group ({backend}); "
                f"evaluation and loss logs use ddpkit's collectives over {transport}"
            )
        # A run that --max-steps cuts short runs fewer epochs than --epochs asks for: say what will run.
        steps_per_epoch = self.data.steps_per_epoch
        epochs = math.ceil(self.total_steps / steps_per_epoch)
        length = f"{self.total_steps} optimizer steps in {epochs} epoch{'' if epochs == 1 else 's'}"
        if self.total_steps < steps_per_epoch * self.config.epochs:
            length += (
                f" (--max-steps {self.config.max_steps} of --epochs {self.config.epochs}; "
                f"{steps_per_epoch} steps an epoch)"
            )
        return (
            f"training {self.config.model} on {self.config.dataset} with {ddp} and {self.batch_norm}: "
            f"micro-batch {self.data.micro_batch}/rank, accumulation {self.config.accumulation_steps}, global "
            f"batch {self.data.global_batch}, {length}\n"
            f"process group: backend {backend}, world size {self.world_size}, device "
            f"{self.device.type}; {collectives}"
        )

    def run(self) -> dict:
        """Trains to the end, writes the model and the metrics, and returns the metrics. A run whose
        checkpoint has finished already trains nothing: it says so, and writes model.pt and
        metrics.json from the checkpoint only where they are missing (a run stopped between writing
        its last checkpoint and them)."""
        header = self.header()
        for note in self.notes:
            self._log(f"note: {note}")
        if self.done():
            return self._finished_already()
        self._log(header)
        while not self.done():
            self.train_epoch()
        summary = self.summary()
        model_state = self._model_state() if self.out_dir else None  # on every rank: a collective when sharded
        if self.rank == 0 and self.out_dir:
            save_atomically(model_state, self.out_dir / "model.pt")
            write_json_atomically(summary, self.out_dir / "metrics.json")
            self._log(
                f"wrote {self.out_dir / 'metrics.json'}, {self.out_dir / 'model.pt'} and "
                f"{self.out_dir / 'checkpoint.pt'}"
            )
        return summary

    def _finished_already(self) -> dict:
        """``run`` of a checkpoint whose run has finished: the metrics, with model.pt and metrics.json
        written from it where missing."""
        summary = self.summary()
        finished = f"epoch {self.epoch}" if self.epoch >= self.config.epochs else f"optimizer step {self.step}"
        missing = [
            name
            for name in ("model.pt", "metrics.json")
            if self.rank == 0 and self.out_dir and not (self.out_dir / name).exists()
        ]
        model_state = self._model_state() if self.out_dir else None  # on every rank: a collective when sharded
        if "model.pt" in missing:
            save_atomically(model_state, self.out_dir / "model.pt")
        if "metrics.json" in missing:
            write_json_atomically(summary, self.out_dir / "metrics.json")
        if missing:
            self._log(
                f"{self.resumed_from}: the run already finished at {finished}; wrote the missing "
                f"{' and '.join(str(self.out_dir / name) for name in missing)} from it"
            )
            return summary
        how = (
            f"pass --epochs {self.config.epochs + 1} (or more) to continue"
            if not self.config.max_steps
            else "use another --out or --no-resume to train again"
        )
        self._log(f"{self.resumed_from}: the run already finished at {finished}; nothing to do ({how})")
        return summary


# ----------------------------------------------------------------------------------------------
# The program


def _one_line(message: str) -> str:
    message = " ".join(str(message).split())
    return message if message.startswith("ddpkit") else f"ddpkit: {message}"


def _fail(message: str, status: int, speaker: bool) -> None:
    if speaker:
        print(_one_line(message), file=sys.stderr, flush=True)
    sys.exit(status)


def main(argv: list[str] | None = None) -> None:
    """The program (``cli.py``'s docstring): trains one rank's share, as torchrun or the command line says."""
    config, args = parse_args(argv)
    # Before the group exists the rank is what torchrun or --rank says.
    first = (args.rank if args.rank is not None else int(os.environ.get("RANK", "0"))) == 0
    try:
        info = init_from_args(args)
    except ValueError as error:
        _fail(str(error), 2, first)
    except dist.DistError as error:  # e.g. --master-addr/--master-port that cannot be reached or bound
        _fail(
            f"ddpkit: cannot set up the process group: {str(error).splitlines()[0] if str(error) else error!r}",
            1,
            first,
        )
    try:
        Trainer(config, info).run()
    except UsageError as error:
        _fail(str(error), 1, info.rank == 0)
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
