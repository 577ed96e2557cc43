"""Checkpoint options through the real CLI: --no-save-optim / --no-save-rng,
--auto-detect-ckpt-format, --use-checkpoint-args.

.venv/bin/python -m pytest -q tests/e2e/test_checkpoint_options.py
"""

import os

import torch

from megatron.training import checkpoint_args

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


def test_auto_detect_ckpt_format_loads_either_format_and_saves_in_ckpt_format(tmp_path):
    """Megatron-LM semantics: --ckpt-format torch alone reads only torch files; with
    --auto-detect-ckpt-format (or --ckpt-format torch_dist) the saved format is detected. Saves
    use --ckpt-format, so the chain torch_dist -> torch -> torch_dist converts both ways and must
    continue the uninterrupted run's losses exactly."""
    base = TINY + ["--optimizer", "muon", "--lr-decay-style", "constant"]
    first, second, third = (str(tmp_path / name) for name in ("a", "b", "c"))
    full = losses(run(base + ["--train-iters", 4, "--ckpt-format", "torch"]))
    got = losses(run(base + ["--train-iters", 2, "--ckpt-format", "torch_dist", "--save", first]))
    refused = run(base + ["--train-iters", 3, "--ckpt-format", "torch", "--load", first])
    assert refused.returncode == 1
    assert "torch_dist format" in refused.stderr and "--auto-detect-ckpt-format" in refused.stderr
    to_torch = ["--ckpt-format", "torch", "--auto-detect-ckpt-format"]
    got.update(
        losses(run(base + ["--train-iters", 3, "--load", first, "--save", second] + to_torch))
    )
    assert os.path.isfile(os.path.join(second, "iter_0000003", "mp_rank_00", "model_optim_rng.pt"))
    to_dist = ["--ckpt-format", "torch_dist", "--auto-detect-ckpt-format"]
    got.update(
        losses(run(base + ["--train-iters", 4, "--load", second, "--save", third] + to_dist))
    )
    assert os.path.isfile(os.path.join(third, "iter_0000004", "metadata.json"))
    assert got == full
    for root in (second, third):  # --use-checkpoint-args reads either format (no process group)
        assert checkpoint_args.saved_args(root)[1]["hidden_size"] == 32


SHAPE = "--num-layers 2 --hidden-size 32 --num-attention-heads 4".split()


def test_use_checkpoint_args_takes_the_model_shape_from_the_checkpoint(tmp_path):
    """Megatron-LM's rule: unset shape flags come from the checkpoint, forced ones (--swiglu
    here) replace the command line's value; a given value that differs is refused by name."""
    save = str(tmp_path / "save")
    base = TINY + ["--optimizer", "muon", "--lr-decay-style", "constant", "--train-iters", 4]
    full = losses(run(base + ["--save", save, "--save-interval", 2, "--ckpt-format", "torch"]))
    with open(os.path.join(save, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("2")  # resume from iteration 2
    assert base[:6] == SHAPE
    unshaped = base[6:]  # no --num-layers, --hidden-size, --num-attention-heads
    resumed = run(unshaped + ["--load", save, "--use-checkpoint-args", "--swiglu"])
    assert losses(resumed) == {3: full[3], 4: full[4]}
    assert "setting hidden_size to 32 from checkpoint" in resumed.stdout
    assert "setting swiglu to False from checkpoint" in resumed.stdout
    wider = run(base + ["--load", save, "--use-checkpoint-args", "--hidden-size", 64])
    assert wider.returncode == 1 and "--hidden-size: checkpoint 32, this run 64" in wider.stderr
