"""``mtp_<k> loss`` figures of --mtp-num-layers, from megatron-core's MTP loss tracker.

megatron-core's GPTModel adds each MTP layer's per-micro-batch mean loss to
``MTPLossLoggingHelper.tracker`` during training forwards (last pipeline stage only); its own
reduction averages with ``ReduceOp.AVG``, which gloo lacks. Here: summed over the step's
micro-batches / their count, then averaged over the data-parallel (x context-parallel) group
with a SUM all-reduce, as Megatron-LM reports them; the tracker is zeroed for the next step.
Ranks without MTP layers return {} and join no collective.
"""

import torch
from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

from megatron.core import parallel_state


def start_step() -> None:
    """Zero the tracker before a forward-backward: a re-run of the step counts once."""
    if "values" in MTPLossLoggingHelper.tracker:
        MTPLossLoggingHelper.tracker["values"].zero_()


def mtp_losses(num_microbatches: int) -> dict:
    """{"mtp_1 loss": ..., ...} of the step just run, or {} where no MTP layer ran."""
    tracker = MTPLossLoggingHelper.tracker
    if "values" not in tracker:
        return {}
    values = tracker["values"].detach().clone().to(torch.float64) / num_microbatches
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    torch.distributed.all_reduce(values, group=group)
    values /= torch.distributed.get_world_size(group)
    tracker["values"].zero_()
    return {f"mtp_{k + 1} loss": v for k, v in enumerate(values.tolist())}
