"""Timers, memory figures, model FLOPs and the progress log, without launching anything; the
device paths (CUDA sync, CUDA memory stats) with a stand-in for the CUDA calls.

    .venv/bin/python -m pytest -q tests/unit/test_timers.py
"""

import logging
import time
from types import SimpleNamespace

import pytest
import torch

from megatron.training import log_memory, progress, timers
from megatron.training.flops import flops_per_iteration

CPU = torch.device("cpu")


def test_levels_decide_which_timers_run():
    group = timers.Timers(1, "minmax", CPU, always=("muon-newton-schulz",))
    assert group("fine", log_level=2) is timers._OFF
    assert group("fine") is timers._OFF  # later calls keep the first call's level
    coarse = group("coarse", log_level=1)
    assert isinstance(coarse, timers.Timer) and group("coarse") is coarse
    assert isinstance(group("muon-newton-schulz", log_level=2), timers.Timer)  # always on
    with pytest.raises(AssertionError, match="log level 2, registered with 1"):
        group("coarse", log_level=2)
    with pytest.raises(ValueError, match="--timing-log-level must be one of"):
        timers.Timers(3, "max", CPU)


def test_timer_accumulates_until_reset():
    timer = timers.Timer("t", CPU)
    for _ in range(2):
        timer.start()
        time.sleep(0.01)
        timer.stop()
    assert timer.elapsed(reset=False) >= 0.02
    assert timer.elapsed() >= 0.02 and timer.elapsed() == 0.0
    timer.start()
    time.sleep(0.01)
    assert timer.elapsed() >= 0.01 and timer._started_at is not None  # still running
    with pytest.raises(AssertionError, match="already been started"):
        timer.start()


def test_sync_only_where_the_device_runs_asynchronously(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cpu, "synchronize", lambda *a: calls.append("cpu"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: calls.append("cuda"))
    timers.synchronize(CPU)
    timers.synchronize(torch.device("cuda", 0))
    assert calls == ["cuda"]


MS = torch.tensor([[10.0, 0.0, 1.0], [30.0, 0.0, 0.0]])  # [rank, timer]; rank 1 never ran "c"


@pytest.mark.parametrize(
    "option, expected",
    [
        ("max", "max time across ranks (ms):\n    a {d}: 30.00\n    c {d}: 1.00"),
        ("minmax", "(min, max) time across ranks (ms):\n    a {d}: (10.00, 30.00)\n    c {d}: "
         "(1.00, 1.00)"),
        ("all", "times across ranks (ms):\n  a:\n     rank  0: 10.00\n     rank  1: 30.00\n"
         "  c:\n     rank  0: 1.00"),
    ],
)  # fmt: skip
def test_reports_are_megatron_lms(option, expected):
    text = timers.Timers(2, option, CPU).format(["a", "b", "c"], MS)
    assert text == expected.format(d="." * 46)
    assert timers.Timers(2, option, CPU).format(["b"], MS[:, 1:2]) is None


def test_memory_figures_cpu_and_cuda(monkeypatch):
    cpu = log_memory.figures(CPU)
    assert set(cpu) == {"mem-rss-bytes", "mem-max-rss-bytes"} and cpu["mem-rss-bytes"] > 1e7
    stats = {
        "reserved_bytes.all.current": 4,
        "allocated_bytes.all.current": 3,
        "allocated_bytes.all.peak": 5,
        "allocation.all.current": 2,
    }
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: stats)
    cuda = log_memory.figures(torch.device("cuda", 0))
    assert cuda == {
        "mem-reserved-bytes": 4,
        "mem-allocated-bytes": 3,
        "mem-max-allocated-bytes": 5,
        "mem-allocated-count": 2,
    }


def _config(**kw):
    base = dict(
        num_layers=2,
        hidden_size=8,
        num_attention_heads=2,
        num_query_groups=1,
        kv_channels=4,
        ffn_hidden_size=16,
        gated_linear_unit=False,
        num_moe_experts=None,
        moe_layer_freq=1,
        moe_router_topk=2,
        moe_ffn_hidden_size=6,
        moe_shared_expert_intermediate_size=None,
    )
    return SimpleNamespace(**{**base, **kw})


def test_model_flops_dense_gqa_and_moe():
    # per token and layer: qkv 8 (8 + 2*4) = 128, attention 8 x 10 = 80, proj 64, MLP 2 x 128
    dense = 6 * 3 * 10 * (2 * (128 + 80 + 64 + 256) + 8 * 32)
    assert flops_per_iteration(_config(), seq_length=10, vocab=32, batch_size=3) == dense
    # MoE every 2nd layer (layer 0): top-2 of ffn 6 with SwiGLU = 3 x 8 x 12; layer 1 dense
    moe = _config(num_moe_experts=4, moe_layer_freq=2, gated_linear_unit=True)
    attention = 128 + 80 + 64
    expected = 6 * 10 * (2 * attention + 3 * 8 * 12 + 3 * 8 * 16 + 8 * 32)
    assert flops_per_iteration(moe, seq_length=10, vocab=32, batch_size=1) == expected


def test_progress_run_starts_at_the_first_job_of_this_world_size(tmp_path):
    path = tmp_path / "progress.txt"
    rows = [
        ("2026-01-01 00:00:00", 4, "Starting job"),
        ("2026-01-01 01:00:00", 4, "Saved checkpoint\tIteration: 5\tJ\tC\tFloating-point "
         "operations: 1.00e+15\tT"),
        ("2026-01-01 02:00:00", 8, "Starting job"),
        ("2026-01-01 03:00:00", 8, "Saved checkpoint\tIteration: 9\tJ\tC\tFloating-point "
         "operations: 3.00e+15\tT"),
        ("2026-01-01 04:00:00", 8, "Starting job"),
    ]  # fmt: skip
    path.write_text("".join(f"{t}\tJob ID: 1\t# GPUs: {w}\t{x}\n" for t, w, x in rows))
    start, flops = progress.run_started(str(path), 8)
    assert flops == 1e15  # the FLOPs done when the 8-GPU run began
    assert start == progress.datetime.strptime("2026-01-01 02:00:00", progress.STAMP).timestamp()
    assert progress.run_started(str(path), 2) == (None, 0.0)


def test_logging_level_from_the_flag_else_the_environment(monkeypatch):
    from megatron.training.initialize import set_logging_level

    root = logging.getLogger()
    monkeypatch.setattr(root, "level", root.level)  # restored afterwards
    monkeypatch.setenv("MEGATRON_LOGGING_LEVEL", "40")
    set_logging_level(None)
    assert root.level == 40
    set_logging_level(10)
    assert root.level == 10


def test_evaluation_runs_without_timers(monkeypatch):
    """As Megatron-LM: evaluation's forward passes do not add to the training timers (the
    schedules read ``config.timers``); the timers are back for the next training step."""
    from megatron.training import training

    config = SimpleNamespace(timers="the run's timers")
    chunk = SimpleNamespace(config=config, eval=lambda: None, train=lambda: None)
    seen = []
    monkeypatch.setattr(training, "run_schedule", lambda *a, **k: seen.append(config.timers) or [])
    args = SimpleNamespace(
        eval_iters=2,
        empty_unused_memory_level=0,
        global_batch_size=4,  # evaluation batches are --global-batch-size ones
        micro_batch_size=2,
        data_parallel_size=1,
    )
    state = SimpleNamespace(consumed_valid_samples=0)
    training.evaluate(args, None, None, [chunk], state)
    assert seen == [None, None] and config.timers == "the run's timers"
    assert state.consumed_valid_samples == 8
