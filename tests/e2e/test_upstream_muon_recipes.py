"""Upstream's MoE Muon functional-test recipe with its ckpt-resume check, shrunk to CPU.

The recipe: Megatron-LM main's tests/functional_tests/test_cases/moe/
gpt3_moe_mcore_te_ep8_resume_torch_dist_dist_muon_param_layout_1node/model_config.yaml
(last changed in ab16414a20a5; read at main d98e8a64ddf3): upstream's Muon inside its LayerWise
distributed optimizer with the precomputed param layout (``--use-distributed-optimizer``, the
layout's default), an 8-expert MoE at EP 4, bf16, async torch_dist saves by a persistent worker,
deterministic mode. ``FLAGS`` is what tools/upstream_muon_recipes.py makes of it (its ``CHANGES``
and ``ADDED`` table says why each flag changed; every other flag is the recipe's): the
same run the tool makes, held here so that the test needs no Megatron-LM checkout (checked equal
to the tool's shrink of the recipe at main d98e8a64; ``tools/upstream_muon_recipes.py CHECKOUT
--recipe dist_muon_param_layout_1node --print-flags`` prints it for a newer checkout).

Upstream's ckpt-resume: 8 iterations saving at 4 and 8, the iteration-8 checkpoint removed, a
second run resumes from 4; here the resumed run's TensorBoard scalars at 5-8 (lm loss, MoE
auxiliary loss, grad and params norms, zeros in grads, learning rate, loss scale) must equal the
uninterrupted run's bit for bit (upstream compares both with golden values instead).

    .venv/bin/python -m pytest -q tests/e2e/test_upstream_muon_recipes.py

Measured: the resume test 45 s (2 cores shared, load ~4; 78 s at load ~14), 3 of 3 runs passed;
most of it is the two launches' imports, each rank's persistent checkpoint worker included.
"""

import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import upstream_muon_recipes as recipes  # noqa: E402

pytestmark = [pytest.mark.e2e]

NAME = "dist_muon_param_layout_1node"
RANKS = 2
RUNNER = recipes.RUNNER
FLAGS = {
    "--num-layers": "2",
    "--hidden-size": "64",
    "--num-attention-heads": 8,
    "--log-params-norm": True,
    "--log-num-zeros-in-grad": True,
    "--log-validation-ppl-to-tensorboard": True,
    "--log-timers-to-tensorboard": True,
    "--tensorboard-dir": RUNNER,
    "--micro-batch-size": "2",
    "--global-batch-size": "16",
    "--seq-length": "64",
    "--max-position-embeddings": "64",
    "--disable-bias-linear": True,
    "--train-iters": "8",
    "--timing-log-level": 0,
    "--lr-decay-iters": 320000,
    "--save": RUNNER,
    "--load": RUNNER,
    "--split": "949,50,1",
    "--distributed-backend": "gloo",
    "--lr": 0.00015,
    "--lr-decay-style": "cosine",
    "--min-lr": 1.0e-5,
    "--weight-decay": "1e-2",
    "--clip-grad": 1.0,
    "--lr-warmup-fraction": 0.01,
    "--log-interval": 1,
    "--save-interval": "4",
    "--eval-interval": 1000,
    "--eval-iters": "2",
    "--transformer-impl": "local",
    "--tensor-model-parallel-size": 1,
    "--pipeline-model-parallel-size": 1,
    "--expert-model-parallel-size": "2",
    "--num-experts": "4",
    "--moe-token-dispatcher-type": "allgather",
    "--moe-router-load-balancing-type": "aux_loss",
    "--moe-router-topk": 2,
    "--moe-router-dtype": "fp32",
    "--moe-ffn-hidden-size": "128",
    "--ckpt-fully-parallel-load": True,
    "--deterministic-mode": True,
    "--no-gradient-accumulation-fusion": True,
    "--attention-softmax-in-fp32": True,
    "--use-checkpoint-opt_param-scheduler": True,
    "--use-mcore-models": True,
    "--ckpt-format": "torch_dist",
    "--data-cache-path": RUNNER,
    "--bf16": True,
    "--no-bias-gelu-fusion": True,
    "--optimizer": "muon",
    "--muon-momentum": 0.9,
    "--muon-extra-scale-factor": 0.2,
    "--muon-scale-mode": "spectral",
    "--async-save": True,
    "--use-persistent-ckpt-worker": True,
    "--use-distributed-optimizer": True,
    "--mock-data": True,
    "--tokenizer-type": "NullTokenizer",
    "--vocab-size": "128",
    "--exit-interval": "8",
    "--no-persist-layer-norm": True,
    "--no-masked-softmax-fusion": True,
    "--async-strategy": "mcore",
}
ENV_VARS = {  # the recipe's ENV_VARS
    "CUDA_DEVICE_MAX_CONNECTIONS": 1,
    "NVTE_ALLOW_NONDETERMINISTIC_ALGO": 0,
    "NCCL_ALGO": "Ring",
    "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
}
IMPLS = {"upstream": [], "ours": ["--muon-impl", "megatron_muon"]}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("impl", ["upstream"])
def test_recipe_resumes_bit_exact(tmp_path, impl):
    flags = dict(FLAGS)
    if IMPLS[impl]:
        flags[IMPLS[impl][0]] = IMPLS[impl][1]
    result = recipes.ckpt_resume(flags, RANKS, tmp_path, ENV_VARS, timeout=500)
    assert result["ok"], result["detail"]
    # 4 iterations x every scalar but times and memory (8 on this recipe)
    assert result["compared"] >= 4 * 8, result["detail"]
    print(f"{NAME} ({impl}): {result['detail']} in {result['seconds']:.0f} s")


def test_a_differing_bit_is_found():
    """Negative control of the comparison: one scalar off by one ulp at one iteration is
    reported there; a resumed run that lacks an iteration fails too."""
    a = {
        "lm loss": {i: 4.0 + i / 7 for i in range(1, 9)},
        "grad-norm": {i: 0.5 / i for i in range(1, 9)},
    }
    b = {tag: {i: v for i, v in values.items() if i > 4} for tag, values in a.items()}
    assert recipes.compare(a, b, 4, 8)["ok"]
    b["grad-norm"][6] = math.nextafter(b["grad-norm"][6], 1.0)
    got = recipes.compare(a, b, 4, 8)
    assert not got["ok"] and "iteration 6: 'grad-norm'" in got["detail"]
    del b["lm loss"][8]
    assert not recipes.compare(a, b, 4, 8)["ok"]
