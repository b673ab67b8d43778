"""ddpkit's collectives against float64 references, on real gloo process groups.

Tolerance: float32 inputs drawn from N(0, 1) must match the float64 reduction within
atol = 1e-5 * world_size (the rounding of n-1 float32 additions); integer-valued inputs, whose
sums are exact in float32, must match exactly, as nccl-tests checks.
"""

import threading
import time

import pytest
import torch
import torch.distributed as dist

import ddpkit
from ddpkit.comm import ONE_HOST_ALGORITHMS as ALGORITHMS
from ddpkit.testing import time_engine_loop

from helpers import all_inputs, caught, rank_input, reference

# The all-reduce's world sizes: 3 and 4 are slow: 5 ranks take the same paths for a world that is not a
# power of two, 8 for one that is.
WORLD_SIZES = [
    1,
    2,
    pytest.param(3, marks=pytest.mark.slow),
    pytest.param(4, marks=pytest.mark.slow),
    5,
    8,
]


def numels_for(world_size):
    return sorted({0, 1, max(world_size - 1, 0), 1000, 1001, 100_000})


# --- cases that run on every rank ----------------------------------------------------------------


def case_all_reduce(numels, ops, integer):
    rank = dist.get_rank()
    results = {}
    for algorithm in ALGORITHMS:
        for numel in numels:
            for op in ops:
                tensor = rank_input(rank, numel, integer=integer)
                returned = ddpkit.all_reduce(tensor, op=op, algorithm=algorithm)
                assert returned.data_ptr() == tensor.data_ptr(), "all_reduce must work in place"
                results[(algorithm, numel, op)] = tensor
    return results


def case_dtypes():
    rank = dist.get_rank()
    out = {}
    for dtype in (torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64):
        for algorithm in ALGORITHMS:
            tensor = (
                rank_input(rank, 777, integer=True, dtype=dtype)
                if not dtype.is_floating_point
                else rank_input(rank, 777, dtype=dtype)
            )
            ddpkit.all_reduce(tensor, op="sum", algorithm=algorithm)
            out[(dtype, algorithm)] = tensor
    return out


def case_rooted():
    rank, world_size = dist.get_rank(), dist.get_world_size()
    out = {}
    for root in range(world_size):
        tensor = rank_input(rank, 1001, integer=True)
        ddpkit.broadcast(tensor, src=root)
        out[("broadcast", root)] = tensor
        tensor = rank_input(rank, 1001, integer=True)
        ddpkit.reduce(tensor, dst=root, op="sum")
        out[("reduce", root)] = tensor if rank == root else None
        gathered = ddpkit.gather(rank_input(rank, 10, integer=True).view(2, 5), dst=root)
        out[("gather", root)] = gathered
        chunks = (
            torch.arange(world_size * 6, dtype=torch.float32).view(world_size, 2, 3) * (root + 1)
            if rank == root
            else None
        )
        received = torch.empty(2, 3)
        ddpkit.scatter(received, chunks, src=root)
        out[("scatter", root)] = received
    return out


def case_raises(fn_name):
    """Runs one bad call; returns the exception text (or None if nothing was raised)."""
    return caught(BAD_CALLS[fn_name], dist.get_rank())


BAD_CALLS = {
    "numel_mismatch": lambda rank: ddpkit.all_reduce(torch.ones(1000 + (rank == 1)), algorithm="ring"),
    "dtype_mismatch": lambda rank: ddpkit.all_reduce(
        torch.ones(8, dtype=torch.float64 if rank == 1 else torch.float32)
    ),
    "op_mismatch": lambda rank: ddpkit.all_reduce(torch.ones(8), op="max" if rank == 1 else "sum"),
    "algorithm_mismatch": lambda rank: ddpkit.all_reduce(torch.ones(8), algorithm="butterfly" if rank == 1 else "ring"),
    "collective_mismatch": lambda rank: (
        ddpkit.broadcast(torch.ones(8)) if rank == 1 else ddpkit.all_reduce(torch.ones(8))
    ),
    "root_mismatch": lambda rank: ddpkit.broadcast(torch.ones(8), src=1 if rank == 1 else 0),
    "non_contiguous_on_one_rank": lambda rank: ddpkit.all_reduce(
        torch.ones(4, 4).t() if rank == 1 else torch.ones(4, 4)
    ),
    "non_contiguous": lambda rank: ddpkit.all_reduce(torch.ones(4, 4).t()),
    "unsupported_dtype": lambda rank: ddpkit.all_reduce(torch.ones(4, dtype=torch.bool)),
    "complex_dtype": lambda rank: ddpkit.all_reduce(torch.ones(4, dtype=torch.complex64)),
    "mean_of_integers": lambda rank: ddpkit.all_reduce(torch.ones(4, dtype=torch.int64), op="mean"),
    "unknown_algorithm": lambda rank: ddpkit.all_reduce(torch.ones(4), algorithm="telepathy"),
    "unknown_op": lambda rank: ddpkit.all_reduce(torch.ones(4), op="product"),
    "src_out_of_range": lambda rank: ddpkit.broadcast(torch.ones(4), src=dist.get_world_size()),
    "reduce_dst_out_of_range": lambda rank: ddpkit.reduce(torch.ones(4), dst=-1),
    "gather_dst_out_of_range": lambda rank: ddpkit.gather(torch.ones(4), dst=dist.get_world_size()),
    "scatter_bad_chunks": lambda rank: ddpkit.scatter(torch.empty(3), torch.ones(1, 3) if rank == 0 else None, src=0),
}


def case_after_errors_group_still_works():
    """An error caught by the header check leaves the group usable for the next collective."""
    tensor = torch.full((100,), float(dist.get_rank()))
    ddpkit.all_reduce(tensor, algorithm="ring")
    return tensor


def case_unchecked(numel):
    rank = dist.get_rank()
    ddpkit.set_collective_checks(False)
    try:
        tensor = rank_input(rank, numel, integer=True)
        ddpkit.all_reduce(tensor, algorithm="auto")
        counters = ddpkit.comm_counters()
    finally:
        ddpkit.set_collective_checks(True)
    return tensor, counters


def case_gil_released():
    """A thread blocked in a ddpkit collective must let the main thread run."""
    rank = dist.get_rank()
    tensor = torch.ones(10)
    if rank == 1:
        time.sleep(0.5)
        ddpkit.all_reduce(tensor)
        return None
    thread = threading.Thread(target=ddpkit.all_reduce, args=(tensor,))
    thread.start()
    time.sleep(0.05)
    spins = 0
    while thread.is_alive():
        spins += 1
    thread.join()
    return spins


def case_mixed_load(iterations):
    """Many consecutive collectives of mixed sizes and algorithms, integer-valued: always exact."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    generator = torch.Generator().manual_seed(1234)  # identical on every rank: same sizes, same order
    algorithms = [a for a in ALGORITHMS]
    failures = []
    for i in range(iterations):
        numel = int(torch.randint(0, 5000, (1,), generator=generator))
        algorithm = algorithms[int(torch.randint(0, len(algorithms), (1,), generator=generator))]
        tensor = torch.arange(numel, dtype=torch.float32) + rank
        ddpkit.all_reduce(tensor, algorithm=algorithm)
        expected = torch.arange(numel, dtype=torch.float32) * world_size + world_size * (world_size - 1) / 2
        if not torch.equal(tensor, expected):
            failures.append((i, algorithm, numel))
    return failures


# --- tests ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_all_reduce_matches_float64_reference(pool, world_size):
    numels = numels_for(world_size)
    ops = ["sum", "mean", "max", "min"]
    per_rank = pool(world_size).run(case_all_reduce, numels, ops, False)
    for key, tensor in per_rank[0].items():
        algorithm, numel, op = key
        expected = reference(world_size, numel, op)
        assert tensor.dtype == torch.float32 and tensor.shape == (numel,)
        torch.testing.assert_close(tensor.double(), expected, atol=1e-5 * world_size, rtol=0, msg=str(key))
        for rank in range(1, world_size):
            assert torch.equal(per_rank[rank][key], tensor), f"rank {rank} differs from rank 0 for {key}"


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_all_reduce_integer_values_are_exact(pool, world_size):
    numels = numels_for(world_size)
    per_rank = pool(world_size).run(case_all_reduce, numels, ["sum", "max", "min"], True)
    for rank_results in per_rank:
        for (algorithm, numel, op), tensor in rank_results.items():
            expected = reference(world_size, numel, op, integer=True).float()
            assert torch.equal(tensor, expected), (algorithm, numel, op)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_dtypes(pool, world_size):
    per_rank = pool(world_size).run(case_dtypes)
    for (dtype, algorithm), tensor in per_rank[0].items():
        assert tensor.dtype == dtype
        if dtype.is_floating_point:
            exact = all_inputs(world_size, 777, dtype=dtype).sum(0)  # float64 sum of the dtype's values
            # float16/bfloat16 are reduced in float32 and rounded once: within one rounding of the exact sum
            torch.testing.assert_close(
                tensor.double(), exact, atol=1e-5, rtol=torch.finfo(dtype).eps, msg=f"{dtype} {algorithm}"
            )
        else:
            assert torch.equal(tensor, all_inputs(world_size, 777, integer=True).sum(0).to(dtype))
        for rank in range(1, world_size):
            assert torch.equal(per_rank[rank][(dtype, algorithm)], tensor)


@pytest.mark.parametrize("world_size", [1, 2, 3, 5])
def test_broadcast_reduce_gather_scatter(pool, world_size):
    per_rank = pool(world_size).run(case_rooted)
    for root in range(world_size):
        source = rank_input(root, 1001, integer=True)
        for rank in range(world_size):
            assert torch.equal(per_rank[rank][("broadcast", root)], source)
            gathered = per_rank[rank][("gather", root)]
            if rank == root:
                expected = torch.stack([rank_input(r, 10, integer=True).view(2, 5) for r in range(world_size)])
                assert torch.equal(gathered, expected)
            else:
                assert gathered is None
            chunks = torch.arange(world_size * 6, dtype=torch.float32).view(world_size, 2, 3) * (root + 1)
            assert torch.equal(per_rank[rank][("scatter", root)], chunks[rank])
        assert torch.equal(per_rank[root][("reduce", root)], reference(world_size, 1001, "sum", integer=True).float())


MISMATCH_MESSAGES = {
    "numel_mismatch": "rank 1 passed elements 1001, rank 0 passed elements 1000",
    "dtype_mismatch": "rank 1 passed dtype Double, rank 0 passed dtype Float",
    "op_mismatch": "rank 1 passed op",
    "algorithm_mismatch": "rank 1 passed algorithm",
    "collective_mismatch": "rank 1 passed collective broadcast, rank 0 passed collective all_reduce",
    "root_mismatch": "rank 1 passed root 1, rank 0 passed root 0",
    "non_contiguous_on_one_rank": "rank 1 rejected its arguments",
}


@pytest.mark.parametrize("case", sorted(MISMATCH_MESSAGES))
def test_mismatched_calls_raise_on_every_rank(pool, case):
    world_size = 3
    started = time.monotonic()
    outcomes = pool(world_size).run(case_raises, case)
    assert time.monotonic() - started < 20, "a mismatch must be reported at once, not at the group timeout"
    for rank, outcome in enumerate(outcomes):
        assert outcome is not None, f"rank {rank} did not raise for {case}"
        if case == "non_contiguous_on_one_rank" and rank == 1:
            assert "contiguous" in outcome
        else:
            assert MISMATCH_MESSAGES[case] in outcome, outcome
    # the group survives a detected mismatch
    results = pool(world_size).run(case_after_errors_group_still_works)
    for tensor in results:
        assert torch.equal(tensor, torch.full((100,), 3.0))


BAD_ARGUMENT_MESSAGES = {
    "non_contiguous": "expected a contiguous tensor",
    "unsupported_dtype": "unsupported dtype Bool",
    "complex_dtype": "unsupported dtype ComplexFloat",
    "mean_of_integers": "op 'mean' needs a floating-point tensor",
    "unknown_algorithm": "unknown algorithm 'telepathy'",
    "unknown_op": "unknown reduce op 'product'",
    "src_out_of_range": "src=2 is not a rank of this group",
    "reduce_dst_out_of_range": "reduce: dst=-1 is not a rank of this group (size 2)",
    "gather_dst_out_of_range": "gather: dst=2 is not a rank of this group (size 2)",
    "scatter_bad_chunks": "on src the chunks must have shape [2, 3]",
}


def case_meta_tensors(meta_ranks):
    """Meta tensors take the ops' fake kernels (python/ddpkit/comm.py), which still take part in the
    collective check (no data): meta on every rank agrees; meta on some ranks raises on every rank."""
    rank = dist.get_rank()
    device = "meta" if rank in meta_ranks else "cpu"
    before = ddpkit.comm_counters()
    out = {}
    try:
        tensor = torch.ones(3, device=device)
        out["all_reduce_is_tensor"] = ddpkit.all_reduce(tensor) is tensor
        gathered = ddpkit.gather(torch.ones(2, 5, device=device), dst=0)
        out["gathered_shape"] = None if gathered is None else tuple(gathered.shape)
    except RuntimeError as exc:
        out["error"] = str(exc)
    after = torch.full((10,), float(rank + 1))
    ddpkit.all_reduce(after)  # the group still pairs its calls
    out["after"] = after[0].item()
    out["bytes_sent"] = ddpkit.comm_counters()["bytes_sent"] - before["bytes_sent"]
    return out


def test_meta_tensors_on_every_rank_take_the_fake_kernels(pool):
    for out in pool(2).run(case_meta_tensors, (0, 1)):
        assert out["all_reduce_is_tensor"] and "error" not in out and out["after"] == 3.0
    results = pool(2).run(case_meta_tensors, (0, 1))
    assert results[0]["gathered_shape"] == (2, 2, 5) and results[1]["gathered_shape"] is None


def test_a_meta_tensor_on_one_rank_raises_on_every_rank(pool):
    outcomes = pool(2).run(case_meta_tensors, (1,))
    for out in outcomes:
        assert "rank 1 passed tensor on the meta device (no data), rank 0 passed tensor with data" in out["error"], out
        assert out["after"] == 3.0  # and the next all-reduce paired correctly


@pytest.mark.parametrize("case", sorted(BAD_ARGUMENT_MESSAGES))
def test_bad_arguments_raise_clearly(pool, case):
    outcomes = pool(2).run(case_raises, case)
    for outcome in outcomes:
        assert outcome is not None
        assert BAD_ARGUMENT_MESSAGES[case] in outcome or "rejected its arguments" in outcome, outcome
    assert BAD_ARGUMENT_MESSAGES[case] in outcomes[0], outcomes[0]


def test_requires_initialized_process_group():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="torch.distributed is not initialized"):
        ddpkit.all_reduce(torch.ones(3))


def test_unchecked_mode_is_correct_and_counts(pool):
    per_rank = pool(4).run(case_unchecked, 3000)
    for tensor, counters in per_rank:
        assert torch.equal(tensor, reference(4, 3000, "sum", integer=True).float())
        assert counters["collectives"] >= 1 and counters["messages_sent"] >= 1


def case_engine_loop():
    per_call = {
        stage: time_engine_loop(1000, 20, stage) for stage in ("lookup", "engine", "all_reduce_unchecked", "all_reduce")
    }
    try:
        time_engine_loop(1000, 20, "everything")
        error = None
    except RuntimeError as exc:
        error = str(exc)
    after = torch.full((5,), float(dist.get_rank()))
    ddpkit.all_reduce(after)
    return per_call, error, ddpkit.collective_checks_enabled(), after


def test_the_engine_loop_benchmark_times_every_stage_and_leaves_the_group_as_it_was(pool):
    for per_call, error, checked, after in pool(2).run(case_engine_loop):
        assert all(seconds > 0 for seconds in per_call.values()), per_call
        assert "unknown stage 'everything'" in error
        assert checked  # the unchecked stage turns the checks back on
        assert torch.equal(after, torch.ones(5))


def case_eager_and_op_paths():
    """ddpkit.all_reduce past the dispatcher (a plain CPU tensor) and through the op (where the
    dispatcher has work: a tensor requiring grad, a dispatch mode): same results, same version bumps,
    and what must see the op still does (Note [Eager calls past the dispatcher])."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    rank = dist.get_rank()
    out = {}
    plain = torch.full((7,), float(rank + 1))
    version = plain._version
    ddpkit.all_reduce(plain)
    out["plain"], out["plain_bumps"] = plain, plain._version - version
    # A tensor autograd saved for backward and then reduced in place: backward must refuse it.
    weight = torch.full((3,), 2.0)
    x = torch.ones(3, requires_grad=True)
    y = (x * weight).sum()
    ddpkit.all_reduce(weight)
    try:
        y.backward()
        out["saved_error"] = None
    except RuntimeError as exc:
        out["saved_error"] = str(exc)
    leaf = torch.full((4,), float(rank + 1), requires_grad=True)
    with torch.no_grad():
        ddpkit.all_reduce(leaf)
    out["leaf"] = leaf.detach()
    with Seen() as seen:
        moded = torch.full((5,), float(rank + 1))
        ddpkit.all_reduce(moded)
    out["moded"], out["seen"] = moded, seen.ops
    return out


def test_eager_calls_past_the_dispatcher_match_the_op(pool):
    for out in pool(2).run(case_eager_and_op_paths):
        assert torch.equal(out["plain"], torch.full((7,), 3.0)) and out["plain_bumps"] == 1
        assert "modified by an inplace operation" in out["saved_error"]
        assert torch.equal(out["leaf"], torch.full((4,), 3.0))
        assert torch.equal(out["moded"], torch.full((5,), 3.0))
        assert "ddpkit.all_reduce_.default" in out["seen"], out["seen"]


def test_the_eager_binding_rejects_what_is_not_its_six_arguments():
    """_C.all_reduce_eager is a raw CPython function: its own argument checks raise TypeError, and
    a tensor the dispatcher must see is handed back untouched (False) before any argument is read."""
    from ddpkit import _C

    t = torch.ones(3)
    with pytest.raises(TypeError, match="takes 6 arguments, got 2"):
        _C.all_reduce_eager(t, "sum")
    with pytest.raises(TypeError, match="op must be a str, got int"):
        _C.all_reduce_eager(t, 3, "auto", "0", "auto", "exact")
    with pytest.raises(TypeError, match="transport must be a str, got NoneType"):
        _C.all_reduce_eager(t, "sum", "auto", "0", None, "exact")
    with pytest.raises(TypeError, match="wire must be a str, got NoneType"):
        _C.all_reduce_eager(t, "sum", "auto", "0", "auto", None)
    graded = torch.ones(3, requires_grad=True)
    assert _C.all_reduce_eager(graded, 3, None, None, None, None) is False
    assert _C.all_reduce_eager([1.0], "sum", "auto", "0", "auto", "exact") is False


def test_gil_is_released_while_waiting(pool):
    spins, _ = pool(2).run(case_gil_released)
    assert spins > 1000, f"main thread made only {spins} iterations while the collective waited"


def test_many_mixed_collectives_are_exact(pool):
    failures = pool(4).run(case_mixed_load, 1000, timeout=600)
    assert failures == [[]] * 4


def test_auto_choice_is_a_real_algorithm():
    for world_size in (1, 2, 3, 4, 8, 16, 32):
        for nbytes in (4, 4000, 400_000, 40_000_000):
            for op in ("sum", "max"):
                assert ddpkit.comm.choose_algorithm(nbytes, world_size, op=op) in (
                    "ring",
                    "butterfly",
                    "star",
                    "gather_scatter",
                    "recursive_doubling",
                    "halving_doubling",
                    "process_group",
                )


def test_auto_choice_follows_the_note():
    """Note [Choosing an algorithm]: direct over shared memory; hierarchical across hosts with a host of
    several ranks; over the process group the star up to 512 KiB while rank 0 receives at most 16 MiB in
    all, then the group's own all-reduce for sums and means, halving-doubling (powers of two) or the ring
    for max and min."""
    choose = ddpkit.comm.choose_algorithm
    for world_size in (2, 3, 8, 32):
        for nbytes in (4, 512 * 1024, 64 * 2**20):
            assert choose(nbytes, world_size, shared_memory=True) == "direct"
            assert choose(nbytes, world_size, hierarchical=True) == "hierarchical"
    for op, large in (
        ("sum", "process_group"),
        ("mean", "process_group"),
        ("max", "halving_doubling"),
        ("min", "halving_doubling"),
    ):
        ring = "ring" if large == "halving_doubling" else large
        assert choose(512 * 1024, 2, op=op) == "star" and choose(512 * 1024 + 4, 2, op=op) == large
        assert choose(512 * 1024, 3, op=op) == "star" and choose(512 * 1024 + 4, 3, op=op) == ring
        # From 34 ranks on, rank 0's share caps the star below 512 KiB: at 64, 16 MiB / 63 per message.
        assert choose(16 * 2**20 // 63, 64, op=op) == "star" and choose(16 * 2**20 // 63 + 4, 64, op=op) == large
        assert choose(40_000_000, 6, op=op) == ring and choose(40_000_000, 8, op=op) == large


def test_default_group_name_follows_a_new_default_group():
    """group_name() keeps the default group's name only while that group is the default: after
    destroy_process_group and a new init it names the new group, and it keeps no group alive."""
    import subprocess
    import sys

    script = """
import gc, os, weakref, torch.distributed as dist
from ddpkit import comm
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(__import__("socket").create_server(("127.0.0.1", 0)).getsockname()[1]))
names = []
for _ in range(2):
    dist.init_process_group("gloo", rank=0, world_size=1)
    first = dist.group.WORLD
    assert comm.group_name() == first.group_name
    names.append(comm.group_name())
    dist.new_group([0])  # a later group does not change the default one
    assert comm.group_name() == first.group_name
    ref = weakref.ref(first)
    del first
    dist.destroy_process_group()
    gc.collect()
    assert ref() is None, "group_name() kept the destroyed group alive"
    try:
        comm.group_name()
    except RuntimeError as e:
        assert "not initialized" in str(e)
    else:
        raise AssertionError("no error without a default group")
print(names)
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]


def test_torch_2_13_names_and_the_old_ones_as_aliases():
    assert ddpkit.all_gather_single is ddpkit.all_gather_into_tensor
    assert ddpkit.reduce_scatter_single is ddpkit.reduce_scatter_tensor
    assert {"all_gather_single", "reduce_scatter_single", "all_gather_into_tensor"} <= set(ddpkit.__all__)
