# The two commands a fresh machine needs (see README.md):
#   make demo   # a real Muon training run on CPU: GPT, TP=2 x DP=2, DistributedOptimizer, 4 ranks
#   make test   # the test suite
# make install BASE=0.19.2: the staged next megatron-core base (.venv-0.19.2, build/fork-0.19.2;
# see tools/fork.py); the default is 0.16.1 (.venv, build/fork). Only a command-line BASE counts.
ifneq ($(origin BASE),command line)
BASE := 0.16.1
endif
ifeq ($(BASE),0.16.1)
VENV ?= .venv
else
VENV ?= .venv-$(BASE)
endif
PY := $(VENV)/bin/python
ENV := MEGATRON_MUON_BASE=$(BASE)

.PHONY: install fork demo test test-next lint check-patches bench pr

install:
	@$(ENV) VENV=$(VENV) tools/bootstrap.sh

fork: install  # after editing patches/ or adding a file under megatron/
	@$(ENV) $(PY) tools/fork.py assemble

demo: install  # upstream's loop: needs base 0.19.2 (`make demo BASE=0.19.2` while it is staged)
	@PYTHON=$(PY) bash examples/cpu_quickstart.sh

test: install  # base 0.16.1's suite, then the staged 0.19.2's (test-next)
	@MEGATRON_MUON_BASE=0.19.2 $(PY) tools/fork.py fetch  # for test_fork_build (2 MB, hashed)
	@$(PY) -m pytest -q $(PYTEST_ARGS)
	@$(MAKE) --no-print-directory test-next

test-next:  # the staged base's suite (tests/conftest.py: e2e_next and the megatron/core tests)
	@# -P: the repository's megatron/ (our 0.16.1 loop) would shadow the installed package
	@$(MAKE) --no-print-directory install BASE=0.19.2
	@.venv-0.19.2/bin/python -P -m pytest -q $(PYTEST_NEXT_ARGS)

lint: install
	@$(PY) -m ruff check . && $(PY) -m ruff format --check .

check-patches: install
	@$(PY) tools/fork.py check
	@MEGATRON_MUON_BASE=0.19.2 $(PY) tools/fork.py fetch
	@MEGATRON_MUON_BASE=0.19.2 $(PY) tools/fork.py check

bench: install  # quick benchmarks, one table of ratios (< 5 min on 2 cores); see bench/README.md
	@$(PY) -m pip install --quiet --no-deps -r requirements/bench.txt
	@$(PY) bench/run_all.py --quick

pr: install  # our changes as a git format-patch series for Megatron-LM (build/pr[-BASE], checked)
	@$(ENV) $(PY) tools/make_pr.py $(PR_OUT)
