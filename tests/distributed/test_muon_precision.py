"""Muon under Megatron's precision wrappers: fp16 overflow skips the step and leaves momentum
untouched; bf16 (fp32 main params) under TP2 x DP2 matches one process.

    .venv/bin/python -m pytest tests/distributed/test_muon_precision.py -q
"""

import functools

import pytest
from harness import run_distributed
from parity import assert_close_runs
from tiny_gpt import (
    TinyGPT,
    build_model,
    build_optimizer,
    global_batches,
    train,
    train_step,
)

from megatron.core import parallel_state as ps
from megatron.training.muon_recipe import SEED_RECIPE

MUON = dict(optimizer="muon", muon_fp32_matmul_prec="highest", **SEED_RECIPE)
# 2**10: small enough that the tiny model's fp16 grads never overflow on their own;
# hysteresis 1: the first overflow already backs the scale off (Megatron's default waits 2).
FP16 = dict(MUON, initial_loss_scale=2.0**10, hysteresis=1)


class InjectInf:
    """Stands in for the optimizer in ``train_step``: puts an inf into one Muon grad first."""

    def __init__(self, optimizer, param):
        self.optimizer, self.param = optimizer, param

    def zero_grad(self):
        self.optimizer.zero_grad()

    def step(self):
        if self.param is not None:  # None: a rank that does not hold it
            self.param.main_grad.view(-1)[0] = float("inf")
        return self.optimizer.step()


def _snapshot(model, muon):
    params = {n: p.detach().clone() for n, p in model[0].named_parameters()}
    momenta = {
        id(p): s["momentum_buffer"].clone() for p, s in muon.state.items() if muon.is_muon(p)
    }
    mains = [p.detach().clone() for g in muon.param_groups for p in g["params"]]
    return params, momenta, mains


def fp16_overflow_run(distopt: bool):
    spec = TinyGPT(dtype="fp16", num_layers=2)
    model = build_model(spec, distopt=distopt, bucket_size=6000, overlap_grad_reduce=distopt)
    optimizer = build_optimizer(spec, model, use_distributed_optimizer=distopt, **FP16)
    muon = optimizer.chained_optimizers[0].optimizer
    batches = global_batches(spec, 3)
    first = train_step(spec, model, optimizer, batches[0])  # creates momentum
    before, scale = _snapshot(model, muon), optimizer.get_loss_scale().item()
    qkv = model[0].module.decoder.layers[0].self_attention.linear_qkv.weight
    skipped = train_step(spec, model, InjectInf(optimizer, qkv), batches[1])
    after, scale_after = _snapshot(model, muon), optimizer.get_loss_scale().item()
    last = train_step(spec, model, optimizer, batches[2])
    return dict(
        ok=(first["ok"], skipped["ok"], last["ok"]),
        scales=(scale, scale_after),
        same_params=all(before[0][n].equal(after[0][n]) for n in before[0]),
        same_momenta=len(before[1]) > 0 and all(before[1][k].equal(after[1][k]) for k in before[1]),
        same_mains=all(a.equal(b) for a, b in zip(before[2], after[2])),
        moved_after=not all(a.equal(b) for a, b in zip(after[2], _snapshot(model, muon)[2])),
        muon_params=len(before[1]),
    )


@pytest.mark.parametrize(
    "world_size, distopt", [(1, False), (2, True)], ids=["plain", "distopt_dp2"]
)
def test_fp16_overflow_skips_step_keeps_momentum_and_backs_off_scale(world_size, distopt):
    """With DistOpt the inf sits in one rank's shard; the skip must still be global."""
    for out in run_distributed(fp16_overflow_run, world_size, args=(distopt,)):
        _check_overflow_run(out, muon_params=None if distopt else 2 * 4)


def _check_overflow_run(out: dict, muon_params) -> None:
    assert out["ok"] == (True, False, True)
    if muon_params is not None:  # qkv, proj, fc1, fc2 per layer; DistOpt ranks hold shards
        assert out["muon_params"] == muon_params
    assert out["muon_params"] > 0
    assert out["same_params"] and out["same_mains"] and out["same_momenta"]
    assert out["scales"] == (2.0**10, 2.0**9)  # backoff factor 0.5
    assert out["moved_after"], "the next finite step must update again"


# MoE with EP: the dense and the expert params have Megatron optimizers of their own (a
# ChainedOptimizer), each with a grad scaler; the loss is scaled by the first one's scale, so
# every scaler must keep it (an inf in the expert grads alone used to back off theirs only).
MOE_FP16 = TinyGPT(
    dtype="fp16", num_layers=2, num_moe_experts=4, moe_token_dispatcher_type="allgather"
)
# The step after the skip computes its grads on the params of step 1 (which differ between the
# layouts by fp16 rounding only): its grad norm matches one process to 5e-5 (measured), while
# expert grads unscaled by the wrong loss scale (x2) put it 9% off. Params are not compared:
# fp16 rounding makes the runs drift apart by ~0.15 over the 4 steps, with or without a skip.
GRAD_NORM_RTOL = 2e-3


def expert_overflow_run(distopt: bool):
    """4 steps; in the 2nd an inf sits in one expert's grad, on EP rank 0 only (at EP=1: in
    the one optimizer). Returns the steps' ok flags and grad norms, and every sub-optimizer's
    loss scale at the end."""
    model = build_model(MOE_FP16, distopt=distopt, bucket_size=6000, overlap_grad_reduce=distopt)
    optimizer = build_optimizer(MOE_FP16, model, use_distributed_optimizer=distopt, **FP16)
    expert = model[0].module.decoder.layers[0].mlp.experts.local_experts[0].linear_fc1.weight
    holder = ps.get_expert_model_parallel_rank() == 0
    steps = []
    for i, batch in enumerate(global_batches(MOE_FP16, 4)):
        step_with = InjectInf(optimizer, expert if holder else None) if i == 1 else optimizer
        steps.append(train_step(MOE_FP16, model, step_with, batch))
    scales = [o.get_loss_scale().item() for o in getattr(optimizer, "chained_optimizers", [])]
    return [s["ok"] for s in steps], [s["grad_norm"] for s in steps], scales


@pytest.mark.parametrize("distopt", [False, True], ids=["plain", "distopt"])
def test_fp16_moe_expert_only_overflow_keeps_one_loss_scale(distopt):
    ((ref_ok, ref_norms, _),) = run_distributed(expert_overflow_run, 1, args=(False,))
    for ok, norms, scales in run_distributed(expert_overflow_run, 2, ep=2, args=(distopt,)):
        assert ref_ok == ok == [True, False, True, True]
        assert scales == [2.0**9, 2.0**9], "the dense and the expert optimizer's loss scales"
        assert norms[2] == pytest.approx(ref_norms[2], rel=GRAD_NORM_RTOL)


# bf16 model, fp32 main params and fp32 Newton-Schulz. Row-parallel layers all-reduce bf16
# partial sums (8 mantissa bits, ~4e-3 relative), so gradients differ at ~1e-2 between layouts.
# - AdamW params (norms, embeddings): Adam's first steps are ~lr*sign(g), so that noise flips
#   coordinates; the 1-D params are pooled (parity.update_rel_error).
# - Muon matrices: NS is smooth, so the gradient noise passes through at about its size, plus
#   the bf16 rounding of the model params themselves.
# Measured 0.121 for both (matrices' worst, pooled vectors) under every summation order
# tools/parity_margins.py runs (ATEN_CPU_CAPABILITY default/avx2 x 1/2 threads): 0.3 leaves
# 2.5x, as test_parity_adam's bf16, and sits below the 0.7 a wrong TP exchange gives.
BF16_TOL, BF16_LOSS_RTOL = 0.3, 2e-2


@functools.cache
def bf16_reference():
    return run_distributed(train, 1, args=(TinyGPT(dtype="bf16"), 3), kwargs=MUON)[0]


def test_bf16_tp2_dp2_matches_one_process():
    got = run_distributed(train, 4, tp=2, args=(TinyGPT(dtype="bf16"), 3), kwargs=MUON)
    errors = assert_close_runs(
        bf16_reference(), got, tol=BF16_TOL, loss_rtol=BF16_LOSS_RTOL, pool_vectors=True
    )
    assert sum(".linear_" in k for k in errors) == 4 * 4  # every Muon matrix compared
