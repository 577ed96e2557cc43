"""A sample of Megatron-LM core_v0.19.0's pretraining functional-test recipes, shrunk to 2 CPU
ranks, launched through the fork's pretrain_gpt.py (issue 30): dense (PP 2), MoE (EP 2, torch_dist
DistributedOptimizer checkpoints: upstream's ckpt-resume test), virtual pipeline (PP 2 x 2
virtual stages) and MTP (MoE at TP 2 with sequence parallelism x EP 2, ETP 1, multi-latent
attention, one MTP layer).

``RECIPES`` holds, per kind, the test case (tests/functional_tests/test_cases/CASE/
model_config.yaml at core_v0.19.0, 5be9626709af) and what tools/upstream_recipes_sample.py makes
of it (its ``SIZE``, ``PLAIN``/``RESUME``, ``SAMPLE`` tables and tools/upstream_muon_recipes.py's
``CPU_CHANGES``/``CPU_ADDED`` say why each flag changed; every other flag is the recipe's), frozen
so that the test needs no Megatron-LM checkout (``tools/upstream_recipes_sample.py CHECKOUT
--print-flags`` prints them again). Each run must log a finite lm loss at every iteration (and
the MTP loss where the recipe has MTP, the parallelism it asks for); the ckpt-resume recipe's run
resumed at iteration 2 must log the uninterrupted run's scalars at 3-4 bit for bit.

    .venv/bin/python -m pytest -q tests/e2e/test_upstream_recipes_sample.py

Measured (2 cores shared, load ~13): dense 14 s, moe 33 s (two launches), vpp 15 s, mtp 11 s.
"""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import upstream_recipes_sample as sample  # noqa: E402

pytestmark = [pytest.mark.e2e]

RUNNER = sample.RUNNER
RECIPES = {
    "dense": (
        "gpt/gpt3_mcore_tp1_pp2",
        {
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
            "--split": "949,50,1",
            "--distributed-backend": "gloo",
            "--lr": 0.00015,
            "--lr-decay-style": "cosine",
            "--min-lr": 1e-05,
            "--weight-decay": "1e-2",
            "--clip-grad": 1.0,
            "--lr-warmup-fraction": 0.01,
            "--log-interval": 1,
            "--eval-interval": 1000,
            "--eval-iters": "1",
            "--transformer-impl": "local",
            "--tensor-model-parallel-size": 1,
            "--pipeline-model-parallel-size": 2,
            "--deterministic-mode": True,
            "--no-gradient-accumulation-fusion": True,
            "--use-mcore-models": True,
            "--ckpt-format": "torch_dist",
            "--dist-ckpt-optim-fully-reshardable": True,
            "--dist-ckpt-strictness": "log_all",
            "--data-cache-path": RUNNER,
            "--bf16": True,
            "--apply-query-key-layer-scaling": True,
            "--mock-data": True,
            "--tokenizer-type": "NullTokenizer",
            "--vocab-size": "128",
            "--no-persist-layer-norm": True,
            "--no-masked-softmax-fusion": True,
        },
        {
            "CUDA_DEVICE_MAX_CONNECTIONS": 1,
            "NVTE_ALLOW_NONDETERMINISTIC_ALGO": 0,
            "NCCL_ALGO": "Ring",
            "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
        },
    ),
    "moe": (
        "moe/gpt3_moe_mcore_te_ep8_resume_torch_dist_dist_optimizer_1node",
        {
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
            "--disable-bias-linear": True,
            "--train-iters": "4",
            "--timing-log-level": 0,
            "--lr-decay-iters": 320000,
            "--save": RUNNER,
            "--load": RUNNER,
            "--split": "949,50,1",
            "--distributed-backend": "gloo",
            "--lr": 0.00015,
            "--lr-decay-style": "cosine",
            "--min-lr": 1e-05,
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
            "--expert-model-parallel-size": "2",
            "--num-experts": "4",
            "--use-distributed-optimizer": True,
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
            "--ckpt-assume-constant-structure": True,
            "--data-cache-path": RUNNER,
            "--bf16": True,
            "--no-bias-gelu-fusion": True,
            "--async-save": True,
            "--async-strategy": "mcore",
            "--use-persistent-ckpt-worker": True,
            "--mock-data": True,
            "--tokenizer-type": "NullTokenizer",
            "--vocab-size": "128",
            "--no-persist-layer-norm": True,
            "--no-masked-softmax-fusion": True,
        },
        {
            "CUDA_DEVICE_MAX_CONNECTIONS": 1,
            "NVTE_ALLOW_NONDETERMINISTIC_ALGO": 0,
            "NCCL_ALGO": "Ring",
            "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
        },
    ),
    "vpp": (
        "gpt/gpt3_mcore_te_tp1_pp4_vp1_1node",
        {
            "--num-layers": "4",
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
            "--split": "949,50,1",
            "--distributed-backend": "gloo",
            "--lr": 0.00015,
            "--lr-decay-style": "cosine",
            "--min-lr": 1e-05,
            "--weight-decay": "1e-2",
            "--clip-grad": 1.0,
            "--lr-warmup-fraction": 0.01,
            "--log-interval": 1,
            "--eval-interval": 1000,
            "--eval-iters": "1",
            "--transformer-impl": "local",
            "--tensor-model-parallel-size": 1,
            "--pipeline-model-parallel-size": "2",
            "--num-layers-per-virtual-pipeline-stage": 1,
            "--deterministic-mode": True,
            "--no-gradient-accumulation-fusion": True,
            "--attention-softmax-in-fp32": True,
            "--use-mcore-models": True,
            "--ckpt-format": "torch_dist",
            "--dist-ckpt-optim-fully-reshardable": True,
            "--dist-ckpt-strictness": "log_all",
            "--data-cache-path": RUNNER,
            "--bf16": True,
            "--attention-backend": "unfused",
            "--mock-data": True,
            "--tokenizer-type": "NullTokenizer",
            "--vocab-size": "128",
            "--no-persist-layer-norm": True,
            "--no-masked-softmax-fusion": True,
        },
        {
            "CUDA_DEVICE_MAX_CONNECTIONS": 1,
            "NVTE_ALLOW_NONDETERMINISTIC_ALGO": 0,
            "NCCL_ALGO": "Ring",
            "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
            "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
        },
    ),
    "mtp": (
        "moe/gpt3_mcore_te_tp2_pp2_ep4_etp1_memory_speed",
        {
            "--distributed-timeout-minutes": 60,
            "--tensor-model-parallel-size": 2,
            "--pipeline-model-parallel-size": "1",
            "--expert-model-parallel-size": "2",
            "--context-parallel-size": 1,
            "--expert-tensor-parallel-size": 1,
            "--use-distributed-optimizer": True,
            "--overlap-grad-reduce": True,
            "--overlap-param-gather": True,
            "--attention-backend": "unfused",
            "--use-mcore-models": True,
            "--sequence-parallel": True,
            "--disable-bias-linear": True,
            "--micro-batch-size": "2",
            "--global-batch-size": "8",
            "--train-iters": "4",
            "--exit-duration-in-mins": 230,
            "--no-check-for-nan-in-loss-and-grad": True,
            "--no-rope-fusion": True,
            "--cross-entropy-loss-fusion": True,
            "--cross-entropy-fusion-impl": "native",
            "--manual-gc": True,
            "--manual-gc-interval": 100,
            "--transformer-impl": "local",
            "--seq-length": "64",
            "--data-cache-path": RUNNER,
            "--split": "949,50,1",
            "--num-layers": "2",
            "--hidden-size": "64",
            "--ffn-hidden-size": "128",
            "--num-attention-heads": "4",
            "--kv-channels": "16",
            "--max-position-embeddings": "64",
            "--position-embedding-type": "rope",
            "--rotary-base": 10000,
            "--make-vocab-size-divisible-by": "64",
            "--normalization": "RMSNorm",
            "--norm-epsilon": "1e-6",
            "--swiglu": True,
            "--untie-embeddings-and-output-weights": True,
            "--multi-latent-attention": True,
            "--mtp-num-layers": 1,
            "--mtp-loss-scaling-factor": 0.1,
            "--attention-dropout": 0.0,
            "--hidden-dropout": 0.0,
            "--clip-grad": 1.0,
            "--weight-decay": 0.1,
            "--qk-layernorm": True,
            "--lr-warmup-fraction": 0.01,
            "--lr": 0.00015,
            "--min-lr": 1e-05,
            "--lr-decay-style": "cosine",
            "--adam-beta1": 0.9,
            "--adam-beta2": 0.95,
            "--num-experts": "4",
            "--moe-layer-freq": "([0]*1+[1]*1)",
            "--moe-ffn-hidden-size": "64",
            "--moe-shared-expert-intermediate-size": "64",
            "--moe-router-load-balancing-type": "seq_aux_loss",
            "--moe-router-topk": "2",
            "--moe-token-dispatcher-type": "alltoall",
            "--moe-router-pre-softmax": True,
            "--moe-aux-loss-coeff": "1e-4",
            "--moe-router-group-topk": "1",
            "--moe-router-num-groups": "2",
            "--moe-router-topk-scaling-factor": 2.0,
            "--moe-router-score-function": "sigmoid",
            "--moe-router-enable-expert-bias": True,
            "--moe-router-bias-update-rate": "1e-3",
            "--moe-router-dtype": "fp32",
            "--q-lora-rank": "32",
            "--kv-lora-rank": "16",
            "--qk-head-dim": "16",
            "--qk-pos-emb-head-dim": "8",
            "--v-head-dim": "16",
            "--rotary-scaling-factor": 40,
            "--mscale": 1.0,
            "--mscale-all-dim": 1.0,
            "--eval-iters": "1",
            "--eval-interval": 200,
            "--init-method-std": 0.02,
            "--log-timers-to-tensorboard": True,
            "--log-num-zeros-in-grad": True,
            "--log-params-norm": True,
            "--log-validation-ppl-to-tensorboard": True,
            "--log-throughput": True,
            "--log-interval": 1,
            "--logging-level": 40,
            "--tensorboard-dir": RUNNER,
            "--bf16": True,
            "--exit-interval": "4",
            "--mock-data": True,
            "--tokenizer-type": "NullTokenizer",
            "--vocab-size": "128",
            "--no-persist-layer-norm": True,
            "--no-masked-softmax-fusion": True,
            "--distributed-backend": "gloo",
            "--no-gradient-accumulation-fusion": True,
        },
        {
            "CUDA_DEVICE_MAX_CONNECTIONS": 1,
            "NVTE_ALLOW_NONDETERMINISTIC_ALGO": 0,
            "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
            "NCCL_NVLS_ENABLE": 0,
            "PYTHONWARNINGS": "ignore",
            "NCCL_DEBUG": "VERSION",
        },
    ),
}
# torch.compile (megatron-core's jit_fuser) spends ~10 s of each launch's initialization
# (_warmup_jit_function) and ~25 s of the MTP recipe's first iteration compiling fused functions
# on a CPU: eager, as on a torch without compile (as upstream_runs.launch_env, which says where
# the compiled path stays tested)
EAGER = {"TORCHDYNAMO_DISABLE": "1"}
FEATURE = {  # what the run's log must show (upstream's args printout for the parallelism)
    "vpp": ["Number of virtual stages per pipeline stage: 2"],
    "mtp": [
        f"  {name} {'.' * (48 - len(name))} {value}\n"  # upstream's _print_args
        for name, value in [
            ("tensor_model_parallel_size", 2),
            ("sequence_parallel", True),
            ("expert_model_parallel_size", 2),
            ("expert_tensor_parallel_size", 1),
            ("multi_latent_attention", True),
        ]
    ],
}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind", list(RECIPES))
def test_recipe_trains_on_two_cpu_ranks(tmp_path, kind):
    case, flags, env_vars = RECIPES[kind]
    why, seconds = sample.check(flags, {**env_vars, **EAGER}, tmp_path)
    assert not why, why
    out = "".join(log.read_text() for log in tmp_path.glob("*.log"))
    for feature in FEATURE.get(kind, []):
        assert feature in out, feature
    print(f"{kind} ({case}): passed upstream's test in {seconds:.0f} s")


def test_a_run_missing_an_iteration_or_finite_loss_fails():
    """Negative control of ``trained``: an iteration not logged, or a NaN loss, is reported."""
    line = " iteration        {0}/       2 | lr: 1.0 | lm loss: {1} | mtp_1 loss: 4.0 |\n"
    good = line.format(1, "4.5E+00") + line.format(2, "4.4E+00")
    assert sample.trained(good, 2, True) == ""
    assert "not 1..2" in sample.trained(line.format(1, "4.5E+00"), 2, False)
    assert "not finite" in sample.trained(
        line.format(1, "4.5E+00") + line.format(2, "nan"), 2, False
    )
