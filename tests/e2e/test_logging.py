"""Log-line figures through the real CLI: --log-params-norm, --log-num-zeros-in-grad,
--log-validation-ppl-to-tensorboard.

    .venv/bin/python -m pytest -q tests/e2e/test_logging.py
"""

import math
import os
import re

import pytest
import torch

from .cli import TINY, losses, run
from .test_train import _tensorboard_scalars

FLAGS = TINY + "--optimizer muon --train-iters 2 --untie-embeddings-and-output-weights".split()
FLAGS += ["--log-params-norm", "--log-num-zeros-in-grad"]


def _figure(stdout: str, name: str) -> list:
    return [float(x) for x in re.findall(rf" {name}: (\S+) \|", stdout)]


def test_params_norm_num_zeros_and_validation_ppl(tmp_path):
    """The printed params norm is the norm of the saved params (TP=1, and TP=2 where each
    replicated param counts once); the untied embedding's padded rows (64 of 128, never an
    input) have zero grads, so num zeros >= 64 x 32; TensorBoard gets exp(validation loss)."""
    save, tb = str(tmp_path / "save"), str(tmp_path / "tb")
    args = FLAGS + ["--ckpt-format", "torch"]
    one = run(
        args + ["--save", save, "--tensorboard-dir", tb, "--log-validation-ppl-to-tensorboard"]
    )
    assert sorted(losses(one)) == [1, 2]
    norms, zeros = _figure(one.stdout, "params norm"), _figure(one.stdout, "num zeros")
    assert len(norms) == len(zeros) == 2 and all(64 * 32 <= z < 20_000 for z in zeros), zeros
    assert norms[1] == pytest.approx(_saved_norm(save, 1), abs=1e-3)  # printed with 3 decimals
    save2 = str(tmp_path / "save2")
    two = run(args + ["--save", save2, "--tensor-model-parallel-size", 2], nproc=2)
    assert _figure(two.stdout, "params norm")[1] == pytest.approx(_saved_norm(save2, 2), abs=1e-3)
    scalars = _tensorboard_scalars(tb)
    ((step, loss),) = scalars["validation/lm loss"]
    assert scalars["validation/lm loss ppl"] == [(step, pytest.approx(math.exp(loss), rel=1e-5))]
    assert [v for _, v in scalars["params-norm"]] == pytest.approx(norms, abs=1e-3)
    assert [v for _, v in scalars["num-zeros"]] == zeros


def _saved_norm(save: str, tp: int) -> float:
    """Norm of the iteration-2 checkpoint's params over the TP shard files: a param equal in
    every file is replicated (norms, row-parallel biases) and counts once; others are shards."""
    folder = os.path.join(save, "iter_0000002")
    files = [os.path.join(folder, f"mp_rank_{r:02d}", "model_optim_rng.pt") for r in range(tp)]
    models = [torch.load(f, map_location="cpu", weights_only=False)["model"] for f in files]
    total = 0.0
    for name, first in models[0].items():
        if not (torch.is_tensor(first) and first.is_floating_point()):
            continue
        shards = [m[name] for m in models]
        replicated = all(s.shape == first.shape and torch.equal(s, first) for s in shards)
        total += sum(s.double().square().sum().item() for s in shards[: 1 if replicated else tp])
    return math.sqrt(total)
