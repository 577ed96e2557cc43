"""Muon in megatron.core, single process: defaults, Newton-Schulz, the optimizer, QKV split.

In upstream's tests/unit_tests form: no process groups, runs on a GPU when there is one (as
upstream's CI runs it) and on the CPU otherwise (our CI).
"""

import pytest
import torch

from megatron.core.optimizer import OptimizerConfig
from megatron.core.optimizer.megatron_muon.functional import OrthoSpec, orthogonalize_matrices
from megatron.core.optimizer.megatron_muon.newton_schulz import newton_schulz
from megatron.core.optimizer.muon import Muon, MuonParamInfo, TensorParallelMuon

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _randn(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(DEVICE)


def test_optimizer_config_keeps_upstream_muon_defaults():
    config = OptimizerConfig()
    assert (config.muon_momentum, config.muon_nesterov) == (0.95, False)
    assert (config.muon_scale_mode, config.muon_extra_scale_factor) == ("spectral", 1.0)
    assert (config.muon_tp_mode, config.muon_fp32_matmul_prec) == ("blockwise", "medium")
    assert (config.muon_num_ns_steps, config.muon_split_qkv) == (5, True)
    # added fields: off, or what 0.16.1 already ran
    assert config.muon_matched_adamw_rms is None
    assert config.muon_coefficient_type == "quintic"
    assert config.muon_distopt_exchange_dtype == "fp32"


@pytest.mark.parametrize("shape", [(64, 128), (128, 64)])
def test_newton_schulz_reaches_the_polar_factor(shape):
    # Polar Express's 8 steps drive every singular value to 1 (fp32): |s - 1| < 1e-3
    x = _randn(*shape)
    sv = torch.linalg.svdvals(newton_schulz(x, 8, "polar_express", "highest").double())
    torch.testing.assert_close(sv, torch.ones_like(sv), rtol=0, atol=1e-3)


def test_muon_with_the_seed_recipe_matches_torch_muon_in_fp32():
    # torch.optim.Muon: Nesterov, Keller Jordan's coefficients, matched AdamW RMS 0.2 (its
    # "match_rms_adamw"); its EMA momentum differs from ours by (1 - mu), which Newton-Schulz's
    # normalization removes up to fp32 rounding of the bf16 NS input: bound 2% of the move
    # (measured < 1% over 5 steps), while dropping Nesterov moves > 10% (see tests/unit).
    start = [_randn(32, 64, seed=1), _randn(96, 48, seed=2)]
    ours = [w.clone().requires_grad_() for w in start]
    theirs = [w.clone().requires_grad_() for w in start]
    recipe = dict(nesterov=True, ns_coefficients="simple", ns_precision="medium")
    opt = Muon(ours, lr=0.02, weight_decay=0.1, matched_adamw_rms=0.2, **recipe)
    ref = torch.optim.Muon(theirs, lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    for step in range(5):
        for p, q in zip(ours, theirs):
            p.grad = _randn(*p.shape, seed=10 + step)
            q.grad = p.grad.clone()
        opt.step(), ref.step()
    for p, q, w in zip(ours, theirs, start):
        assert ((p - q).norm() / (p - w).norm()).item() < 0.02


def test_fused_qkv_is_orthogonalized_per_block():
    groups, split, hidden = 2, (8, 4, 4), 24
    u = _randn(groups * sum(split), hidden)
    spec = OrthoSpec(5, "quintic", "highest", 1e-7, "spectral", 1.0)
    (got,) = orthogonalize_matrices([u], [MuonParamInfo(tuple(u.shape), split)], spec)
    per_group, start = u.view(groups, sum(split), hidden), 0
    for rows in split:
        block = per_group[:, start : start + rows].reshape(-1, hidden)
        want = max(groups * rows, hidden) ** 0.5 * newton_schulz(block, 5, "quintic", "highest")
        out = got.view(groups, sum(split), hidden)[:, start : start + rows].reshape(-1, hidden)
        torch.testing.assert_close(out, want, rtol=0, atol=1e-5)
        start += rows


@pytest.mark.parametrize("mode", ["blockwise", "duplicated", "distributed"])
def test_tensor_parallel_muon_keeps_upstreams_constructor(mode):
    # without TP every mode is plain Muon with upstream's TensorParallelMuon defaults
    w = _randn(50, 100).requires_grad_()
    ref = w.detach().clone().requires_grad_()
    initial = w.detach().clone()
    tp = TensorParallelMuon([w], lr=0.01, weight_decay=0.0, pg_collection=None, tp_mode=mode)
    plain = Muon([ref], lr=0.01, weight_decay=0.0, nesterov=True, ns_coefficients="quintic")
    w.grad, ref.grad = _randn(50, 100, seed=3), _randn(50, 100, seed=3)
    tp.step(), plain.step()
    assert torch.equal(w, ref) and not torch.equal(w, initial)
    with pytest.raises(ValueError, match="num_ns_steps must be at least 1"):
        TensorParallelMuon([w], num_ns_steps=0)


def test_tensor_parallel_muon_takes_upstreams_argument_names():
    names = dict(momentum=0.9, nesterov=False, tp_mode="blockwise")  # megatron-core 0.19's
    tp = TensorParallelMuon([_randn(8, 12).requires_grad_()], **names)
    group = tp.param_groups[0]
    assert (group["momentum"], group["nesterov"], tp.mode) == (0.9, False, "blockwise")


@pytest.mark.parametrize("old", ["momentum_beta", "use_nesterov", "mode"])
def test_tensor_parallel_muon_has_no_0_16_1_names(old):
    with pytest.raises(TypeError, match=f"unexpected keyword argument '{old}'"):
        TensorParallelMuon([_randn(8, 12).requires_grad_()], **{old: None})
