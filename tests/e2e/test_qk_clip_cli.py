"""QK-clip through the real CLI: DP=2 with the DistributedOptimizer and Muon, the max attention
logit on the console and in TensorBoard, and a resumed run that clips as the uninterrupted one
(the clip keeps no state).

    .venv/bin/python -m pytest -q tests/e2e/test_qk_clip_cli.py
"""

import os
import re
import shutil

import pytest

from .cli import TINY, losses, run
from .test_train import _tensorboard_scalars

# Megatron's init (std 0.02) starts the tiny model's max logit near 0.06: 0.05 makes it clip.
CLIP = "--optimizer muon --use-distributed-optimizer --qk-clip --qk-clip-threshold 0.05"
_MAX = re.compile(r"iteration\s+(\d+)/.*? max attention logit: (\S+) \|")


def _max_logits(proc) -> dict:
    return {int(m[1]): m[2] for m in _MAX.finditer(proc.stdout)}


def test_qk_clip_logs_and_resumes_identically(tmp_path):
    save, tb = str(tmp_path / "save"), str(tmp_path / "tb")
    args = TINY + CLIP.split() + ["--train-iters", 4, "--ckpt-format", "torch"]
    full = run(args + ["--save", save, "--save-interval", 2, "--tensorboard-dir", tb], nproc=2)
    table, maxima = losses(full), _max_logits(full)
    assert sorted(maxima) == [1, 2, 3, 4], full.stdout[-2000:]
    assert float(maxima[1]) > 0.05  # the clip had something to do
    logged = [v for _, v in _tensorboard_scalars(tb)["max_attention_logit"]]
    assert logged == pytest.approx([float(maxima[i]) for i in range(1, 5)], rel=1e-5)
    load = str(tmp_path / "load")
    shutil.copytree(os.path.join(save, "iter_0000002"), os.path.join(load, "iter_0000002"))
    with open(os.path.join(load, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("2")
    resumed = run(args + ["--load", load], nproc=2)
    assert losses(resumed) == {3: table[3], 4: table[4]}
    assert _max_logits(resumed) == {3: maxima[3], 4: maxima[4]}
