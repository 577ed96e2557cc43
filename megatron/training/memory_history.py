"""--record-memory-history / --memory-snapshot-path: Megatron-LM's CUDA allocator history.

As Megatron-LM: before the model is built, ``torch.cuda.memory._record_memory_history`` keeps
the last 100,000 allocation and free events with their stacks, and an out-of-memory observer
pickles a snapshot to ``oom_rank-<rank>_<path>`` when an allocation fails; every --log-interval
steps the last rank pickles ``torch.cuda.memory._snapshot()`` to --memory-snapshot-path (default
``snapshot.pickle``), which PyTorch's memory visualizer (pytorch.org/memory_viz) reads. The
history is the CUDA caching allocator's: a CPU run has none to record, so the flags are refused
there rather than ignored. Not yet run on a GPU here.
"""

import pickle

import torch

from . import cpu_mode

MAX_ENTRIES = 100_000  # Megatron-LM's: alloc/free events kept before each snapshot

RULES = (
    (
        lambda a: a.record_memory_history and cpu_mode.requested(),
        lambda a: "--record-memory-history records the CUDA caching allocator's history "
        "(torch.cuda.memory._record_memory_history): it needs CUDA, and this is a CPU run",
    ),
    (
        lambda a: "memory_snapshot_path" in a.given and not a.record_memory_history,
        lambda a: "--memory-snapshot-path is where --record-memory-history writes its "
        "snapshots: it needs --record-memory-history",
    ),
)


def start(args) -> None:
    """Record the allocator's history from here on (before the model is built, as upstream)."""
    if not args.record_memory_history:
        return
    torch.cuda.memory._record_memory_history(
        True, trace_alloc_max_entries=MAX_ENTRIES, trace_alloc_record_context=True
    )
    torch._C._cuda_attach_out_of_memory_observer(_oom_observer(args.memory_snapshot_path))


def _oom_observer(path: str):
    def observe(device, alloc, device_alloc, device_free):
        print("saving allocated state during OOM", flush=True)
        _dump(f"oom_rank-{torch.distributed.get_rank()}_{path}")

    return observe


def snapshot(args, last_rank: bool) -> None:
    """At a --log-interval step: the last rank writes the snapshot (over the previous one)."""
    if args.record_memory_history and last_rank:
        _dump(args.memory_snapshot_path)


def _dump(path: str) -> None:
    with open(path, "wb") as f:
        pickle.dump(torch.cuda.memory._snapshot(), f)
