# The two commands a fresh machine needs (see README.md):
#   make demo   # a real Muon training run on CPU: GPT, TP=2 x DP=2, DistributedOptimizer, 4 ranks
#   make test   # the test suite (`make check` first: the meta tests alone)
# The fork: megatron-core 0.19.2 (its megatron/core and Megatron-LM's megatron/training) from the
# pinned archive, patched (patches/), our files linked in (tools/fork.py), in .venv (Python 3.12).
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: install fork demo test check lint check-patches bench pr docs

install:
	@VENV=$(VENV) tools/bootstrap.sh

fork: install  # after editing patches/ or adding a file under megatron/
	@$(PY) tools/fork.py assemble

demo: install
	@PYTHON=$(PY) bash examples/cpu_quickstart.sh

# Two stages. `make check`: the meta tests (tests/meta: documentation, docstrings, examples, lint,
# import layering, the fork build and `make pr`), quick, stopping at the first failure. Then the
# suite (TESTS: unit tests of the math, distributed parity runs, end-to-end launches).
# Two pytest workers, a test file each (module-scoped runs stay shared): ~2x on 2 cores; more
# workers would run several multi-rank launches at once (memory). TEST_WORKERS=0: one process.
# Workers take whole files in the order pytest-xdist's loadfile sets (3.x: most tests first, so
# the one- and two-test e2e files come last); measured, the two workers end within ~15 s.
TEST_WORKERS ?= 2
TESTS ?= tests/e2e tests/distributed tests/unit
test: check
	@$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(TESTS) $(PYTEST_ARGS)

check: install
	@$(PY) -m pytest -q -x -n $(TEST_WORKERS) --dist loadfile tests/meta

lint: install
	@$(PY) -m ruff check . && $(PY) -m ruff format --check .

check-patches: install
	@$(PY) tools/fork.py check

bench: install  # quick benchmarks, one table of ratios (< 5 min on 2 cores); see bench/README.md
	@$(PY) -m pip install --quiet --no-deps -r requirements/bench.txt
	@$(PY) bench/run_all.py --quick

pr: install  # our changes as a git format-patch series for Megatron-LM (build/pr, checked)
	@$(PY) tools/make_pr.py $(PR_OUT)

docs:  # docs/package.md, the package drawn from its imports (standard library only, no install)
	@python3 tools/package_map.py
