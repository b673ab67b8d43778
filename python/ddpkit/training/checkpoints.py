"""A training run's files: written atomically (``save_atomically``, ``write_json_atomically``: a crash
leaves the old file or the new one, never half of one), and the checkpoint a run continues, read on
every rank (``read_checkpoint``) and checked to belong to the same run (``check_same_run``)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from ..atomic import write_atomically
from .config import RUN_DEFINING, TrainConfig, UsageError, resolved_augment


def save_atomically(obj, path: Path) -> None:
    write_atomically(path, lambda handle: torch.save(obj, handle))


def write_json_atomically(obj, path: Path) -> None:
    write_atomically(path, lambda handle: handle.write((json.dumps(obj, indent=1) + "\n").encode()))


def read_checkpoint(path: Path | None, rank: int, world_size: int, any_world_size: bool = False) -> dict | None:
    """The checkpoint at ``path`` on every rank (rank 0 reads it and broadcasts it: nodes need not share a
    file system), or None where there is none; raises ``UsageError`` on every rank for a file that is no
    checkpoint of this many ranks (of any number with ``any_world_size``). Collective."""
    holder = [None]
    if rank == 0 and path is not None and path.exists():
        try:
            holder[0] = torch.load(path, map_location="cpu", weights_only=False)
            if not isinstance(holder[0], dict) or not {"config", "world_size", "model"} <= holder[0].keys():
                raise ValueError("not a ddpkit training checkpoint")
        except Exception as exc:  # whatever torch.load raises for a file that is no checkpoint
            holder[0] = {
                "error": f"ddpkit: checkpoint {path} cannot be resumed ({type(exc).__name__}: "
                f"{exc}); use another --out or --no-resume"
            }
    dist.broadcast_object_list(holder, src=0)
    state = holder[0]
    if state is None:
        return None
    if "error" in state:
        raise UsageError(state["error"])
    if state["world_size"] != world_size and not any_world_size:
        raise UsageError(
            f"ddpkit: checkpoint {path} was written by {state['world_size']} ranks, this run has "
            f"{world_size}; use another --out or --no-resume (a run with --global-batch-size resumes at any "
            "world size)"
        )
    return state


def check_same_run(state: dict, config: TrainConfig, path: Path) -> bool:
    """Raises ``UsageError`` unless checkpoint ``state`` belongs to the run ``config`` defines; whether
    ``config`` extends the finished run with more epochs.

    More epochs continue a run that has finished all of its own; anywhere else a different length
    would change the learning-rate schedule under the run."""
    saved = dict(state["config"])
    saved["augment"] = resolved_augment(saved.get("augment"), saved["dataset"])  # older checkpoints kept None
    extending = config.epochs > saved["epochs"] and state["epoch"] >= saved["epochs"] and not saved.get("max_steps")
    changed = [
        f"{name} {saved.get(name)!r} -> {getattr(config, name)!r}"
        for name in RUN_DEFINING
        if saved.get(name) != getattr(config, name) and not (name == "epochs" and extending)
    ]
    if changed:
        raise UsageError(
            f"ddpkit: checkpoint {path} belongs to a different run ({', '.join(changed)}); "
            "resuming it would mix two runs: use another --out or --no-resume"
        )
    return extending
