"""The "ddpkit" torch.distributed backend (csrc/backend, python/ddpkit/backend.py): what every operation
computes, synchronously and asynchronously, on shared memory and over the process group.

Every worker of a pool of "ddpkit" ranks also makes a gloo group of the same ranks, runs each
torch.distributed operation on both groups with the same integer-valued inputs and returns both
results: they must be identical (where both reduce in the same order) or within one rounding
(helpers.check_against_gloo). Then asynchronous work and futures, and the process-group transport.
"""

import time

import pytest
import torch
import torch.distributed as dist

import ddpkit
from ddpkit.testing import WorkerPool

from helpers import RED, all_reduced, both, check_against_gloo, gloo_group, quiet, run_on_a_fresh_pool, values

FLOAT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
OWN_DTYPES = FLOAT_DTYPES + (torch.int32, torch.int64)


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
    out[("all_reduce_coalesced", "product")] = both(
        coalesced([values(rank, (4,), salt=20, low=-3, high=4)], RED.PRODUCT)
    )
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

        for name in ("all_gather_single", "all_gather_into_tensor"):  # torch 2.13's name, and the deprecated one

            def gather_flat(g):
                flat = torch.empty(n * 2, 3, dtype=dtype)
                quiet(getattr(dist, name), flat, x, group=g)
                return flat

            out[(name, dtype)] = ours, theirs = both(gather_flat)
        stacked = torch.empty(n, 2, 3, dtype=dtype)  # torch's other output shape (gloo takes only the flat one)
        dist.all_gather_into_tensor(stacked, x)
        out[("all_gather_into_tensor", "stacked", dtype)] = (stacked.view(n * 2, 3), theirs)
    out["all_gather_object"] = both(
        lambda g: (lambda objs: (dist.all_gather_object(objs, {rank: "y" * rank}, group=g), objs)[1])([None] * n)
    )

    for op in (RED.SUM, RED.MIN, RED.PRODUCT):
        for dtype in (torch.float32, torch.int64):
            inputs = [values(rank, (3, 2), dtype, salt=27 + r, low=-3, high=4) for r in range(n)]

            def rs_list(g):
                t = torch.empty(3, 2, dtype=dtype)
                dist.reduce_scatter(t, [i.clone() for i in inputs], op=op, group=g)
                return t

            out[("reduce_scatter", str(op), dtype)] = both(rs_list)
            x = values(rank, (n * 3, 2), dtype, salt=28, low=-3, high=4)

            for name in ("reduce_scatter_single", "reduce_scatter_tensor"):  # torch 2.13's name, the deprecated one

                def rs_tensor(g):
                    t = torch.empty(3, 2, dtype=dtype)
                    quiet(getattr(dist, name), t, x.clone(), op=op, group=g)
                    return t

                out[(name, str(op), dtype)] = both(rs_tensor)

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
                dist.all_gather_into_tensor(
                    output, values(rank, (output.shape[0] // n, *output.shape[1:]), salt=salt), group=g
                )
        return outputs

    out["all_gather_into_tensor_coalesced"] = both(coalesced_gather)

    def coalesced_gather_strided(g):
        output = torch.empty(2, 2 * n).t()  # (2n, 2), not contiguous: filled in its own row-major order
        with dist._coalescing_manager(group=g):
            dist.all_gather_into_tensor(output, values(rank, (2, 2), salt=42), group=g)
        return output

    out["all_gather_into_tensor_coalesced_strided"] = (
        coalesced_gather_strided(None),
        torch.cat([values(peer, (2, 2), salt=42) for peer in range(n)]),
    )
    for op in (RED.SUM, RED.MAX):

        def coalesced_reduce_scatter(g):
            outputs = [torch.empty(3), torch.empty(2, 2)]
            with dist._coalescing_manager(group=g):
                for output, salt in zip(outputs, (36, 37)):
                    quiet(
                        dist.reduce_scatter_tensor,
                        output,
                        values(rank, (n * output.shape[0], *output.shape[1:]), salt=salt),
                        op=op,
                        group=g,
                    )
            return outputs

        out[("reduce_scatter_tensor_coalesced", str(op))] = both(coalesced_reduce_scatter)
    # delegated to gloo: an op or a dtype ddpkit does not reduce, or several dtypes at once
    for op, dtypes in (
        (RED.PRODUCT, (torch.float32, torch.float32)),
        (RED.SUM, (torch.int8, torch.int8)),
        (RED.BAND, (torch.int32, torch.int32)),
        (RED.SUM, (torch.float32, torch.float64)),
    ):

        def delegated_reduce_scatter(g):
            outputs = [torch.empty(3, dtype=dtypes[0]), torch.empty(2, 2, dtype=dtypes[1])]
            with dist._coalescing_manager(group=g):
                for output, salt in zip(outputs, (43, 44)):
                    quiet(
                        dist.reduce_scatter_tensor,
                        output,
                        values(rank, (n * output.shape[0], *output.shape[1:]), output.dtype, salt=salt, low=-3, high=4),
                        op=op,
                        group=g,
                    )
            return outputs

        out[("reduce_scatter_tensor_coalesced", str(op), dtypes)] = both(delegated_reduce_scatter)

    def coalesced_gather_mixed(g):
        outputs = [torch.empty(3 * n), torch.empty(2 * n, dtype=torch.int64)]
        with dist._coalescing_manager(group=g):
            for output, salt in zip(outputs, (45, 46)):
                quiet(
                    dist.all_gather_into_tensor,
                    output,
                    values(rank, (output.shape[0] // n,), output.dtype, salt=salt),
                    group=g,
                )
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
            works = [dist.isend(torch.full((4,), float(rank)), right, group=g), dist.irecv(received, left, group=g)]
            for work in works:
                work.wait()
            return received

        out["isend_irecv"] = both(ring_nonblocking)
    return out


# --- every operation against gloo -------------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
def test_every_op_matches_gloo(pools, world_size):
    per_rank = pools("ddpkit", world_size).run(case_every_op, timeout=60)
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
        works = [
            dist.all_reduce(a, async_op=True, group=g),
            dist.broadcast(b, src=n - 1, async_op=True, group=g),
            dist.all_gather_into_tensor(c_out, c_in, async_op=True, group=g),
            quiet(dist.reduce_scatter_tensor, d_out, d_in, op=RED.MAX, async_op=True, group=g),
            dist.all_to_all_single(e_out, e_in, async_op=True, group=g),
            dist.all_reduce(f, op=RED.PRODUCT, async_op=True, group=g),
            dist.barrier(async_op=True, group=g),
        ]
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
def test_async_work_and_futures(pools, world_size):
    per_rank = pools("ddpkit", world_size).run(case_async, timeout=60)
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
    out["no_grad_parameter"] = (
        parameter.detach().clone(),
        torch.full((5,), float(n * (n + 1) // 2), dtype=torch.bfloat16),
    )
    # a synchronous call queued behind an asynchronous one also runs on the engine's thread
    big = torch.ones(300_001)
    with torch.no_grad():
        work = dist.all_reduce(big, async_op=True)
        dist.all_reduce(parameter)
        work.wait()
    out["no_grad_queued_sync"] = (
        parameter.detach().clone(),
        torch.full((5,), float(n * n * (n + 1) // 2), dtype=torch.bfloat16),
    )
    # under inference_mode, into inference tensors
    with torch.inference_mode():
        source = torch.arange(2 * n, dtype=torch.float32) + 100 * rank
        target = torch.empty(2 * n)
        dist.all_to_all_single(target, source, async_op=True).wait()
    out["inference_mode_all_to_all"] = (
        target.clone(),
        torch.cat([torch.arange(2) + 2 * rank + 100 * peer for peer in range(n)]).float(),
    )
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


def test_async_collectives_run_under_the_issuing_threads_state(pools):
    for results in pools("ddpkit", 2).run(case_async_under_the_callers_state, timeout=60):
        for key, (ours, expected) in results.items():
            assert torch.equal(ours, expected), (key, ours, expected)


def case_callback_waits_for_the_next_collective():
    """A future's callback that waits for the next collective's future, with fewer idle completion
    threads than completions: both completions once went to the one idle thread, which the first
    callback then held (Note [Future callbacks])."""
    results = []
    for _ in range(20):
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
    """Rank 0 calls a barrier with a timeout of 2 s; rank 1 never joins it: it returns at once, and a rank
    idle in its pool is as far from the barrier as one asleep in the task, without the test waiting on it."""
    import datetime

    if dist.get_rank() == 1:
        return "late"
    try:
        dist.barrier(timeout=datetime.timedelta(seconds=2))
    except RuntimeError as error:
        return str(error)
    return "passed"


@pytest.mark.parametrize(
    "env",
    [{}, {"DDPKIT_TRANSPORT": "process_group"}, {"DDPKIT_TEST_HOSTS": "a,b"}],
    ids=["shm", "process_group", "across_hosts"],
)
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


# --- the process-group transport --------------------------------------------------------------


def case_transport_and_counters():
    n = dist.get_world_size()
    ddpkit.reset_comm_counters()
    dist.all_reduce(torch.ones(1000))
    dist.all_gather_into_tensor(torch.empty(10 * n), torch.ones(10))
    quiet(dist.reduce_scatter_tensor, torch.empty(10), torch.ones(10 * n))
    return ddpkit.comm.resolved_transport(), ddpkit.comm_counters()


@pytest.mark.parametrize("world_size", [2, 3])
def test_process_group_transport_matches_gloo(pools, world_size):
    """DDPKIT_TRANSPORT=process_group, read when the backend is constructed: ddpkit's message schedules
    over the inner gloo instead of shared memory, with the same results."""
    worker_pool = pools("ddpkit", world_size, DDPKIT_TRANSPORT="process_group")
    for transport, counters in worker_pool.run(case_transport_and_counters, timeout=30):
        assert transport == "process_group"
        assert counters["collectives"] == 3 and counters["messages_sent"] > 0, counters
    check_against_gloo(worker_pool.run(case_every_op, timeout=60))
    check_against_gloo(worker_pool.run(case_async, timeout=60))


def test_shared_memory_sends_no_messages(pools):
    for transport, counters in pools("ddpkit", 3).run(case_transport_and_counters, timeout=30):
        assert transport == "shm"
        assert counters["collectives"] == 3 and counters["messages_sent"] == 0, counters
