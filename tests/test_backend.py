"""The "ddpkit" torch.distributed backend (csrc/backend, python/ddpkit/backend.py).

Every worker of a pool started with backend="ddpkit" also makes a gloo group of the same ranks, runs
each torch.distributed operation on both groups with the same integer-valued inputs and returns both
results: they must be identical (where both reduce in the same order) or within one rounding. On top
of that: asynchronous work and futures, subgroups, torch's DistributedDataParallel and
ZeroRedundancyOptimizer unchanged, mismatched calls, clear errors, ddpkit's own API on a "ddpkit"
group, the process-group transport and torchrun.
"""

import contextlib
import json
import subprocess
import sys
import time
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import ddpkit
from ddpkit.testing import WorkerPool

from helpers import TRAIN, free_port, needs_fashion_mnist, needs_hosts, small_cli

RED = dist.ReduceOp
FLOAT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
OWN_DTYPES = FLOAT_DTYPES + (torch.int32, torch.int64)


# --- pools ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def dpool():
    """``dpool(n, group_timeout=30, **env)``: a live WorkerPool of n "ddpkit" ranks (one per n, timeout and
    environment). A case that fails kills its pool; the next call starts a fresh one."""
    pools = {}

    def get(world_size, group_timeout=30.0, **env):
        key = (world_size, group_timeout, tuple(sorted(env.items())))
        if key not in pools:
            pools[key] = WorkerPool(world_size, backend="ddpkit", timeout=60.0, group_timeout=group_timeout, env=env)
        return pools[key]

    yield get
    for worker_pool in pools.values():
        worker_pool.close()


# --- helpers that run on every rank ---------------------------------------------------------------

_GLOO = None


def gloo_group():
    """A gloo group of every rank, made once per worker (collectively, on the first call)."""
    global _GLOO
    if _GLOO is None:
        _GLOO = dist.new_group(backend="gloo")
    return _GLOO


def values(rank, shape, dtype=torch.float32, salt=0, low=-50, high=51):
    """Integer-valued inputs: sums over 5 ranks (|x| <= 250) are exact in every dtype, bfloat16 included."""
    generator = torch.Generator().manual_seed(salt * 1000 + rank)
    return torch.randint(low, high, shape, generator=generator).to(dtype)


def both(fn):
    """(fn on the "ddpkit" world group, fn on the gloo group)."""
    return fn(None), fn(gloo_group())


def quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


def caught(fn):
    """fn()'s result, or the text of the exception it raised."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test reads the message
        return f"{type(exc).__name__}: {exc}"
    return None


def all_reduced(tensor, op, group):
    dist.all_reduce(tensor, op=op, group=group)
    return tensor


def case_every_op():
    """Every torch.distributed operation on the "ddpkit" world group and on a gloo group, same inputs."""
    rank, n = dist.get_rank(), dist.get_world_size()
    out = {}

    # all_reduce: ddpkit's own ops and dtypes, several sizes (the large one spans shared-memory chunks)
    for dtype in OWN_DTYPES:
        for numel in (0, 1, 1001):
            for op in (RED.SUM, RED.MAX, RED.MIN):
                x = values(rank, (numel,), dtype, salt=numel)
                out[("all_reduce", dtype, numel, str(op))] = both(lambda g: all_reduced(x.clone(), op, g))
    x = values(rank, (300_001,), salt=7)
    out[("all_reduce", "large")] = both(lambda g: all_reduced(x.clone(), RED.SUM, g))
    x = values(rank, (3, 4, 5), torch.float64, salt=8)
    out[("all_reduce", "3d")] = both(lambda g: all_reduced(x.clone(), RED.MAX, g))
    # AVG, which gloo lacks: against gloo's SUM / n
    for dtype in FLOAT_DTYPES:
        x = values(rank, (1001,), dtype, salt=9)
        mean = all_reduced(x.clone(), RED.AVG, None)
        out[("all_reduce_avg", dtype)] = (mean, (all_reduced(x.clone(), RED.SUM, gloo_group()).double() / n).to(dtype))
    # layouts other than contiguous, which gloo takes as they are (ZeroRedundancyOptimizer broadcasts
    # a channels_last model's parameters)
    x = values(rank, (3, 5), salt=50)
    out[("all_reduce", "transposed")] = both(lambda g: all_reduced(x.clone().t(), RED.SUM, g))
    image = values(rank, (2, 3, 4, 5), salt=51).contiguous(memory_format=torch.channels_last)

    def broadcast_channels_last(g):
        t = image.clone(memory_format=torch.channels_last)
        dist.broadcast(t, src=n - 1, group=g)
        return t
    out[("broadcast", "channels_last")] = both(broadcast_channels_last)

    def reduce_transposed(g):
        t = x.clone().t()
        dist.reduce(t, dst=0, op=RED.MAX, group=g)
        return t if rank == 0 else None  # elsewhere what is left is the algorithm's
    out[("reduce", "transposed")] = both(reduce_transposed)
    # delegated to gloo: PRODUCT, bitwise ops, dtypes ddpkit does not reduce
    for dtype in (torch.float32, torch.int32, torch.int64, torch.float64):
        x = values(rank, (101,), dtype, salt=10, low=-3, high=4)
        out[("all_reduce", dtype, "product")] = both(lambda g: all_reduced(x.clone(), RED.PRODUCT, g))
    for dtype in (torch.uint8, torch.int32, torch.int64):
        x = values(rank, (101,), dtype, salt=11, low=0, high=100)
        for op in (RED.BAND, RED.BOR, RED.BXOR):
            out[("all_reduce", dtype, str(op))] = both(lambda g: all_reduced(x.clone(), op, g))
    for dtype in (torch.uint8, torch.int8):  # (gloo has no int16)
        x = values(rank, (33,), dtype, salt=12, low=0, high=20)
        for op in (RED.SUM, RED.MAX, RED.MIN):
            out[("all_reduce", dtype, str(op))] = both(lambda g: all_reduced(x.clone(), op, g))
    x = values(rank, (17,), torch.bool, salt=13, low=0, high=2)
    for op in (RED.MAX, RED.BAND, RED.BOR):
        out[("all_reduce", torch.bool, str(op))] = both(lambda g: all_reduced(x.clone(), op, g))
    # sparse tensors: delegated (gloo's sparse all-reduce)
    def sparse(g):
        t = torch.sparse_coo_tensor(torch.tensor([[rank, rank + 1]]), torch.tensor([1.0, float(rank)]), (n + 1,))
        dist.all_reduce(t, group=g)
        return t.to_dense()
    out[("all_reduce", "sparse")] = both(sparse)

    # all_reduce_coalesced: ddpkit's own, and delegated (an op or a dtype it does not reduce)
    def coalesced(tensors, op):
        def fn(g):
            copies = [t.clone() for t in tensors]
            quiet(dist.all_reduce_coalesced, copies, op=op, group=g)
            return copies
        return fn
    same = [values(rank, shape, salt=14 + i) for i, shape in enumerate([(3,), (2, 5), (0,), (7,)])]
    out[("all_reduce_coalesced", "sum")] = both(coalesced(same, RED.SUM))
    out[("all_reduce_coalesced", "min")] = both(coalesced(same, RED.MIN))
    out[("all_reduce_coalesced", "product")] = both(coalesced([values(rank, (4,), salt=20, low=-3, high=4)],
                                                              RED.PRODUCT))
    bytes_ = [values(rank, (5,), torch.uint8, salt=21, low=0, high=40), values(rank, (2,), torch.uint8, salt=22, low=0)]
    out[("all_reduce_coalesced", "uint8")] = both(coalesced(bytes_, RED.SUM))

    for root in range(n):
        for dtype in (torch.float32, torch.int64, torch.bfloat16, torch.uint8):
            x = values(rank, (5, 7), dtype, salt=22, low=0)

            def bcast(g):
                t = x.clone()
                dist.broadcast(t, src=root, group=g)
                return t
            out[("broadcast", root, dtype)] = both(bcast)
        for op in (RED.SUM, RED.MAX, RED.PRODUCT):
            x = values(rank, (1001,), salt=23, low=-3, high=4)

            def red(g):
                t = x.clone()
                dist.reduce(t, dst=root, op=op, group=g)
                return t if rank == root else None  # elsewhere the contents are unspecified
            out[("reduce", root, str(op))] = both(red)
        x = values(rank, (2, 3), torch.int32, salt=24)

        def gather(g):
            targets = [torch.empty(2, 3, dtype=torch.int32) for _ in range(n)] if rank == root else None
            dist.gather(x, targets, dst=root, group=g)
            return targets
        out[("gather", root)] = both(gather)

        def scatter(g):
            sources = [values(r, (4, 2), salt=25 + root) for r in range(n)] if rank == root else None
            t = torch.empty(4, 2)
            dist.scatter(t, sources, src=root, group=g)
            return t
        out[("scatter", root)] = both(scatter)

        def bcast_objects(g):
            objects = [{"rank": rank, "root": root}, "x" * (rank + 1), list(range(rank))]
            dist.broadcast_object_list(objects, src=root, group=g)
            return objects
        out[("broadcast_object_list", root)] = both(bcast_objects)

        def gather_object(g):
            gathered = [None] * n if rank == root else None
            dist.gather_object(("obj", rank, [rank] * rank), gathered, dst=root, group=g)
            return gathered
        out[("gather_object", root)] = both(gather_object)

        def scatter_object(g):
            output = [None]
            sources = [{"to": r, "from": root} for r in range(n)] if rank == root else None
            dist.scatter_object_list(output, sources, src=root, group=g)
            return output
        out[("scatter_object_list", root)] = both(scatter_object)

    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.bool):
        x = values(rank, (2, 3), dtype, salt=26, low=0, high=2 if dtype == torch.bool else 51)

        def gather_list(g):
            targets = [torch.empty(2, 3, dtype=dtype) for _ in range(n)]
            dist.all_gather(targets, x, group=g)
            return targets
        out[("all_gather", dtype)] = both(gather_list)

        def gather_flat(g):
            flat = torch.empty(n * 2, 3, dtype=dtype)
            dist.all_gather_into_tensor(flat, x, group=g)
            return flat
        out[("all_gather_into_tensor", dtype)] = ours, theirs = both(gather_flat)
        stacked = torch.empty(n, 2, 3, dtype=dtype)  # torch's other output shape (gloo takes only the flat one)
        dist.all_gather_into_tensor(stacked, x)
        out[("all_gather_into_tensor", "stacked", dtype)] = (stacked.view(n * 2, 3), theirs)
    out["all_gather_object"] = both(lambda g: (lambda objs: (dist.all_gather_object(objs, {rank: "y" * rank}, group=g),
                                                             objs)[1])([None] * n))

    for op in (RED.SUM, RED.MIN, RED.PRODUCT):
        for dtype in (torch.float32, torch.int64):
            inputs = [values(rank, (3, 2), dtype, salt=27 + r, low=-3, high=4) for r in range(n)]

            def rs_list(g):
                t = torch.empty(3, 2, dtype=dtype)
                dist.reduce_scatter(t, [i.clone() for i in inputs], op=op, group=g)
                return t
            out[("reduce_scatter", str(op), dtype)] = both(rs_list)
            x = values(rank, (n * 3, 2), dtype, salt=28, low=-3, high=4)

            def rs_tensor(g):
                t = torch.empty(3, 2, dtype=dtype)
                quiet(dist.reduce_scatter_tensor, t, x.clone(), op=op, group=g)
                return t
            out[("reduce_scatter_tensor", str(op), dtype)] = both(rs_tensor)

            def rs_tensor_stacked(g):  # the input as [n, *output.shape], which the docs allow
                t = torch.empty(3, 2, dtype=dtype)
                quiet(dist.reduce_scatter_tensor, t, x.clone().view(n, 3, 2), op=op, group=g)
                return t
            out[("reduce_scatter_tensor_stacked", str(op), dtype)] = (rs_tensor_stacked(None), both(rs_tensor)[1])
    x = values(rank, (n * 501,), salt=29)
    rs_mean = torch.empty(501)
    quiet(dist.reduce_scatter_tensor, rs_mean, x.clone(), op=RED.AVG)
    rs_sum = torch.empty(501)
    quiet(dist.reduce_scatter_tensor, rs_sum, x.clone(), op=RED.SUM, group=gloo_group())
    out["reduce_scatter_tensor_avg"] = (rs_mean, rs_sum / n)

    # all_to_all_single with equal parts and with uneven split sizes (zeros included)
    x = values(rank, (n * 2, 3), salt=30)

    def a2a_equal(g):
        t = torch.empty(n * 2, 3)
        dist.all_to_all_single(t, x, group=g)
        return t
    out["all_to_all_single"] = both(a2a_equal)
    send_rows = [(rank + peer) % 3 for peer in range(n)]  # rows this rank sends to each peer
    recv_rows = [(peer + rank) % 3 for peer in range(n)]  # rows each peer sends to this rank
    x = values(rank, (sum(send_rows), 2), torch.int64, salt=31)

    def a2a_uneven(g):
        t = torch.empty(sum(recv_rows), 2, dtype=torch.int64)
        dist.all_to_all_single(t, x, recv_rows, send_rows, group=g)
        return t
    out["all_to_all_single_uneven"] = both(a2a_uneven)
    sources = [values(rank, (2, 3), salt=32 + peer) for peer in range(n)]

    def a2a_list(g):
        targets = [torch.empty(2, 3) for _ in range(n)]
        dist.all_to_all(targets, [s.clone() for s in sources], group=g)
        return targets
    out["all_to_all"] = both(a2a_list)
    # uneven sizes, which gloo's all_to_all rejects: against what each peer sent
    sources = [values(rank, (rank + peer + 1, 2), salt=33 + peer) for peer in range(n)]
    targets = [torch.empty(peer + rank + 1, 2) for peer in range(n)]
    dist.all_to_all(targets, sources)
    out["all_to_all_uneven"] = (targets, [values(peer, (peer + rank + 1, 2), salt=33 + rank) for peer in range(n)])

    # coalesced forms: torch's coalescing manager (allgather_into_tensor_coalesced, reduce_scatter_tensor_coalesced,
    # allreduce_coalesced) and all_gather_coalesced (delegated)
    def coalesced_gather(g):
        outputs = [torch.empty(3 * n), torch.empty(2 * n, 2)]
        with dist._coalescing_manager(group=g):
            for output, salt in zip(outputs, (34, 35)):
                dist.all_gather_into_tensor(output, values(rank, (output.shape[0] // n, *output.shape[1:]), salt=salt),
                                            group=g)
        return outputs
    out["all_gather_into_tensor_coalesced"] = both(coalesced_gather)

    def coalesced_gather_strided(g):
        output = torch.empty(2, 2 * n).t()  # (2n, 2), not contiguous: filled in its own row-major order
        with dist._coalescing_manager(group=g):
            dist.all_gather_into_tensor(output, values(rank, (2, 2), salt=42), group=g)
        return output
    out["all_gather_into_tensor_coalesced_strided"] = (coalesced_gather_strided(None),
                                                       torch.cat([values(peer, (2, 2), salt=42) for peer in range(n)]))
    for op in (RED.SUM, RED.MAX):
        def coalesced_reduce_scatter(g):
            outputs = [torch.empty(3), torch.empty(2, 2)]
            with dist._coalescing_manager(group=g):
                for output, salt in zip(outputs, (36, 37)):
                    quiet(dist.reduce_scatter_tensor, output, values(rank, (n * output.shape[0], *output.shape[1:]),
                                                                     salt=salt), op=op, group=g)
            return outputs
        out[("reduce_scatter_tensor_coalesced", str(op))] = both(coalesced_reduce_scatter)
    # delegated to gloo: an op or a dtype ddpkit does not reduce, or several dtypes at once
    for op, dtypes in ((RED.PRODUCT, (torch.float32, torch.float32)), (RED.SUM, (torch.int8, torch.int8)),
                       (RED.BAND, (torch.int32, torch.int32)), (RED.SUM, (torch.float32, torch.float64))):
        def delegated_reduce_scatter(g):
            outputs = [torch.empty(3, dtype=dtypes[0]), torch.empty(2, 2, dtype=dtypes[1])]
            with dist._coalescing_manager(group=g):
                for output, salt in zip(outputs, (43, 44)):
                    quiet(dist.reduce_scatter_tensor, output,
                          values(rank, (n * output.shape[0], *output.shape[1:]), output.dtype, salt=salt, low=-3, high=4),
                          op=op, group=g)
            return outputs
        out[("reduce_scatter_tensor_coalesced", str(op), dtypes)] = both(delegated_reduce_scatter)

    def coalesced_gather_mixed(g):
        outputs = [torch.empty(3 * n), torch.empty(2 * n, dtype=torch.int64)]
        with dist._coalescing_manager(group=g):
            for output, salt in zip(outputs, (45, 46)):
                quiet(dist.all_gather_into_tensor, output, values(rank, (output.shape[0] // n,), output.dtype, salt=salt),
                      group=g)
        return outputs
    out["all_gather_into_tensor_coalesced_mixed_dtypes"] = both(coalesced_gather_mixed)

    def coalesced_reduce(g):
        tensors = [values(rank, (3,), salt=38), values(rank, (2, 2), salt=39)]
        with dist._coalescing_manager(group=g, async_ops=True) as manager:
            for t in tensors:
                dist.all_reduce(t, group=g)
        manager.wait()
        return tensors
    out["all_reduce_coalescing_manager"] = both(coalesced_reduce)

    def gather_coalesced(g):
        outputs = [[torch.empty(3), torch.empty(2, 2)] for _ in range(n)]
        inputs = [values(rank, (3,), salt=40), values(rank, (2, 2), salt=41)]
        quiet(dist.all_gather_coalesced, outputs, inputs, group=g)
        return outputs
    out["all_gather_coalesced"] = both(gather_coalesced)

    out["barrier"] = both(lambda g: dist.barrier(group=g))

    # send/recv around the ring: blocking (even ranks send first) and isend/irecv
    if n > 1:
        right, left = (rank + 1) % n, (rank - 1) % n

        def ring_blocking(g):
            received = torch.empty(6, dtype=torch.int64)
            mine = torch.arange(6) + 100 * rank
            if rank % 2 == 0:
                dist.send(mine, right, group=g, tag=3)
                dist.recv(received, left, group=g, tag=3)
            else:
                dist.recv(received, left, group=g, tag=3)
                dist.send(mine, right, group=g, tag=3)
            return received
        out["send_recv"] = both(ring_blocking)

        def ring_nonblocking(g):
            received = torch.empty(4)
            works = [dist.isend(torch.full((4,), float(rank)), right, group=g),
                     dist.irecv(received, left, group=g)]
            for work in works:
                work.wait()
            return received
        out["isend_irecv"] = both(ring_nonblocking)
    return out


def assert_same(ours, theirs, key, exact=True):
    if isinstance(ours, torch.Tensor):
        assert isinstance(theirs, torch.Tensor), key
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, (key, ours.dtype, ours.shape, theirs.shape)
        if exact:
            assert torch.equal(ours, theirs), f"{key}: ddpkit {ours} != gloo {theirs}"
        else:
            torch.testing.assert_close(ours, theirs, msg=str(key))
    elif isinstance(ours, (list, tuple)):
        assert isinstance(theirs, (list, tuple)) and len(ours) == len(theirs), (key, ours, theirs)
        for a, b in zip(ours, theirs):
            assert_same(a, b, key, exact)
    else:
        assert ours == theirs, (key, ours, theirs)


def check_against_gloo(per_rank):
    for rank, results in enumerate(per_rank):
        for key, (ours, theirs) in results.items():
            # a mean is one division away from gloo's sum / n: within one rounding of it
            exact = not (key == "reduce_scatter_tensor_avg" or (isinstance(key, tuple) and key[0] == "all_reduce_avg"))
            assert_same(ours, theirs, (rank, key), exact=exact)


# --- 1. every operation against gloo -------------------------------------------------------------

@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
def test_every_op_matches_gloo(dpool, world_size):
    per_rank = dpool(world_size).run(case_every_op, timeout=60)
    check_against_gloo(per_rank)
    # sanity: the comparison is not vacuous
    expected = sum(values(r, (1001,), torch.float32, salt=1001) for r in range(world_size))
    assert torch.equal(per_rank[0][("all_reduce", torch.float32, 1001, str(RED.SUM))][0], expected)
    assert len(per_rank[0]) > 100


# --- asynchronous work ------------------------------------------------------------------------------

def case_async():
    rank, n = dist.get_rank(), dist.get_world_size()
    out = {}
    # wait() and the future's value: the output tensors, the very ones passed in
    x = values(rank, (1001,), salt=40)
    work = dist.all_reduce(x, async_op=True)
    work.wait()
    future_value = work.get_future().wait()
    out["wait"] = (x, all_reduced(values(rank, (1001,), salt=40), RED.SUM, gloo_group()))
    out["future_is_output"] = (len(future_value) == 1 and future_value[0].data_ptr() == x.data_ptr(), True)
    out["completed"] = (work.is_completed(), True)
    # a future read without wait(), as DDP's communication hooks do
    y = values(rank, (77,), torch.float64, salt=41)
    got = dist.all_reduce(y, op=RED.MAX, async_op=True).get_future().then(lambda fut: fut.value()[0] * 2).wait()
    out["then"] = (got, all_reduced(values(rank, (77,), torch.float64, salt=41), RED.MAX, gloo_group()) * 2)
    # the same of a delegated operation (PRODUCT runs on the inner gloo)
    z = values(rank, (5,), salt=49, low=-3, high=4)
    got = dist.all_reduce(z, op=RED.PRODUCT, async_op=True).get_future().wait()
    expected = all_reduced(values(rank, (5,), salt=49, low=-3, high=4), RED.PRODUCT, gloo_group())
    out["delegated_future"] = (got, [expected])

    # several operations in flight (own and delegated), waited for in reverse order
    def launch(g):
        a = values(rank, (300_001,), salt=42)
        b = values(rank, (9,), torch.int64, salt=43) if rank == n - 1 else torch.zeros(9, dtype=torch.int64)
        c_in, c_out = values(rank, (5,), torch.bfloat16, salt=44), torch.empty(5 * n, dtype=torch.bfloat16)
        d_in, d_out = values(rank, (n * 4,), salt=45), torch.empty(4)
        e_in, e_out = values(rank, (n * 3,), torch.int32, salt=46), torch.empty(n * 3, dtype=torch.int32)
        f = values(rank, (10,), salt=47, low=-3, high=4)
        works = [dist.all_reduce(a, async_op=True, group=g),
                 dist.broadcast(b, src=n - 1, async_op=True, group=g),
                 dist.all_gather_into_tensor(c_out, c_in, async_op=True, group=g),
                 quiet(dist.reduce_scatter_tensor, d_out, d_in, op=RED.MAX, async_op=True, group=g),
                 dist.all_to_all_single(e_out, e_in, async_op=True, group=g),
                 dist.all_reduce(f, op=RED.PRODUCT, async_op=True, group=g),
                 dist.barrier(async_op=True, group=g)]
        # a synchronous one behind them runs after them
        h = values(rank, (6,), salt=48)
        dist.all_reduce(h, group=g)
        for work in reversed(works):
            work.wait()
        return [a, b, c_out, d_out, e_out, f, h]
    out["in_flight"] = both(launch)

    # many small ones in flight at once, then waited for in order
    def many(g):
        tensors = [torch.full((3,), float(rank + i)) for i in range(50)]
        works = [dist.all_reduce(t, async_op=True, group=g) for t in tensors]
        for work in works:
            work.wait()
        return tensors
    out["many"] = both(many)
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_async_work_and_futures(dpool, world_size):
    per_rank = dpool(world_size).run(case_async, timeout=60)
    check_against_gloo(per_rank)
    assert torch.equal(per_rank[0]["many"][0][49], torch.full((3,), float(sum(r + 49 for r in range(world_size)))))


def case_async_under_the_callers_state():
    """Asynchronous collectives run on the engine's thread under the state they were issued in
    (Note [Issued, then run])."""
    rank, n = dist.get_rank(), dist.get_world_size()
    out = {}
    # under no_grad, into a parameter: the bfloat16 all-reduce copies its float32 result back in place
    parameter = torch.nn.Parameter(torch.full((5,), float(rank + 1), dtype=torch.bfloat16))
    with torch.no_grad():
        dist.all_reduce(parameter, async_op=True).wait()
    out["no_grad_parameter"] = (parameter.detach().clone(), torch.full((5,), float(n * (n + 1) // 2),
                                                                       dtype=torch.bfloat16))
    # a synchronous call queued behind an asynchronous one also runs on the engine's thread
    big = torch.ones(300_001)
    with torch.no_grad():
        work = dist.all_reduce(big, async_op=True)
        dist.all_reduce(parameter)
        work.wait()
    out["no_grad_queued_sync"] = (parameter.detach().clone(), torch.full((5,), float(n * n * (n + 1) // 2),
                                                                         dtype=torch.bfloat16))
    # under inference_mode, into inference tensors
    with torch.inference_mode():
        source = torch.arange(2 * n, dtype=torch.float32) + 100 * rank
        target = torch.empty(2 * n)
        dist.all_to_all_single(target, source, async_op=True).wait()
    out["inference_mode_all_to_all"] = (target.clone(), torch.cat([torch.arange(2) + 2 * rank + 100 * peer
                                                                   for peer in range(n)]).float())
    # a rank that turns the checks off while its collective is still queued runs it checked, as its
    # peers, which issued it checked too, do
    first, second = torch.ones(300_001), torch.full((7,), float(rank))
    if rank != 0:
        time.sleep(0.3)  # rank 0's engine is still busy with `first` when it turns the checks off
    # (the reduce runs over messages, whose check is a step of its own: run unchecked on one rank
    # alone, the ranks' steps would part)
    works = [dist.all_reduce(first, async_op=True), dist.reduce(second, dst=0, async_op=True)]
    if rank == 0:
        ddpkit.set_collective_checks(False)
    try:
        for work in works:
            work.wait()
    finally:
        ddpkit.set_collective_checks(True)
    third = torch.full((3,), float(rank))
    dist.all_reduce(third)  # and the ranks still pair
    out["checks_as_issued"] = (second, torch.full((7,), float(n * (n - 1) // 2 if rank == 0 else rank)))
    out["checks_as_issued_then"] = (third, torch.full((3,), float(n * (n - 1) // 2)))
    return out


def test_async_collectives_run_under_the_issuing_threads_state(dpool):
    for results in dpool(2).run(case_async_under_the_callers_state, timeout=60):
        for key, (ours, expected) in results.items():
            assert torch.equal(ours, expected), (key, ours, expected)


def case_callback_waits_for_the_next_collective():
    """A future's callback that waits for the next collective's future, with fewer idle completion
    threads than completions: both completions once went to the one idle thread, which the first
    callback then held (Note [Future callbacks])."""
    results = []
    for attempt in range(20):
        dist.all_reduce(torch.ones(1), async_op=True).get_future().wait()  # one completion thread, warm
        busy = dist.all_reduce(torch.ones(200_000), async_op=True)  # the next two queue behind it
        a, b = torch.ones(3), torch.full((3,), 2.0)
        first, second = dist.all_reduce(a, async_op=True), dist.all_reduce(b, async_op=True)
        later = second.get_future()
        chained = first.get_future().then(lambda _: later.wait()[0].clone())
        busy.wait()
        results.append(chained.wait())
    return results


def test_a_callback_may_wait_for_the_next_collective():
    n = 3
    for outcome in run_on_a_fresh_pool(case_callback_waits_for_the_next_collective):
        assert not isinstance(outcome, BaseException), outcome
        assert all(torch.equal(t, torch.full((3,), 2.0 * n)) for t in outcome)


def case_barrier_with_its_own_timeout():
    """Rank 0 calls a barrier with a timeout of 2 s; rank 1 never joins it (it returns after 8 s)."""
    import datetime
    if dist.get_rank() == 1:
        time.sleep(8)
        return "late"
    try:
        dist.barrier(timeout=datetime.timedelta(seconds=2))
    except RuntimeError as error:
        return str(error)
    return "passed"


@pytest.mark.parametrize("env", [{}, {"DDPKIT_TRANSPORT": "process_group"}, {"DDPKIT_TEST_HOSTS": "a,b"}],
                         ids=["shm", "process_group", "across_hosts"])
def test_a_barrier_gives_up_after_its_own_timeout(env):
    # The group's timeout (60 s) is beyond the run's 30: a barrier that waits it out fails the test.
    worker_pool = WorkerPool(2, backend="ddpkit", timeout=60.0, group_timeout=60.0, env=env)
    try:
        worker_pool.run(all_reduced, torch.ones(1), RED.SUM, None, timeout=30)  # the group's set-up
        outcomes = worker_pool.run(case_barrier_with_its_own_timeout, timeout=30)
    finally:
        worker_pool.kill()
    assert outcomes[1] == "late"
    assert "2000" in outcomes[0] and ("timeout" in outcomes[0] or "imed out" in outcomes[0]), outcomes[0]


# --- subgroups -----------------------------------------------------------------------------------

def case_subgroups():
    rank, n = dist.get_rank(), dist.get_world_size()
    members = [0, n - 1]
    ours = dist.new_group(members, backend="ddpkit")
    theirs = dist.new_group(members, backend="gloo")
    every = dist.new_group(list(range(n)), backend="ddpkit")
    out = {}
    if rank in members:
        def ops(g):
            a = values(rank, (1001,), salt=50)
            dist.all_reduce(a, group=g)
            b = values(rank, (4,), torch.int64, salt=51)
            dist.broadcast(b, group_src=1, group=g)
            c = torch.empty(2 * 3)
            dist.all_gather_into_tensor(c, values(rank, (3,), salt=52), group=g)
            d = torch.empty(3)
            quiet(dist.reduce_scatter_tensor, d, values(rank, (6,), salt=53), group=g)
            e = values(rank, (5,), salt=54)
            dist.all_reduce(e, async_op=True, group=g).wait()
            objects = [None, None]
            dist.all_gather_object(objects, ("from", rank), group=g)
            return [a, b, c, d, e, objects, dist.get_rank(g)]
        out["ops"] = (ops(ours), ops(theirs))
        # ddpkit's own API on the subgroup runs on the subgroup's engine
        x = values(rank, (10,), salt=55)
        ddpkit.all_reduce(x, group=ours)
        out["ddpkit.all_reduce"] = (x, sum(values(r, (10,), salt=55) for r in members))
    # the world and a second group of every rank keep working alongside
    for name, g in (("world", None), ("every", every)):
        y = values(rank, (33,), salt=56)
        dist.all_reduce(y, group=g)
        out[name] = (y, sum(values(r, (33,), salt=56) for r in range(n)))
    for g in (ours, theirs, every):
        dist.destroy_process_group(g)
    return out


def test_subgroups(dpool):
    per_rank = dpool(3).run(case_subgroups, timeout=60)
    check_against_gloo(per_rank)
    assert "ops" in per_rank[0] and "ops" in per_rank[2] and "ops" not in per_rank[1]


def case_ddpkit_group_in_gloo_world():
    rank, n = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(backend="ddpkit")
    x = values(rank, (1001,), salt=57)
    dist.all_reduce(x, group=group)
    objects = [None] * n
    dist.all_gather_object(objects, rank, group=group)
    backend = dist.get_backend(group)
    dist.destroy_process_group(group)
    return x, objects, backend


def test_ddpkit_subgroup_of_a_gloo_world(pool):
    for x, objects, backend in pool(2).run(case_ddpkit_group_in_gloo_world, timeout=60):
        assert torch.equal(x, values(0, (1001,), salt=57) + values(1, (1001,), salt=57))
        assert objects == [0, 1] and backend == "ddpkit"


# --- 2, 3. torch's DistributedDataParallel and ZeroRedundancyOptimizer, unchanged ------------------

class Branchy(nn.Module):
    """A batch-normalized trunk and one or two heads; a step uses one of them (the other's parameters are unused)."""

    def __init__(self, heads=1):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(8, 32, bias=False), nn.BatchNorm1d(32), nn.ReLU(),
                                   nn.Linear(32, 16), nn.ReLU())
        self.heads = nn.ModuleList([nn.Linear(16, 4) for _ in range(heads)])

    def forward(self, x, head=0):
        return self.heads[head](self.trunk(x))


def batch(rank, step, size=16):
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(size, 8, generator=generator), torch.randint(0, 4, (size,), generator=generator)


def train_torch_ddp(group, steps, accumulate=1, alternate_heads=False, hook=False, zero=None, **ddp_kwargs):
    """Final state of a few SGD steps (with ZeRO or without) of torch's DDP over `group`; every rank starts
    from its own random weights, so DDP's broadcast from rank 0 matters."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = dist.get_rank()
    torch.manual_seed(rank)
    # tiny buckets: several bucket all-reduces in flight during backward
    model = DDP(Branchy(2 if alternate_heads else 1), process_group=group, bucket_cap_mb=0.001, **ddp_kwargs)
    if hook:
        model.register_comm_hook(group, default_hooks.allreduce_hook)
    if zero is None:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    else:
        # (SGD: Adam would turn the last-bit differences of a three-rank sum into lr-sized ones)
        optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, lr=0.1, momentum=0.9,
                                            process_group=group, parameters_as_bucket_view=zero)
    for step in range(steps):
        for micro in range(accumulate):
            x, y = batch(rank, step * accumulate + micro)
            head = step % 2 if alternate_heads else 0
            context = model.no_sync() if micro < accumulate - 1 else contextlib.nullcontext()
            with context:
                nn.functional.cross_entropy(model(x, head), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    state = {k: v.clone() for k, v in model.module.state_dict().items()}
    if zero is not None:
        optimizer.consolidate_state_dict(to=0)
        if rank == 0:
            for index, entry in optimizer.state_dict()["state"].items():
                state[f"momentum.{index}"] = entry["momentum_buffer"]
    return state


DDP_SETTINGS = {
    "plain": dict(),
    "no_sync": dict(accumulate=3),
    "find_unused": dict(alternate_heads=True, find_unused_parameters=True),
    "grad_as_bucket_view": dict(gradient_as_bucket_view=True, accumulate=2),
    "static_graph": dict(static_graph=True),
    "comm_hook": dict(hook=True),
    "zero": dict(zero=False),
    "zero_bucket_view": dict(zero=True),
}


def case_torch_ddp(settings, steps):
    return {name: both(lambda g: train_torch_ddp(g, steps, **DDP_SETTINGS[name])) for name in settings}


@pytest.mark.parametrize("world_size", [2, 3])
def test_torch_ddp_and_zero_match_gloo(dpool, world_size):
    per_rank = dpool(world_size).run(case_torch_ddp, list(DDP_SETTINGS), 4, timeout=120)
    for rank, results in enumerate(per_rank):
        for name, (ours, theirs) in results.items():
            assert ours.keys() == theirs.keys()
            for key in ours:
                if world_size == 2:  # a + b: the same bits whatever the algorithm
                    assert torch.equal(ours[key], theirs[key]), (rank, name, key)
                else:  # three ranks' gradients may be added in another order
                    torch.testing.assert_close(ours[key], theirs[key], rtol=1e-6, atol=1e-6, msg=f"{rank} {name} {key}")
                if "running" not in key:  # all ranks hold the same parameters (buffers: their last batch's)
                    assert torch.equal(ours[key], per_rank[0][name][0][key]), (rank, name, key)
        untrained = Branchy()
        assert not torch.equal(results["plain"][0]["heads.0.weight"], untrained.heads[0].weight.detach())
    # rank 0 consolidated every rank's shard of the optimizer state
    parameters = len(list(Branchy().parameters()))
    assert sum(key.startswith("momentum.") for key in per_rank[0]["zero"][0]) == parameters


@needs_hosts
def test_torch_ddp_across_hosts_matches_gloo(hosts):
    """Two simulated hosts of two ranks: torch DDP's buckets cross hosts through the backend's hierarchy."""
    per_rank = hosts("2x2", backend="ddpkit").run(case_torch_ddp, ["plain", "no_sync"], 3, timeout=300)
    for rank, results in enumerate(per_rank):
        for name, (ours, theirs) in results.items():
            for key in ours:
                torch.testing.assert_close(ours[key], theirs[key], rtol=1e-6, atol=1e-6, msg=f"{rank} {name} {key}")


# --- 4. mismatched calls -------------------------------------------------------------------------

def _mismatched_async(rank):
    dist.all_reduce(torch.ones(5 + (rank == 1)), async_op=True).wait()


MISMATCHED_CALLS = {
    "numel": lambda rank: dist.all_reduce(torch.ones(5 + (rank == 1))),
    "collective": lambda rank: dist.all_reduce(torch.ones(5)) if rank == 1 else dist.broadcast(torch.ones(5), src=0),
    "dtype": lambda rank: dist.all_reduce(torch.ones(5, dtype=torch.float64 if rank == 1 else torch.float32)),
    "op": lambda rank: dist.all_reduce(torch.ones(5), op=RED.MAX if rank == 1 else RED.SUM),
    "root": lambda rank: dist.broadcast(torch.ones(5), src=1 if rank == 1 else 0),
    "all_gather_into_tensor": lambda rank: dist.all_gather_into_tensor(torch.empty(3 * (4 + (rank == 1))),
                                                                       torch.ones(4 + (rank == 1))),
    "all_gather_list": lambda rank: dist.all_gather([torch.empty(2 + (rank == 1)) for _ in range(3)],
                                                    torch.ones(2 + (rank == 1))),
    "async": _mismatched_async,
}

MISMATCH_MESSAGES = {
    "numel": "rank 1 passed elements 6, rank 0 passed elements 5",
    "collective": "rank 1 passed collective all_reduce, rank 0 passed collective broadcast",
    "dtype": "rank 1 passed dtype Double, rank 0 passed dtype Float",
    "op": "rank 1 passed op max, rank 0 passed op sum",
    "root": "rank 1 passed root 1, rank 0 passed root 0",
    "all_gather_into_tensor": "rank 1 passed elements 5, rank 0 passed elements 4",
    "all_gather_list": "rank 1 passed elements 3, rank 0 passed elements 2",
    "async": "rank 1 passed elements 6, rank 0 passed elements 5",
}


def case_mismatch(kind):
    rank = dist.get_rank()
    error = caught(lambda: MISMATCHED_CALLS[kind](rank))
    # the group is still usable: synchronously and asynchronously
    after = torch.full((1001,), float(rank))
    dist.all_reduce(after)
    later = torch.full((7,), float(rank))
    dist.all_reduce(later, op=RED.MAX, async_op=True).wait()
    return error, after, later


@pytest.mark.parametrize("kind", sorted(MISMATCHED_CALLS))
def test_mismatched_calls_raise_on_every_rank(dpool, kind):
    world_size = 3
    outcomes = dpool(world_size).run(case_mismatch, kind, timeout=30)
    for rank, (error, after, later) in enumerate(outcomes):
        assert error is not None, f"rank {rank} did not raise"
        assert "mismatched collectives" in error and MISMATCH_MESSAGES[kind] in error, error
        assert torch.equal(after, torch.full((1001,), float(sum(range(world_size)))))
        assert torch.equal(later, torch.full((7,), float(world_size - 1)))


def _coalesced(call, *args):
    """`call(*args)` inside torch's coalescing manager, which hands the backend its coalesced form."""
    with dist._coalescing_manager():
        quiet(call, *args)


# Calls whose backend operation shares its collective check's kind with another call (the kind is
# named after one of them): each mismatched by a size or dtype on rank 1. The torch.distributed name
# of the call, then the kind the check compares.
NAMED_MISMATCHES = {
    "all_gather": ("all_gather_into_tensor", lambda rank: dist.all_gather(
        [torch.empty(2 + rank) for _ in range(2)], torch.ones(2 + rank))),
    "reduce_scatter": ("reduce_scatter_tensor", lambda rank: dist.reduce_scatter(
        torch.empty(2 + rank), [torch.ones(2 + rank) for _ in range(2)])),
    "all_gather_into_tensor_coalesced": ("all_gather_into_tensor", lambda rank: _coalesced(
        dist.all_gather_into_tensor, torch.empty(2 * (2 + rank)), torch.ones(2 + rank))),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter_tensor", lambda rank: _coalesced(
        dist.reduce_scatter_tensor, torch.empty(2 + rank), torch.ones(2 * (2 + rank)))),
    "all_reduce_coalesced": ("all_reduce", lambda rank: _coalesced(dist.all_reduce, torch.ones(2 + rank))),
    # delegated to gloo, after the same check
    "all_gather_coalesced": ("all_gather_into_tensor", lambda rank: quiet(
        dist.all_gather_coalesced, [[torch.empty(2 + rank)] for _ in range(2)], [torch.ones(2 + rank)])),
    "all_to_all_single": ("all_to_all", lambda rank: dist.all_to_all_single(
        torch.empty(2, dtype=torch.float64 if rank else torch.float32),
        torch.ones(2, dtype=torch.float64 if rank else torch.float32))),
}


def case_named_mismatch(name):
    rank = dist.get_rank()
    error = caught(lambda: NAMED_MISMATCHES[name][1](rank))
    after = torch.full((3,), float(rank))
    dist.all_reduce(after)
    return error, after


@pytest.mark.parametrize("name", sorted(NAMED_MISMATCHES))
def test_mismatch_errors_name_the_call(dpool, name):
    """On every rank the error starts with the name of the call made, not with that of the kind of
    collective its check compares (which all_gather shares with all_gather_into_tensor, ...)."""
    kind = NAMED_MISMATCHES[name][0]
    outcomes = dpool(2).run(case_named_mismatch, name, timeout=30)
    for rank, (error, after) in enumerate(outcomes):
        assert error is not None, f"rank {rank} did not raise"
        assert f"ddpkit.{name}: ranks called mismatched collectives: rank 1 passed " in error, error
        assert f"ddpkit.{kind}:" not in error, error
        assert torch.equal(after, torch.full((3,), 1.0)), f"rank {rank}: the group is not usable afterwards"


def case_uneven_split_mismatch():
    """Rank 1 sends one row to itself but expects two from itself, and three rows to rank 0, which expects two."""
    rank = dist.get_rank()
    output = torch.full((6,), -1.0)
    send = [3, 1, 2] if rank == 1 else [2, 2, 2]
    error = caught(lambda: dist.all_to_all_single(output, torch.arange(6.0) + 10 * rank, [2, 2, 2], send))
    after = torch.full((5,), float(rank))
    dist.all_reduce(after)
    return error, output, after


def test_all_to_all_split_mismatch_raises_on_every_rank(dpool):
    outcomes = dpool(3).run(case_uneven_split_mismatch, timeout=30)
    problems = []
    for rank, (error, output, after) in enumerate(outcomes):
        if error is None:
            problems.append(f"rank {rank} did not raise (its output: {output.tolist()})")
        elif "frame #0" in error or "Exception raised from" in error:
            problems.append(f"rank {rank}'s error carries a C++ stack trace: {error[:400]!r}")
        if not torch.equal(after, torch.full((5,), 3.0)):
            problems.append(f"rank {rank}: the group is not usable afterwards")
    assert not problems, "\n".join(problems)


def run_on_a_fresh_pool(fn, *args):
    """fn on 3 fresh "ddpkit" ranks with a short group timeout, for calls that may hang or break the group."""
    worker_pool = WorkerPool(3, backend="ddpkit", timeout=60.0, group_timeout=5.0)
    try:
        return worker_pool.run(fn, *args, timeout=40, return_exceptions=True)
    finally:
        worker_pool.close()


def mismatch_problems(outcomes, expected_everywhere=None, expected_on=None):
    """What is wrong with per-rank (error, error afterwards, tensor afterwards) outcomes."""
    problems = []
    for rank, outcome in enumerate(outcomes):
        if isinstance(outcome, BaseException):
            problems.append(f"rank {rank} failed outside the case: {outcome!r}")
            continue
        error, after_error, after = outcome
        expected = (expected_on or {}).get(rank, expected_everywhere)
        if error is None:
            problems.append(f"rank {rank} did not raise")
        elif expected is not None and expected not in error:
            problems.append(f"rank {rank} raised {error[:300]!r}, expected it to say {expected!r}")
        if after_error is not None:
            problems.append(f"rank {rank}: the next all_reduce failed: {after_error[:300]!r}")
        elif not torch.equal(after, torch.full((3,), 3.0)):
            problems.append(f"rank {rank}: the next all_reduce gave {after.tolist()}")
    return problems


def case_then_all_reduce(table, kind):
    """Runs globals()[table][kind] (a dict of lambdas cannot be pickled), then an all_reduce."""
    rank = dist.get_rank()
    error = caught(lambda: globals()[table][kind](rank))
    after = torch.full((3,), float(rank))
    after_error = caught(lambda: dist.all_reduce(after))
    return error, after_error, after


ROOT_ARGUMENT_ERRORS = {
    "gather_short_list": lambda rank: dist.gather(torch.ones(2), [torch.empty(2)] * 2 if rank == 0 else None, dst=0),
    "scatter_short_list": lambda rank: dist.scatter(torch.empty(2), [torch.ones(2)] * 2 if rank == 0 else None, src=0),
    "gather_wrong_sizes": lambda rank: dist.gather(torch.ones(2), [torch.empty(3)] * 3 if rank == 0 else None, dst=0),
}


@pytest.mark.parametrize("kind", sorted(ROOT_ARGUMENT_ERRORS))
def test_bad_arguments_on_the_root_raise_on_every_rank(kind):
    """The root's list of the wrong length or sizes: like all_gather's (rejected inside the collective,
    on every rank), not an error on the root alone that leaves the others waiting and the group broken."""
    outcomes = run_on_a_fresh_pool(case_then_all_reduce, "ROOT_ARGUMENT_ERRORS", kind)
    what = kind.split("_")[0]
    problems = mismatch_problems(outcomes, expected_everywhere="rank 0 rejected its arguments", expected_on={0: what})
    assert not problems, "\n".join(problems)


LIST_ARGUMENT_ERRORS = {
    # a wrong list with an empty input once passed the collective's size check and read past the list
    "all_gather_empty_list_everywhere": lambda rank: dist.all_gather([], torch.empty(0)),
    "all_gather_short_list_on_rank_1": lambda rank: dist.all_gather([torch.empty(0)] * (2 if rank == 1 else 3),
                                                                    torch.empty(0)),
    # delegated to gloo, which checks the input on rank 1 alone: the others waited for it
    "reduce_scatter_tensor_short_input_on_rank_1": lambda rank: quiet(
        dist.reduce_scatter_tensor, torch.empty(2), torch.ones(4 if rank == 1 else 6), op=RED.PRODUCT),
    # PRODUCT is delegated to gloo, which checks the list on rank 1 alone: the others waited for it
    "reduce_scatter_short_list_on_rank_1": lambda rank: dist.reduce_scatter(
        torch.empty(2), [torch.ones(2)] * (2 if rank == 1 else 3), op=RED.PRODUCT),
    "all_gather_coalesced_short_list_on_rank_1": lambda rank: quiet(
        dist.all_gather_coalesced, [[torch.empty(2)] for _ in range(2 if rank == 1 else 3)], [torch.ones(2)]),
}


@pytest.mark.parametrize("kind", sorted(LIST_ARGUMENT_ERRORS))
def test_bad_lists_raise_on_every_rank(kind):
    outcomes = run_on_a_fresh_pool(case_then_all_reduce, "LIST_ARGUMENT_ERRORS", kind)
    if kind.endswith("everywhere"):
        problems = mismatch_problems(outcomes, expected_everywhere="takes a list of one tensor per rank of the group (3)")
    else:
        problems = mismatch_problems(outcomes, expected_everywhere="rank 1 rejected its arguments",
                                     expected_on={1: "expected world size times the output's 2" if "tensor" in kind
                                                  else "per rank of the group (3), got 2"})
    assert not problems, "\n".join(problems)


MIXED_CALLS = {
    # rank 1's PRODUCT is delegated to gloo, the others' SUM runs on ddpkit's engine
    "own_and_delegated": lambda rank: dist.all_reduce(torch.ones(5), op=RED.PRODUCT if rank == 1 else RED.SUM),
}


def test_mismatch_with_a_delegated_op_raises_on_every_rank():
    outcomes = run_on_a_fresh_pool(case_then_all_reduce, "MIXED_CALLS", "own_and_delegated")
    problems = mismatch_problems(outcomes, expected_everywhere="mismatched collectives")
    assert not problems, "\n".join(problems)


# --- 5. what the backend does not do: clear errors ------------------------------------------------

UNSUPPORTED_CALLS = {
    "avg_of_integers_on_one_rank": lambda rank: dist.all_reduce(
        torch.ones(4, dtype=torch.int64) if rank == 1 else torch.ones(4), op=RED.AVG),
    "non_contiguous_all_to_all_single": lambda rank: dist.all_to_all_single(torch.empty(6, 2).t(),
                                                                            torch.ones(6, 2).t()),
    "avg_of_integers": lambda rank: dist.all_reduce(torch.ones(4, dtype=torch.int64), op=RED.AVG),
    "premul_sum": lambda rank: dist.all_reduce(torch.ones(4), op=dist._make_nccl_premul_sum(2.0)),
    "int16": lambda rank: dist.all_reduce(torch.ones(4, dtype=torch.int16)),
}

UNSUPPORTED_MESSAGES = {
    "avg_of_integers_on_one_rank": "ddpkit.all_reduce: rank 1 rejected its arguments",
    "non_contiguous_all_to_all_single": "ddpkit.all_to_all_single: takes contiguous tensors",
    "avg_of_integers": "ddpkit.all_reduce: op 'mean' needs a floating-point tensor, got Long",
    "premul_sum": "Cannot use ReduceOp.PREMUL_SUM with Gloo",  # delegated: gloo's error
    "int16": "Invalid scalar type",  # delegated: gloo's error (gloo has no int16)
}


def case_unsupported(kind):
    rank = dist.get_rank()
    error = caught(lambda: UNSUPPORTED_CALLS[kind](rank))
    after = torch.full((3,), float(rank))
    dist.all_reduce(after)
    return error, after


@pytest.mark.parametrize("kind", sorted(UNSUPPORTED_CALLS))
def test_unsupported_calls_raise_clearly(dpool, kind):
    outcomes = dpool(3).run(case_unsupported, kind, timeout=30)
    for rank, (error, after) in enumerate(outcomes):
        assert error is not None, f"rank {rank} did not raise"
        if kind == "avg_of_integers_on_one_rank" and rank == 1:
            assert UNSUPPORTED_MESSAGES["avg_of_integers"] in error, error
        else:
            assert UNSUPPORTED_MESSAGES[kind] in error, error
        assert torch.equal(after, torch.full((3,), 3.0)), "the group must stay usable"


def test_registered_for_cpu_only():
    """No GPU here: check the registration that makes torch refuse CUDA tensors on a "ddpkit" group."""
    assert "DDPKIT" in dist.Backend._plugins
    assert dist.Backend.backend_capability["ddpkit"] == ["cpu"]


# --- 6. ddpkit's own API on a "ddpkit" group: one engine ------------------------------------------

def case_ddpkit_api():
    rank, n = dist.get_rank(), dist.get_world_size()
    out = {}
    # torch's collectives on a "ddpkit" group are ddpkit collectives; on the gloo group they are not
    gloo_group()
    ddpkit.reset_comm_counters()
    for _ in range(3):
        dist.all_reduce(torch.ones(10))
    dist.all_gather_into_tensor(torch.empty(2 * n), torch.ones(2))
    dist.all_reduce(torch.ones(10), group=gloo_group())
    out["counted"] = (ddpkit.comm_counters()["collectives"], 4)
    out["transport"] = (ddpkit.comm.resolved_transport(), "shm")
    # one sequence of collectives: ddpkit's call runs after the queued asynchronous ones, in order
    a, b = values(rank, (300_001,), salt=60), values(rank, (1001,), salt=61)
    work = dist.all_reduce(a, async_op=True)
    ddpkit.all_reduce(b)
    c = values(rank, (5,), salt=62)
    ddpkit.broadcast(c, src=n - 1)
    work.wait()
    out["interleaved"] = ([a, b, c], [sum(values(r, (300_001,), salt=60) for r in range(n)),
                                      sum(values(r, (1001,), salt=61) for r in range(n)), values(n - 1, (5,), salt=62)])

    # ddpkit.DistributedDataParallel and ddpkit.SyncBatchNorm on the "ddpkit" world and on the gloo group
    def train(g):
        torch.manual_seed(rank)
        model = ddpkit.DistributedDataParallel(
            nn.Sequential(nn.Linear(8, 16), ddpkit.SyncBatchNorm(16, process_group=g), nn.ReLU(), nn.Linear(16, 4)),
            process_group=g)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            x, y = batch(rank, step)
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
        return {k: v.clone() for k, v in model.module.state_dict().items()}
    out["ddp_syncbn"] = both(train)

    def syncbn(g):
        bn = ddpkit.SyncBatchNorm(3, process_group=g)
        x = values(rank, (4, 3, 5), salt=63).requires_grad_()
        y = bn(x)
        (y * torch.arange(3.0).view(1, 3, 1)).sum().backward()
        return [y.detach(), x.grad, bn.weight.grad, bn.running_mean, bn.running_var]
    out["syncbn"] = both(syncbn)
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_ddpkit_api_shares_the_backend_engine(dpool, world_size):
    per_rank = dpool(world_size).run(case_ddpkit_api, timeout=60)
    for rank, results in enumerate(per_rank):
        for key, (ours, theirs) in results.items():
            if key in ("ddp_syncbn", "syncbn") and world_size > 2:
                for a, b in zip(ours.values() if isinstance(ours, dict) else ours,
                                theirs.values() if isinstance(theirs, dict) else theirs):
                    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
            else:
                assert_same(list(ours.values()) if isinstance(ours, dict) else ours,
                            list(theirs.values()) if isinstance(theirs, dict) else theirs, (rank, key))
    # the synchronized batch norm saw every rank's batch: its output differs from a local batch norm's
    x = values(0, (4, 3, 5), salt=63)
    local = nn.functional.batch_norm(x, None, None, training=True)
    assert not torch.allclose(per_rank[0]["syncbn"][0][0], local)
    everything = torch.cat([values(r, (4, 3, 5), salt=63) for r in range(world_size)])
    expected = nn.functional.batch_norm(everything, None, None, training=True)[:4]
    torch.testing.assert_close(per_rank[0]["syncbn"][0][0], expected, rtol=1e-5, atol=1e-5)


# --- 7. the process-group transport --------------------------------------------------------------

def case_transport_and_counters():
    n = dist.get_world_size()
    ddpkit.reset_comm_counters()
    dist.all_reduce(torch.ones(1000))
    dist.all_gather_into_tensor(torch.empty(10 * n), torch.ones(10))
    quiet(dist.reduce_scatter_tensor, torch.empty(10), torch.ones(10 * n))
    return ddpkit.comm.resolved_transport(), ddpkit.comm_counters()


@pytest.mark.parametrize("world_size", [2, 3])
def test_process_group_transport_matches_gloo(dpool, world_size):
    """DDPKIT_TRANSPORT=process_group, read when the backend is constructed: ddpkit's message schedules
    over the inner gloo instead of shared memory, with the same results."""
    worker_pool = dpool(world_size, DDPKIT_TRANSPORT="process_group")
    for transport, counters in worker_pool.run(case_transport_and_counters, timeout=30):
        assert transport == "process_group"
        assert counters["collectives"] == 3 and counters["messages_sent"] > 0, counters
    check_against_gloo(worker_pool.run(case_every_op, timeout=60))
    check_against_gloo(worker_pool.run(case_async, timeout=60))


def test_shared_memory_sends_no_messages(dpool):
    for transport, counters in dpool(3).run(case_transport_and_counters, timeout=30):
        assert transport == "shm"
        assert counters["collectives"] == 3 and counters["messages_sent"] == 0, counters


# --- 8. train.py --backend ddpkit under torchrun -------------------------------------------------

def assert_succeeded(processes, outputs):
    codes = [process.returncode for process in processes]
    assert codes == [0] * len(processes), "\n".join(f"--- process {i} (exit {code}):\n{output[-6000:]}"
                                                    for i, (code, output) in enumerate(zip(codes, outputs)))


@needs_fashion_mnist
def test_torchrun_with_the_ddpkit_backend(tmp_path):
    """torch's DDP (--impl torch) through train.py, all its collectives on the "ddpkit" backend."""
    process = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
         str(TRAIN), "--backend", "ddpkit", "--impl", "torch", *small_cli(tmp_path / "run")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = process.communicate(timeout=240)[0]
    assert_succeeded([process], [output])
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["world_size"] == 2 and metrics["final_test_accuracy"] is not None
    assert output.count("test loss") == 1


@needs_fashion_mnist
def test_two_torchrun_launchers_as_two_nodes_with_the_ddpkit_backend(tmp_path):
    endpoint = f"127.0.0.1:{free_port()}"
    launchers = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node), "--nproc_per_node",
         "1", "--rdzv_backend", "c10d", "--rdzv_endpoint", endpoint, "--rdzv_id", "two-nodes-ddpkit", str(TRAIN),
         "--backend", "ddpkit", *small_cli(tmp_path / "run")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True) for node in (0, 1)]
    outputs = [launcher.communicate(timeout=240)[0] for launcher in launchers]
    assert_succeeded(launchers, outputs)
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["world_size"] == 2
    assert sum("test loss" in output for output in outputs) == 1  # only rank 0 logs


# --- a backend per device, and torch's debug wrapper ---------------------------------------------

def case_per_device_backend():
    rank = dist.get_rank()
    ddpkit.reset_comm_counters()
    x = values(rank, (1001,), salt=71)
    dist.all_reduce(x)
    ddpkit.all_reduce(x)  # ddpkit's own call on the same group: the same engine
    return dist.get_backend(), x, ddpkit.comm_counters()["collectives"], ddpkit.comm.resolved_transport()


def test_a_backend_string_per_device():
    """"cpu:ddpkit,cuda:<backend>" sends CPU tensors to ddpkit (NCCL needs a GPU; gloo stands in for it)."""
    with WorkerPool(2, backend="cpu:ddpkit,cuda:gloo", timeout=60.0, group_timeout=30.0) as worker_pool:
        outcomes = worker_pool.run(case_per_device_backend, timeout=60)
    expected = 2 * (values(0, (1001,), salt=71) + values(1, (1001,), salt=71))
    for backend, x, collectives, transport in outcomes:
        assert backend == "cpu:ddpkit,cuda:gloo"
        assert torch.equal(x, expected)
        assert collectives == 2 and transport == "shm"  # dist.all_reduce and ddpkit.all_reduce: one engine


def case_debug_detail():
    rank = dist.get_rank()
    x = values(rank, (1001,), salt=73)
    dist.all_reduce(x)
    # torch's debug wrapper fingerprints collectives before they reach the backend
    mismatch = caught(lambda: dist.all_reduce(torch.ones(3)) if rank == 0 else dist.broadcast(torch.ones(3), 0))
    y = values(rank, (1001,), salt=74)
    ddpkit.all_reduce(y)  # ddpkit's own call on the wrapped group still works
    dist.all_reduce(y)
    return x, mismatch, y


def test_torch_distributed_debug_detail_keeps_working():
    with WorkerPool(2, backend="ddpkit", timeout=60.0, group_timeout=30.0,
                    env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}) as worker_pool:
        outcomes = worker_pool.run(case_debug_detail, timeout=60)
    for x, mismatch, y in outcomes:
        assert torch.equal(x, values(0, (1001,), salt=73) + values(1, (1001,), salt=73))
        assert mismatch is not None and "mismatch" in mismatch.lower(), mismatch
        assert torch.equal(y, 2 * (values(0, (1001,), salt=74) + values(1, (1001,), salt=74)))
