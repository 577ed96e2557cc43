"""Megatron-LM-shaped launch commands run unchanged through our pretrain_gpt.py with Muon.

Each command is written in the shape of Megatron-LM's GPT/MoE launch scripts and functional-test
recipes (the flags they pass, grouped as they group them), with sizes and paths shrunk,
Transformer Engine switched to the local layers, fp8 to bf16, and ``--optimizer muon`` added.
They train a few steps on CPU ranks:

    .venv/bin/python -m pytest -q tests/e2e/test_recipes.py
"""

import re

import pytest

from .cli import floats, losses, run

TINY_DATA = "--mock-data --vocab-size 128 --num-workers 0 --seq-length 16"
LOGGING = (
    "--log-interval 1 --eval-interval 2 --eval-iters 1 --distributed-backend nccl "
    "--use-mcore-models --transformer-impl local --no-gradient-accumulation-fusion "
    "--no-masked-softmax-fusion --no-bias-dropout-fusion --no-rope-fusion "
    "--attention-softmax-in-fp32 --manual-gc"
)
MUON = "--optimizer muon --muon-tp-mode duplicated --muon-momentum 0.95"

# (name, ranks, flags): dense Llama-style TP x PP x VPP with GQA, RoPE, SwiGLU, RMSNorm, a
# rampup batch (sample-based, as Megatron-LM requires for a rampup), bf16 and DistOpt; GPT-3-style
# DP in fp16 (loss scaling; the 345M recipes' precision) with learned positions and GeLU; MoE with
# expert parallelism in bf16 with bf16 gradient reduction and no DistOpt (Megatron's
# mixed-precision optimizer, fp32 main grads: its clipping needs them), one Multi-Token
# Prediction layer (as upstream's MoE memory/speed recipe) and experts padded to capacity.
RECIPES = [
    (
        "llama-tp2-pp2-vpp2-gqa-rope-swiglu-rampup",
        4,
        "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 "
        "--num-layers-per-virtual-pipeline-stage 1 --overlap-grad-reduce --num-layers 4 "
        "--hidden-size 32 --ffn-hidden-size 64 "
        "--num-attention-heads 4 --group-query-attention --num-query-groups 2 --kv-channels 8 "
        "--position-embedding-type rope --rotary-percent 1.0 --rotary-base 500000 --swiglu "
        "--normalization RMSNorm --norm-epsilon 1e-5 --untie-embeddings-and-output-weights "
        "--disable-bias-linear --attention-dropout 0.0 --hidden-dropout 0.0 --init-method-std 0.02 "
        "--micro-batch-size 1 --global-batch-size 4 --rampup-batch-size 2 2 8 "
        "--train-samples 16 --lr-decay-samples 16 --lr-warmup-samples 2 "
        "--lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine "
        "--weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 "
        "--use-flash-attn --bf16 --use-distributed-optimizer",
    ),
    (
        "gpt3-dp2-learned-gelu",
        2,
        "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --micro-batch-size 2 "
        "--global-batch-size 8 --train-iters 4 --lr 3e-3 --min-lr 3e-4 --lr-decay-style linear "
        "--lr-warmup-fraction 0.25 --lr-decay-iters 4 --weight-decay 0.01 --clip-grad 1.0 "
        "--seed 1234 --init-method-std 0.006 --accumulate-allreduce-grads-in-fp32 "
        "--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather "
        "--ckpt-format torch_dist --no-mmap-bin-files --no-create-attention-mask-in-dataloader "
        "--deterministic-mode --fp16 --initial-loss-scale 4096",
    ),
    (
        "moe-ep2-alltoall-aux-loss",
        2,
        "--expert-model-parallel-size 2 --expert-tensor-parallel-size 1 --num-experts 4 "
        "--moe-router-topk 2 --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2 "
        "--moe-token-dispatcher-type alltoall --moe-grouped-gemm --moe-ffn-hidden-size 32 "
        "--moe-shared-expert-intermediate-size 32 --moe-router-dtype fp32 "
        "--moe-z-loss-coeff 1e-3 --moe-per-layer-logging --grad-reduce-in-bf16 --num-layers 2 "
        "--hidden-size 32 "
        "--mtp-num-layers 1 --mtp-loss-scaling-factor 0.1 "
        "--moe-expert-capacity-factor 1.0 --moe-pad-expert-input-to-capacity "
        "--num-attention-heads 4 --position-embedding-type rope --swiglu --normalization RMSNorm "
        "--disable-bias-linear --micro-batch-size 1 --global-batch-size 4 --train-iters 4 "
        "--lr 3e-3 --lr-decay-style cosine --bf16",
    ),
]


@pytest.mark.parametrize("name, nproc, flags", RECIPES, ids=[r[0] for r in RECIPES])
def test_megatron_lm_shaped_recipe_trains_with_muon(tmp_path, name, nproc, flags):
    args = f"{TINY_DATA} {LOGGING} {MUON} {flags}".split()
    if "--moe-per-layer-logging" in flags:  # its figures go to TensorBoard only, every step
        args += ["--tensorboard-dir", str(tmp_path / "tb"), "--tensorboard-log-interval", "2"]
    proc = run(args, nproc=nproc)
    table = losses(proc)
    total = int(re.findall(r"iteration\s+\d+/\s*(\d+)", proc.stdout)[-1])
    assert sorted(table) == list(range(1, total + 1)) and total >= 4, proc.stdout[-2000:]
    assert all(loss > 0 for loss in floats(table))
    noted = [line for line in proc.stderr.splitlines() if "accepted, no effect" in line]
    assert len(noted) == 1 and "--use-mcore-models" in noted[0]
    # fp16 runs under Megatron's loss scaler (a 1.0 scale here meant none); bf16 needs none
    scales = set(re.findall(r"loss scale: (\S+) \|", proc.stdout))
    assert scales == ({"4096.0"} if "--fp16" in flags else {"1.0"}), scales
    if "--mtp-num-layers" in flags:  # Multi-Token Prediction's loss, on every line
        mtp = re.findall(r"\| mtp_1 loss: (\S+) \|", proc.stdout)
        assert len(mtp) == total and all(0 < float(v) < 10 for v in mtp), proc.stdout[-2000:]
    if "--moe-aux-loss-coeff" in flags:  # the routers' losses (over their coefficients)
        for name in ("load_balancing_loss", "z_loss"):
            values = [float(v) for v in re.findall(rf"\| {name}: (\S+) \|", proc.stdout)]
            assert len(values) == total and all(0 < v < 10 for v in values), (name, values)
    if "--moe-per-layer-logging" in flags:
        _check_per_layer(str(tmp_path / "tb"), proc.stdout, layers=3)  # 2 layers + 1 MTP


def _check_per_layer(tb: str, stdout: str, layers: int) -> None:
    """Each step's moe/<name>_layer_<i> scalars (every step, as upstream: the other scalars
    follow --tensorboard-log-interval 2) average to the figure the console printed."""
    from .test_train import _tensorboard_scalars

    scalars = _tensorboard_scalars(tb)
    assert [step for step, _ in scalars["lm loss"]] == [2, 4]
    for name in ("load_balancing_loss", "z_loss"):
        printed = [float(v) for v in re.findall(rf"\| {name}: (\S+) \|", stdout)]
        tags = [f"moe/{name}_layer_{i}" for i in range(layers)]
        assert f"moe/{name}_layer_{layers}" not in scalars and all(t in scalars for t in tags)
        assert all([s for s, _ in scalars[t]] == [1, 2, 3, 4] for t in tags)
        per_step = zip(*(scalars[t] for t in tags))
        means = [sum(v for _, v in step) / layers for step in per_step]
        assert means == pytest.approx(printed, rel=1e-5), name  # the console prints 7 digits
