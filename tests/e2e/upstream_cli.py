"""Launching pretrain_gpt.py on upstream's training loop (base megatron-core 0.19.2) for the
layout and QK-clip tests: a tiny GQA GPT with our Muon, on gloo CPU ranks where CUDA is absent."""

import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from upstream_runs import launch_env

ROOT = Path(__file__).resolve().parents[2]
CPU = not torch.cuda.is_available()
# A tiny GQA GPT with 4 layers (PP2 x 2 virtual stages: one layer each); dropout off; upstream's
# defaults otherwise (--num-workers 2, torch_dist, tied embeddings, linear decay). Upstream pads the
# vocabulary to a multiple of --make-vocab-size-divisible-by x TP (128 x 2 would make TP2's 256
# classes against the reference's 128): 64 keeps 128 at TP 1 and 2.
MODEL = (
    "--mock-data --tokenizer-type NullTokenizer --vocab-size 128 --make-vocab-size-divisible-by 64"
    " --num-layers 4 --hidden-size 64"
    " --num-attention-heads 4 --group-query-attention --num-query-groups 2 --seq-length 32"
    " --max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 8"
    " --attention-dropout 0 --hidden-dropout 0 --log-interval 1 --eval-interval 1000"
    " --eval-iters 1 --transformer-impl local --no-persist-layer-norm"
    " --no-gradient-accumulation-fusion"
).split()
# Our Muon, exact under TP (duplicated: whole-matrix Newton-Schulz; upstream's default blockwise
# orthogonalizes each TP shard alone, another algorithm), fp32 Newton-Schulz (upstream's default
# 'medium' is bf16, whose rounding would swamp the layouts' fp32 reordering).
MUON = (
    "--optimizer muon --muon-impl megatron_muon --muon-tp-mode duplicated"
    " --muon-fp32-matmul-prec high --lr 3e-3"
).split()


def launch(tmp: Path, name: str, ranks: int, *flags: str, model: Sequence[str] = MODEL) -> str:
    """pretrain_gpt.py under torchrun on ``ranks`` ranks (gloo CPU where CUDA is absent), the
    ``model`` flags first; its console output, rc 0 asserted."""
    # CUDA_DEVICE_MAX_CONNECTIONS: upstream requires it with TP before Blackwell (a CPU counts so)
    env = dict(launch_env(tmp, name), CUDA_DEVICE_MAX_CONNECTIONS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}"]
    cmd += ["--standalone", str(ROOT / "pretrain_gpt.py"), *model]
    cmd += ["--distributed-backend", "gloo" if CPU else "nccl", *flags]
    done = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=600)
    out = done.stdout + done.stderr
    (tmp / f"{name}.log").write_text(out)
    assert done.returncode == 0, f"{name}: rc {done.returncode}\n{out[-4000:]}"
    return out


def hits(tmp: Path, name: str) -> set:
    counts = json.loads((tmp / f"{name}.hits" / "hits.0.json").read_text())
    return {key.split(" ")[0] for key in counts}
