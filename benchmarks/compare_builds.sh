#!/usr/bin/env bash
# Is this tree's all-reduce as fast as an earlier commit's? Builds BASE and this tree (its committed
# state plus any uncommitted changes, `git stash create`) alike: each a release build (`pip install`,
# no testing hooks) in a venv of its own. Then runs this tree's bench_allreduce.py at n=2 (ddpkit, gloo,
# the memory floor) alternately with the base build and with the tree's, ROUNDS times, and prints per
# size the median over rounds of the tree's ddpkit time over the base's (each round's two runs back to
# back, so drift hits both). Building both the same way keeps the testing build's fault points out of
# the comparison. With --two-hosts (as root: simulated hosts), it then alternates the two builds the
# same way on bench_multihost.py's all-reduce across two hosts (2x1 and 2x2, unshaped). With --hosts
# TOPOLOGIES SIZES it alternates them on those topologies and sizes only (bench_multihost.py's
# --reps 9 each), without the n=2 runs.
#   bash benchmarks/compare_builds.sh ac93524 11      # about 3 minutes on 2 cores, plus the builds
#   bash benchmarks/compare_builds.sh ac93524 11 --two-hosts
#   bash benchmarks/compare_builds.sh ac93524 5 --hosts "3x1 4x1 4x2 8x1" "1000000 16000000"
set -euo pipefail
cd "$(dirname "$0")/.."
base=$(git rev-parse --short "${1:?usage: compare_builds.sh BASE_COMMIT [ROUNDS] [--two-hosts | --hosts TOPOLOGIES SIZES]}")
rounds=${2:-11}
hosts_mode=${3:-}
topologies="2x1 2x2"
sizes="1000 100000 1000000"
reps=()
if [ "$hosts_mode" = --hosts ]; then
  topologies=${4:?--hosts needs TOPOLOGIES and SIZES}
  sizes=${5:?--hosts needs TOPOLOGIES and SIZES}
  reps=(--reps 9)
fi
stash=$(git stash create)  # empty when the tree has no uncommitted changes
tree=$(git rev-parse --short "${stash:-HEAD}")
release_venv() {  # COMMIT -> the path of a venv with COMMIT's release build, made once
  local work=${TMPDIR:-/tmp}/ddpkit-compare-$1
  if [ ! -x "$work/venv/bin/python" ] || ! "$work/venv/bin/python" -c "import ddpkit" 2>/dev/null; then
    rm -rf "$work" && mkdir -p "$work/src"
    git archive "$1" | tar -x -C "$work/src"
    python3 -m venv "$work/venv"
    "$work/venv/bin/pip" install -q --disable-pip-version-check torch==2.13.0 "scikit-build-core>=0.11" ninja numpy tqdm
    "$work/venv/bin/pip" install -q --disable-pip-version-check --no-build-isolation --no-deps "$work/src"
  fi >&2
  echo "$work/venv/bin/python"
}
base_py=$(release_venv "$base")
tree_py=$(release_venv "$tree")
work=${TMPDIR:-/tmp}/ddpkit-compare-$base-vs-$tree
rm -rf "$work" && mkdir -p "$work"
for round in $(seq 1 "$rounds"); do
  [ "$hosts_mode" = --hosts ] && break
  for build in base tree; do
    py=$tree_py; [ $build = base ] && py=$base_py
    DDPKIT_RESULTS_DIR="$work/$build-$round" $py benchmarks/bench_allreduce.py --world-sizes 2 \
      --candidates ddpkit gloo floor --sizes 1000 10000 100000 1000000 16000000 --reps 30 --pools 1 \
      --memory-sizes > "$work/$build-$round.log" 2>&1
  done
  echo "round $round of $rounds done"
done
[ "$hosts_mode" = --hosts ] || "$tree_py" - "$work" "$rounds" "$base" "$tree" <<'PY'
import json, statistics, sys
work, rounds, base, tree = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
def times(path):
    return {(r["candidate"], r["numel"]): r["median_s"] for r in json.load(open(path))["records"]
            if r.get("kind") == "time" and r["world_size"] == 2 and r["median_s"]}
runs = [(times(f"{work}/base-{i}/allreduce.json"), times(f"{work}/tree-{i}/allreduce.json")) for i in range(1, rounds + 1)]
print(f"\nddpkit all-reduce at n=2, this tree ({tree}) against {base}, both release builds: medians over {rounds} rounds")
print(f"{'floats':>9}  {'tree/base':>9}  {'rounds min-max':>14}  {'base':>10}  {'tree':>10}  {'base/gloo':>9}  {'tree/gloo':>9}")
for numel in sorted({numel for _, numel in runs[0][0]}):
    ratio = [t[("ddpkit", numel)] / b[("ddpkit", numel)] for b, t in runs]
    med = lambda xs: statistics.median(xs)
    print(f"{numel:>9}  {med(ratio):>8.3f}x  {min(ratio):>6.2f}-{max(ratio):<6.2f}  "
          f"{med([b[('ddpkit', numel)] for b, _ in runs]) * 1e6:>8.1f}us  {med([t[('ddpkit', numel)] for _, t in runs]) * 1e6:>8.1f}us  "
          f"{med([b[('ddpkit', numel)] / b[('gloo', numel)] for b, _ in runs]):>9.3f}  "
          f"{med([t[('ddpkit', numel)] / t[('gloo', numel)] for _, t in runs]):>9.3f}")
PY
[ -n "$hosts_mode" ] || exit 0
for round in $(seq 1 "$rounds"); do
  for build in base tree; do
    py=$tree_py; [ $build = base ] && py=$base_py
    # shellcheck disable=SC2086  # the topologies and sizes are lists
    # Each build runs its own bench_multihost.py (the same timing either way): HostPool's arguments
    # grow (delayed links), and a base older than that cannot run this tree's.
    DDPKIT_RESULTS_DIR="$work/hosts-$build-$round" $py "${py%/venv/bin/python}/src/benchmarks/bench_multihost.py" --topologies $topologies \
      --links unshaped --collectives all_reduce --candidates ddpkit --sizes $sizes "${reps[@]}" --no-ddp \
      > "$work/hosts-$build-$round.log" 2>&1
  done
  echo "across hosts: round $round of $rounds done"
done
"$tree_py" - "$work" "$rounds" "$base" "$tree" <<'PY'
import json, statistics, sys
work, rounds, base, tree = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
def times(path):
    return {(r["topology"], r["candidate"], r["numel"]): r["median_s"] for r in json.load(open(path))["records"]
            if r.get("kind") == "multihost_all_reduce"}
runs = [(times(f"{work}/hosts-base-{i}/multihost.json"), times(f"{work}/hosts-tree-{i}/multihost.json"))
        for i in range(1, rounds + 1)]
med = statistics.median
print(f"\nddpkit all-reduce across hosts, this tree ({tree}) against {base}: medians over {rounds} rounds")
print(f"{'topology':>8}  {'floats':>8}  {'tree/base':>9}  {'rounds min-max':>14}  {'base/gloo':>9}  {'tree/gloo':>9}")
for key in sorted(k for k in runs[0][0] if k[1] == "ddpkit"):
    topology, _, numel = key
    gloo = (topology, "gloo", numel)
    ratio = [t[key] / b[key] for b, t in runs]
    print(f"{topology:>8}  {numel:>8}  {med(ratio):>8.3f}x  {min(ratio):>6.2f}-{max(ratio):<6.2f}  "
          f"{med([b[key] / b[gloo] for b, _ in runs]):>9.3f}  {med([t[key] / t[gloo] for _, t in runs]):>9.3f}")
PY
