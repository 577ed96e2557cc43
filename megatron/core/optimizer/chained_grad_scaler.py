"""One loss scale for the sub-optimizers of a ChainedOptimizer (fp16 with dynamic loss scaling).

With expert parallelism megatron-core builds one Megatron optimizer for the dense params and one
for the expert params, each with its own grad scaler, while the loss is scaled by the first
one's scale (``ChainedOptimizer.get_loss_scale``). Upstream updates each scaler with its own
optimizer's inf/NaN check: an inf only in expert grads skips the step (rightly, the chain ORs
the checks) but backs off the expert scaler alone, and from then on the expert grads are
unscaled by a scale the loss was not scaled by (twice too large after one backoff; the growth
intervals drift apart the same way). Here every scaler starts the unscale from the first one's
state and takes the chain's verdict, so all of them hold one loss scale at all times.
"""

from collections.abc import Sequence


def prepare_grads_with_one_scale(optimizers: Sequence) -> bool:
    """``ChainedOptimizer.prepare_grads`` with one loss scale for every sub-optimizer.

    Args:
        optimizers: the chained Megatron optimizers; the first one's grad scaler scales the loss.

    Returns:
        Whether any of them found an inf or NaN (the same verdict on every rank: each check is
        reduced over its optimizer's grad-stats group, and replicas hold the same grads).
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
