# The README's first two commands: `make main` runs the main job, `make test` the whole test suite.
# Both set everything up first (scripts/setup.sh is idempotent).
# `make main` trains ddpkit's and torch's pipelines side by side on Fashion-MNIST, short (3 epochs on
# 30000 samples, under 10 minutes on 2 cores), into runs/main/ (training.json, training.png); the
# full-length comparison the report shows (about 35 minutes) is `.venv/bin/python benchmarks/bench_training.py --full`.
PY := .venv/bin/python

.PHONY: setup main test

setup:
	bash scripts/setup.sh

main: setup
	$(PY) benchmarks/bench_training.py

test: setup
	$(PY) -m pytest -q
