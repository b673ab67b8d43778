"""The shared-memory transport and the collective engine (csrc/comm/shm/segment.h, shm/direct.h, shm/channels.h, csrc/comm/engine/engine.h).

Every collective runs over shared memory and over the process group's send/recv on the same inputs
and is compared with a float64 reference (integer-valued inputs exactly) and across ranks (identical
bits); the direct all-reduce's checks, chunking, transport selection, concurrency across groups and
threads.
"""

import threading
import time

import pytest
import torch
import torch.distributed as dist

import ddpkit
from ddpkit.testing import WorkerPool

from helpers import algorithms_for, all_inputs, rank_input, reference

# --- cases that run on every rank ----------------------------------------------------------------


def case_resolved(transport):
    return ddpkit.comm.resolved_transport(transport=transport)


def case_direct_all_reduce():
    return ddpkit.all_reduce(torch.ones(4), algorithm="direct")


def case_every_collective(transport, numels):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    out = {}
    for algorithm in algorithms_for(transport):
        for numel in numels:
            for op in ("sum", "max"):
                tensor = rank_input(rank, numel, integer=True)
                ddpkit.all_reduce(tensor, op=op, algorithm=algorithm, transport=transport)
                out[("all_reduce", algorithm, numel, op)] = tensor
            tensor = rank_input(rank, numel)
            ddpkit.all_reduce(tensor, op="mean", algorithm=algorithm, transport=transport)
            out[("mean", algorithm, numel)] = tensor
    for root in range(world_size):
        tensor = rank_input(rank, 1001, integer=True)
        ddpkit.broadcast(tensor, src=root, transport=transport)
        out[("broadcast", root)] = tensor
        tensor = rank_input(rank, 1001, integer=True)
        ddpkit.reduce(tensor, dst=root, transport=transport)
        out[("reduce", root)] = tensor if rank == root else None
        out[("gather", root)] = ddpkit.gather(rank_input(rank, 6, integer=True), dst=root, transport=transport)
        chunks = torch.arange(world_size * 5, dtype=torch.float32).view(world_size, 5) + root if rank == root else None
        received = torch.empty(5)
        ddpkit.scatter(received, chunks, src=root, transport=transport)
        out[("scatter", root)] = received
    return out


def case_dtypes(transport):
    rank = dist.get_rank()
    out = {}
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64):
        for algorithm in algorithms_for(transport):
            tensor = rank_input(rank, 1003, integer=True).to(dtype)
            ddpkit.all_reduce(tensor, algorithm=algorithm, transport=transport)
            out[(dtype, algorithm)] = tensor
        for numel in (0, 1, 1003):
            tensor = rank_input(rank, numel, integer=True).to(dtype)
            ddpkit.broadcast(tensor, src=1, transport=transport)
            out[(dtype, "broadcast", numel)] = tensor
            tensor = rank_input(rank, numel, integer=True).to(dtype)
            ddpkit.reduce(tensor, dst=2, transport=transport)
            out[(dtype, "reduce", numel)] = tensor
        out[(dtype, "gather")] = ddpkit.gather(rank_input(rank, 7, integer=True).to(dtype), dst=0, transport=transport)
    return out


def case_mismatch(kind):
    rank = dist.get_rank()
    calls = {
        "numel": lambda: ddpkit.all_reduce(torch.ones(1000 + (rank == 1))),
        "dtype": lambda: ddpkit.all_reduce(torch.ones(8, dtype=torch.float64 if rank == 1 else torch.float32)),
        "op": lambda: ddpkit.all_reduce(torch.ones(8), op="max" if rank == 1 else "sum"),
        "rejected": lambda: ddpkit.all_reduce(torch.ones(8, dtype=torch.bool if rank == 1 else torch.float32)),
        "large_numel": lambda: ddpkit.all_reduce(torch.ones(3_000_000 + (rank == 1))),
    }
    try:
        calls[kind]()
        error = None
    except RuntimeError as exc:
        error = str(exc)
    after = torch.full((300_000,), float(rank))
    ddpkit.all_reduce(after)  # the group is still usable
    return error, after


def case_two_groups_two_threads(iterations):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    other = dist.new_group(list(range(world_size)))
    results, errors = {}, []

    def loop(name, group, numel):
        try:
            total = torch.zeros(numel)
            for i in range(iterations):
                tensor = torch.full((numel,), float(rank + i))
                ddpkit.all_reduce(tensor, group=group)
                total += tensor
            results[name] = total
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            errors.append(repr(exc))

    threads = [
        threading.Thread(target=loop, args=("world", None, 1000)),
        threading.Thread(target=loop, args=("other", other, 200_000)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    transports = (ddpkit.comm.resolved_transport(), ddpkit.comm.resolved_transport(other))
    dist.destroy_process_group(other)
    return errors, results, transports


def case_busy_receiver(numel):
    """Rank 1 still waits for rank 2 in a gather when rank 0, done with it, starts a large broadcast.
    Unchecked, so rank 0's payload leaves at once (a checked collective first waits for every rank)."""
    rank = dist.get_rank()
    ddpkit.all_reduce(torch.ones(1), transport="shm")  # the segment's rendezvous waits for every rank
    ddpkit.set_collective_checks(False)
    ddpkit.reset_comm_counters()
    if rank == 2:
        time.sleep(0.5)
    gathered = ddpkit.gather(torch.full((4,), float(rank)), dst=1, transport="shm")
    tensor = rank_input(0, numel, integer=True) if rank == 0 else torch.zeros(numel)
    ddpkit.broadcast(tensor, src=0, transport="shm")
    dist.barrier()
    ddpkit.set_collective_checks(True)
    return gathered, tensor, ddpkit.comm_counters()["peak_buffered_bytes"]


# --- tests ---------------------------------------------------------------------------------------


def test_auto_picks_shared_memory_on_one_host(pool):
    assert pool(2).run(case_resolved, "auto") == ["shm", "shm"]
    assert pool(2).run(case_resolved, "process_group") == ["process_group", "process_group"]
    assert pool(2).run(case_resolved, "shm") == ["shm", "shm"]


def test_environment_forces_the_process_group():
    worker_pool = WorkerPool(2, timeout=120, group_timeout=30, env={"DDPKIT_TRANSPORT": "process_group"})
    try:
        assert worker_pool.run(case_resolved, "auto") == ["process_group", "process_group"]
        outcomes = worker_pool.run(case_direct_all_reduce, return_exceptions=True)
        for outcome in outcomes:
            assert isinstance(outcome, RuntimeError) and "needs the shared-memory transport" in str(outcome), outcome
    finally:
        worker_pool.close()


@pytest.mark.parametrize("value", ["shm", "tcp"])
def test_environment_forces_shared_memory_or_names_a_bad_value(value):
    worker_pool = WorkerPool(2, timeout=120, group_timeout=30, env={"DDPKIT_TRANSPORT": value})
    try:
        outcomes = worker_pool.run(case_resolved, "auto", return_exceptions=True)
        if value == "shm":
            assert outcomes == ["shm", "shm"]
            for reduced in worker_pool.run(case_direct_all_reduce):
                assert torch.equal(reduced, torch.full((4,), 2.0))
        else:
            for outcome in outcomes:
                assert isinstance(outcome, RuntimeError) and "DDPKIT_TRANSPORT=tcp is not one of" in str(outcome), (
                    outcome
                )
    finally:
        worker_pool.close()


@pytest.mark.parametrize("transport", ["shm", "process_group"])
@pytest.mark.parametrize("world_size", [2, 3, 4, 8])
def test_every_collective_matches_the_reference(pool, world_size, transport):
    numels = sorted({0, 1, world_size - 1, 1001, 300_001})
    results = pool(world_size).run(case_every_collective, transport, numels)
    for key, tensor in results[0].items():
        for rank in range(1, world_size):
            other = results[rank][key]
            if key[0] in ("reduce", "gather", "scatter"):
                continue
            assert torch.equal(
                tensor.view(torch.uint8) if tensor.numel() else tensor,
                other.view(torch.uint8) if other.numel() else other,
            ), f"{key}: ranks differ"
        if key[0] == "all_reduce":
            _, algorithm, numel, op = key
            torch.testing.assert_close(tensor.double(), reference(world_size, numel, op, integer=True), rtol=0, atol=0)
        elif key[0] == "mean":
            _, algorithm, numel = key
            torch.testing.assert_close(
                tensor.double(), reference(world_size, numel, "mean"), rtol=0, atol=1e-5 * world_size
            )
        elif key[0] == "broadcast":
            assert torch.equal(tensor, rank_input(key[1], 1001, integer=True))
    for root in range(world_size):
        reduced = results[root][("reduce", root)]
        assert torch.equal(reduced.double(), all_inputs(world_size, 1001, integer=True).sum(0))
        gathered = results[root][("gather", root)]
        assert torch.equal(gathered, torch.stack([rank_input(r, 6, integer=True) for r in range(world_size)]))
        for rank in range(world_size):
            expected = torch.arange(world_size * 5, dtype=torch.float32).view(world_size, 5)[rank] + root
            assert torch.equal(results[rank][("scatter", root)], expected)


@pytest.mark.parametrize("transport", ["shm", "process_group"])
def test_every_dtype(pool, transport):
    world_size = 3
    results = pool(world_size).run(case_dtypes, transport)
    exact = all_inputs(world_size, 1003, integer=True).sum(0)
    for key, tensor in results[0].items():
        if len(key) != 2 or key[1] == "gather":
            continue
        dtype, algorithm = key
        assert tensor.dtype == dtype
        for rank in range(1, world_size):
            assert torch.equal(tensor, results[rank][(dtype, algorithm)]), (dtype, algorithm)
        # |sums| <= 3000: exact in every dtype but the 8-bit-mantissa bfloat16, which rounds once.
        atol = 16 if dtype == torch.bfloat16 else 2 if dtype == torch.float16 else 0
        torch.testing.assert_close(tensor.double(), exact, rtol=0, atol=atol, msg=f"{dtype} {algorithm}")
    for dtype in {key[0] for key in results[0]}:
        for numel in (0, 1, 1003):
            for rank in range(world_size):
                broadcast = results[rank][(dtype, "broadcast", numel)]
                assert broadcast.dtype == dtype and torch.equal(broadcast, rank_input(1, numel, integer=True).to(dtype))
            reduced = results[2][(dtype, "reduce", numel)]
            atol = 16 if dtype == torch.bfloat16 else 2 if dtype == torch.float16 else 0
            torch.testing.assert_close(
                reduced.double(),
                all_inputs(world_size, numel, integer=True).sum(0),
                rtol=0,
                atol=atol,
                msg=f"reduce {dtype} {numel}",
            )
        gathered = results[0][(dtype, "gather")]
        expected = torch.stack([rank_input(r, 7, integer=True).to(dtype) for r in range(world_size)])
        assert gathered.dtype == dtype and torch.equal(gathered, expected), dtype


def test_many_small_chunks_and_slots():
    """Tiny slots and channel chunks: every message spans many chunks, every direct all-reduce many
    steps (both the whole-chunk and the sliced path), so the pipelining and wrap-around run."""
    env = {"DDPKIT_SHM_SLOT_BYTES": "4096", "DDPKIT_SHM_CHUNK_BYTES": "4096"}
    worker_pool = WorkerPool(3, timeout=180, group_timeout=30, env=env)
    try:
        results = worker_pool.run(case_every_collective, "shm", [0, 1, 1023, 1024, 100_003])
    finally:
        worker_pool.close()
    for key, tensor in results[0].items():
        if key[0] == "all_reduce":
            _, algorithm, numel, op = key
            torch.testing.assert_close(tensor.double(), reference(3, numel, op, integer=True), rtol=0, atol=0)
            assert torch.equal(tensor, results[2][key])


@pytest.mark.parametrize("kind", ["numel", "dtype", "op", "rejected", "large_numel"])
def test_direct_all_reduce_checks_raise_on_every_rank(pool, kind):
    world_size = 3
    outcomes = pool(world_size).run(case_mismatch, kind)
    expected = {
        "numel": "rank 1 passed elements 1001, rank 0 passed elements 1000",
        "dtype": "rank 1 passed dtype Double, rank 0 passed dtype Float",
        "op": "rank 1 passed op max, rank 0 passed op sum",
        "rejected": "rank 1 rejected its arguments",
        "large_numel": "rank 1 passed elements 3000001, rank 0 passed elements 3000000",
    }[kind]
    for rank, (error, after) in enumerate(outcomes):
        assert error is not None, f"rank {rank} did not raise"
        if kind == "rejected" and rank == 1:
            assert "unsupported dtype Bool" in error, error
        else:
            assert expected in error, error
        assert torch.equal(after, torch.full((300_000,), float(sum(range(world_size)))))


def test_two_groups_from_two_threads_never_cross(pool):
    iterations = 40
    for errors, results, transports in pool(2).run(case_two_groups_two_threads, iterations):
        assert errors == []
        assert transports == ("shm", "shm")
        expected_sum = sum(2 * i + 1 for i in range(iterations))  # ranks 0 and 1 add rank + i
        assert torch.equal(results["world"], torch.full((1000,), float(expected_sum)))
        assert torch.equal(results["other"], torch.full((200_000,), float(expected_sum)))


def test_early_messages_wait_in_shared_memory(pool):
    """A message whose receive is not posted yet waits in its channel (its sender waits for room):
    a rank busy with an earlier collective holds nothing of a 16 MB broadcast on the heap
    (Note [Shared-memory messages])."""
    world_size, numel = 3, 4_000_000
    outcomes = pool(world_size).run(case_busy_receiver, numel)
    for rank, (gathered, tensor, peak_buffered) in enumerate(outcomes):
        if rank == 1:
            assert torch.equal(gathered, torch.arange(world_size, dtype=torch.float32)[:, None].expand(-1, 4))
        assert torch.equal(tensor, rank_input(0, numel, integer=True)), rank
        assert peak_buffered == 0, f"rank {rank} buffered {peak_buffered} bytes of early messages"
