"""--manual-gc / --manual-gc-interval and --empty-unused-memory-level through the real CLI, with
the events of the run recorded in order by tests/e2e/memory_probe.py.

    .venv/bin/python -m pytest -q tests/e2e/test_memory_flags.py
"""

import json
import os
import subprocess

from .cli import ROOT, TINY, command

FLAGS = TINY + ["--eval-interval", 3, "--optimizer", "muon"]


def _events(tmp_path, flags) -> list:
    out = str(tmp_path / "events.json")
    cmd, env = command(flags)
    cmd[1:1] = [os.path.join(ROOT, "tests", "e2e", "memory_probe.py"), out]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.load(open(out))


def _between_steps(events) -> list:
    """[(after step n: the events up to step n + 1)] from the first step on."""
    first = events.index(["step"])
    chunks, current = [], None
    for event in events[first:]:
        if event == ["step"]:
            if current is not None:
                chunks.append(current)
            current = []
        elif event[0] != "exit":
            current.append(event)
    return chunks + [current]


def test_manual_gc_collects_at_the_interval_and_around_evaluations(tmp_path):
    flags = FLAGS + ["--train-iters", 6, "--manual-gc", "--manual-gc-interval", 2]
    flags += ["--empty-unused-memory-level", 2]
    events = _events(tmp_path, flags)
    first = events.index(["step"])
    # disabled, then one full collection, before the first step
    assert events[first - 1] == ["gc", 2, False]
    full, young, empty = ["gc", 2, False], ["gc", 0, False], ["empty_cache"]
    step = [empty, empty]  # level 1: after forward/backward; level 2: after the optimizer step
    evaluation = [full, empty, young]  # collect all, one eval iteration (level 1), collect young
    expected = [
        step,  # 1
        step + [full],  # 2: the interval
        step + evaluation,  # 3: evaluation
        step + [full],  # 4
        step,  # 5
        step + evaluation + [full],  # 6: evaluation, then the interval (last in the iteration)
    ]
    chunks = _between_steps(events)
    after_loop = chunks[-1][len(expected[-1]) :]
    chunks[-1] = chunks[-1][: len(expected[-1])]
    assert chunks == expected
    assert events[-1] == ["exit", True]  # the collector is on again after the loop
    assert all(e[2] for e in after_loop if e[0] == "gc")  # collections after it are automatic
    # the validation and test evaluations after the last step: one batch each (level 1)
    assert [e for e in after_loop if e[0] != "gc"] == [empty, empty]


def test_without_the_flags_collection_stays_automatic_and_no_cache_is_emptied(tmp_path):
    events = _events(tmp_path, FLAGS + ["--train-iters", 2])
    assert ["empty_cache"] not in events
    gcs = [e for e in events if e[0] == "gc"]
    assert gcs and all(enabled for _, _, enabled in gcs)
