"""End-to-end on CPU through the real CLI: one tiny run per optimizer and layout, save/resume that
reproduces the uninterrupted loss sequence, preprocess -> train -> eval on real text.

    .venv/bin/python -m pytest -q tests/e2e
"""

import os
import shutil
import subprocess
import sys

import pytest

from megatron.training.muon_recipe import SEED_RECIPE_FLAGS

from .cli import ROOT, TINY, floats, losses, run

# Muon with the seed's recipe: these runs check that the loss falls at TINY's lr
MUON = "--optimizer muon " + " ".join(SEED_RECIPE_FLAGS)


def _resume_from(save: str, iteration: int, into: str) -> str:
    """A --load folder holding only ``iteration`` of ``save`` (the run saved later ones too)."""
    os.makedirs(into)
    name = f"iter_{iteration:07d}"
    shutil.copytree(os.path.join(save, name), os.path.join(into, name))
    with open(os.path.join(into, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(iteration))
    return into


LAYOUTS = [  # (name, ranks, flags, checkpoint format)
    ("adam-tp2", 2, "--optimizer adam --tensor-model-parallel-size 2", "torch_dist"),
    # with a Multi-Token Prediction layer on the last stage: its weights, loss and grads resume;
    # uneven stages from --pipeline-model-parallel-layout, recorded in the checkpoint: the
    # embedding alone, then layers 1 | 1 1 over 2 virtual stages (--decoder-first-pipeline-*
    # reach the same model-building path: test_arguments.py, test_muon_parity.py)
    (
        "muon-pp2-layout-vpp-mtp",
        2,
        MUON + " --pipeline-model-parallel-size 2 --mtp-num-layers 1 --num-layers 3 "
        "--pipeline-model-parallel-layout E|t|t|tmL",
        "torch",
    ),
    ("muon-tp2", 2, MUON + " --tensor-model-parallel-size 2", "torch_dist"),
    # Interleaved PP2 x DP2 with DistOpt: the model chunks share local param names, which
    # upstream's DistributedOptimizer._param_name refuses (muon_distopt.param_names prefixes them);
    # the first chunk's grads in 3 DDP buckets (overlapped reduce), padded to multiples of 2^16
    (
        "muon-pp2-vpp2-dp2-distopt",
        4,
        MUON + " --num-layers 4 --pipeline-model-parallel-size 2 "
        "--num-layers-per-virtual-pipeline-stage 1 --global-batch-size 8 "
        "--use-distributed-optimizer --overlap-grad-reduce --ddp-num-buckets 3 "
        "--ddp-pad-buckets-for-high-nccl-busbw",
        "torch",
    ),
]


@pytest.mark.parametrize("name, nproc, flags, fmt", LAYOUTS, ids=[x[0] for x in LAYOUTS])
def test_train_save_resume_reproduces_losses(tmp_path, name, nproc, flags, fmt):
    """Train 4 steps saving at 2 and 4; a second launch resumes at 2 and must print the same
    losses and grad norms for steps 3 and 4 (dropout on: the RNG state is part of it)."""
    save = str(tmp_path / "save")
    common = TINY + flags.split() + ["--train-iters", 4, "--ckpt-format", fmt]
    full = losses(run(common + ["--save", save, "--save-interval", 2], nproc))
    assert sorted(full) == [1, 2, 3, 4]
    assert sorted(os.listdir(save)) == [
        "iter_0000002",
        "iter_0000004",
        "latest_checkpointed_iteration.txt",
    ]
    load = _resume_from(save, 2, str(tmp_path / "load"))
    resumed = losses(run(common + ["--load", load], nproc))
    assert resumed == {3: full[3], 4: full[4]}


@pytest.mark.parametrize(
    "optimizer, fmt, loader",
    [("muon", "torch_dist", "single"), ("adam", "torch", "cyclic")],
)
def test_data_parallel_distributed_optimizer_resume(tmp_path, optimizer, fmt, loader):
    """DP=2 with the DistributedOptimizer trains, saves, and a resumed launch prints the same
    losses. Upstream 0.16.1 fails every DistOpt resume on CPU (design.md section 6): the fork's
    declared-state checkpoint code (muon_checkpoint.py) covers Muon, and torch's AdamW keeps
    upstream's format with its defects repaired (distopt_adam_checkpoint.py, patch 0009). The
    adam case reads with --dataloader-type cyclic: its random sampler resumes from the
    consumed-sample count alone (the 16 mock samples are one shuffled epoch; a restart at sample 0
    would differ)."""
    save = str(tmp_path / "save")
    chosen = MUON.split() if optimizer == "muon" else ["--optimizer", optimizer]
    args = TINY + chosen + ["--use-distributed-optimizer", "--train-iters", 4]
    args += ["--dataloader-type", loader]
    args += ["--ckpt-format", fmt]
    full = losses(run(args + ["--save", save, "--save-interval", 2], nproc=2))
    assert sorted(full) == [1, 2, 3, 4] and floats(full)[-1] < floats(full)[0]
    proc = run(args + ["--load", _resume_from(save, 2, str(tmp_path / "load"))], nproc=2)
    assert losses(proc) == {3: full[3], 4: full[4]}


MORE_LAYOUTS = {  # layouts beyond the save/resume matrix: they must train
    # one aux-loss coefficient: a scalar, as Megatron-LM passes it (a list failed in the router)
    "moe-ep2-distopt": "--num-experts 4 --expert-model-parallel-size 2 --use-distributed-optimizer "
    "--moe-aux-loss-coeff 0.01",
}


@pytest.mark.parametrize("flags", MORE_LAYOUTS.values(), ids=MORE_LAYOUTS)
def test_muon_trains_expert_parallel(flags):
    args = TINY + MUON.split() + ["--train-iters", 4] + flags.split()
    table = losses(run(args, nproc=2))
    assert sorted(table) == [1, 2, 3, 4] and floats(table)[-1] < floats(table)[0]


def test_preprocess_train_eval_on_real_text(tmp_path):
    """The stdlib's own source as jsonl -> tools/preprocess_data.py -> train with evaluation."""
    from megatron.training.corpus import write_corpus_jsonl

    jsonl = str(tmp_path / "corpus.jsonl")
    write_corpus_jsonl(jsonl, max_bytes=300_000)
    prefix = str(tmp_path / "stdlib")
    subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "tools", "preprocess_data.py"),
            "--input",
            jsonl,
            "--output-prefix",
            prefix,
            "--tokenizer-type",
            "ByteLevelTokenizer",
            "--append-eod",
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    data = [a for a in TINY if a not in ("--mock-data", "--vocab-size", "64")]
    args = data + [
        "--data-path",
        prefix + "_text_document",
        "--split",
        "90,10,0",
        "--tokenizer-type",
        "ByteLevelTokenizer",
        "--train-iters",
        20,
        "--lr",
        3e-3,
        "--eval-interval",
        10,
        "--eval-iters",
        2,
        *MUON.split(),
        "--tensorboard-dir",
        str(tmp_path / "tb"),
    ]
    proc = run(args)
    table = floats(losses(proc))
    assert sum(table[-5:]) / 5 < sum(table[:5]) / 5 - 0.3, table  # bytes are learnable fast
    assert proc.stdout.count("validation loss at iteration") == 3  # 10, 20, 20 on validation set
    assert "validation loss at iteration 20 on validation set |" in proc.stdout
    scalars = _tensorboard_scalars(str(tmp_path / "tb"))
    logged = [v for _, v in scalars["lm loss"]]  # the console prints 6 significant digits
    assert logged == pytest.approx(table, rel=1e-5) and len(scalars["lm loss validation"]) == 3


def _tensorboard_scalars(log_dir: str) -> dict:
    """{tag: [(step, value)]} from the event files under ``log_dir``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(log_dir)
    events.Reload()
    return {t: [(e.step, e.value) for e in events.Scalars(t)] for t in events.Tags()["scalars"]}
