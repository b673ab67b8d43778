"""ddpkit.SyncBatchNorm against torch's batch norm on the whole (global) batch in one process.

Distributed cases run in real gloo process groups: one module-scoped WorkerPool per world size,
reused by every test. Worker functions are module-level (they are pickled by reference); each
takes the global batch, keeps its rank's shard and returns what the parent compares.
"""

import collections
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

from helpers import batch_norm_reference, even_sizes, forward_backward, needs_hosts, shard, small_model

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
    y_ref, grad_ref = batch_norm_reference(x, torch.nn.BatchNorm1d(features), half)
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
    y_ref, grad_ref = batch_norm_reference(x, torch.nn.BatchNorm1d(features), batch // 2)
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
    y_ref, grad_ref = batch_norm_reference(x, torch.nn.BatchNorm1d(features), batch // 2)
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
    y_ref, grad_ref = batch_norm_reference(x, torch.nn.BatchNorm1d(features), batch // 2)
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
        y_ref, grad_ref = batch_norm_reference(x, ref, len(x) // 2)
        torch.testing.assert_close(torch.cat([r["outputs"][step][0] for r in results]), y_ref, atol=TIGHT, rtol=0)
        torch.testing.assert_close(torch.cat([r["outputs"][step][1] for r in results]), grad_ref, atol=TIGHT, rtol=0)
    for r in results:
        for key, value in ref.state_dict().items():
            torch.testing.assert_close(r["state"][key], value, atol=1e-5, rtol=1e-6, msg=key)
    ref.eval()
    y_ref, grad_ref = batch_norm_reference(batches[-1], ref, len(batches[-1]) // 2)
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
    y_ref, grad_ref = batch_norm_reference(x, ref, len(x) // 2)
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
    y_ref, grad_ref = batch_norm_reference(x, ref, shape[0] // 2)
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
    y_ref, grad_ref = batch_norm_reference(x.double(), torch.nn.BatchNorm1d(features).double(), batch // 2)
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
    y_ref, grad_ref = batch_norm_reference(
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


def test_converted_model_in_a_group_matches_the_full_batch(pools):
    torch.manual_seed(13)
    state = small_model().state_dict()
    x = torch.randn(20, 3, 6, 6)
    sizes = [6, 0, 9, 5]
    results = pools(4).run(run_converted_model, x, sizes, state)
    model = small_model()
    model.load_state_dict(state)
    y_ref, grad_ref = batch_norm_reference(x, model, len(x) // 2)
    torch.testing.assert_close(torch.cat([r[0] for r in results]), y_ref, atol=TIGHT, rtol=0)
    torch.testing.assert_close(torch.cat([r[1] for r in results]), grad_ref, atol=TIGHT, rtol=0)
    for name, p in model.named_parameters():
        torch.testing.assert_close(results[0][2][name], p.grad, atol=1e-4, rtol=1e-4, msg=name)
    assert all(r[3]["collectives"] == 3 and r[4]["collectives"] == 3 for r in results)  # three layers
