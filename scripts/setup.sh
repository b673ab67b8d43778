#!/usr/bin/env bash
# Everything ddpkit needs on a fresh Debian machine, idempotent: apt data, a venv with the CPU torch,
# and an editable build of the C++ extension against that torch (never an isolated build, which
# would download another, multi-GB CUDA torch). Each step says what it does and shows its progress.
set -euo pipefail
cd "$(dirname "$0")/.."
# The extras of pyproject.toml to install beside ddpkit: `make main` asks for the plot alone.
extras=${1:-test,report}

SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
apt_packages=()
if [ ! -d /usr/share/datasets/fashion-mnist ]; then
  echo "== apt: Fashion-MNIST (dataset-fashion-mnist, 30 MB)"
  apt_packages+=(dataset-fashion-mnist)
fi
if [[ ",$extras," == *",test,"* ]] && ! command -v mpirun >/dev/null; then
  echo "== apt: MPICH's mpirun (mpich, for tests/test_launchers.py)"
  apt_packages+=(mpich)
fi
if [ ${#apt_packages[@]} -gt 0 ]; then
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${apt_packages[@]}" >/dev/null
fi

if [ ! -x .venv/bin/python ]; then
  echo "== venv: .venv"
  python3 -m venv .venv
fi

# pip's output goes whole to build/setup.log; the terminal gets the lines that show progress (what is
# collected and installed, each file compiled), and the end of the log if a step fails.
mkdir -p build
log=build/setup.log
: > "$log"
logged() {  # logged SED_SCRIPT COMMAND...: runs COMMAND, showing the lines SED_SCRIPT prints
  local script=$1
  shift
  set +e
  "$@" 2>&1 | tee -a "$log" | sed -nu -E "$script"
  local status=${PIPESTATUS[0]}
  set -e
  if [ "$status" -ne 0 ]; then
    tail -n 40 "$log"
    echo "setup: '$*' failed with exit status $status; the whole log is $log" >&2
    exit "$status"
  fi
}
PIP=".venv/bin/pip --disable-pip-version-check"
INSTALLS='s#^(Collecting [^ ]*|Successfully installed .*)$#  \1#p'
if .venv/bin/python -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null; then
  echo "== pip: torch 2.13.0 is installed"
else
  echo "== pip: torch 2.13.0 (CPU; the first time this downloads about 200 MB)"
  $PIP install "torch==2.13.0"  # unfiltered: pip's own progress bar shows the download
fi
logged "$INSTALLS" $PIP install --progress-bar off "scikit-build-core>=0.11" ninja

# The Python packages ddpkit and the extras need go in while the extension compiles: pip would install
# them only after the build (the compiler keeps both cores busy; unpacking wheels mostly waits on the
# disk). Their own pip, into build/deps.log, is waited for below.
deps_log=build/deps.log
# The names from pyproject.toml, one a line: ddpkit's dependencies but torch (installed above), then the extras'.
mapfile -t deps < <(.venv/bin/python - "$extras" <<'PY'
import sys
try:
    import tomllib
except ImportError:  # Python 3.10: pip's own copy of tomli
    from pip._vendor import tomli as tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
names = [d for d in project["dependencies"] if not d.startswith("torch")]
for extra in filter(None, sys.argv[1].split(",")):
    names += project["optional-dependencies"][extra]
print("\n".join(names))
PY
)
(
  set -e
  $PIP install --progress-bar off "${deps[@]}"
  if [[ ",$extras," == *",test,"* ]] && ! .venv/bin/python -c "import torchft" 2>/dev/null; then
    # torchft (docs/fault_tolerance.md, tests/test_torchft.py) declares a dependency on a torch build
    # that pip would replace the CPU torch with, which the test extra cannot prevent: it goes in
    # without its dependencies, and the few it needs at import beside torch go in by name.
    $PIP install --progress-bar off --no-deps "torchft==0.2.0"
    $PIP install --progress-bar off opentelemetry-api opentelemetry-sdk opentelemetry-exporter-otlp
  fi
) > "$deps_log" 2>&1 &
deps_pid=$!
trap 'kill "$deps_pid" 2>/dev/null || true' EXIT  # a failed build leaves no pip behind
echo "== pip: ddpkit's Python dependencies and the extras ($extras) in the background, into $deps_log"

echo "== build: ddpkit's C++ extension (the first time about 2 minutes on 2 cores)"
# A testing build (DDPKIT_TESTING): the test suite arms the fault points it carries, and the
# benchmarks time the engine with its timing op (csrc/testing/). `pip install .` builds without them.
# pip shows a build's output only with -v. Its compiler steps, "[3/41] Building CXX object
# CMakeFiles/_C.dir/csrc/comm/shm.cpp.o", show as "[3/41] csrc/comm/shm.cpp (_C)".
logged "$INSTALLS
        s#^ *(\[[0-9]+/[0-9]+\]) Building CXX object CMakeFiles/([^/]*)\.dir/(.*)\.o\$#  \1 \3 (\2)#p
        s#^ *(\[[0-9]+/[0-9]+\]) Linking CXX .*\$#  \1 linking#p
        s#^.*(ddpkit: CUDA kernels .*)\$#  \1#p" \
  $PIP install -v --progress-bar off --no-build-isolation --no-deps -C cmake.define.DDPKIT_TESTING=ON -e .
if ! wait "$deps_pid"; then
  tail -n 40 "$deps_log"
  echo "setup: installing the Python dependencies failed; the whole log is $deps_log" >&2
  exit 1
fi
sed -n -E "$INSTALLS" "$deps_log"
.venv/bin/python -c "import ddpkit, torch; print(f'ddpkit {ddpkit.__version__} ready: torch {torch.__version__}')"
