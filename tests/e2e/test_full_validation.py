"""--full-validation through the real CLI: every evaluation reads the same whole validation split.

With --lr 1e-12 (0 reads as "no --lr") the model does not change within the 6 printed digits, so
evaluations over the same samples print the same loss; with moving windows (the default) they
differ (the negative control)."""

import random
import re

from megatron.training.corpus import write_indexed

from .cli import TINY, run

_VALID = re.compile(r"validation loss at iteration (\d+) \| lm loss value: (\S+) \|")


def _prefix(tmp_path) -> str:
    """10 documents of 300 random lowercase bytes; --split 80,20,0 leaves 2 for validation
    (~37 samples of 16 tokens: 9 global batches of 4, not a whole number of them)."""
    rng = random.Random(0)
    texts = ["".join(rng.choice("abcdefgh \n") for _ in range(300)) for _ in range(10)]
    prefix = str(tmp_path / "tiny")
    write_indexed(prefix, texts)
    return prefix


def _evaluations(tmp_path, *extra, nproc=1) -> list[float]:
    data = [a for a in TINY if a not in ("--mock-data", "--vocab-size", "64", "--lr", "1e-2")]
    args = data + ["--data-path", _prefix(tmp_path), "--split", "80,20,0"]
    args += ["--tokenizer-type", "ByteLevelTokenizer", "--train-iters", 4, "--lr", 1e-12]
    proc = run(args + ["--optimizer", "adam", "--eval-interval", 1, *extra], nproc)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [float(v) for _, v in _VALID.findall(proc.stdout)]


def test_full_validation_reads_the_same_set_every_time(tmp_path):
    # TP=2: only TP rank 0 reads data; the other rank learns the batch count from it.
    fixed = _evaluations(tmp_path, "--full-validation", "--tensor-model-parallel-size", 2, nproc=2)
    assert len(fixed) == 4 and len(set(fixed)) == 1, fixed
    moving = _evaluations(tmp_path, "--eval-iters", 1)
    assert len(moving) == 4 and len(set(moving)) > 1, moving  # windows move without the flag


def test_full_validation_needs_a_global_batch_of_validation(tmp_path):
    data = [a for a in TINY if a not in ("--mock-data", "--vocab-size", "64")]
    args = data + ["--data-path", _prefix(tmp_path), "--split", "80,20,0", "--train-iters", 2]
    args += ["--tokenizer-type", "ByteLevelTokenizer", "--full-validation"]
    proc = run(args + ["--global-batch-size", 64, "--micro-batch-size", 64])
    assert proc.returncode != 0
    assert "--full-validation" in proc.stdout + proc.stderr
    assert "fewer samples than one global batch" in proc.stdout + proc.stderr
