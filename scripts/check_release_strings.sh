#!/usr/bin/env bash
# Builds the release library as `pip install .` does (no DDPKIT_TESTING) into a scratch folder and
# lists what of the test suite's hooks (csrc/testing/) its _C carries: fault names, the test
# variables, the timing op. Prints nothing above its last line and exits 0 when there is none.
#   bash scripts/check_release_strings.sh      # about 3 minutes on 2 cores
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
$PY -m pip wheel --no-build-isolation --no-deps -q -C build-dir="$scratch/build" -w "$scratch" . >"$scratch/build.log" 2>&1 \
  || { tail -20 "$scratch/build.log"; exit 1; }
(cd "$scratch" && unzip -q -o ./*.whl 'ddpkit/_C*')
names="die_at_hello|die_at_offer|die_at_map|die_at_verdict|die_in_host_step|die_in_host_data_step|corrupt_chunk"
names="$names|stray_links|links_cannot_listen|stale_link_frame|die_in_ring_step|DDPKIT_TEST_FAULT|DDPKIT_TEST_HOSTS|the test fault"
names="$names|no_liveness_poll|DDPKIT_SHM_|DDPKIT_LINK_THREADS|time_engine_loop|ddpkit_testing"
found=$(strings "$scratch"/ddpkit/_C*.so | grep -E "$names" || true)
if [ -n "$found" ]; then
  echo "$found"
  echo "check_release_strings: the release _C carries test hooks (above)"
  exit 1
fi
echo "check_release_strings: the release _C ($(du -k "$scratch"/ddpkit/_C*.so | cut -f1) KiB) carries no test hook"
