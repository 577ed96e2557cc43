"""Checkpoint options through the real CLI: --no-save-optim / --no-save-rng,
--auto-detect-ckpt-format, --use-checkpoint-args, --use-checkpoint-opt_param-scheduler /
--override-opt_param-scheduler; the torch_dist options --async-save,
--dist-ckpt-optim-fully-reshardable, --dist-ckpt-strictness, --ckpt-assume-constant-structure,
--ckpt-fully-parallel-load and --no-ckpt-fully-parallel-save.

.venv/bin/python -m pytest -q tests/e2e/test_checkpoint_options.py
"""

import os
import shutil
import threading
import time

import torch

from megatron.core import dist_checkpointing
from megatron.training import checkpoint_args

from .cli import TINY, losses, run

ARGS = TINY + "--optimizer muon --ckpt-format torch".split()
MUON_FLAGS = ["--optimizer", "muon", "--lr-decay-style", "constant"]


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
    # resumed with more --train-iters: the saved lr/wd schedule continues (as Megatron-LM asks)
    to_torch = [
        "--ckpt-format",
        "torch",
        "--auto-detect-ckpt-format",
        "--use-checkpoint-opt_param-scheduler",
    ]
    got.update(
        losses(run(base + ["--train-iters", 3, "--load", first, "--save", second] + to_torch))
    )
    assert os.path.isfile(os.path.join(second, "iter_0000003", "mp_rank_00", "model_optim_rng.pt"))
    to_dist = [
        "--ckpt-format",
        "torch_dist",
        "--auto-detect-ckpt-format",
        "--use-checkpoint-opt_param-scheduler",
    ]
    got.update(
        losses(run(base + ["--train-iters", 4, "--load", second, "--save", third] + to_dist))
    )
    assert os.path.isfile(os.path.join(third, "iter_0000004", "metadata.json"))
    assert got == full
    for root in (second, third):  # --use-checkpoint-args reads either format (no process group)
        assert checkpoint_args.saved_args(root)[1]["hidden_size"] == 32


def test_resumed_lr_schedule_follows_megatron_lms_scheduler_flags(tmp_path):
    """Megatron-LM's rule: a resumed lr/wd schedule must equal the command line's, unless
    --use-checkpoint-opt_param-scheduler (the saved schedule continues) or
    --override-opt_param-scheduler (the command line's replaces it) is given."""
    save = str(tmp_path / "save")
    i = TINY.index("--lr")
    base = TINY[:i] + TINY[i + 2 :] + MUON_FLAGS + ["--ckpt-format", "torch"]
    full = losses(run(base + ["--lr", 1e-2, "--train-iters", 3]))
    losses(run(base + ["--lr", 1e-2, "--train-iters", 2, "--save", save]))
    higher = base + ["--lr", 2e-2, "--train-iters", 3, "--load", save]
    refused = run(higher)
    assert refused.returncode == 1, refused.stdout[-2000:]
    assert "for learning rate" in refused.stderr
    assert "--use-checkpoint-opt_param-scheduler" in refused.stderr
    kept = run(higher + ["--use-checkpoint-opt_param-scheduler"])
    assert losses(kept) == {3: full[3]}  # the saved schedule, exactly
    assert "learning rate: 1.000000E-02" in kept.stdout
    replaced = run(higher + ["--override-opt_param-scheduler"])
    assert "learning rate: 2.000000E-02" in replaced.stdout  # the group lr the step uses


SHAPE = "--num-layers 2 --hidden-size 32 --num-attention-heads 4".split()


def test_use_checkpoint_args_takes_the_model_shape_from_the_checkpoint(tmp_path):
    """Megatron-LM's rule: unset shape flags come from the checkpoint, forced ones (--swiglu and
    the dropout rates here) replace the command line's value; a given value that differs is
    refused by name."""
    save = str(tmp_path / "save")
    base = TINY + ["--optimizer", "muon", "--lr-decay-style", "constant", "--train-iters", 4]
    base += ["--hidden-dropout", 0.05, "--attention-dropout", 0.2]
    full = losses(run(base + ["--save", save, "--save-interval", 2, "--ckpt-format", "torch"]))
    with open(os.path.join(save, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("2")  # resume from iteration 2
    assert base[:6] == SHAPE
    unshaped = base[6:-4]  # no --num-layers, --hidden-size, --num-attention-heads, dropout
    resumed = run(unshaped + ["--load", save, "--use-checkpoint-args", "--swiglu"])
    assert losses(resumed) == {3: full[3], 4: full[4]}
    assert "setting hidden_size to 32 from checkpoint" in resumed.stdout
    assert "setting swiglu to False from checkpoint" in resumed.stdout
    assert "setting hidden_dropout to 0.05 from checkpoint" in resumed.stdout
    wider = run(base + ["--load", save, "--use-checkpoint-args", "--hidden-size", 64])
    assert wider.returncode == 1 and "--hidden-size: checkpoint 32, this run 64" in wider.stderr


# DP=2 with the DistributedOptimizer, whose state each DistOpt layout shards differently. No
# dropout: the strictness launches resume without the RNG state and must still match.
DIST = TINY + MUON_FLAGS + ["--use-distributed-optimizer", "--ckpt-format", "torch_dist"]
DIST += ["--hidden-dropout", 0, "--attention-dropout", 0]
FOUR = DIST + ["--train-iters", 4]


def _only(save: str, iteration: int, into: str) -> str:
    """A --load folder holding only ``iteration`` of ``save``."""
    name = f"iter_{iteration:07d}"
    shutil.copytree(os.path.join(save, name), os.path.join(into, name))
    with open(os.path.join(into, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(iteration))
    return into


def _layout(save: str, iteration: int) -> str:
    common = dist_checkpointing.load_common_state_dict(os.path.join(save, f"iter_{iteration:07d}"))
    return dist_checkpointing.load_content_metadata(preloaded_state_dict=common)[
        "distrib_optim_sharding_type"
    ]


def _run_watching_tracker(args, save: str):
    """Launch (in a thread); while it runs, every tracker value seen must name a complete
    checkpoint (renamed from .partial, with dist_checkpointing's metadata.json). Returns
    (finished launch, values seen)."""
    done, seen = [], set()
    launch = threading.Thread(target=lambda: done.append(run(args, nproc=2)))
    launch.start()
    tracker = os.path.join(save, "latest_checkpointed_iteration.txt")
    while launch.is_alive():
        if os.path.isfile(tracker):
            text = open(tracker).read().strip()
            if text:
                folder = os.path.join(save, f"iter_{int(text):07d}")
                assert os.path.isfile(os.path.join(folder, "metadata.json")), f"{text}: partial"
                seen.add(int(text))
        time.sleep(0.01)
    launch.join()
    return done[0], seen


def test_torch_dist_options_save_and_resume_exactly(tmp_path):
    """A sync run saves at 2 and 4, an async one (2 steps) at 1 and 2, with different options;
    resumes from their iteration-2 checkpoints (other load options) print the sync run's losses
    for 3 and 4. The async run's second save is the one the cached structure wrote."""
    sync_dir, async_dir = str(tmp_path / "sync"), str(tmp_path / "async")
    sync_opts = ["--dist-ckpt-optim-fully-reshardable", "--no-ckpt-fully-parallel-save"]
    full = losses(run(FOUR + ["--save", sync_dir, "--save-interval", 2] + sync_opts, nproc=2))
    assert _layout(sync_dir, 2) == "fully_reshardable"

    async_opts = ["--async-save", "--ckpt-assume-constant-structure", "--log-progress"]
    two_steps = ["--train-iters", 2, "--save", async_dir, "--save-interval", 1]
    proc, seen = _run_watching_tracker(DIST + two_steps + async_opts, async_dir)
    assert losses(proc) == {1: full[1], 2: full[2]}  # saving does not touch training
    assert seen and seen <= {1, 2} and _layout(async_dir, 2) == "dp_reshardable"
    out = proc.stdout
    scheduled = out.index("scheduled an async save of iteration       2")
    assert scheduled < out.index("successfully saved checkpoint from iteration       2")
    assert sorted(os.listdir(async_dir)) == sorted(
        ["iter_0000001", "iter_0000002", "latest_checkpointed_iteration.txt", "progress.txt"]
    )
    progress = open(os.path.join(async_dir, "progress.txt")).read()  # written when complete
    assert [line.split("Iteration: ")[1][:1] for line in progress.splitlines()[1:]] == ["1", "2"]

    load = _only(async_dir, 2, str(tmp_path / "from_async"))
    strict = ["--dist-ckpt-strictness", "raise_all", "--ckpt-fully-parallel-load"]
    strict += ["--use-checkpoint-opt_param-scheduler"]  # saved by a 2-step run
    assert losses(run(FOUR + ["--load", load] + strict, nproc=2)) == {3: full[3], 4: full[4]}

    # the layout the checkpoint records is the one loaded (this run does not give the flag);
    # without --no-load-rng's rng_state, log_all reports the key the load leaves unread
    load = _only(sync_dir, 2, str(tmp_path / "from_sync"))
    logged = run(FOUR + ["--load", load, "--no-load-rng", "--dist-ckpt-strictness", "log_all"], 2)
    assert losses(logged) == {3: full[3], 4: full[4]}
    assert "Missing keys (for all ranks): {'rng_state'}" in logged.stdout + logged.stderr
    refused = run(FOUR + ["--load", load, "--no-load-rng", "--dist-ckpt-strictness", "raise_all"])
    assert refused.returncode == 1 and "rng_state" in refused.stderr
    assert "refused by --dist-ckpt-strictness raise_all" in refused.stderr


def test_exit_on_missing_checkpoint(tmp_path):
    """With --exit-on-missing-checkpoint an empty --load ends the run (code 0, as Megatron-LM)
    before any step; without it the run starts from scratch."""
    empty = str(tmp_path / "empty")
    os.makedirs(empty)
    args = TINY + ["--train-iters", 2, "--optimizer", "adam", "--load", empty]
    proc = run(args + ["--exit-on-missing-checkpoint"])
    assert proc.returncode == 0 and not losses(proc), proc.stderr[-2000:]
    assert "--exit-on-missing-checkpoint: no checkpoint in --load" in proc.stdout
    assert sorted(losses(run(args))) == [1, 2]
