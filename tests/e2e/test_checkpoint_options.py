"""Checkpoint options through the real CLI: --no-save-optim / --no-save-rng.

.venv/bin/python -m pytest -q tests/e2e/test_checkpoint_options.py
"""

import os

import torch

from .cli import TINY, losses, run

ARGS = TINY + "--optimizer muon --ckpt-format torch".split()


def test_no_save_optim_and_rng_leave_them_out_and_loading_needs_no_load(tmp_path):
    save = str(tmp_path / "save")
    losses(run(ARGS + ["--train-iters", 2, "--save", save, "--no-save-optim", "--no-save-rng"]))
    path = os.path.join(save, "iter_0000002", "mp_rank_00", "model_optim_rng.pt")
    saved = torch.load(path, map_location="cpu", weights_only=False)
    assert "model" in saved and "optimizer" not in saved and "rng_state" not in saved
    refused = run(ARGS + ["--train-iters", 3, "--load", save])
    assert refused.returncode == 1
    assert "saved with --no-save-optim" in refused.stderr and "--no-load-optim" in refused.stderr
    resumed = run(ARGS + ["--train-iters", 3, "--load", save, "--no-load-optim", "--no-load-rng"])
    assert sorted(losses(resumed)) == [3]  # the weights and the position in the data resume
