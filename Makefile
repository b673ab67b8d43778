# The README's first two commands: `make main` runs the main job, `make test` the whole test suite.
# Both set everything up first (scripts/setup.sh is idempotent: the first time it installs torch and
# builds the extension, later it only rebuilds what changed).
# `make main` trains ddpkit's and torch's pipelines side by side on Fashion-MNIST, short (3 epochs on
# 30000 samples), into runs/main/ (training.json, training.png); `make main MAIN_ARGS="--shard gradients"`
# adds ddpkit's pipeline with ZeRO-2 (bench_training.py's --shard); the full-length comparison the report
# shows is `.venv/bin/python benchmarks/bench_training.py --full` (about 35 minutes on 2 cores).
PY := .venv/bin/python

.PHONY: setup main test test-full report

# `make setup` and `make test` install the test, report and ray extras too (pytest, jupyter's kernel,
# Ray Train); `make main` needs only matplotlib for its plot.
setup:
	bash scripts/setup.sh test,report,ray

main:
	bash scripts/setup.sh plot
	@echo "== main: ddpkit's and torch's training pipelines side by side (benchmarks/bench_training.py)"
	$(PY) benchmarks/bench_training.py $(MAIN_ARGS)

# The suite runs in two pytest-xdist workers, a test file each at a time (--dist loadfile: a file's pools
# and simulated hosts are made once): much of its time is waiting (process start-up, rendezvous, the
# timeouts under test), which the other worker fills. Each worker keeps its own session pools, whose ranks
# return a task's memory after it (ddpkit.testing), so two sets fit a small machine. xdist's own order
# (files with the most tests first) mixes the long multi-process files with quick ones; the longest
# first was slower here, both workers then running many ranks each on the two cores at once.
# The report notebook in a browser: Jupyter Notebook (the jupyter extra, installed here the first time) opens
# notebooks/report.ipynb, whose kernel starts in notebooks/ as every Jupyter front end's does. Jupyter refuses
# to serve as root unless told to (CI machines and containers run as root).
report:
	bash scripts/setup.sh report,jupyter
	.venv/bin/jupyter notebook notebooks/report.ipynb $(if $(filter 0,$(shell id -u)),--allow-root)

# `make test` (what CI runs) leaves out the tests marked slow (pyproject.toml's markers): further
# variants of what an unmarked test already checks. `make test-full` runs every test.
test: setup
	@echo "== test: ruff's rules and format (pyproject.toml's [tool.ruff]), clang-format (.clang-format), then the suite but its slow variants in 2 workers (what CI runs)"
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	git ls-files 'csrc/*.cpp' 'csrc/*.h' 'csrc/*.cu' 'csrc/*.cuh' | xargs .venv/bin/clang-format --dry-run --Werror
	$(PY) -m pytest -q -n 2 --dist loadfile -m "not slow" --durations=30

test-full: setup
	@echo "== test-full: the whole suite, its slow variants too, in 2 workers"
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=30
