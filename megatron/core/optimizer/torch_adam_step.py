"""torch Adam's per-param ``step`` where megatron-core seeds or checkpoints its state.

Without Transformer Engine or Apex, Megatron's Adam is torch's ``Adam``/``AdamW``, which keeps a
``step`` in every param's state and creates it only for an empty state. Two places of
megatron-core 0.19.2 lose it outside the DistributedOptimizer (which patch 0009 repairs):

1. the ``init_state_fn`` of ``_get_megatron_optimizer_based_on_param_groups`` seeds
   ``exp_avg``/``exp_avg_sq`` for checkpoint loading and nothing else: the state is no longer
   empty, so torch's next ``step()`` is a ``KeyError: 'step'``;
2. ``Float16OptimizerWithFloat16Params`` / ``FP32Optimizer.sharded_state_dict`` save the shared
   step only ``if step:``, so a step of 0 (a seeded state) is dropped and the loaded states have
   none: the same ``KeyError``.

Patch ``0042-torch-adam-step-kept.patch`` calls :func:`seed_step` from (1) and keeps a step of 0
in (2) (``is not None``). The LayerWise optimizer (``--optimizer muon
--use-distributed-optimizer`` without its param layout) and the emerging-optimizer chain put
torch Adam under those two wrappers.
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
