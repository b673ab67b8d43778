#!/usr/bin/env bash
# Re-runs every benchmark with the assignment-sized settings, then executes notebooks/report.ipynb.
#   bash benchmarks/run_all.sh           # full: about 2 hours on 2 cores; results in benchmarks/results/
#   bash benchmarks/run_all.sh --quick   # smoke check in a few minutes; results in benchmarks/results/quick/
# Run it on an otherwise idle machine: every figure is a ratio measured in one run, but a busy
# neighbour still adds noise.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
QUICK=()
TRAINING=(--full)  # bench_training.py's default is the short run of `make main`
REPORT=(notebooks/report.py)
if [ "${1:-}" = "--quick" ]; then
  QUICK=(--quick)
  TRAINING=(--quick)
  export DDPKIT_RESULTS_DIR="$PWD/benchmarks/results/quick"
  REPORT+=(--results "$DDPKIT_RESULTS_DIR" --output "$DDPKIT_RESULTS_DIR/report.ipynb")
fi
$PY benchmarks/bench_allreduce.py "${QUICK[@]}"
$PY benchmarks/bench_allreduce.py "${QUICK[@]}" --check-overhead --world-sizes 2 4 8 --reps 300 --output allreduce_checks
$PY benchmarks/bench_syncbn.py "${QUICK[@]}"
$PY benchmarks/bench_ddp.py "${QUICK[@]}"
$PY benchmarks/bench_backend.py "${QUICK[@]}"
$PY benchmarks/bench_training.py "${TRAINING[@]}"
$PY "${REPORT[@]}"
