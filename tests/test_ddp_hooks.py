"""Communication hooks on ddpkit.DistributedDataParallel (Note [Communication hooks] in
csrc/ddp/reducer.h): torch's own hooks against torch's DDP with the same hook, model, data and bucket
layout, the GradBucket a hook gets, and every case the native reducer handles, under a hook too."""

import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, post_localSGD_hook, powerSGD_hook

import ddpkit

from helpers import BufferNet, FailingBackward, UnusedBranchNet

FEATURES = 24
BATCH = 8
STEPS = 5
# One bucket per layer, on both sides: a layer's weight (2304 bytes) stays under the cap and its bias
# (96 bytes) reaches it, whichever of the two comes first (torch visits parameters first to last
# before its rebuild, ddpkit last to first). Both start at the last layer.
BUCKET_BYTES = FEATURES * FEATURES * 4 + FEATURES * 4
BUCKET_MB = BUCKET_BYTES / 2**20


class Layers(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(FEATURES, FEATURES)
        self.fc2 = nn.Linear(FEATURES, FEATURES)
        self.fc3 = nn.Linear(FEATURES, FEATURES)

    def forward(self, x):
        return self.fc3(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


def make_layers():
    torch.manual_seed(0)
    return Layers()


def batch(step, rank):
    generator = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(BATCH, FEATURES, generator=generator), torch.randn(BATCH, FEATURES, generator=generator)


def loss_of(model, x, y):
    return ((model(x) - y) ** 2).mean()


def ddpkit_model(**kwargs):
    options = dict(bucket_cap_mb=BUCKET_MB, first_bucket_cap_mb=BUCKET_MB)
    options.update(kwargs)
    return ddpkit.DistributedDataParallel(make_layers(), **options)


def averaging_hook(state, bucket):
    """The plainest hook: torch.distributed's all-reduce of the bucket, then the average."""
    if state is not None:
        state.append(bucket.index())
    buffer = bucket.buffer()
    return dist.all_reduce(buffer, async_op=True).get_future().then(lambda f: f.value()[0] / dist.get_world_size())


# --- torch's hooks against torch's DDP --------------------------------------------------------------


def power_sgd_state():
    # Compression from the third step: PowerSGD then sees the buckets torch's DDP rebuilds after its
    # first step (its documented reason for start_powerSGD_iter > 1), which are ddpkit's layout.
    return powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2)


TORCH_HOOKS = {
    "allreduce_hook": lambda: (None, default_hooks.allreduce_hook),
    "fp16_compress_hook": lambda: (None, default_hooks.fp16_compress_hook),
    "fp16_compress_wrapper(allreduce_hook)": lambda: (
        None,
        default_hooks.fp16_compress_wrapper(default_hooks.allreduce_hook),
    ),
    "powerSGD_hook": lambda: (power_sgd_state(), powerSGD_hook.powerSGD_hook),
    "batched_powerSGD_hook": lambda: (power_sgd_state(), powerSGD_hook.batched_powerSGD_hook),
    "fp16_compress_wrapper(powerSGD_hook)": lambda: (
        power_sgd_state(),
        default_hooks.fp16_compress_wrapper(powerSGD_hook.powerSGD_hook),
    ),
    # Global averaging for two steps, then each rank on its own (subgroups of one rank).
    "post_localSGD_hook": lambda: (
        post_localSGD_hook.PostLocalSGDState(
            process_group=None, subgroup=dist.new_subgroups(group_size=1)[0], start_localSGD_iter=2
        ),
        post_localSGD_hook.post_localSGD_hook,
    ),
}
# PowerSGD issues its second and third collectives from its futures' callbacks, on the process group's
# thread when the previous one completes: with several buckets, one bucket's next collective and the
# next bucket's first may be issued in another order on another rank, which gloo then pairs wrongly
# (a hang), under torch's DDP as under ddpkit's (docs/ddp.md). Its cases run on one bucket, the
# default layout of this small model on both sides.
ONE_BUCKET = {"powerSGD_hook", "batched_powerSGD_hook", "fp16_compress_wrapper(powerSGD_hook)"}


def recording(hook, layouts):
    """``hook``, recording each call's bucket index and the shapes of its parameters, in slot order."""

    def run(state, bucket):
        layouts.append((bucket.index(), [tuple(p.shape) for p in bucket.parameters()]))
        return hook(state, bucket)

    return run


def case_torch_hook(name, steps):
    """The same training with `name` registered on ddpkit's DDP and on torch's: per step, the
    gradients and the buckets the hook saw; at the end, the parameters."""
    rank = dist.get_rank()
    results = {}
    one_bucket = name in ONE_BUCKET
    for kind in ("ddpkit", "torch"):
        if kind == "ddpkit":
            model = ddpkit.DistributedDataParallel(make_layers()) if one_bucket else ddpkit_model()
        elif one_bucket:
            model = nn.parallel.DistributedDataParallel(make_layers())
        else:
            model = nn.parallel.DistributedDataParallel(make_layers(), bucket_cap_mb_list=[BUCKET_MB])
        state, hook = TORCH_HOOKS[name]()
        layouts = []
        model.register_comm_hook(state, recording(hook, layouts))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.5)
        grads, per_step = [], []
        try:
            for step in range(steps):
                del layouts[:]
                loss_of(model, *batch(step, rank)).backward()
                grads.append([p.grad.clone() for p in model.parameters()])
                per_step.append(sorted(layouts))
                optimizer.step()
                optimizer.zero_grad()
        except Exception as exc:  # noqa: BLE001  (torch's own hook may fail: the test compares)
            results[kind] = f"{type(exc).__name__} at step {step}"
            continue
        results[kind] = (grads, per_step, [p.detach().clone() for p in model.parameters()])
    return results


@pytest.mark.parametrize("name", list(TORCH_HOOKS))
def test_torch_hook_matches_torch_ddp_bitwise(pool, name):
    """Each of torch's hooks is deterministic on CPU given its inputs (PowerSGD seeds its random
    projections from its state, alike on both sides), so the two DDPs agree bit for bit."""
    for result in pool(2).run(case_torch_hook, name, STEPS):
        if isinstance(result["torch"], str):
            # torch 2.13's batched_powerSGD_hook passes a 2-D matrix to an _orthogonalize that asserts 3-D
            # ones, at its first compressed step, under torch's DDP too: ddpkit's fails where torch's does.
            assert name == "batched_powerSGD_hook", result
            assert result["ddpkit"] == result["torch"] == "AssertionError at step 2", result
            continue
        (ours, our_layouts, our_params), (theirs, their_layouts, their_params) = result["ddpkit"], result["torch"]
        # The same buckets, in the same slot order, once torch's DDP has rebuilt its buckets after the
        # first step (its first step's layout lists each layer's weight before its bias).
        layer = [(FEATURES,), (FEATURES, FEATURES)]
        assert our_layouts[0] == ([(0, layer * 3)] if name in ONE_BUCKET else [(i, layer) for i in range(3)])
        assert our_layouts[1:] == their_layouts[1:]
        for step, (a, b) in enumerate(zip(ours, theirs)):
            for index, (x, y) in enumerate(zip(a, b)):
                assert torch.equal(x, y), f"{name}: step {step}, parameter {index}: {(x - y).abs().max()}"
        for x, y in zip(our_params, their_params):
            assert torch.equal(x, y)


def case_bf16_hook(wrapped):
    """bf16_compress_hook (or bf16_compress_wrapper(allreduce_hook)) on ddpkit's DDP, and each rank's
    local gradients of the same step, gathered."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = ddpkit_model()
    replica = make_layers()
    hook = (
        default_hooks.bf16_compress_wrapper(default_hooks.allreduce_hook)
        if wrapped
        else default_hooks.bf16_compress_hook
    )
    model.register_comm_hook(None, hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    synced, local = [], []
    for step in range(3):
        replica.load_state_dict(model.module.state_dict())
        x, y = batch(step, rank)
        loss_of(replica, x, y).backward()
        gathered = [[torch.empty_like(p) for _ in range(world_size)] for p in replica.parameters()]
        for out, p in zip(gathered, replica.parameters()):
            dist.all_gather(out, p.grad)
        replica.zero_grad()
        loss_of(model, x, y).backward()
        synced.append([p.grad.clone() for p in model.parameters()])
        local.append(gathered)
        optimizer.step()
        optimizer.zero_grad()
    return synced, local


@pytest.mark.parametrize("wrapped", [False, True], ids=["bf16_compress_hook", "bf16_compress_wrapper"])
def test_bf16_compress_hook_rounds_as_by_hand(pool, wrapped):
    """torch's DDP refuses bf16_compress_hook without CUDA and NCCL; on ddpkit's it runs on CPU. Its
    rounding, by hand: each rank's gradient in bfloat16, divided by the world size there, summed in
    bfloat16, back to float32."""
    for synced, local in pool(2).run(case_bf16_hook, wrapped):
        for step_synced, step_local in zip(synced, local):
            for grad, per_rank in zip(step_synced, step_local):
                expected = sum(g.to(torch.bfloat16).div_(2) for g in per_rank).float()
                assert torch.equal(grad, expected)
                assert not torch.equal(grad, sum(per_rank) / 2)  # it did round


# --- the bucket a hook gets -----------------------------------------------------------------------


def case_grad_bucket():
    rank = dist.get_rank()
    model = ddpkit_model()
    parameters = list(model.parameters())
    seen = []

    def hook(state, bucket):
        buffer = bucket.buffer()
        gradients = bucket.gradients()
        offsets, views_match = 0, True
        for grad in gradients:
            views_match &= torch.equal(grad.flatten(), buffer[offsets : offsets + grad.numel()])
            views_match &= grad.data_ptr() == buffer[offsets:].data_ptr()
            offsets += grad.numel()
        seen.append(
            {
                "type": isinstance(bucket, dist.GradBucket),
                "index": bucket.index(),
                "is_last": bucket.is_last(),
                "parameters": [next(i for i, p in enumerate(parameters) if p is q) for q in bucket.parameters()],
                "shapes_match": all(g.shape == p.shape for g, p in zip(gradients, bucket.parameters())),
                "views_match": views_match and offsets == buffer.numel(),
                "unscaled": [g.clone() for g in gradients],
            }
        )
        # set_buffer: the hook's own tensor from now on, gradients() are views of it
        bucket.set_buffer(buffer.double())
        swapped = bucket.buffer().dtype == torch.float64 and bucket.gradients()[0].dtype == torch.float64
        seen[-1]["set_buffer"] = swapped
        return averaging_hook(None, bucket)

    model.register_comm_hook(None, hook)
    loss_of(model, *batch(0, rank)).backward()
    replica = make_layers()
    loss_of(replica, *batch(0, rank)).backward()
    return seen, [p.grad for p in replica.parameters()], [p.grad.clone() for p in model.parameters()]


def test_hook_gets_a_torch_grad_bucket(pool):
    results = pool(2).run(case_grad_bucket)
    for seen, local, synced in results:
        assert [s["index"] for s in seen] == [0, 1, 2]
        assert [s["is_last"] for s in seen] == [False, False, True]
        assert [s["parameters"] for s in seen] == [[5, 4], [3, 2], [1, 0]]  # last parameter first
        assert all(s["type"] and s["shapes_match"] and s["views_match"] and s["set_buffer"] for s in seen)
        for s in seen:  # the gradients enter the bucket unscaled: the hook averages
            for grad, index in zip(s["unscaled"], s["parameters"]):
                assert torch.equal(grad, local[index])
        # the float64 result is copied back into the float32 bucket, then into the gradients
        for grad, index in zip(synced, range(6)):
            mean = sum(r[1][index].double() for r in results) / 2
            assert torch.equal(grad, mean.float())


# --- what the native reducer handles, under a hook --------------------------------------------------


def case_buffers_broadcast_under_a_hook():
    rank = dist.get_rank()
    ddp = ddpkit.DistributedDataParallel(BufferNet(FEATURES))
    ddp.register_comm_hook(None, averaging_hook)
    ddp.module.counter.fill_(rank + 1)  # drift, as batch-norm statistics would
    ddp(torch.randn(2, FEATURES)).sum().backward()
    return ddp.module.counter.clone()


def test_buffers_are_broadcast_before_each_forward_under_a_hook(pool):
    for counter in pool(2).run(case_buffers_broadcast_under_a_hook):
        assert torch.equal(counter, torch.full((3,), 1.0))  # rank 0's


def case_a_backward_that_raised(hook_fails):
    """A backward that raised after the first bucket's hook ran (an error below the model's last layer,
    or in the hook of the second bucket), then a normal one."""
    rank = dist.get_rank()
    model = make_layers()
    ddp = ddpkit.DistributedDataParallel(model, bucket_cap_mb=BUCKET_MB, first_bucket_cap_mb=BUCKET_MB)
    calls = []

    def hook(state, bucket):
        calls.append(bucket.index())
        if hook_fails and len(calls) == 2:
            raise RuntimeError("injected failure in the hook")
        return averaging_hook(None, bucket)

    ddp.register_comm_hook(None, hook)
    x = torch.full((4, FEATURES), float(rank + 1))
    if hook_fails:
        out = ddp(x)
    else:  # fc3 gets its gradient (and its bucket leaves) before the failure below it
        out = model.fc3(FailingBackward.apply(torch.tanh(model.fc2(torch.tanh(model.fc1(x))))))
    try:
        out.sum().backward()
        raised = None
    except RuntimeError as exc:
        raised = str(exc)
    first_calls = list(calls)
    ddp.zero_grad(set_to_none=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ddp(x).sum().backward()
    return raised, first_calls, [str(w.message) for w in caught], [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("hook_fails", [False, True], ids=["model_raised", "hook_raised"])
def test_a_backward_that_raised_leaves_the_next_step_synchronised_under_a_hook(pool, hook_fails):
    """torch's DDP raises at the next forward ("Expected to have finished reduction in the prior
    iteration"); ddpkit's reducer recovers with a warning (Note [A backward that raised]), hook or
    not: the next step's gradients are averaged on every rank, never left to diverge."""
    results = pool(2).run(case_a_backward_that_raised, hook_fails, timeout=60)
    reference = make_layers()
    (reference(torch.full((4, FEATURES), 1.0)).sum() + reference(torch.full((4, FEATURES), 2.0)).sum()).backward()
    for raised, first_calls, caught, grads in results:
        assert raised is not None and "injected failure" in raised, raised
        assert first_calls[0] == 0 and len(first_calls) <= 2
        for grad, other, expected in zip(grads, results[0][3], reference.parameters()):
            assert torch.equal(grad, other), "the ranks' gradients differ"
            torch.testing.assert_close(grad, expected.grad / 2)
        assert any("previous backward raised" in w for w in caught), caught


def case_hook_raised_at_the_end_of_backward():
    """The hook raises for the last bucket, which only the end of backward launches (it holds ``never``,
    a parameter no rank uses): backward raises, after every bucket launched before has settled."""
    rank = dist.get_rank()
    model = UnusedBranchNet(FEATURES)
    ddp = ddpkit.DistributedDataParallel(model, bucket_cap_mb=0.0001, first_bucket_cap_mb=0.0001)
    failing = [True]

    def hook(state, bucket):
        if failing[0] and bucket.is_last():
            raise RuntimeError("injected failure in the last bucket's hook")
        return averaging_hook(None, bucket)

    ddp.register_comm_hook(None, hook)
    x = torch.full((2, FEATURES), float(rank + 1))
    try:
        ddp(x).sum().backward()
        raised = None
    except RuntimeError as exc:
        raised = str(exc)
    failing[0] = False
    ddp.zero_grad(set_to_none=True)
    ddp(x).sum().backward()
    return raised, {name: p.grad.clone() for name, p in model.named_parameters()}


def test_a_hook_that_raised_at_the_end_of_backward_fails_it_and_the_next_step_synchronises(pool):
    for raised, grads in pool(2).run(case_hook_raised_at_the_end_of_backward, timeout=60):
        assert raised is not None and "injected failure in the last bucket's hook" in raised, raised
        assert torch.equal(grads["body.weight"], torch.full((4, FEATURES), 3.0))  # (2 + 4) / 2
        assert torch.equal(grads["never.weight"], torch.zeros(4, FEATURES))


def case_frozen_after_wrapping(as_view):
    rank = dist.get_rank()
    model = make_layers()
    ddp = ddpkit.DistributedDataParallel(model, gradient_as_bucket_view=as_view)
    ddp.register_comm_hook(None, averaging_hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
    x = torch.full((4, FEATURES), float(rank + 1))
    ddp(x).sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    model.fc1.weight.requires_grad_(False)
    frozen = model.fc1.weight.detach().clone()
    ddp(x).sum().backward()
    grad_while_frozen = model.fc1.weight.grad
    optimizer.step()
    moved = not torch.equal(model.fc1.weight, frozen)
    optimizer.zero_grad(set_to_none=True)
    model.fc1.weight.requires_grad_(True)
    ddp(x).sum().backward()
    return grad_while_frozen, moved, model.fc1.weight.grad.clone(), model.fc2.weight.grad.clone()


@pytest.mark.parametrize("as_view", [True, False])
def test_a_parameter_frozen_after_wrapping_gets_no_gradient_under_a_hook(pool, as_view):
    results = pool(2).run(case_frozen_after_wrapping, as_view)
    for grad_while_frozen, moved, grad_after, other_grad in results:
        assert grad_while_frozen is None and not moved  # as torch's DDP: .grad stays None
        assert grad_after.abs().sum() > 0 and torch.equal(grad_after, results[0][2])
        assert torch.equal(other_grad, results[0][3])


def case_unused_parameters():
    rank = dist.get_rank()
    model = UnusedBranchNet(FEATURES)
    ddp = ddpkit.DistributedDataParallel(model, bucket_cap_mb=0.0001, first_bucket_cap_mb=0.0001)
    calls = []
    ddp.register_comm_hook(calls, averaging_hook)
    x = torch.full((2, FEATURES), float(rank + 1))
    ddp(x, use_rare=(rank == 0)).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return grads, calls, ddp.reducer_stats()["buckets"]


def test_unused_parameters_under_a_hook(pool):
    results = pool(2).run(case_unused_parameters, timeout=60)
    for grads, calls, buckets in results:
        assert calls == list(range(buckets))  # every bucket, in order, unused ones too
        for name in grads:
            assert torch.equal(grads[name], results[0][0][name])
        # rare.weight: only rank 0 (inputs of ones, 2 rows) contributed, averaged over 2 ranks
        assert torch.equal(grads["rare.weight"], torch.full((4, FEATURES), 1.0))
        assert torch.equal(grads["never.weight"], torch.zeros(4, FEATURES))
        assert torch.equal(grads["body.weight"], torch.full((4, FEATURES), 3.0))


def case_accumulation(hooked, as_view, accumulation=3, steps=3):
    """GradientAccumulation (no_sync() on all but the last micro-batch): the hook runs on the last only."""
    rank = dist.get_rank()
    model = ddpkit_model(gradient_as_bucket_view=as_view)
    calls = []
    if hooked:
        model.register_comm_hook(calls, averaging_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    accumulate = ddpkit.GradientAccumulation(model, accumulation)
    per_micro_batch = []
    for step in range(steps):
        for micro in range(accumulation):
            before = len(calls)
            accumulate.backward(loss_of(model, *batch(10 * step + micro, rank)))
            per_micro_batch.append(len(calls) - before)
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach().clone() for p in model.parameters()], per_micro_batch


@pytest.mark.parametrize("as_view", [True, False])
def test_accumulation_and_no_sync_under_a_hook_match_the_native_reducer(pool, as_view):
    """The averaging hook divides by 2 where the native reducer multiplies by 1/2: the same bits."""
    for (hooked, calls), (native, _) in zip(
        pool(2).run(case_accumulation, True, as_view), pool(2).run(case_accumulation, False, as_view)
    ):
        assert calls == [0, 0, 3] * 3
        for a, b in zip(hooked, native):
            assert torch.equal(a, b)


def case_gradient_as_bucket_view(as_view):
    ddp = ddpkit_model(gradient_as_bucket_view=as_view)
    ddp.register_comm_hook(None, averaging_hook)
    spans = [(b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()) for b in ddp.bucket_tensors()]

    def in_buckets():
        return [any(lo <= p.grad.data_ptr() < hi for lo, hi in spans) for p in ddp.parameters()]

    ddp(torch.randn(4, FEATURES)).sum().backward()
    after_sync = in_buckets()
    ddp.zero_grad(set_to_none=True)
    with ddp.no_sync():
        ddp(torch.randn(4, FEATURES)).sum().backward()
    return after_sync, in_buckets(), ddp.reducer_stats()


@pytest.mark.parametrize("as_view", [True, False])
def test_gradient_as_bucket_view_under_a_hook(pool, as_view):
    after_sync, after_no_sync, stats = pool(2).run(case_gradient_as_bucket_view, as_view)[0]
    for inside in (after_sync, after_no_sync):
        assert all(inside) if as_view else not any(inside)
    # The hook ran where the all-reduce would have: as each bucket filled, during backward.
    assert stats["collectives"] == stats["buckets"] == stats["launched_during_backward"] == 3


def case_state_dict_under_a_hook():
    ddp = ddpkit_model()
    ddp.register_comm_hook(None, averaging_hook)
    loss_of(ddp, *batch(0, dist.get_rank())).backward()
    reference = nn.parallel.DistributedDataParallel(make_layers())
    fresh = ddpkit_model()
    fresh.register_comm_hook(None, averaging_hook)
    fresh.load_state_dict(ddp.state_dict())
    same = all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), ddp.state_dict().values()))
    return list(ddp.state_dict()), list(reference.state_dict()), same


def test_state_dict_under_a_hook(pool):
    keys, torch_keys, same = pool(2).run(case_state_dict_under_a_hook)[0]
    assert keys == torch_keys and same


# --- torchft's manager ------------------------------------------------------------------------------


class _GroupManager:
    """What ddpkit.torchft.allreduce_hook uses of torchft's Manager, over the pool's world group: allreduce
    returns torchft's own managed work over the group's all-reduce; wrap_future is the manager's own."""

    def __init__(self) -> None:
        import logging
        from datetime import timedelta

        from torchft.manager import Manager

        self._timeout = timedelta(seconds=60)
        self._logger = logging.getLogger("test_ddp_hooks")
        self.wrap_future = Manager.wrap_future.__get__(self)
        self.errors: list = []

    def report_error(self, error: Exception) -> None:
        self.errors.append(error)

    def num_participants(self) -> int:
        return dist.get_world_size()

    def allreduce(self, tensor, should_quantize=False, reduce_op=dist.ReduceOp.AVG):
        from torchft.manager import _ManagedWork

        assert reduce_op == dist.ReduceOp.SUM
        return _ManagedWork(self, dist.all_reduce(tensor, async_op=True), tensor)


def case_torchft_hook():
    from ddpkit.torchft import allreduce_hook

    rank = dist.get_rank()
    results = []
    for hooked in (True, False):
        model = ddpkit_model()
        manager = _GroupManager()
        if hooked:
            model.register_comm_hook(manager, allreduce_hook)
        for step in range(3):
            loss_of(model, *batch(step, rank)).backward()
            grads = [p.grad.clone() for p in model.parameters()]
            model.zero_grad()
        results.append((grads, model.reducer_stats(), manager.errors))
    return results


def test_torchft_allreduce_hook_overlaps_and_averages_as_the_native_reducer(pool):
    pytest.importorskip("torchft", reason="scripts/setup.sh installs torchft with the test extra")
    for (hooked, stats, errors), (native, _, _) in pool(2).run(case_torchft_hook):
        assert errors == []
        # Every bucket's hook ran as the bucket filled (its future pending: tests/test_torchft.py).
        assert stats["collectives"] == stats["launched_during_backward"] == 3 * stats["buckets"] == 9
        for a, b in zip(hooked, native):  # a sum halved is the halves summed: the same bits
            assert torch.equal(a, b)


# --- registration and a hook's errors ---------------------------------------------------------------


def case_hook_errors():
    rank = dist.get_rank()
    errors = {}
    for name, hook in {
        "no_future": lambda state, bucket: bucket.buffer(),
        "wrong_size": lambda state, bucket: averaging_hook(None, bucket).then(lambda f: f.value()[:3]),
        "failed_future": lambda state, bucket: averaging_hook(None, bucket).then(lambda f: 1 / 0),
    }.items():
        model = ddpkit_model()
        model.register_comm_hook(None, hook)
        try:
            loss_of(model, *batch(0, rank)).backward()
        except Exception as exc:  # noqa: BLE001
            errors[name] = f"{type(exc).__name__}: {exc}"
    return errors


def test_a_hook_that_misbehaves_fails_backward_with_a_clear_error(pool):
    for errors in pool(2).run(case_hook_errors, timeout=60):
        assert "must return a torch.futures.Future" in errors["no_future"], errors
        assert "holds a tensor of 3 elements; the bucket has 600" in errors["wrong_size"], errors
        assert "division by zero" in errors["failed_future"], errors


def case_registration():
    ddp = ddpkit_model()
    errors = []
    for call in (
        lambda: ddp.register_comm_hook(None, "not a hook"),
        lambda: ddp.register_comm_hook(None, averaging_hook),
        lambda: ddp.register_comm_hook(None, averaging_hook),
    ):
        try:
            call()
            errors.append(None)
        except Exception as exc:  # noqa: BLE001
            errors.append(f"{type(exc).__name__}: {exc}")
    per_parameter = ddpkit.DistributedDataParallel(make_layers(), grad_sync="per_parameter")
    try:
        per_parameter.register_comm_hook(None, averaging_hook)
    except RuntimeError as exc:
        errors.append(str(exc))
    return errors


def test_a_hook_is_registered_once_on_a_bucketed_reducer(pool):
    not_callable, first, second, per_parameter = pool(2).run(case_registration)[0]
    assert not_callable.startswith("TypeError") and "must be callable" in not_callable
    assert first is None
    assert "can only be called once" in second
    assert "grad_sync='bucketed'" in per_parameter
