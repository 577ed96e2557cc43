"""Early exits through the real CLI: SIGTERM as Slurm sends it, --exit-duration-in-mins,
--exit-interval. Each saves a checkpoint and exits 0; a launch resuming from it continues the
uninterrupted run's loss sequence exactly.

    .venv/bin/python -m pytest -q tests/e2e/test_exit.py
"""

import os
import signal

from .cli import TINY, losses, run, start

TRACKER = "latest_checkpointed_iteration.txt"
# Constant lr: the schedule does not depend on where a launch stops.
COMMON = TINY + ["--train-iters", 200, "--lr-decay-style", "constant", "--optimizer", "muon"]
# The signal tests launch through real torchrun, where a torch_dist save would start upstream's
# spawned results-queue server in each rank, which imports torch (~1.7 CPU-s: writer_queue.py).
# The exit's save is the same call in either format; test_exit_duration... saves torch_dist.
SIGNALLED = COMMON + ["--ckpt-format", "torch"]


def _tracker(save: str) -> int:
    return int(open(os.path.join(save, TRACKER)).read())


def _signal_after(proc, iteration: int, sig) -> str:
    """Send ``sig`` to the launcher once the log shows ``iteration``; the whole output."""
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if f"iteration {iteration:8d}/" in line:
            proc.send_signal(sig)
            break
    rest, _ = proc.communicate(timeout=300)
    return "".join(lines) + rest


def test_sigterm_to_torchrun_saves_and_resume_is_exact(tmp_path):
    """SIGTERM to torchrun (what Slurm's --signal sends to the step's tasks): torchrun forwards it
    to both ranks, they agree on the step to stop after, save it, and exit 0. A reference run
    without the signal and a launch resuming from the saved step print the same losses. The
    reference stops by --exit-interval k + 2: it saves that step and exits 0 as
    test_exit_duration_and_interval_save_and_exit_zero's timed run does."""
    save = str(tmp_path / "save")
    proc = start(SIGNALLED + ["--exit-signal-handler", "--save", save], nproc=2)
    output = _signal_after(proc, 2, signal.SIGTERM)
    stopped = losses(_Done(output))
    # torchrun itself exits 1 after forwarding a signal; the ranks' exit 0 is checked below.
    assert "exiting program after receiving SIGTERM" in output, output[-3000:]
    k = _tracker(save)
    assert k == max(stopped) and k >= 2
    assert sorted(os.listdir(save)) == sorted([f"iter_{k:07d}", TRACKER])
    interval = str(tmp_path / "interval")
    proc = run(SIGNALLED + ["--exit-interval", k + 2, "--save", interval], nproc=2)
    _assert_exited(proc, interval, k + 2, f"exiting program at iteration {k + 2}")
    reference = losses(proc)
    assert stopped == {i: reference[i] for i in range(1, k + 1)}
    resumed = losses(run(SIGNALLED + ["--exit-interval", k + 2, "--load", save], nproc=2))
    assert resumed == {k + 1: reference[k + 1], k + 2: reference[k + 2]}


def test_sigterm_to_one_rank_stops_every_rank_at_the_same_step(tmp_path):
    """Only rank 1 gets the signal (a node that Slurm signalled first): the collective check
    stops rank 0 too, after the same step, with one complete checkpoint."""
    import psutil

    save = str(tmp_path / "save")
    proc = start(SIGNALLED + ["--exit-signal-handler", "--save", save], nproc=2)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if f"iteration {2:8d}/" in line:
            workers = psutil.Process(proc.pid).children()
            rank1 = [
                w for w in workers if "LOCAL_RANK" in w.environ() and w.environ()["RANK"] == "1"
            ]
            assert len(rank1) == 1, [w.cmdline() for w in workers]
            rank1[0].send_signal(signal.SIGTERM)
            break
    rest, _ = proc.communicate(timeout=300)
    output = "".join(lines) + rest
    assert proc.returncode == 0, output[-3000:]
    k = _tracker(save)
    assert max(losses(_Done(output))) == k >= 2
    assert f"saved checkpoint from iteration {k:7d}" in output
    assert "exiting program after receiving SIGTERM" in output


def test_exit_duration_and_interval_save_and_exit_zero(tmp_path):
    """--exit-duration-in-mins (a fraction of a minute is over once start-up is done) stops after
    the first step, leaving that step's evaluation after its first batch as Megatron-LM does (no
    validation line). It saves and exits 0, without the evaluations that follow a completed run
    (Megatron-LM exits before them). --exit-interval: the reference run of
    test_sigterm_to_torchrun_saves_and_resume_is_exact, checked the same way."""
    timed = ["--exit-duration-in-mins", 0.001, "--eval-interval", 1, "--eval-iters", 3]
    save = str(tmp_path / "save")
    proc = run(COMMON + timed + ["--save", save])
    _assert_exited(proc, save, 1, "Exiting during evaluation, timelimit reached")
    assert "validation loss" not in proc.stdout  # its one evaluation was left: no validation line


def _assert_exited(proc, save: str, expected: int, message: str) -> None:
    """Stopped after step ``expected`` (saved, exit 0) with ``message``; no final evaluations."""
    assert sorted(losses(proc)) == list(range(1, expected + 1))
    assert message in proc.stdout and _tracker(save) == expected
    assert "exiting program" in proc.stdout and "set |" not in proc.stdout


class _Done:
    """The shape losses() reads, for a launch whose output was collected while it ran."""

    def __init__(self, stdout: str, returncode: int = 0):
        self.stdout, self.stderr, self.returncode = stdout, "", returncode
