"""megatron/training/memory.py in-process: the collector is handed back, --no-manual-gc-eval
skips the collections around evaluations, and the cache release goes to the run's device type.

    .venv/bin/python -m pytest -q tests/unit/test_memory.py
"""

import gc

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
