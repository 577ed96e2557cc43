"""tools/gpu_check.py's numeric checks run here on CPU (``--device cpu``), so the script a lent GPU
runs does not rot between loans; the training check is the e2e tests' business.

    .venv/bin/python -m pytest -q tests/unit/test_gpu_check.py
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import gpu_check  # noqa: E402

CHECKS = [
    gpu_check.check_newton_schulz,
    gpu_check.check_sharded_newton_schulz,
    gpu_check.check_packed_gram,
]


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_check_passes_on_cpu(check):
    assert check("cpu").startswith(("NS", "sharded NS", "pack"))


def test_lockstep_serves_the_gathers_a_negative_control_drops():
    """Without the GATHER's rows from the other shards (left unfilled, whatever the memory held)
    the sharded NS misses the whole one."""
    import torch

    from megatron.core.optimizer.megatron_muon.newton_schulz import (
        newton_schulz,
        sharded_newton_schulz_steps,
    )

    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    ref = newton_schulz(x, precision="highest")

    def run(driver):
        shards = x.tensor_split(2, dim=1)
        steps = [
            sharded_newton_schulz_steps(s, 1, precision="highest", part=(p, 2))
            for p, s in enumerate(shards)
        ]
        return torch.cat(driver(steps), dim=1)

    torch.testing.assert_close(run(gpu_check._lockstep), ref, rtol=0, atol=1e-5)
    sums_only = lambda steps: gpu_check._lockstep(steps, gather=False)  # noqa: E731
    assert not torch.allclose(run(sums_only), ref, rtol=0, atol=1e-2)  # NaN or far
