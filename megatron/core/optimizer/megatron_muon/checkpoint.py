"""MuonDistributedOptimizer checkpoints: the ``torch`` format and the common part, keyed by
param name (no dependence on DP size or bucket padding). Formats and why: docs/checkpoints.md.
"""

import torch
from torch import Tensor

from ..optimizer import param_group_identifier_keys
from ..repairs.distopt_layout import (
    ShardPiece,
    buckets,
    in_bucket,
    param_name,
    param_shapes,
    shard_pieces,
)
from .factory import MegatronMuon

FORMAT = "declared-state-distopt/1"
MARK = "declared_state_checkpoint"  # key of the format marker in DistOpt.state_dict()
GROUP_IDENTITY = param_group_identifier_keys  # use_muon among them (patch 0012)


def is_ours(state_dict) -> bool:
    """Whether ``state_dict`` was written by this module (it carries our marker)."""
    return isinstance(state_dict, dict) and MARK in state_dict


# ------------------------------------------------------------------ the pieces a rank holds


def _keys_of(distopt, shard: Tensor) -> tuple[str, ...]:
    """The param-shaped tensors a checkpoint carries for a shard: ``("param", *state keys)``."""
    return ("param", *distopt.optimizer.state_keys(shard))


def tensors_of(distopt, piece: ShardPiece) -> dict[str, Tensor]:
    """The param-shaped state of ``piece``'s shard, created if absent (live tensors, not copies).

    Args:
        distopt: the ``MuonDistributedOptimizer``.
        piece: the shard piece (repairs/distopt_layout.py).

    Returns:
        {key: tensor}, the shard itself under "param".
    """
    muon = distopt.optimizer
    state = muon.init_state(piece.shard)
    return {"param": piece.shard, **{k: state[k] for k in muon.state_keys(piece.shard)}}


def _scalars_of(distopt, piece: ShardPiece) -> dict[str, float]:
    """The per-param scalar state of ``piece``'s shard as floats, e.g. {"step": 3.0}."""
    state = distopt.optimizer.init_state(piece.shard)
    return {k: float(state[k]) for k in distopt.optimizer.scalar_state_keys(piece.shard)}


def local_meta(distopt) -> dict[str, dict]:
    """Per model param: shape, declared keys and scalars, as this rank sees them."""
    return {
        p.name: {
            "keys": _keys_of(distopt, p.shard),
            "scalars": _scalars_of(distopt, p),
            "shape": tuple(p.model_param.shape),
        }
        for p in shard_pieces(distopt)
    }


# ------------------------------------------------------------------ collectives (DP group)


def _comm(distopt):
    """(group, device): gloo on CPU tensors when Megatron made a gloo group, else the DP group."""
    if distopt.data_parallel_group_gloo is not None:
        return distopt.data_parallel_group_gloo, torch.device("cpu")
    return distopt.data_parallel_group, distopt.buffers[0].grad_data.device


def all_gather_object(distopt, obj) -> list:
    """``obj`` from every rank of the DP group (its gloo group where there is one).

    Args:
        distopt: the ``MuonDistributedOptimizer``; every DP rank must call this.
        obj: a picklable object.

    Returns:
        The objects in DP-rank order.
    """
    group, _ = _comm(distopt)
    out = [None] * group.size()
    torch.distributed.all_gather_object(out, obj, group=group)
    return out


def _broadcast_object(distopt, obj):
    """DP rank 0's ``obj`` on every rank of the DP group."""
    group, _ = _comm(distopt)
    box = [obj]
    src = torch.distributed.get_process_group_ranks(group)[0]
    torch.distributed.broadcast_object_list(box, src=src, group=group)
    return box[0]


def check_compatible(distopt, meta: dict) -> None:
    """ValueError on every rank (collectively) if the checkpoint's params or keys differ.

    Args:
        distopt: the ``MuonDistributedOptimizer`` loaded into.
        meta: the checkpoint's {param name: {"keys", "scalars", "shape"}}, same on every rank.
    """
    errors = []
    names = param_shapes(distopt)
    if set(meta) != set(names):
        missing, extra = sorted(set(names) - set(meta)), sorted(set(meta) - set(names))
        errors.append(f"params missing from the checkpoint: {missing[:5]}; unknown: {extra[:5]}")
    for p in shard_pieces(distopt):
        saved = meta.get(p.name)
        if saved is None:
            continue
        if tuple(saved["shape"]) != names[p.name]:
            errors.append(f"{p.name}: shape {tuple(saved['shape'])} saved, {names[p.name]} now")
        if tuple(saved["keys"]) != _keys_of(distopt, p.shard):
            errors.append(
                f"{p.name}: checkpoint has state {tuple(saved['keys'])}, this optimizer "
                f"({type(distopt.optimizer).__name__}) keeps {_keys_of(distopt, p.shard)}"
            )
    found = sorted({e for errs in all_gather_object(distopt, errors) for e in errs})
    if found:
        raise ValueError(
            "DistributedOptimizer checkpoint does not match this optimizer or model layout "
            "(saved by a different optimizer, e.g. adam vs muon, or another model?): "
            + "; ".join(found[:8])
        )


def _union(meta: dict) -> list[str]:
    keys = ["param"]
    for m in meta.values():
        keys += [k for k in m["keys"] if k not in keys]
    return keys


def _by_bucket(distopt) -> dict:
    out = {}
    for p in shard_pieces(distopt):
        out.setdefault(p.bucket, []).append(p)
    return out


# ------------------------------------------------------------------ dp-zero: gather and scatter


def gather_state(distopt, everywhere: bool = False):
    """Every param's state, whole, by name, on DP rank 0 (or every rank).

    Per bucket and key, ranks send their piece (zeros where a param lacks the key); the receiver
    cuts params out of the *padded* bucket, at ``param_index_map`` offsets.

    Args:
        distopt: the ``MuonDistributedOptimizer``; every DP rank must call this.
        everywhere: all-gather instead of gathering to DP rank 0.

    Returns:
        ``{name: {key: flat fp32 tensor, "scalars": {...}}}`` on receivers, else None.
    """
    group, device = _comm(distopt)
    meta = {}
    for part in all_gather_object(distopt, local_meta(distopt)):
        meta.update(part)
    receiver = everywhere or group.rank() == 0
    out = {n: {"scalars": m["scalars"]} for n, m in meta.items()} if receiver else None
    held = _by_bucket(distopt)
    for where, buffer, bucket in buckets(distopt):
        for key in _union(meta):
            local = _local_bucket(distopt, bucket, held.get(where, []), key, group.size())
            world = _gather(local.to(device), group, everywhere)
            if receiver:
                _cut(distopt, buffer, bucket, world.cpu(), key, meta, out)
    return out


def _local_bucket(distopt, bucket, held: list, key: str, world: int) -> Tensor:
    local = torch.zeros(bucket.grad_data.numel() // world, dtype=torch.float32)
    for p in held:
        tensor = tensors_of(distopt, p).get(key)
        if tensor is not None:
            local[p.local[0] : p.local[1]] = tensor.detach().float().cpu()
    return local


def _gather(local: Tensor, group, everywhere: bool):
    parts = [torch.empty_like(local) for _ in range(group.size())]
    if everywhere:
        torch.distributed.all_gather(parts, local, group=group)
    else:
        dst = torch.distributed.get_process_group_ranks(group)[0]
        torch.distributed.gather(local, parts if group.rank() == 0 else None, dst, group=group)
    return torch.cat(parts)


def _cut(distopt, buffer, bucket, world: Tensor, key: str, meta: dict, out: dict) -> None:
    for param in bucket.params_list:
        name = param_name(distopt, param)
        if key in meta[name]["keys"]:
            start, end = in_bucket(buffer, bucket, param)
            out[name][key] = world[start:end].clone()


def scatter_state(distopt, state) -> None:
    """Inverse of ``gather_state``.

    Args:
        distopt: the ``MuonDistributedOptimizer``; every DP rank must call this.
        state: ``get_parameter_state_dp_zero``'s output on DP rank 0; ignored elsewhere.
    """
    group, device = _comm(distopt)
    # DP rank 0 alone reads the file: its verdict travels with the broadcast, so that a file
    # of another format raises on every rank instead of leaving the others in a collective.
    meta = _broadcast_object(distopt, _checked_meta(state) if group.rank() == 0 else None)
    if isinstance(meta, str):
        raise ValueError(meta)
    check_compatible(distopt, meta)
    held = _by_bucket(distopt)
    for where, buffer, bucket in buckets(distopt):
        for key in _union(meta):
            local = _scatter(distopt, buffer, bucket, state, key, group, device)
            for p in held.get(where, []):
                if key in _keys_of(distopt, p.shard):
                    set_piece_key(distopt, p, key, local[p.local[0] : p.local[1]])
    for p in shard_pieces(distopt):
        set_scalars(distopt, p, meta[p.name]["scalars"])


def _checked_meta(state):
    """The file's metadata, or the message of why it cannot be loaded (a str)."""
    try:
        _require_ours(state, "the parameter state file")
        return _meta_of_state(state)
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        if isinstance(err, ValueError):
            return str(err)
        return f"the parameter state file is malformed ({type(err).__name__}: {err})"


def _meta_of_state(state) -> dict:
    params = state["params"]
    return {
        name: {
            "keys": tuple(k for k in tensors if k != "scalars"),
            "scalars": tensors["scalars"],
            "shape": tuple(state["shapes"][name]),
        }
        for name, tensors in params.items()
    }


def _scatter(distopt, buffer, bucket, state, key: str, group, device) -> Tensor:
    size = bucket.grad_data.numel() // group.size()
    local = torch.empty(size, dtype=torch.float32, device=device)
    parts = None
    if group.rank() == 0:
        world = torch.zeros(bucket.grad_data.numel(), dtype=torch.float32)
        for param in bucket.params_list:
            tensors = state["params"][param_name(distopt, param)]
            if key in tensors:
                start, end = in_bucket(buffer, bucket, param)
                world[start:end] = tensors[key]
        parts = [t.to(device) for t in world.split(size)]
    src = torch.distributed.get_process_group_ranks(group)[0]
    torch.distributed.scatter(local, parts, src=src, group=group)
    return local.cpu()


@torch.no_grad()
def set_piece_key(distopt, piece: ShardPiece, key: str, value: Tensor) -> None:
    """Copy ``value`` into state ``key`` of ``piece``'s shard.

    Args:
        distopt: the ``MuonDistributedOptimizer``.
        piece: the shard piece.
        key: "param" or a state key.
        value: 1-D, the piece's elements.
    """
    tensors_of(distopt, piece)[key].copy_(value)


def set_scalars(distopt, piece: ShardPiece, scalars: dict) -> None:
    """Restore the scalar state of ``piece``'s shard, one tensor per param.

    Args:
        distopt: the ``MuonDistributedOptimizer``.
        piece: the shard piece.
        scalars: {key: value} as saved.
    """
    state = distopt.optimizer.state[piece.shard]
    for key in distopt.optimizer.scalar_state_keys(piece.shard):
        # one tensor per param: torch-style optimizers increment ``step`` in place
        state[key] = torch.tensor(scalars[key], dtype=torch.float32)


def _require_ours(state, what: str) -> None:
    if not (isinstance(state, dict) and state.get("format") == FORMAT):
        found = sorted(map(str, state))[:6] if isinstance(state, dict) else type(state).__name__
        raise ValueError(
            f"{what} was not written by a DistributedOptimizer whose optimizer declares its "
            f"state (format {FORMAT!r}); found keys {found}: a checkpoint of another optimizer "
            "(e.g. adam) cannot be loaded into this one"
        )


def get_parameter_state_dp_zero(distopt, everywhere: bool = False):
    """What ``save_parameter_state`` writes.

    Args:
        distopt: the ``MuonDistributedOptimizer``; every DP rank must call this.
        everywhere: build it on every DP rank, not only DP rank 0.

    Returns:
        {"format", "optimizer", "shapes", "params"} on the receivers; None elsewhere.
    """
    params = gather_state(distopt, everywhere)
    if params is None:
        return None
    return {
        "format": FORMAT,
        "optimizer": type(distopt.optimizer).__name__,
        "shapes": param_shapes(distopt),
        "params": params,
    }


# ------------------------------------------------------------------ the common (non-param) part


def state_dict(distopt) -> dict:
    """Param groups, grad scaler and the format marker; no per-param ``step`` (a fresh
    optimizer lacks it, unlike upstream's assumption): scalars travel with the param state."""
    groups = [{k: v for k, v in g.items() if k != "params"} for g in distopt.optimizer.param_groups]
    out = {"optimizer": {"param_groups": groups}, MARK: {"format": FORMAT}}
    out[MARK]["optimizer"] = type(distopt.optimizer).__name__
    if distopt.grad_scaler:
        out["grad_scaler"] = distopt.grad_scaler.state_dict()
    return out


def group_identity(group: dict) -> tuple:
    """Upstream's identifying keys (NeMo's ``pre_`` variants too) plus ``use_muon``."""
    return tuple(group.get(k, group.get(f"pre_{k}")) for k in GROUP_IDENTITY)


def require_marker(distopt, state: dict) -> None:
    """ValueError unless ``state`` was saved by an optimizer of this one's kind; upstream's
    ``DistributedOptimizer`` (patch 0011) calls it too, to refuse ours by name.

    Args:
        distopt: the ``DistributedOptimizer`` loaded into (ours or upstream's).
        state: the loaded common state dict.
    """
    mark = state.get(MARK)
    # MuonDistributedOptimizer's inner optimizer is a MegatronMuon (the factory, patch 0002)
    inner = distopt.optimizer
    ours = type(inner).__name__ if isinstance(inner, MegatronMuon) else None
    if mark is not None and ours is None and mark.get("optimizer") in ("Adam", "AdamW"):
        raise ValueError(
            f"DistributedOptimizer checkpoint of {mark['optimizer']} in this fork's earlier "
            f"declared-state format ({mark.get('format')}); torch Adam checkpoints now keep "
            "upstream's format (patch 0009): resume it with the fork version that wrote it"
        )
    if mark is None or mark.get("format") != FORMAT or ours is None or mark["optimizer"] != ours:
        saved = mark["optimizer"] if mark else "Adam (upstream's format: no declared state)"
        mine = ours or f"{type(distopt.optimizer).__name__} (upstream's format)"
        raise ValueError(
            f"DistributedOptimizer checkpoint was saved by {saved}; this optimizer is {mine}: "
            "their states differ (e.g. Muon's momentum_buffer vs Adam's exp_avg/exp_avg_sq)"
        )


def unsupported_format(distopt, name: str):
    """NotImplementedError naming the format and the supported ones.

    Args:
        distopt: the ``MuonDistributedOptimizer``.
        name: the requested format, e.g. a sharding_type.
    """
    raise NotImplementedError(
        f"DistributedOptimizer {name} is not implemented for {type(distopt.optimizer).__name__}; "
        "use sharding_type 'fully_reshardable' or 'dp_reshardable', or the torch format"
    )
