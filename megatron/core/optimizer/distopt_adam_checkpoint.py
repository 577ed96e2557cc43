"""torch Adam/AdamW under the DistributedOptimizer: upstream's checkpoint format, resumable.

Without Transformer Engine or Apex, Megatron's Adam is torch's ``Adam``/``AdamW``, and plain
megatron-core (0.16.1, 0.19.2) cannot resume it from any DistOpt checkpoint. Patch
``0009-distopt-torch-adam-checkpoint-repairs.patch`` calls the repairs below from
``distrib_optimizer.py``; the checkpoint *format* stays upstream's, so a checkpoint written by
plain megatron-core loads here and one written here loads wherever upstream can load:

1. ``state_dict()`` asserts that all params share one ``step``; a fresh optimizer has none, and
   ``sharded_state_dict(is_loading=True)`` calls it before anything is loaded
   (``common_step``: 0, the step torch starts from).
2. ``_set_main_param_and_optimizer_states`` copies every key of the destination state, so the
   per-param ``step`` is a ``KeyError`` (``torch``, ``fully_reshardable``) or the loading
   optimizer's own step (``dp_reshardable``); the step comes from the param groups instead. The
   copy into fp32 main params (views of the model params) also needs ``no_grad``
   (``copy_state``).
3. ``load_state_dict`` gives every param one shared ``step`` tensor, which torch's Adam then
   increments once per param per step: wrong bias correction after resume (``unshare_steps``).
4. ``fully_reshardable`` slices the dp-zero gather (buckets' unpadded parts, concatenated) at
   ``param_index_map`` offsets that count the padding ending each bucket: every param after the
   first bucket was saved shifted (on 0.16.1; NVIDIA/Megatron-LM#5077) or is loaded shifted.
   ``distopt_layout.unpadded_index_map`` gives the offsets the gathered tensors have. A
   ``fully_reshardable`` checkpoint that plain 0.16.1 wrote with several buckets per buffer
   (``overlap_grad_reduce``) holds that shifted state; no loader can restore it.
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
