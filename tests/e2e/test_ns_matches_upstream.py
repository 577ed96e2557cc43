"""Where our Muon and upstream's share a setting, they compute the same numbers: our
Newton-Schulz against emerging_optimizers' ``muon_utils.newton_schulz`` step by step, and three
steps of our ``Muon`` against upstream megatron-core 0.19's ``TensorParallelMuon``.

    .venv/bin/python -m pytest -q tests/e2e/test_ns_matches_upstream.py
"""

import pytest
import torch
from emerging_optimizers.orthogonalized_optimizers import muon_utils

from megatron.core.optimizer.megatron_muon.newton_schulz import COEFFICIENT_SETS, newton_schulz
from megatron.core.optimizer.megatron_muon.optimizer import Muon

SETS = sorted(COEFFICIENT_SETS)
SHAPES = [(48, 80), (80, 48), (64, 64), (3, 24, 40)]  # wide, tall, square, batched
# fp32 rounding (6e-8) grown by up to 11 steps of slope <= ~8.5: the matmuls differ only in order
# (our tall inputs iterate on X^T X in place, upstream transposes); measured <= 2.5e-6 (quintic;
# 1.1e-6 CANS), bound 1e-5.


def _randn(shape, seed=0, norm=None):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    return x if norm is None else x * (norm / x.norm())


def _upstream_ns(x, steps, name, precision):
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        return muon_utils.newton_schulz(x, steps, name)
    finally:
        torch.set_float32_matmul_precision(before)


def test_upstream_names_the_same_sets():
    assert set(SETS) == set(muon_utils._COEFFICIENT_SETS)


@pytest.mark.parametrize("name", SETS)
@pytest.mark.parametrize("shape", SHAPES)
def test_fp32_matches_upstream_step_by_step(shape, name):
    x = _randn(shape)
    for steps in range(1, 12):  # past every set's end: cycled or repeated as upstream
        want = _upstream_ns(x, steps, name, "highest")
        got = newton_schulz(x, steps, name, "highest")
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5, msg=str(steps))


@pytest.mark.parametrize("norm", [4e-5, 1e-7, 5e-8])
def test_tiny_inputs_match_upstream(norm):
    """X / max(||X||_F, eps): at and below eps = 1e-7 both divide by eps."""
    x = _randn((32, 48), norm=norm)
    want = _upstream_ns(x, 5, "quintic", "highest")
    torch.testing.assert_close(newton_schulz(x, 5, "quintic", "highest"), want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", ["quintic", "simple", "polar_express"])
@pytest.mark.parametrize("shape", [(48, 80), (3, 24, 40)])
def test_medium_matches_upstream(shape, name):
    """'medium': bf16 matmuls on both sides; upstream normalizes in fp32 before the cast, ours
    casts first (newton_schulz._normalized: what keeps the DistOpt bf16 exchange exact), so X_0
    differs by one bf16 rounding, which 5 bf16 steps carry to ~10 bf16 ulps of the output's
    entries (|O| <= ~0.5): measured <= 2.3e-2 over 8 seeds on these shapes; 5e-2 bounds it."""
    x = _randn(shape)
    want = _upstream_ns(x, 5, name, "medium")
    torch.testing.assert_close(newton_schulz(x, 5, name, "medium"), want, rtol=0, atol=5e-2)


# ------------------------------------------------------------------------- the optimizers
SETTINGS = [
    dict(momentum=0.95, nesterov=True, scale_mode="spectral", coefficient_type="quintic", steps=5),
    dict(momentum=0.9, nesterov=False, scale_mode="shape_scaling", coefficient_type="aol", steps=6),
    dict(
        momentum=0.8,
        nesterov=True,
        scale_mode="unit_rms_norm",
        coefficient_type="polar_express",
        steps=7,
    ),
    dict(momentum=0.95, nesterov=True, scale_mode="spectral", coefficient_type="quintic", steps=6),
]


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in [(32, 64), (64, 32), (40, 40)]]


def _three_steps(opt, params, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()


@pytest.mark.parametrize("s", SETTINGS, ids=lambda s: "-".join(str(v) for v in s.values()))
def test_three_steps_match_upstreams_tensor_parallel_muon(s):
    """Upstream's momentum is an EMA ((1 - mu) times ours): Newton-Schulz is scale invariant
    (the inputs are far above eps), so the updates agree to fp32 rounding of NS grown over 3
    steps: measured <= 1e-6 on |W| ~ 1-3 with lr 0.02; bound 1e-5."""
    from megatron.core.optimizer.emerging_optimizers import TensorParallelMuon

    ours, theirs = _params(), _params()
    kw = dict(lr=0.02, weight_decay=0.1)
    ref = TensorParallelMuon(
        theirs,
        momentum=s["momentum"],
        nesterov=s["nesterov"],
        fp32_matmul_prec="highest",
        coefficient_type=s["coefficient_type"],
        num_ns_steps=s["steps"],
        scale_mode=s["scale_mode"],
        **kw,
    )
    opt = Muon(
        ours,
        momentum=s["momentum"],
        nesterov=s["nesterov"],
        ns_precision="highest",
        ns_coefficients=s["coefficient_type"],
        ns_steps=s["steps"],
        scale_mode=s["scale_mode"],
        **kw,
    )
    _three_steps(ref, theirs)
    _three_steps(opt, ours)
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-5)
