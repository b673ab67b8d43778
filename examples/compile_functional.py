"""torch.compile with torch's functional collectives on the "ddpkit" backend. The collective is part of
the compiled graph (``fullgraph=True``: no graph break), and the compiled function returns the same bits
as the same function run eagerly.

    torchrun --nproc_per_node 2 examples/compile_functional.py

Functional collectives return a new tensor instead of writing in place, which is what lets the
compiler trace them. ddpkit's own in-place calls (``ddpkit.all_reduce``) compile too, but run eagerly
at a graph break.

The backend is "aot_eager": the whole capture (Dynamo, then AOTAutograd, where a collective must be
traceable) without Inductor's C++ code generation, which takes tens of seconds on a small machine. The
default backend runs this too; its fused reductions add in another order, so it equals eager within
rounding rather than bit for bit.
"""

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import ddpkit  # noqa: F401  (registers the "ddpkit" backend)

dist.init_process_group("ddpkit")
rank, world_size = dist.get_rank(), dist.get_world_size()


def normalize_across_ranks(x: torch.Tensor) -> torch.Tensor:
    """Centre x with the mean over all ranks' rows."""
    total = funcol.all_reduce(x.sum(0), "sum", group=dist.group.WORLD)
    return x - total / (x.shape[0] * world_size)


x = torch.randn(64, 128, generator=torch.Generator().manual_seed(rank))
compiled = torch.compile(normalize_across_ranks, fullgraph=True, backend="aot_eager")
got = compiled(x)
expected = normalize_across_ranks(x)  # eager: the same collective, run by the backend one call at a time
assert torch.equal(got, expected)

# And the result is right: the rows of all ranks, centred, sum to zero.
column_sums = got.sum(0)
dist.all_reduce(column_sums)
torch.testing.assert_close(column_sums, torch.zeros(128), atol=1e-3, rtol=0)

if rank == 0:
    print(
        f"compile_functional: a functional all-reduce compiled (fullgraph, aot_eager) on {world_size} ranks "
        f"({dist.get_backend()} backend) equals eager, bit for bit"
    )
dist.destroy_process_group()
