"""Muon optimizer: equivalence with torch.optim.Muon / AdamW, state, scale families, validation."""

import io

import pytest
import torch

from megatron.core.optimizer.megatron_muon.newton_schulz import newton_schulz as _newton_schulz
from megatron.core.optimizer.muon import Muon as _Muon
from megatron.core.optimizer.muon import MuonParamInfo

# These tests check torch.optim.Muon's math (Nesterov, Keller Jordan's coefficients, matched
# AdamW RMS 0.2) in fp32: the seed's recipe, given explicitly here since Muon's defaults are
# upstream's (tests/unit/test_muon_config.py checks those).
RECIPE = dict(
    nesterov=True, ns_coefficients="simple", ns_precision="highest", matched_adamw_rms=0.2
)


def Muon(params, **kwargs):  # noqa: N802 - Muon with the recipe as this file's defaults
    return _Muon(params, **{**RECIPE, **kwargs})


def newton_schulz(x, steps=5, coefficients="simple", precision="highest"):
    return _newton_schulz(x, steps, coefficients, precision)


SHAPES = [(32, 64), (96, 48)]  # wide and tall: both the transposed and plain NS paths
STEPS = 5


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _params(shapes=SHAPES, seed=0):
    g = _gen(seed)
    return [torch.randn(s, generator=g).requires_grad_() for s in shapes]


def _clone(params):
    return [p.detach().clone().requires_grad_() for p in params]


def _run(opts_and_params, steps=STEPS, seed=1):
    """Feed every (optimizer, params) pair the same gradients for ``steps`` steps."""
    g = _gen(seed)
    for _ in range(steps):
        grads = [torch.randn(p.shape, generator=g) for p in opts_and_params[0][1]]
        for opt, params in opts_and_params:
            for p, grad in zip(params, grads):
                p.grad = grad.clone()
            opt.step()


# torch's adjust_lr_fn -> our equivalent scale settings.
TORCH_SCALES = {
    "original": dict(matched_adamw_rms=None, scale_mode="shape_scaling"),
    "match_rms_adamw": dict(matched_adamw_rms=0.2),
}


@pytest.mark.parametrize("adjust_lr_fn", list(TORCH_SCALES))
def test_matches_torch_muon_bitwise_but_for_bf16_ties_when_momentum_is_a_power_of_two(
    adjust_lr_fn,
):
    # torch keeps an EMA buffer (1 - mu) times ours and feeds NS (1 - mu) * U. With mu = 0.5 that
    # factor is a power of two, so its bf16 NS input is bitwise ours, and both run bf16 NS on it.
    # Error model: (1) the fp32 rounding of lr * s * O vs lr * (s * O): a few ulps of |W| ~ 4
    # (< 2e-6); (2) for the tall matrix torch multiplies transposed views where we iterate on
    # X^T X in place: kernels that sum a transposed operand in another order (ATen's `default`
    # CPU kernels do; avx2's do not) can round a bf16 product one ulp apart, which moves that
    # element by lr * s * |O| * 2^-8 per step and spreads to a few neighbours. Measured under
    # `default`: 2 of 4608 elements beyond 2e-6 (max 1.9e-5); under avx2: none. So nearly every
    # element must agree to 2e-6 (a slip in lr, scale, momentum or decay moves all of them by
    # > 1e-4), and the rest within one bf16 rounding of the update per step.
    ours, theirs = _params(), _params()
    opt = Muon(
        ours,
        lr=0.02,
        weight_decay=0.1,
        momentum=0.5,
        ns_precision="medium",
        **TORCH_SCALES[adjust_lr_fn],
    )
    ref = torch.optim.Muon(
        theirs, lr=0.02, weight_decay=0.1, momentum=0.5, adjust_lr_fn=adjust_lr_fn
    )
    _run([(opt, ours), (ref, theirs)])
    for p, q in zip(ours, theirs):
        diff = (p - q).abs()
        assert (diff > 2e-6).float().mean() <= 0.01, f"{p.shape}: not bitwise but for ties"
        assert diff.max() <= _bf16_tie_bound(p.shape, adjust_lr_fn), f"{p.shape}: {diff.max()}"


def _bf16_tie_bound(shape, adjust_lr_fn, lr=0.02, max_entry=1.5):
    """STEPS bf16 roundings (2^-8 relative) of an update lr * s * O with |O_ij| <= max_entry
    (NS leaves singular values <= ~1.2), s as torch's adjust_lr_fn scales it."""
    rows, cols = shape
    s = max(1, rows / cols) ** 0.5 if adjust_lr_fn == "original" else 0.2 * max(shape) ** 0.5
    return STEPS * lr * s * max_entry * 2**-8


def _torch_ns_in_fp32(grad, ns_coefficients, ns_steps, eps):
    """torch.optim.Muon's Newton-Schulz op for op, without its cast to bf16."""
    a, b, c = ns_coefficients
    x = grad.T if grad.size(0) > grad.size(1) else grad
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if grad.size(0) > grad.size(1) else x


@pytest.mark.parametrize("adjust_lr_fn", list(TORCH_SCALES))
def test_matches_torch_muon_step_logic_tightly_in_fp32(adjust_lr_fn, monkeypatch):
    # With torch's NS swapped for its fp32 transcription, everything else (EMA momentum, Nesterov
    # lerp, lr adjustment, weight decay) is torch's own code. What remains is fp32 rounding of
    # (1 - mu) U vs U through NS and the update: measured 2.4e-7 after 5 steps (2 ulps of
    # |W| ~ 4); bound 5e-6 leaves room for other BLAS builds, yet a 1e-3 relative slip in lr,
    # scale or momentum moves W by > 1e-4.
    monkeypatch.setattr(torch.optim._muon, "_zeropower_via_newtonschulz", _torch_ns_in_fp32)
    ours, theirs = _params(), _params()
    opt = Muon(ours, lr=0.02, weight_decay=0.1, **TORCH_SCALES[adjust_lr_fn])
    ref = torch.optim.Muon(theirs, lr=0.02, weight_decay=0.1, adjust_lr_fn=adjust_lr_fn)
    _run([(opt, ours), (ref, theirs)])
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p, q, rtol=0, atol=5e-6)


def _displacement_gap(ours, theirs, start):
    """||W_ours - W_torch||_F / ||W_ours - W_0||_F, worst over params."""
    return max(((p - q).norm() / (p - w).norm()).item() for p, q, w in zip(ours, theirs, start))


@pytest.mark.parametrize("adjust_lr_fn", list(TORCH_SCALES))
def test_matches_torch_muon_within_bf16_noise_at_default_momentum(adjust_lr_fn):
    # mu = 0.95: torch's bf16 NS input (0.05 * U) rounds differently from ours, so the two bf16
    # NS outputs differ by bf16 noise. Measured over 5 steps, seeds 0-3: 0.7-1.0% of the
    # displacement, the same as our own bf16-vs-fp32 gap (0.6-0.8%). Bound: 2%. A real semantic
    # difference is far larger: see the negative control below.
    start = _params()
    ours, theirs = _clone(start), _clone(start)
    opt = Muon(ours, lr=0.02, weight_decay=0.1, ns_precision="medium", **TORCH_SCALES[adjust_lr_fn])
    ref = torch.optim.Muon(theirs, lr=0.02, weight_decay=0.1, adjust_lr_fn=adjust_lr_fn)
    _run([(opt, ours), (ref, theirs)])
    assert _displacement_gap(ours, theirs, start) < 0.02


def test_negative_control_without_nesterov_exceeds_the_tolerance():
    start = _params()
    ours, theirs = _clone(start), _clone(start)
    opt = Muon(ours, lr=0.02, weight_decay=0.1, nesterov=False, ns_precision="medium")
    ref = torch.optim.Muon(theirs, lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    _run([(opt, ours), (ref, theirs)])
    assert _displacement_gap(ours, theirs, start) > 0.1


ADAMW = dict(lr=3e-3, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.05)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("foreach", [False, True, None])
def test_adamw_groups_match_torch_adamw_bitwise(foreach, dtype):
    # torch's functional AdamW of the same kind (None: torch's rule, single-tensor on CPU)
    shapes = [(7,), (5, 3), (4, 2, 3)]
    ours = [p.detach().to(dtype).requires_grad_() for p in _params(shapes)]
    theirs = _clone(ours)
    opt = Muon([dict(params=ours, use_muon=False, **ADAMW)], foreach=foreach)
    ref = torch.optim.AdamW(theirs, **ADAMW, foreach=foreach)
    _adamw_run(opt, ref, ours, theirs)
    for p, q in zip(ours, theirs):
        assert torch.equal(p, q)
    for p, q in zip(ours, theirs):
        assert torch.equal(opt.state[p]["step"], ref.state[q]["step"])
        assert opt.state[p]["step"].device.type == "cpu"  # read without a device sync


def _adamw_run(opt, ref, ours, theirs, after_ref=lambda: None):
    g = _gen(1)
    for _ in range(STEPS):
        for p, q in zip(ours, theirs):
            p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
            q.grad = p.grad.clone()
        opt.step(), ref.step()
        after_ref()


@pytest.mark.parametrize("foreach", [False, True])
def test_adamw_narrow_state_rounds_once_per_step(foreach):
    # bf16 state: widened to the fp32 param for torch's step, rounded back once; the reference
    # is torch's AdamW with its state rounded to bf16 after each step (widening is exact)
    ours, theirs = _params([(7,), (5, 3)]), _params([(7,), (5, 3)])
    bf16 = torch.bfloat16
    opt = Muon([dict(params=ours, use_muon=False, **ADAMW)], exp_avg_dtype=bf16, foreach=foreach)
    ref = torch.optim.AdamW(theirs, **ADAMW, foreach=foreach)

    def round_ref():
        for q in theirs:
            for key in ("exp_avg", "exp_avg_sq"):
                ref.state[q][key].copy_(ref.state[q][key].to(bf16))

    _adamw_run(opt, ref, ours, theirs, round_ref)
    for p, q in zip(ours, theirs):
        assert torch.equal(p, q)
        assert opt.state[p]["exp_avg"].dtype == torch.bfloat16
        assert torch.equal(opt.state[p]["exp_avg_sq"].float(), ref.state[q]["exp_avg_sq"])


def test_mixed_groups_step_each_by_its_own_rule():
    """A Muon group and an AdamW group in one optimizer equal two separate optimizers."""
    mats, vecs = _params(), _params([(6,), (3,)], seed=2)
    mats2, vecs2 = _clone(mats), _clone(vecs)
    both = Muon([dict(params=mats), dict(params=vecs, use_muon=False, **ADAMW)], lr=0.02)
    only_muon = Muon(mats2, lr=0.02)
    only_adamw = torch.optim.AdamW(vecs2, **ADAMW, foreach=False)
    g = _gen(3)
    for _ in range(3):
        for a, b in zip(mats + vecs, mats2 + vecs2):
            a.grad = torch.randn(a.shape, generator=g)
            b.grad = a.grad.clone()
        both.step(), only_muon.step(), only_adamw.step()
    for a, b in zip(mats + vecs, mats2 + vecs2):
        assert torch.equal(a, b)


def _mixed_optimizer(mats, vecs, **kw):
    return Muon([dict(params=mats), dict(params=vecs, use_muon=False)], lr=0.01, **kw)


@pytest.mark.parametrize("exp_avg_dtype", [None, torch.bfloat16])
def test_state_dict_round_trip_continues_bit_exactly(exp_avg_dtype):
    mats, vecs = _params(), _params([(6,)], seed=2)
    straight = _mixed_optimizer(mats, vecs, exp_avg_dtype=exp_avg_dtype)
    _run([(straight, mats + vecs)], steps=3, seed=5)
    buf = io.BytesIO()
    torch.save({"params": [p.detach() for p in mats + vecs], "opt": straight.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf)
    r_mats, r_vecs = _clone(saved["params"][:2]), _clone(saved["params"][2:])
    resumed = _mixed_optimizer(r_mats, r_vecs, exp_avg_dtype=exp_avg_dtype)
    resumed.load_state_dict(saved["opt"])
    _run([(straight, mats + vecs)], steps=3, seed=6)
    _run([(resumed, r_mats + r_vecs)], steps=3, seed=6)
    for a, b in zip(mats + vecs, r_mats + r_vecs):
        assert torch.equal(a, b)
        for key in straight.state_keys(a):
            assert resumed.state[b][key].dtype == (exp_avg_dtype or torch.float32)
            assert torch.equal(straight.state[a][key], resumed.state[b][key])
    steps = [resumed.state[p]["step"] for p in r_vecs]
    assert all(s.item() == 6 for s in steps)


def test_declared_state_keys_are_exactly_the_state():
    mats, vecs = _params(), _params([(6,)], seed=2)
    opt = _mixed_optimizer(mats, vecs)
    assert opt.state_keys(mats[0]) == ("momentum_buffer",)
    assert opt.state_keys(vecs[0]) == ("exp_avg", "exp_avg_sq")
    assert opt.scalar_state_keys(mats[0]) == () and opt.scalar_state_keys(vecs[0]) == ("step",)
    assert len(opt.state) == 0  # lazy
    _run([(opt, mats + vecs)], steps=1)
    for p in mats + vecs:
        assert set(opt.state[p]) == set(opt.state_keys(p) + opt.scalar_state_keys(p))
        for key in opt.state_keys(p):
            assert opt.state[p][key].shape == p.shape


def test_bf16_state_holds_rounded_values_after_one_step():
    mats, vecs = _params(), _params([(6,)], seed=2)
    opt = _mixed_optimizer(mats, vecs, exp_avg_dtype=torch.bfloat16)
    grads = [torch.randn(p.shape, generator=_gen(9)) for p in mats + vecs]
    for p, g in zip(mats + vecs, grads):
        p.grad = g
    opt.step()
    for p, g in zip(mats, grads):  # B_1 = G
        assert torch.equal(opt.state[p]["momentum_buffer"], g.bfloat16())
    m = opt.state[vecs[0]]
    g = grads[-1]
    assert torch.equal(m["exp_avg"], torch.zeros_like(g).lerp_(g, 0.1).bfloat16())
    assert torch.equal(m["exp_avg_sq"], (0.001 * g * g).bfloat16())


def test_matched_rms_equals_spectral_times_factor_bitwise():
    a, b = _params(), _params()
    opt_a = Muon(a, lr=0.01, matched_adamw_rms=0.2)
    opt_b = Muon(b, lr=0.01, matched_adamw_rms=None, scale_mode="spectral", extra_scale_factor=0.2)
    _run([(opt_a, a), (opt_b, b)], steps=2)
    for p, q in zip(a, b):
        assert torch.equal(p, q)


@pytest.mark.parametrize(
    "mode,expected",
    [("spectral", 0.5 * 96**0.5), ("shape_scaling", 0.5 * 2**0.5), ("unit_rms_norm", 0.5 * 2**0.5)],
)
def test_first_step_update_is_scaled_ns_of_nesterov_input(mode, expected):
    """Step 1 from zero momentum: U = G + mu G; W1 = W0 (1 - lr wd) - lr s NS(U)."""
    (w,) = _params([(96, 48)])
    w0 = w.detach().clone()
    grad = torch.randn(w.shape, generator=_gen(4))
    opt = Muon(
        [w],
        lr=0.01,
        weight_decay=0.1,
        momentum=0.9,
        matched_adamw_rms=None,
        scale_mode=mode,
        extra_scale_factor=0.5,
    )
    w.grad = grad
    opt.step()
    want = w0 * (1 - 0.01 * 0.1) - 0.01 * expected * newton_schulz(grad * 1.9)
    torch.testing.assert_close(w.detach(), want, rtol=0, atol=1e-6)


def test_l2_weight_decay_enters_the_gradient():
    (w,) = _params([(16, 24)])
    w0 = w.detach().clone()
    grad = torch.randn(w.shape, generator=_gen(4))
    opt = Muon([w], lr=0.01, weight_decay=0.1, nesterov=False, decoupled_weight_decay=False)
    w.grad = grad
    opt.step()
    want = w0 - 0.01 * 0.2 * 24**0.5 * newton_schulz(grad + 0.1 * w0)
    torch.testing.assert_close(w.detach(), want, rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------- non-finite grads
def _poisoned():
    mats, vecs = _params(), _params([(6,)], seed=2)
    opt = _mixed_optimizer(mats, vecs)
    _run([(opt, mats + vecs)], steps=1)
    before = [p.detach().clone() for p in mats + vecs]
    state = {(i, k): v.clone() for i, p in enumerate(mats + vecs) for k, v in opt.state[p].items()}
    for p in mats + vecs:
        p.grad = torch.ones_like(p)
    vecs[0].grad[2] = float("nan")
    return opt, mats + vecs, before, state


def _unchanged(opt, params, before, state):
    same_state = all(
        torch.equal(v, state[i, k]) for i, p in enumerate(params) for k, v in opt.state[p].items()
    )
    return same_state and all(torch.equal(p, b) for p, b in zip(params, before))


def test_nonfinite_grad_raises_and_leaves_everything_untouched():
    opt, params, before, state = _poisoned()
    with pytest.raises(FloatingPointError, match=r"param group 1, param 0 \(shape \(6,\)\)"):
        opt.step()
    assert _unchanged(opt, params, before, state)


def test_nonfinite_grad_skip_policy_skips_the_whole_step():
    opt, params, before, state = _poisoned()
    opt.on_nonfinite_grad = "skip"
    opt.step()
    assert opt.skipped_steps == 1 and _unchanged(opt, params, before, state)
    params[-1].grad.zero_()
    opt.step()
    assert opt.skipped_steps == 1 and not _unchanged(opt, params, before, state)


# ----------------------------------------------------------------------------- validation
def _muon(**kw):
    return Muon(_params(), **kw)


def _adamw(**kw):
    return Muon([dict(params=_params([(4,)]), use_muon=False, **kw)])


BAD_SETTINGS = [
    (_muon, dict(lr=-1.0), "lr must be a finite number >= 0, got -1.0"),
    (_muon, dict(weight_decay=-0.1), "weight_decay must be a finite number >= 0, got -0.1"),
    (_muon, dict(momentum=-0.1), r"momentum must be a finite number in \[0, 1\), got -0.1"),
    (_muon, dict(momentum=1.0), r"momentum must be a finite number in \[0, 1\), got 1.0"),
    (_muon, dict(ns_steps=0), "ns_steps must be an int >= 1, got 0"),
    (_muon, dict(ns_steps=2.5), "ns_steps must be an int >= 1, got 2.5"),
    (_muon, dict(ns_eps=0.0), "ns_eps must be a finite number > 0, got 0.0"),
    (_muon, dict(ns_coefficients="cubic"), "unknown Newton-Schulz coefficient set 'cubic'"),
    (_muon, dict(ns_precision="fp8"), "unknown Newton-Schulz precision 'fp8'"),
    (_muon, dict(ns_form="fast"), r"ns_form must be one of \['standard', 'auto'\], got 'fast'"),
    (_muon, dict(scale_mode="rms"), "unknown scale_mode 'rms'"),
    (_muon, dict(matched_adamw_rms=-0.2), r"matched_adamw_rms must be a finite .* got -0.2"),
    (_muon, dict(extra_scale_factor=0.0), "extra_scale_factor must be a finite number > 0, got 0"),
    (_muon, dict(scale_mode="unit_rms_norm"), "cannot be combined with scale_mode='unit_rms_n"),
    (_muon, dict(extra_scale_factor=2.0), "cannot be combined with .* extra_scale_factor=2.0"),
    (_muon, dict(exp_avg_dtype=torch.int8), "exp_avg_dtype must be a floating dtype"),
    (_muon, dict(on_nonfinite_grad="warn"), "on_nonfinite_grad must be one of"),
    (_adamw, dict(betas=(0.9, 1.0)), r"betas must be in \[0, 1\), got \(0.9, 1.0\)"),
    (_adamw, dict(eps=-1e-8), "eps must be a finite number >= 0, got -1e-08"),
    (_adamw, dict(lr=-3.0), "lr must be a finite number >= 0, got -3.0"),
]


@pytest.mark.parametrize("build,kwargs,match", BAD_SETTINGS)
def test_invalid_settings_raise_value_error(build, kwargs, match):
    with pytest.raises(ValueError, match=match):
        build(**kwargs)


BAD_PARAMS = [
    (lambda: Muon([torch.zeros(3, requires_grad=True)]), r"2-D parameters, got shape \(3,\)"),
    (lambda: Muon([torch.zeros(2, 3, 4, requires_grad=True)]), r"got shape \(2, 3, 4\)"),
    (lambda: MuonParamInfo((10, 8), qkv_split=(2, 1, 1)), r"\(sum 4\) does not divide the 10 rows"),
    (lambda: MuonParamInfo((10, 8), qkv_split=(2, 0, 1)), "qkv_split must be positive"),
    (lambda: MuonParamInfo((10,)), r"2-D matrix shape, got \(10,\)"),
]


@pytest.mark.parametrize("build,match", BAD_PARAMS)
def test_invalid_params_raise_value_error(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_failed_add_param_group_leaves_groups_unchanged():
    opt = _muon()
    with pytest.raises(ValueError, match="momentum"):
        opt.add_param_group(dict(params=_params([(4, 4)]), momentum=2.0))
    assert len(opt.param_groups) == 1
