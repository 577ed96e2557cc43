"""All-gather of per-rank tensors of different sizes, on gloo too (which refuses uneven sizes):
LayerWise Muon's, through patch 0041. docs/upstream_repairs.md.
"""

import torch
import torch.distributed as dist


class _PaddedWork:
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
    """``dist.all_gather`` where each rank's 1-D part may differ in size (on gloo: padded).

    Args:
        gather_list: one 1-D tensor per rank of ``group``, filled in place.
        src: this rank's part.
        group: the process group.
        async_op: return a work handle instead of waiting.

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
    return _PaddedWork(work, padded, gather_list)


def wait_all(handles: list) -> None:
    """Wait for a bucket group's all-gathers: each padded gloo one too, not only the last."""
    for work in handles[:-1]:
        if isinstance(work, _PaddedWork):
            work.wait()
    handles[-1].wait()
