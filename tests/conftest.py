"""Test-wide setup: CPU mode for the test process, quiet upstream warnings, shared fixtures."""

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
torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)
    yield
