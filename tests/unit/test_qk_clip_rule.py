"""QK-clip's rule (upstream's per-group default, our opt-in per-head one) on hand-made weights
and against upstream's own ``SelfAttention.clip_qk``, the recorded max logit, and the config
checks.

.venv/bin/python -m pytest tests/unit/test_qk_clip_rule.py -q
"""

import contextlib
import io
import math
from types import SimpleNamespace

import pytest
import torch
from cli_config import transformer_config
from harness import run_distributed
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.max_attention_logit import record_max_attention_logit

from megatron.core.optimizer import qk_clip
from megatron.core.optimizer.qk_clip import head_scales, qkv_row_scales, scale_rows_

S2 = math.sqrt(2.0)


def test_head_scales_by_hand_per_head():
    """``per_head=True`` (``qk_clip_per_head``): 4 query heads in 2 groups, tau 2, alpha 1/2:
    eta = (1/2, 1, 1, 1/4); a query head takes its own eta**alpha, a key head its group's
    smallest eta (largest logit) ** (1 - alpha)."""
    q, k = head_scales(torch.tensor([4.0, 1.0, 0.5, 8.0]), 2, 2.0, 0.5, per_head=True)
    torch.testing.assert_close(q, torch.tensor([1 / S2, 1.0, 1.0, 0.5]))
    torch.testing.assert_close(k, torch.tensor([1 / S2, 0.5]))
    q, k = head_scales(torch.tensor([4.0, 1.0]), 1, threshold=2.0, alpha=0.25, per_head=True)
    torch.testing.assert_close(q, torch.tensor([0.5**0.25, 1.0]))
    torch.testing.assert_close(k, torch.tensor([0.5**0.75]))


def test_head_scales_default_is_upstreams_per_group_rule():
    """The default (upstream's rule): every query head of a group takes the group's eta**alpha,
    eta_g = tau / (the group's max): heads 1 and 2 (below tau, or above it but below their
    group's max) are scaled as their group's largest head. Negative control, checked by hand:
    with ``per_head``'s default flipped to True this test fails (q = [1/S2, 1, 1, 1/2])."""
    q, k = head_scales(torch.tensor([4.0, 1.0, 0.5, 8.0]), 2, threshold=2.0, alpha=0.5)
    torch.testing.assert_close(q, torch.tensor([1 / S2, 1 / S2, 0.5, 0.5]))
    torch.testing.assert_close(k, torch.tensor([1 / S2, 0.5]))
    q, k = head_scales(torch.tensor([4.0, 1.0]), 1, threshold=2.0, alpha=0.25)
    torch.testing.assert_close(q, torch.tensor([0.5**0.25, 0.5**0.25]))
    torch.testing.assert_close(k, torch.tensor([0.5**0.75]))


@pytest.mark.parametrize("per_head", [False, True])
def test_heads_at_or_below_tau_and_unrecorded_heads_are_left_alone(per_head):
    q, k = head_scales(torch.tensor([2.0, -3.0, float("-inf"), 0.0]), 2, 2.0, 0.5, per_head)
    assert q.tolist() == [1.0] * 4 and k.tolist() == [1.0, 1.0]
    q, k = head_scales(torch.tensor([float("inf"), float("nan")]), 1, 2.0, 0.5, per_head)
    assert q.tolist() == [1.0, 1.0] and k.tolist() == [1.0]  # overflowed: not zeroed


def test_row_scales_follow_megatrons_fused_qkv_layout():
    """Per group: the group's query heads, then its key head, then its value head (head_dim rows
    each), as SelfAttention.get_query_key_value_tensors splits them."""
    rows = qkv_row_scales(torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([5.0, 6.0]), 2)
    assert rows.tolist() == [1, 1, 2, 2, 5, 5, 1, 1, 3, 3, 4, 4, 6, 6, 1, 1]


def _logits(w_q, w_k, x, heads, groups, dim):
    """[heads] max over token pairs of q_h . k_g(h), with GQA's key head sharing."""
    q = (x @ w_q.T).view(-1, heads, dim)
    k = (x @ w_k.T).view(-1, groups, dim).repeat_interleave(heads // groups, dim=1)
    return torch.einsum("shd,thd->hst", q, k).amax(dim=(1, 2))


@pytest.mark.parametrize("per_head", [False, True])
def test_clipped_hand_made_weights_cap_every_head_at_tau(per_head):
    """Random Q/K weights of 4 heads / 2 key heads, fused as Megatron fuses them: after scaling
    the rows, each head's max logit is S_h * eta_q * eta_k <= tau, with equality for the largest
    head of a group over tau; a group below tau is untouched. Both rules."""
    gen = torch.Generator().manual_seed(0)
    heads, groups, dim, hidden = 4, 2, 3, 5
    w_q, w_k = torch.randn(heads * dim, hidden, generator=gen), torch.randn(groups * dim, hidden)
    w_k[:dim] *= 4  # group 0 far above tau, group 1 below it
    w_v = torch.randn(groups * dim, hidden, generator=gen)
    x = torch.randn(7, hidden, generator=gen)
    before = _logits(w_q, w_k, x, heads, groups, dim)
    tau = (before[2:].max().item() + before[:2].max().item()) / 2
    assert before[:2].max() > tau > before[2:].max()
    fused = _fuse(w_q, w_k, w_v, groups)
    rows = qkv_row_scales(*head_scales(before, groups, tau, 0.5, per_head), dim)
    scale_rows_(fused.view(-1), rows, hidden, start=0)
    after = _logits(*_unfuse(fused, heads, groups, dim)[:2], x, heads, groups, dim)
    assert after[:2].max().item() == pytest.approx(tau, rel=1e-5)
    assert (after <= tau * (1 + 1e-5)).all()
    torch.testing.assert_close(after[2:], before[2:])
    torch.testing.assert_close(_unfuse(fused, heads, groups, dim)[2], w_v)  # values untouched


def _fuse(w_q, w_k, w_v, groups):
    per = [t.view(groups, -1, t.shape[1]) for t in (w_q, w_k, w_v)]
    return torch.cat(per, dim=1).reshape(-1, w_q.shape[1]).clone()


def _unfuse(fused, heads, groups, dim):
    g = fused.view(groups, -1, fused.shape[1])
    q_rows = heads // groups * dim
    parts = g[:, :q_rows], g[:, q_rows : q_rows + dim], g[:, q_rows + dim :]
    return [p.reshape(-1, fused.shape[1]) for p in parts]


@pytest.mark.parametrize("cuts", [[0, 7, 20, 33, 48], [0, 16, 48], [0, 48], [0, 7, 10, 12, 48]])
def test_shards_scaled_from_their_offset_equal_the_whole(cuts):
    """A DistOpt shard is a piece of the flattened matrix that may start and end inside rows."""
    whole = torch.randn(8, 6)
    rows = torch.arange(1.0, 9.0)
    expected = whole * rows[:, None]
    flat = whole.clone().view(-1)
    pieces = [flat[a:b] for a, b in zip(cuts, cuts[1:])]
    for (start, _), piece in zip(zip(cuts, cuts[1:]), pieces):
        scale_rows_(piece, rows, 6, start)
    torch.testing.assert_close(flat.view(8, 6), expected)
    wrong = whole.clone().view(-1)
    scale_rows_(wrong[7:20], rows, 6, 0)  # negative control: the offset forgotten
    assert not torch.allclose(wrong[7:20], expected.view(-1)[7:20])


# ------------------------------------------------------- against upstream's SelfAttention.clip_qk

# Per-head maxima of 4 query heads in 2 groups, tau 1: group 0 has two heads above tau with
# different maxima (4 and 2: the two rules differ on head 1); group 1 one head above (3).
MAXIMA = [4.0, 2.0, 0.5, 3.0]
UPSTREAM_CLIP = dict(qk_clip=True, qk_clip_threshold=1.0, qk_clip_alpha=0.3)


def upstream_vs_ours(per_head: bool, run_upstream: bool = True):
    """On a real 1-layer GPT (local spec, GQA 4 heads / 2 groups, no QKV bias): this rank's
    fused QKV weight before, after upstream's ``SelfAttention.clip_qk`` (None unless
    ``run_upstream``) and after our ``clip_qk`` (the default rule, or ``qk_clip_per_head``),
    each from the same weight and the same maxima (this TP rank's heads of ``MAXIMA``)."""
    from megatron.core.transformer.attention import SelfAttention
    from tiny_gpt import TinyGPT, build_model

    from megatron.core import parallel_state as ps

    extra = dict(UPSTREAM_CLIP, qk_clip_per_head=True) if per_head else UPSTREAM_CLIP  # default
    model = build_model(TinyGPT(num_layers=1, extra=extra))
    (layer,) = [m for m in model[0].modules() if isinstance(m, SelfAttention)]
    heads = layer.core_attention.num_attention_heads_per_partition
    rank = ps.get_tensor_model_parallel_rank()
    maxima = torch.tensor(MAXIMA[rank * heads : (rank + 1) * heads])
    weight = layer.linear_qkv.weight
    initial = weight.detach().clone()
    upstream = None
    if run_upstream:
        layer.core_attention.current_max_attn_logits = maxima.clone()
        SelfAttention.clip_qk(layer)  # upstream 0.19.2's method, unchanged in the fork
        upstream = weight.detach().clone()
        weight.data.copy_(initial)
    layer.core_attention.current_max_attn_logits = maxima.clone()
    qk_clip.clip_qk(model)
    return initial, upstream, weight.detach().clone()


def test_default_rule_equals_upstreams_clip_qk():
    """Upstream's ``SelfAttention.clip_qk`` (pure torch: it runs without Transformer Engine once
    the maxima are set) and our default clip give the same weights, to fp32 rounding (the same
    factors, eta_g**alpha from one group eta both ways: 1e-6 relative); the config leaves
    ``qk_clip_per_head`` at its default. Negative controls, checked by hand: flipping that
    default to True in TransformerConfig, or passing ``per_head=True`` in ``_clip_layer``, fails
    it (heads 1 and 2 differ: see the test below)."""
    ((initial, upstream, ours),) = run_distributed(upstream_vs_ours, 1, args=(False,))
    assert not torch.allclose(upstream, initial)  # the clip acted
    torch.testing.assert_close(ours, upstream, rtol=1e-6, atol=0)


def test_default_rule_under_tp2_equals_upstreams_on_one_process():
    """TP2: each rank clips its own query group, and its rows equal upstream's clip of the whole
    weight on one process (1e-6, as above). Upstream 0.19.2's ``clip_qk`` cannot itself run under
    TP > 1: ``_clip_linear_qkv`` splits the TP-local weight by the global
    ``query_projection_size`` (a size mismatch in its ``torch.cat``), hence one process."""
    ((initial, upstream, _),) = run_distributed(upstream_vs_ours, 1, args=(False,))
    ranks = run_distributed(upstream_vs_ours, 2, tp=2, args=(False, False))
    rows = initial.shape[0] // 2
    for rank, (initial_r, _, ours_r) in enumerate(ranks):
        torch.testing.assert_close(initial_r, initial[rank * rows : (rank + 1) * rows])
        torch.testing.assert_close(
            ours_r, upstream[rank * rows : (rank + 1) * rows], rtol=1e-6, atol=0
        )


def test_per_head_rule_differs_from_upstream_on_the_smaller_heads_only():
    """``qk_clip_per_head``: head 1 (max 2, in a group whose max is 4) is scaled by its own eta
    (1/2)**alpha, not the group's (1/4)**alpha; head 2 (max 0.5, below tau, in a group whose max
    is 3) is left alone, not scaled by (1/3)**alpha. Every other row (heads 0 and 3, whose own
    eta is their group's; key and value rows) is upstream's."""
    ((initial, upstream, ours),) = run_distributed(upstream_vs_ours, 1, args=(True,))
    dim = initial.shape[0] // 8  # per group: 2 query heads, 1 key, 1 value
    head1, head2 = slice(dim, 2 * dim), slice(4 * dim, 5 * dim)  # group 1 starts at row 4 * dim
    changed = ~torch.isclose(ours, upstream, rtol=1e-6, atol=0).all(dim=1)
    assert changed.nonzero().view(-1).tolist() == [*range(dim, 2 * dim), *range(4 * dim, 5 * dim)]
    alpha = UPSTREAM_CLIP["qk_clip_alpha"]
    torch.testing.assert_close(ours[head1], initial[head1] * 0.5**alpha)
    torch.testing.assert_close(upstream[head1], initial[head1] * 0.25**alpha)
    torch.testing.assert_close(ours[head2], initial[head2])
    torch.testing.assert_close(upstream[head2], initial[head2] * (1 / 3) ** alpha)


# ----------------------------------------------------------------------- the recorded max logit


def _attention(coeff=None, training=True):
    config = SimpleNamespace(qk_clip=True, log_max_attention_logit=False)
    softmax = SimpleNamespace(window_size=None, attn_mask_type=AttnMaskType.causal, scale=coeff)
    return SimpleNamespace(config=config, scale_mask_softmax=softmax, training=training)


def test_recorded_max_skips_masked_scores_and_keeps_the_running_max():
    scores = torch.zeros(1, 2, 3, 3)
    scores[0, 0, 0, 2] = 50.0  # a future token: causally masked, not a logit the softmax sees
    scores[0, 0, 2, 0] = 3.0
    scores[0, 1, 1, 1] = -1.0
    attention = _attention()
    record_max_attention_logit(attention, scores, None)
    assert attention.current_max_attn_logits.tolist() == [3.0, 0.0]
    record_max_attention_logit(attention, scores - 10 + torch.eye(3) * 14, None)
    assert attention.current_max_attn_logits.tolist() == [4.0, 4.0]


def test_recorded_max_uses_the_given_mask_and_the_layer_scaling_coefficient():
    scores = torch.arange(9.0).view(1, 1, 3, 3)
    mask = torch.zeros(1, 1, 3, 3, dtype=torch.bool)
    mask[..., 2, 2] = True
    attention = _attention(coeff=2.0)
    record_max_attention_logit(attention, scores, mask)
    assert attention.current_max_attn_logits.tolist() == [14.0]  # 7 * 2


def test_evaluation_forwards_record_nothing():
    attention = _attention(training=False)
    record_max_attention_logit(attention, torch.ones(1, 1, 2, 2), None)
    assert getattr(attention, "current_max_attn_logits", None) is None


# ------------------------------------------------------------------------------ config checks

BASE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True)

BAD_CONFIGS = [
    (dict(qk_clip=True, qk_clip_alpha=0.0), r"qk_clip_alpha must be in \(0, 1\), got 0\.0"),
    (dict(qk_clip=True, qk_clip_alpha=1.0), r"qk_clip_alpha must be in \(0, 1\), got 1\.0"),
    (dict(qk_clip=True, qk_clip_threshold=0.0), "qk_clip_threshold must be a finite number > 0"),
    (
        dict(qk_clip=True, qk_clip_threshold=float("inf")),
        "qk_clip_threshold must be a finite number > 0",
    ),
    (dict(qk_clip=True, qk_layernorm=True), "qk_clip with qk_layernorm"),
    (dict(qk_clip_per_head=True), "qk_clip_per_head selects the rule of qk_clip"),
    (
        dict(qk_clip=True, num_query_groups=1, tensor_model_parallel_size=2),
        r"num_query_groups \(1\) >= tensor_model_parallel_size \(2\)",
    ),
]


@pytest.mark.parametrize("fields, message", BAD_CONFIGS)
def test_bad_qk_clip_configs_name_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        TransformerConfig(**BASE, **fields, transformer_impl="local")


def test_ranges_are_checked_only_with_the_clip_on_as_upstream():
    # upstream 0.16.1 declares the fields without checks: a config with the clip off keeps
    # accepting any alpha / threshold (no upstream caller breaks)
    config = TransformerConfig(**BASE, qk_clip_alpha=2.0, qk_clip_threshold=0.0)
    assert (config.qk_clip_alpha, config.qk_clip_threshold) == (2.0, 0.0)


def test_defaults_are_upstreams_and_off():
    config = TransformerConfig(**BASE)
    assert (config.qk_clip, config.log_max_attention_logit) == (False, False)
    assert (config.qk_clip_alpha, config.qk_clip_threshold) == (0.5, 100)
    assert config.qk_clip_per_head is False  # ours: upstream's per-group rule by default


# ------------------------------------------------------------------------------ command line
# upstream's pretrain_gpt.py command line (parse_args, validate_args, the TransformerConfig its
# pretrain() builds: tests/cli_config.py) with our patches 0013 and 0060

CLI_BASE = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
    "--max-position-embeddings 32 --micro-batch-size 2 --train-iters 10 --lr 1e-3 --mock-data "
    "--tokenizer-type NullTokenizer --vocab-size 128 --transformer-impl local"
).split()


def test_cli_flags_set_upstreams_fields():
    flags = "--qk-clip --qk-clip-alpha 0.25 --qk-clip-threshold 50 --log-max-attention-logit"
    config = transformer_config(CLI_BASE + flags.split(), world_size=1)
    assert (config.qk_clip, config.qk_clip_alpha, config.qk_clip_threshold) == (True, 0.25, 50.0)
    assert config.log_max_attention_logit
    assert not config.qk_clip_per_head  # upstream's per-group rule by default
    config = transformer_config(CLI_BASE, world_size=1)
    assert not (config.qk_clip or config.log_max_attention_logit)  # off by default
    config = transformer_config(CLI_BASE + ["--qk-clip", "--qk-clip-per-head"], world_size=1)
    assert config.qk_clip and config.qk_clip_per_head  # ours, through upstream's config copy


@pytest.mark.parametrize(
    "flags, words",
    [
        # upstream's validate_args asserts (its words: the flag and the range, not the value)
        ("--qk-clip --qk-clip-alpha 1.5", ["--qk-clip-alpha", "between 0.0 and 1.0"]),
        ("--qk-clip --qk-clip-threshold -1", ["--qk-clip-threshold", "greater than 0"]),
        # patch 0060: the local attention records the logits too; TE's does from 2.9.0
        (
            "--qk-clip --transformer-impl transformer_engine",
            ["--qk-clip", "TE >= 2.9.0 or --transformer-impl local"],
        ),
        # patch 0013's TransformerConfig checks, which upstream's validate_args lets through
        ("--qk-clip --qk-clip-threshold inf", ["qk_clip_threshold must be a finite number > 0"]),
        ("--qk-clip --qk-layernorm", ["qk_clip with qk_layernorm"]),
        # ours (megatron/training/muon_args.py)
        ("--qk-clip-per-head", ["--qk-clip-per-head", "add --qk-clip"]),
        # argparse
        ("--qk-clip-threshold x", ["--qk-clip-threshold", "invalid float value: 'x'"]),
    ],
)
def test_cli_bad_qk_clip_values_name_the_setting(flags, words):
    message = _cli_error(CLI_BASE + flags.split())
    assert all(word in message for word in words), message


def _cli_error(argv: list) -> str:
    """The error ``pretrain_gpt.py argv`` stops with (argparse's on stderr); fails if none."""
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            config = transformer_config(argv, world_size=1)
    except SystemExit as err:  # argparse: usage and message on stderr
        return f"SystemExit({err.code}): {stderr.getvalue()}"
    except (AssertionError, ValueError) as err:  # validate_args asserts; the config raises
        return f"{type(err).__name__}: {err}"
    raise AssertionError(f"{argv} accepted: {config}")


@pytest.mark.parametrize(
    "fields, message", [c for c in BAD_CONFIGS if "qk_clip_per_head" not in c[0]]
)
def test_transformer_engine_configs_are_accepted_as_upstream(fields, message):
    """The checks act where the local attention's clip (ours) runs; a TE configuration keeps
    upstream's acceptance (no config upstream took raises after the patch)."""
    config = TransformerConfig(**BASE, **fields, transformer_impl="transformer_engine")
    assert config.qk_clip
