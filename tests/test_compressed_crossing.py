"""Note [Compressed crossing]: float32 sums and means that cross hosts in bfloat16 or float16.

The groups are split into hosts by DDPKIT_TEST_HOSTS (the testing build's override): two hosts swap
over their socket link, three or more run the ring (Note [A ring across hosts]). Every rank must end
with the same bits, the error must stay within the Note's bound against a float64 reference, and
everything the Note leaves exact (other dtypes and ops, tensors that ride in the check's round) must
equal the uncompressed result.
"""

import pytest
import torch
import torch.distributed as dist

import ddpkit
from ddpkit.testing import WorkerPool

from helpers import rank_input

# hosts: labels of DDPKIT_TEST_HOSTS
LAYOUTS = {"2x2": "a,a,b,b", "3x1": "a,b,c", "3x2": "a,a,b,b,c,c", "4x1": "a,b,c,d"}
CROSSINGS = (None, torch.bfloat16, torch.float16)
# Larger than the check's round carries (Note [One round across hosts]): crosses in the channel.
LARGE = 100_003
SMALL = 1000
# The relative rounding of one value in each format: 8 significant bits in bfloat16, 11 in float16.
UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def case_crossings(world_size_numel):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    out = {}
    for cross in CROSSINGS:
        for numel in (SMALL, LARGE):
            for op in ("sum", "mean"):
                tensor = rank_input(rank, numel)
                ddpkit.all_reduce(tensor, op=op, cross_host_dtype=cross)
                out[("all_reduce", cross, numel, op)] = tensor
        block = torch.empty(world_size_numel)
        ddpkit.reduce_scatter_tensor(block, rank_input(rank, world_size * world_size_numel), cross_host_dtype=cross)
        out[("reduce_scatter", cross)] = block
        # Left exact: an integer sum and a float max.
        integers = rank_input(rank, LARGE, dtype=torch.int64, integer=True)
        ddpkit.all_reduce(integers, cross_host_dtype=cross)
        out[("int64", cross)] = integers
        largest = rank_input(rank, LARGE)
        ddpkit.all_reduce(largest, op="max", cross_host_dtype=cross)
        out[("max", cross)] = largest
    # The backend's option: torch's own all_reduce on a "ddpkit" group made with it.
    group = dist.new_group(backend="ddpkit", pg_options=ddpkit.Options(cross_host_dtype=torch.bfloat16))
    tensor = rank_input(rank, LARGE)
    dist.all_reduce(tensor, group=group)
    out["backend"] = tensor
    dist.destroy_process_group(group)
    return out


def assert_within_rounding(result, inputs, hosts, cross, mean):
    """|result - exact| <= one rounding per host of a partial sum no larger than the sum of the
    magnitudes (Note [Compressed crossing]), and float32's own additions."""
    exact = inputs.sum(0)
    bound = (hosts * UNIT_ROUNDOFF[cross] + len(inputs) * 2.0**-24) * inputs.abs().sum(0)
    if mean:
        exact, bound = exact / len(inputs), bound / len(inputs)
    error = (result.double() - exact).abs()
    assert bool((error <= bound).all()), f"largest error {error.max():.3g} over bound {bound[error.argmax()]:.3g}"


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def crossed(request):
    labels = LAYOUTS[request.param]
    world_size = len(labels.split(","))
    with WorkerPool(world_size, timeout=300, group_timeout=60, env={"DDPKIT_TEST_HOSTS": labels}) as pool:
        per_rank = pool.run(case_crossings, 30_001, timeout=300)
    return per_rank, world_size, len(set(labels.split(",")))


def test_every_rank_ends_with_the_same_bits(crossed):
    per_rank, _, _ = crossed
    for key, tensor in per_rank[0].items():
        if key[0] == "reduce_scatter":
            continue  # each rank holds its own block
        for rank, result in enumerate(per_rank[1:], start=1):
            assert torch.equal(result[key].view(torch.uint8), tensor.view(torch.uint8)), (rank, key)


def test_compressed_sums_are_within_the_notes_bound_and_differ_from_exact(crossed):
    per_rank, world_size, hosts = crossed
    inputs = torch.stack([rank_input(r, LARGE, dtype=torch.float64) for r in range(world_size)])
    exact_sum = per_rank[0][("all_reduce", None, LARGE, "sum")]
    torch.testing.assert_close(exact_sum.double(), inputs.sum(0), atol=1e-5, rtol=0)
    for cross in (torch.bfloat16, torch.float16):
        for op in ("sum", "mean"):
            result = per_rank[0][("all_reduce", cross, LARGE, op)]
            assert_within_rounding(result, inputs, hosts, cross, mean=op == "mean")
        # It did cross compressed: most elements differ from the exact sum.
        assert (per_rank[0][("all_reduce", cross, LARGE, "sum")] != exact_sum).float().mean() > 0.5


def test_compressed_reduce_scatter_is_within_the_notes_bound(crossed):
    per_rank, world_size, hosts = crossed
    m = 30_001
    wide = torch.stack([rank_input(r, world_size * m, dtype=torch.float64) for r in range(world_size)])
    for rank, result in enumerate(per_rank):
        mine = wide[:, rank * m : (rank + 1) * m]
        torch.testing.assert_close(result[("reduce_scatter", None)].double(), mine.sum(0), atol=1e-5, rtol=0)
        for cross in (torch.bfloat16, torch.float16):
            assert_within_rounding(result[("reduce_scatter", cross)], mine, hosts, cross, mean=False)


def test_what_the_note_leaves_exact_is_exact(crossed):
    per_rank, _, _ = crossed
    out = per_rank[0]
    for cross in (torch.bfloat16, torch.float16):
        assert torch.equal(out[("int64", cross)], out[("int64", None)])
        assert torch.equal(out[("max", cross)], out[("max", None)])
        for op in ("sum", "mean"):  # small enough to ride in the check's round
            assert torch.equal(out[("all_reduce", cross, SMALL, op)], out[("all_reduce", None, SMALL, op)])


def test_the_backends_option_compresses_torchs_all_reduce(crossed):
    per_rank, _, _ = crossed
    for result in per_rank:
        assert torch.equal(result["backend"], result[("all_reduce", torch.bfloat16, LARGE, "sum")])


def case_mismatch():
    rank = dist.get_rank()
    try:
        ddpkit.all_reduce(torch.ones(LARGE), cross_host_dtype=torch.bfloat16 if rank == 1 else None)
        error = None
    except RuntimeError as exc:
        error = str(exc)
    after = torch.full((LARGE,), float(rank))
    ddpkit.all_reduce(after)  # the group survives a detected mismatch
    return error, after[0].item()


def test_ranks_that_disagree_on_the_crossing_raise_naming_it():
    with WorkerPool(4, timeout=120, group_timeout=60, env={"DDPKIT_TEST_HOSTS": "a,a,b,b"}) as pool:
        outcomes = pool.run(case_mismatch)
    for error, after in outcomes:
        assert error is not None and "cross_host_dtype" in error and "bfloat16" in error and "exact" in error, error
        assert after == 6.0


def test_only_the_formats_of_the_table_are_taken():
    assert ddpkit.comm.WIRE_FORMATS == ("exact", "bfloat16", "float16")
    assert [ddpkit.comm.wire_format(d) for d in CROSSINGS] == list(ddpkit.comm.WIRE_FORMATS)
    with pytest.raises(ValueError, match="cross_host_dtype must be None, torch.bfloat16 or torch.float16"):
        ddpkit.comm.wire_format(torch.float64)
    with pytest.raises(ValueError, match="cross_host_dtype"):
        ddpkit.Options(cross_host_dtype=torch.int8)
    with pytest.raises(TypeError, match="pg_options must be a ddpkit.Options"):
        ddpkit.backend._create(dist.HashStore(), 0, 1, dist.default_pg_timeout, options=object())


def case_ddp_hook(cross_host_dtype):
    """ddpkit's DDP with torch's allreduce_hook on a "ddpkit" group made with ddpkit.Options: the
    gradients after one backward of this rank's batch."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    torch.manual_seed(0)
    model = ddpkit.DistributedDataParallel(torch.nn.Linear(300, 400))  # 120k parameters: they cross in the channel
    group = dist.new_group(backend="ddpkit", pg_options=ddpkit.Options(cross_host_dtype=cross_host_dtype))
    model.register_comm_hook(group, default_hooks.allreduce_hook)
    torch.manual_seed(1 + dist.get_rank())
    model(torch.randn(8, 300)).square().mean().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    dist.destroy_process_group(group)
    return grads


def test_a_ddp_hook_reaches_the_compressed_crossing():
    with WorkerPool(4, timeout=120, group_timeout=60, env={"DDPKIT_TEST_HOSTS": "a,a,b,b"}) as pool:
        exact = pool.run(case_ddp_hook, None)
        crossed = pool.run(case_ddp_hook, torch.bfloat16)
    for rank in range(1, 4):
        for a, b in zip(crossed[0] + exact[0], crossed[rank] + exact[rank], strict=True):
            assert torch.equal(a, b), rank  # every rank's gradients alike
    for ours, reference in zip(crossed[0], exact[0], strict=True):
        assert not torch.equal(ours, reference)
        # Two roundings (one per host) of partial sums no larger than the gradients' scale.
        torch.testing.assert_close(ours, reference, rtol=0, atol=2 * 2.0**-8 * reference.abs().max().item())
