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
torch.set_num_threads(1 if rank_threads else max(1, min(2, torch.get_num_threads())))


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)
    yield
