"""ddpkit on CUDA: the hand-written SyncBatchNorm kernels (csrc/syncbn/cuda/) against ddpkit's CPU
kernels and torch's BatchNorm, SyncBatchNorm in two processes sharing one GPU, and DDP on CUDA.

Everything here is skipped, with the reason, on a machine without a CUDA device. On one with a
device, test_cuda_kernels_are_built fails if the extension was built without its CUDA kernels
(CMake then printed "ddpkit: CUDA kernels skipped: ..."), and the kernel tests skip naming it.

Distributed cases use gloo for two ranks on the same GPU (NCCL refuses two ranks on one device).
gloo's send/recv cannot carry CUDA pointers, so on a gloo group ddpkit's collectives copy CUDA
tensors to the host, run there (over shared memory: both ranks share the host) and copy back
(Note [Device tensors on a host group] in csrc/comm/engine/engine.h); the collective tests below check
every collective that way.

DDPKIT_TEST_CUDA_ON_CPU=1 runs the same cases with CPU tensors instead (the CUDA-only checks skip):
a dry run of this file's own logic on a machine without a GPU, not a test of the CUDA kernels.
"""

import os

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import ProfilerActivity, profile

import ddpkit
from ddpkit.testing import WorkerPool

from helpers import even_sizes, shard

DRY_RUN = os.environ.get("DDPKIT_TEST_CUDA_ON_CPU") == "1"
CUDA = torch.cuda.is_available()
DEVICE = "cpu" if DRY_RUN else "cuda"
pytestmark = pytest.mark.skipif(
    not CUDA and not DRY_RUN,
    reason=f"no CUDA device: torch {torch.__version__} (torch.version.cuda={torch.version.cuda}) "
    "sees none; the GPU part of issue 13 runs these",
)

OP = "ddpkit::sync_batch_norm"
CUDA_KERNELS = torch._C._dispatch_has_kernel_for_dispatch_key(OP, "CUDA")
needs_kernels = pytest.mark.skipif(
    not CUDA_KERNELS and not DRY_RUN,
    reason="ddpkit was built without its CUDA kernels (no CUDA compiler at build time?); "
    "CUDA tensors run the ATen-generic code",
)

TIGHT = 1e-5  # float32, against float64 BatchNorm (as tests/test_syncbn.py)
DTYPE_ATOL = {torch.float64: 1e-12, torch.float32: TIGHT, torch.bfloat16: 3e-2, torch.float16: 4e-3}
# Plus the output's own rounding (half an ulp) where the affine parameters scale it past 1.
DTYPE_RTOL = {torch.float64: 0.0, torch.float32: 0.0, torch.bfloat16: 2**-8, torch.float16: 2**-11}


only_cuda = pytest.mark.skipif(DRY_RUN, reason="checks CUDA itself (DDPKIT_TEST_CUDA_ON_CPU=1 dry run)")


# ----------------------------------------------------------------------------------------------
# Helpers shared by the parent and the workers


def set_device():
    """Both ranks of a pool share GPU 0."""
    if DEVICE == "cuda":
        torch.cuda.set_device(0)


def batch_norm_class(ndim):
    return {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}[ndim]


def parameter_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def step(layer, x, grad_out, memory_format=torch.contiguous_format):
    """One forward + backward of `layer` on `x` (on the layer's device) with output gradient
    `grad_out`: output, input gradient, weight and bias gradients, state, all on the CPU."""
    device = layer.running_mean.device if layer.running_mean is not None else next(layer.parameters()).device
    x = x.detach().to(device, copy=True).contiguous(memory_format=memory_format).requires_grad_()
    y = layer(x)
    y.backward(grad_out.to(device).contiguous(memory_format=memory_format))
    grads = (layer.weight.grad.cpu(), layer.bias.grad.cpu()) if layer.affine else None
    return dict(
        y=y.detach().cpu(),
        grad=x.grad.cpu(),
        affine_grads=grads,
        state={k: v.cpu() for k, v in layer.state_dict().items()},
        layout_kept=y.is_contiguous(memory_format=memory_format) and x.grad.is_contiguous(memory_format=memory_format),
    )


def make_layers(features, affine, dtype, device, seed=0):
    """ddpkit.SyncBatchNorm and torch's BatchNorm with the same random affine parameters."""
    torch.manual_seed(seed)
    weight, bias = torch.randn(features), torch.randn(features)
    ours = ddpkit.SyncBatchNorm(features, affine=affine, dtype=dtype).to(device)
    if affine:
        with torch.no_grad():
            ours.weight.copy_(weight)
            ours.bias.copy_(bias)
    return ours


def torch_batch_norm(ndim, features, affine, dtype, device, seed=0):
    """torch's BatchNorm with make_layers' affine parameters."""
    layer = batch_norm_class(ndim)(features, affine=affine, dtype=dtype).to(device)
    if affine:
        torch.manual_seed(seed)
        weight, bias = torch.randn(features), torch.randn(features)
        with torch.no_grad():
            layer.weight.copy_(weight)
            layer.bias.copy_(bias)
    return layer


def reference(x, grad_out, features, affine, seed=0):
    """torch's BatchNorm in float64 on the CPU: the exact answer for the given values."""
    return step(torch_batch_norm(x.dim(), features, affine, torch.float64, "cpu", seed), x.double(), grad_out.double())


def assert_matches(result, expected, atol, affine_atol=None, rtol=0.0):
    torch.testing.assert_close(result["y"].double(), expected["y"], atol=atol, rtol=rtol)
    torch.testing.assert_close(result["grad"].double(), expected["grad"], atol=atol, rtol=rtol)
    if expected["affine_grads"] is not None:
        for ours, theirs in zip(result["affine_grads"], expected["affine_grads"]):
            torch.testing.assert_close(ours.double(), theirs, atol=affine_atol or 1e-3, rtol=1e-5)
    for key in ("running_mean", "running_var"):
        torch.testing.assert_close(result["state"][key].double(), expected["state"][key], atol=1e-5, rtol=1e-5)


def cuda_kernel_names(fn):
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


# ----------------------------------------------------------------------------------------------
# The build


@only_cuda
def test_cuda_kernels_are_built():
    assert CUDA_KERNELS, (
        "ddpkit.sync_batch_norm has no CUDA kernel: the extension was built without "
        "csrc/syncbn/cuda (look for 'ddpkit: CUDA kernels skipped' in the build log; "
        "pip install --no-build-isolation -v . shows it)"
    )
    assert torch._C._dispatch_has_kernel_for_dispatch_key("ddpkit::sync_batch_norm_backward", "CUDA")


# (shape, memory format, whether a channel's values are reduced in several splits: Note [Reduction
# sinks] in csrc/syncbn/cuda/kernels.cuh). A single split ends in the reduction kernel itself; several
# end in a finishing kernel over the partials.
KERNEL_ROUTES = [
    ((64, 256), torch.contiguous_format, False),
    ((8, 32, 9, 9), torch.contiguous_format, False),
    ((8, 32, 9, 9), torch.channels_last, True),  # 648 rows of 32 channels: 10 splits
    ((16, 8, 64, 64), torch.contiguous_format, True),
    ((16384, 64), torch.contiguous_format, True),
]


@only_cuda
@needs_kernels
@pytest.mark.parametrize("shape,memory_format,split", KERNEL_ROUTES)
def test_hand_written_kernels_run(shape, memory_format, split):
    """The CUDA kernels launched by a training step are ddpkit's own, never torch's batch norm, and
    a channel reduced in several splits is finished by the finishing kernels, one in a single split
    in the reduction kernel (two launches per pass instead of three)."""
    layer = ddpkit.SyncBatchNorm(shape[1], affine=True).to(DEVICE)
    x = torch.randn(shape, device=DEVICE).contiguous(memory_format=memory_format).requires_grad_()
    names = cuda_kernel_names(lambda: layer(x).sum().backward())
    ours = [n for n in names if "ddpkit::syncbn::cuda::" in n]
    for kernel in ("moments_", "affine_", "grad_sums_"):
        assert any(kernel in n for n in ours), (kernel, names)
    finishing = [n for n in ours if "finish_kernel" in n]
    assert len(finishing) == (2 if split else 0), names
    torch_kernels = [n for n in names if "ddpkit::" not in n and ("batch_norm" in n.lower() or "welford" in n.lower())]
    assert not torch_kernels, names


@needs_kernels
@pytest.mark.parametrize("shape,memory_format,split", KERNEL_ROUTES)
def test_both_reduction_routes_match_float64_batch_norm(shape, memory_format, split):
    """Both routes of Note [Reduction sinks] on inputs whose mean is large against their spread."""
    torch.manual_seed(13)
    x, grad_out = 100 + 3 * torch.randn(shape), torch.randn(shape)
    on_cuda = step(make_layers(shape[1], True, torch.float32, DEVICE), x, grad_out, memory_format)
    expected = reference(x, grad_out, shape[1], True)
    assert_matches(on_cuda, expected, 1e-4, affine_atol=1e-2, rtol=1e-5)


def fused_shapes():
    """Planar shapes with at least a channel per multiprocessor (Note [One block per channel]): planes
    of 36 values (vector loads) and of 15 (none)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count if CUDA else 132
    return [(4, sms, 6, 6), (3, 2 * sms + 1, 5, 3)]


@only_cuda
@needs_kernels
def test_one_block_per_channel_runs_fused_kernels():
    """Without a group such an input runs one kernel per pass, not the reduction and element-wise
    kernels, and holds no sums or partials between them."""
    for shape in fused_shapes():
        layer = ddpkit.SyncBatchNorm(shape[1], affine=True).to(DEVICE)
        x = torch.randn(shape, device=DEVICE).requires_grad_()
        names = [n for n in cuda_kernel_names(lambda: layer(x).sum().backward()) if "ddpkit::syncbn::cuda::" in n]
        assert sum("fused_forward_planar_kernel" in n for n in names) == 1, names
        assert sum("fused_backward_planar_kernel" in n for n in names) == 1, names
        assert not [n for n in names if "moments_" in n or "grad_sums_" in n or "affine_" in n], names


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape_index", [0, 1])
def test_one_block_per_channel_matches_float64_batch_norm(dtype, shape_index):
    """The fused passes against float64 BatchNorm, float32 on inputs whose mean is large against their
    spread (1e4 + N(0, 1)), and with only the weight and bias gradients wanted."""
    shape = fused_shapes()[shape_index]
    torch.manual_seed(19)
    x = (1e4 + torch.randn(shape)) if dtype == torch.float32 else torch.randn(shape) * 2 + 0.5
    x, grad_out = x.to(dtype), torch.randn(shape).to(dtype)
    pdt = parameter_dtype(dtype)
    on_cuda = step(make_layers(shape[1], True, pdt, DEVICE), x, grad_out)
    expected = reference(x, grad_out, shape[1], True)
    atol, rtol = DTYPE_ATOL[dtype], DTYPE_RTOL[dtype]
    assert_matches(on_cuda, expected, atol, affine_atol=max(atol, 1e-3) * 10, rtol=rtol)
    layer = make_layers(shape[1], True, pdt, DEVICE)
    layer(x.to(DEVICE)).backward(grad_out.to(DEVICE))  # the input needs no gradient: weight and bias only
    for ours, theirs in zip((layer.weight.grad, layer.bias.grad), expected["affine_grads"]):
        torch.testing.assert_close(ours.cpu().double(), theirs, atol=max(atol, 1e-3) * 10, rtol=1e-5)


@needs_kernels
def test_non_contiguous_running_statistics():
    """Running estimates that are strided views are updated afterwards from the batch variance, which
    the CUDA passes compute only for them."""
    torch.manual_seed(17)
    features = 24
    ours = ddpkit.SyncBatchNorm(features, affine=False).to(DEVICE)
    ref = nn.BatchNorm1d(features, affine=False, dtype=torch.float64)
    storage = torch.zeros(2 * features, 2, device=DEVICE)
    ours.running_mean = storage[::2, 0]
    ours.running_var = storage[1::2, 1].fill_(1.0)
    assert not ours.running_mean.is_contiguous() and not ours.running_var.is_contiguous()
    for i in range(3):
        x, grad_out = torch.randn(20, features) * (i + 1) + i, torch.randn(20, features)
        assert_matches(step(ours, x, grad_out), step(ref, x.double(), grad_out.double()), TIGHT)


# ----------------------------------------------------------------------------------------------
# One process: CUDA kernels vs CPU kernels vs BatchNorm


@needs_kernels
@pytest.mark.parametrize("batch", [32, 64])
@pytest.mark.parametrize("features", [128, 256, 512, 1024])
def test_assignment_matrix(features, batch):
    torch.manual_seed(1000 * features + batch)
    x, grad_out = torch.randn(batch, features), torch.randn(batch, features)
    on_cuda = step(make_layers(features, True, torch.float32, DEVICE), x, grad_out)
    on_cpu = step(make_layers(features, True, torch.float32, "cpu"), x, grad_out)
    expected = reference(x, grad_out, features, True)
    assert_matches(on_cuda, expected, TIGHT)
    assert_matches(on_cpu, expected, TIGHT)
    torch.testing.assert_close(on_cuda["y"], on_cpu["y"], atol=TIGHT, rtol=0)
    torch.testing.assert_close(on_cuda["grad"], on_cpu["grad"], atol=TIGHT, rtol=0)
    # torch's own CUDA BatchNorm1d agrees too (cuDNN or its native kernels).
    torch_cuda = step(torch_batch_norm(2, features, True, torch.float32, DEVICE), x, grad_out)
    torch.testing.assert_close(on_cuda["y"], torch_cuda["y"], atol=1e-4, rtol=0)
    torch.testing.assert_close(on_cuda["grad"], torch_cuda["grad"], atol=1e-4, rtol=0)


@needs_kernels
@pytest.mark.parametrize(
    "shape,memory_format",
    [
        ((12, 24), torch.contiguous_format),
        ((12, 24, 7), torch.contiguous_format),
        ((40, 96, 3), torch.contiguous_format),  # planes shorter than a warp
        ((8, 24, 5, 6), torch.contiguous_format),
        ((8, 24, 5, 6), torch.channels_last),
        ((16, 8, 1, 1), torch.contiguous_format),  # one value per plane: the channels-inner layout
        ((6, 20, 3, 4, 5), torch.contiguous_format),
        ((6, 20, 3, 4, 5), torch.channels_last_3d),
        ((4, 33, 70, 70), torch.contiguous_format),  # odd channel count, long planes
        ((5, 1000, 3, 3), torch.channels_last),  # channel count not a multiple of 32
        ((32, 256, 32, 32), torch.contiguous_format),  # the benchmark's conv shape
        ((32, 256, 32, 32), torch.channels_last),
    ],
)
def test_shapes_and_layouts(shape, memory_format):
    torch.manual_seed(8)
    x, grad_out = torch.randn(shape) * 2 + 0.5, torch.randn(shape)
    on_cuda = step(make_layers(shape[1], True, torch.float32, DEVICE), x, grad_out, memory_format)
    on_cpu = step(make_layers(shape[1], True, torch.float32, "cpu"), x, grad_out, memory_format)
    expected = reference(x, grad_out, shape[1], True)
    assert on_cuda["layout_kept"]
    assert_matches(on_cuda, expected, TIGHT, affine_atol=1e-3)
    torch.testing.assert_close(on_cuda["y"], on_cpu["y"], atol=TIGHT, rtol=0)
    torch.testing.assert_close(on_cuda["grad"], on_cpu["grad"], atol=TIGHT, rtol=0)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize(
    "shape,memory_format",
    [((40, 96), torch.contiguous_format), ((40, 96, 3), torch.contiguous_format), ((8, 64, 6, 6), torch.channels_last)],
)
def test_dtypes(dtype, shape, memory_format):
    torch.manual_seed(10)
    x = torch.randn(shape).to(dtype)
    grad_out = torch.randn(shape).to(dtype)
    pdt = parameter_dtype(dtype)
    on_cuda = step(make_layers(shape[1], True, pdt, DEVICE), x, grad_out, memory_format)
    on_cpu = step(make_layers(shape[1], True, pdt, "cpu"), x, grad_out, memory_format)
    expected = reference(x, grad_out, shape[1], True)
    assert on_cuda["y"].dtype == dtype and on_cuda["grad"].dtype == dtype
    assert on_cuda["state"]["running_mean"].dtype == pdt
    atol = DTYPE_ATOL[dtype]
    rtol = DTYPE_RTOL[dtype]
    assert_matches(on_cuda, expected, atol, affine_atol=max(atol, 1e-3) * 10, rtol=rtol)
    torch.testing.assert_close(on_cuda["y"].double(), on_cpu["y"].double(), atol=atol, rtol=2 * rtol)
    torch.testing.assert_close(on_cuda["grad"].double(), on_cpu["grad"].double(), atol=atol, rtol=2 * rtol)


@needs_kernels
@pytest.mark.parametrize("shape", [(64, 256), (16, 32, 8, 8)])
def test_large_mean_inputs(shape):
    """1e4 + N(0, 1) in float32 (Note [CUDA moments]): exact against float64 BatchNorm."""
    torch.manual_seed(9)
    x, grad_out = 1e4 + torch.randn(shape), torch.randn(shape)
    on_cuda = step(make_layers(shape[1], False, torch.float32, DEVICE), x, grad_out)
    expected = reference(x, grad_out, shape[1], False)
    assert_matches(on_cuda, expected, TIGHT)


@needs_kernels
def test_eval_mode_and_running_statistics():
    torch.manual_seed(11)
    features = 48
    ours = ddpkit.SyncBatchNorm(features, affine=True, momentum=None).to(DEVICE)
    ref = nn.BatchNorm1d(features, momentum=None, dtype=torch.float64)
    ref.load_state_dict(ours.state_dict())
    for i in range(3):
        x, grad_out = torch.randn(20, features) * (i + 1) + i, torch.randn(20, features)
        for mode in (True, False):
            ours.train(mode)
            ref.train(mode)
            assert_matches(step(ours, x, grad_out), step(ref, x.double(), grad_out.double()), TIGHT, affine_atol=1e-3)


@needs_kernels
def test_empty_batch_without_a_group():
    """An empty batch gives empty outputs and leaves the running statistics alone, as on the CPU."""
    features = 16
    for device in (DEVICE, "cpu"):
        layer = ddpkit.SyncBatchNorm(features, affine=True).to(device)
        result = step(layer, torch.empty(0, features), torch.empty(0, features))
        assert result["y"].shape == (0, features) and result["grad"].shape == (0, features)
        assert torch.equal(result["state"]["running_mean"], torch.zeros(features))
        assert torch.equal(result["affine_grads"][0], torch.zeros(features))


# ----------------------------------------------------------------------------------------------
# Two processes sharing the GPU (gloo)


@pytest.fixture(scope="module")
def gpu_pool():
    created = {}

    def get():
        if "pool" not in created:
            created["pool"] = WorkerPool(2, backend="gloo", timeout=300, group_timeout=30)
            created["pool"].start()
        return created["pool"]

    yield get
    if "pool" in created:
        created["pool"].close()


def run_collectives(transport, algorithm, dtype):
    """Every ddpkit collective on CUDA tensors of a gloo group (Note [Device tensors on a host group])."""
    set_device()
    rank, n = dist.get_rank(), dist.get_world_size()
    out = {}
    t = (torch.arange(1000, device=DEVICE) % 64 * (rank + 1)).to(dtype)  # sums exact in bfloat16 too
    ddpkit.all_reduce(t, algorithm=algorithm, transport=transport)
    out["all_reduce"] = (t.device.type, t.cpu())
    b = torch.full((7,), rank + 5, device=DEVICE).to(dtype)
    ddpkit.broadcast(b, src=1, transport=transport)
    out["broadcast"] = (b.device.type, b.cpu())
    r = torch.full((9,), rank + 1, device=DEVICE).to(dtype)
    ddpkit.reduce(r, dst=0, transport=transport)
    out["reduce"] = (r.device.type, r.cpu() if rank == 0 else None)
    g = ddpkit.gather(torch.full((3,), rank, device=DEVICE).to(dtype), dst=0, transport=transport)
    out["gather"] = (g.device.type, g.cpu()) if rank == 0 else (None, None)
    chunks = torch.arange(n * 4, device=DEVICE).to(dtype).view(n, 4) if rank == 0 else None
    s = torch.empty(4, device=DEVICE, dtype=dtype)
    ddpkit.scatter(s, chunks, src=0, transport=transport)
    out["scatter"] = (s.device.type, s.cpu())
    out["resolved"] = ddpkit.comm.resolved_transport(transport=transport)
    return out


@pytest.mark.parametrize(
    "transport,algorithm",
    [("auto", "auto"), ("process_group", "auto"), ("process_group", "ring"), ("auto", "process_group")],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_collectives_on_device_tensors(gpu_pool, transport, algorithm, dtype):
    """gloo cannot send CUDA pointers: ddpkit stages through the host, and the results land on CUDA."""
    results = gpu_pool().run(run_collectives, transport, algorithm, dtype)
    expected_sum = (torch.arange(1000) % 64 * 3).to(dtype)
    for rank, r in enumerate(results):
        assert r["resolved"] == ("shm" if transport == "auto" else "process_group")
        assert r["all_reduce"][0] == DEVICE and torch.equal(r["all_reduce"][1], expected_sum)
        assert torch.equal(r["broadcast"][1], torch.full((7,), 6).to(dtype))
        assert torch.equal(r["scatter"][1], torch.arange(rank * 4, rank * 4 + 4).to(dtype))
        assert all(r[k][0] in (DEVICE, None) for k in ("broadcast", "reduce", "gather", "scatter"))
    assert torch.equal(results[0]["reduce"][1], torch.full((9,), 3).to(dtype))
    assert torch.equal(results[0]["gather"][1], torch.tensor([[0] * 3, [1] * 3]).to(dtype))


def run_sync_step(x, grad_out, sizes, algorithm, options):
    set_device()
    rank = dist.get_rank()
    local, _ = shard(x, sizes, rank)
    local_grad, _ = shard(grad_out, sizes, rank)
    torch.manual_seed(0)
    weight, bias = torch.randn(x.shape[1]), torch.randn(x.shape[1])
    layer = ddpkit.SyncBatchNorm(x.shape[1], affine=True, algorithm=algorithm, dtype=options.get("parameter_dtype")).to(
        DEVICE
    )
    with torch.no_grad():
        layer.weight.copy_(weight)
        layer.bias.copy_(bias)
    ddpkit.reset_comm_counters()
    result = step(layer, local, local_grad, options.get("memory_format", torch.contiguous_format))
    result["counters"] = ddpkit.comm_counters()
    return result


def check_group_result(results, x, grad_out, atol=TIGHT, rtol=0.0):
    expected = reference(x, grad_out, x.shape[1], True)
    torch.testing.assert_close(torch.cat([r["y"] for r in results]).double(), expected["y"], atol=atol, rtol=rtol)
    torch.testing.assert_close(torch.cat([r["grad"] for r in results]).double(), expected["grad"], atol=atol, rtol=rtol)
    # Each rank's affine gradients are its own sums; DDP's average makes them the global batch's.
    for i in range(2):
        torch.testing.assert_close(
            sum(r["affine_grads"][i] for r in results).double(), expected["affine_grads"][i], atol=1e-3, rtol=1e-5
        )
    for r in results:
        torch.testing.assert_close(
            r["state"]["running_var"].double(), expected["state"]["running_var"], atol=1e-5, rtol=1e-5
        )
        assert r["counters"]["collectives"] == 2, r["counters"]  # one per pass


@pytest.mark.parametrize("algorithm", ["process_group", "auto"])
@pytest.mark.parametrize("sizes", [[16, 16], [5, 27], [0, 32]], ids=["even", "uneven", "empty"])
@pytest.mark.parametrize("features", [128, 1024])
def test_sync_batch_norm_two_ranks_one_gpu(gpu_pool, algorithm, sizes, features):
    torch.manual_seed(features + sizes[0])
    x, grad_out = torch.randn(sum(sizes), features), torch.randn(sum(sizes), features)
    check_group_result(gpu_pool().run(run_sync_step, x, grad_out, sizes, algorithm, {}), x, grad_out)


@pytest.mark.parametrize(
    "dtype,memory_format",
    [
        (torch.float32, torch.channels_last),
        (torch.float16, torch.contiguous_format),
        (torch.bfloat16, torch.channels_last),
    ],
)
def test_sync_batch_norm_two_ranks_conv(gpu_pool, dtype, memory_format):
    torch.manual_seed(12)
    shape = (12, 64, 8, 8)
    x, grad_out = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)
    options = {"parameter_dtype": torch.float32, "memory_format": memory_format}
    results = gpu_pool().run(run_sync_step, x, grad_out, [7, 5], "process_group", options)
    assert all(r["y"].dtype == dtype and r["layout_kept"] for r in results)
    check_group_result(results, x, grad_out, atol=DTYPE_ATOL[dtype], rtol=DTYPE_RTOL[dtype])


# ----------------------------------------------------------------------------------------------
# DDP on CUDA (two processes, one GPU, gloo)


class ConvNet(nn.Module):
    def __init__(self, batch_norm=True):
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1)
        self.bn = nn.BatchNorm2d(16) if batch_norm else nn.Identity()
        self.fc = nn.Linear(16 * 8 * 8, 10)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).flatten(1))


def run_ddp(state, batches, impl, batch_norm):
    """Three SGD steps of the model wrapped in ddpkit's or torch's DDP on cuda:0; parameters after."""
    set_device()
    rank = dist.get_rank()
    model = ConvNet(batch_norm)
    model.load_state_dict(state)
    model = model.to(DEVICE)
    if impl == "ddpkit":
        if batch_norm:
            model = ddpkit.convert_sync_batchnorm(model)
        wrapped = ddpkit.DistributedDataParallel(model)
    else:
        if batch_norm:
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        wrapped = nn.parallel.DistributedDataParallel(model, device_ids=[0] if DEVICE == "cuda" else None)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    for x, target in batches:
        local, _ = shard(x, even_sizes(len(x), 2), rank)
        local_target, _ = shard(target, even_sizes(len(x), 2), rank)
        loss = nn.functional.cross_entropy(wrapped(local.to(DEVICE)), local_target.to(DEVICE))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return {k: v.cpu() for k, v in model.state_dict().items()}


def ddp_inputs():
    torch.manual_seed(13)
    batches = [(torch.randn(16, 3, 8, 8), torch.randint(0, 10, (16,))) for _ in range(3)]
    return batches


def single_process(state, batches, batch_norm):
    """The same three steps on the whole batch in one process, in float64 on the CPU."""
    model = ConvNet(batch_norm).double()
    model.load_state_dict(state)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, target in batches:
        loss = nn.functional.cross_entropy(model(x.double()), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.state_dict()


@pytest.mark.parametrize("batch_norm", [False, True], ids=["plain", "syncbn"])
def test_ddp_matches_the_global_batch(gpu_pool, batch_norm):
    """ddpkit DDP (+ ddpkit SyncBatchNorm) on CUDA: every rank ends with the full-batch model."""
    torch.manual_seed(14)
    state = ConvNet(batch_norm).state_dict()
    batches = ddp_inputs()
    results = gpu_pool().run(run_ddp, state, batches, "ddpkit", batch_norm)
    expected = single_process(state, batches, batch_norm)
    for r in results:
        for key, value in expected.items():
            torch.testing.assert_close(r[key].double(), value.double(), atol=1e-4, rtol=1e-4, msg=key)


def test_ddp_matches_torch_ddp(gpu_pool):
    """ddpkit DDP and torch DDP on CUDA give the same parameters after three steps."""
    torch.manual_seed(15)
    state = ConvNet(False).state_dict()
    batches = ddp_inputs()
    ours = gpu_pool().run(run_ddp, state, batches, "ddpkit", False)
    theirs = gpu_pool().run(run_ddp, state, batches, "torch", False)
    for a, b in zip(ours, theirs):
        for key in a:
            torch.testing.assert_close(a[key], b[key], atol=1e-5, rtol=1e-5, msg=key)


# ----------------------------------------------------------------------------------------------
# An NCCL group of world size 1: the one GPU of the lent machines. It checks ddpkit's code path on
# an NCCL group (ddpkit's engine over a group of that backend, CUDA tensors end to end); two or more
# ranks on NCCL need a GPU each, which no machine this project is lent has.


def run_nccl_world_size_one(state, batches):
    """ddpkit's SyncBatchNorm and DDP on the NCCL group, three SGD steps; parameters and a
    SyncBatchNorm step's output and input gradient after."""
    assert dist.get_backend() == "nccl" and dist.get_world_size() == 1
    set_device()
    torch.manual_seed(16)
    x, grad_out = torch.randn(24, 32, 5, 5), torch.randn(24, 32, 5, 5)
    sync = step(make_layers(32, True, torch.float32, DEVICE), x, grad_out)  # reference()'s affine parameters
    model = ddpkit.convert_sync_batchnorm(ConvNet(True))
    model.load_state_dict(state)
    wrapped = ddpkit.DistributedDataParallel(model.to(DEVICE))
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    for x_batch, target in batches:
        loss = nn.functional.cross_entropy(wrapped(x_batch.to(DEVICE)), target.to(DEVICE))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return {"sync": sync, "x": x, "grad_out": grad_out, "state": {k: v.cpu() for k, v in model.state_dict().items()}}


@only_cuda
@needs_kernels
def test_nccl_group_of_world_size_one():
    """ddpkit's SyncBatchNorm and DDP on an NCCL group of the one GPU give the single-process answer."""
    torch.manual_seed(14)
    state = ConvNet(True).state_dict()
    batches = ddp_inputs()
    pool = WorkerPool(1, backend="nccl", timeout=300, group_timeout=60)
    pool.start()
    try:
        (result,) = pool.run(run_nccl_world_size_one, state, batches)
    finally:
        pool.close()
    expected = reference(result["x"], result["grad_out"], 32, True)
    assert_matches(result["sync"], expected, TIGHT)
    for key, value in single_process(state, batches, True).items():
        torch.testing.assert_close(result["state"][key].double(), value.double(), atol=1e-4, rtol=1e-4, msg=key)
