"""ddpkit.SyncBatchNorm against torch's batch norm on the whole (global) batch in one process.

Distributed cases run in real gloo process groups: one module-scoped WorkerPool per world size,
reused by every test. Worker functions are module-level (they are pickled by reference); each
takes the global batch, keeps its rank's shard and returns what the parent compares.
"""

import collections
import inspect
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

import ddpkit
from ddpkit.testing import WorkerPool

from helpers import needs_hosts

TIGHT = 1e-5  # what the float32 kernels achieve against BatchNorm1d (observed errors are ~1e-6)


@pytest.fixture(scope="module")
def pools():
    created = {}

    def get(world_size):
        if world_size not in created:
            created[world_size] = WorkerPool(world_size, timeout=120, group_timeout=60)
            created[world_size].start()
        return created[world_size]

    yield get
    for pool in created.values():
        pool.close()


# ----------------------------------------------------------------------------------------------
# Helpers shared by the parent and the workers


def even_sizes(batch, world_size):
    return [len(chunk) for chunk in torch.arange(batch).tensor_split(world_size)]


def shard(x, sizes, rank):
    start = sum(sizes[:rank])
    return x[start : start + sizes[rank]], start


def forward_backward(layer, x, start, half, memory_format=torch.contiguous_format):
    """One step on a shard starting at global index `start`: loss = sum of all outputs of the first
    `half` samples of the global batch. Returns output, input gradient and the comm counters of the
    forward and of the backward."""
    x = x.detach().clone(memory_format=memory_format).requires_grad_()
    ddpkit.reset_comm_counters()
    y = layer(x)
    forward = ddpkit.comm_counters()
    ddpkit.reset_comm_counters()
    y[: max(0, min(start + len(x), half) - start)].sum().backward()
    backward = ddpkit.comm_counters()
    return y.detach(), x.grad, forward, backward


def reference(x, layer, half):
    x = x.detach().clone().requires_grad_()
    y = layer(x)
    y[:half].sum().backward()
    return y.detach(), x.grad


def collective_events(prof):
    """Collective-like profiler events: torch.distributed ops (c10d::*) and backend events
    (gloo:*, nccl:*), with ddpkit's point-to-point messages counted separately."""
    return collections.Counter(e.name for e in prof.events() if e.name.startswith(("c10d::", "gloo:", "nccl:")))


# ----------------------------------------------------------------------------------------------
# Worker functions


def run_step(x, sizes, features, half, algorithm, options):
    """One training step of SyncBatchNorm on this rank's shard of `x`; also the comm counters of one
    stand-alone ddpkit all-reduce of each pass's buffer, for comparison."""
    rank = dist.get_rank()
    local, start = shard(x, sizes, rank)
    settings = {"affine": False, **options.get("layer", {})}  # without weight and bias unless a test asks
    layer = ddpkit.SyncBatchNorm(features, algorithm=algorithm, **settings)
    if "weight" in options:
        with torch.no_grad():
            layer.weight.copy_(options["weight"])
            layer.bias.copy_(options["bias"])
    memory_format = options.get("memory_format", torch.contiguous_format)
    y, grad, forward, backward = forward_backward(layer, local, start, half, memory_format)
    singles = []
    for numel in (2 * features + 1, 2 * features):
        ddpkit.reset_comm_counters()
        ddpkit.all_reduce(torch.zeros(numel, dtype=torch.float64), algorithm=algorithm)
        singles.append(ddpkit.comm_counters())
    grads = (layer.weight.grad, layer.bias.grad) if layer.affine else None
    channels_last = y.is_contiguous(memory_format=memory_format) if memory_format != torch.contiguous_format else None
    return dict(
        y=y,
        grad=grad,
        forward=forward,
        backward=backward,
        singles=singles,
        affine_grads=grads,
        state=layer.state_dict(),
        channels_last=channels_last,
    )


def run_training_steps(batches, sizes_per_step, features, momentum, track_running_stats):
    """Several training steps of one layer (uneven shards allowed), then an eval step on the last batch."""
    rank = dist.get_rank()
    layer = ddpkit.SyncBatchNorm(features, momentum=momentum, affine=True, track_running_stats=track_running_stats)
    outputs = []
    for x, sizes in zip(batches, sizes_per_step):
        local, start = shard(x, sizes, rank)
        outputs.append(forward_backward(layer, local, start, len(x) // 2)[:2])
    layer.eval()
    local, start = shard(batches[-1], sizes_per_step[-1], rank)
    y, grad, forward, backward = forward_backward(layer, local, start, len(batches[-1]) // 2)
    return dict(
        outputs=outputs,
        state=layer.state_dict(),
        eval_y=y,
        eval_grad=grad,
        eval_forward=forward,
        eval_backward=backward,
        affine_grads=(layer.weight.grad, layer.bias.grad),
    )


def run_profiled(x, sizes, features, algorithm):
    """Profiles a training forward, its backward, and an eval forward+backward separately."""
    rank = dist.get_rank()
    local, _ = shard(x, sizes, rank)
    layer = ddpkit.SyncBatchNorm(features, affine=False, algorithm=algorithm)
    phases = {}
    local = local.clone().requires_grad_()
    ddpkit.reset_comm_counters()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        y = layer(local)
    phases["forward"] = (collective_events(prof), ddpkit.comm_counters())
    ddpkit.reset_comm_counters()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        y.sum().backward()
    phases["backward"] = (collective_events(prof), ddpkit.comm_counters())
    layer.eval()
    ddpkit.reset_comm_counters()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        layer(local).sum().backward()
    phases["eval"] = (collective_events(prof), ddpkit.comm_counters())
    # The trace of one stand-alone ddpkit all-reduce of each pass's buffer, for comparison.
    for phase, numel in (("single_forward", 2 * features + 1), ("single_backward", 2 * features)):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            ddpkit.all_reduce(torch.zeros(numel, dtype=torch.float64), algorithm=algorithm)
        phases[phase] = collective_events(prof)
    return phases


def run_single_value(shapes):
    """A training forward on a group whose batch has one value per channel in total; returns what each
    rank raised, then checks that the group still works."""
    local = torch.randn(shapes[dist.get_rank()])
    layer = ddpkit.SyncBatchNorm(local.shape[1], affine=False)
    try:
        layer(local)
        raised = None
    except Exception as exc:  # the test checks type and message
        raised = (type(exc).__name__, str(exc))
    ok = ddpkit.all_reduce(torch.ones(3), algorithm="auto")
    return raised, ok


def run_frozen_input(x, sizes, features):
    """Backward with only weight/bias needing gradients: local sums, no communication."""
    rank = dist.get_rank()
    local, start = shard(x, sizes, rank)
    layer = ddpkit.SyncBatchNorm(features, affine=True)
    y = layer(local)
    ddpkit.reset_comm_counters()
    y[: max(0, min(start + len(local), len(x) // 2) - start)].sum().backward()
    return layer.weight.grad, layer.bias.grad, ddpkit.comm_counters()


def run_eval_without_running_stats(x, sizes, features):
    """track_running_stats=False in eval mode: each rank's own batch statistics, no communication."""
    local, _ = shard(x, sizes, dist.get_rank())
    layer = ddpkit.SyncBatchNorm(features, affine=False, track_running_stats=False).eval()
    ddpkit.reset_comm_counters()
    y = layer(local)
    return y, ddpkit.comm_counters()


def run_generic_kernels(x, sizes, features, dtype):
    """The device-generic (ATen) path on CPU tensors, in a group."""
    ddpkit.syncbn.set_native_cpu_kernels(False)
    try:
        assert ddpkit.syncbn.cpu_kernels() == "aten"
        return run_step(
            x.to(dtype),
            sizes,
            features,
            len(x) // 2,
            "auto",
            {"layer": {"dtype": torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype}},
        )
    finally:
        ddpkit.syncbn.set_native_cpu_kernels(True)


def run_converted_model(x, sizes, state):
    """A converted model trained one step on shards: outputs, input grads, summed parameter grads."""
    rank = dist.get_rank()
    model = small_model()
    model.load_state_dict(state)
    model = ddpkit.convert_sync_batchnorm(model)
    local, start = shard(x, sizes, rank)
    y, grad, forward, backward = forward_backward(model, local, start, len(x) // 2)
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    for g in grads.values():
        dist.all_reduce(g)
    return y, grad, grads, forward, backward


def run_subgroups(x, sizes, features):
    """Two groups of two ranks, {0, 1} and {2, 3}: statistics over the pair only, through the layer and
    through the functional form."""
    rank = dist.get_rank()
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group = groups[rank // 2]
    local, _ = shard(x, sizes, rank)
    ddpkit.reset_comm_counters()
    y = ddpkit.SyncBatchNorm(features, affine=False, process_group=group)(local)
    y_functional = ddpkit.sync_batch_norm(local, None, None, None, None, True, 0.1, 1e-5, group=group)
    return y, y_functional, ddpkit.comm_counters()


def small_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1),
        torch.nn.BatchNorm2d(8),
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Linear(8 * 6 * 6, 16),
        torch.nn.BatchNorm1d(16),
        torch.nn.Sequential(torch.nn.Linear(16, 4), torch.nn.BatchNorm1d(4, affine=False, momentum=None)),
    )


# ----------------------------------------------------------------------------------------------
# The assignment's matrix


@pytest.mark.parametrize("batch", [32, 64])
@pytest.mark.parametrize("features", [128, 256, 512, 1024])
@pytest.mark.parametrize("workers", [1, 4])
def test_matches_batchnorm1d(pools, workers, features, batch):
    torch.manual_seed(1000 * features + batch)
    x = torch.randn(batch, features)
    half = batch // 2
    results = pools(workers).run(run_step, x, even_sizes(batch, workers), features, half, "auto", {})
    y_ref, grad_ref = reference(x, torch.nn.BatchNorm1d(features), half)
    y = torch.cat([r["y"] for r in results])
    grad = torch.cat([r["grad"] for r in results])
    torch.testing.assert_close(y, y_ref, atol=1e-3, rtol=0)
    torch.testing.assert_close(grad, grad_ref, atol=1e-3, rtol=0)
    torch.testing.assert_close(y, y_ref, atol=TIGHT, rtol=0)
    torch.testing.assert_close(grad, grad_ref, atol=TIGHT, rtol=0)
    # Exactly one collective per pass (none alone), and it is the size of the pass's buffer.
    expected = 1 if workers > 1 else 0
    for r in results:
        assert r["forward"]["collectives"] == expected and r["backward"]["collectives"] == expected
        if workers > 1:
            assert r["forward"] == r["singles"][0] and r["backward"] == r["singles"][1]
        else:
            assert r["forward"]["messages_sent"] == 0 and r["backward"]["messages_sent"] == 0
    # Running statistics of the global batch, identical on every rank.
    ref = torch.nn.BatchNorm1d(features)
    ref(x)
    for r in results:
        torch.testing.assert_close(r["state"]["running_mean"], ref.running_mean, atol=1e-6, rtol=0)
        torch.testing.assert_close(r["state"]["running_var"], ref.running_var, atol=1e-6, rtol=0)


# ----------------------------------------------------------------------------------------------
# Communication is exactly one call per pass, whatever calls it


@pytest.mark.parametrize("algorithm", ["auto", "ring", "process_group"])
def test_one_collective_per_pass_in_profiler_trace(pools, algorithm):
    features, batch = 128, 32
    x = torch.randn(batch, features)
    results = pools(4).run(run_profiled, x, even_sizes(batch, 4), features, algorithm)
    for phases in results:
        for phase in ("forward", "backward"):
            events, counters = phases[phase]
            assert counters["collectives"] == 1, (phase, counters)
            assert not [name for name in events if name.startswith("c10d::")], events  # no torch.distributed call
            backend_collectives = {n: c for n, c in events.items() if n not in ("gloo:send", "gloo:recv")}
            if algorithm == "process_group":
                assert backend_collectives == {"gloo:all_reduce": 1}, events
                assert counters["messages_sent"] == 0
            elif algorithm == "auto":
                # The direct all-reduce over shared memory: no gloo call and no message at all.
                assert events == {} and counters["messages_sent"] == 0, (events, counters)
            else:
                # The ring over shared-memory messages: ddpkit's own messages, none through gloo.
                assert events == {} and counters["messages_sent"] > 0, (events, counters)
            # Exactly the backend events of one all-reduce of the pass's buffer.
            assert events == phases["single_" + phase], (events, phases["single_" + phase])
        events, counters = phases["eval"]
        assert not events and counters["collectives"] == 0, (events, counters)


def test_every_algorithm_gives_the_same_result(pools):
    features, batch = 256, 32
    torch.manual_seed(3)
    x = torch.randn(batch, features)
    y_ref, grad_ref = reference(x, torch.nn.BatchNorm1d(features), batch // 2)
    for algorithm in ddpkit.comm.ONE_HOST_ALGORITHMS:
        results = pools(4).run(run_step, x, even_sizes(batch, 4), features, batch // 2, algorithm, {})
        torch.testing.assert_close(torch.cat([r["y"] for r in results]), y_ref, atol=TIGHT, rtol=0)
        torch.testing.assert_close(torch.cat([r["grad"] for r in results]), grad_ref, atol=TIGHT, rtol=0)
        assert all(r["forward"]["collectives"] == 1 and r["backward"]["collectives"] == 1 for r in results)


def test_matches_batchnorm1d_over_the_process_group_transport():
    """DDPKIT_TRANSPORT=process_group: the passes' all-reduces run over torch.distributed send/recv."""
    features, batch = 256, 32
    torch.manual_seed(3)
    x = torch.randn(batch, features)
    y_ref, grad_ref = reference(x, torch.nn.BatchNorm1d(features), batch // 2)
    pool = WorkerPool(4, timeout=120, group_timeout=60, env={"DDPKIT_TRANSPORT": "process_group"})
    try:
        for algorithm in ("auto", "ring"):
            results = pool.run(run_step, x, even_sizes(batch, 4), features, batch // 2, algorithm, {})
            torch.testing.assert_close(torch.cat([r["y"] for r in results]), y_ref, atol=TIGHT, rtol=0)
            torch.testing.assert_close(torch.cat([r["grad"] for r in results]), grad_ref, atol=TIGHT, rtol=0)
            # ddpkit's own messages carried the passes: nothing skipped to another path.
            assert all(r["forward"]["messages_sent"] > 0 and r["backward"]["messages_sent"] > 0 for r in results), [
                (r["forward"], r["backward"]) for r in results
            ]
        assert pool.run(ddpkit.comm.resolved_transport) == ["process_group"] * 4
    finally:
        pool.close()


@needs_hosts
def test_matches_batchnorm1d_across_hosts(hosts):
    """Two simulated hosts of two ranks: each pass's all-reduce runs hierarchically."""
    features, batch = 64, 32
    torch.manual_seed(5)
    x = torch.randn(batch, features)
    y_ref, grad_ref = reference(x, torch.nn.BatchNorm1d(features), batch // 2)
    results = hosts("2x2").run(run_step, x, even_sizes(batch, 4), features, batch // 2, "auto", {}, timeout=300)
    torch.testing.assert_close(torch.cat([r["y"] for r in results]), y_ref, atol=TIGHT, rtol=0)
    torch.testing.assert_close(torch.cat([r["grad"] for r in results]), grad_ref, atol=TIGHT, rtol=0)


def test_process_group_option_selects_the_group(pools):
    features, sizes = 24, [3, 5, 4, 2]
    torch.manual_seed(15)
    x = torch.randn(sum(sizes), features) + torch.arange(sum(sizes)).unsqueeze(1)
    results = pools(4).run(run_subgroups, x, sizes, features)
    for pair in (0, 1):
        ranks = [2 * pair, 2 * pair + 1]
        pair_batch = torch.cat([shard(x, sizes, r)[0] for r in ranks])
        expected = torch.nn.BatchNorm1d(features)(pair_batch)
        torch.testing.assert_close(torch.cat([results[r][0] for r in ranks]), expected, atol=TIGHT, rtol=0)
        torch.testing.assert_close(torch.cat([results[r][1] for r in ranks]), expected, atol=TIGHT, rtol=0)
    assert all(r[2]["collectives"] == 2 for r in results)


def test_weight_only_backward_communicates_nothing(pools):
    features, batch = 64, 24
    torch.manual_seed(4)
    x = torch.randn(batch, features)
    results = pools(4).run(run_frozen_input, x, even_sizes(batch, 4), features)
    ref = torch.nn.BatchNorm1d(features)
    ref(x)[: batch // 2].sum().backward()
    torch.testing.assert_close(sum(r[0] for r in results), ref.weight.grad, atol=1e-4, rtol=0)
    torch.testing.assert_close(sum(r[1] for r in results), ref.bias.grad, atol=1e-4, rtol=0)
    assert all(r[2]["collectives"] == 0 for r in results)


# ----------------------------------------------------------------------------------------------
# Running statistics, uneven and empty shards, eval mode


@pytest.mark.parametrize("momentum", [0.1, None])
def test_running_stats_and_eval_over_several_steps(pools, momentum):
    features = 48
    torch.manual_seed(5)
    splits = [[4, 4, 4, 4], [7, 0, 2, 5], [0, 0, 9, 1], [1, 1, 1, 13]]
    batches = [torch.randn(sum(s), features) * (i + 1) + i for i, s in enumerate(splits)]
    results = pools(4).run(run_training_steps, batches, splits, features, momentum, True)
    ref = torch.nn.BatchNorm1d(features, momentum=momentum)
    for step, x in enumerate(batches):
        y_ref, grad_ref = reference(x, ref, len(x) // 2)
        torch.testing.assert_close(torch.cat([r["outputs"][step][0] for r in results]), y_ref, atol=TIGHT, rtol=0)
        torch.testing.assert_close(torch.cat([r["outputs"][step][1] for r in results]), grad_ref, atol=TIGHT, rtol=0)
    for r in results:
        for key, value in ref.state_dict().items():
            torch.testing.assert_close(r["state"][key], value, atol=1e-5, rtol=1e-6, msg=key)
    ref.eval()
    y_ref, grad_ref = reference(batches[-1], ref, len(batches[-1]) // 2)
    torch.testing.assert_close(torch.cat([r["eval_y"] for r in results]), y_ref, atol=TIGHT, rtol=0)
    torch.testing.assert_close(torch.cat([r["eval_grad"] for r in results]), grad_ref, atol=TIGHT, rtol=0)
    assert all(r["eval_forward"]["collectives"] == 0 and r["eval_backward"]["collectives"] == 0 for r in results)


def test_uneven_and_empty_shards_with_affine_gradients(pools):
    features, sizes = 40, [0, 11, 3, 2]
    torch.manual_seed(6)
    x = torch.randn(sum(sizes), 1).mul(3) + torch.randn(sum(sizes), features)
    weight, bias = torch.randn(features), torch.randn(features)
    options = {"layer": {"affine": True}, "weight": weight, "bias": bias}
    results = pools(4).run(run_step, x, sizes, features, len(x) // 2, "auto", options)
    ref = torch.nn.BatchNorm1d(features)
    with torch.no_grad():
        ref.weight.copy_(weight)
        ref.bias.copy_(bias)
    y_ref, grad_ref = reference(x, ref, len(x) // 2)
    assert results[0]["y"].shape == (0, features) and results[0]["grad"].shape == (0, features)
    torch.testing.assert_close(torch.cat([r["y"] for r in results]), y_ref, atol=TIGHT, rtol=0)
    torch.testing.assert_close(torch.cat([r["grad"] for r in results]), grad_ref, atol=TIGHT, rtol=0)
    # Local weight/bias gradients (what DDP averages) add up to the global batch's.
    torch.testing.assert_close(sum(r["affine_grads"][0] for r in results), ref.weight.grad, atol=1e-5, rtol=0)
    torch.testing.assert_close(sum(r["affine_grads"][1] for r in results), ref.bias.grad, atol=1e-5, rtol=0)
    torch.testing.assert_close(results[0]["affine_grads"][0], torch.zeros(features))
    for r in results:
        torch.testing.assert_close(r["state"]["running_var"], ref.running_var, atol=1e-6, rtol=0)
        assert r["forward"]["collectives"] == 1 and r["backward"]["collectives"] == 1


def test_eval_without_running_stats_uses_local_batch(pools):
    features, sizes = 16, [3, 5, 2, 6]
    torch.manual_seed(7)
    x = torch.randn(sum(sizes), features)
    results = pools(4).run(run_eval_without_running_stats, x, sizes, features)
    for rank, (y, counters) in enumerate(results):
        local, _ = shard(x, sizes, rank)
        expected = torch.nn.BatchNorm1d(features, track_running_stats=False).eval()(local)
        torch.testing.assert_close(y, expected, atol=TIGHT, rtol=0)
        assert counters["collectives"] == 0


@pytest.mark.parametrize(
    "shapes", [[(1, 8), (0, 8), (0, 8), (0, 8)], [(0, 8, 1, 1), (0, 8, 1, 1), (1, 8, 1, 1), (0, 8, 1, 1)]]
)
def test_single_value_per_channel_raises_on_every_rank(pools, shapes):
    results = pools(4).run(run_single_value, shapes)
    for raised, ok in results:
        assert raised is not None and raised[0] == "ValueError"
        assert raised[1].startswith("Expected more than 1 value per channel when training")
        torch.testing.assert_close(ok, torch.full((3,), 4.0))


# ----------------------------------------------------------------------------------------------
# Shapes, layouts, dtypes, precision


@pytest.mark.parametrize(
    "shape,memory_format",
    [
        ((12, 24), torch.contiguous_format),
        ((12, 24, 7), torch.contiguous_format),
        ((8, 24, 5, 6), torch.contiguous_format),
        ((8, 24, 5, 6), torch.channels_last),
        ((6, 20, 3, 4, 5), torch.contiguous_format),
        ((6, 20, 3, 4, 5), torch.channels_last_3d),
        ((4, 33, 70, 70), torch.contiguous_format),  # planes longer than a kernel block, odd channel count
    ],
)
def test_input_shapes_and_layouts(pools, shape, memory_format):
    torch.manual_seed(8)
    features = shape[1]
    x = torch.randn(shape) * 2 + 0.5
    weight, bias = torch.randn(features), torch.randn(features)
    options = {"layer": {"affine": True}, "weight": weight, "bias": bias, "memory_format": memory_format}
    sizes = even_sizes(shape[0], 4)
    results = pools(4).run(run_step, x, sizes, features, shape[0] // 2, "auto", options)
    ref = {2: torch.nn.BatchNorm1d, 3: torch.nn.BatchNorm1d, 4: torch.nn.BatchNorm2d, 5: torch.nn.BatchNorm3d}[
        len(shape)
    ](features)
    with torch.no_grad():
        ref.weight.copy_(weight)
        ref.bias.copy_(bias)
    y_ref, grad_ref = reference(x, ref, shape[0] // 2)
    torch.testing.assert_close(torch.cat([r["y"] for r in results]), y_ref, atol=TIGHT, rtol=0)
    torch.testing.assert_close(torch.cat([r["grad"] for r in results]), grad_ref, atol=TIGHT, rtol=0)
    torch.testing.assert_close(sum(r["affine_grads"][0] for r in results), ref.weight.grad, atol=1e-3, rtol=1e-5)
    torch.testing.assert_close(sum(r["affine_grads"][1] for r in results), ref.bias.grad, atol=1e-3, rtol=1e-5)
    if memory_format != torch.contiguous_format:
        assert all(r["channels_last"] for r in results)


def test_large_mean_inputs(pools):
    torch.manual_seed(9)
    features, batch = 256, 64
    x = 1e4 + torch.randn(batch, features)
    results = pools(4).run(run_step, x, even_sizes(batch, 4), features, batch // 2, "auto", {})
    # The exact answer: BatchNorm1d in float64 on the same float32 values (float32 BatchNorm1d itself
    # is off by ~2e-3 here).
    y_ref, grad_ref = reference(x.double(), torch.nn.BatchNorm1d(features).double(), batch // 2)
    torch.testing.assert_close(torch.cat([r["y"] for r in results]).double(), y_ref, atol=TIGHT, rtol=0)
    torch.testing.assert_close(torch.cat([r["grad"] for r in results]).double(), grad_ref, atol=TIGHT, rtol=0)


@pytest.mark.parametrize("dtype,atol", [(torch.float64, 1e-12), (torch.bfloat16, 3e-2), (torch.float16, 4e-3)])
def test_dtypes(pools, dtype, atol):
    torch.manual_seed(10)
    features, batch = 96, 40
    x = torch.randn(batch, features, 3).to(dtype)
    parameter_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    options = {"layer": {"dtype": parameter_dtype}}
    results = pools(4).run(run_step, x, even_sizes(batch, 4), features, batch // 2, "auto", options)
    y_ref, grad_ref = reference(
        x.to(parameter_dtype), torch.nn.BatchNorm1d(features, dtype=parameter_dtype), batch // 2
    )
    y = torch.cat([r["y"] for r in results])
    grad = torch.cat([r["grad"] for r in results])
    assert y.dtype == dtype and grad.dtype == dtype
    assert results[0]["state"]["running_mean"].dtype == parameter_dtype
    torch.testing.assert_close(y.to(parameter_dtype), y_ref, atol=atol, rtol=0)
    torch.testing.assert_close(grad.to(parameter_dtype), grad_ref, atol=atol, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_device_generic_kernels(pools, dtype):
    """The ATen path that serves CUDA, run on CPU tensors, agrees with the native CPU kernels."""
    torch.manual_seed(11)
    features, batch = 40, 24
    x = torch.randn(batch, features, 5, 3)
    generic = pools(4).run(run_generic_kernels, x, even_sizes(batch, 4), features, dtype)
    native = pools(4).run(
        run_step, x.to(dtype), even_sizes(batch, 4), features, batch // 2, "auto", {"layer": {"dtype": torch.float32}}
    )
    atol = TIGHT if dtype == torch.float32 else 2e-2
    for g, n in zip(generic, native):
        torch.testing.assert_close(g["y"], n["y"], atol=atol, rtol=0)
        torch.testing.assert_close(g["grad"], n["grad"], atol=atol, rtol=0)
        torch.testing.assert_close(g["state"]["running_var"], n["state"]["running_var"], atol=1e-6, rtol=0)
        assert g["forward"]["collectives"] == 1 and g["backward"]["collectives"] == 1


@pytest.mark.parametrize(
    "capability",
    [
        "default",
        pytest.param(
            "avx2",
            marks=pytest.mark.skipif(
                torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
                reason="this CPU runs no AVX2 kernels",
            ),
        ),
    ],
)
def test_other_cpu_capabilities(capability):
    """The DEFAULT and AVX2 copies of the CPU kernels (this machine may run AVX512), in a fresh process."""
    script = textwrap.dedent("""
        import torch, ddpkit
        assert ddpkit.syncbn.cpu_kernels() == "cpu-" + CAPABILITY, ddpkit.syncbn.cpu_kernels()
        torch.manual_seed(0)
        for shape, fmt in [((20, 70), torch.contiguous_format), ((6, 19, 9, 7), torch.contiguous_format),
                           ((6, 19, 9, 7), torch.channels_last)]:
            for dtype, atol in [(torch.float32, 1e-5), (torch.float64, 1e-12), (torch.bfloat16, 3e-2)]:
                x = torch.randn(shape).to(dtype).contiguous(memory_format=fmt).requires_grad_()
                pdt = torch.float64 if dtype == torch.float64 else torch.float32
                layer = ddpkit.SyncBatchNorm(shape[1], affine=True, dtype=pdt)
                ref_layer = (torch.nn.BatchNorm1d if len(shape) == 2 else torch.nn.BatchNorm2d)(shape[1], dtype=pdt)
                y = layer(x)
                y.sum().backward()
                xr = x.detach().to(pdt).requires_grad_()
                yr = ref_layer(xr)
                yr.sum().backward()
                torch.testing.assert_close(y.to(pdt), yr, atol=atol, rtol=0)
                torch.testing.assert_close(x.grad.to(pdt), xr.grad, atol=atol, rtol=0)
                torch.testing.assert_close(layer.running_var, ref_layer.running_var, atol=1e-6, rtol=0)
        print("ok")
    """).replace("CAPABILITY", repr(capability.upper()))
    env = dict(os.environ, ATEN_CPU_CAPABILITY=capability)
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


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
            y_ref, grad_ref = reference(x, ref, shape[0] // 2)
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
        y_ref, grad_ref = reference(x.double(), ref, shape[0] // 2)
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


def test_converted_model_in_a_group_matches_the_full_batch(pools):
    torch.manual_seed(13)
    state = small_model().state_dict()
    x = torch.randn(20, 3, 6, 6)
    sizes = [6, 0, 9, 5]
    results = pools(4).run(run_converted_model, x, sizes, state)
    model = small_model()
    model.load_state_dict(state)
    y_ref, grad_ref = reference(x, model, len(x) // 2)
    torch.testing.assert_close(torch.cat([r[0] for r in results]), y_ref, atol=TIGHT, rtol=0)
    torch.testing.assert_close(torch.cat([r[1] for r in results]), grad_ref, atol=TIGHT, rtol=0)
    for name, p in model.named_parameters():
        torch.testing.assert_close(results[0][2][name], p.grad, atol=1e-4, rtol=1e-4, msg=name)
    assert all(r[3]["collectives"] == 3 and r[4]["collectives"] == 3 for r in results)  # three layers


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
