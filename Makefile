# The README's first two commands: `make main` runs the main job, `make test` the whole test suite.
# Both set everything up first (scripts/setup.sh is idempotent).
PY := .venv/bin/python
NPROC ?= 2

.PHONY: setup main test

setup:
	bash scripts/setup.sh

main: setup
	$(PY) benchmarks/bench_allreduce.py --quick --output allreduce_demo

test: setup
	$(PY) -m pytest -q
