"""All-gather of per-rank tensors of different sizes, on gloo too.

LayerWise Muon gathers each rank's flattened params, whose sizes differ by rank: in
``LayerWiseDistributedOptimizer.allgather_params`` (without a precomputed param layout) and in
the DDP buckets' param sync (``_ParamAndGradBucketGroup.start_param_sync``, synchronous or
overlapped with the forward pass). NCCL accepts uneven sizes; gloo refuses them
(``ProcessGroupGloo::allgather: invalid tensor size``). Patch
``0041-layer-wise-all-gather-on-gloo.patch`` calls :func:`all_gather` and :func:`wait_all`
there: on gloo each part is padded to the largest and sliced back; every other backend gets
torch's ``all_gather`` and upstream's wait as before.
"""

import torch
import torch.distributed as dist


class PaddedWork:
    """An async padded gloo all-gather: ``wait()`` also copies each part back into place."""

    def __init__(self, work, padded: list, gather_list: list):
        self._work, self._padded, self._gather_list = work, padded, gather_list

    def wait(self) -> bool:
        """Wait for the gather, then copy each rank's part from its padded buffer (once)."""
        if self._work is not None:
            self._work.wait()
            _unpad(self._gather_list, self._padded)
            self._work = self._padded = self._gather_list = None
        return True


def _unpad(gather_list: list, padded: list) -> None:
    for out, got in zip(gather_list, padded):
        out.copy_(got[: out.numel()])


def all_gather(gather_list: list, src: torch.Tensor, group, async_op: bool = False):
    """``dist.all_gather(gather_list, src, group, async_op)`` where ``gather_list[i]`` (1-D) may
    differ in size by rank ``i``; on gloo through a padded gather of the largest size.

    Args:
        gather_list: one 1-D tensor per rank of ``group``, filled in place.
        src: this rank's part (``gather_list[rank]``'s size).
        group: the process group.
        async_op: return a work handle (a :class:`PaddedWork` on gloo) instead of waiting.

    Returns:
        The work handle when ``async_op``, else None.
    """
    if dist.get_backend(group) != dist.Backend.GLOO:
        return dist.all_gather(gather_list, src, group=group, async_op=async_op)
    size = max(t.numel() for t in gather_list)
    padded = [src.new_empty(size) for _ in gather_list]
    src = torch.nn.functional.pad(src, (0, size - src.numel()))
    work = dist.all_gather(padded, src, group=group, async_op=async_op)
    if not async_op:
        _unpad(gather_list, padded)
        return None
    return PaddedWork(work, padded, gather_list)


def wait_all(handles: list) -> None:
    """Wait for a bucket group's all-gathers. Upstream waits only for the last (NCCL completes a
    communicator's collectives in order); a padded gloo gather must each be waited for, to copy
    its parts back (gloo's works may also finish out of order)."""
    for work in handles[:-1]:
        if isinstance(work, PaddedWork):
            work.wait()
    handles[-1].wait()
