"""torch Adam/AdamW under the DistributedOptimizer: upstream's checkpoint format, resumable.

Without Transformer Engine or Apex plain megatron-core cannot resume torch's Adam from any DistOpt
checkpoint (a fresh state_dict asserts, a per-param ``step`` is lost or shared, fully_reshardable
slices at padded offsets: NVIDIA/Megatron-LM#5077). Patch 0009 calls these repairs from
``distrib_optimizer.py``; the format stays upstream's. The four defects: docs/checkpoints.md.
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
    """Copy a param's main param and state tensors from ``source``; ``step`` is not one of them
    (load_state_dict restores it from the param groups), nor is a non-tensor source value
    (megatron-core 0.19's loaders pass some).

    Args:
        destination: {key: tensor} of this rank's shard, written in place.
        source: {key: tensor} of the loaded shard, same keys and shapes.
    """
    for key, tensor in destination.items():
        if key != "step" and torch.is_tensor(source[key]):
            tensor.copy_(source[key])
