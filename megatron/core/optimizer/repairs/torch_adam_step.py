"""torch Adam's per-param ``step`` where megatron-core seeds its state (patch 0042; why:
docs/checkpoints.md, "repairs/torch_adam_step.py").
"""

import torch


def seed_step(optimizer: torch.optim.Optimizer, group: dict, param: torch.Tensor) -> None:
    """Give a seeded torch Adam state the ``step`` torch would: the other params' (shared),
    else 0. Other optimizers keep their step in their groups: left alone.

    Args:
        optimizer: the inner torch optimizer whose state was seeded.
        group: ``param``'s param group (``capturable``/``fused``: the step on its device).
        param: the param whose state gets the step.
    """
    state = optimizer.state[param]
    if not isinstance(optimizer, torch.optim.Adam) or "step" in state:
        return
    shared = next((s["step"] for s in optimizer.state.values() if "step" in s), None)
    if shared is not None:
        state["step"] = shared.clone() if torch.is_tensor(shared) else shared
    elif group.get("capturable") or group.get("fused"):
        state["step"] = torch.zeros((), dtype=torch.float32, device=param.device)
    else:
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
