"""Deterministic sequential printing from N processes, with point-to-point messages only.

    torchrun --nproc_per_node 4 sequential_print.py                       # 10 iterations, ascending
    torchrun --nproc_per_node 4 sequential_print.py --num-iter 3 --order alternating

Each iteration prints ``Process 0`` ... ``Process N-1`` (one line each) and iterations are separated
by a ``---`` line (none after the last). A token passed rank to rank with ``send``/``recv`` orders
the prints: a rank prints and flushes, then hands the token on, so the shared stdout receives the
lines in order. No barrier and no collective are involved. ``--order descending`` prints N-1 ... 0;
``--order alternating`` prints even iterations ascending and odd iterations descending;
``--order ascending_descending`` prints 0 ... N-1 then N-1 ... 0 in every iteration.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist

ORDERS = ("ascending", "descending", "alternating", "ascending_descending")


def iteration_order(iteration: int, world_size: int, order: str) -> list[int]:
    ascending = list(range(world_size))
    if order == "ascending_descending":
        return ascending + ascending[::-1]
    if order == "ascending" or (order == "alternating" and iteration % 2 == 0):
        return ascending
    return ascending[::-1]


def expected_output(world_size: int, num_iter: int = 10, order: str = "ascending") -> str:
    """The exact text ``run_sequential`` prints, for tests."""
    blocks = ["".join(f"Process {rank}\n" for rank in iteration_order(i, world_size, order)) for i in range(num_iter)]
    return "---\n".join(blocks)


def run_sequential(rank: int, world_size: int, num_iter: int = 10, order: str = "ascending") -> None:
    """Prints this rank's lines in turn; returns when this rank has printed all of them."""
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    token = torch.zeros(1, dtype=torch.int64)
    sequence = [(i, r) for i in range(num_iter) for r in iteration_order(i, world_size, order)]
    for position, (iteration, printer) in enumerate(sequence):
        if printer != rank:
            continue
        if position > 0:
            previous = sequence[position - 1][1]
            if previous != rank:
                dist.recv(token, src=previous)
                if int(token) != position:
                    raise RuntimeError(f"rank {rank}: token {int(token)} arrived for turn {position}")
        last_of_iteration = position + 1 == len(sequence) or sequence[position + 1][0] != iteration
        text = f"Process {rank}\n" + ("---\n" if last_of_iteration and iteration + 1 < num_iter else "")
        sys.stdout.write(text)
        sys.stdout.flush()
        if position + 1 < len(sequence):
            following = sequence[position + 1][1]
            if following != rank:
                token.fill_(position + 1)
                dist.send(token, dst=following)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-iter", type=int, default=10, help="number of iterations (default 10)")
    parser.add_argument("--order", choices=ORDERS, default="ascending")
    args = parser.parse_args(argv)
    if args.num_iter < 0:
        parser.error("--num-iter must be >= 0")
    from ddpkit.launch import init_distributed

    info = init_distributed(backend="gloo")
    try:
        run_sequential(info.rank, info.world_size, args.num_iter, args.order)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
