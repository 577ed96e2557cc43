"""Sample-based schedules, --rampup-batch-size and --decoupled-lr through the real CLI.

.venv/bin/python -m pytest -q tests/e2e/test_schedule.py
"""

import os
import re

import pytest
import torch

from .cli import TINY, losses, run

_LINE = re.compile(
    r"iteration\s+(\d+)/\s*(\d+) \| consumed samples:\s+(\d+) \|.*? learning rate: (\S+) \|"
    r"(?: decoupled learning rate: (\S+) \|)? global batch size:\s+(\d+) \|"
)


def _lines(proc) -> list:
    """[(iteration, of, consumed samples, lr, decoupled lr or None, global batch)] as printed."""
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [
        (int(m[1]), int(m[2]), int(m[3]), float(m[4]), m[5] and float(m[5]), int(m[6]))
        for m in _LINE.finditer(proc.stdout)
    ]


def _without(args: list, *flags) -> list:
    out, skip = [], 0
    for a in args:
        if skip:
            skip -= 1
        elif a in flags:
            skip = 1
        else:
            out.append(a)
    return out


BASE = _without(TINY, "--global-batch-size") + ["--global-batch-size", 4, "--optimizer", "muon"]


def test_sample_based_run_equals_its_iteration_based_twin():
    """--train-samples 32 / warm-up 8 / decay 24 samples at batch 4 is --train-iters 8 / warm-up
    2 / decay 6: same losses, same learning rates."""
    samples = run(
        BASE
        + "--train-samples 32 --lr-warmup-samples 8 --lr-decay-samples 24 --min-lr 1e-3".split()
    )
    iters = run(
        BASE + "--train-iters 8 --lr-warmup-iters 2 --lr-decay-iters 6 --min-lr 1e-3".split()
    )
    assert losses(samples) == losses(iters) and len(losses(samples)) == 8
    assert [x[3] for x in _lines(samples)] == [x[3] for x in _lines(iters)]


def test_rampup_batch_size_grows_the_batch_over_samples(tmp_path):
    """--rampup-batch-size 2 2 12 to batch 6 (micro batch 2): +2 every 6 samples, Megatron-LM's
    calculator; the lr warms up over 12 samples and decays linearly to --min-lr at 40. As
    Megatron-LM, a checkpoint is saved whenever the batch grows (before steps 4 and 6)."""
    args = _without(BASE, "--global-batch-size") + ["--global-batch-size", 6]
    args += "--train-samples 40 --rampup-batch-size 2 2 12 --lr-warmup-samples 12".split()
    save = str(tmp_path / "save")
    lines = _lines(run(args + ["--min-lr", 1e-3, "--save", save, "--ckpt-format", "torch"]))
    saved = sorted(int(name[5:]) for name in os.listdir(save) if name.startswith("iter_"))
    assert saved == [3, 5, len(lines)]
    batches = [x[5] for x in lines]
    # consumed 0,2,4 -> batch 2; 6,10 -> 4 (6/6 = 1 increment); 14 -> past the ramp: 6 ...
    assert batches[:6] == [2, 2, 2, 4, 4, 6] and set(batches[6:]) == {6}
    consumed = [x[2] for x in lines]
    assert consumed == [sum(batches[: i + 1]) for i in range(len(batches))]
    assert lines[-1][0] == lines[-1][1] == len(lines) and consumed[-1] <= 40 < consumed[-1] + 6
    for _, _, c, lr, _, _ in lines:  # the scheduler steps by the batch just consumed
        expected = 1e-2 * c / 12 if c <= 12 else 1e-3 + (1e-2 - 1e-3) * (40 - c) / (40 - 12)
        assert lr == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("optimizer", ["muon", "adam"])
def test_decoupled_lr_applies_to_embedding_and_output_only(tmp_path, optimizer):
    """--decoupled-lr 0: the (untied) embedding and output layer stay at their initial values
    while Muon's matrices and AdamW's other params (the final norm) train at --lr."""
    save = str(tmp_path / "save")
    args = _without(BASE, "--optimizer") + ["--optimizer", optimizer, "--train-iters", 2]
    args += "--untie-embeddings-and-output-weights --decoupled-lr 0 --ckpt-format torch".split()
    lines = _lines(run(args + ["--save", save, "--save-interval", 1]))
    assert [(x[3], x[4]) for x in lines] == [(1e-2 * (1 - i / 2), 0.0) for i in (1, 2)]
    one, two = (_model(save, i) for i in (1, 2))
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        assert torch.equal(one[name], two[name]), name
    for name in ("decoder.layers.0.mlp.linear_fc1.weight", "decoder.final_layernorm.weight"):
        assert not torch.equal(one[name], two[name]), name


def _model(save: str, iteration: int) -> dict:
    path = os.path.join(save, f"iter_{iteration:07d}", "mp_rank_00", "model_optim_rng.pt")
    return torch.load(path, map_location="cpu", weights_only=False)["model"]


def test_iterations_to_skip_drop_a_batch_without_a_step():
    """--iterations-to-skip 1 (Megatron-LM's 0-based index): the 2nd step's batch is read and
    dropped, no update, no lr step, no log line. --lr 1e-12 keeps the weights still within the
    printed digits and without dropout a loss depends only on the batch read: step 3 of both
    runs reads batch 3. The skipped run's lr at step 3 is the full run's at step 2 (one
    scheduler step fewer)."""
    common = BASE + "--train-iters 4 --lr 1e-12 --lr-decay-style linear --min-lr 0".split()
    common += "--hidden-dropout 0 --attention-dropout 0".split()  # no RNG drawn by a forward
    full, skipped = run(common), run(common + ["--iterations-to-skip", 1])
    assert sorted(losses(skipped)) == [1, 3, 4] and "iteration 2 skipped" in skipped.stdout
    assert losses(skipped)[3][0] == losses(full)[3][0] != losses(full)[2][0]
    full_lr = {line[0]: line[3] for line in _lines(full)}
    skipped_lines = {line[0]: line for line in _lines(skipped)}
    assert skipped_lines[3][3] == full_lr[2] != full_lr[3]
    assert skipped_lines[3][2] == 12  # consumed samples count the dropped batch


def test_iterations_to_skip_count_the_dropped_samples(tmp_path):
    """As Megatron-LM's training_log: ' skipped samples: N |' after the consumed samples once a
    batch was dropped; the count is saved with the checkpoint and carries on after a resume."""
    save = str(tmp_path / "save")
    common = BASE + ["--save", save, "--train-iters", 4, "--iterations-to-skip", 1]
    proc = run(common + ["--exit-interval", 3])  # saves at 3 and exits
    line = next(x for x in proc.stdout.splitlines() if re.search(r"iteration\s+3/", x))
    assert re.search(r"consumed samples:\s+12 \| skipped samples:\s+4 \|", line), line
    resumed = run(common + ["--load", save])
    line = next(x for x in resumed.stdout.splitlines() if re.search(r"iteration\s+4/", x))
    assert re.search(r"consumed samples:\s+16 \| skipped samples:\s+4 \|", line), line
