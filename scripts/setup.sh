#!/usr/bin/env bash
# Everything ddpkit needs on a fresh Debian machine, idempotent: apt data, a venv with the CPU torch,
# and an editable build of the C++ extension against that torch (never an isolated build, which
# would download another, multi-GB CUDA torch).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -d /usr/share/datasets/fashion-mnist ]; then
  echo "== apt: Fashion-MNIST (dataset-fashion-mnist)"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq dataset-fashion-mnist >/dev/null
fi

if [ ! -x .venv/bin/python ]; then
  echo "== venv"
  python3 -m venv .venv
fi
PIP=".venv/bin/pip --disable-pip-version-check -q"
echo "== pip: torch 2.13.0 (CPU) and build tools"
$PIP install "torch==2.13.0" "scikit-build-core>=0.10" ninja
echo "== build: ddpkit (C++ extension, editable)"
$PIP install --no-build-isolation -e ".[test,report]"
.venv/bin/python -c "import ddpkit, torch; print('ddpkit ready: torch', torch.__version__)"
