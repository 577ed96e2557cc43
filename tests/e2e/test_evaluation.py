"""Evaluation as Megatron-LM's pretrain runs it, through the real CLI: after the last step the
validation split (``iteration N on validation set``) and the test split (``iteration N on test
set``, from --split's third share or --test-data-path) are evaluated, each over --eval-iters
global batches; an early exit (--exit-interval ...) skips both, as upstream exits first.
During --rampup-batch-size an evaluation still reads whole --global-batch-size batches
(upstream's evaluate: "make validation batch size independent from training batch size").

    .venv/bin/python -m pytest -q tests/e2e/test_evaluation.py
"""

import os
import re

from .cli import TINY, losses, run

_VALID = re.compile(
    r"validation loss at (iteration \d+(?: on \w+ set)?) \| lm loss value: (\S+) \|"
)


def _evaluations(proc) -> list:
    """[(label, loss)] of the validation blocks, in order."""
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [(label, float(value)) for label, value in _VALID.findall(proc.stdout)]


def test_training_ends_with_validation_and_test_evaluations():
    """Mock data has all three splits: in-loop evaluation at 2, then after step 3 the validation
    and the test split, in upstream's order and labels."""
    proc = run(TINY + ["--train-iters", 3, "--optimizer", "adam"])
    assert sorted(losses(proc)) == [1, 2, 3]
    labels = [label for label, _ in _evaluations(proc)]
    assert labels == ["iteration 2", "iteration 3 on validation set", "iteration 3 on test set"]


def test_evaluation_reads_whole_global_batches_during_rampup():
    """--lr 1e-12: the weights do not move within the printed digits, so an evaluation's loss
    depends only on the samples it reads. With --rampup-batch-size 2 2 12 the first steps train
    on batches of 2, but each evaluation must read the same 6-sample batches (and advance the
    validation position by 6) as a run at a constant batch of 6: the same losses. Reading the
    ramp's batch (2 samples) gives other losses (the negative control is the ramp itself)."""
    common = TINY + ["--global-batch-size", 6, "--lr", 1e-12, "--optimizer", "adam"]  # last wins
    common += ["--eval-interval", 1, "--train-samples", 24]
    ramp = _evaluations(run(common + ["--rampup-batch-size", 2, 2, 12]))
    flat = _evaluations(run(common))
    in_loop = [value for label, value in ramp if "set" not in label]
    assert len(in_loop) >= 4 and len({*in_loop}) > 1  # the windows move
    assert in_loop[:4] == [value for label, value in flat if "set" not in label][:4]


def test_skip_train_evaluates_the_loaded_checkpoint(tmp_path):
    """--skip-train: no step, no save; the validation and test splits are evaluated at the
    loaded iteration, both from their first sample, as Megatron-LM (every checkpoint scored
    on the same batches). The saved run evaluated the validation split at iteration 2 in the
    loop (its first window) and after its last step (the next window), with the weights the
    checkpoint holds: --skip-train must give the in-loop loss, and the test loss."""
    save = str(tmp_path / "save")
    common = TINY + ["--train-iters", 2, "--optimizer", "adam", "--save", save]
    trained = _evaluations(run(common + ["--save-interval", 2]))
    tracker = os.path.join(save, "latest_checkpointed_iteration.txt")
    written = os.stat(tracker).st_mtime_ns
    proc = run(common + ["--load", save, "--skip-train"])
    assert os.stat(tracker).st_mtime_ns == written  # not saved again
    assert "skipping training (--skip-train is on)" in proc.stdout and not losses(proc)
    labels = ["iteration 2", "iteration 2 on validation set", "iteration 2 on test set"]
    assert [label for label, _ in trained] == labels and trained[0][1] != trained[1][1]
    assert _evaluations(proc) == [(labels[1], trained[0][1]), trained[2]]
    assert sorted(os.listdir(save)) == ["iter_0000002", "latest_checkpointed_iteration.txt"]
