"""megatron/training/memory.py in-process: the collector is handed back, --no-manual-gc-eval
skips the collections around evaluations, and the cache release goes to the run's device type.

    .venv/bin/python -m pytest -q tests/unit/test_memory.py
"""

import gc
import pickle

import torch

from megatron.training import memory


def _collections(action) -> list:
    seen = []
    record = lambda phase, info: seen.append(info["generation"]) if phase == "start" else None  # noqa: E731
    gc.callbacks.append(record)
    try:
        action()
    finally:
        gc.callbacks.remove(record)
    return seen


def test_no_manual_gc_eval_skips_the_collections_around_evaluations():
    assert gc.isenabled()
    with memory.ManualGC(True, 0, around_eval=False) as collector:
        assert not gc.isenabled()
        assert _collections(lambda: (collector.before_eval(), collector.after_eval())) == []
        assert _collections(lambda: collector.after_step(4)) == []  # interval 0: never
    assert gc.isenabled()
    with memory.ManualGC(True, 2) as collector:
        steps = _collections(lambda: [collector.after_step(i) for i in (1, 2, 3, 4)])
        around = _collections(lambda: (collector.before_eval(), collector.after_eval()))
    assert (steps, around) == ([2, 2], [2, 0])


def test_empty_cache_goes_to_the_device_types_allocator(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cpu, "empty_cache", lambda: calls.append(1), raising=False)
    for level, at_least in ((0, 1), (1, 2), (1, 1), (2, 2)):
        memory.empty_cache(level, at_least, torch.device("cpu"))
    assert len(calls) == 2
    monkeypatch.delattr(torch.cpu, "empty_cache")
    memory.empty_cache(2, 1, torch.device("cpu"))  # no allocator cache: nothing to call


def test_record_memory_history_calls_torchs_recorder_and_dumps_on_the_last_rank(
    monkeypatch, tmp_path
):
    """--record-memory-history with torch.cuda's recorder, snapshot and OOM hook stood in for
    (CPU runs refuse the flag: test_arguments.py); what a GPU run would call, with Megatron-LM's
    arguments, and where the pickles go. Not run against a real CUDA allocator here."""
    from types import SimpleNamespace

    from megatron.training import memory_history

    calls, observers = [], []
    monkeypatch.setattr(
        torch.cuda.memory, "_record_memory_history", lambda *a, **k: calls.append((a, k))
    )
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda: {"segments": ["s"]})
    monkeypatch.setattr(
        torch._C, "_cuda_attach_out_of_memory_observer", observers.append, raising=False
    )
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 3)
    monkeypatch.chdir(tmp_path)
    path = str(tmp_path / "snap.pickle")
    off = SimpleNamespace(record_memory_history=False, memory_snapshot_path=path)
    memory_history.start(off)
    memory_history.snapshot(off, last_rank=True)
    assert (calls, observers, list(tmp_path.iterdir())) == ([], [], [])
    args = SimpleNamespace(record_memory_history=True, memory_snapshot_path="snap.pickle")
    memory_history.start(args)
    assert calls == [
        ((True,), dict(trace_alloc_max_entries=100_000, trace_alloc_record_context=True))
    ]
    memory_history.snapshot(args, last_rank=False)
    assert list(tmp_path.iterdir()) == []  # only the last rank writes
    memory_history.snapshot(args, last_rank=True)
    observers[0](0, 1 << 30, 0, 0)  # an allocation failed: this rank's own file
    for name in ("snap.pickle", "oom_rank-3_snap.pickle"):
        with open(tmp_path / name, "rb") as f:
            assert pickle.load(f) == {"segments": ["s"]}
