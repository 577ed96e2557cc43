"""torch Adam/AdamW under the DistributedOptimizer, resumable in upstream's checkpoint format:
the repairs patch 0009 calls. The four defects: docs/checkpoints.md.
"""

import torch


def common_step(inner_state_dict: dict) -> float:
    """The one ``step`` of torch Adam's per-param states; 0 for a fresh optimizer."""
    steps = {state["step"].item() for state in inner_state_dict["state"].values()}
    if len(steps) > 1:
        raise RuntimeError(f"torch Adam params are at different steps {sorted(steps)}")
    return steps.pop() if steps else 0


def unshare_steps(optimizer: torch.optim.Optimizer) -> None:
    """Give each param its own ``step`` tensor (torch's Adam increments it in place)."""
    for state in optimizer.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()


@torch.no_grad()
def copy_state(destination: dict, source: dict) -> None:
    """Copy a param's main param and state tensors from ``source``, without ``step`` (restored
    from the param groups) or non-tensor values (0.19's loaders pass some).

    Args:
        destination: {key: tensor} of this rank's shard, written in place.
        source: {key: tensor} of the loaded shard, same keys and shapes.
    """
    for key, tensor in destination.items():
        if key != "step" and torch.is_tensor(source[key]):
            tensor.copy_(source[key])
