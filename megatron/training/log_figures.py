"""Optional figures of the training log line, as Megatron-LM prints them:

    --log-num-zeros-in-grad   ' num zeros: 2048.0 |'   (from the optimizer's step)
    --log-params-norm         ' params norm: 12.345 |' (L2 norm of the whole model's params)

``figures(args, model, num_zeros)`` runs on every rank at a log iteration (the params norm is a
collective) and returns {console name: value} for the flags given.
"""

import torch
from megatron.core.tensor_parallel.layers import param_is_not_tensor_parallel_duplicate

from megatron.core import parallel_state

# console name -> TensorBoard tag (Megatron-LM's)
TAGS = {"num zeros": "num-zeros", "params norm": "params-norm"}
FORMATS = {"num zeros": "{:.1f}", "params norm": "{:.3f}"}


def figures(args, model, num_zeros) -> dict:
    out = {}
    if args.log_num_zeros_in_grad and num_zeros is not None:
        out["num zeros"] = float(num_zeros)
    if args.log_params_norm:
        out["params norm"] = params_norm(model)
    return out


def _counted_once(param) -> bool:
    """A param that no other rank holds a copy of: TP-replicated params (norms, biases of row
    parallel layers) count on TP rank 0 only; the output layer's copy of a tied embedding
    (``shared``, on the last pipeline stage) not at all."""
    return param_is_not_tensor_parallel_duplicate(param) and not getattr(param, "shared", False)


@torch.no_grad()
def params_norm(model) -> float:
    """sqrt(sum of squares) over the whole model, in fp64: dense params summed over the
    model-parallel group (TP x PP), expert params over the expert TP x EP x PP group."""
    sums = {True: 0.0, False: 0.0}  # expert?
    device = None
    for chunk in model:
        for param in chunk.parameters():
            device = param.device
            if _counted_once(param):
                expert = not getattr(param, "allreduce", True)
                sums[expert] += param.detach().double().square().sum().item()
    dense = torch.tensor([sums[False]], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(dense, group=parallel_state.get_model_parallel_group())
    expert = torch.tensor([sums[True]], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(
        expert, group=parallel_state.get_expert_tensor_model_pipeline_parallel_group()
    )
    return float((dense + expert).sqrt().item())
