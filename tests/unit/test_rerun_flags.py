"""The rerun state machine's flags and --save-retain-interval: parsing, bad input, the retain
rule (Megatron-LM's iter_finalize_fn in checkpointing.save_checkpoint) on a real folder.
The launches that run the machine are in tests/e2e/test_rerun.py."""

import os

import pytest
import torch

from megatron.training import checkpointing
from megatron.training.arguments import ArgumentsError, parse_args

BASE = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
    "--micro-batch-size 2 --train-iters 10 --lr 1e-3 --mock-data"
).split()


def parse(extra=""):
    return parse_args(BASE + extra.split(), world_size=1)


def test_upstreams_defaults_and_values_parse():
    args = parse()
    assert (args.rerun_mode, args.error_injection_rate, args.error_injection_type) == (
        "validate_results",
        0,
        "transient_error",
    )
    assert not args.check_for_spiky_loss and not args.check_for_large_grads
    assert args.save_retain_interval is None
    for mode in ("disabled", "validate_results", "report_stats"):
        assert parse(f"--rerun-mode {mode}").rerun_mode == mode
    given = parse("--error-injection-rate 5 --error-injection-type correct_result")
    assert (given.error_injection_rate, given.error_injection_type) == (5, "correct_result")
    retain = parse("--save /tmp/x --save-interval 2 --save-retain-interval 6")
    assert retain.save_retain_interval == 6


def test_large_grads_reach_the_ddp_config():
    from megatron.training.core_configs import ddp_config

    assert ddp_config(parse("--check-for-large-grads")).check_for_large_grads
    on = ddp_config(parse())
    assert on.check_for_nan_in_grad and not on.check_for_large_grads
    # disabled: the loop's collective check instead of a per-rank raise; fp16: its scaler's
    assert not ddp_config(parse("--rerun-mode disabled")).check_for_nan_in_grad
    assert not ddp_config(parse("--fp16")).check_for_nan_in_grad
    assert not ddp_config(parse("--no-check-for-nan-in-loss-and-grad")).check_for_nan_in_grad


ERRORS = [  # (extra flags, words the message must contain)
    ("--rerun-mode sometimes", ["--rerun-mode", "sometimes"]),
    ("--error-injection-type broken", ["--error-injection-type", "broken"]),
    ("--error-injection-rate -1", ["--error-injection-rate must be >= 0", "-1"]),
    ("--error-injection-rate 3 --rerun-mode disabled", ["--error-injection-rate", "disabled"]),
    ("--error-injection-rate 3 --rerun-mode report_stats", ["--error-injection-rate"]),
    (
        "--error-injection-rate 3 --no-check-for-nan-in-loss-and-grad",
        ["--error-injection-rate needs a check", "--check-for-spiky-loss"],
    ),
    ("--error-injection-type persistent_error", ["--error-injection-type needs"]),
    ("--save-retain-interval 4", ["--save-retain-interval needs --save"]),
    ("--save /tmp/x --save-retain-interval 4", ["--save-retain-interval needs"]),
    ("--save /tmp/x --save-interval 2 --save-retain-interval 0", ["--save-retain-interval"]),
    (
        "--save /tmp/x --save-interval 4 --save-retain-interval 6",
        ["--save-retain-interval (6) must be a multiple of --save-interval (4)"],
    ),
]


@pytest.mark.parametrize("extra, words", ERRORS)
def test_bad_input_names_the_flag(extra, words):
    with pytest.raises(ArgumentsError) as err:
        parse(extra)
    for word in words:
        assert word in str(err.value)


# Megatron-LM: a save retires the checkpoint the tracker named before it, unless N divides it.
RETIRED = [  # (previous, iteration, N, retired)
    (2, 4, 4, True),
    (4, 6, 4, False),  # a multiple of N stays
    (6, 6, 4, False),  # the same iteration saved again (e.g. the rerun machine's save)
    (0, 2, 4, False),  # iteration 0 is never retired (upstream's prev_iteration > 0)
    (None, 2, 4, False),  # no tracker yet
    (2, 4, None, False),  # without the flag nothing is deleted
]


@pytest.mark.parametrize("previous, iteration, interval, expected", RETIRED)
def test_retire_rule(previous, iteration, interval, expected):
    assert checkpointing.retired(previous, iteration, interval) is expected


def _publish(root, iteration, interval):
    """checkpointing._publish as a save at ``iteration`` runs it (rank 0 of one process)."""
    args = type("Args", (), dict(save=root, save_retain_interval=interval, ckpt_format="torch"))
    args.async_save = False
    partial = checkpointing.checkpoint_dir(root, iteration) + ".partial"
    os.makedirs(partial)
    checkpointing._publish(args, partial, partial[: -len(".partial")], (iteration, 0.0), None)


@pytest.fixture
def one_rank(monkeypatch):
    monkeypatch.setattr(torch.distributed, "get_rank", lambda *a, **k: 0)


def test_saves_every_2_keep_every_4th_and_the_latest(tmp_path, one_rank):
    root = str(tmp_path)
    for iteration in range(2, 12, 2):
        _publish(root, iteration, 4)
    kept = sorted(n for n in os.listdir(root) if n.startswith("iter_"))
    assert kept == ["iter_0000004", "iter_0000008", "iter_0000010"]
    assert checkpointing.read_tracker(root) == 10


def test_without_the_flag_every_checkpoint_stays_and_links_are_never_deleted(tmp_path, one_rank):
    root = str(tmp_path)
    for iteration in (2, 4):
        _publish(root, iteration, None)
    assert len([n for n in os.listdir(root) if n.startswith("iter_")]) == 2
    # a linked checkpoint the tracker names is left alone (as Megatron-LM), then retired no more
    os.rename(checkpointing.checkpoint_dir(root, 4), os.path.join(root, "elsewhere"))
    os.symlink(os.path.join(root, "elsewhere"), checkpointing.checkpoint_dir(root, 5))
    checkpointing.write_tracker(root, 5)
    _publish(root, 6, 4)
    assert os.path.islink(checkpointing.checkpoint_dir(root, 5))
