"""QK-clip with multi-latent attention (MLA) on the local spec: our clip applies upstream 0.19's
``MLASelfAttention.clip_qk`` rule (q_nope rows by eta ** alpha, k_nope rows by eta ** (1 - alpha),
q_pe rows by eta, the shared k_pe and the values alone) in the model params and in every fp32
main copy, DistOpt shards included, which upstream's method cannot place (it views a 1-D shard
as the whole matrix: a RuntimeError, or None.data on a rank holding none of it).

A tiny real GPT with MLA (4 heads, q_lora_rank 40, kv_lora_rank 24, qk_head_dim 16,
qk_pos_emb_head_dim 8, v_head_dim 16, RoPE); initial per-head maxima 0.13-0.20, so tau 0.14
clips most heads and leaves some alone. Reproduce a case by hand:

    .venv/bin/python -m pytest tests/distributed/test_qk_clip_mla.py -k tp2 -q
"""

import functools

import pytest
import torch
from harness import run_distributed
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from parity import assert_close_runs, misses, update_rel_error
from test_qk_clip import BF16_REL, MUON, OPTIMIZERS, _forward_maxima, _reference_start
from tiny_gpt import (
    TinyGPT,
    build_model,
    build_optimizer,
    full_params,
    global_batches,
    train,
    train_step,
)

from megatron.core import parallel_state as ps
from megatron.core.optimizer import DistributedOptimizer, qk_clip

MLA = dict(q_lora_rank=40, kv_lora_rank=24, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16)
NOPE, PE, V = MLA["qk_head_dim"], MLA["qk_pos_emb_head_dim"], MLA["v_head_dim"]
TAU = 0.14
CLIP = dict(qk_clip=True, qk_clip_threshold=TAU, qk_clip_alpha=0.5)
SP = dict(sequence_parallel=True)  # as the MTP recipe runs MLA: TP 2 with sequence parallelism


def mla_spec(layers=2, mla=MLA, extra=CLIP, **kwargs) -> TinyGPT:
    return TinyGPT(num_layers=layers, hidden_size=80, mla=mla, extra=extra, **kwargs)


def mla_layers(model) -> list:
    return [m for m in model[0].modules() if isinstance(m, MLASelfAttention)]


def q_weight(layer):
    return (
        layer.linear_q_proj if layer.config.q_lora_rank is None else layer.linear_q_up_proj
    ).weight


# ---------------------------------------------------- against upstream's MLASelfAttention.clip_qk

# Per-head maxima, tau 1: three heads above it (different etas), one below; alpha 0.3 makes the
# q_pe rows' eta differ from the q_nope rows' eta ** alpha.
MAXIMA = [4.0, 2.0, 0.5, 3.0]
UPSTREAM_CLIP = dict(qk_clip=True, qk_clip_threshold=1.0, qk_clip_alpha=0.3)


def upstream_vs_ours(q_lora_rank):
    """This rank's (q, kv up-proj) weights before, after upstream's ``MLASelfAttention.clip_qk``
    and after our ``clip_qk``, from the same weights and this TP rank's heads of ``MAXIMA``."""
    model = build_model(mla_spec(1, dict(MLA, q_lora_rank=q_lora_rank), UPSTREAM_CLIP))
    (layer,) = mla_layers(model)
    heads = layer.num_attention_heads_per_partition
    rank = ps.get_tensor_model_parallel_rank()
    maxima = torch.tensor(MAXIMA[rank * heads : (rank + 1) * heads])
    weights = [q_weight(layer), layer.linear_kv_up_proj.weight]
    initial = [w.detach().clone() for w in weights]
    layer.core_attention.current_max_attn_logits = maxima.clone()
    MLASelfAttention.clip_qk(layer)  # upstream 0.19.2's method (pure torch once maxima are set)
    upstream = [w.detach().clone() for w in weights]
    for w, w0 in zip(weights, initial):
        w.data.copy_(w0)
    layer.core_attention.current_max_attn_logits = maxima.clone()
    qk_clip.clip_qk(model)
    return initial, upstream, [w.detach().clone() for w in weights]


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
@pytest.mark.parametrize("q_lora_rank", [40, None], ids=["q_lora", "q_proj"])
def test_mla_clip_equals_upstreams_clip_qk(q_lora_rank, tp):
    """Bit for bit: the same fp32 factors (tau / S_h, its powers) times the same weights, one
    elementwise product per row either way (measured: equal; upstream's MLA method, unlike its
    SelfAttention one, splits the TP-local weight by local sizes, so it runs under TP2 too)."""
    for initial, upstream, ours in run_distributed(
        upstream_vs_ours, tp, tp=tp, args=(q_lora_rank,)
    ):
        for w0, up, our in zip(initial, upstream, ours):
            assert not torch.equal(up, w0)  # the clip acted
            assert torch.equal(our, up)


# ------------------------------------------------------------------ logits end at the threshold


def _rope_rows_like_nope(original):
    """Negative control: q_pe rows scaled by eta ** alpha, as the q_nope rows (upstream's rope
    treatment forgotten): the shared k_pe is left alone, so the pe part of a logit keeps eta **
    (1 - alpha) too much."""

    def wrong(max_logits, config):
        q, kv = original(max_logits, config)
        q = q.view(max_logits.numel(), NOPE + PE)
        q[:, NOPE:] = q[:, :1]
        return q.reshape(-1), kv

    return wrong


def capped_run(extra: dict, wrong_rope: bool = False):
    """One MLA layer: per-head maxima over one global batch before and after the clip (no step
    in between), and which rows of this rank's q and kv up-proj weights changed."""
    if wrong_rope:  # in this forked rank only
        qk_clip.mla_row_scales = _rope_rows_like_nope(qk_clip.mla_row_scales)
    spec = mla_spec(1, extra={**CLIP, **extra})
    model = build_model(spec)
    batch = global_batches(spec, 1)[0]
    (layer,) = mla_layers(model)
    weights = [q_weight(layer), layer.linear_kv_up_proj.weight]
    initial = [w.detach().clone() for w in weights]
    before = _forward_maxima(spec, model, batch)
    qk_clip.clip_qk(model)
    after = _forward_maxima(spec, model, batch)
    changed = [(w.detach() != w0).any(dim=1) for w, w0 in zip(weights, initial)]
    return before[0], after[0], changed


CAPPED = {"tp1": (1, {}), "tp2_sp": (2, SP)}


@pytest.mark.parametrize("layout", CAPPED)
def test_mla_logits_above_threshold_end_at_it(layout):
    """Every logit of head h scales by eta_h (q_nope.k_nope by eta ** alpha * eta ** (1 - alpha),
    q_pe.k_pe by eta): a head above tau ends at tau (fp32 rounding of the factors and of the
    recomputed logits: 1e-5 relative), a head below keeps its rows and its max bit for bit."""
    world, extra = CAPPED[layout]
    clipped = 0
    for before, after, (q_changed, kv_changed) in run_distributed(
        capped_run, world, tp=world, args=(extra,)
    ):
        q_changed, kv_changed = q_changed.view(-1, NOPE + PE), kv_changed.view(-1, NOPE + V)
        for h, (b, a) in enumerate(zip(before.tolist(), after.tolist())):
            if b > TAU:
                clipped += 1
                assert a == pytest.approx(TAU, rel=1e-5)
                assert q_changed[h].all() and kv_changed[h, :NOPE].all()
            else:
                assert a == b and not q_changed[h].any() and not kv_changed[h].any()
            assert not kv_changed[h, NOPE:].any()  # the value rows never change
    assert 0 < clipped < 4, clipped  # some heads clipped, some left alone


def test_negative_control_rope_rows_scaled_like_nope_overshoot():
    """The rule with upstream's q_pe treatment forgotten leaves the clipped heads above tau by
    far more than the 1e-5 above (measured 2.2% to 15% over tau, against 1e-7 with the rule)."""
    ((before, after, _),) = run_distributed(capped_run, 1, args=({}, True))
    over = [a / TAU - 1 for b, a in zip(before.tolist(), after.tolist()) if b > TAU]
    assert over and min(over) > 1e-3, over


# ----------------------------------------------------- one process against TP2+SP, DP2 DistOpt


def clipped_params(extra: dict):
    """Two MLA layers' full params after one forward (training mode) and the clip alone."""
    spec = mla_spec(extra={**CLIP, **extra})
    model = build_model(spec)
    _forward_maxima(spec, model, global_batches(spec, 1)[0])
    qk_clip.clip_qk(model)
    return full_params(model, spec)


def test_mla_clip_tp2_sp_equals_one_process():
    """TP2 with sequence parallelism: each rank clips its own heads' rows, and the gathered
    params equal one process's. The maxima come from other matmul splits (the kv down-proj is
    column-parallel, gathered), so they and the etas may differ in the last fp32 bits: 1e-6
    relative (measured 2.4e-7). One forward and the clip alone; training at TP2+SP is
    ``test_mla_qk_clip_layout_matches_one_process``."""
    ((ref),) = run_distributed(clipped_params, 1, args=({},))
    ((initial),) = run_distributed(full_params_at_init, 1)
    for got in run_distributed(clipped_params, 2, tp=2, args=(SP,)):
        assert any(not torch.equal(ref[k], initial[k]) for k in ref)  # the clip acted
        for name in ref:
            torch.testing.assert_close(got[name], ref[name], rtol=1e-6, atol=0)


def full_params_at_init():
    spec = mla_spec()
    return full_params(build_model(spec), spec)


STEPS = 3
TOL, LOSS_RTOL = 1e-4, 1e-5  # as tests/distributed/test_qk_clip.py (same reasons)
LAYOUTS = {
    "dp2_distopt": dict(world_size=2, distopt=True, bucket_size=6000, overlap=True),
    "tp2_sp": dict(world_size=2, tp=2, extra=SP),  # MLA's TP grads: patches 0019, 0020
}


def run_layout(world_size, tp=1, extra=None, clip=True, **kwargs):
    spec = mla_spec(extra={**(CLIP if clip else {}), **(extra or {})})
    return run_distributed(train, world_size, tp=tp, args=(spec, STEPS), kwargs={**MUON, **kwargs})


@functools.cache
def reference(clip: bool = True):
    return run_layout(1, clip=clip)[0]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_mla_qk_clip_layout_matches_one_process(layout):
    """Our Muon (the seed recipe) with the clip after each step: DP2 DistOpt (fp32, small
    buckets, fp32 main shards that are views of the params), or TP2 with sequence parallelism,
    ends with one process's params (measured 5.5e-6, 7.8e-6; TP2+SP without patch 0019: 0.48
    on the kv down-proj)."""
    assert_close_runs(reference(), run_layout(**LAYOUTS[layout]), tol=TOL, loss_rtol=LOSS_RTOL)


def test_the_mla_clip_changes_the_run():
    """Without the clip the q and kv up-proj weights move far beyond TOL (measured 0.59-0.94):
    parity is not vacuous."""
    initial, clipped, _ = reference()
    _, unclipped, _ = reference(clip=False)
    errors = update_rel_error(initial, clipped, unclipped)
    up = {k: e for k, e in errors.items() if "up_proj" in k}
    assert len(up) == 4 and misses(up, 100 * TOL)
    assert min(up.values()) > 100 * TOL, up


# --------------------------------------------------- DistOpt: bf16 main shards cut through rows


def main_shard_run(optimizer_name: str, break_shards: bool = False):
    """bf16 DP2 DistOpt, small buckets, two steps: after each clip, the worst relative miss of a
    q / kv up-proj main shard against its model param region, the shards that start inside a
    row, how many were compared, the max logit."""
    spec = mla_spec(dtype="bf16")
    # 3000: rank 1's kv up-proj shard starts inside a row (rows of 24), its q shard at row 16
    model = build_model(spec, distopt=True, bucket_size=3000, overlap_grad_reduce=True)
    optimizer = build_optimizer(
        spec, model, use_distributed_optimizer=True, **OPTIMIZERS[optimizer_name]
    )
    chain = getattr(optimizer, "chained_optimizers", [optimizer])
    assert all(isinstance(o, DistributedOptimizer) for o in chain), chain
    if break_shards:  # negative control: every shard scaled as if it began at its matrix's start
        qk_clip.shard_start = lambda optimizer, param: 0
    worst, cuts, held, max_logit = 0.0, 0, 0, float("-inf")
    for batch in global_batches(spec, 2):
        max_logit = max(max_logit, train_step(spec, model, optimizer, batch)["max_logit"])
        for layer in mla_layers(model):
            for weight in (q_weight(layer), layer.linear_kv_up_proj.weight):
                if weight.main_param is None:  # this rank holds none of it
                    continue
                start = _reference_start(optimizer, weight)
                main = weight.main_param.view(-1)
                region = weight.detach().view(-1)[start : start + main.numel()].float()
                rel = (main - region).abs() / region.abs().clamp_min(1e-30)
                worst = max(worst, rel.nan_to_num(nan=float("inf")).max().item())
                cuts, held = cuts + int(start % weight.shape[1] != 0), held + 1
    return worst, cuts, held, max_logit


@pytest.mark.parametrize("broken", [False, True], ids=["clipped", "negative_control"])
@pytest.mark.parametrize("optimizer_name", ["adam", "muon"])
def test_mla_distopt_main_shards_are_clipped_with_their_rows(optimizer_name, broken):
    """Adam and our Muon (muon_impl='megatron_muon') on bf16 DP2 DistOpt: each fp32 main shard
    of the q and kv up projections, cut inside rows, ends equal to its model rows to bf16
    rounding (BF16_REL, test_qk_clip.py: two roundings to bf16; measured 0.0071 both). Negative
    control: ``shard_start`` returning 0 scales shards with another part's factors, > 5x
    BF16_REL (measured 0.40 Adam, 0.30 Muon)."""
    results = run_distributed(main_shard_run, 2, args=(optimizer_name, broken))
    worst = max(r[0] for r in results)
    assert sum(r[1] for r in results) > 0, "no shard starts inside a row: too weak"
    assert sum(r[2] for r in results) > 0, "no main shard compared: vacuous"
    assert all(r[3] > TAU for r in results), "the clip had nothing to do: too weak"
    if broken:
        assert worst > 5 * BF16_REL, worst
    else:
        assert worst <= BF16_REL, worst


# ------------------------------------------------------------------------------ config checks

MLA_CONFIG = dict(num_layers=1, hidden_size=64, num_attention_heads=4, **MLA)


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(qk_clip_alpha=1.0), r"qk_clip_alpha must be in \(0, 1\), got 1\.0"),
        (dict(qk_clip_threshold=0.0), "qk_clip_threshold must be a finite number > 0"),
        (dict(qk_clip_per_head=True), "qk_clip_per_head does not apply to multi_latent_attention"),
    ],
)
def test_bad_mla_qk_clip_configs_name_the_field(fields, message):
    """Patch 0013's checks, which apply to the local attention our QK-clip serves (a Transformer
    Engine config keeps upstream's own: test_qk_clip_rule.py)."""
    from megatron.core.transformer import MLATransformerConfig

    with pytest.raises(ValueError, match=message):
        MLATransformerConfig(**MLA_CONFIG, qk_clip=True, transformer_impl="local", **fields)


def test_mla_qk_clip_takes_qk_layernorm():
    """MLA's q/kv norms act on the latents, before the up projections the clip scales (the MTP
    recipe's --qk-layernorm); with GQA the flag is refused (tests/unit/test_qk_clip_rule.py)."""
    from megatron.core.transformer import MLATransformerConfig

    config = MLATransformerConfig(**MLA_CONFIG, qk_clip=True, qk_layernorm=True)
    assert config.qk_clip and config.qk_layernorm
