"""Newton-Schulz against frozen values of upstream's: megatron-core 0.19.2's
``emerging_optimizers`` 0.3 ``muon_utils.newton_schulz`` (fp32, ``set_float32_matmul_precision
('highest')``, CPU), run once on the inputs below; each case keeps six numbers of the 8 x 12 (or
12 x 8) result: its Frobenius norm, entries [0, 0], [3, 7], [-1, -1], its smallest and largest
singular value. The cases cover each coefficient set, the steps past a set's end (quintic and
AOL start again, Polar Express, CANS and DeepSeek-V4 repeat their last triple) and inputs whose
norm is near or below eps (X / max(||X||_F, eps)). tests/e2e/test_ns_matches_upstream.py
compares with upstream itself where it is installed.
"""

import pytest
import torch

from megatron.core.optimizer.megatron_muon.newton_schulz import newton_schulz

# (coefficient set, steps, shape, input norm (None: as drawn))
CASES = {
    "simple5": ("simple", 5, (8, 12), None),
    "quintic5": ("quintic", 5, (8, 12), None),
    "quintic6": ("quintic", 6, (8, 12), None),
    "quintic7": ("quintic", 7, (8, 12), None),
    "quintic7_tall": ("quintic", 7, (12, 8), None),
    "polar_express5": ("polar_express", 5, (8, 12), None),
    "polar_express9": ("polar_express", 9, (8, 12), None),
    "cans7": ("cans", 7, (8, 12), None),
    "aol5": ("aol", 5, (8, 12), None),
    "deepseekv4_11": ("deepseekv4", 11, (8, 12), None),
    "tiny4e-5": ("quintic", 5, (8, 12), 4e-5),
    "below_eps": ("quintic", 5, (8, 12), 5e-8),
}

# Upstream's results (norm, [0, 0], [3, 7], [-1, -1], sigma_min, sigma_max), computed once.
UPSTREAM = {
    "simple5": (
        2.59640617e00,
        -4.58402157e-01,
        -2.33136982e-01,
        2.16508508e-01,
        6.82288625e-01,
        1.13428287e00,
    ),
    "quintic5": (
        2.82497112e00,
        -4.45016086e-01,
        -2.39370197e-01,
        1.55324966e-01,
        9.80368272e-01,
        1.01882643e00,
    ),
    "quintic6": (
        3.50082147e-01,
        -4.15306091e-02,
        -3.44387889e-02,
        1.57263279e-02,
        8.34189917e-02,
        1.58898679e-01,
    ),
    "quintic7": (
        1.34420738e00,
        -1.62027925e-01,
        -1.32173821e-01,
        6.13946915e-02,
        3.25898622e-01,
        6.02709192e-01,
    ),
    "quintic7_tall": (
        1.45333688e00,
        -2.58222014e-01,
        -7.21511617e-03,
        3.93718965e-02,
        3.71155074e-01,
        6.21138666e-01,
    ),
    "polar_express5": (
        2.79796560e00,
        -4.48933423e-01,
        -2.39267603e-01,
        1.29144490e-01,
        8.79881089e-01,
        1.12027074e00,
    ),
    "polar_express9": (
        2.82842708e00,
        -4.39697772e-01,
        -2.42548123e-01,
        1.54220417e-01,
        9.99999918e-01,
        1.00000009e00,
    ),
    "cans7": (
        2.92218979e00,
        -4.52341318e-01,
        -2.46158808e-01,
        1.66429400e-01,
        9.88160504e-01,
        1.05984974e00,
    ),
    "aol5": (
        1.64719631e00,
        2.51559377e-01,
        1.51388943e-01,
        -1.02984428e-01,
        5.24409697e-01,
        6.24886344e-01,
    ),
    "deepseekv4_11": (
        2.82842712e00,
        -4.39697385e-01,
        -2.42548406e-01,
        1.54220283e-01,
        9.99999855e-01,
        1.00000020e00,
    ),
    "tiny4e-5": (
        2.82497087e00,
        -4.45016146e-01,
        -2.39370048e-01,
        1.55324906e-01,
        9.80368199e-01,
        1.01882594e00,
    ),
    "below_eps": (
        2.80147242e00,
        -4.33826268e-01,
        -2.45080620e-01,
        1.50330126e-01,
        9.78124765e-01,
        1.02067456e00,
    ),
}


def _input(shape, norm):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    return x if norm is None else x * (norm / x.norm())


def _summary(y):
    y = y.double()
    sv = torch.linalg.svdvals(y)
    return torch.tensor([y.norm(), y[0, 0], y[3, 7], y[-1, -1], sv.min(), sv.max()]).double()


@pytest.mark.parametrize("case", list(CASES))
def test_matches_upstreams_frozen_values(case):
    name, steps, shape, norm = CASES[case]
    got = _summary(newton_schulz(_input(shape, norm), steps, name, "highest"))
    # Same triples and order of steps; the matmuls differ only in their order of operations
    # (our tall inputs iterate on X^T X in place, upstream transposes), so the results differ by
    # fp32 rounding (6e-8) grown by up to 7 steps of slope <= ~8: measured <= 1.8e-6 (the tall
    # case; 4e-9 otherwise). 1e-5 catches any other triple or order (the old quintic at 6 steps
    # was 2.4 off, the old Polar Express 4e-2, the old eps rule 1e-3 at ||X|| = 4e-5).
    torch.testing.assert_close(got, torch.tensor(UPSTREAM[case]).double(), rtol=0, atol=1e-5)
