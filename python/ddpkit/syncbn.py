"""Synchronized batch normalization: statistics of the batch of every rank of a process group.

``SyncBatchNorm`` is a drop-in ``torch.nn.modules.batchnorm._BatchNorm`` (same state_dict as
BatchNorm) over the ``ddpkit::sync_batch_norm`` op, whose forward and backward kernels are
ddpkit's own (csrc/syncbn). A training-mode forward all-reduces exactly once and its backward
exactly once; eval mode, a group of one rank and an uninitialized ``torch.distributed`` communicate
nothing and give BatchNorm's result. See csrc/syncbn/syncbn.h for the contract.

Both ops have fake (meta) kernels, registered here with ``torch.library.register_fake``: they give
the shapes, dtypes and strides of the outputs without computing them, for FakeTensor tracing
(``torch.compile``, ``torch.export``), ``torch.library.opcheck`` and meta-device tensors. See Note
[SyncBatchNorm under torch.compile] for what compiling a model with this layer does.
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn.modules.batchnorm import _BatchNorm

from ._C import sync_batch_norm_eager as _sync_batch_norm_eager
from ._on_import import when_imported
from .comm import ALGORITHMS

# torch 2.13 gave the batch-norm layers a `bias` flag; older releases always have a bias when affine.
_NORM_TAKES_BIAS = "bias" in inspect.signature(_BatchNorm.__init__).parameters

__all__ = ["SyncBatchNorm", "convert_sync_batchnorm", "sync_batch_norm", "set_native_cpu_kernels", "cpu_kernels"]


def _sync_group_name(group: dist.ProcessGroup | None) -> str | None:
    """The name of the group to synchronize over, or None when this rank is on its own."""
    if group is None:  # the world, if there is one; a group given needs none (torchft's quorum group)
        if not dist.is_available() or not dist.is_initialized():
            return None
        group = dist.group.WORLD
    return group.group_name if group.size() > 1 else None


def sync_batch_norm(
    input: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    training: bool,
    momentum: float,
    eps: float,
    algorithm: str = "auto",
    group: dist.ProcessGroup | None = None,
) -> Tensor:
    """Functional SyncBatchNorm: like ``torch.nn.functional.batch_norm``, with training-mode statistics
    over ``group`` (default: the world); ``momentum`` is the running-average factor for this call."""
    return _sync_batch_norm_op(
        input, weight, bias, running_mean, running_var, training, momentum, eps, algorithm, group, training
    )


# Note [SyncBatchNorm under torch.compile]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# torch.compile runs ddpkit::sync_batch_norm eagerly, outside the compiled graphs: a model holding
# SyncBatchNorm layers compiles, runs and gives eager's results, with a graph break at each layer's
# op (the layers before and after it are compiled). The op cannot go into a graph today because
# AOTAutograd (the default backend's first stage) must functionalize it, and it can only do that
# for a custom op that mutates its inputs (running_mean, running_var) if every output is a plain
# Tensor: the op's fourth output is an `int` (the number of values per channel, which with a
# process group is only known after the forward's all-reduce), so compiling it fails with "Found a
# custom (non-ATen) operator whose output has alias annotations". A schema whose count is a Tensor
# would let it in (tests/test_opcheck.py keeps that case as an expected failure). The same `int`
# limits the fake kernel: with a group it can only return an unbacked size for the group's total,
# which an `int` output cannot carry (a `SymInt` or Tensor one could). The break is at the op
# whether or not it communicates; eager execution also keeps its all-reduce where every rank
# expects it.
def _sync_batch_norm_op(
    input: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    batch_stats: bool,
    momentum: float,
    eps: float,
    algorithm: str,
    group: dist.ProcessGroup | None,
    synchronize: bool,
) -> Tensor:
    if torch.compiler.is_compiling():
        return _sync_batch_norm_op_eagerly(
            input, weight, bias, running_mean, running_var, batch_stats, momentum, eps, algorithm, group, synchronize
        )
    name = _sync_group_name(group) if synchronize else None
    output = _sync_batch_norm_eager(
        input, weight, bias, running_mean, running_var, batch_stats, momentum, eps, algorithm, name
    )  # Note [SyncBatchNorm's eager call] (csrc/python.cpp)
    if output is None:
        output = torch.ops.ddpkit.sync_batch_norm(
            input, weight, bias, running_mean, running_var, batch_stats, momentum, eps, algorithm, name
        )[0]
    return output


# What a compiled graph calls (Dynamo does not trace into it); eager calls skip the wrapper's cost.
# Made when Dynamo is imported (Note [Compile support waits for Dynamo], comm.py).
_sync_batch_norm_op_eagerly = None


def _disable_under_compile(dynamo) -> None:
    global _sync_batch_norm_op_eagerly
    _sync_batch_norm_op_eagerly = torch.compiler.disable(_sync_batch_norm_op)


when_imported("torch._dynamo", _disable_under_compile)


class SyncBatchNorm(_BatchNorm):
    """Batch normalization over the batches of all ranks of ``process_group`` (default: the world).

    A drop-in for ``torch.nn.SyncBatchNorm``: the same constructor arguments, in the same order and
    with the same defaults (``num_features, eps=1e-5, momentum=0.1, affine=True,
    track_running_stats=True, process_group=None, device=None, dtype=None``, keyword ``bias=True``),
    and the same state_dict. ddpkit's own options are keyword-only, after torch's: ``algorithm`` is
    the all-reduce algorithm (``ddpkit.comm.ALGORITHMS``; ``"process_group"`` is the group's own,
    e.g. NCCL).

    Accepts (N, C), (N, C, L), (N, C, H, W) and (N, C, D, H, W) inputs, any of float32, float64,
    float16 and bfloat16 (float16/bfloat16 inputs with float32 parameters are fine), on CPU as well
    as on GPUs. Ranks may hold different batch sizes, including none. Running statistics,
    ``momentum=None`` (cumulative average) and ``track_running_stats`` follow ``torch.nn.BatchNorm*d``
    for the global batch. ``weight``/``bias`` gradients are this rank's, as with
    ``torch.nn.SyncBatchNorm``: averaging them across ranks (DDP) gives the global batch's gradient.

    ``torch.compile``: a model holding this layer compiles, runs and gives eager's results; each
    layer's op runs eagerly at a graph break, between compiled graphs (Note [SyncBatchNorm under
    torch.compile] in this file says why).
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: dist.ProcessGroup | None = None,
        device=None,
        dtype=None,
        *,
        algorithm: str = "auto",
        bias: bool = True,
    ) -> None:
        if isinstance(device, str) and device in ALGORITHMS:
            raise TypeError(
                f"ddpkit.SyncBatchNorm: {device!r} was passed as `device`; `algorithm` is keyword-only "
                f"(SyncBatchNorm(num_features, ..., algorithm={device!r}))"
            )
        if algorithm not in ALGORITHMS:
            raise ValueError(f"ddpkit.SyncBatchNorm: unknown algorithm {algorithm!r}; expected one of {ALGORITHMS}")
        if not _NORM_TAKES_BIAS and not bias:
            raise TypeError(
                f"ddpkit.SyncBatchNorm: bias=False needs torch >= 2.13 (torch {torch.__version__} batch-norm "
                "layers have no `bias` flag)"
            )
        extra = {"bias": bias} if _NORM_TAKES_BIAS else {}
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype, **extra)
        self.process_group = process_group
        self.algorithm = algorithm

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() not in (2, 3, 4, 5):
            raise ValueError(f"ddpkit.SyncBatchNorm: expected a 2D, 3D, 4D or 5D input (got {input.dim()}D input)")

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, algorithm={self.algorithm!r}"

    def forward(self, input: Tensor) -> Tensor:
        self._check_input_dim(input)
        # torch's _BatchNorm rules: which statistics are used, and the running-average factor.
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                factor = 1.0 / float(self.num_batches_tracked)
        batch_stats = self.training or (self.running_mean is None and self.running_var is None)
        keep_running = not self.training or self.track_running_stats
        # Only training synchronizes, as torch.nn.SyncBatchNorm: eval without running statistics
        # normalizes each rank's batch by its own statistics.
        return _sync_batch_norm_op(
            input,
            self.weight,
            self.bias,
            self.running_mean if keep_running else None,
            self.running_var if keep_running else None,
            batch_stats,
            factor,
            self.eps,
            self.algorithm,
            self.process_group,
            self.training,
        )


def convert_sync_batchnorm(
    module: torch.nn.Module, process_group: dist.ProcessGroup | None = None, algorithm: str = "auto"
) -> torch.nn.Module:
    """Replaces every batch-norm layer of ``module`` (BatchNorm1d/2d/3d, torch's SyncBatchNorm) by a
    ``ddpkit.SyncBatchNorm``, like ``torch.nn.SyncBatchNorm.convert_sync_batchnorm``.

    Each new layer keeps the old one's own settings (``num_features``, ``eps``, ``momentum``,
    ``affine``, ``track_running_stats``, with or without ``bias``; the constructor defaults play no
    part) and holds the old layer's parameter and buffer objects themselves, as torch's conversion
    does (so values, device, dtype and ``requires_grad`` are kept, and an optimizer built before the
    conversion still updates them), in the same training mode. ``ddpkit.SyncBatchNorm`` layers are
    left as they are. Returns the converted module, which is ``module`` itself unless ``module`` is
    a batch-norm layer."""
    if isinstance(module, _BatchNorm) and not isinstance(module, SyncBatchNorm):
        converted = SyncBatchNorm(
            module.num_features,
            module.eps,
            module.momentum,
            module.affine,
            module.track_running_stats,
            process_group,
            device="meta",
            algorithm=algorithm,
            bias=module.bias is not None or not module.affine,
        )
        for name in ("weight", "bias"):
            setattr(converted, name, getattr(module, name))
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            converted.register_buffer(name, getattr(module, name))
        converted.train(module.training)
        if hasattr(module, "qconfig"):
            converted.qconfig = module.qconfig
        return converted
    for name, child in module.named_children():
        module.add_module(name, convert_sync_batchnorm(child, process_group, algorithm))
    return module


def set_native_cpu_kernels(enabled: bool) -> None:
    """Runs CPU tensors through ddpkit's vectorised CPU kernels (default) or through the
    device-generic ATen code other devices use; for comparing the two. Process-wide."""
    torch.ops.ddpkit.set_syncbn_native_cpu_kernels(enabled)


def cpu_kernels() -> str:
    """What CPU tensors run: ``"cpu-<capability>"`` (e.g. ``"cpu-AVX512"``) or ``"aten"``."""
    return torch.ops.ddpkit.syncbn_cpu_kernels()


# ----------------------------------------------------------------------------------------------
# Fake (meta) kernels: output metadata only, as the C++ kernels lay their outputs out.


def _prepared_input(input: Tensor) -> Tensor:
    """The tensor the C++ kernels compute on (``prepare_input`` in csrc/syncbn/kernels.cpp): the input
    itself when it is contiguous or channels-last (4D/5D), else a contiguous copy; (N, C) inputs and
    inputs with one value per channel and sample are made contiguous. Outputs follow its layout."""
    spatial = 1
    for size in input.shape[2:]:
        spatial *= size
    if input.dim() == 2 or spatial == 1:
        return input.contiguous()
    if input.is_contiguous():
        return input
    if input.dim() == 4 and input.is_contiguous(memory_format=torch.channels_last):
        return input
    if input.dim() == 5 and input.is_contiguous(memory_format=torch.channels_last_3d):
        return input
    return input.contiguous()


@torch.library.register_fake("ddpkit::sync_batch_norm")
def _sync_batch_norm_fake(
    input, weight, bias, running_mean, running_var, training, momentum, eps, algorithm, group_name
):
    torch._check(
        input.dim() >= 2,
        lambda: f"ddpkit::sync_batch_norm: expected an input of shape (N, C, *), got {input.dim()} dimensions",
    )
    channels = input.shape[1]
    for tensor in (weight, bias, running_mean, running_var):
        if tensor is not None:
            torch._check(
                tensor.dim() == 1 and tensor.shape[0] == channels,
                lambda: f"ddpkit::sync_batch_norm: per-channel tensors should have shape [{channels}]",
            )
    output = torch.empty_like(_prepared_input(input))
    # The saved statistics, in the arithmetic dtype (Note [Saved statistics] in csrc/syncbn/kernels.h).
    arithmetic = torch.float64 if input.dtype == torch.float64 else torch.float32
    mean = input.new_empty((channels,), dtype=arithmetic)
    invstd = input.new_empty((channels,), dtype=arithmetic)
    if training and group_name is not None:
        # The group's total, known only after the all-reduce.
        count = torch.library.get_ctx().new_dynamic_size()
    else:
        count = input.numel() // channels
    return output, mean, invstd, count


@torch.library.register_fake("ddpkit::sync_batch_norm_backward")
def _sync_batch_norm_backward_fake(
    grad_output, input, weight, mean, invstd, training, count, algorithm, group_name, output_mask
):
    channels = input.shape[1]
    torch._check(
        grad_output.shape == input.shape,
        lambda: "ddpkit::sync_batch_norm_backward: grad_output must match the input's shape",
    )
    if weight is not None:
        dtype = weight.dtype
    elif input.dtype in (torch.float16, torch.bfloat16):
        dtype = torch.float32
    else:
        dtype = input.dtype
    grad_input = torch.empty_like(_prepared_input(input)) if output_mask[0] else None
    grad_weight = input.new_empty((channels,), dtype=dtype) if output_mask[1] else None
    grad_bias = input.new_empty((channels,), dtype=dtype) if output_mask[2] else None
    return grad_input, grad_weight, grad_bias
