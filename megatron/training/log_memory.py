"""--log-memory-to-tensorboard and --log-memory-interval: this rank's memory, as Megatron-LM
reports it on GPUs, and the process's resident memory where the device has no allocator stats.

    CUDA (any device with ``torch.<type>.memory_stats``): Megatron-LM's tags
        mem-reserved-bytes, mem-allocated-bytes, mem-max-allocated-bytes, mem-allocated-count
    CPU: the CPU allocator keeps no statistics; the process's resident set (psutil) stands in
        mem-rss-bytes, mem-max-rss-bytes (peak since the process started)

Tags differ on purpose: an RSS figure counts the Python heap and libraries too, so it must not
be read as allocator bytes. The console line (--log-memory-interval) is Megatron-LM's
``report_memory``: ``[Rank r] (after N iterations) memory (MB) | allocated: ... |``, printed by
the ranks of DP rank 0.
"""

import resource
import sys

import psutil
import torch

MB = 1024.0 * 1024.0


def _device_stats(device: torch.device):
    if device.type == "cpu":
        return None
    backend = getattr(torch, device.type, None)
    stats = getattr(backend, "memory_stats", None)
    return stats(device) if stats is not None else None


def _max_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB


def figures(device: torch.device) -> dict:
    """{TensorBoard tag: value} of this rank's memory now."""
    stats = _device_stats(device)
    if stats is None:
        rss = psutil.Process().memory_info().rss
        # the kernel's high-water mark is synced lazily and can trail the current RSS
        return {"mem-rss-bytes": rss, "mem-max-rss-bytes": max(rss, _max_rss_bytes())}
    return {
        "mem-reserved-bytes": stats.get("reserved_bytes.all.current", 0),
        "mem-allocated-bytes": stats.get("allocated_bytes.all.current", 0),
        "mem-max-allocated-bytes": stats.get("allocated_bytes.all.peak", 0),
        "mem-allocated-count": stats.get("allocation.all.current", 0),
    }


def report(iteration: int, device: torch.device) -> str:
    """Megatron-LM's ``report_memory`` line (MB) for this rank."""
    values = figures(device)
    if "mem-rss-bytes" in values:
        parts = [("rss", values["mem-rss-bytes"]), ("max rss", values["mem-max-rss-bytes"])]
    else:
        stats = _device_stats(device)
        parts = [
            ("allocated", stats.get("allocated_bytes.all.current", 0)),
            ("max allocated", stats.get("allocated_bytes.all.peak", 0)),
            ("reserved", stats.get("reserved_bytes.all.current", 0)),
            ("max reserved", stats.get("reserved_bytes.all.peak", 0)),
        ]
    text = "".join(f" | {name}: {value / MB}" for name, value in parts)
    rank = torch.distributed.get_rank()
    return f"[Rank {rank}] (after {iteration} iterations) memory (MB)" + text
