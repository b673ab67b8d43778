"""The candidates of bench_sharding.py, built on every rank of its pools: each is one way to train the same
MLP with AdamW, and ``CANDIDATES`` maps its name to its builder. A candidate is added here and nowhere else
(with its bytes per parameter in ``STATE_BYTES_PER_PARAM`` when it has a target): the driver times, measures
and checks every name in ``CANDIDATES`` alike.

Model state (``model_state_bytes``) is the storage of the parameters, their gradients and the optimizer's
state on a rank, each storage counted once however many tensors view it: the parameters (a DTensor's local
shard), their ``.grad``, every tensor of the optimizer's state, and ddpkit's gradient buckets and shards
(which ddpkit's gradients are views of). It is counted after a backward, before the step, when every
candidate holds its gradients. torch DDP's own buckets are not reachable and not counted, nor is ZeRO-2's
pool of transfer buffers, which is reported on its own (``transfer_bytes``: buffers a bucket's gradients
pass through on their way to the reduce-scatter, as FSDP's all-gather buffers are).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

import ddpkit

LR = 1e-4


def mlp(width: int, layers: int) -> nn.Sequential:
    """``layers`` Linear width x width (with bias), ReLU between them: 6 x 2048 is 25.2M parameters."""
    modules: list[nn.Module] = []
    for index in range(layers):
        modules.append(nn.Linear(width, width))
        if index < layers - 1:
            modules.append(nn.ReLU())
    return nn.Sequential(*modules)


_groups: dict = {}


def groups() -> dict:
    """The pool's world group (its backend "ddpkit") and a gloo group of the same ranks, made once per process."""
    if not _groups:
        if dist.get_backend() != "ddpkit":
            raise RuntimeError(f"bench_sharding's pools run on the ddpkit backend, not {dist.get_backend()}")
        _groups.update(ddpkit=dist.group.WORLD, gloo=dist.new_group(backend="gloo"))
    return _groups


@dataclass
class Built:
    """One candidate built on this rank: ``module`` is the unwrapped model, ``model`` what the step calls."""

    model: nn.Module
    module: nn.Module
    optimizer: torch.optim.Optimizer
    group: dist.ProcessGroup
    extra_state: Callable[[], list[torch.Tensor]] = field(default=lambda: [])  # e.g. ddpkit's buckets
    transfer_bytes: Callable[[], int] = field(default=lambda: 0)
    # Every parameter whole, flattened in parameters() order, where the module's parameters are not (ZeRO-3's
    # are this rank's pieces): a collective.
    whole_parameters: Callable[[], torch.Tensor] | None = None
    param_count: int | None = None  # the model's parameters, where module.parameters() are pieces

    def step(self, x: torch.Tensor) -> None:
        self.model(x).square().mean().backward()
        self.optimizer.step()
        self.optimizer.zero_grad()

    def finish(self) -> None:
        """Waits for what a step leaves running (ZeRO's parameter all-gathers)."""
        wait = getattr(self.optimizer, "wait_for_parameters", None)
        if wait is not None:
            wait()


def _ddpkit_ddp(width: int, layers: int, algorithm: str, optimizer: Callable) -> Built:
    model = ddpkit.DistributedDataParallel(mlp(width, layers), algorithm=algorithm)
    built = Built(model, model.module, optimizer(model), dist.group.WORLD)
    reducer = model._native_reducer
    built.extra_state = lambda: list(reducer().buckets()) + list(reducer().gradient_shards())
    built.transfer_bytes = lambda: int(reducer().stats()["transfer_bytes"])
    return built


def ddpkit_ddp(width: int, layers: int, algorithm: str = "auto") -> Built:
    return _ddpkit_ddp(width, layers, algorithm, lambda m: torch.optim.AdamW(m.parameters(), lr=LR))


def zero1(width: int, layers: int, algorithm: str = "auto") -> Built:
    return _ddpkit_ddp(
        width,
        layers,
        algorithm,
        lambda m: ddpkit.ShardedOptimizer(m.parameters(), torch.optim.AdamW, shard_gradients=False, lr=LR),
    )


def zero2(width: int, layers: int, algorithm: str = "auto") -> Built:
    return _ddpkit_ddp(
        width, layers, algorithm, lambda m: ddpkit.ShardedOptimizer(m.parameters(), torch.optim.AdamW, lr=LR)
    )


def torch_zero_ddpkit(width: int, layers: int, algorithm: str = "auto") -> Built:
    """torch's ZeroRedundancyOptimizer on ddpkit's DDP, its broadcasts on the "ddpkit" world group."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return _ddpkit_ddp(
        width, layers, algorithm, lambda m: ZeroRedundancyOptimizer(m.parameters(), torch.optim.AdamW, lr=LR)
    )


def _fsdp2(width: int, layers: int, group: dist.ProcessGroup) -> Built:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    model = mlp(width, layers)
    mesh = DeviceMesh.from_group(group, "cpu")
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return Built(model, model, torch.optim.AdamW(model.parameters(), lr=LR), group)


def fsdp2_ddpkit(width: int, layers: int, algorithm: str = "auto") -> Built:
    return _fsdp2(width, layers, groups()["ddpkit"])


def fsdp2_gloo(width: int, layers: int, algorithm: str = "auto") -> Built:
    return _fsdp2(width, layers, groups()["gloo"])


def torch_ddp_gloo(width: int, layers: int, algorithm: str = "auto") -> Built:
    group = groups()["gloo"]
    model = torch.nn.parallel.DistributedDataParallel(mlp(width, layers), process_group=group)
    return Built(model, model.module, torch.optim.AdamW(model.parameters(), lr=LR), group)


def _zero3(width: int, layers: int, compute_dtype: torch.dtype | None) -> Built:
    """ddpkit.FullyShardedDataParallel, each Linear a unit (its default), the biases whole (persistent)."""
    module = mlp(width, layers)
    count = sum(p.numel() for p in module.parameters())
    model = ddpkit.FullyShardedDataParallel(module, compute_dtype=compute_dtype)
    built = Built(model, model.module, torch.optim.AdamW(model.parameters(), lr=LR), dist.group.WORLD)
    built.param_count = count
    # Its buffers between uses (Note [Block cache]), as FSDP2's all-gather buffers: reported, not model state.
    built.transfer_bytes = lambda: int(model.sharding_stats()["cached_bytes"])
    built.whole_parameters = lambda: torch.cat([value.flatten() for value in model.state_dict().values()])
    return built


def zero3(width: int, layers: int, algorithm: str = "auto") -> Built:
    return _zero3(width, layers, None)


def zero3_bf16(width: int, layers: int, algorithm: str = "auto") -> Built:
    return _zero3(width, layers, torch.bfloat16)


# name -> builder(width, layers, algorithm): algorithm is ddpkit DDP's (the bytes phase asks for "ring").
CANDIDATES: dict[str, Callable[..., Built]] = {
    "ddpkit_ddp": ddpkit_ddp,
    "zero1": zero1,
    "zero2": zero2,
    "torch_zero_ddpkit": torch_zero_ddpkit,
    "fsdp2_ddpkit": fsdp2_ddpkit,
    "fsdp2_gloo": fsdp2_gloo,
    "torch_ddp_gloo": torch_ddp_gloo,
    "zero3": zero3,
    "zero3_bf16": zero3_bf16,
}
# Those whose collectives ddpkit runs, so that its counters see their bytes (bench_sharding's bytes phase).
ON_DDPKIT = ("ddpkit_ddp", "zero1", "zero2", "torch_zero_ddpkit", "fsdp2_ddpkit", "zero3", "zero3_bf16")
# The model state each should hold, in bytes per float32 parameter with AdamW at n ranks (the ZeRO paper's
# accounting, docs/sharding.md); the bar is within 5% of it.
STATE_BYTES_PER_PARAM: dict[str, Callable[[int], float]] = {
    "ddpkit_ddp": lambda n: 16.0,
    "zero1": lambda n: 4 + 4 + 8 / n,
    "zero2": lambda n: 4 + 12 / n,
    "fsdp2_ddpkit": lambda n: 16 / n,
    "fsdp2_gloo": lambda n: 16 / n,
    "zero3": lambda n: 16 / n,
    "zero3_bf16": lambda n: 16 / n,
}


def build(name: str, width: int, layers: int, algorithm: str = "auto") -> Built:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return CANDIDATES[name](width, layers, algorithm)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor._local_tensor if hasattr(tensor, "_local_tensor") else tensor


def model_state_bytes(built: Built) -> int:
    """The storage of the parameters, gradients and optimizer state on this rank, each storage once."""
    storages: dict[int, int] = {}

    def count(tensor) -> None:
        if torch.is_tensor(tensor) and tensor.numel() > 0:
            storage = _local(tensor).untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()

    for param in built.module.parameters():
        count(param)
        count(param.grad)
    optimizer = getattr(built.optimizer, "optim", built.optimizer)  # a sharded optimizer's inner one
    for state in optimizer.state.values():
        for value in state.values():
            count(value)
    for tensor in built.extra_state():
        count(tensor)
    return sum(storages.values())


def full_parameters(built: Built) -> torch.Tensor:
    """Every parameter whole, flattened (a collective for DTensors and ZeRO-3: every rank calls it)."""
    if built.whole_parameters is not None:
        return built.whole_parameters()
    parts = []
    for param in built.module.parameters():
        value = param.detach()
        parts.append((value.full_tensor() if hasattr(value, "full_tensor") else value).flatten())
    return torch.cat(parts)
