"""Where the DistributedOptimizer keeps each model param: the one reading of megatron-core's
shard layout that the Muon exchange and the checkpoints share (docs/checkpoints.md, "Layout").
"""

from dataclasses import dataclass

from torch import Tensor


def param_names(distopt) -> dict:
    """{model param: name}: upstream's names (expert indices global), ``chunk{i}.``-prefixed
    where virtual pipeline chunks share local names."""
    if getattr(distopt, "muon_param_names", None) is None:
        from ...transformer.fsdp_dtensor_checkpoint import handle_experts_in_state_dict

        chunks = distopt.model_chunks
        experts = chunks[0].config.num_moe_experts if chunks else None
        names = {}
        for i, chunk in enumerate(chunks):
            named = handle_experts_in_state_dict(dict(chunk.named_parameters()), experts)
            prefix = f"chunk{i}." if len(chunks) > 1 else ""
            names.update({p: prefix + n for n, p in named.items()})
        distopt.muon_param_names = names
    return distopt.muon_param_names


def param_name(distopt, param) -> str:
    """The checkpoint name of a model param of ``distopt``.

    Args:
        distopt: the ``DistributedOptimizer`` whose model chunks hold ``param``.
        param: a model param (not its fp32 main copy).

    Returns:
        Its name in ``param_names``.
    """
    return param_names(distopt)[param]


def param_shapes(distopt) -> dict[str, tuple]:
    """{name: shape} of every model param of this DistOpt instance (held here or not)."""
    return {
        param_name(distopt, p): tuple(p.shape)
        for buffer in distopt.buffers
        for p in buffer.param_index_map
    }


def buckets(distopt):
    """``((buffer index, bucket index), buffer, bucket)`` for every bucket, in buffer order."""
    for gi, buffer in enumerate(distopt.buffers):
        for bi, bucket in enumerate(buffer.buckets):
            yield (gi, bi), buffer, bucket


def in_bucket(buffer, bucket, param) -> tuple[int, int]:
    """(start, end) of ``param`` within its bucket's flat (padded) tensor.

    Args:
        buffer: the DDP ``_ParamAndGradBuffer`` holding ``param``.
        bucket: its bucket.
        param: a model param.

    Returns:
        Element offsets, end exclusive.
    """
    start, end, _ = buffer.param_index_map[param]
    return start - bucket.offset, end - bucket.offset


def unpadded_index_map(buffer) -> dict:
    """``param_index_map`` without the padding ending each bucket: the offsets in DistOpt's
    dp-zero gather, which concatenates the buckets' unpadded parts."""
    out, removed = {}, 0
    for bucket in buffer.buckets:
        for param in bucket.params_list:
            start, end, bucket_id = buffer.param_index_map[param]
            out[param] = (start - removed, end - removed, bucket_id)
        removed += bucket.grad_data.numel() - bucket.numel_unpadded
    return out


@dataclass(frozen=True)
class ShardPiece:
    """A model param's elements that this DP rank holds, as one 1-D shard main param."""

    name: str
    model_param: Tensor
    shard: Tensor  # the inner optimizer's param
    local: tuple[int, int]  # range within this rank's shard of the bucket
    param_range: tuple[int, int]  # range within the flattened model param
    bucket: tuple[int, int]  # (buffer index, bucket index)


def shard_pieces(distopt) -> list[ShardPiece]:
    """This rank's shard pieces, one per (model param, shard main param), in bucket order."""
    out = []
    for gi, per_dtype in enumerate(distopt.gbuf_ranges):
        for per_bucket in per_dtype.values():
            for bi, bucket_map in enumerate(per_bucket):
                for param, ranges in bucket_map["param_map"].items():
                    group, order = distopt.model_param_group_index_map[param]
                    shard = distopt.optimizer.param_groups[group]["params"][order]
                    local, in_param = ranges["gbuf_local"], ranges["param"]
                    out.append(
                        ShardPiece(
                            param_name(distopt, param),
                            param,
                            shard,
                            (local.start, local.end),
                            (in_param.start, in_param.end),
                            (gi, bi),
                        )
                    )
    return out
