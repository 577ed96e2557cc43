"""Per-head maximum pre-softmax attention logit, recorded by the local core attention.

QK-clip (megatron/core/optimizer/qk_clip.py) needs S_h = max over the step's tokens of the logit
``softmax_scale * q_h . k`` of every head h. ``DotProductAttention.forward`` already materializes
those scores; one max reduction over them (the positions the softmax masks excluded, as the softmax
sees them) keeps a running max per head in ``core_attention.current_max_attn_logits`` (upstream's
attribute name, which its Transformer Engine attention fills the same way). Only training forwards
count: an evaluation between two steps must not feed the next clip. ``clip_qk`` reduces the
maxima over data-parallel ranks and resets them after each optimizer step.
"""

import torch
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.utils import get_sliding_window_causal_mask


def record_max_attention_logit(core_attention, scores: torch.Tensor, attention_mask) -> None:
    """Fold this micro-batch's per-head max of ``scores`` [b, np, sq, sk] into the running max.

    Args:
        core_attention: the ``DotProductAttention`` module; its ``current_max_attn_logits``
            ([np] fp32, this TP rank's heads) holds the running max.
        scores: pre-softmax attention scores [b, np, sq, sk], before the softmax's scaling.
        attention_mask: the mask passed to the softmax, or None.
    """
    config = core_attention.config
    if not (config.qk_clip or config.log_max_attention_logit) or not core_attention.training:
        return
    with torch.no_grad():
        mask = _softmax_mask(core_attention.scale_mask_softmax, scores, attention_mask)
        if mask is not None:
            scores = scores.masked_fill(mask, float("-inf"))
        batch_max = scores.amax(dim=(0, 2, 3)).float()
        # apply_query_key_layer_scaling: the softmax multiplies the scores by the layer number
        coeff = core_attention.scale_mask_softmax.scale
        if coeff is not None:
            batch_max = batch_max * coeff
        current = getattr(core_attention, "current_max_attn_logits", None)
        if current is not None:
            batch_max = torch.maximum(current, batch_max)
        core_attention.current_max_attn_logits = batch_max


def _softmax_mask(softmax, scores: torch.Tensor, attention_mask):
    """The boolean mask (True = excluded) that ``FusedScaleMaskSoftmax`` applies to ``scores``."""
    sq, sk = scores.shape[2], scores.shape[3]
    if softmax.window_size is not None:
        return get_sliding_window_causal_mask(sq, sk, softmax.window_size).to(scores.device)
    if attention_mask is not None:
        return attention_mask
    if softmax.attn_mask_type == AttnMaskType.causal and sq > 1:
        return torch.ones(sq, sk, dtype=torch.bool, device=scores.device).triu(diagonal=1)
    return None
