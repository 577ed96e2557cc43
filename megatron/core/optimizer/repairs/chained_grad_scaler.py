"""One loss scale for the sub-optimizers of a ChainedOptimizer (fp16, dynamic loss scaling;
patch 0021): upstream lets an expert-only inf back off one scaler alone. docs/upstream_repairs.md.
"""

from collections.abc import Sequence


def prepare_grads_with_one_scale(optimizers: Sequence) -> bool:
    """``ChainedOptimizer.prepare_grads`` with one loss scale for every sub-optimizer.

    Args:
        optimizers: the chained Megatron optimizers; the first one's grad scaler scales the loss.

    Returns:
        Whether any of them found an inf or NaN (the same on every rank).
    """
    lead = getattr(optimizers[0], "grad_scaler", None)
    if lead is None:  # no loss scaling (fp32, bf16)
        return any([optimizer.prepare_grads() for optimizer in optimizers])
    others = [o.grad_scaler for o in optimizers[1:] if getattr(o, "grad_scaler", None)]
    before = lead.state_dict()
    for scaler in others:  # e.g. resumed from a checkpoint saved while the scales differed
        scaler.load_state_dict(before)
    found_inf = False
    for optimizer in optimizers:
        found_inf |= optimizer.prepare_grads()  # unscales, then updates its own scaler
    lead.load_state_dict(before)  # the updates again, all with the chain's verdict
    lead.update(found_inf)
    for scaler in others:
        scaler.load_state_dict(lead.state_dict())
    return found_inf
