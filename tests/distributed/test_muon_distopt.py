"""Muon inside the DistributedOptimizer (ZeRO-1) is exact Muon, balanced and cheap to exchange.

A tiny real GPT (local spec, GQA, SwiGLU, QKV split) trains with ``OptimizerConfig(
optimizer='muon', use_distributed_optimizer=True)`` and small DDP buckets, so that matrices
straddle DP shard boundaries and some ranks hold none of a matrix. Reproduce a case by hand:

    .venv/bin/python -m pytest tests/distributed/test_muon_distopt.py -k dp4 -q
"""

import functools

import pytest
import torch
from harness import run_distributed
from parity import assert_close_runs, update_rel_error
from tiny_gpt import TinyGPT, build_model, build_optimizer, global_batches, train, train_step

from megatron.training.muon_recipe import SEED_RECIPE

STEPS = 3
# DDP makes several buckets only with overlap_grad_reduce; 6000 elements cut the tiny GPT into
# ~12 buckets, and matrices straddle DP shard boundaries in every layout.
BUCKET = 6000
MUON = dict(optimizer="muon", muon_fp32_matmul_prec="fp32", **SEED_RECIPE)

# Tolerances on parity.update_rel_error, as in test_muon_parity.py: DP sharding only reorders
# fp32 gradient sums (the exchange itself moves fp32 values unchanged and NS runs on the very same
# whole matrix), so fp32 runs agree to ~1e-5; 1e-4 keeps a 10x margin and sits far below a
# broken exchange (~1). bf16: the model computes in bf16, where TP's partial-sum all-reduce rounds
# at 8 mantissa bits (~4e-3); Muon matrices then differ by ~0.1 and the AdamW params (norms,
# embeddings; sign-like first steps) by up to 0.17, as in test_parity_adam.py: 0.3 for both.
TOL = {"fp32": 1e-4, "bf16": 0.3}
LOSS_RTOL = {"fp32": 1e-5, "bf16": 2e-2}

LAYOUTS = {
    "dp2_one_bucket": dict(world_size=2, overlap=False),
    "dp2": dict(world_size=2),
    "dp4": dict(world_size=4),
    "tp2_dp2": dict(world_size=4, tp=2),
    "pp2_dp2": dict(world_size=4, pp=2),
    "tp2_pp2_dp2": dict(world_size=8, tp=2, pp=2),
    "tp2_dp2_distributed_tp": dict(world_size=4, tp=2, muon_tp_mode="distributed"),
}


MOE = dict(num_layers=2, num_moe_experts=4, moe_token_dispatcher_type="allgather")


@functools.cache
def reference(dtype: str, moe: bool = False):
    spec = TinyGPT(dtype=dtype, **(MOE if moe else {}))
    return run_distributed(train, 1, args=(spec, STEPS), kwargs=MUON)[0]


def run_layout(dtype, world_size, tp=1, pp=1, ep=1, etp=None, hook=None, moe=False, **kwargs):
    kwargs = {
        **MUON,
        "distopt": True,
        "bucket_size": BUCKET,
        "overlap": True,
        "optimizer_hook": hook,
        **kwargs,
    }
    spec = TinyGPT(dtype=dtype, **(MOE if moe else {}))
    layout = dict(tp=tp, pp=pp, ep=ep, etp=etp)
    return run_distributed(train, world_size, **layout, args=(spec, STEPS), kwargs=kwargs)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_distopt_muon_fp32_matches_one_process(layout):
    got = run_layout("fp32", **LAYOUTS[layout])
    assert_close_runs(reference("fp32"), got, tol=TOL["fp32"], loss_rtol=LOSS_RTOL["fp32"])


@pytest.mark.parametrize("layout", ["dp4", "tp2_pp2_dp2"])
def test_distopt_muon_bf16_matches_one_process(layout):
    got = run_layout("bf16", **LAYOUTS[layout])
    assert_close_runs(reference("bf16"), got, tol=TOL["bf16"], loss_rtol=LOSS_RTOL["bf16"])


@pytest.mark.parametrize("etp", [1, 2])
def test_distopt_muon_moe_expert_params_use_the_expert_groups(etp):
    """EP=2 (x expert TP): expert weights sit in the expert DistOpt over the expert DP group.

    The allgather dispatcher: the alltoall one gathers uneven sizes over expert TP, which gloo's
    all_gather cannot do (NCCL can); test_muon_moe.py runs the alltoall one at EP=2.
    """
    got = run_layout("fp32", 4, ep=2, etp=etp, moe=True)
    errors = assert_close_runs(
        reference("fp32", moe=True), got, tol=TOL["fp32"], loss_rtol=LOSS_RTOL["fp32"]
    )
    assert sum(".experts.local_experts." in k for k in errors) == 2 * 2 * 4


def distopts(optimizer) -> list:
    """The DistributedOptimizer instances inside a (possibly chained) Megatron optimizer."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _lose_gathered_pieces(optimizer):
    """Negative control: owners assemble matrices from zeros instead of the received pieces."""
    for distopt in distopts(optimizer):
        ortho = distopt.optimizer.orthogonalizer
        ortho._gather_to_owners = functools.partial(_zeros_instead, ortho._gather_to_owners)


def _zeros_instead(gather, bucket, by_matrix, device):
    return {i: torch.zeros_like(m) for i, m in gather(bucket, by_matrix, device).items()}


def test_negative_control_broken_gather_misses_the_reference():
    initial, ref, _ = reference("fp32")
    got = run_layout("fp32", **LAYOUTS["dp4"], hook=_lose_gathered_pieces)
    errors = update_rel_error(initial, ref, got[0][1])
    assert max(errors.values()) > 100 * TOL["fp32"]


# ------------------------------------------------------------------------- counted figures


def _step_metrics(spec: TinyGPT):
    model = build_model(spec, distopt=True, bucket_size=BUCKET, overlap_grad_reduce=True)
    optimizer = build_optimizer(spec, model, use_distributed_optimizer=True, **MUON)
    train_step(spec, model, optimizer, global_batches(spec, 1)[0])
    (distopt,) = distopts(optimizer)
    plan, ortho = distopt.muon_plan, distopt.optimizer.orthogonalizer
    momentum_bytes = sum(
        (m.end - m.start) * torch.finfo(torch.float32).bits // 8 for m in plan.matrices
    )
    return {
        "flops": plan.ns_flops_per_rank(),
        "matrices": len(plan.matrices),
        "owners": sorted({m.owner for m in plan.matrices}),
        "bytes_moved": ortho.bytes_moved,
        "bytes_counted": plan.bytes_per_step(4),
        "momentum_bytes": momentum_bytes,
        "buckets": len(plan.buckets),
        "straddling": sum(
            1
            for m in plan.matrices
            if m.start // plan.buckets[m.bucket].shard_size
            != (m.end - 1) // plan.buckets[m.bucket].shard_size
        ),
    }


@functools.cache
def dp4_metrics():
    return run_distributed(_step_metrics, 4, args=(TinyGPT(),))


def test_every_matrix_has_one_owner_and_work_is_balanced():
    metrics = dp4_metrics()
    first = metrics[0]
    assert first["matrices"] >= 16 and first["buckets"] > 1 and first["straddling"] > 0
    assert all(m["flops"] == first["flops"] for m in metrics), "ranks disagree on owners"
    assert first["owners"] == [0, 1, 2, 3]
    flops = first["flops"]
    assert max(flops) / (sum(flops) / len(flops)) <= 1.15


def test_exchange_bytes_are_within_twice_the_muon_momentum_bytes():
    for m in dp4_metrics():
        assert m["bytes_moved"] == m["bytes_counted"] > 0
        assert m["bytes_moved"] <= 2 * m["momentum_bytes"]
