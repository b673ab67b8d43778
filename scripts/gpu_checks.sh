#!/usr/bin/env bash
# Issue 13's GPU work on a machine with a CUDA torch and nvcc (no network), in the repository root:
#   bash scripts/gpu_checks.sh build   # build and install against that torch (--no-build-isolation --no-deps)
#   bash scripts/gpu_checks.sh test    # tests/test_cuda.py, then the CPU suites that exercise torch's APIs
#   bash scripts/gpu_checks.sh bench   # bench_syncbn.py --device cuda, bench_ddp.py --device cuda
# Several phases in one call: bash scripts/gpu_checks.sh build test bench. Logs and results go to
# $OUT (default /tmp/ddpkit-gpu); each step has its own time limit so that a slow one still leaves
# the others' output. Where the machine's copy of the tree may carry a stale .git (the device tool
# sends the session's first one), name the commit: DDPKIT_GIT_COMMIT=<sha> bash scripts/gpu_checks.sh ...
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/ddpkit-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
PY=${PY:-python3}

installed() { (cd /tmp && $PY -c "import ddpkit, torch; assert torch._C._dispatch_has_kernel_for_dispatch_key('ddpkit::sync_batch_norm', 'CUDA')") 2>/dev/null; }

for phase in "$@"; do
  case "$phase" in
    build)
      nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
      $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
      nvcc --version | tail -1
      echo "CXX=${CXX:-unset} $(${CXX:-c++} --version | head -1); shared libstdc++: $(${CXX:-c++} -print-file-name=libstdc++.so)"
      start=$SECONDS
      timeout 300 $PY -m pip install --no-build-isolation --no-deps -v . >"$OUT/build.log" 2>&1
      echo "build: rc=$? in $((SECONDS - start)) s"
      grep -E "ddpkit: |error" "$OUT/build.log" | head -20
      readelf -d "$($PY -c 'import ddpkit._C as c; print(c.__file__)' 2>/dev/null)" 2>/dev/null | grep -i "libstdc" \
        || echo "WARNING: _C.so does not load a shared libstdc++"
      installed && echo "ddpkit installed with its CUDA kernels" || echo "ddpkit NOT installed with CUDA kernels"
      ;;
    test)
      installed || { echo "test: build first"; exit 1; }
      timeout 180 $PY -m pytest -q -rfEsx -p no:cacheprovider tests/test_cuda.py --junitxml="$OUT/test_cuda.xml" 2>&1 \
        | tee "$OUT/test_cuda.log" | tail -40
      timeout 200 $PY -m pytest -q -p no:cacheprovider tests/test_comm.py tests/test_shm.py tests/test_ddp.py tests/test_syncbn.py tests/test_opcheck.py 2>&1 | tee "$OUT/test_cpu_suites.log" | tail -15
      ;;
    bench)
      installed || { echo "bench: build first"; exit 1; }
      mkdir -p "$OUT/results"
      timeout 240 $PY benchmarks/bench_syncbn.py --device cuda --cuda-algorithms process_group auto 2>&1 \
        | tee "$OUT/bench_syncbn.log" | tail -45
      cp benchmarks/results/syncbn_cuda.json "$OUT/results/" 2>/dev/null
      timeout 150 $PY benchmarks/bench_ddp.py --device cuda --blocks 6 2>&1 | tee "$OUT/bench_ddp.log" | tail -25
      cp benchmarks/results/ddp_cuda.json "$OUT/results/" 2>/dev/null
      ;;
    *) echo "unknown phase $phase"; exit 2 ;;
  esac
done
