"""Newton-Schulz's Gram form (``form='gram'``/``'auto'``): as accurate as the standard form
against the float64 SVD polar factor, the same polynomial, and the FLOP rule ``'auto'`` uses.

Metric: ``err = ||NS_5(X) - U V^T||_F / ||U V^T||_F`` against the float64 SVD polar factor. Five
steps of a coefficient set do not reach ``U V^T`` even in exact arithmetic (singular values end
in a band around 1, small ones below it), so each case is judged by its *excess* over the same
polynomial run in float64 (``err - err_exact``): what rounding adds. One bound per precision,
met by today's standard form and asked of the Gram form (``EXCESS``).
"""

import functools

import pytest
import torch

from megatron.core.optimizer.megatron_muon.newton_schulz import (
    GRAM_MAX_SHARE,
    _gram_iterate,
    _normalized,
    coefficient_set,
    gram_flops,
    newton_schulz,
    ns_flops,
    standard_flops,
    uses_gram,
)

# Scaled-down 8B aspect ratios (K/V 1024 x 4096 -> 256 x 1024, fc2 4096 x 14336 -> 256 x 1792,
# fc1 at 4x, a square Q/O), one tall.
SHAPES = [(256, 1024), (256, 1792), (128, 512), (512, 512), (512, 128)]
SPECTRA = ["randn", "power", "exp", "lowrank"]
SETS = ["quintic", "simple"]
# Rounding's excess over the float64 iteration that both forms must stay under. Measured
# (bench/README.md, "Gram form"; the same to 2 digits under ATEN_CPU_CAPABILITY=default) on
# these 80 cases, largest excess of each form:
#   'highest' (fp32): standard 2.2e-7, Gram 4.2e-6 (its m x m steps square the condition number:
#     ~100 fp32 ulps); bound 1e-4, 24x the Gram form's worst, still far under a wrong step.
#   'medium' (bf16): standard 8.6e-3, Gram 1.06e-2 (both 128 x 512 or 512 x 128, power-law
#     spectrum, quintic: small singular values where the polynomials' slope, up to ~4 per step,
#     amplifies bf16's 2^-9 rounding); bound 2e-2, 1.9x the Gram form's worst. The Gram form
#     with bf16 m x m steps is off by 1 to 1e5 (the negative control).
EXCESS = {"highest": 1e-4, "medium": 2e-2}


def _matrix(m, n, spectrum, seed=0):
    """A random m x n matrix: Gaussian, or ``U diag(s) V^T`` with a decaying spectrum as
    momentum-averaged gradients have (power law 1/i, exponential, rank 8 over a 1e-3 floor)."""
    g = torch.Generator().manual_seed(seed)
    if spectrum == "randn":
        return torch.randn(m, n, generator=g)
    k = min(m, n)
    u, _ = torch.linalg.qr(torch.randn(m, k, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(n, k, generator=g, dtype=torch.float64))
    i = torch.arange(1, k + 1, dtype=torch.float64)
    s = {
        "power": 1 / i,
        "exp": torch.exp(-i / (k / 8)),
        "lowrank": torch.where(i <= 8, 1.0, 1e-3),
    }[spectrum]
    s = s * (1 + 0.1 * torch.rand(k, generator=g, dtype=torch.float64))
    return ((u * s) @ v.mT).float()


@functools.cache
def _case(shape, spectrum):
    x = _matrix(*shape, spectrum)
    u, _, vh = torch.linalg.svd(x.double(), full_matrices=False)
    return x, u @ vh


def _exact_ns(x, name, steps=5):
    """The standard iteration in float64 (no fused ops)."""
    X = x.double()
    tall = X.shape[-2] > X.shape[-1]
    X = X.mT if tall else X
    X = X / X.norm()
    for a, b, c in coefficient_set(name).schedule(steps):
        A = X @ X.mT
        X = a * X + b * (A @ X) + c * (A @ (A @ X))
    return X.mT if tall else X


@functools.cache
def _exact_err(shape, spectrum, name):
    x, polar = _case(shape, spectrum)
    return _err(_exact_ns(x, name), polar)


def _err(got, polar):
    return ((got.double() - polar).norm() / polar.norm()).item()


def excess(shape, spectrum, name, precision, form):
    """Rounding's excess over the float64 iteration, ``err - err_exact``."""
    x, polar = _case(shape, spectrum)
    got = newton_schulz(x, 5, name, precision, form=form)
    return _err(got, polar) - _exact_err(shape, spectrum, name)


@pytest.mark.parametrize("precision", ["highest", "medium"])
@pytest.mark.parametrize("name", SETS)
@pytest.mark.parametrize("spectrum", SPECTRA)
@pytest.mark.parametrize("shape", SHAPES)
def test_gram_within_the_standard_forms_bound(shape, spectrum, name, precision):
    bound = EXCESS[precision]
    assert excess(shape, spectrum, name, precision, "standard") <= bound  # today's form
    assert excess(shape, spectrum, name, precision, "gram") <= bound


@pytest.mark.parametrize("spectrum", ["power", "lowrank"])
def test_gram_without_fp32_steps_exceeds_it(spectrum):
    """Negative control: the Gram form with ``A_0`` and the m x m steps in bf16 (no fp32
    safeguard) is off by more than the bound, by orders of magnitude (measured 1.2e4, 2.0e3)."""
    shape, name = (128, 512), "quintic"
    x, polar = _case(shape, spectrum)
    xn = _normalized(x, torch.bfloat16, 1e-7)
    got = _gram_iterate(xn, coefficient_set(name).schedule(5), tall=False, inner=torch.bfloat16)
    assert _err(got, polar) - _exact_err(shape, spectrum, name) > 10 * EXCESS["medium"]


@pytest.mark.parametrize("steps", [1, 2, 5, 11])
@pytest.mark.parametrize("shape", [(48, 160), (160, 48), (64, 64), (3, 24, 40), (2, 40, 24)])
def test_gram_is_the_same_polynomial(shape, steps):
    """fp32 Gram form against the float64 standard iteration, entrywise: the same numbers up to
    fp32 rounding in the squared condition number. Measured on these Gaussian inputs, under
    ATEN_CPU_CAPABILITY default / avx2 / avx512, 1 and 2 threads: <= 2.2e-6 on rectangles (the
    standard form: <= 2.5e-6); on the 64 x 64 square at 11 steps 4.6e-5 (avx2, avx512) and
    1.01e-4 (default: another summation order), its smallest singular value ~1e-3 of the
    largest, squared in A_0 (the standard form 1.4e-6). Bounds 5e-6 and 5e-4: >= 2x and 5x the
    worst measured, and entries are ~0.1, which a wrong coefficient moves by > 1e-2."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    got = newton_schulz(x, steps, "quintic", "highest", form="gram")
    want = torch.stack([_exact_ns(m, "quintic", steps) for m in x.reshape(-1, *shape[-2:])])
    atol = 5e-4 if shape[-1] == shape[-2] else 5e-6
    torch.testing.assert_close(got.double(), want.reshape(shape), rtol=0, atol=atol)
    assert got.dtype == x.dtype and got.shape == x.shape


def test_tall_is_transpose_of_wide_and_input_untouched():
    x = torch.randn(40, 100, generator=torch.Generator().manual_seed(2))
    before = x.clone()
    wide = newton_schulz(x, form="gram", precision="highest")
    tall = newton_schulz(x.T.contiguous(), form="gram", precision="highest")
    torch.testing.assert_close(tall, wide.T, rtol=0, atol=1e-6)
    assert torch.equal(x, before)


def test_auto_takes_gram_where_it_saves_a_quarter():
    # k = 5, units of m^3: Gram 3.5 r + 25.5, standard 20 r + 10 (r = n / m): a quarter saved
    # from r = (25.5 - 7.5) / (15 - 3.5) = 1.565.
    assert gram_flops(100, 157, 5) <= GRAM_MAX_SHARE * standard_flops(100, 157, 5)
    assert gram_flops(100, 156, 5) > GRAM_MAX_SHARE * standard_flops(100, 156, 5)
    assert uses_gram(100, 157, 5, "auto") and uses_gram(157, 100, 5, "auto")
    assert not uses_gram(100, 156, 5, "auto") and not uses_gram(512, 512, 5, "auto")
    assert uses_gram(512, 512, 5, "gram") and not uses_gram(100, 1000, 5, "standard")
    assert ns_flops(1024, 4096, 5, "auto") == 3.5 * 1024**2 * 4096 + 17 * 1.5 * 1024**3
    assert ns_flops(1024, 4096, 5) == 5 * (4 * 1024**2 * 4096 + 2 * 1024**3)  # default standard
    assert gram_flops(8, 8, 1) == 3.5 * 8**3 + 1.5 * 8**3  # k = 1: A0, A0^2, Q_1 X0


def test_auto_runs_what_it_counts():
    x = torch.randn(32, 256, generator=torch.Generator().manual_seed(3))
    gram = newton_schulz(x, precision="highest", form="gram")
    assert torch.equal(newton_schulz(x, precision="highest", form="auto"), gram)
    square = torch.randn(64, 64)
    assert torch.equal(
        newton_schulz(square, precision="highest", form="auto"),
        newton_schulz(square, precision="highest"),
    )


def test_unknown_form_raises():
    with pytest.raises(ValueError, match="form 'fast'.*allowed"):
        newton_schulz(torch.randn(4, 8), form="fast")


def test_planner_counts_the_form_that_runs():
    """The DistOpt planner's cost of a whole matrix is what ``newton_schulz`` runs on it: the
    Gram form's count where ``'auto'`` takes it, per Q/K/V block; sharded forms stay standard."""
    from megatron.core.optimizer.megatron_muon.functional import LocalOrthogonalizer, MuonParamInfo
    from megatron.core.optimizer.megatron_muon.planner.plan import ns_cost, tp_ns_cost
    from megatron.core.optimizer.megatron_muon.planner.plan import ns_cost_model as cost_model

    wide, square = MuonParamInfo((1024, 4096)), MuonParamInfo((512, 512))
    assert ns_cost(wide, 5, "auto") == gram_flops(1024, 4096, 5) < ns_cost(wide, 5)
    assert ns_cost(square, 5, "auto") == ns_cost(square, 5) == standard_flops(512, 512, 5)
    qkv = MuonParamInfo((8 * 48, 256), qkv_split=(32, 8, 8))  # 8 groups: Q 256, K/V 64 rows
    blocks = gram_flops(256, 256, 5) if uses_gram(256, 256, 5, "auto") else ns_flops(256, 256, 5)
    assert ns_cost(qkv, 5, "auto") == blocks + 2 * gram_flops(64, 256, 5)
    assert cost_model(LocalOrthogonalizer(), 5, form="auto").whole(wide) == ns_cost(wide, 5, "auto")
    assert cost_model(LocalOrthogonalizer(), 5).whole(wide) == ns_cost(wide, 5)  # default
    wide.__dict__["partition_dim"] = 0  # a TP-sharded param's info carries its dimension
    dist = tp_ns_cost(wide, 5, "distributed", 2, "auto")
    assert dist == tp_ns_cost(wide, 5, "distributed", 2)  # sharded steps: standard
    block = MuonParamInfo((512, 4096))
    assert tp_ns_cost(wide, 5, "blockwise", 2, "auto") == ns_cost(block, 5, "auto")


def test_muon_step_runs_the_gram_form():
    """``Muon(ns_form='auto')``: the wide matrix and each Q/K/V block in the Gram form, the
    square one in the standard steps (``uses_gram``), scaled as ever."""
    from megatron.core.optimizer.megatron_muon.functional import MuonParamInfo
    from megatron.core.optimizer.megatron_muon.optimizer import Muon

    g = torch.Generator().manual_seed(4)
    wide, square = torch.zeros(16, 64), torch.zeros(32, 32)
    qkv = torch.zeros(2 * 24, 128)  # 2 groups of Q 16, K 4, V 4 rows
    params = [torch.nn.Parameter(p) for p in (wide, square, qkv)]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    info = {params[2]: MuonParamInfo((48, 128), qkv_split=(16, 4, 4))}
    opt = Muon(params, lr=1.0, weight_decay=0.0, ns_precision="highest", ns_form="auto",
               momentum=0.0, param_info=info)  # fmt: skip
    opt.step()

    def ns(x, form):
        return newton_schulz(x, 5, "quintic", "highest", form=form) * max(x.shape) ** 0.5

    torch.testing.assert_close(params[0].data, -ns(params[0].grad, "gram"), rtol=0, atol=0)
    torch.testing.assert_close(params[1].data, -ns(params[1].grad, "standard"), rtol=0, atol=0)
    grad = params[2].grad.view(2, 24, 128)
    for lo, hi in ((0, 16), (16, 20), (20, 24)):
        want = -ns(grad[:, lo:hi].reshape(-1, 128), "gram").view(2, hi - lo, 128)
        # K and V run batched in the step (one stacked call), here one by one: BLAS blocks the
        # products differently, a few fp32 ulps on entries ~1 (measured 4.3e-6)
        got = params[2].data.view(2, 24, 128)[:, lo:hi]
        torch.testing.assert_close(got, want, atol=2e-5, rtol=0)


def test_8b_layer_counts_half_the_flops():
    """bench/README.md's table: a Llama-3-8B layer's NS FLOPs, standard vs 'auto' (<= 0.7)."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
    from bench_newton_schulz import LLAMA_8B

    from megatron.core.optimizer.megatron_muon.planner.plan import ns_cost

    std = sum(ns_cost(info, 5) for info in LLAMA_8B.values())
    auto = sum(ns_cost(info, 5, "auto") for info in LLAMA_8B.values())
    h, f = 4096, 28672  # fc1: 2 x 14336 rows (SwiGLU), one matrix
    assert ns_cost(LLAMA_8B["fc1"], 5) == 5 * (4 * h * h * f + 2 * h**3)
    assert ns_cost(LLAMA_8B["fc1"], 5, "auto") == 3.5 * h * h * f + 17 * 1.5 * h**3
    assert round(auto / std, 3) == 0.509


class _MatmulFlops(torch.overrides.TorchFunctionMode):
    """Counts 2 m k n per matmul (fused ``addmm``/``baddbmm`` by their product)."""

    OPS = {torch.matmul, torch.mm, torch.bmm, torch.Tensor.matmul, torch.Tensor.__matmul__}
    FMA = {torch.addmm, torch.baddbmm, torch.Tensor.addmm, torch.Tensor.baddbmm}

    def __init__(self):
        super().__init__()
        self.flops = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.OPS or func in self.FMA:
            a, b = args[1:3] if func in self.FMA else args[:2]
            self.flops += 2 * a.shape[:-1].numel() * a.shape[-1] * b.shape[-1]
        return func(*args, **kwargs or {})


@pytest.mark.parametrize("steps", [1, 2, 5])
@pytest.mark.parametrize("shape", [(16, 40), (40, 16), (15, 41), (3, 9, 20), (24, 24)])
def test_flop_counts_are_what_runs(shape, steps):
    batch = shape[0] if len(shape) == 3 else 1
    for form, count in (("standard", standard_flops), ("gram", gram_flops)):
        with _MatmulFlops() as counter:
            newton_schulz(torch.randn(shape), steps, "quintic", "highest", form=form)
        assert counter.flops == batch * count(*shape[-2:], steps), form
