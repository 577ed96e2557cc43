"""DDP's buffer layout for our Muon: LayerWise's (each matrix whole in one DP shard) where the
holders' Newton-Schulz loads balance, else DistOpt's byte-level one (docs/distopt_exchange.md)."""

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
    apart = [key for key, per in aligned.layouts.items() if _apart(key, per, sizes)]
    if not apart:
        return aligned
    groups = group_params_for_buffers(params, ddp_config.grad_reduce_in_fp32)  # DDP's buffers
    for key in apart:  # those groups stay in (or go back to) DistOpt's byte-level buffers
        for p in groups[key][0]:
            delattr(p, TAG)
    return layout()


def _apart(key, per_buffer, sizes) -> bool:
    """A shard-aligned buffer to give up: one DP rank, or whole matrices that cannot balance."""
    if not key.is_managed_by_layer_wise_optimizer:
        return False
    dp = sizes[1] if key.is_expert_parallel and sizes[1] is not None else sizes[0]
    return dp <= 1 or holder_owners(*holder_costs(per_buffer, dp), dp) is None


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
