"""QK-clip (Kimi K2's MuonClip, arXiv 2507.20534) on every layout, without Transformer Engine:
after each optimizer step, query and key rows scale so every head's max logit ends <= tau, in
the model params and the fp32 main params (DistOpt shards included). Rules: docs/qk_clip.md.
"""

from typing import Optional

import torch
from megatron.core.transformer.attention import Attention, SelfAttention
from megatron.core.transformer.multi_latent_attention import MultiLatentAttention
from megatron.core.utils import get_model_config

from megatron.core import parallel_state

# ------------------------------------------------------------------------------ the math


def head_etas(max_logits: torch.Tensor, threshold: float) -> torch.Tensor:
    """Per-head clip factors; a non-finite max leaves its head alone.

    Args:
        max_logits: [np] max pre-softmax logit per query head.
        threshold: tau.

    Returns:
        [np] eta_h = tau / S_h where S_h > tau, else 1.
    """
    clip = (max_logits > threshold) & torch.isfinite(max_logits)
    return torch.where(clip, threshold / max_logits, torch.ones_like(max_logits))


def head_scales(
    max_logits: torch.Tensor,
    num_groups: int,
    threshold: float,
    alpha: float,
    per_head: bool = False,
):
    """Query and key scales from the per-head maxima; a non-finite max (fp16 overflow, a
    skipped step) leaves its head alone.

    Args:
        max_logits: [np] max pre-softmax logit per query head, grouped as Megatron lays them out.
        num_groups: ng, the query groups among those heads.
        threshold: tau.
        alpha: the query side's share of the clip.
        per_head: each query head its own eta (else its group's: upstream's rule).

    Returns:
        (query scale [np], key scale [ng]), 1 where nothing is clipped.
    """
    eta = head_etas(max_logits, threshold)
    group_eta = eta.view(num_groups, -1).amin(dim=1)
    if not per_head:
        eta = group_eta.repeat_interleave(max_logits.numel() // num_groups)
    return eta.pow(alpha), group_eta.pow(1.0 - alpha)


def qkv_row_scales(q_scale: torch.Tensor, k_scale: torch.Tensor, head_dim: int) -> torch.Tensor:
    """One scale per output row of Megatron's fused QKV (per group: q heads, k, v).

    Args:
        q_scale: [np] per query head.
        k_scale: [ng] per key head.
        head_dim: rows per head.

    Returns:
        [ng * (np / ng + 2) * head_dim] row scales; the V rows get 1.
    """
    groups = k_scale.numel()
    q = q_scale.view(groups, -1).repeat_interleave(head_dim, dim=1)
    k = k_scale.view(groups, 1).expand(groups, head_dim)
    v = torch.ones_like(k)
    return torch.cat([q, k, v], dim=1).reshape(-1)


def head_row_scales(parts: list) -> torch.Tensor:
    """One scale per output row of a projection laid out head by head, each head's rows in parts.

    Args:
        parts: [(scale [n] per head, rows per head)], in the order of a head's rows.

    Returns:
        [n * sum(rows)] row scales.
    """
    return torch.cat([s.view(-1, 1).expand(-1, rows) for s, rows in parts], dim=1).reshape(-1)


def mla_row_scales(max_logits: torch.Tensor, config) -> tuple:
    """Row scales of multi-latent attention's query and key-value up projections: upstream
    0.19's ``MLASelfAttention.clip_qk`` rule. A head's logit is q_nope.k_nope + q_pe.k_pe, with
    k_pe shared by all heads (left alone): q_nope rows scale by eta_h ** alpha, k_nope rows by
    eta_h ** (1 - alpha), q_pe rows by eta_h, value rows not at all.

    Args:
        max_logits: [n] this rank's heads' maxima.
        config: the MLATransformerConfig (head dims, tau, alpha).

    Returns:
        ([n * (qk_head_dim + qk_pos_emb_head_dim)] query rows,
        [n * (qk_head_dim + v_head_dim)] key-value rows).
    """
    eta, alpha = head_etas(max_logits, config.qk_clip_threshold), config.qk_clip_alpha
    q = head_row_scales([(eta.pow(alpha), config.qk_head_dim), (eta, config.qk_pos_emb_head_dim)])
    ones = torch.ones_like(eta)
    kv = head_row_scales([(eta.pow(1 - alpha), config.qk_head_dim), (ones, config.v_head_dim)])
    return q, kv


def scale_rows_(flat: torch.Tensor, row_scale: torch.Tensor, row_len: int, start: int) -> None:
    """Scale in place each element of a flattened row-major matrix's piece by its row's scale.

    Args:
        flat: 1-D piece of the flattened matrix (the whole param, or a DistOpt shard).
        row_scale: one scale per row of the whole (TP-local) matrix.
        row_len: elements per row.
        start: the flat position of ``flat[0]`` in the matrix.
    """
    row_scale = row_scale.to(flat.device)
    row, offset, n = start // row_len, start % row_len, flat.numel()
    lead = min(n, (row_len - offset) % row_len)
    if lead:
        flat[:lead].mul_(row_scale[row])
        row += 1
    whole = (n - lead) // row_len
    if whole:
        body = flat[lead : lead + whole * row_len].view(whole, row_len)
        body.mul_(row_scale[row : row + whole, None])
    if lead + whole * row_len < n:
        flat[lead + whole * row_len :].mul_(row_scale[row + whole])


# ------------------------------------------------------------------------------ the step


@torch.no_grad()
def clip_qk(model, log_max_only: bool = False, optimizer=None) -> Optional[float]:
    """After the optimizer step, clip every attention layer (``config.qk_clip``); collective
    over the whole world.

    Args:
        model: the list of model chunks.
        log_max_only: only measure the max, clip nothing.
        optimizer: Megatron's optimizer; needed with the DistributedOptimizer.

    Returns:
        The model-wide max attention logit (same on every rank), or None where neither
        ``qk_clip`` nor ``log_max_attention_logit`` is set (then nothing runs).
    """
    config = get_model_config(model[0])
    if not (config.qk_clip or config.log_max_attention_logit):
        return None
    modules = [m for chunk in model for m in chunk.modules()]
    layers = [m for m in modules if isinstance(m, (SelfAttention, MultiLatentAttention))]
    _check_ready(layers, optimizer)
    others = [m for m in modules if _clips_itself(m)]  # upstream's own clip
    local = [_local_maxima(layer) for layer in layers]
    local += [m.core_attention.current_max_attn_logits.float() for m in others]
    maxima = _reduce_over_data_parallel(local)
    if config.qk_clip and not log_max_only:
        for layer, max_logits in zip(layers, maxima):
            for param, rows in _row_scales(layer, max_logits, config):
                _scale_param(param, rows, optimizer)
    for module, max_logits in zip(others, maxima[len(layers) :]):
        module.core_attention.current_max_attn_logits = max_logits
        if config.qk_clip and not log_max_only:
            module.clip_qk()  # resets the maxima
    for module in layers + others:
        module.core_attention.current_max_attn_logits = None
    return _model_wide_max(maxima)


def _clips_itself(module) -> bool:
    """Another attention module with upstream's own ``clip_qk`` and maxima this step."""
    if isinstance(module, (SelfAttention, MultiLatentAttention)):
        return False
    if not isinstance(module, Attention):
        return False
    own = getattr(type(module), "clip_qk", None) not in (None, getattr(Attention, "clip_qk", None))
    core = getattr(module, "core_attention", None)
    return own and getattr(core, "current_max_attn_logits", None) is not None


def _check_ready(layers, optimizer) -> None:
    # Same answer on every rank (same spec, same optimizer kind): raised before any collective.
    for layer in layers:
        if not hasattr(layer.core_attention, "current_max_attn_logits"):
            raise ValueError(
                f"qk_clip: {type(layer.core_attention).__name__} records no attention logits "
                "(use the local core attention, or Transformer Engine >= 2.9)"
            )
        if isinstance(layer, MultiLatentAttention) and not hasattr(layer, "linear_kv_up_proj"):
            raise ValueError(
                "qk_clip: multi-latent attention with cache_mla_latents absorbed its "
                "linear_kv_up_proj (inference only): nothing to clip"
            )
        for weight in _clipped_weights(layer):
            if getattr(weight, "main_param_sharded", False) and optimizer is None:
                raise ValueError("qk_clip: pass the optimizer: DistributedOptimizer main params")


def _clipped_weights(layer) -> list:
    """The weights whose rows the clip scales: MLA's query and key-value up projections (the
    query projection without q_lora_rank), else the fused QKV weight and bias."""
    if isinstance(layer, MultiLatentAttention):
        q = layer.linear_q_proj if layer.config.q_lora_rank is None else layer.linear_q_up_proj
        return [q.weight, layer.linear_kv_up_proj.weight]
    params = (layer.linear_qkv.weight, getattr(layer.linear_qkv, "bias", None))
    return [p for p in params if isinstance(p, torch.Tensor) and p.numel() > 0]


def _row_scales(layer, max_logits: torch.Tensor, config) -> list:
    """[(param, its row scales)] of one attention layer (the bias, if any, with its weight)."""
    weights = _clipped_weights(layer)
    if isinstance(layer, MultiLatentAttention):
        return list(zip(weights, mla_row_scales(max_logits, config)))
    return [(param, _qkv_rows(layer, max_logits, config)) for param in weights]


def _local_maxima(layer) -> torch.Tensor:
    """This rank's per-head maxima; -inf (never clips) for a layer that ran no forward."""
    attention = layer.core_attention
    current = attention.current_max_attn_logits
    if current is not None:
        return current.float()
    device = layer.linear_proj.weight.device
    return torch.full((layer.num_attention_heads_per_partition,), float("-inf"), device=device)


def _reduce_over_data_parallel(maxima: list) -> list:
    if not maxima:
        return maxima
    flat = torch.cat(maxima)
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    torch.distributed.all_reduce(flat, op=torch.distributed.ReduceOp.MAX, group=group)
    return list(flat.split([m.numel() for m in maxima]))


def _model_wide_max(maxima: list) -> float:
    if maxima:
        local = torch.stack([m.max() for m in maxima]).max()
    else:  # a stage without attention layers still joins the all-reduce
        cuda = torch.cuda.is_available()
        local = torch.tensor(float("-inf"), device=torch.cuda.current_device() if cuda else None)
    group = parallel_state.get_model_parallel_group()
    torch.distributed.all_reduce(local, op=torch.distributed.ReduceOp.MAX, group=group)
    return local.item()


def _qkv_rows(layer, max_logits: torch.Tensor, config) -> torch.Tensor:
    attention = layer.core_attention
    q_scale, k_scale = head_scales(
        max_logits,
        attention.num_query_groups_per_partition,
        config.qk_clip_threshold,
        config.qk_clip_alpha,
        per_head=config.qk_clip_per_head,
    )
    return qkv_row_scales(q_scale, k_scale, attention.hidden_size_per_attention_head)


def _scale_param(param, rows: torch.Tensor, optimizer) -> None:
    """Scale the fp32 main copy (whole, or this rank's DistOpt shard), then the model param."""
    row_len = param.numel() // param.shape[0]
    main, start = _main_copy(optimizer, param)
    if main is not None and main.untyped_storage().data_ptr() != param.untyped_storage().data_ptr():
        scale_rows_(main.data.view(-1), rows, row_len, start)
    scale_rows_(param.data.view(-1), rows, row_len, 0)


def _main_copy(optimizer, param) -> tuple:
    """(this rank's main copy of ``param`` or None, its offset in the flattened param); a main
    shard it cannot place is a ValueError, never a skip (docs/qk_clip.md)."""
    main = getattr(param, "main_param", None)
    if not getattr(param, "main_param_sharded", False):
        return main, 0  # Float16Optimizer's whole fp32 copy, or none (fp32 params)
    owner = _distributed_optimizer_of(optimizer, param)
    if owner is None:
        if main is None:
            return None, 0  # this rank holds none of it
        raise ValueError(
            f"qk_clip: a DistributedOptimizer main shard of a {tuple(param.shape)} query/key param "
            f"that no DistributedOptimizer in the given optimizer ({type(optimizer).__name__}) "
            "owns: pass the optimizer that holds it"
        )
    held = owner._get_model_param_range_map(param)["param"]
    if main is None or main.numel() != held.size:
        got = "no main_param" if main is None else f"a main_param of {main.numel()} elements"
        raise ValueError(
            f"qk_clip: this rank's DistributedOptimizer range of a {tuple(param.shape)} query/key "
            f"param holds {held.size} elements but the param has {got}; the clip cannot scale the "
            "main copy (--use-precision-aware-optimizer keeps it outside main_param: not "
            "supported with --qk-clip)"
        )
    return main, shard_start(optimizer, param)


def _distributed_optimizers(optimizer):
    """Every DistributedOptimizer under ``optimizer``, chains nested at any depth."""
    if optimizer is None:
        return
    if hasattr(optimizer, "model_param_gbuf_map"):
        yield optimizer
    for inner in getattr(optimizer, "chained_optimizers", None) or ():
        if inner is not optimizer:
            yield from _distributed_optimizers(inner)


def _distributed_optimizer_of(optimizer, param):
    """The DistributedOptimizer that holds a range of ``param`` on this rank, or None."""
    owners = {
        id(o): o for o in _distributed_optimizers(optimizer) if param in o.model_param_gbuf_map
    }
    owners = list(owners.values())
    if len(owners) > 1:
        raise ValueError("qk_clip: two DistributedOptimizers hold the same query/key param")
    return owners[0] if owners else None


def shard_start(optimizer, param) -> int:
    """Where this rank's DistOpt main shard of ``param`` starts in the flattened param;
    ValueError where no DistributedOptimizer under ``optimizer`` holds a range of it.

    Args:
        optimizer: Megatron's optimizer (chains nested at any depth).
        param: a model param whose main param is a DistOpt shard on this rank.

    Returns:
        The element offset.
    """
    owner = _distributed_optimizer_of(optimizer, param)
    if owner is None:
        raise ValueError(
            f"qk_clip: no DistributedOptimizer in {type(optimizer).__name__} holds a shard of "
            f"this {tuple(param.shape)} param on this rank"
        )
    return owner._get_model_param_range_map(param)["param"].start
