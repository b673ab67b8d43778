# The README's first two commands: `make main` runs the main job, `make test` the whole test suite.
# Both set everything up first (scripts/setup.sh is idempotent).
PY := .venv/bin/python

.PHONY: setup main test

setup:
	bash scripts/setup.sh

main: setup
	$(PY) benchmarks/bench_training.py

test: setup
	$(PY) -m pytest -q
