"""MuonDistributedOptimizer's torch_dist formats and ``load_state_dict`` (every format's
loader): docs/checkpoints.md.
"""

from dataclasses import replace

import torch

from ...dist_checkpointing.dict_utils import nested_values
from ...dist_checkpointing.mapping import ShardedObject, ShardedTensor
from ...dist_checkpointing.utils import extract_sharded_tensors_and_factories
from ..repairs.distopt_layout import param_name, param_shapes, shard_pieces
from ..repairs.group_matching import match_groups
from .checkpoint import (
    all_gather_object,
    check_compatible,
    gather_state,
    group_identity,
    local_meta,
    require_marker,
    scatter_state,
    set_piece_key,
    set_scalars,
    tensors_of,
)
from .optimizer import RULE_SETTINGS


def _prefix(distopt) -> str:
    return f"optimizer.distributed.dp_group_idx_{distopt.data_parallel_group_idx}"


def _holds_experts(distopt) -> bool:
    # Megatron marks expert-parallel params with allreduce=False
    return any(
        not getattr(p, "allreduce", True) for b in distopt.buffers for p in b.param_index_map
    )


def _meta_key(distopt) -> str:
    """The meta object's key; an MoE model's dense and expert DistOpts can share a
    ``dp_group_idx`` with no ChainedOptimizer prefix, so the expert one's key says so."""
    return f"{_prefix(distopt)}{'.expert' if _holds_experts(distopt) else ''}.declared_state_meta"


def _meta_object(distopt, meta) -> ShardedObject:
    return ShardedObject(
        _meta_key(distopt),
        meta,
        (1,),
        (0,),
        replica_id=(
            distopt.distributed_optimizer_instance_id,
            0,
            distopt.data_parallel_group.rank(),
        ),
    )


def _gathered_meta(distopt) -> dict:
    meta = {}
    for part in all_gather_object(distopt, local_meta(distopt)):
        meta.update(part)
    return meta


def _load_meta(distopt, param_state) -> dict:
    meta = param_state["meta"]
    check_compatible(distopt, meta)
    return meta


# ------------------------------------------------------------------ fully_reshardable


def _model_metadata(distopt, model_sharded_state_dict) -> dict:
    """{model param name: its ShardedTensor (or factory)} from the model's sharded state dict."""
    sharded, _ = extract_sharded_tensors_and_factories(model_sharded_state_dict)
    by_tensor = {sh.data: sh for sh in nested_values(sharded)}
    out = {}
    for buffer in distopt.buffers:
        for param in buffer.param_index_map:
            if param not in by_tensor:
                raise ValueError(
                    f"model param {param_name(distopt, param)} is not in the model's sharded "
                    "state dict (build it with keep_vars=True, e.g. model.sharded_state_dict())"
                )
            out[param_name(distopt, param)] = by_tensor[param]
    return out


def _model_space(meta_sh, key: str, tensor: torch.Tensor):
    kwargs = dict(
        key=f"optimizer.state.{key}.{meta_sh.key}",
        data=tensor.reshape(meta_sh.data.shape),
        dtype=tensor.dtype,
        replica_id=meta_sh.replica_id,
    )
    if not isinstance(meta_sh, ShardedTensor):  # a ShardedTensorFactory takes its dtype from data
        kwargs.pop("dtype")
    return replace(meta_sh, **kwargs)


def sharded_fully_reshardable(distopt, model_sharded_state_dict, is_loading: bool, metadata=None):
    """Model-space state: each key shaped like its param, under the model's keys.

    Args:
        distopt: the ``MuonDistributedOptimizer``; every DP rank must call this.
        model_sharded_state_dict: the model's sharded state dict (keys and replica ids).
        is_loading: build empty tensors to load into instead of the state to save.
        metadata: upstream's metadata; unused.

    Returns:
        {"tensors": {param name: {key: sharded tensor}}, "meta": the scalars and keys object}.
    """
    model = _model_metadata(distopt, model_sharded_state_dict)
    if is_loading:
        # every param, not only those held here: a layer-stacked model key must be read whole
        keys = {name: m["keys"] for name, m in _gathered_meta(distopt).items()}
        state = {
            name: {k: torch.empty(model[name].data.shape, dtype=torch.float32) for k in ks}
            for name, ks in keys.items()
        }
        meta = {}
    else:
        state = gather_state(distopt, everywhere=True)
        meta = _gathered_meta(distopt)
    out = {
        name: {k: _model_space(model[name], k, t) for k, t in tensors.items() if k != "scalars"}
        for name, tensors in state.items()
    }
    return {"tensors": out, "meta": _meta_object(distopt, meta)}


def _load_fully_reshardable(distopt, param_state) -> None:
    """Load what ``sharded_fully_reshardable`` built, filled by the load, into the shards."""
    meta = _load_meta(distopt, param_state)
    for p in shard_pieces(distopt):
        for key, value in param_state["tensors"][p.name].items():
            set_piece_key(distopt, p, key, value.flatten()[p.param_range[0] : p.param_range[1]])
        set_scalars(distopt, p, meta[p.name]["scalars"])


# ------------------------------------------------------------------ dp_reshardable


def sharded_dp_reshardable(distopt, model_sharded_state_dict, is_loading: bool, metadata=None):
    """One flat ShardedTensor per param and key (the whole flattened param: no padding, any
    DP size reads it); each rank writes and reads exactly its piece.

    Args:
        distopt: the ``MuonDistributedOptimizer``; every DP rank must call this.
        model_sharded_state_dict: the model's sharded state dict; unused (the names are ours).
        is_loading: build empty tensors to load into instead of the state to save.
        metadata: upstream's metadata; unused.

    Returns:
        {"tensors": {param name: {key: sharded tensor}}, "meta": the scalars and keys object}.
    """
    names = param_shapes(distopt)
    out = {}
    for p in shard_pieces(distopt):
        numel = int(torch.Size(names[p.name]).numel())
        out[p.name] = {
            key: ShardedTensor(
                f"{_prefix(distopt)}.declared_state.{p.name}.{key}",
                torch.empty_like(t) if is_loading else t.detach(),
                t.dtype,
                t.shape,
                (numel,),
                (p.param_range[0],),
                axis_fragmentations=None,
                flattened_range=None,
                allow_shape_mismatch=False,
                replica_id=(distopt.distributed_optimizer_instance_id, 0, 0),
            )
            for key, t in tensors_of(distopt, p).items()
        }
    meta = {} if is_loading else _gathered_meta(distopt)
    return {"tensors": out, "meta": _meta_object(distopt, meta)}


def _load_dp_reshardable(distopt, param_state) -> None:
    """Load what ``sharded_dp_reshardable`` built, filled by the load, into the shards."""
    meta = _load_meta(distopt, param_state)
    for p in shard_pieces(distopt):
        for key, value in param_state["tensors"][p.name].items():
            set_piece_key(distopt, p, key, value)
        set_scalars(distopt, p, meta[p.name]["scalars"])


def load_state_dict(distopt, state: dict) -> None:
    """``load_state_dict`` of every format: groups matched by identity (incl. ``use_muon``,
    repairs/group_matching.py), state created, then the param state loaded.

    Args:
        distopt: the ``MuonDistributedOptimizer``.
        state: what ``state_dict()`` (or a sharded load) produced.
    """
    require_marker(distopt, state)
    groups = distopt.optimizer.param_groups
    saved = match_groups(groups, state["optimizer"]["param_groups"], group_identity)
    kept = ("params", *RULE_SETTINGS)  # the Muon rule's settings stay this run's
    for group, saved_group in zip(groups, saved):
        group.update({k: v for k, v in saved_group.items() if k not in kept})
        for param in group["params"]:
            distopt.optimizer.init_state(param)
    if "grad_scaler" in state and distopt.grad_scaler:
        distopt.grad_scaler.load_state_dict(state["grad_scaler"])
    if "param_state" in state:
        _load_param_state(distopt, state["param_state"], state["param_state_sharding_type"])


def _load_param_state(distopt, param_state, sharding_type: str) -> None:
    loaders = {
        "dp_zero_gather_scatter": scatter_state,
        "fully_reshardable": _load_fully_reshardable,
        "dp_reshardable": _load_dp_reshardable,
    }
    if sharding_type not in loaders:
        raise NotImplementedError(
            f"sharding_type {sharding_type!r} with {type(distopt.optimizer).__name__}: "
            f"supported are {sorted(loaders)}"
        )
    loaders[sharding_type](distopt, param_state)
