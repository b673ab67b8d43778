#!/usr/bin/env bash
# Measures every result notebooks/report.ipynb shows, from this tree and nothing outside it, then
# rebuilds and executes the notebook.
#   bash benchmarks/run_all.sh           # full: about 1 hour 45 minutes on 2 cores (104 minutes at c3f5aa0); results in benchmarks/results/
#   bash benchmarks/run_all.sh --quick   # smoke check in a few minutes; results in benchmarks/results/quick/
# Each result records the commit it was measured at, with "-dirty" when tracked files had uncommitted
# changes: commit first, so that the whole report comes from one commit (the notebook warns otherwise).
# With a GPU, the CUDA benchmarks (syncbn_cuda.json, ddp_cuda.json) run too, and with 16 cores or more
# the all-reduce grid up to 16 ranks (allreduce_16core.json); without them, the report keeps the
# results it has and says which commit they come from. Run it on an otherwise idle
# machine: every figure is a ratio measured in one run, but a busy neighbour still adds noise.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
QUICK=()
TRAINING=(--full)  # bench_training.py's default is the short run of `make main`
REPORT=(-m notebooks.report)  # a module of the repository's root (see its docstring)
if [ "${1:-}" = "--quick" ]; then
  QUICK=(--quick)  # every script then writes to benchmarks/results/quick/
  TRAINING=(--quick)
  REPORT+=(--results benchmarks/results/quick --output benchmarks/results/quick/report.ipynb)
fi

# The same outputs as benchmarks/common.py's MEASUREMENT_OUTPUTS, which decides each result's "-dirty".
if [ -n "$(git status --porcelain --untracked-files=no -- . ":(exclude)benchmarks/results" ":(exclude)notebooks/report.ipynb" 2>/dev/null)" ]; then
  echo "run_all: tracked files have uncommitted changes: every result will say <commit>-dirty, and the report will warn" >&2
fi
if [ ! -x .venv/bin/mpiexec ] || ! $PY -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('deepspeed') is None)"; then
  echo "run_all: MPICH or DeepSpeed is not installed, so the all-reduce grid runs without it" \
       "(bash benchmarks/peers/install.sh installs both)"
fi

run() {
  echo
  echo "== run_all: $*"
  "$@"
}
started=$SECONDS
run $PY benchmarks/bench_allreduce.py "${QUICK[@]}"
run $PY benchmarks/bench_allreduce.py "${QUICK[@]}" --check-overhead --world-sizes 2 4 8 --reps 300 --output allreduce_checks
run $PY benchmarks/bench_latency.py "${QUICK[@]}"
run $PY benchmarks/bench_syncbn.py "${QUICK[@]}" --device cpu
run $PY benchmarks/bench_ddp.py "${QUICK[@]}"
run $PY benchmarks/bench_backend.py "${QUICK[@]}"
run $PY benchmarks/bench_training.py "${TRAINING[@]}" --no-progress
run $PY benchmarks/bench_torch_stack.py "${QUICK[@]}"
# ZeRO-1/2 (sharding.json) and ZeRO-3 (sharding_zero3.json), each beside the baselines its targets name
run $PY benchmarks/bench_sharding.py "${QUICK[@]}" \
  --candidates ddpkit_ddp zero1 zero2 torch_zero_ddpkit fsdp2_ddpkit fsdp2_gloo torch_ddp_gloo
run $PY benchmarks/bench_sharding.py "${QUICK[@]}" \
  --candidates ddpkit_ddp zero3 zero3_bf16 fsdp2_ddpkit fsdp2_gloo --output sharding_zero3
# ZeRO-3's peak memory against DDP's at the 100M model (sharding_memory.json)
run $PY benchmarks/bench_sharding.py "${QUICK[@]}" --candidates ddpkit_ddp zero3 zero3_bf16 --models 100M \
  --phases one_host bytes --reps 3 --steps 3 --warmup 1 --output sharding_memory
run $PY benchmarks/bench_fault_tolerance.py "${QUICK[@]}"  # torchft on gloo and on ddpkit
if [ "$(id -u)" -eq 0 ] && command -v ip >/dev/null && command -v unshare >/dev/null; then
  run $PY benchmarks/bench_multihost.py "${QUICK[@]}"  # simulated hosts: network and mount namespaces
  # three hosts and more: the ring across hosts and the compressed crossing (issue 49)
  run $PY benchmarks/bench_multihost.py "${QUICK[@]}" --topologies 2x1 3x1 4x1 4x2 8x1 --links unshaped 1gbit \
    --collectives all_reduce --candidates ddpkit ddpkit_kernel_buffers ddpkit_backend ddpkit_bf16 gloo --no-ddp \
    --output multihost_hosts
  run $PY benchmarks/bench_multihost.py "${QUICK[@]}" --topologies 2x1 3x1 4x1 4x2 8x1 --links unshaped \
    --collectives all_reduce --candidates ddpkit ddpkit_kernel_buffers ddpkit_backend ddpkit_backend_method ddpkit_torch_python gloo \
    --sizes 1000 100000 1000000 16000000 --reps 25 --no-ddp --output multihost_unshaped
  run $PY benchmarks/bench_compression.py "${QUICK[@]}"
  run $PY benchmarks/bench_fault_tolerance.py "${QUICK[@]}" --hosts 4 --link 1gbit --steady-wrappers torchft-ddp
  # long, fat links: delayed behind a router (issue 65)
  run $PY benchmarks/bench_multihost.py "${QUICK[@]}" --topologies 2x1 4x1 --links 1gbit-10ms \
    --collectives all_reduce --candidates ddpkit ddpkit_backend ddpkit_bf16 ddpkit_send_buffer_256 ddpkit_kernel_buffers gloo \
    --sizes 1000000 16000000 --no-ddp --output multihost_delayed
  run $PY benchmarks/bench_multihost.py "${QUICK[@]}" --topologies 4x1 --links 1gbit-10ms 1gbit-10ms-reno \
    --collectives all_reduce --candidates ddpkit ddpkit_backend gloo --sizes 16000000 --reps 40 --no-ddp \
    --output multihost_delayed_4x1_16M
  run $PY benchmarks/bench_fault_tolerance.py "${QUICK[@]}" --hosts 2 --link 1gbit-10ms --steady-wrappers torchft-ddp \
    --name fault_tolerance_hosts_delayed
else
  echo "run_all: bench_multihost.py needs root and iproute2 (its hosts are namespaces); the report keeps its result"
fi
if $PY -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  run $PY benchmarks/bench_syncbn.py "${QUICK[@]}" --device cuda
  run $PY benchmarks/bench_ddp.py "${QUICK[@]}" --device cuda
fi
if [ "$(nproc)" -ge 16 ]; then  # a core per rank up to 16 ranks (the lent GPU machines have 16)
  run $PY benchmarks/bench_allreduce.py "${QUICK[@]}" --world-sizes 2 4 8 16 --sizes 1000 100000 1000000 16000000 \
    --max-numel-above-8 16000000 --peer-max-world-size 16 --memory-sizes --output allreduce_16core
fi
run $PY "${REPORT[@]}"
echo
echo "run_all: done in $(( (SECONDS - started) / 60 )) minutes"
