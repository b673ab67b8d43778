"""The "ddpkit" backend's groups and engines: subgroups of a "ddpkit" world and a "ddpkit" subgroup of a gloo
world, ddpkit's own API on a "ddpkit" group (one engine for both), a backend string per device, and torch's
debug wrapper around the backend. Each compares with gloo on the same ranks (helpers.check_against_gloo)."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

import ddpkit
from ddpkit.testing import WorkerPool

from helpers import assert_same, batch, both, caught, check_against_gloo, gloo_group, quiet, values

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


def test_subgroups(pools):
    per_rank = pools("ddpkit", 3).run(case_subgroups, timeout=60)
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


# --- ddpkit's own API on a "ddpkit" group: one engine ------------------------------------------


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
    out["interleaved"] = (
        [a, b, c],
        [
            sum(values(r, (300_001,), salt=60) for r in range(n)),
            sum(values(r, (1001,), salt=61) for r in range(n)),
            values(n - 1, (5,), salt=62),
        ],
    )

    # ddpkit.DistributedDataParallel and ddpkit.SyncBatchNorm on the "ddpkit" world and on the gloo group
    def train(g):
        torch.manual_seed(rank)
        model = ddpkit.DistributedDataParallel(
            nn.Sequential(nn.Linear(8, 16), ddpkit.SyncBatchNorm(16, process_group=g), nn.ReLU(), nn.Linear(16, 4)),
            process_group=g,
        )
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
def test_ddpkit_api_shares_the_backend_engine(pools, world_size):
    per_rank = pools("ddpkit", world_size).run(case_ddpkit_api, timeout=60)
    for rank, results in enumerate(per_rank):
        for key, (ours, theirs) in results.items():
            if key in ("ddp_syncbn", "syncbn") and world_size > 2:
                for a, b in zip(
                    ours.values() if isinstance(ours, dict) else ours,
                    theirs.values() if isinstance(theirs, dict) else theirs,
                ):
                    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
            else:
                assert_same(
                    list(ours.values()) if isinstance(ours, dict) else ours,
                    list(theirs.values()) if isinstance(theirs, dict) else theirs,
                    (rank, key),
                )
    # the synchronized batch norm saw every rank's batch: its output differs from a local batch norm's
    x = values(0, (4, 3, 5), salt=63)
    local = nn.functional.batch_norm(x, None, None, training=True)
    assert not torch.allclose(per_rank[0]["syncbn"][0][0], local)
    everything = torch.cat([values(r, (4, 3, 5), salt=63) for r in range(world_size)])
    expected = nn.functional.batch_norm(everything, None, None, training=True)[:4]
    torch.testing.assert_close(per_rank[0]["syncbn"][0][0], expected, rtol=1e-5, atol=1e-5)


# --- a backend per device, and torch's debug wrapper ---------------------------------------------


def case_per_device_backend():
    rank = dist.get_rank()
    ddpkit.reset_comm_counters()
    x = values(rank, (1001,), salt=71)
    dist.all_reduce(x)
    ddpkit.all_reduce(x)  # ddpkit's own call on the same group: the same engine
    return dist.get_backend(), x, ddpkit.comm_counters()["collectives"], ddpkit.comm.resolved_transport()


def test_a_backend_string_per_device():
    """ "cpu:ddpkit,cuda:<backend>" sends CPU tensors to ddpkit (NCCL needs a GPU; gloo stands in for it)."""
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
    with WorkerPool(
        2, backend="ddpkit", timeout=60.0, group_timeout=30.0, env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}
    ) as worker_pool:
        outcomes = worker_pool.run(case_debug_detail, timeout=60)
    for x, mismatch, y in outcomes:
        assert torch.equal(x, values(0, (1001,), salt=73) + values(1, (1001,), salt=73))
        assert mismatch is not None and "mismatch" in mismatch.lower(), mismatch
        assert torch.equal(y, 2 * (values(0, (1001,), salt=74) + values(1, (1001,), salt=74)))
