"""bench/convergence.py's arithmetic: reaching a target loss, the schedule-matched figure, the lr
grid extension, and the counted parameters against a real run of the flags it passes."""

import os
import re
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))

import convergence  # noqa: E402


def test_steps_to_reach_interpolates_between_evaluations():
    curve = [(10, 3.0), (20, 2.0), (30, 1.0)]
    assert convergence.steps_to_reach(curve, 1.5) == pytest.approx(25.0)
    assert convergence.steps_to_reach(curve, 3.5) == 10.0  # already there at the first point
    assert convergence.steps_to_reach(curve, 0.5) is None


def test_schedule_to_reach_is_exact_inside_and_a_bound_below():
    finals = [(240, 1.0), (108, 1.4), (156, 1.2)]  # unsorted on purpose
    steps, exact = convergence.schedule_to_reach(finals, 1.3)
    assert exact and steps == pytest.approx(132.0)  # halfway between 108 and 156
    assert convergence.schedule_to_reach(finals, 1.5) == (108.0, False)  # <= the shortest run
    assert convergence.schedule_to_reach(finals, 0.9)[0] is None


def test_lr_grid_grows_only_at_an_edge():
    assert convergence.next_lr([1e-3, 3e-3, 1e-2], 1e-2) == 3e-2
    assert convergence.next_lr([1e-3, 3e-3, 1e-2], 1e-3) == 3e-4
    assert convergence.next_lr([1e-3, 3e-3, 1e-2], 3e-3) is None
    assert convergence.next_lr([3e-3], 3e-3) is None  # one lr: nothing to bracket


def test_flops_count_newton_schulz_per_matrix():
    size = dict(convergence.QUICK)
    adam, muon = (convergence.flops_per_step(size, o) for o in ("adam", "muon"))
    assert adam["model"] == muon["model"]
    p = convergence.model_params(size)
    # One 128 x 64 fc1 (s=64, l=128) per layer among the Muon matrices, by hand:
    assert [2 * size["ffn"], size["hidden"]] in p["muon"]
    ns = sum(5 * (4 * min(m) ** 2 * max(m) + 2 * min(m) ** 3) for m in p["muon"])
    rest = p["total"] - sum(r * c for r, c in p["muon"])
    assert muon["optimizer"] == ns + 12 * rest
    assert adam["optimizer"] == 12 * p["total"]


def test_counted_params_match_a_real_run(tmp_path):
    """The count the FLOPs come from is the model the study's flags build (printed by
    pretrain_gpt.py); a few steps on mock data."""
    size = dict(convergence.QUICK)
    run = ("x", "muon", 1e-2, 1234, 4)  # 4 steps: more than the warmup
    args = convergence.train_args(size, run, ("unused", "98,2,0"))
    drop = {"--data-path", "--split", "--full-validation"}
    keep, skip = [], False
    for a in args:
        if skip:
            skip = False
            continue
        if a in drop:
            skip = a != "--full-validation"
            continue
        keep.append(a)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "pretrain_gpt.py", *keep, "--mock-data", "--eval-iters", "0"]
    proc = subprocess.run(
        cmd, cwd=convergence.ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    printed = int(re.search(r"number of parameters: (\d+)", proc.stdout)[1])
    assert printed == convergence.model_params(size)["total"]
