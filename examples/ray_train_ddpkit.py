"""Ray Train on the "ddpkit" backend: ``TorchTrainer(..., torch_config=TorchConfig(backend="ddpkit"))``. Ray
creates each worker's process group by that name before the training function runs, which works because
torch registered the backend at ``import torch`` (ddpkit's entry point); nothing imports ddpkit first.
Checked against the same training on gloo, in the same workers.

    .venv/bin/python examples/ray_train_ddpkit.py

A local Ray cluster of 2 CPUs runs 2 workers. Each trains the same small model three ways on the same
batches: Ray's ``prepare_model`` (torch's DistributedDataParallel on the default group, so on ddpkit's
engine), ``ddpkit.DistributedDataParallel`` (``prepare_model(..., parallel_strategy=None)`` leaves the
wrapping to it), and torch's DDP on a gloo group; all three end with the same weights, bit for bit.
"""

import json
import tempfile
from pathlib import Path

import ray
import torch
import torch.distributed as dist
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer, prepare_model
from torch import nn

WORKERS, STEPS, BATCH = 2, 5, 16


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))


def trained(model: nn.Module) -> torch.Tensor:
    """``model``'s weights after STEPS steps of SGD on this rank's batches."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(100 + dist.get_rank())
    for _ in range(STEPS):
        x, y = torch.randn(BATCH, 8, generator=generator), torch.randint(0, 4, (BATCH,), generator=generator)
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def train_loop(config: dict) -> None:
    import ddpkit  # for its DistributedDataParallel: the process group below needed no import

    assert dist.get_backend() == "ddpkit", dist.get_backend()
    gloo = dist.new_group(backend="gloo")
    wrapped = prepare_model(make_model())
    results = {
        type(wrapped).__module__ + "." + type(wrapped).__name__: trained(wrapped),
        "ddpkit.DistributedDataParallel": trained(
            ddpkit.DistributedDataParallel(prepare_model(make_model(), parallel_strategy=None))
        ),
    }
    reference = trained(nn.parallel.DistributedDataParallel(make_model(), process_group=gloo))
    unequal = torch.tensor([float(not torch.equal(weights, reference)) for weights in results.values()])
    dist.all_reduce(unequal, group=gloo)  # how many ranks' weights differ from gloo's, per wrapper
    if dist.get_rank() == 0:
        Path(config["out"]).write_text(json.dumps(dict(zip(results, unequal.tolist()))))


def main() -> None:
    ray.init(num_cpus=WORKERS, include_dashboard=False, log_to_driver=False)
    try:
        with tempfile.TemporaryDirectory() as storage:
            TorchTrainer(
                train_loop,
                train_loop_config={"out": f"{storage}/unequal.json"},
                torch_config=TorchConfig(backend="ddpkit"),
                scaling_config=ScalingConfig(num_workers=WORKERS, use_gpu=False),
                run_config=RunConfig(storage_path=storage, name="ray_train_ddpkit"),
            ).fit()
            unequal = json.loads(Path(storage, "unequal.json").read_text())
    finally:
        ray.shutdown()
    assert set(unequal.values()) == {0.0}, f"ranks whose weights differ from gloo's: {unequal}"
    print(
        f"ray_train_ddpkit: {WORKERS} Ray Train workers on the ddpkit backend; {' and '.join(unequal)} trained "
        f"{STEPS} steps to gloo's weights, bit for bit, on every rank"
    )


if __name__ == "__main__":
    main()
