"""Sequence parallelism with the local (torch) norms (patch 0017): TP 2 + SP on 2 gloo ranks
equals TP 1 on one process: the loss, the norm weights' grads after finalize_model_grads, and
every param after one SGD step; with the norms' ``sequence_parallel`` marks dropped (negative
control) each rank keeps the grad of its half of the sequence and the norm grads miss.

    .venv/bin/python -m pytest tests/distributed/test_sequence_parallel_norm.py -q
"""

import dataclasses
import functools

import pytest
import torch
from harness import run_distributed
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from parity import assert_close_step, grad_rel_error, record
from tiny_gpt import (
    TinyGPT,
    build_model,
    build_optimizer,
    gather_all_params,
    global_batches,
    global_name,
    train_step,
)

SP = dict(sequence_parallel=True)
CASES = {  # name: (spec, EP); the reference runs the same spec at TP 1 without SP
    "rmsnorm": (TinyGPT(num_layers=2), 1),
    # our zero-centered gamma (patch 0015) is the module WrappedTorchNorm returns here
    "layernorm_zero_centered": (
        TinyGPT(
            num_layers=2,
            extra=dict(normalization="LayerNorm", layernorm_zero_centered_gamma=True),
        ),
        1,
    ),
    # MoE at TP > 1 requires SP (the reason for the patch); the MTP recipe's EP 4 x ETP 1 on 2
    # ranks: EP 2, ETP 1, the router weight marked by upstream itself
    "moe_ep2_etp1": (
        TinyGPT(num_layers=2, num_moe_experts=4, moe_token_dispatcher_type="allgather"),
        2,
    ),
}
# fp32 throughout. TP and SP only reorder fp32 sums: a norm weight's grad is the sum over the
# sequence of per-token terms, here two half-sequence partial sums all-reduced over TP. Errors
# relative to the grad's (or the update's) Frobenius norm. Measured (default and avx2 kernels):
# norm grads <= 8.4e-7, loss <= 1e-7, updates <= 1.3e-5 (an MoE expert whose grad, a sum over the
# few tokens routed to it, cancels more); the control's norm grads (each rank's half of the sum
# alone) miss by 0.26-0.98. GRAD_TOL leaves >10x over the measured error and sits >10000x below
# the control's. The step is SGD's, linear in the grads: Adam's first step g / (|g| + eps) turns
# the rounding noise of grads near eps into update errors up to 6.9e-4 (measured), a measure of
# Adam's conditioning, not of the layout. STEP_TOL is the other fp32 parity tests' (>7x margin).
GRAD_TOL = 1e-5
STEP_TOL = 1e-4
LOSS_RTOL = 1e-5


def _run(spec: TinyGPT, drop_marks: bool = False) -> tuple:
    """One SGD step on one global batch: (initial params, norm grads after
    finalize_model_grads, final params, loss, names of the params marked sequence_parallel)."""
    model = build_model(spec)
    config = model[0].module.config
    norms = {
        global_name(c.module, n, spec): p
        for c in model
        for n, p in c.module.named_parameters()
        if "norm" in n
    }
    if drop_marks:
        for p in norms.values():
            p.sequence_parallel = False
    marked = sorted(
        global_name(c.module, n, spec)
        for c in model
        for n, p in c.module.named_parameters()
        if getattr(p, "sequence_parallel", False)
    )
    grads, finalize = {}, config.finalize_model_grads_func

    def recording(*args, **kwargs):
        finalize(*args, **kwargs)
        grads.update({k: p.main_grad.detach().clone() for k, p in norms.items()})

    config.finalize_model_grads_func = recording
    initial = gather_all_params(model, spec)
    optimizer = build_optimizer(spec, model, optimizer="sgd")
    loss = train_step(spec, model, optimizer, global_batches(spec, 1)[0])["loss"]
    if drop_marks:  # each TP rank stepped its copy of a norm with its own half-sequence grad
        with pytest.raises(AssertionError, match=r"norm\.weight: rank 1's copy differs from"):
            gather_all_params(model, spec)
        return initial, grads, None, loss, marked
    return initial, grads, gather_all_params(model, spec), loss, marked


@functools.cache
def reference(case: str) -> tuple:
    return run_distributed(_run, 1, args=(CASES[case][0],))[0]


def _sp_run(case: str, drop_marks: bool = False) -> list:
    spec, ep = CASES[case]
    spec = dataclasses.replace(spec, extra={**spec.extra, **SP})
    return run_distributed(_run, 2, tp=2, ep=ep, etp=1, args=(spec, drop_marks))


@pytest.mark.parametrize("case", CASES)
def test_sequence_parallel_norms_match_one_process(case):
    *ref, ref_marked = reference(case)
    assert ref_marked == [], f"marked without sequence parallelism: {ref_marked}"
    for *got, marked in _sp_run(case):
        grads = got[1]
        assert set(grads) <= set(marked), f"norms not marked: {set(grads) - set(marked)}"
        tols = dict(grad_tol=GRAD_TOL, step_tol=STEP_TOL, loss_rtol=LOSS_RTOL)
        assert_close_step(tuple(ref), tuple(got), **tols)


def test_without_the_marks_the_norm_grads_miss():
    """Negative control: each TP rank's norm grad is then the sum over its half of the sequence;
    every norm's grad misses the reference (measured: by 0.26 at least), and the TP ranks' copies
    of a norm weight part after the step (the replica check of gather_all_params, in _run)."""
    ref_grads = reference("rmsnorm")[1]
    for _, grads, _, _, _ in _sp_run("rmsnorm", drop_marks=True):
        name, error = min(grad_rel_error(ref_grads, grads).items(), key=lambda kv: kv[1])
        record("control", name, error, 1000 * GRAD_TOL)
        assert error > 1000 * GRAD_TOL, f"{name}: {error:.2e}"


@pytest.mark.parametrize("zero_centered", [False, True])
def test_torch_norm_marks_only_with_sequence_parallel(zero_centered):
    """Upstream's behaviour without SP is unchanged: no attribute on the norm's params."""
    for sp in (False, True):
        config = TransformerConfig(
            num_layers=1,
            hidden_size=8,
            num_attention_heads=2,
            normalization="LayerNorm",
            layernorm_zero_centered_gamma=zero_centered,
            tensor_model_parallel_size=2,
            sequence_parallel=sp,
        )
        params = list(WrappedTorchNorm(config, 8).parameters())
        assert len(params) == 2
        assert all(getattr(p, "sequence_parallel", None) == (True if sp else None) for p in params)


def test_zero_centered_norm_stores_gamma():
    """The zero-centered module (patch 0015) starts at gamma = 0 and scales by 1 + gamma."""
    config = TransformerConfig(
        num_layers=1, hidden_size=8, num_attention_heads=1, layernorm_zero_centered_gamma=True
    )
    norm, x = WrappedTorchNorm(config, 8), torch.randn(3, 8)
    assert torch.equal(norm.weight, torch.zeros(8))
    torch.nn.init.constant_(norm.weight, 0.5)
    want = torch.nn.functional.layer_norm(x, (8,), torch.full((8,), 1.5), norm.bias, norm.eps)
    torch.testing.assert_close(norm(x), want, rtol=0, atol=0)
    with pytest.raises(ValueError, match="needs normalization LayerNorm or RMSNorm, got 'L2Norm'"):
        WrappedTorchNorm(dataclasses.replace(config, normalization="L2Norm"), 8)
