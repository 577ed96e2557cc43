"""Megatron-FSDP's fsdp_dtensor checkpoints: every rank's optimizer state names the same tensors.

    state_dict["optimizer"] = fill_empty_shard_state(state_dict["optimizer"], model)  # patch 0080

Megatron-FSDP shards each bucket by bytes, so a rank can hold none of a parameter (an empty local
shard). It gives that parameter no gradient (``update_main_grads``: ``grad = None`` when the shard
is empty), so the optimizer (torch's Adam, TE's FusedAdam) never creates its state there, and
``_init_optimizer_states_with_dummy_values`` skips it on load. Upstream's
``preprocess_state_dict_for_uneven_dtensor`` then runs one collective per DTensor of the sorted
state dict, assuming every rank has the same ones: a rank with fewer waits in a collective its
peers never enter (save and load hang), and before that the peers pair the chunk shapes of
different tensors. Here a rank fills each missing state tensor with an empty local shard of the
parameter's DTensor (its mesh, placements and global shape), with the keys and dtypes the
parameter's state has on the ranks that hold it, so every rank walks the same list. An empty shard
writes and reads nothing; the optimizer never steps a parameter without a gradient, so training
is unchanged.
"""

import torch
from torch.distributed.tensor import DTensor


def fill_empty_shard_state(optimizer_state: dict, model: torch.nn.Module) -> dict:
    """``optimizer_state`` (Megatron-FSDP's ``{"state": {name: {key: value}}, "param_to_group_meta":
    {name: ...}}``, keyed by the names of ``model.named_parameters()``) with the state of
    every parameter of ``param_to_group_meta`` that the other ranks hold and this one lacks.
    Collective over the default group (every rank saves or loads). Other layouts (a chained
    optimizer's list) are returned as they are."""
    if not (isinstance(optimizer_state, dict) and "param_to_group_meta" in optimizer_state):
        return optimizer_state
    state = optimizer_state["state"]
    everyone = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, _templates(state))
    params = {_bare(name): param for name, param in model.named_parameters()}
    for name in optimizer_state["param_to_group_meta"]:
        held = [mine[name] for mine in everyone if name in mine]
        if held and not _holds(state.get(name, {})):
            state[name] = {
                key: _empty_like(params[_bare(name)], value) if isinstance(value, str) else value
                for key, value in held[0].items()
            }
    return optimizer_state


def with_empty_shard_state(state_dict: dict, model: torch.nn.Module) -> dict:
    """A checkpoint's state dict whose optimizer state ``fill_empty_shard_state`` completed.

    Args:
        state_dict: the fsdp_dtensor state dict being saved or loaded.
        model: the first model chunk.

    Returns:
        ``state_dict`` itself without an ``optimizer`` entry, else a copy of it (the outer dict)
        with the filled optimizer state.
    """
    if "optimizer" not in state_dict:
        return state_dict
    return {**state_dict, "optimizer": fill_empty_shard_state(state_dict["optimizer"], model)}


def _bare(name: str) -> str:
    """A parameter's name without its wrappers' ``module.`` prefixes: the optimizer names them
    from its model chunks (DDP wrapper included), the checkpoint from the unwrapped model."""
    while name.startswith("module."):
        name = name.removeprefix("module.")
    return name


def _templates(state: dict) -> dict:
    """Per param name, its state as a peer without it must rebuild it: a DTensor's dtype name
    (an empty shard of it is made there), any other value itself (Adam's ``step``: DCP saves a
    plain tensor from one rank of those that have it, so every copy must be the true one)."""
    return {
        name: {
            key: str(value.dtype).removeprefix("torch.") if isinstance(value, DTensor) else value
            for key, value in entry.items()
        }
        for name, entry in state.items()
        if _holds(entry)
    }


def _holds(entry: dict) -> bool:
    """Whether this rank holds part of the parameter: a non-empty DTensor shard in its state. A
    rank that does not keeps what an earlier load filled in, Adam's ``step`` included, which no
    step advances: it is replaced by a holder's each time, or DCP might save the stale one."""
    return any(isinstance(v, DTensor) and v.to_local().numel() > 0 for v in entry.values())


def _empty_like(param: DTensor, dtype: str) -> DTensor:
    local, dtype = param.to_local(), getattr(torch, dtype)
    assert local.numel() == 0, "state is missing only where the local shard is empty"
    return DTensor.from_local(
        torch.empty(local.shape, dtype=dtype, device=local.device),
        param.device_mesh,
        param.placements,
        shape=param.shape,
        stride=param.stride(),
        run_check=False,
    )


def optimizer_state_for_loading(optimizer) -> dict:
    """``optimizer.state_dict()`` with every state tensor allocated, for DCP to load into (patch
    0081: upstream's torch_dcp load asks ``state_dict(is_loading=True)``, which only
    Float16Optimizer takes). Each chained optimizer's ``init_state_fn`` first, as that one does;
    torch's SGD, which has none, gets its momentum buffers (``sgd_momentum_for_loading``)."""
    for chained in getattr(optimizer, "chained_optimizers", [optimizer]):
        if chained.optimizer is not None and callable(chained.init_state_fn):
            chained.init_state_fn(chained.optimizer, chained.config)
        elif isinstance(chained.optimizer, torch.optim.SGD):
            sgd_momentum_for_loading(chained.optimizer)
    return optimizer.state_dict()


def sgd_momentum_for_loading(optimizer: torch.optim.SGD) -> None:
    """A zero ``momentum_buffer`` for each param of a group with momentum that has none: torch
    creates it at the first step, so a fresh optimizer offered DCP no key and the checkpoint's
    momentum was not loaded. DCP overwrites the zeros; where the checkpoint has no buffer, a zero
    one steps as none does (``buf * momentum + grad``, Megatron's dampening 0), so only groups
    without dampening get one."""
    for group in optimizer.param_groups:
        if not group.get("momentum") or group.get("dampening"):
            continue
        for param in group["params"]:
            state = optimizer.state[param]
            if state.get("momentum_buffer") is None:
                state["momentum_buffer"] = torch.zeros_like(
                    param, memory_format=torch.preserve_format
                )
