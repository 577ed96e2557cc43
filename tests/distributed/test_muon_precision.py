"""Muon under Megatron's precision wrappers: fp16 overflow skips the step and leaves momentum
untouched; bf16 (fp32 main params) under TP2 x DP2 matches one process.

    .venv/bin/python -m pytest tests/distributed/test_muon_precision.py -q
"""

import functools

import pytest
from harness import run_distributed
from parity import assert_close_runs
from tiny_gpt import TinyGPT, build_model, build_optimizer, global_batches, train, train_step

from megatron.training.muon_recipe import SEED_RECIPE

MUON = dict(optimizer="muon", muon_fp32_matmul_prec="fp32", **SEED_RECIPE)
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


# bf16 model, fp32 main params and fp32 Newton-Schulz. Row-parallel layers all-reduce bf16
# partial sums (8 mantissa bits, ~4e-3 relative), so gradients differ at ~1e-2 between layouts.
# - AdamW params (norms, embeddings): Adam's first steps are ~lr*sign(g), so that noise flips
#   coordinates: the same 0.3 as test_parity_adam's bf16 (measured here up to ~0.17).
# - Muon matrices: NS is smooth, so the gradient noise passes through at about its size, plus
#   the bf16 rounding of the model params themselves (measured 0.04-0.12 over the 16 matrices);
#   0.25 is 2x the worst and ~3x below the 0.7 a wrong TP exchange gives.
BF16_TOL, BF16_MUON_TOL, BF16_LOSS_RTOL = 0.3, 0.25, 2e-2


@functools.cache
def bf16_reference():
    return run_distributed(train, 1, args=(TinyGPT(dtype="bf16"), 3), kwargs=MUON)[0]


def test_bf16_tp2_dp2_matches_one_process():
    got = run_distributed(train, 4, tp=2, args=(TinyGPT(dtype="bf16"), 3), kwargs=MUON)
    errors = assert_close_runs(bf16_reference(), got, tol=BF16_TOL, loss_rtol=BF16_LOSS_RTOL)
    muon = {k: e for k, e in errors.items() if ".linear_" in k}
    assert len(muon) == 4 * 4 and max(muon.values()) <= BF16_MUON_TOL, max(muon.values())
