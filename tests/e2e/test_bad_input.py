"""Bad input through the real CLI: a clear message, a non-zero exit, and no checkpoint written
(nor a partial one). One launch per case; the checkpoint cases share one saved run."""

import os

import pytest

from .cli import TINY, losses, run


def _assert_fails(proc, code: int, words: list, save: str | None = None, before=None):
    assert proc.returncode == code, proc.stdout[-2000:] + proc.stderr[-3000:]
    for word in words:
        assert word in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    if save is not None:
        assert sorted(os.listdir(save)) == (before or []), "a checkpoint was left behind"


def test_bad_flag_exits_2_before_saving(tmp_path):
    """One launch; the other argument errors are a table in tests/unit/test_arguments.py."""
    save = str(tmp_path / "save")
    os.makedirs(save)
    args = TINY + ["--train-iters", 2, "--save", save, "--hidden-sise", 64]
    _assert_fails(run(args), 2, ["unknown flag --hidden-sise", "--hidden-size"], save)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    save = str(tmp_path_factory.mktemp("ckpt") / "save")
    losses(run(TINY + ["--train-iters", 2, "--save", save]))
    return save


def test_mismatched_checkpoint_names_what_differs(saved, tmp_path):
    save = str(tmp_path / "new")
    os.makedirs(save)
    args = TINY + ["--train-iters", 4, "--load", saved, "--save", save]
    args[args.index("--hidden-size") + 1] = 64
    proc = run(args)
    _assert_fails(proc, 1, ["does not match", "--hidden-size: checkpoint 32, this run 64"], save)


def test_corrupt_checkpoint_is_reported(saved, tmp_path):
    import shutil

    load = str(tmp_path / "load")
    shutil.copytree(saved, load)
    folder = os.path.join(load, "iter_0000002")
    for name in os.listdir(folder):
        if name.endswith(".distcp"):
            with open(os.path.join(folder, name), "wb") as f:
                f.write(b"garbage")
    before = sorted(os.listdir(load))
    proc = run(TINY + ["--train-iters", 4, "--load", load, "--save", load])
    _assert_fails(proc, 1, ["checkpoint", "iter_0000002"], load, before)


def test_corrupt_tracker_is_reported(tmp_path):
    """read_tracker is what --load calls first (no launch needed for this case)."""
    from megatron.training.checkpointing import CheckpointError, read_tracker

    (tmp_path / "latest_checkpointed_iteration.txt").write_text("12abc")
    with pytest.raises(CheckpointError, match="latest_checkpointed_iteration.txt is corrupt"):
        read_tracker(str(tmp_path))
    assert read_tracker(str(tmp_path / "absent")) is None  # Megatron-LM: start from scratch
