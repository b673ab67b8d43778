"""ddpkit.SyncBatchNorm in one process that never initializes torch.distributed: exactly torch's
BatchNorm, its autograd, its module API (constructor, defaults, conversion, state_dict) as torch's
SyncBatchNorm, and clear errors for bad inputs. The distributed cases are in test_syncbn.py.
"""

import inspect

import pytest
import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

import ddpkit

from helpers import batch_norm_reference, forward_backward, small_model

TIGHT = 1e-5  # what the float32 kernels achieve against BatchNorm1d (observed errors are ~1e-6)


# ----------------------------------------------------------------------------------------------
# Without torch.distributed (this process never initializes it): exactly BatchNorm


@pytest.mark.parametrize("shape", [(16, 32), (8, 12, 10), (4, 12, 6, 5), (4, 6, 3, 4, 5)])
def test_without_distributed_matches_batchnorm(shape):
    assert not dist.is_initialized()
    torch.manual_seed(12)
    features = shape[1]
    layer = ddpkit.SyncBatchNorm(features, affine=True, momentum=None)
    ref = {2: torch.nn.BatchNorm1d, 3: torch.nn.BatchNorm1d, 4: torch.nn.BatchNorm2d, 5: torch.nn.BatchNorm3d}[
        len(shape)
    ](features, momentum=None)
    ref.load_state_dict(layer.state_dict())
    for step in range(3):
        x = torch.randn(shape) * (step + 1)
        for mode in ("train", "eval"):
            layer.train(mode == "train")
            ref.train(mode == "train")
            y, grad, forward, backward = forward_backward(layer, x, 0, shape[0] // 2)
            y_ref, grad_ref = batch_norm_reference(x, ref, shape[0] // 2)
            torch.testing.assert_close(y, y_ref, atol=TIGHT, rtol=0)
            torch.testing.assert_close(grad, grad_ref, atol=TIGHT, rtol=0)
            assert forward["collectives"] == 0 and backward["collectives"] == 0
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(layer.state_dict()[key], value, atol=1e-6, rtol=1e-6, msg=key)
    torch.testing.assert_close(layer.weight.grad, ref.weight.grad, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(layer.bias.grad, ref.bias.grad, atol=1e-4, rtol=1e-5)


def test_backward_makes_no_zero_gradients():
    """mean and invstd, the op's non-differentiable outputs, get no zero-filled gradients: on a GPU
    those were two allocations and two kernel launches per step (Note [Backend element kernels])."""
    layer = ddpkit.SyncBatchNorm(8)
    x = torch.randn(16, 8, requires_grad=True)
    grad = torch.randn(16, 8)
    layer(x).backward(grad)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        layer(x).backward(grad)
    names = [event.name for event in prof.events()]
    assert "ddpkit::sync_batch_norm_backward" in names
    assert not [name for name in names if name in ("aten::zeros", "aten::zero_", "aten::fill_")], names


def test_autograd_node_gives_the_gradients_asked_for():
    """Note [SyncBatchNorm's autograd node]: gradients match BatchNorm1d's for every combination of
    what requires grad, only the ones asked for are computed, a retained graph runs twice and a freed
    one raises."""
    torch.manual_seed(3)
    x0, grad = torch.randn(12, 5, dtype=torch.float64) * 2 + 1, torch.randn(12, 5, dtype=torch.float64)
    for x_grad, weight_grad, bias_grad in [
        (True, True, True),
        (True, False, True),
        (False, True, False),
        (True, False, False),
    ]:
        layer = ddpkit.SyncBatchNorm(5, dtype=torch.float64)
        ref = torch.nn.BatchNorm1d(5, dtype=torch.float64)
        outputs = []
        for module in (layer, ref):
            module.weight.requires_grad_(weight_grad)
            module.bias.requires_grad_(bias_grad)
            x = x0.clone().requires_grad_(x_grad)
            y = module(x)
            y.backward(grad)
            outputs.append((x.grad, module.weight.grad, module.bias.grad))
        assert layer(x0.clone().requires_grad_()).grad_fn.name() == "SyncBatchNormBackward"
        for mine, theirs in zip(*outputs):
            assert (mine is None) == (theirs is None)
            if mine is not None:
                torch.testing.assert_close(mine, theirs)
    layer = ddpkit.SyncBatchNorm(5, dtype=torch.float64)
    x = x0.clone().requires_grad_()
    (weight_only,) = torch.autograd.grad(layer(x), [layer.weight], grad)
    assert x.grad is None and layer.bias.grad is None
    ref = torch.nn.BatchNorm1d(5, dtype=torch.float64)
    torch.testing.assert_close(weight_only, torch.autograd.grad(ref(x0), [ref.weight], grad)[0])
    with torch.no_grad():
        assert layer(x).grad_fn is None
    y = layer(x)
    y.backward(grad, retain_graph=True)
    first = x.grad.clone()
    y.backward(grad)
    torch.testing.assert_close(x.grad, 2 * first)
    with pytest.raises(RuntimeError, match="freed|second time"):
        y.backward(grad)


def test_eager_call_keeps_what_the_op_does():
    """Note [SyncBatchNorm's eager call]: plain tensors take the binding, which still goes through the
    dispatcher (the profiler records the op); a tensor subclass or a torch function mode gets None
    from it, and the module then calls the op, which hands it to __torch_function__."""
    from ddpkit import _C

    layer = ddpkit.SyncBatchNorm(4)
    x = torch.randn(8, 4)
    args = (layer.weight, layer.bias, layer.running_mean, layer.running_var, True, 0.1, 1e-5, "auto", None)
    assert type(_C.sync_batch_norm_eager(x, *args)) is torch.Tensor
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        layer(x)
    assert "ddpkit::sync_batch_norm" in [event.name for event in prof.events()]

    class Seen(torch.Tensor):
        calls = []

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            cls.calls.append(str(func))
            return super().__torch_function__(func, types, args, kwargs or {})

    assert _C.sync_batch_norm_eager(x.as_subclass(Seen), *args) is None
    y = layer(x.as_subclass(Seen))
    assert type(y) is Seen and "ddpkit.sync_batch_norm" in Seen.calls
    torch.testing.assert_close(y.as_subclass(torch.Tensor), layer(x))

    class Mode(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Mode():
        assert _C.sync_batch_norm_eager(x, *args) is None
    assert _C.sync_batch_norm_eager(x, *args[:4], 1, *args[5:]) is None  # training given as an int


def test_gradcheck():
    torch.manual_seed(4)
    x = torch.randn(6, 3, 2, dtype=torch.float64, requires_grad=True)
    weight = torch.rand(3, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda x, w, b: ddpkit.sync_batch_norm(x, w, b, None, None, True, 0.1, 1e-5), (x, weight, bias)
    )


def test_double_backward_raises_instead_of_dropping_terms():
    """A gradient penalty through the layer: its backward is differentiable once (torch's SyncBatchNorm
    raises too), so the second backward must raise, not return gradients without their second-order terms."""
    torch.manual_seed(5)
    layer = ddpkit.SyncBatchNorm(3)
    head = torch.nn.Linear(3, 1)
    x = torch.randn(8, 3, requires_grad=True)
    (grad_x,) = torch.autograd.grad(head(layer(x)).sum(), x, create_graph=True)
    assert grad_x.grad_fn is not None
    with pytest.raises(RuntimeError, match="SyncBatchNorm's backward is not differentiable"):
        grad_x.pow(2).sum().backward()
    # Without create_graph, nothing changes: the first-order gradients are BatchNorm's.
    reference = torch.nn.BatchNorm1d(3)
    x_ref = x.detach().clone().requires_grad_(True)
    (expected,) = torch.autograd.grad(head(reference(x_ref)).sum(), x_ref)
    (grad,) = torch.autograd.grad(head(layer(x)).sum(), x)
    torch.testing.assert_close(grad, expected)


@pytest.mark.parametrize(
    "shape,memory_format",
    [
        ((256, 512), torch.contiguous_format),
        ((16, 8, 32, 32), torch.contiguous_format),
        ((16, 8, 32, 32), torch.channels_last),
    ],
)
def test_kernels_split_across_threads(shape, memory_format):
    """Inputs large enough for the CPU kernels to split rows or channels across two threads, against
    BatchNorm in float64 (float32 BatchNorm's weight gradient is off by ~4e-3 on the channels_last case)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch.manual_seed(14)
        x = (torch.randn(shape) * 3 + 1).contiguous(memory_format=memory_format)
        layer = ddpkit.SyncBatchNorm(shape[1], affine=True)
        ref = (torch.nn.BatchNorm1d if len(shape) == 2 else torch.nn.BatchNorm2d)(shape[1], dtype=torch.float64)
        y, grad, _, _ = forward_backward(layer, x, 0, shape[0] // 2, memory_format)
        y_ref, grad_ref = batch_norm_reference(x.double(), ref, shape[0] // 2)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(y.double(), y_ref, atol=TIGHT, rtol=0)
    torch.testing.assert_close(grad.double(), grad_ref, atol=TIGHT, rtol=0)
    torch.testing.assert_close(layer.running_var.double(), ref.running_var, atol=1e-6, rtol=0)
    torch.testing.assert_close(layer.weight.grad.double(), ref.weight.grad, atol=1e-3, rtol=1e-5)


def test_functional_form_without_distributed():
    torch.manual_seed(16)
    x, weight, bias = torch.randn(10, 6, 4), torch.randn(6), torch.randn(6)
    ours_stats, ref_stats = [torch.zeros(6), torch.ones(6)], [torch.zeros(6), torch.ones(6)]
    for training in (True, False):
        y = ddpkit.sync_batch_norm(x, weight, bias, *ours_stats, training, 0.3, 1e-3)
        expected = torch.nn.functional.batch_norm(x, *ref_stats, weight, bias, training, 0.3, 1e-3)
        torch.testing.assert_close(y, expected, atol=TIGHT, rtol=0)
    torch.testing.assert_close(ours_stats, ref_stats, atol=1e-6, rtol=0)


def test_constructor_is_torchs():
    """torch.nn.SyncBatchNorm's arguments, in its order, with its defaults; then ddpkit's own, keyword-only."""
    ours = inspect.signature(ddpkit.SyncBatchNorm.__init__).parameters
    theirs = inspect.signature(torch.nn.SyncBatchNorm.__init__).parameters
    positional = [(p.name, p.default) for p in theirs.values() if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert [(p.name, p.default) for p in ours.values() if p.kind is p.POSITIONAL_OR_KEYWORD] == positional
    assert positional[1:] == [
        ("num_features", inspect.Parameter.empty),
        ("eps", 1e-5),
        ("momentum", 0.1),
        ("affine", True),
        ("track_running_stats", True),
        ("process_group", None),
        ("device", None),
        ("dtype", None),
    ]
    keyword_only = {p.name: p.default for p in ours.values() if p.kind is p.KEYWORD_ONLY}
    # torch >= 2.13 has a keyword `bias` flag; ddpkit takes it on every torch (bias=False needs 2.13).
    assert keyword_only == {"algorithm": "auto", "bias": theirs["bias"].default if "bias" in theirs else True}


def test_defaults_match_torchs_syncbatchnorm():
    ours, theirs = ddpkit.SyncBatchNorm(6), torch.nn.SyncBatchNorm(6)
    for name in ("num_features", "eps", "momentum", "affine", "track_running_stats", "process_group", "training"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert ours.algorithm == "auto"
    assert list(ours.state_dict()) == list(theirs.state_dict())
    for key, value in theirs.state_dict().items():
        assert torch.equal(ours.state_dict()[key], value), key
    assert [name for name, _ in ours.named_parameters()] == ["weight", "bias"]
    ours.load_state_dict(theirs.state_dict(), strict=True)


def test_positional_arguments_as_torchs():
    args = (6, 1e-3, 0.3, False, False, None, "cpu", torch.float64)
    ours, theirs = ddpkit.SyncBatchNorm(*args), torch.nn.SyncBatchNorm(*args)
    for name in ("eps", "momentum", "affine", "track_running_stats"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert ours.weight is None and ours.running_mean is None and list(ours.state_dict()) == []
    ours = ddpkit.SyncBatchNorm(6, 1e-5, 0.1, True, True, None, None, torch.float64, algorithm="ring")
    assert ours.algorithm == "ring" and ours.weight.dtype == torch.float64
    if "bias" in inspect.signature(torch.nn.SyncBatchNorm.__init__).parameters:
        assert ddpkit.SyncBatchNorm(6, affine=True, bias=False).bias is None
    else:  # torch < 2.13
        with pytest.raises(TypeError, match="bias=False needs torch >= 2.13"):
            ddpkit.SyncBatchNorm(6, affine=True, bias=False)
    with pytest.raises(TypeError, match=r"'ring' was passed as `device`; `algorithm` is keyword-only"):
        ddpkit.SyncBatchNorm(6, 1e-5, 0.1, True, True, None, "ring")


def test_affine_layer_matches_batchnorm_with_trained_parameters():
    torch.manual_seed(5)
    ours, theirs = ddpkit.SyncBatchNorm(5), torch.nn.BatchNorm2d(5)
    with torch.no_grad():
        theirs.weight.uniform_(0.5, 2.0)
        theirs.bias.normal_()
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(4, 5, 3, 3)
    torch.testing.assert_close(ours(x), theirs(x), atol=TIGHT, rtol=0)
    ours(x).sum().backward()
    theirs(x).sum().backward()
    torch.testing.assert_close(ours.weight.grad, theirs.weight.grad, atol=1e-4, rtol=0)


@pytest.mark.parametrize("affine,track", [(True, True), (False, True), (True, False), (False, False)])
def test_convert_keeps_each_layers_own_settings(affine, track):
    """The conversion takes affine and track_running_stats from each layer, never from the
    constructor's defaults, and carries its parameters and buffers over (values included)."""
    torch.manual_seed(2)
    original = torch.nn.BatchNorm1d(4, eps=1e-3, momentum=0.2, affine=affine, track_running_stats=track)
    original(torch.randn(8, 4) * 3 + 1)  # running statistics that are not the initial ones
    if affine:
        with torch.no_grad():
            original.weight.uniform_(0.5, 2.0)
            original.bias.normal_()
    state = {k: v.clone() for k, v in original.state_dict().items()}
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), original)
    converted = ddpkit.convert_sync_batchnorm(model, algorithm="ring")[1]
    assert type(converted) is ddpkit.SyncBatchNorm and converted.algorithm == "ring"
    assert (converted.eps, converted.momentum, converted.affine, converted.track_running_stats) == (
        1e-3,
        0.2,
        affine,
        track,
    )
    assert (converted.weight is None) == (not affine) and (converted.running_mean is None) == (not track)
    assert list(converted.state_dict()) == list(state)
    for key, value in state.items():
        assert torch.equal(converted.state_dict()[key], value), key
    x = torch.randn(6, 3)
    model.eval()
    expected = torch.nn.Sequential(model[0], torch.nn.BatchNorm1d(4, 1e-3, 0.2, affine, track)).eval()
    expected[1].load_state_dict(state)
    torch.testing.assert_close(model(x), expected(x), atol=TIGHT, rtol=0)


def test_convert_torchs_syncbatchnorm_and_leaves_ddpkits_alone():
    model = torch.nn.Sequential(
        torch.nn.SyncBatchNorm(3, affine=False), ddpkit.SyncBatchNorm(3, affine=False, algorithm="star")
    )
    kept = model[1]
    ddpkit.convert_sync_batchnorm(model)
    assert type(model[0]) is ddpkit.SyncBatchNorm and not model[0].affine
    assert model[1] is kept and kept.algorithm == "star"


def test_state_dict_is_batchnorms():
    for affine, track in [(True, True), (False, True), (False, False)]:
        ours = ddpkit.SyncBatchNorm(10, affine=affine, track_running_stats=track)
        theirs = torch.nn.BatchNorm2d(10, affine=affine, track_running_stats=track)
        assert list(ours.state_dict()) == list(theirs.state_dict())
        theirs(torch.randn(4, 10, 3, 3) + 2)
        ours.load_state_dict(theirs.state_dict(), strict=True)
        theirs.load_state_dict(ours.state_dict(), strict=True)
        for key, value in theirs.state_dict().items():
            assert torch.equal(ours.state_dict()[key], value)


def test_convert_sync_batchnorm_keeps_everything():
    model = small_model()
    model[5].eval()
    model[1].weight.requires_grad_(False)
    originals = {
        name: (m, dict(m.named_parameters(recurse=False)), dict(m.named_buffers(recurse=False)))
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
    }
    x = torch.randn(10, 3, 6, 6)
    expected = model(x)
    converted = ddpkit.convert_sync_batchnorm(model)
    assert converted is model
    for name, (original, params, buffers) in originals.items():
        m = converted.get_submodule(name)
        assert type(m) is ddpkit.SyncBatchNorm and m is not original
        assert (m.num_features, m.eps, m.momentum, m.affine, m.track_running_stats, m.training) == (
            original.num_features,
            original.eps,
            original.momentum,
            original.affine,
            original.track_running_stats,
            original.training,
        )
        assert all(getattr(m, k) is v for k, v in params.items()) and all(
            getattr(m, k) is v for k, v in buffers.items()
        )
    assert not converted[1].weight.requires_grad and converted[1].bias.requires_grad
    torch.testing.assert_close(converted(x), expected, atol=TIGHT, rtol=0)


def test_bad_inputs_raise_clear_errors():
    layer = ddpkit.SyncBatchNorm(8, affine=False)
    with pytest.raises(ValueError, match=r"expected a 2D, 3D, 4D or 5D input \(got 1D input\)"):
        layer(torch.randn(8))
    with pytest.raises(ValueError, match=r"got 6D input"):
        layer(torch.randn(2, 8, 1, 1, 1, 2))
    with pytest.raises(RuntimeError, match=r"running_mean should have shape \[7\] \(the input's channels"):
        layer(torch.randn(4, 7))
    with pytest.raises(RuntimeError, match=r"unsupported input dtype Long"):
        layer(torch.ones(4, 8, dtype=torch.long))
    with pytest.raises(RuntimeError, match=r"running_mean has dtype Float but the input has dtype Double"):
        layer(torch.randn(4, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"unknown algorithm 'fastest'"):
        ddpkit.SyncBatchNorm(8, algorithm="fastest")
    with pytest.raises(
        ValueError, match=r"Expected more than 1 value per channel when training, got input size \[1, 8\]"
    ):
        layer(torch.randn(1, 8))
    with pytest.raises(RuntimeError, match=r"running_mean and running_var are required when training=False"):
        torch.ops.ddpkit.sync_batch_norm(torch.randn(4, 8), None, None, None, None, False, 0.1, 1e-5, "auto", None)
