"""QK-clip (MuonClip) after each optimizer step matches one process under TP, PP, DP and the
DistributedOptimizer, caps the logits at the threshold, and keeps DistOpt's fp32 main shards in
step with the model params.

A tiny real GPT (local spec, GQA 4 heads / 2 query groups, RoPE) whose initial max logit is ~0.73;
the threshold 0.5 makes the clip act on most heads at every step. The default rule is upstream's
(one eta per query group); ``qk_clip_per_head`` (ours, opt-in) is checked on the layouts and the
threshold too. Reproduce a case by hand:

    .venv/bin/python -m pytest tests/distributed/test_qk_clip.py -k tp2_pp2_dp2 -q
"""

import dataclasses
import functools

import pytest
import torch
from harness import run_distributed
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.multi_latent_attention import MultiLatentAttention
from parity import assert_close_runs, misses, update_rel_error
from tiny_gpt import (
    TinyGPT,
    _forward_step,
    _micro_batches,
    build_model,
    build_optimizer,
    global_batches,
    train,
    train_step,
)

from megatron.core import parallel_state as ps
from megatron.core.optimizer import DistributedOptimizer, OptimizerConfig, qk_clip
from megatron.core.optimizer.megatron_muon.factory import MegatronMuon
from megatron.training.muon_recipe import SEED_RECIPE

STEPS = 3
TAU = 0.5
CLIP = dict(qk_clip=True, qk_clip_threshold=TAU, qk_clip_alpha=0.5)
SPEC = TinyGPT(num_layers=2, extra=CLIP)
PER_HEAD = dict(CLIP, qk_clip_per_head=True)
SPEC_PER_HEAD = TinyGPT(num_layers=2, extra=PER_HEAD)
# the seed recipe: exact TP (duplicated), as the parity reference needs
MUON = dict(optimizer="muon", muon_fp32_matmul_prec="highest", **SEED_RECIPE)
BUCKET = 6000  # with overlap_grad_reduce: several buckets, QKV matrices cut by DP shards

# Tolerance on parity.update_rel_error, as in test_muon_parity.py (measured there ~7e-6 for these
# layouts without the clip). The clip adds an elementwise product by per-row factors computed from
# maxima that every layout reduces exactly (a max is order-free), so it adds fp32 rounding only.
# Without the clip the same runs miss by > 100x TOL (asserted below), so 1e-4 tests the clip.
TOL = 1e-4
LOSS_RTOL = 1e-5

LAYOUTS = {
    "tp2": dict(world_size=2, tp=2),
    "pp2": dict(world_size=2, pp=2),
    "dp2_distopt": dict(world_size=2, distopt=True, bucket_size=BUCKET, overlap=True),
    "tp2_pp2_dp2_distopt": dict(world_size=8, tp=2, pp=2, distopt=True, bucket_size=BUCKET),
}


def run_layout(world_size, tp=1, pp=1, spec=SPEC, **kwargs):
    return run_distributed(
        train, world_size, tp=tp, pp=pp, args=(spec, STEPS), kwargs={**MUON, **kwargs}
    )


@functools.cache
def reference(clip: bool = True, per_head: bool = False):
    spec = (SPEC_PER_HEAD if per_head else SPEC) if clip else TinyGPT(num_layers=2)
    return run_layout(1, spec=spec)[0]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_qk_clip_layout_matches_one_process(layout):
    assert_close_runs(reference(), run_layout(**LAYOUTS[layout]), tol=TOL, loss_rtol=LOSS_RTOL)


@pytest.mark.parametrize("layout", ["tp2", "tp2_pp2_dp2_distopt"])
def test_per_head_rule_layout_matches_one_process(layout):
    """``qk_clip_per_head``: the same parity (its factors differ per query head, so the rows of
    a group's query heads get different scales, also in DistOpt shards)."""
    got = run_layout(**LAYOUTS[layout], spec=SPEC_PER_HEAD)
    assert_close_runs(reference(per_head=True), got, tol=TOL, loss_rtol=LOSS_RTOL)


def test_the_two_rules_give_different_runs():
    """The per-head parity above is not the default's: the two rules' QKV updates differ by far
    more than TOL (heads below their group's max are scaled less per head; measured 0.36 and
    0.41 for the two layers). Negative control, checked by hand: ``_clip_layer`` ignoring
    ``qk_clip_per_head`` makes the two runs equal (0.0) and fails this."""
    initial, per_group, _ = reference()
    _, per_head, _ = reference(per_head=True)
    errors = update_rel_error(initial, per_group, per_head)
    assert max(e for k, e in errors.items() if "linear_qkv" in k) > 100 * TOL


def test_the_clip_changes_the_run():
    """Without it the reference moves the QKV weights far beyond TOL: parity is not vacuous."""
    initial, clipped, _ = reference()
    _, unclipped, _ = reference(clip=False)
    errors = update_rel_error(initial, clipped, unclipped)
    assert min(e for k, e in errors.items() if "linear_qkv" in k) > 100 * TOL


def _key_scale_on_value_rows(optimizer):
    """Negative control: the key heads' factor lands on the value rows, the key rows keep 1.
    (Swapping the query and key factors, the control before the default became upstream's
    per-group rule, is no control with it at alpha 1/2: both factors are eta_g ** 1/2.)"""

    def wrong(q_scale, k_scale, head_dim):
        rows = original(q_scale, torch.ones_like(k_scale), head_dim).view(k_scale.numel(), -1)
        rows[:, -head_dim:] = k_scale.view(-1, 1)
        return rows.reshape(-1)

    original = qk_clip.qkv_row_scales
    qk_clip.qkv_row_scales = wrong  # in this forked rank only


def test_negative_control_wrong_rows_miss_the_reference():
    initial, ref, _ = reference()
    got = run_layout(**LAYOUTS["tp2"], optimizer_hook=_key_scale_on_value_rows)
    errors = update_rel_error(initial, ref, got[0][1])
    assert misses(errors, 100 * TOL)


# ------------------------------------------------------------------ logits end at the threshold


def _forward_maxima(spec, model, batch) -> list:
    """Per-layer per-head maxima the local attention records over one global batch (training
    mode, forward only), DP-reduced by a log-only clip_qk pass."""
    get_forward_backward_func()(
        forward_step_func=_forward_step,
        data_iterator=iter(_micro_batches(spec, batch)),
        model=model,
        num_microbatches=len(_micro_batches(spec, batch)),
        seq_length=spec.seq_length,
        micro_batch_size=spec.micro_batch_size,
        forward_only=True,
    )
    kinds = (SelfAttention, MultiLatentAttention)
    layers = [m for m in model[0].modules() if isinstance(m, kinds)]
    maxima = [layer.core_attention.current_max_attn_logits.clone() for layer in layers]
    group = ps.get_data_parallel_group()
    for m in maxima:
        torch.distributed.all_reduce(m, op=torch.distributed.ReduceOp.MAX, group=group)
    return maxima


def capped_run(per_head: bool = False):
    # One layer: a later layer's input changes with the clip of the layers before it, so only
    # the first layer's logits are a function of its own weights and the batch alone.
    spec = TinyGPT(num_layers=1, extra=PER_HEAD if per_head else CLIP)
    model = build_model(spec)
    batch = global_batches(spec, 1)[0]
    before = _forward_maxima(spec, model, batch)
    qk_clip.clip_qk(model)  # the same maxima: no optimizer step in between
    after = _forward_maxima(spec, model, batch)
    return before, after, spec.num_query_groups // ps.get_tensor_model_parallel_world_size()


@pytest.mark.parametrize("per_head", [False, True], ids=["per_group", "per_head"])
@pytest.mark.parametrize("layout", [dict(world_size=1), dict(world_size=2, tp=2)], ids=str)
def test_logits_above_threshold_end_at_it(layout, per_head):
    """A head's logit is bilinear in its query and key rows: after the clip (either rule) the
    largest logit of every group that exceeded tau equals tau, and no head exceeds it (fp32
    rounding: 1e-5)."""
    for before, after, groups in run_distributed(capped_run, **layout, args=(per_head,)):
        clipped = 0
        for b, a in zip(before, after):
            for b_group, a_group in zip(b.view(groups, -1), a.view(groups, -1)):
                if b_group.max() > TAU:
                    clipped += 1
                    assert a_group.max().item() == pytest.approx(TAU, rel=1e-5)
                    assert (a_group <= TAU * (1 + 1e-5)).all()
                else:
                    torch.testing.assert_close(a_group, b_group, rtol=1e-5, atol=0)
        assert clipped > 0, "the threshold should have been exceeded"


# --------------------------------------------------- DistOpt: fp32 main shards cut through heads


# "muon" is this fork's Muon: on 0.19.2 optimizer="muon" alone builds upstream's emerging-optimizers
# Muon (muon_impl defaults to "emerging"), chained under Float16Optimizers, with no DistOpt shards.
# "upstream_muon": that one as upstream's CLI builds it with --use-distributed-optimizer
# (--optimizer muon turns it into the LayerWiseDistributedOptimizer: whole fp32 main params, each
# on the rank that owns the matrix, and none on the others).
OPTIMIZERS = {
    "adam": dict(optimizer="adam"),
    "muon": MUON,
    "upstream_muon": dict(
        optimizer="muon", muon_impl="emerging", use_layer_wise_distributed_optimizer=True
    ),
}
HAS_UPSTREAM_MUON = "muon_impl" in {f.name for f in dataclasses.fields(OptimizerConfig)}


def main_shard_run(optimizer_name: str, break_shards: bool = False, distopt: bool = True):
    """bf16 with DP2 DistOpt and small buckets (or one process, whole fp32 main params): after
    the clip each rank's fp32 main copy of every QKV matrix must equal its model param region to
    bf16 rounding."""
    # hidden 80 (rows of 80 elements): DistOpt's 64-element-aligned shard bounds fall inside rows
    spec = TinyGPT(num_layers=2, hidden_size=80, dtype="bf16", extra=CLIP)
    model = build_model(spec, distopt=distopt, bucket_size=BUCKET, overlap_grad_reduce=distopt)
    optimizer = build_optimizer(
        spec, model, use_distributed_optimizer=distopt, **OPTIMIZERS[optimizer_name]
    )
    chain = getattr(optimizer, "chained_optimizers", [optimizer])
    if optimizer_name == "muon":  # ours, not 0.19's emerging-optimizers Muon (muon_impl)
        assert any(isinstance(getattr(o, "optimizer", None), MegatronMuon) for o in chain)
    if distopt:  # every 16-bit param's main copy is a DistOpt shard (or none on this rank)
        assert all(isinstance(o, DistributedOptimizer) for o in chain), chain
    if optimizer_name == "upstream_muon":
        assert type(optimizer).__name__ == "LayerWiseDistributedOptimizer", type(optimizer)
    if break_shards:  # negative control: treat every shard as if it began at the matrix's start
        qk_clip.shard_start = lambda optimizer, param: 0
    # checked after every step: the first step's clip is the strong one (logits from ~0.87 to
    # tau); after it Muon's small update leaves them barely above tau, the next clip near 1
    worst, max_logit = 0.0, float("-inf")
    for batch in global_batches(spec, 2):
        max_logit = max(max_logit, train_step(spec, model, optimizer, batch)["max_logit"])
        step_worst, row_cuts, held = _main_shard_miss(model, optimizer, distopt)
        worst = max(worst, step_worst)
    return worst, row_cuts, max_logit, held


def _reference_start(optimizer, param) -> int:
    """The offset of this rank's main shard of ``param``, read off its DistributedOptimizer here,
    not by qk_clip.shard_start (the code under test)."""
    chain = getattr(optimizer, "chained_optimizers", [optimizer])
    (owner,) = [o for o in chain if param in o.model_param_gbuf_map]
    return owner._get_model_param_range_map(param)["param"].start


def _main_shard_miss(model, optimizer, distopt: bool):
    """(worst relative miss of a QKV main copy against its model param region, how many main
    shards start inside a row, how many main copies were compared) on this rank."""
    worst, row_cuts, held = 0.0, 0, 0
    for layer in (m for m in model[0].modules() if isinstance(m, SelfAttention)):
        weight = layer.linear_qkv.weight
        if getattr(weight, "main_param", None) is None:  # this rank holds none of it
            continue
        start = _reference_start(optimizer, weight) if distopt else 0
        region = weight.detach().view(-1)[start : start + weight.main_param.numel()].float()
        rel = (weight.main_param.view(-1) - region).abs() / region.abs().clamp_min(1e-30)
        worst = max(worst, rel.nan_to_num(nan=float("inf")).max().item())  # a NaN: a miss
        row_cuts += int(start % weight.shape[1] != 0)
        held += 1
    return worst, row_cuts, held


# The model param is bf16(bf16(main) * r), the main shard main * r: two roundings to bf16's 8
# significant bits, each at most 2**-8 relative, so <= ~2**-7 (measured up to 0.0077); 2**-6
# leaves 2x. A shard scaled with another row's factor is off by the ratio of two factors (query
# or key ~0.8 against value 1 at the first step; measured 0.29 with Adam and with our Muon), over
# 5x this bound.
BF16_REL = 2.0**-6


def _check_main_shards(results, expect_ok: bool, sharded: bool = True):
    worst = max(w for w, _, _, _ in results)
    assert all(m > TAU for _, _, m, _ in results), "the clip had nothing to do: test too weak"
    assert sum(held for _, _, _, held in results) > 0, "no main copy compared: test vacuous"
    if sharded:
        assert sum(cuts for _, cuts, _, _ in results) > 0, "no shard starts inside a row: too weak"
    if expect_ok:
        assert worst <= BF16_REL, worst
    else:
        assert worst > 5 * BF16_REL, worst


@pytest.mark.parametrize("optimizer_name", ["adam", "muon"])
def test_distopt_main_shards_are_clipped_with_their_rows(optimizer_name):
    """Adam and our Muon (muon_impl='megatron_muon') on bf16 DP2 DistOpt: each rank's fp32 main
    shard of a QKV matrix is scaled with the rows it holds. Negative control (checked by hand):
    qk_clip.shard_start returning 0 fails both cases (miss 0.29 > BF16_REL); the test reads the
    true offset off the DistOpt itself, not through shard_start."""
    _check_main_shards(run_distributed(main_shard_run, 2, args=(optimizer_name,)), True)


@pytest.mark.parametrize("optimizer_name", ["adam", "muon"])
def test_negative_control_shards_scaled_from_the_wrong_offset(optimizer_name):
    """``shard_start`` returning 0 (each shard scaled as if it began at its matrix's start, the
    rows of another part of the matrix) misses by > 5x BF16_REL: the test above sees the offset."""
    _check_main_shards(run_distributed(main_shard_run, 2, args=(optimizer_name, True)), False)


def test_float16_optimizer_main_params_are_clipped_too():
    """Without DistOpt, Megatron's Float16Optimizer keeps whole fp32 main params."""
    results = run_distributed(main_shard_run, 1, args=("adam", False, False))
    _check_main_shards(results, True, sharded=False)


@pytest.mark.skipif(
    not HAS_UPSTREAM_MUON, reason="megatron-core < 0.17: no emerging-optimizers Muon"
)
def test_upstream_layer_wise_muon_main_params_are_clipped_too():
    """Upstream 0.19's Muon under its LayerWiseDistributedOptimizer (what its CLI builds for
    --optimizer muon --use-distributed-optimizer): the owner rank's whole fp32 main params."""
    results = run_distributed(main_shard_run, 2, args=("upstream_muon", False, False))
    _check_main_shards(results, True, sharded=False)


def unplaceable_main_run(case: str) -> str:
    """The error clip_qk raises where a DistOpt main shard cannot be placed, or "no error"."""
    spec = TinyGPT(num_layers=2, hidden_size=80, dtype="bf16", extra=CLIP)
    model = build_model(spec, distopt=True, bucket_size=BUCKET)
    optimizer = build_optimizer(spec, model, use_distributed_optimizer=True)
    layers = [m for m in model[0].modules() if isinstance(m, SelfAttention)]
    # DP2: each rank holds a shard of some QKV matrix (rows of 80 elements: the ranks cut them)
    weight = next(w for w in (m.linear_qkv.weight for m in layers) if w.main_param is not None)
    if case == "not_given":  # the torch optimizer inside, not the DistOpt that shards
        optimizer = optimizer.chained_optimizers[0].optimizer
    else:  # "main_elsewhere": as with the precision-aware optimizer (main copy in FusedAdam)
        weight.main_param = None
    try:
        qk_clip.clip_qk(model, optimizer=optimizer)  # no forward: maxima -inf, scales of 1
    except ValueError as error:
        return str(error)
    return "no error"


@pytest.mark.parametrize(
    "case, message",
    [("not_given", "no DistributedOptimizer in the given"), ("main_elsewhere", "no main_param")],
)
def test_a_main_shard_the_clip_cannot_place_is_an_error(case, message):
    """Never a silent skip: a sharded main copy without its DistOpt, or a DistOpt range without
    a main copy to scale, raises (the scales are all 1 here: the check is before any scaling)."""
    for error in run_distributed(unplaceable_main_run, 2, args=(case,)):
        assert message in error, error
