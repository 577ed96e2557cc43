"""torch Adam's per-param ``step`` where megatron-core seeds or checkpoints its state.

torch's Adam creates ``step`` only for an empty state; megatron-core 0.19.2 seeds
``exp_avg``/``exp_avg_sq`` for checkpoint loading and drops a saved step of 0, so the next
``step()`` is a ``KeyError: 'step'``. Patch 0042 calls ``seed_step`` and keeps a step of 0
(docs/checkpoints.md, "torch_adam_step.py").
"""

import torch


def seed_step(optimizer: torch.optim.Optimizer, group: dict, param: torch.Tensor) -> None:
    """Give a torch Adam state seeded without one the ``step`` torch's own ``_init_group`` makes:
    the step the optimizer's other params are at (they share one), else 0. Other optimizers (TE
    and Apex keep the step in their param groups) are left alone.

    Args:
        optimizer: the inner torch optimizer whose state was seeded.
        group: ``param``'s param group (``capturable``/``fused`` put the step on its device).
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
