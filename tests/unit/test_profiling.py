"""``--profile`` with ``--use-pytorch-profiler`` (megatron/training/profiling.py), off the CLI.
The CLI launch with a trace checked step by step is in tests/e2e/test_logging.py."""

import json
import os
from types import SimpleNamespace

import torch

from megatron.training.profiling import StepProfiler


def _args(tmp_path, start, end, ranks=(0,)):
    return SimpleNamespace(
        profile=True,
        use_pytorch_profiler=True,
        profile_step_start=start,
        profile_step_end=end,
        profile_ranks=list(ranks),
        tensorboard_dir=str(tmp_path),
    )


def _steps(profiler: StepProfiler, count: int) -> None:
    for done in range(count):
        profiler.before_step(done)
        torch.ones(8, 8) @ torch.ones(8, 8)
        profiler.after_step(done + 1)


def _recorded(tmp_path) -> set:
    traces = [n for n in os.listdir(tmp_path) if n.endswith(".pt.trace.json")]
    assert len(traces) == 1, traces
    with open(os.path.join(tmp_path, traces[0])) as f:
        names = {e.get("name") or "" for e in json.load(f)["traceEvents"]}
    return {n for n in names if n.startswith("ProfilerStep#")}


def test_steps_start_to_end_are_recorded(tmp_path):
    profiler = StepProfiler(_args(tmp_path, 2, 4), rank=0)
    _steps(profiler, 6)
    profiler.stop()
    assert _recorded(tmp_path) == {"ProfilerStep#2", "ProfilerStep#3"}


def test_a_run_ending_inside_the_window_still_writes_its_trace(tmp_path):
    profiler = StepProfiler(_args(tmp_path, 2, 10), rank=0)
    _steps(profiler, 3)  # the run ends after step 3, before --profile-step-end
    profiler.stop()
    assert _recorded(tmp_path) == {"ProfilerStep#2", "ProfilerStep#3"}


def test_ranks_not_listed_do_not_profile(tmp_path):
    profiler = StepProfiler(_args(tmp_path, 1, 2, ranks=(1,)), rank=0)
    _steps(profiler, 3)
    profiler.stop()
    assert os.listdir(tmp_path) == []


def test_a_run_ending_before_the_window_says_nothing_was_recorded(tmp_path, capsys):
    profiler = StepProfiler(_args(tmp_path, 3, 5), rank=0)
    _steps(profiler, 2)
    profiler.stop()
    assert os.listdir(tmp_path) == []
    assert "ended before --profile-step-start (3): nothing recorded" in capsys.readouterr().out
    recorded = StepProfiler(_args(tmp_path / "other", 1, 2), rank=0)
    _steps(recorded, 3)
    recorded.stop()
    assert "nothing recorded" not in capsys.readouterr().out
