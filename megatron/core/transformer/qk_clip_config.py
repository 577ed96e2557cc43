"""Checks of TransformerConfig's QK-clip fields (``qk_clip``, ``qk_clip_alpha``,
``qk_clip_threshold``, ``log_max_attention_logit``, and our ``qk_clip_per_head``), called from
``__post_init__``.

The fields are upstream's (declared there without these checks); the refusals below are where the
clip (megatron/core/optimizer/qk_clip.py) cannot keep its promise that every head's logit ends at
or below the threshold, so a run asking for it fails at configuration time on every rank alike.
"""

import math


def validate_qk_clip_config(config) -> None:
    """Raise ValueError naming the field when the QK-clip settings are out of range or the
    attention variant is one the clip cannot bound."""
    if getattr(config, "qk_clip_per_head", False):  # ours: refused where it would do nothing
        if not config.qk_clip:
            raise ValueError("qk_clip_per_head selects the rule of qk_clip: set qk_clip too")
        if config.multi_latent_attention:
            raise ValueError(
                "qk_clip_per_head does not apply to multi_latent_attention (upstream's MLA clip "
                "has its own rule)"
            )
    if not config.qk_clip or getattr(config, "transformer_impl", "local") != "local":
        return  # upstream takes any alpha / threshold while the clip is off, and with TE
    alpha, tau = config.qk_clip_alpha, config.qk_clip_threshold
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"qk_clip_alpha must be in (0, 1), got {alpha}")
    if not (tau > 0 and math.isfinite(tau)):
        raise ValueError(f"qk_clip_threshold must be a finite number > 0, got {tau}")
    # MLA: its q/kv norms act on the latents, before the up projections the clip scales, and it
    # has no query groups; the fused-QKV refusals below do not apply
    if config.multi_latent_attention:
        return
    for field in ("qk_layernorm", "qk_l2_norm"):
        if getattr(config, field, False):
            raise ValueError(
                f"qk_clip with {field}: the clip scales the query/key weights, which the norm "
                "applied after the projection undoes (the norm already bounds the logits)"
            )
    if getattr(config, "attention_output_gate", False):
        raise ValueError("qk_clip does not support attention_output_gate (its fused QKV layout)")
    if config.num_query_groups < config.tensor_model_parallel_size:
        raise ValueError(
            f"qk_clip needs num_query_groups ({config.num_query_groups}) >= "
            f"tensor_model_parallel_size ({config.tensor_model_parallel_size}): with fewer key "
            "heads than ranks a key head is replicated across ranks holding different queries"
        )
