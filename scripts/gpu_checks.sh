#!/usr/bin/env bash
# The GPU list (issue 44) on a machine with a CUDA torch and nvcc (no network), in the repository root:
#   bash scripts/gpu_checks.sh build       # a testing build against that torch (--no-build-isolation --no-deps)
#   bash scripts/gpu_checks.sh test        # tests/test_cuda.py
#   bash scripts/gpu_checks.sh bench       # bench_syncbn.py --device cuda, bench_ddp.py --device cuda
#   bash scripts/gpu_checks.sh grid        # bench_allreduce.py on the machine's CPU cores: n = 2, 4, 8, 16,
#                                          # 1k-16M floats, ddpkit, gloo, the floor and MPICH (from the
#                                          # wheels in .whl/: mpich, mpi4py) -> allreduce_16core.json
#   bash scripts/gpu_checks.sh profile     # scripts/gpu_profile.py: where SyncBatchNorm's and DDP's time goes
#   bash scripts/gpu_checks.sh multihost   # bench_multihost.py on simulated hosts (network and mount namespaces,
#                                          # root): 3x1, 4x1, 8x1 unshaped, ddpkit against gloo and against
#                                          # ddpkit with its links' threads chosen otherwise (Note [Threads
#                                          # of the links]) or on the kernel's send buffers (Note
#                                          # [Send buffers]) -> multihost_16core_link_threads.json;
#                                          # iproute2 from .tools/ where the machine has no `ip` (see below)
#   bash scripts/gpu_checks.sh cpu-suites  # the CPU suites that exercise torch's APIs, on the CUDA torch
# Several phases in one call: bash scripts/gpu_checks.sh build test bench profile multihost grid (about
# 460 s on an H100 with multihost failing at once: with multihost running, give grid a second call).
# Issue 49's open question, what the links' threads gain on 16 cores, wants `build multihost` in one
# call first (multihost's limit is 300 s; an estimate, not yet timed there).
# The machine reaches no network: fetch MPICH's wheels here first, into .whl/ (ignore it in
# .git/info/exclude and carry it with the call), for the machine's Python 3.12:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_5_x86_64 \
#     -d .whl mpich==5.0.2 mpi4py==4.1.2
#
# Where the machine has no iproute2, carry Debian's (ignore .tools/ in .git/info/exclude): `apt-get download
# iproute2` and its libraries, `dpkg -x` each into .tools/root/, with the wrappers .tools/bin/ip and
# .tools/bin/tc that give ip and tc their libraries and the programs `ip netns exec` starts none. Replace
# every link there by a copy of its target (dpkg -x leaves sbin/ip a link to /bin/ip, which the machine
# lacks: the H100 round of 2026-11-28 lost its multihost phase to it).
#
# Each phase runs under a time limit of its own, capped by what is left of BUDGET seconds (default
# 560, for a 600-second device call), so a slow phase still leaves the later ones some time and the
# call ends inside its limit. Logs and results go to $WORK (default /tmp/ddpkit-gpu), and each
# phase packs what it wrote into $OUT/gpu-PHASE.tgz as soon as it ends: the device tool brings back
# at most 8 files, and a call cut short still returns the phases that finished. Where the machine's
# copy of the tree may carry a stale .git (the device tool sends the session's first one), name the
# commit: DDPKIT_GIT_COMMIT=<sha> bash scripts/gpu_checks.sh ...
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/ddpkit-gpu-out}
WORK=${WORK:-/tmp/ddpkit-gpu}
BUDGET=${BUDGET:-560}
mkdir -p "$OUT" "$WORK/results"
export PYTHONUNBUFFERED=1 CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
PY=${PY:-python3}

installed() { (cd /tmp && $PY -c "import ddpkit, torch; assert torch._C._dispatch_has_kernel_for_dispatch_key('ddpkit::sync_batch_norm', 'CUDA')") 2>/dev/null; }
# limit SECONDS: the smaller of SECONDS and what is left of the budget (at least 10).
limit() { local left=$((BUDGET - SECONDS)); ((left < $1)) && echo $((left > 10 ? left : 10)) || echo "$1"; }
pack() { tar czf "$OUT/gpu-$1.tgz" -C "$WORK" . 2>/dev/null; rm -rf "${WORK:?}"/*; mkdir -p "$WORK/results"; }

for phase in "$@"; do
  echo "== $phase at ${SECONDS}s"
  case "$phase" in
    build)
      # The machine, into the phase's archive too: the call's output keeps only its tail.
      {
        nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
        $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
        nvcc --version | tail -1
        lscpu | grep -E "^(Model name|CPU\(s\)|Thread|Core|Socket|NUMA node\(s\))"
      } 2>&1 | tee "$WORK/machine.txt"
      start=$SECONDS
      timeout "$(limit 300)" $PY -m pip install --no-build-isolation --no-deps -C cmake.define.DDPKIT_TESTING=ON -v . \
        >"$WORK/build.log" 2>&1
      echo "build: rc=$? in $((SECONDS - start)) s"
      grep -E "ddpkit: |error" "$WORK/build.log" | head -20
      installed && echo "ddpkit installed with its CUDA kernels" || echo "ddpkit NOT installed with CUDA kernels"
      ;;
    test)
      installed || { echo "test: build first"; continue; }
      timeout "$(limit 150)" $PY -m pytest -q -rfEsx -p no:cacheprovider tests/test_cuda.py \
        --junitxml="$WORK/test_cuda.xml" >"$WORK/test_cuda.log" 2>&1
      echo "test: rc=$?"; tail -25 "$WORK/test_cuda.log"
      ;;
    cpu-suites)
      installed || { echo "cpu-suites: build first"; continue; }
      timeout "$(limit 200)" $PY -m pytest -q -p no:cacheprovider tests/test_comm.py tests/test_shm.py tests/test_ddp.py \
        tests/test_syncbn.py tests/test_opcheck.py >"$WORK/test_cpu_suites.log" 2>&1
      echo "cpu-suites: rc=$?"; tail -8 "$WORK/test_cpu_suites.log"
      ;;
    bench)
      installed || { echo "bench: build first"; continue; }
      timeout "$(limit 200)" $PY benchmarks/bench_syncbn.py --device cuda --cuda-algorithms ${SYNCBN_ALGORITHMS:-auto} \
        ${SYNCBN_REPS:+--reps $SYNCBN_REPS} \
        >"$WORK/bench_syncbn.log" 2>&1
      echo "bench_syncbn: rc=$?"; tail -32 "$WORK/bench_syncbn.log"
      cp benchmarks/results/syncbn_cuda.json "$WORK/results/" 2>/dev/null
      # bench_ddp.py rewrites its JSON after each of its four configurations: a cut keeps the ones done.
      timeout "$(limit 180)" $PY benchmarks/bench_ddp.py --device cuda --blocks ${DDP_BLOCKS:-4} >"$WORK/bench_ddp.log" 2>&1
      echo "bench_ddp: rc=$?"; tail -22 "$WORK/bench_ddp.log"
      cp benchmarks/results/ddp_cuda.json "$WORK/results/" 2>/dev/null
      ;;
    grid)
      installed || { echo "grid: build first"; continue; }
      if ls .whl/mpich-*.whl .whl/mpi4py-*.whl >/dev/null 2>&1; then
        $PY -m pip install -q --no-index --no-deps --no-compile .whl/mpich-*.whl .whl/mpi4py-*.whl 2>&1 | grep -v WARNING
      fi
      # run_all.sh's 16-core grid, with fewer repetitions to fit the call. bench_allreduce.py rewrites
      # its JSON after every world size, so a cut leaves the sizes done.
      timeout "$(limit 240)" $PY benchmarks/bench_allreduce.py --world-sizes ${GRID_WORLD_SIZES:-2 4 8 16} \
        --sizes 1000 100000 1000000 16000000 --max-numel-above-8 16000000 --candidates ddpkit gloo floor mpich \
        --peer-max-world-size 16 --reps ${GRID_REPS:-12} --pools 1 --point-budget 2 --memory-sizes \
        --output allreduce_16core >"$WORK/grid.log" 2>&1
      echo "grid: rc=$?"; tail -30 "$WORK/grid.log"
      cp benchmarks/results/allreduce_16core.json "$WORK/results/" 2>/dev/null
      # Note [Direct all-reduce]'s threshold for ranks that spin, against the one it replaced (128 KiB): the
      # 1k-float call is the grid's only size it moves.
      timeout "$(limit 60)" env DDPKIT_SHM_WHOLE_BYTES=131072 $PY benchmarks/bench_allreduce.py --world-sizes 4 8 16 \
        --sizes 1000 --candidates ddpkit mpich --peer-max-world-size 16 --reps ${GRID_REPS:-12} --pools 1 \
        --point-budget 2 --memory-sizes --output allreduce_whole_16core >"$WORK/grid_whole.log" 2>&1
      echo "grid, whole path up to 128 KiB: rc=$?"; tail -12 "$WORK/grid_whole.log"
      cp benchmarks/results/allreduce_whole_16core.json "$WORK/results/" 2>/dev/null
      ;;
    multihost)
      installed || { echo "multihost: build first"; continue; }
      command -v ip >/dev/null || export PATH="$PWD/.tools/bin:$PATH"
      command -v ip && ip -V && command -v tc unshare
      if ! ip netns add ddpkit-probe 2>"$WORK/netns.log"; then
        echo "multihost: no network namespaces here: $(cat "$WORK/netns.log")"; continue
      fi
      ip netns del ddpkit-probe
      # The defaults time Note [Threads of the links]'s choices against each other and gloo, and
      # Note [Send buffers]'s against the kernel's own sizing (ddpkit_kernel_buffers); the
      # figures of 2026-11-28 (multihost_16core*.json) took MULTIHOST_TOPOLOGIES="4x1 4x2 8x1"
      # MULTIHOST_LINKS="unshaped 10gbit" MULTIHOST_CANDIDATES="ddpkit ddpkit_backend gloo"
      # MULTIHOST_SIZES="1000 100000 1000000 16000000" MULTIHOST_OUTPUT=multihost_16core.
      output=${MULTIHOST_OUTPUT:-multihost_16core_link_threads}
      timeout "$(limit 300)" $PY benchmarks/bench_multihost.py --topologies ${MULTIHOST_TOPOLOGIES:-3x1 4x1 8x1} \
        --links ${MULTIHOST_LINKS:-unshaped} --collectives all_reduce \
        --candidates ${MULTIHOST_CANDIDATES:-ddpkit ddpkit_links_caller ddpkit_links_send ddpkit_links_both ddpkit_kernel_buffers gloo} \
        --sizes ${MULTIHOST_SIZES:-100000 1000000 16000000} --reps ${MULTIHOST_REPS:-5} --no-ddp --output "$output" \
        >"$WORK/multihost.log" 2>&1
      echo "multihost: rc=$?"; tail -30 "$WORK/multihost.log"
      cp "benchmarks/results/$output.json" "$WORK/results/" 2>/dev/null
      ;;
    profile)
      installed || { echo "profile: build first"; continue; }
      timeout "$(limit 120)" $PY scripts/gpu_profile.py syncbn ddp >"$WORK/profile.log" 2>&1
      echo "profile: rc=$?"; grep -E "^(===|ratio|ddpkit |torch |--- )" "$WORK/profile.log"
      ;;
    *) echo "unknown phase $phase"; continue ;;
  esac
  pack "$phase"
done
echo "== done at ${SECONDS}s"
