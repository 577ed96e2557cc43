"""Megatron-LM's rerun state machine through the real CLI, on gloo ranks (DP=2, and PP=2 for
the pipeline's stages). Error injection
(--error-injection-rate 1: every rank rejects its first checked result of each step from step 2
on) drives each path; a diverging --lr drives the real NaN one. Launch, e.g.:

    python -m torch.distributed.run --nproc-per-node 2 --standalone pretrain_gpt.py \\
        --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 \\
        --micro-batch-size 2 --global-batch-size 8 --lr 1e-2 --mock-data --vocab-size 64 \\
        --train-iters 3 --hidden-dropout 0.1 --no-check-for-nan-in-loss-and-grad \\
        --check-for-spiky-loss --error-injection-rate 1 --error-injection-type transient_error

Exit codes are Megatron-LM's: 16 (resume to re-run the step elsewhere), 17 (validation failed).
A launch of several ranks exits 1 as torchrun does; the code is then read off the loop's line.
"""

import os
import re

import pytest
import torch

from megatron.training import checkpointing

from .cli import TINY, losses, run

# dropout on: equal re-run results then also show the RNG state was restored
BASE = TINY + ["--train-iters", 3, "--global-batch-size", 8, "--hidden-dropout", 0.1]
INJECT = ["--error-injection-rate", 1, "--error-injection-type"]
NON_FATAL = ["--no-check-for-nan-in-loss-and-grad", "--check-for-spiky-loss"]
RERUN = re.compile(
    r"First rerun: unexpected result is (?:not )?reproducible .*?\((\S+) !?= ([^\s)]+)"
)
STOPPED = "rerun state machine: stopped before the update of iteration {} (exit code {})"


def _output(proc) -> str:
    return proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def reference():
    """DP=2, the default mode, nothing rejected: no step re-run."""
    proc = run(BASE, nproc=2)
    assert "First rerun" not in _output(proc)
    return losses(proc)


def test_transient_faults_rerun_the_same_batch_and_training_goes_on(reference):
    proc = run(BASE + NON_FATAL + ["--check-for-large-grads"] + INJECT + ["transient_error"], 2)
    # each rank re-ran steps 2 and 3 and saw the result of the first run again (same micro-
    # batches, same dropout): the injected fault alone made the comparison fail
    pairs = RERUN.findall(proc.stderr)
    assert len(pairs) == 4 and all(a == b for a, b in pairs), pairs
    assert "Possible transient error!" in proc.stderr
    assert proc.stderr.count("Continuing normal execution") == 2  # rank 0, once per step
    assert losses(proc) == reference  # the re-runs changed nothing: same losses, grad norms


def test_report_stats_runs_every_step_twice_and_reports(reference):
    proc = run(BASE + ["--rerun-mode", "report_stats", "--check-for-spiky-loss"], nproc=2)
    assert losses(proc) == reference
    assert proc.stderr.count("Stats on computation determinism") == 2  # steps 1 and 3
    assert "Spiky loss:" in proc.stderr and "samples, all identical" in proc.stderr
    # CPU runs are deterministic: every checked value (losses, grad norms) matched its re-run;
    # a loss handed to the machine uncopied would differ (the schedule divides it in place)
    assert "rel. variability" not in proc.stderr


def test_fatal_transient_fault_saves_and_exits_17_and_the_job_resumes(tmp_path):
    save = str(tmp_path / "save")
    flags = BASE + ["--save", save, "--ckpt-format", "torch"]
    proc = run(flags + INJECT + ["transient_error"])
    assert proc.returncode == 17, _output(proc)[-3000:]
    assert "Possible transient error!" in proc.stderr
    assert STOPPED.format(2, 17) in proc.stdout
    assert checkpointing.read_tracker(save) == 1  # the steps done: for further examination
    # a transient fault is over: the job restarted from that checkpoint trains on
    resumed = run(flags + ["--load", save])
    assert sorted(losses(resumed)) == [2, 3], _output(resumed)[-3000:]
    # nothing was left to re-run: the checkpoint holds no machine state
    assert not os.path.isdir(
        os.path.join(checkpointing.checkpoint_dir(save, 1), "rerun_state_machine")
    )


def test_a_real_nan_reruns_reproduces_and_exits_16_with_a_checkpoint(tmp_path):
    """The default (validate_results, --check-for-nan-in-loss-and-grad): a diverging run's NaN
    is reproduced on the re-run; the checkpoint before that step holds the machine's state.
    Saved every step, --save-retain-interval 2 keeps the even ones and the latest."""
    save = str(tmp_path / "save")
    extra = ["--lr", "1e4", "--train-iters", 8, "--save", save, "--ckpt-format", "torch"]
    proc = run(TINY + extra + ["--save-interval", 1, "--save-retain-interval", 2])
    assert proc.returncode == 16, _output(proc)[-3000:]
    failed = int(re.search(r"stopped before the update of iteration (\d+)", proc.stdout)[1])
    assert re.search(r"found (NaN|Inf) in local", proc.stderr)
    assert "First rerun: unexpected result is reproducible" in proc.stderr
    latest = checkpointing.read_tracker(save)
    assert latest == failed - 1
    assert os.path.isfile(checkpointing.rerun_file(checkpointing.checkpoint_dir(save, latest), 0))
    kept = {int(n[len("iter_") :]) for n in os.listdir(save) if n.startswith("iter_")}
    assert kept == {i for i in range(1, failed) if i % 2 == 0} | {latest}, (kept, failed)


def _moved_to_another_node(folder: str) -> None:
    """What a resume on another machine looks like to the machine's same-GPU test."""
    for name in os.listdir(os.path.join(folder, "rerun_state_machine")):
        path = os.path.join(folder, "rerun_state_machine", name)
        saved = torch.load(path, weights_only=False)
        saved["sharded"]["suspicious_node"] = "another-node"
        torch.save(saved, path)


def test_correct_result_rerun_from_a_torch_checkpoint_on_another_node(tmp_path):
    save = str(tmp_path / "save")
    flags = BASE + INJECT + ["correct_result", "--save", save, "--ckpt-format", "torch"]
    first = run(flags, nproc=2)
    assert first.returncode != 0 and STOPPED.format(2, 16) in first.stdout, _output(first)[-3000:]
    assert "Need to rerun on a different GPU" in first.stderr
    _moved_to_another_node(checkpointing.checkpoint_dir(save, 1))
    second = run(flags + ["--load", save], nproc=2)
    out = _output(second)
    assert "Getting RerunStateMachine state from checkpoint" in out, out[-3000:]
    assert out.count("Second rerun: unexpected result is reproducible on a different GPU") == 2
    assert STOPPED.format(2, 17) in second.stdout  # fatal (the NaN check): validation failed
    # with another number of ranks the step cannot be replayed (its micro-batches and results
    # are per rank); --rerun-mode disabled trains on without it (the iteration 1 checkpoint)
    plain = BASE + ["--save", save, "--ckpt-format", "torch", "--load", save]
    resumed = run(plain + ["--rerun-mode", "disabled"], nproc=1)
    assert "the step to re-run in" in resumed.stdout, _output(resumed)[-3000:]
    assert sorted(losses(resumed)) == [2, 3]


def test_persistent_fault_torch_dist_pipeline_resume_on_the_same_node(tmp_path):
    """PP=2: the stages judge different results (the loss on the last, local grad norms on
    both) and still re-run, save and exit together; resumed on the same node, the machine's
    restored state asks for another resume elsewhere (16 again, nothing saved). --async-save
    with a save every step: the machine's checkpoint replaces the interval save of the same
    iteration, still in flight when the fault stops the run."""
    save = str(tmp_path / "save")
    flags = BASE + ["--pipeline-model-parallel-size", 2, "--save", save]
    flags += ["--async-save", "--save-interval", 1]
    flags += INJECT + ["persistent_error", "--use-distributed-optimizer"]
    first = run(flags, nproc=2)
    assert STOPPED.format(2, 16) in first.stdout, _output(first)[-3000:]
    assert first.stderr.count("Need to rerun on a different GPU") == 2
    common = torch.load(
        os.path.join(checkpointing.checkpoint_dir(save, 1), "common.pt"), weights_only=False
    )
    assert common["rerun_state_machine"]["current_iteration"] == 1  # the 2nd step, from 0
    second = run(flags + ["--load", save], nproc=2)
    out = _output(second)
    assert out.count("Got rescheduled on the same GPU") == 2, out[-3000:]  # both stages
    assert STOPPED.format(2, 16) in second.stdout
    assert checkpointing.read_tracker(save) == 1
    # PP=2 x DP=2 cannot replay the step: refused by name (was a "corrupt?" missing key)
    refused = run(flags + ["--load", save], nproc=4)
    assert refused.returncode != 0
    assert "holds a step to re-run saved by 2 ranks" in refused.stderr, _output(refused)[-3000:]
