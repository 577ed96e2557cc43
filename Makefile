# The two commands a fresh machine needs (see README.md):
#   make demo   # a real Muon training run on CPU: GPT, TP=2 x DP=2, DistributedOptimizer, 4 ranks
#   make test   # the test suite
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: install fork demo test lint check-patches bench pr

install:
	@tools/bootstrap.sh

fork: install  # after editing patches/ or adding a file under megatron/
	@$(PY) tools/fork.py assemble

demo: install
	@bash examples/cpu_quickstart.sh

test: install
	@$(PY) -m pytest -q $(PYTEST_ARGS)

lint: install
	@$(PY) -m ruff check . && $(PY) -m ruff format --check .

check-patches: install
	@$(PY) tools/fork.py check

bench: install  # quick benchmarks, one table of ratios (< 5 min on 2 cores); see bench/README.md
	@$(PY) -m pip install --quiet --no-deps -r requirements/bench.txt
	@$(PY) bench/run_all.py --quick

pr: install  # our megatron.core changes as a git format-patch series for Megatron-LM (build/pr)
	@$(PY) tools/make_pr.py $(PR_OUT)
