"""All-gather of per-rank tensors of different sizes, on gloo too.

``LayerWiseDistributedOptimizer.allgather_params`` (the legacy path, without a precomputed
param layout: ``--no-use-layer-wise-param-layout``) gathers each rank's flattened params, whose
sizes differ by rank. NCCL accepts that; gloo refuses it (``ProcessGroupGloo::allgather:
invalid tensor size``). Patch ``0041-layer-wise-all-gather-on-gloo.patch`` calls
:func:`all_gather` there: on gloo each part is padded to the largest and sliced back; every other
backend gets torch's ``all_gather`` as before.
"""

import torch
import torch.distributed as dist


def all_gather(gather_list: list, src: torch.Tensor, group) -> None:
    """``dist.all_gather(gather_list, src, group)`` where ``gather_list[i]`` (1-D) may differ in
    size by rank ``i``; on gloo through a padded gather of the largest size.

    Args:
        gather_list: one 1-D tensor per rank of ``group``, filled in place.
        src: this rank's part (``gather_list[rank]``'s size).
        group: the process group.
    """
    if dist.get_backend(group) != dist.Backend.GLOO:
        dist.all_gather(gather_list, src, group=group)
        return
    size = max(t.numel() for t in gather_list)
    padded = [src.new_empty(size) for _ in gather_list]
    dist.all_gather(padded, torch.nn.functional.pad(src, (0, size - src.numel())), group=group)
    for out, got in zip(gather_list, padded):
        out.copy_(got[: out.numel()])
