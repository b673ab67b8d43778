"""all_gather_into_tensor, reduce_scatter_tensor and barrier (Note [All-gather and reduce-scatter] in
csrc/comm/core/algorithm.h, Note [Direct all-gather and reduce-scatter] in csrc/comm/shm/direct.h).

Every algorithm valid for each transport runs on the same integer-valued inputs and is compared
exactly with a float64 reference built here from the same seeds (sums, maxima and minima of
integers below 2^24 are exact in float32; a mean is the exact sum divided once, so one correctly
rounded division); all-gathered outputs must have identical bits on every rank. Block sizes cover
0, 1, n-1, odd and larger than a shared-memory slot (kSlotBytes in csrc/comm/shm/segment.cpp, 256 KiB), so
the direct paths take many steps. The barrier blocks. Mismatched and bad calls:
test_block_collective_errors.py.
"""

import functools
import time

import pytest
import torch
import torch.distributed as dist

import ddpkit
from ddpkit.testing import WorkerPool

from helpers import bits, rank_input

TRANSPORTS = ["shm", "process_group"]
BLOCK_ALGORITHMS = ("auto", "ring", "halving_doubling", "direct")
REDUCE_OPS = ("sum", "mean", "max", "min")
LARGE = 600_000  # float32 elements per block: 2.4 MB, ten 256 KiB slots (kSlotBytes in csrc/comm/shm/segment.cpp)


def algorithms_for(transport: str, world_size: int | None = None) -> list[str]:
    """The algorithms a group of `world_size` ranks (default: this worker's world) can run over `transport`:
    "direct" reads the peers' slots (shared memory only), "halving_doubling" needs a power of two."""
    if world_size is None:
        world_size = dist.get_world_size()
    power_of_two = world_size & (world_size - 1) == 0
    return [
        a
        for a in BLOCK_ALGORITHMS
        if (transport == "shm" or a != "direct") and (power_of_two or a != "halving_doubling")
    ]


def block_numels(world_size: int) -> list[int]:
    return sorted({0, 1, world_size - 1, 1001, LARGE})


@functools.cache
def inputs_of(world_size: int, numel: int) -> torch.Tensor:
    """[world_size, numel]: every rank's integer-valued rank_input, as float64."""
    return torch.stack([rank_input(r, numel, integer=True).double() for r in range(world_size)])


@functools.cache
def gathered_reference(world_size: int, numel: int) -> torch.Tensor:
    return inputs_of(world_size, numel).reshape(-1).float()


@functools.cache
def reduced_reference(world_size: int, numel: int, op: str) -> torch.Tensor:
    """op over the ranks of every rank's input (world_size * numel elements): every block's reference at once,
    computed once for every rank, algorithm and call of a test."""
    inputs = inputs_of(world_size, world_size * numel)
    if op == "mean":
        return inputs.sum(0).float() / world_size  # exact float32 sum, divided once
    return {"sum": inputs.sum(0), "max": inputs.amax(0), "min": inputs.amin(0)}[op].float()


def scattered_reference(world_size: int, numel: int, rank: int, op: str) -> torch.Tensor:
    """op over the ranks of block `rank` of every rank's input (world_size * numel elements)."""
    return reduced_reference(world_size, numel, op)[rank * numel : (rank + 1) * numel]


# --- cases that run on every rank ----------------------------------------------------------------


def case_every_block_collective(transport, numels):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    out, inputs_changed = {}, []
    # each size's inputs made once (a clone per call): generating them cost the ranks more than the collectives
    gather_sources = {numel: rank_input(rank, numel, integer=True) for numel in numels}
    scatter_sources = {numel: rank_input(rank, world_size * numel, integer=True) for numel in numels}
    for algorithm in algorithms_for(transport):
        for numel in numels:
            source = gather_sources[numel].clone()
            output = torch.full((world_size * numel,), float("nan"))
            returned = ddpkit.all_gather_into_tensor(output, source, algorithm=algorithm, transport=transport)
            assert returned is output or returned.data_ptr() == output.data_ptr(), "all_gather must fill `output`"
            out[("all_gather", algorithm, numel)] = output
            # In place, as FSDP2 calls it: the input is this rank's block of the output.
            output = torch.full((world_size * numel,), float("nan"))
            own = output[rank * numel : (rank + 1) * numel]
            own.copy_(source)
            ddpkit.all_gather_into_tensor(output, own, algorithm=algorithm, transport=transport)
            out[("all_gather_in_place", algorithm, numel)] = output
            for op in REDUCE_OPS:
                source = scatter_sources[numel].clone()
                before = scatter_sources[numel]
                output = torch.full((numel,), float("nan"))
                returned = ddpkit.reduce_scatter_tensor(output, source, op=op, algorithm=algorithm, transport=transport)
                assert returned is output or returned.data_ptr() == output.data_ptr(), (
                    "reduce_scatter must fill `output`"
                )
                out[("reduce_scatter", algorithm, numel, op)] = output
                if not torch.equal(source, before):
                    inputs_changed.append((algorithm, numel, op))
                # In place: the output is this rank's block of the input.
                own = source[rank * numel : (rank + 1) * numel]
                ddpkit.reduce_scatter_tensor(own, source, op=op, algorithm=algorithm, transport=transport)
                out[("reduce_scatter_in_place", algorithm, numel, op)] = own.clone()
    return out, inputs_changed


def case_shapes_and_torch_ops(transport):
    """Outputs of torch's shapes ([n*a, b] and [n, a, b]) and torch.distributed.ReduceOp values."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    out = {}
    for algorithm in algorithms_for(transport):
        source = rank_input(rank, 6, integer=True).view(2, 3)
        flat = torch.empty(world_size * 2, 3)
        ddpkit.all_gather_into_tensor(flat, source, algorithm=algorithm, transport=transport)
        stacked = torch.empty(world_size, 2, 3)
        ddpkit.all_gather_into_tensor(stacked, source, algorithm=algorithm, transport=transport)
        out[("all_gather", algorithm)] = (flat, stacked)
        for name, op in (
            ("sum", dist.ReduceOp.SUM),
            ("mean", dist.ReduceOp.AVG),
            ("max", dist.ReduceOp.MAX),
            ("min", dist.ReduceOp.MIN),
        ):
            source = rank_input(rank, world_size * 6, integer=True).view(world_size * 2, 3)
            output = torch.empty(2, 3)
            ddpkit.reduce_scatter_tensor(output, source, op=op, algorithm=algorithm, transport=transport)
            out[("reduce_scatter", algorithm, name)] = output
    return out


GATHER_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
)
SCATTER_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64)
GATHER_NUMEL = 70_001  # odd, and more than a slot for the 8-byte dtypes
SCATTER_NUMEL = 70_001  # odd, several steps of the direct reduce-scatter (a 1/n-slot piece per step)


def gather_source(rank, dtype):
    """Every rank's all-gather input: bit patterns only bytes preserve (NaN, -0.0, inf) included."""
    source = rank_input(rank, GATHER_NUMEL, integer=True)
    if dtype.is_floating_point:
        source[:4] = torch.tensor([float("nan"), -0.0, float("inf"), -float("inf")])
    if dtype == torch.complex64:
        return torch.complex(source, -source)
    if not dtype.is_floating_point:
        return source.long().to(dtype)  # integer wrap-around: defined, unlike float-to-int8 overflow
    return source.to(dtype)


def scatter_source(rank, world_size, dtype):
    """Small integers (|x| < 32): every sum over at most 5 ranks is exact even in bfloat16."""
    return torch.randint(-32, 32, (world_size * SCATTER_NUMEL,), generator=torch.Generator().manual_seed(rank)).to(
        dtype
    )


def narrow_float_source(rank, world_size, dtype):
    """Block element j is big on rank j and 1 elsewhere: the sum big + n - 1 is exact in `dtype`, but
    any rank-by-rank accumulation in `dtype` that starts from big loses the ones (big + 1 rounds back
    to big, a tie to even), and every such order starts from big for some element."""
    big = 256.0 if dtype == torch.bfloat16 else 2048.0
    block = torch.ones(world_size)
    block[rank] = big
    return block.repeat(world_size).to(dtype)


def case_dtypes(transport):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    out = {}
    for algorithm in algorithms_for(transport):
        for dtype in GATHER_DTYPES:
            source = gather_source(rank, dtype)
            output = torch.empty(world_size * GATHER_NUMEL, dtype=dtype)
            ddpkit.all_gather_into_tensor(output, source, algorithm=algorithm, transport=transport)
            out[("all_gather", algorithm, dtype)] = output
        for dtype in SCATTER_DTYPES:
            for op in REDUCE_OPS if dtype.is_floating_point else ("sum", "max", "min"):
                source = scatter_source(rank, world_size, dtype)
                output = torch.empty(SCATTER_NUMEL, dtype=dtype)
                ddpkit.reduce_scatter_tensor(output, source, op=op, algorithm=algorithm, transport=transport)
                out[("reduce_scatter", algorithm, dtype, op)] = output
        for dtype in (torch.float16, torch.bfloat16):
            output = torch.empty(world_size, dtype=dtype)
            ddpkit.reduce_scatter_tensor(
                output, narrow_float_source(rank, world_size, dtype), algorithm=algorithm, transport=transport
            )
            out[("in_float32", algorithm, dtype)] = output
    return out


SUBGROUP = [1, 3, 4]  # of 5 ranks: group ranks 0, 1, 2 are global ranks 1, 3, 4


def case_subgroup(transport, numels):
    rank = dist.get_rank()
    group = dist.new_group(SUBGROUP)
    if rank not in SUBGROUP:
        return None
    size, group_rank = dist.get_world_size(group), dist.get_rank(group)
    out = {}
    for algorithm in algorithms_for(transport):
        for numel in numels:
            output = torch.full((size * numel,), float("nan"))
            ddpkit.all_gather_into_tensor(
                output, rank_input(rank, numel, integer=True), group=group, algorithm=algorithm, transport=transport
            )
            out[("all_gather", algorithm, numel)] = output
            output = torch.full((numel,), float("nan"))
            ddpkit.reduce_scatter_tensor(
                output,
                rank_input(rank, size * numel, integer=True),
                group=group,
                algorithm=algorithm,
                transport=transport,
            )
            out[("reduce_scatter", algorithm, numel)] = output
    ddpkit.barrier(group=group, transport=transport)
    resolved = ddpkit.comm.resolved_transport(group, transport)
    dist.destroy_process_group(group)
    return group_rank, resolved, out


def subgroup_inputs(numel):
    return torch.stack([rank_input(r, numel, integer=True).double() for r in SUBGROUP])


def case_message_counts(numel):
    """What each algorithm sends over shared memory: the direct paths no messages at all, the ring
    n-1 messages of one block per rank (Note [All-gather and reduce-scatter])."""
    world_size = dist.get_world_size()
    out = {}
    for algorithm in algorithms_for("shm"):
        ddpkit.reset_comm_counters()
        ddpkit.all_gather_into_tensor(
            torch.empty(world_size * numel), torch.ones(numel), algorithm=algorithm, transport="shm"
        )
        out[("all_gather", algorithm)] = ddpkit.comm_counters()
        ddpkit.reset_comm_counters()
        ddpkit.reduce_scatter_tensor(
            torch.empty(numel), torch.ones(world_size * numel), algorithm=algorithm, transport="shm"
        )
        out[("reduce_scatter", algorithm)] = ddpkit.comm_counters()
    return out


def case_unchecked(transport):
    """With the header check off, the direct and the ring paths still give the exact results."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    ddpkit.set_collective_checks(False)
    out = {}
    try:
        for algorithm in algorithms_for(transport):
            output = torch.empty(world_size * LARGE)
            ddpkit.all_gather_into_tensor(
                output, rank_input(rank, LARGE, integer=True), algorithm=algorithm, transport=transport
            )
            out[("all_gather", algorithm)] = output
            output = torch.empty(1001)
            ddpkit.reduce_scatter_tensor(
                output, rank_input(rank, world_size * 1001, integer=True), algorithm=algorithm, transport=transport
            )
            out[("reduce_scatter", algorithm)] = output
            ddpkit.barrier(transport=transport)
    finally:
        ddpkit.set_collective_checks(True)
    return out


BARRIER_SLEEP = 0.3


def case_barrier(transport, group_ranks, checked):
    """The first member (rank 0 of the world, or group_ranks[0]) arrives late at a barrier of the world
    or of a new group of `group_ranks`; returns when each member entered and left it."""
    ddpkit.set_collective_checks(checked)
    try:
        return barrier_timings(transport, group_ranks)
    finally:
        ddpkit.set_collective_checks(True)


def barrier_timings(transport, group_ranks):
    rank = dist.get_rank()
    group = None if group_ranks is None else dist.new_group(group_ranks)
    members = list(range(dist.get_world_size())) if group_ranks is None else group_ranks
    if rank not in members:
        return None
    ddpkit.barrier(group=group, transport=transport)  # line up, so that the sleep below is what delays
    if rank == members[0]:
        time.sleep(BARRIER_SLEEP)
    entered = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process of this host
    ddpkit.barrier(group=group, transport=transport)
    left = time.monotonic()
    if group is not None:
        dist.destroy_process_group(group)
    return entered, left


# --- tests ---------------------------------------------------------------------------------------


# 3 and 4 ranks are slow: 5 ranks take the same paths for a world that is not a power of two (uneven too), 8 for
# one that is (halving_doubling with more rounds).
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize(
    "world_size", [1, 2, pytest.param(3, marks=pytest.mark.slow), pytest.param(4, marks=pytest.mark.slow), 5, 8]
)
def test_every_block_collective_matches_the_reference(pool, world_size, transport):
    numels = block_numels(world_size)
    results = pool(world_size).run(case_every_block_collective, transport, numels)
    for rank, (out, inputs_changed) in enumerate(results):
        assert inputs_changed == [], f"rank {rank}: reduce_scatter changed its input for {inputs_changed}"
        assert sorted({key[1] for key in out}) == sorted(algorithms_for(transport, world_size))
        for key, tensor in out.items():
            if key[0].startswith("all_gather"):
                _, algorithm, numel = key
                assert tensor.shape == (world_size * numel,) and tensor.dtype == torch.float32
                # the reference's bits on every rank: equal values, and identical bits on all ranks
                assert torch.equal(bits(tensor), bits(gathered_reference(world_size, numel))), (rank, key)
            else:
                _, algorithm, numel, op = key
                assert tensor.shape == (numel,) and tensor.dtype == torch.float32
                expected = scattered_reference(world_size, numel, rank, op)
                assert torch.equal(tensor, expected), f"rank {rank} {key}: {tensor} != {expected}"


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_torch_shapes_and_reduce_ops(pool, transport):
    world_size = 3
    results = pool(world_size).run(case_shapes_and_torch_ops, transport)
    gathered = gathered_reference(world_size, 6)
    for rank, out in enumerate(results):
        for algorithm in algorithms_for(transport, world_size):
            flat, stacked = out[("all_gather", algorithm)]
            assert torch.equal(flat, gathered.view(world_size * 2, 3))
            assert torch.equal(stacked, gathered.view(world_size, 2, 3))
            for op in REDUCE_OPS:
                expected = scattered_reference(world_size, 6, rank, op).view(2, 3)
                assert torch.equal(out[("reduce_scatter", algorithm, op)], expected), (rank, algorithm, op)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_every_dtype(pool, transport):
    world_size = 3
    results = pool(world_size).run(case_dtypes, transport)
    for rank, out in enumerate(results):
        for algorithm in algorithms_for(transport, world_size):
            for dtype in GATHER_DTYPES:
                tensor = out[("all_gather", algorithm, dtype)]
                expected = torch.cat([gather_source(r, dtype) for r in range(world_size)])
                assert tensor.dtype == dtype
                assert torch.equal(bits(tensor), bits(expected)), (rank, algorithm, dtype)
            for dtype in SCATTER_DTYPES:
                exact = torch.stack([scatter_source(r, world_size, dtype).double() for r in range(world_size)])[
                    :, rank * SCATTER_NUMEL : (rank + 1) * SCATTER_NUMEL
                ]
                for op in REDUCE_OPS if dtype.is_floating_point else ("sum", "max", "min"):
                    tensor = out[("reduce_scatter", algorithm, dtype, op)]
                    assert tensor.dtype == dtype
                    if op == "mean":
                        # the exact sum in float32 (float64 for float64), divided once, rounded to dtype once
                        work = torch.float64 if dtype == torch.float64 else torch.float32
                        expected = (exact.sum(0).to(work) / world_size).to(dtype)
                    else:
                        expected = {"sum": exact.sum(0), "max": exact.amax(0), "min": exact.amin(0)}[op].to(dtype)
                    assert torch.equal(tensor, expected), (rank, algorithm, dtype, op)
            for dtype in (torch.float16, torch.bfloat16):
                big = 256.0 if dtype == torch.bfloat16 else 2048.0
                expected = torch.full((world_size,), big + world_size - 1, dtype=dtype)
                assert expected.double().eq(big + world_size - 1).all()  # exactly representable
                assert torch.equal(out[("in_float32", algorithm, dtype)], expected), (rank, algorithm, dtype)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_subgroup(pool, transport):
    world_size = 5
    numels = [0, 1, 2, 1001, LARGE]
    results = pool(world_size).run(case_subgroup, transport, numels)
    size = len(SUBGROUP)
    for rank, result in enumerate(results):
        if rank not in SUBGROUP:
            assert result is None
            continue
        group_rank, resolved, out = result
        assert group_rank == SUBGROUP.index(rank)
        assert resolved == transport
        for numel in numels:
            gathered = subgroup_inputs(numel).reshape(-1).float()
            block = subgroup_inputs(size * numel)[:, group_rank * numel : (group_rank + 1) * numel].sum(0).float()
            for algorithm in algorithms_for(transport, size):
                assert torch.equal(out[("all_gather", algorithm, numel)], gathered), (rank, algorithm, numel)
                assert torch.equal(out[("reduce_scatter", algorithm, numel)], block), (rank, algorithm, numel)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_unchecked_mode_is_exact(pool, transport):
    world_size = 3
    for rank, out in enumerate(pool(world_size).run(case_unchecked, transport)):
        for algorithm in algorithms_for(transport, world_size):
            assert torch.equal(out[("all_gather", algorithm)], gathered_reference(world_size, LARGE))
            assert torch.equal(out[("reduce_scatter", algorithm)], scattered_reference(world_size, 1001, rank, "sum"))


@pytest.mark.parametrize("world_size", [3, 4])
def test_direct_sends_no_messages_and_ring_one_block_per_round(pool, world_size):
    numel = 100_001
    for rank, out in enumerate(pool(world_size).run(case_message_counts, numel)):
        assert ("all_gather", "halving_doubling") in out or world_size == 3
        for (collective, algorithm), counters in out.items():
            assert counters["collectives"] == 1, (rank, collective, algorithm, counters)
            if algorithm == "ring":
                assert counters["messages_sent"] == world_size - 1, (rank, collective, counters)
                assert counters["bytes_sent"] == (world_size - 1) * numel * 4, (rank, collective, counters)
            elif algorithm == "halving_doubling":  # log2(n) messages, the ring's bytes
                assert counters["messages_sent"] == 2, (rank, collective, counters)
                assert counters["bytes_sent"] == (world_size - 1) * numel * 4, (rank, collective, counters)
            else:  # "auto" takes the direct path over shared memory
                assert counters["messages_sent"] == 0 and counters["bytes_sent"] == 0, (
                    rank,
                    collective,
                    algorithm,
                    counters,
                )


def test_many_small_slots_and_chunks():
    """Tiny slots and channel chunks: every direct all-gather and reduce-scatter takes many steps (the
    two slot sets alternate and wrap around), every ring message many channel chunks."""
    world_size = 3
    env = {"DDPKIT_SHM_SLOT_BYTES": "4096", "DDPKIT_SHM_CHUNK_BYTES": "4096"}
    worker_pool = WorkerPool(world_size, timeout=180, group_timeout=30, env=env)
    numels = [0, 1, 1023, 1024, 100_003]
    try:
        results = worker_pool.run(case_every_block_collective, "shm", numels)
    finally:
        worker_pool.close()
    for rank, (out, inputs_changed) in enumerate(results):
        assert inputs_changed == []
        # each once as it is and once in place
        assert len(out) == 2 * len(numels) * len(algorithms_for("shm", world_size)) * (1 + len(REDUCE_OPS))
        for key, tensor in out.items():
            if key[0].startswith("all_gather"):
                assert torch.equal(tensor, gathered_reference(world_size, key[2])), (rank, key)
            else:
                assert torch.equal(tensor, scattered_reference(world_size, key[2], rank, key[3])), (rank, key)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize(
    "world_size, group_ranks, checked", [(1, None, True), (3, None, True), (3, None, False), (5, [4, 0, 2], True)]
)
def test_barrier_waits_for_the_last_rank(pool, world_size, group_ranks, checked, transport):
    """With checks off too: then over the process group only the barrier's own messages hold ranks back."""
    results = pool(world_size).run(case_barrier, transport, group_ranks, checked)
    members = list(range(world_size)) if group_ranks is None else group_ranks
    late_entered, _ = results[members[0]]
    for rank, result in enumerate(results):
        if rank not in members:
            assert result is None
            continue
        _, left = result
        # An ordering only (no upper bound): nobody leaves before the late rank has entered.
        assert left >= late_entered, f"rank {rank} left the barrier before rank {members[0]} entered it"
