"""A checkpoint of megatron-muon's own training loop on megatron-core 0.16.1 (the fork before it
moved onto upstream's loop), loaded by pretrain_gpt.py on 0.19.2 with our Muon
(``--muon-impl megatron_muon``).

The checkpoint is ``tests/fixtures/checkpoint_0_16_1``, saved by that loop (main 14469f0's
``make install`` venv, Python 3.11, torch 2.13) with the flags below: 2 ranks, DistOpt Muon,
torch_dist, ``--lr 1e-3 --train-iters 2 --save ck --save-interval 2``. Upstream's loop refuses to
resume it in one line naming the version and what to do (patch ``0051-checkpoint-origin-0.16.1``);
with ``--finetune`` it loads the model weights alone: with ``--lr 0`` the weights it then saves
equal the 0.16.1 checkpoint's, bit for bit. Negative control (by hand, patch 0051 removed): the
resume fails unnamed, ``'dict' object has no attribute`` (upstream reads the dict our loop saved
as its args with getattr).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from upstream_runs import CPU, RANKS

ROOT = Path(__file__).resolve().parents[2]
SAVED_ON_0_16_1 = ROOT / "tests" / "fixtures" / "checkpoint_0_16_1"

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(900),
]

# the fixture's tiny GPT, flag for flag; upstream's defaults otherwise (--num-workers 2).
# The embedding's rows: NullTokenizer's vocabulary is 129 on our 0.16.1 loop (Megatron-LM's
# legacy tokenizer adds the eod) and 128 on 0.19.2's; padded to a multiple of 256 both are 256
# (a smaller padding would differ, and upstream loads the first rows of a larger embedding)
TINY = (
    "--mock-data --tokenizer-type NullTokenizer --vocab-size 128 --make-vocab-size-divisible-by"
    " 256 --num-layers 2 --hidden-size 32"
    " --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 --micro-batch-size 2"
    " --global-batch-size 8 --log-interval 1 --eval-interval 1000 --eval-iters 1"
    " --transformer-impl local --no-persist-layer-norm --no-gradient-accumulation-fusion"
    " --optimizer muon --use-distributed-optimizer"
).split()
OURS_0_19_2 = ["--muon-impl", "megatron_muon"]


def _launch(cwd: Path, *flags: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={RANKS}"]
    cmd += ["--standalone"]
    cmd += [str(ROOT / "pretrain_gpt.py"), *TINY, "--distributed-backend"]
    cmd += ["gloo" if CPU else "nccl", *flags]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture
def saved_on_0_16_1(tmp_path):
    """A copy of the fixture (a load must not write into the repository)."""
    import shutil

    return Path(shutil.copytree(SAVED_ON_0_16_1, tmp_path / "ckpt_0_16_1"))


def _model(folder: Path, out: Path) -> dict:
    """The model weights of a torch_dist checkpoint (flat sharded keys; ``_extra_state`` left
    out), read without a process group."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(folder, out)
    flat = torch.load(out, weights_only=False)
    tops = ("embedding.", "decoder.", "output_layer.")
    return {k: v for k, v in flat.items() if k.startswith(tops) and "_extra_state" not in k}


def test_a_resume_is_refused_in_one_line(saved_on_0_16_1, tmp_path):
    done = _launch(
        tmp_path, *OURS_0_19_2, "--lr", "1e-3", "--train-iters", "4",
        "--load", str(saved_on_0_16_1), "--save", "again", "--save-interval", "4",
    )  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode != 0
    line = next((x for x in out.splitlines() if "RuntimeError: checkpoint " in x), None)
    assert line is not None, out[-4000:]
    assert line.endswith("(iteration 0, a fresh optimizer)")  # the whole message, one line
    for words in ("megatron-core 0.16.1", "the 0.16.1 fork", "--finetune", str(saved_on_0_16_1)):
        assert words in line, words
    assert not (tmp_path / "again").exists()


def test_finetune_loads_its_weights(saved_on_0_16_1, tmp_path):
    """--lr 0: one step changes no weight, so the checkpoint saved after it holds the loaded
    weights (Muon's and AdamW's updates and weight decay all scale with the lr)."""
    done = _launch(
        tmp_path, *OURS_0_19_2, "--lr", "0", "--min-lr", "0",
        "--train-iters", "1", "--finetune", "--load", str(saved_on_0_16_1),
        "--save", "tuned", "--save-interval", "1",
    )  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    before = _model(saved_on_0_16_1 / "iter_0000002", tmp_path / "a.pt")
    after = _model(tmp_path / "tuned" / "iter_0000001", tmp_path / "b.pt")
    assert len(before) > 10 and sorted(before) == sorted(after)
    assert before["embedding.word_embeddings.weight"].shape[0] == 256
    for key, value in before.items():
        assert torch.equal(value, after[key]), key
