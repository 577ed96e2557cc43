"""An upstream GPT recipe as written, air-gapped (issue 42): Megatron-LM core_v0.19.0's
``gpt/gpt3_mcore_te_tp1_pp1_resume_torch_dist_dist_optimizer_1node`` keeps its tokenizer (no
``--tokenizer-type``: pretrain_gpt.py's default GPT2BPETokenizer, with ``--vocab-file`` and
``--merge-file``) and its ``--data-path``, here files the test makes: a GPT-2 style BPE vocabulary
and merges (tests/offline_fixtures.py) and a corpus preprocessed by the installed package
(``python -m megatron.training.preprocess_data``, ``--workers 2``). Everything runs with
``HF_HUB_OFFLINE=1``, an empty Hugging Face cache and no network, as on a cluster's compute
node: preprocess, then upstream's ckpt-resume test (4 iterations saving at 2 with torch_dist
DistributedOptimizer checkpoints, async with the persistent worker; a second run resumed from 2
must log the first run's scalars at 3-4 bit for bit), shrunk to 2 CPU ranks as
tools/upstream_recipes_sample.py shrinks recipes (``CHANGES`` says why each flag changed; every
other flag is the recipe's, at 5be9626709af).

    .venv/bin/python -m pytest -q tests/e2e/test_offline_recipe.py

Measured: 210 s wall on 2 cores shared at load 18 (64 s of CPU time in all, the preprocessing
~8 s of it, mostly imports); the recipe sample's two-launch resume takes ~33 s at load 13.
"""

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import offline_fixtures as fx
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import upstream_muon_recipes as muon  # noqa: E402

pytestmark = [pytest.mark.e2e]

RUNNER = muon.RUNNER
CASE = "gpt/gpt3_mcore_te_tp1_pp1_resume_torch_dist_dist_optimizer_1node"
FILES = "<made by the test>"
# The recipe's MODEL_ARGS with every change: flag -> (value or None: dropped, why)
CHANGES = {
    "--num-layers": ("2", "size: 12 layers of 512 are minutes per step on a CPU"),
    "--hidden-size": ("64", "size"),
    "--num-attention-heads": ("4", "size"),
    "--micro-batch-size": ("2", "size"),
    "--global-batch-size": ("8", "size: 2 micro-batches per step on each of 2 DP ranks"),
    "--seq-length": ("64", "size"),
    "--max-position-embeddings": ("64", "size (= --seq-length, as upstream's)"),
    "--train-iters": ("4", "a few iterations"),
    "--save-interval": ("2", "ckpt-resume saves at N/2 (upstream: 50 of 100)"),
    "--eval-iters": ("1", "size: the final validation and test"),
    "--data-path": (FILES, "the corpus this test preprocesses"),
    "--vocab-file": (FILES, "the BPE vocabulary this test makes (GPT-2's layout)"),
    "--merge-file": (FILES, "its merges"),
    "--data-cache-path": (RUNNER, "a temporary folder"),
    "--tensorboard-dir": (RUNNER, "a temporary folder per run"),
    "--distributed-backend": ("gloo", "CPU ranks: NCCL needs GPUs"),
    "--transformer-impl": ("local", "no Transformer Engine on CPU: megatron-core's torch layers"),
    "--log-memory-to-tensorboard": (None, "CUDA's allocator statistics (KeyError on a CPU)"),
    "--save": (RUNNER, "a temporary folder"),
    "--load": (RUNNER, "a temporary folder"),
}
ADDED = {  # flags the recipe does not give: flag -> (value, why)
    "--no-persist-layer-norm": (True, "the default persist_layer_norm is Apex's kernel"),
    "--no-masked-softmax-fusion": (True, "the default loads a CUDA extension under --bf16"),
    "--exit-interval": ("4", "upstream's runner sets it to --train-iters"),
    "--async-strategy": ("mcore", "--async-save's default backend (nvrx) is not installed"),
}
RECIPE = {  # the recipe's MODEL_ARGS at core_v0.19.0, with CHANGES and ADDED applied
    "--num-layers": "2",
    "--hidden-size": "64",
    "--num-attention-heads": "4",
    "--log-params-norm": True,
    "--log-num-zeros-in-grad": True,
    "--log-validation-ppl-to-tensorboard": True,
    "--log-timers-to-tensorboard": True,
    "--tensorboard-dir": RUNNER,
    "--micro-batch-size": "2",
    "--global-batch-size": "8",
    "--seq-length": "64",
    "--max-position-embeddings": "64",
    "--train-iters": "4",
    "--timing-log-level": 0,
    "--lr-decay-iters": 320000,
    "--save": RUNNER,
    "--load": RUNNER,
    "--data-path": FILES,
    "--vocab-file": FILES,
    "--merge-file": FILES,
    "--split": "949,50,1",
    "--distributed-backend": "gloo",
    "--lr": 0.00015,
    "--lr-decay-style": "cosine",
    "--min-lr": 1.0e-5,
    "--weight-decay": "1e-2",
    "--clip-grad": 1.0,
    "--lr-warmup-fraction": 0.01,
    "--log-interval": 1,
    "--save-interval": "2",
    "--eval-interval": 1000,
    "--eval-iters": "1",
    "--transformer-impl": "local",
    "--tensor-model-parallel-size": 1,
    "--pipeline-model-parallel-size": 1,
    "--use-distributed-optimizer": True,
    "--no-ckpt-fully-parallel-save": True,
    "--async-save": True,
    "--deterministic-mode": True,
    "--no-gradient-accumulation-fusion": True,
    "--attention-softmax-in-fp32": True,
    "--use-checkpoint-opt_param-scheduler": True,
    "--use-mcore-models": True,
    "--ckpt-format": "torch_dist",
    "--dist-ckpt-strictness": "log_all",
    "--data-cache-path": RUNNER,
    "--bf16": True,
    "--use-persistent-ckpt-worker": True,
    "--no-persist-layer-norm": True,
    "--no-masked-softmax-fusion": True,
    "--exit-interval": "4",
    "--async-strategy": "mcore",
}
ENV_VARS = {  # the recipe's
    "CUDA_DEVICE_MAX_CONNECTIONS": 1,
    "NVTE_ALLOW_NONDETERMINISTIC_ALGO": 0,
    "NCCL_ALGO": "Ring",
    "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
}
# No hub: offline mode, and a cache with nothing in it
OFFLINE = {"HF_HUB_OFFLINE": "1", "TORCHDYNAMO_DISABLE": "1"}
DOCS = 1000  # split 949,50,1: the test split gets a document too


def _corpus(path: Path) -> None:
    lines = [f"{fx.CORPUS[i % 3]} Document {i}: {fx.TEXTS[i % len(fx.TEXTS)]}" for i in range(DOCS)]
    path.write_text("".join(json.dumps({"text": line}) + "\n" for line in lines))


def _preprocess(work: Path, vocab: Path, merges: Path, env: dict) -> str:
    _corpus(work / "corpus.jsonl")
    cmd = [sys.executable, "-m", "megatron.training.preprocess_data", "--input", "corpus.jsonl"]
    cmd += ["--output-prefix", "data/corpus", "--tokenizer-type", "GPT2BPETokenizer"]
    cmd += ["--vocab-file", str(vocab), "--merge-file", str(merges), "--append-eod"]
    cmd += ["--workers", "2"]
    done = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return str(work / "data" / "corpus_text_document")


def test_recipe_offline_preprocess_train_save_resume(tmp_path):
    kept = {flag for flag, (value, _) in CHANGES.items() if value is not None}
    assert kept | set(ADDED) <= set(RECIPE) and not {*CHANGES} - kept & set(RECIPE)
    vocab, merges = fx.gpt2_files(tmp_path / "bpe")
    env_vars = {**ENV_VARS, **OFFLINE, "HF_HOME": str(tmp_path / "hf_home")}
    os.makedirs(env_vars["HF_HOME"])
    data = _preprocess(tmp_path, vocab, merges, muon.run_env(env_vars))
    files = {"--data-path": data, "--vocab-file": str(vocab), "--merge-file": str(merges)}
    flags = {flag: files.get(flag, value) for flag, value in RECIPE.items()}
    result = muon.ckpt_resume(flags, 2, tmp_path, env_vars)
    assert result["ok"] and result["compared"], result["detail"]
    log = (tmp_path / "run_1.log").read_text()
    assert f"  tokenizer_type {'.' * 34} GPT2BPETokenizer\n" in log  # upstream's args printout
    # The model's vocabulary is the fixture's 320 tokens padded to 384: at initialization (std
    # 0.02) the logits are near zero and the first loss is ln(384) = 5.95 + O(0.01) (measured
    # 5.961); ln(320) = 5.77 and GPT-2's ln(50304) = 10.8 are far outside 0.1
    first = float(re.search(r"iteration\s+1/.*?lm loss: ([0-9.E+-]+)", log).group(1))
    assert abs(first - math.log(384)) < 0.1, first
    assert list(tmp_path.joinpath("hf_home").iterdir()) == []  # nothing fetched or cached
    print(f"{CASE}: offline preprocess + ckpt-resume passed in {result['seconds']:.0f} s")
