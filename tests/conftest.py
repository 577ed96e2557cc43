"""Test-wide setup: CPU mode for the test process, quiet upstream warnings, shared fixtures."""

import os
import warnings

import pytest

warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
warnings.filterwarnings("ignore", message=".*Apex.*")

# torch.optim imports torch._dynamo when the first optimizer is built (~0.8 s of CPU): once here,
# not in every rank that harness.run_distributed forks (a test's ranks each built one)
import torch  # noqa: E402
import torch._dynamo  # noqa: E402,F401

from megatron.training import cpu_mode  # noqa: E402

cpu_mode.enable_if_needed()
# With TEST_RANK_THREADS (tools/parity_margins.py) forked ranks run OpenMP pools of their own: a
# parent that never started one lets them (libgomp's workers do not survive a fork; a rank that
# used the parent's pool hung)
rank_threads = os.environ.get("TEST_RANK_THREADS", "1") != "1"
# pytest-xdist's workers share the cores: more OpenMP threads than cores, and OpenMP's barriers
# spin (measured: 4 threads of 2 workers on 2 cores took 2.2x the wall time of 2 threads)
workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
usable = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
cores = max(1, len(usable) // workers)
torch.set_num_threads(1 if rank_threads else max(1, min(2, cores, torch.get_num_threads())))


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)
    yield
