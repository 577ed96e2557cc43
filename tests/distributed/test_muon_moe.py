"""An MoE GPT (4 experts, SequentialMLP, top-2) trains with Muon under expert parallelism and its
expert weights match one process (each expert is its own Muon matrix, expert-TP group for TP).

    .venv/bin/python -m pytest tests/distributed/test_muon_moe.py -q
"""

import dataclasses
import functools

import pytest
from harness import run_distributed
from parity import assert_close_runs, misses, record, split_key_bias, update_rel_error
from test_muon_distopt import BUCKET, distopts
from tiny_gpt import TinyGPT, train

from megatron.training.muon_recipe import SEED_RECIPE

STEPS = 3
SPEC = TinyGPT(num_layers=2, num_moe_experts=4, moe_token_dispatcher_type="allgather")
MUON = dict(optimizer="muon", muon_fp32_matmul_prec="highest", **SEED_RECIPE)
# Same reasoning as test_muon_parity.TOL (fp32 sums reordered by the all-to-all dispatch and
# the DP/TP reductions; NS is smooth). Top-2 routing is discrete, but a tie flip would change the
# loss by far more than LOSS_RTOL, which the comparison would catch. Measured under every
# summation order of tools/parity_margins.py: <= 2.7e-5, the router weights (AdamW, sign-like
# first steps).
TOL = 1e-4
LOSS_RTOL = 1e-5

# the DistOpt layout test_muon_distopt.py runs (small buckets, overlap), gangs forced by the hook
GANGS = dict(muon_tp_mode="distributed", distopt=True, bucket_size=BUCKET, overlap=True, gangs=True)
LAYOUTS = {
    "dp2": dict(world_size=2, ep=1),
    "ep2": dict(world_size=2, ep=2),
    "ep2_alltoall_dispatcher": dict(world_size=2, ep=2, dispatcher="alltoall"),
    # MoE with TP > 1 requires sequence parallelism, which the local spec lacks; expert TP
    # alone (etp=2, tp=1) still shards every expert matrix over the expert-TP group. Expert TP
    # needs EP > 1 here: with EP = 1 Megatron marks expert weights as dense (allreduce=True) and
    # DDP would average different expert-TP shards over the same ranks.
    "ep2_expert_tp2_duplicated": dict(world_size=4, ep=2, etp=2, muon_tp_mode="duplicated"),
    # ours: each expert matrix whole on one expert-TP rank (tp.py's owner mode)
    "ep2_expert_tp2_owner": dict(world_size=4, ep=2, etp=2, muon_tp_mode="owner"),
    # the expert matrices streamed over the expert-TP group (tp.py's stream, after the dense)
    "ep2_expert_tp2_distributed": dict(world_size=4, ep=2, etp=2, muon_tp_mode="distributed"),
    # the same under the DistributedOptimizer: the expert exchange hands its owners' matrices to
    # one stream (exchange._stream)
    "ep2_expert_tp2_distributed_distopt": dict(
        world_size=4, ep=2, etp=2, muon_tp_mode="distributed", distopt=True
    ),
    # and with gangs (low split targets): 8 ranks, so the experts' DP group has 2; each expert
    # matrix's NS runs over its 2 expert-TP ranks x 2 expert-DP ranks, the dense ones over DP 8
    "ep2_expert_tp2_distributed_distopt_gangs": dict(world_size=8, ep=2, etp=2, **GANGS),
}


def _gangs_everywhere(optimizer, broken_partial: bool = False) -> None:
    """Hook: re-plan every exchange (dense and expert) with gangs of every DP rank (low split
    targets, FLOPs alone, as test_muon_gangs.py), on every rank alike; ``broken_partial``: the
    negative control, no TP reduce-scatter of the partial sums (no rank runs it)."""
    from megatron.core.optimizer.megatron_muon.planner import gangs

    split = []
    for distopt in distopts(optimizer):
        ortho = distopt.optimizer.orthogonalizer
        model = dataclasses.replace(ortho.plan.model, link_flops_per_byte=0.0)
        plan = ortho.plan.rebuilt(model=model, targets=(0.1,), bundles=())
        ortho.plan = distopt.muon_plan = plan
        ortho.gangs.make_groups(plan)
        split += [m.name for m in plan.matrices if len(m.units) > 1]
    assert any(".experts." in name for name in split), split
    if broken_partial:
        gangs.reduce_scatter_ranges = lambda flat, bounds, p, group, dtype=None: None


@functools.cache
def reference():
    return run_distributed(train, 1, args=(SPEC, STEPS), kwargs=MUON)[0]


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS)
def test_moe_expert_weights_match_one_process(layout):
    kwargs = dict(layout)
    world, ep, etp = kwargs.pop("world_size"), kwargs.pop("ep"), kwargs.pop("etp", None)
    spec = dataclasses.replace(
        SPEC, moe_token_dispatcher_type=kwargs.pop("dispatcher", "allgather")
    )
    if kwargs.pop("gangs", False):
        kwargs["optimizer_hook"] = _gangs_everywhere
    got = run_distributed(
        train, world, ep=ep, etp=etp, args=(spec, STEPS), kwargs={**MUON, **kwargs}
    )
    errors = assert_close_runs(reference(), got, tol=TOL, loss_rtol=LOSS_RTOL)
    experts = [k for k in errors if ".experts.local_experts." in k]
    assert len(experts) == SPEC.num_layers * SPEC.num_moe_experts * 2  # fc1 and fc2 each
    initial, ref, _ = reference()
    assert all((ref[k] - initial[k]).norm() > 0 for k in experts), "an expert never trained"


def test_negative_control_expert_gangs_without_the_tp_reduce_scatter_miss():
    """The gang layout above without the TP reduce-scatter of its partial sums: each expert-TP
    rank iterates on its half's Gram alone, and the expert matrices miss the reference."""
    hook = functools.partial(_gangs_everywhere, broken_partial=True)
    kwargs = {**MUON, **GANGS, "optimizer_hook": hook}
    del kwargs["gangs"]
    got = run_distributed(train, 8, ep=2, etp=2, args=(SPEC, 1), kwargs=kwargs)
    initial, ref, _ = run_distributed(train, 1, args=(SPEC, 1), kwargs=MUON)[0]
    for _, params, _ in got:  # every rank: the experts it holds
        experts = {k: v for k, v in params.items() if ".experts.local_experts." in k}
        errors = update_rel_error(initial, {k: ref[k] for k in experts}, experts)
        assert experts and misses(errors, 100 * TOL)


# Megatron-LM's default: linear layers with biases (--disable-bias-linear turns them off). An
# expert's bias is added after its fc2, weighted by the token's routing prob; the biases are
# AdamW params, the expert matrices Muon's. Same tolerance as above, but for the attention's key
# bias, whose update is rounding noise (parity.split_key_bias): Adam moves a coordinate by at
# most ~lr per step (|m_hat| <= sqrt(v_hat)), so two runs differ by at most 2 lr per step.
BIASED = dataclasses.replace(SPEC, extra=dict(add_bias_linear=True))
LR = 1e-2  # tiny_gpt.build_optimizer's


def _split(result):
    """(result with the key rows cut from every QKV bias, the final key rows)."""
    initial, final, losses = result
    (initial, _), (final, keys) = (
        split_key_bias(s, SPEC.num_query_groups, SPEC.num_attention_heads) for s in result[:2]
    )
    return (initial, final, losses), keys


def test_moe_with_biases_matches_one_process():
    ref, ref_keys = _split(run_distributed(train, 1, args=(BIASED, STEPS), kwargs=MUON)[0])
    got, got_keys = zip(
        *map(_split, run_distributed(train, 2, ep=2, args=(BIASED, STEPS), kwargs=MUON))
    )
    errors = assert_close_runs(ref, got, tol=TOL, loss_rtol=LOSS_RTOL)
    assert len(ref_keys) == SPEC.num_layers
    for name, key in ref_keys.items():
        gap = (got_keys[0][name] - key).abs().max().item()
        record("parity", name + "[key]", gap, 2 * LR * STEPS)
        assert gap <= 2 * LR * STEPS, f"{name}[key]: {gap:.2e} > 2 lr x {STEPS} steps"
    biases = [k for k in errors if ".experts.local_experts." in k and k.endswith(".bias")]
    assert len(biases) == SPEC.num_layers * SPEC.num_moe_experts * 2
