"""ddpkit's collectives on CPU tensors, every result checked: all-reduce (its default and the ring over
torch.distributed's send/recv), broadcast, reduce, gather, scatter, all-gather, reduce-scatter, barrier.

    torchrun --nproc_per_node 2 examples/collectives.py

Any number of processes works (``--nproc_per_node 4``); plain ``python examples/collectives.py`` is a
group of one. The collectives are in-place calls on ordinary tensors; every rank calls them in the
same order, and a rank that does not (another collective, another size) makes all of them raise.
"""

import torch
import torch.distributed as dist

import ddpkit

ddpkit.init_distributed()  # torchrun's environment (a group of one without torchrun)
rank, world_size = dist.get_rank(), dist.get_world_size()

t = torch.full((100_000,), float(rank))
ddpkit.all_reduce(t, op="mean")  # in place; algorithm="auto", transport="auto"
assert torch.all(t == (world_size - 1) / 2)

t = torch.full((100_000,), float(rank))
ddpkit.all_reduce(t, algorithm="ring", transport="process_group")  # the ring over torch.distributed send/recv
assert torch.all(t == world_size * (world_size - 1) / 2)

t = torch.full((4,), float(rank))
ddpkit.broadcast(t, src=0)  # rank 0's values everywhere
assert torch.all(t == 0)
t = torch.full((4,), float(rank))
ddpkit.reduce(t, dst=0)  # the sum, on rank 0 only
assert rank != 0 or torch.all(t == world_size * (world_size - 1) / 2)

x = torch.arange(3.0) + 10 * rank
rows = ddpkit.gather(x, dst=0)  # on rank 0 a [world_size, 3] tensor, row r from rank r; None elsewhere
out = torch.empty(3)
ddpkit.scatter(out, rows, src=0)  # row r of rank 0's rows into rank r's out
assert torch.equal(out, x)

blocks = torch.empty(world_size * 3)
ddpkit.all_gather_single(blocks, x)  # block r is rank r's x, on every rank
mine = torch.empty(3)
ddpkit.reduce_scatter_single(mine, blocks)  # the sum over ranks of block `rank` of their inputs
assert torch.equal(blocks.view(world_size, 3)[rank], x) and torch.equal(mine, world_size * x)
ddpkit.barrier()

transport = ddpkit.comm.resolved_transport()  # a collective too: every rank asks
if rank == 0:
    print(f"collectives: every result checked on {world_size} ranks ({transport} transport)")
dist.destroy_process_group()
