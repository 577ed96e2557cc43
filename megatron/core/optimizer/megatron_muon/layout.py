"""DDP's buffer layout for our Muon: LayerWise's (each matrix whole in one DP shard) where the
holders' Newton-Schulz loads balance at a padding under the exchange it spares, else DistOpt's
byte-level one (docs/distopt_exchange.md)."""

import dataclasses

from ...distributed.param_and_grad_buffer import group_params_for_buffers
from ..layer_wise_optimizer import LayerWiseDistributedOptimizer, is_managed_by_layer_wise_optimizer
from .planner.placement import holder_owners

# Upstream's buffer routing attribute: DDP's group_params_for_buffers gives the params carrying
# it a buffer of their own (BufferKey.is_managed_by_layer_wise_optimizer).
TAG = "is_managed_by_layer_wise_optimizer"


def compute_full_param_layout(
    params, bucket_size, data_parallel_world_size, ddp_config, expert_data_parallel_world_size=None
):
    """DDP's buffer layout (upstream's signature), per (dtype, expert) group; tags the
    shard-aligned matrices (``TAG``), so DDP must be built from the same params.

    Args:
        params: every param to lay out.
        bucket_size: approximate elements per bucket (None: one bucket).
        data_parallel_world_size: the dense params' DP size.
        ddp_config: DDP's config.
        expert_data_parallel_world_size: the expert params' DP size (None: the dense one).

    Returns:
        upstream's ``FullParamLayout``.
    """
    sizes = (data_parallel_world_size, expert_data_parallel_world_size)

    def layout():  # per buffer: tagged matrices shard-aligned, the rest DistOpt's
        return LayerWiseDistributedOptimizer.compute_full_param_layout(
            params, bucket_size, sizes[0], ddp_config, sizes[1]
        )

    candidates = [p for p in params if is_managed_by_layer_wise_optimizer(p)]
    for p in candidates:
        setattr(p, TAG, True)
    aligned = layout()
    groups = group_params_for_buffers(params, ddp_config.grad_reduce_in_fp32)  # DDP's buffers
    for p in candidates:
        delattr(p, TAG)
    plain = layout()  # DistOpt's byte-level layout of every param
    tagged = [key for key in aligned.layouts if key.is_managed_by_layer_wise_optimizer]
    kept = [key for key in tagged if not _apart(key, aligned, plain, sizes)]
    for key in kept:  # the others stay in DistOpt's byte-level buffers
        for p in groups[key][0]:
            setattr(p, TAG, True)
    if kept == tagged:
        return aligned
    return layout() if kept else plain


def _apart(key, aligned, plain, sizes) -> bool:
    """Whether a shard-aligned buffer goes back to byte-level: one DP rank, whole matrices that
    cannot balance, or padding that moves more than the exchange it spares. Per rank and step
    DDP's grad reduce-scatter and param all-gather each move ``(dp - 1) / dp`` of the padded
    elements the aligned layout adds; DistOpt's byte-level exchange moves about ``(dp - 1) / dp``
    of the rank's ``M / dp`` Muon elements each way (docs/distopt_exchange.md)."""
    dp = sizes[1] if key.is_expert_parallel and sizes[1] is not None else sizes[0]
    per_buffer = aligned.layouts[key]
    if dp <= 1 or holder_owners(*holder_costs(per_buffer, dp), dp) is None:
        return True
    rest = dataclasses.replace(key, is_managed_by_layer_wise_optimizer=False)
    extra = _numel(aligned, key) + _numel(aligned, rest) - _numel(plain, rest)
    muon = sum(end - start for start, end, _ in per_buffer.param_index_map.values())
    return extra * dp > muon


def _numel(full, key) -> int:
    """Padded elements of ``full``'s buffer ``key`` (0 where it has none)."""
    per = full.layouts.get(key)
    return per.bucket_indices[-1][1] if per is not None and per.bucket_indices else 0


def holder_costs(per_buffer, dp: int) -> tuple[list[float], list[int]]:
    """(NS cost ``m n min(m, n)``, holding DP rank) of each matrix of a shard-aligned buffer;
    the planner's finer costs (Q/K/V, TP) may still move a few more.

    Args:
        per_buffer: upstream's ``PerBufferParamLayout``.
        dp: its DP size.

    Returns:
        (costs, holders), one entry per matrix.
    """
    costs, holders = [], []
    for param, (start, _, bucket_id) in per_buffer.param_index_map.items():
        lo, hi = per_buffer.bucket_indices[bucket_id]
        m, n = param.shape
        costs.append(float(m * n * min(m, n)))
        holders.append((start - lo) // ((hi - lo) // dp))
    return costs, holders


def is_shard_aligned(buffer) -> bool:
    """Whether a DDP buffer holds the shard-aligned Muon matrices."""
    return bool(buffer.params) and getattr(buffer.params[0], TAG, False)
