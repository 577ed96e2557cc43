"""Logging through the real CLI: --log-params-norm, --log-num-zeros-in-grad,
--log-validation-ppl-to-tensorboard; Megatron-LM's timers, memory, throughput and progress log
and TensorBoard scalars; Muon's own figures (--log-muon-figures), tied to the exchange plan.

    .venv/bin/python -m pytest -q tests/e2e/test_logging.py
"""

import json
import math
import os
import re
import sys

import pytest
import torch

from .cli import ROOT, TINY, losses, run
from .test_train import _tensorboard_scalars

FLAGS = TINY + "--optimizer muon --train-iters 2 --untie-embeddings-and-output-weights".split()
FLAGS += ["--log-params-norm", "--log-num-zeros-in-grad"]


def _figure(stdout: str, name: str) -> list:
    return [float(x) for x in re.findall(rf" {name}: (\S+) \|", stdout)]


def test_params_norm_num_zeros_and_validation_ppl(tmp_path):
    """The printed params norm is the norm of the saved params (TP=1, and TP=2 where each
    replicated param counts once); the untied embedding's padded rows (64 of 128, never an
    input) have zero grads, so num zeros >= 64 x 32; TensorBoard gets exp(validation loss).
    Without DistOpt every rank orthogonalizes all its Muon matrices: --log-muon-figures' NS
    FLOPs are the hand count of the whole (TP=1) or TP-local (TP=2, blockwise) matrices."""
    save, tb = str(tmp_path / "save"), str(tmp_path / "tb")
    args = FLAGS + ["--ckpt-format", "torch", "--log-muon-figures"]
    one = run(
        args + ["--save", save, "--tensorboard-dir", tb, "--log-validation-ppl-to-tensorboard"]
    )
    assert sorted(losses(one)) == [1, 2]
    norms, zeros = _figure(one.stdout, "params norm"), _figure(one.stdout, "num zeros")
    assert len(norms) == len(zeros) == 2 and all(64 * 32 <= z < 20_000 for z in zeros), zeros
    assert norms[1] == pytest.approx(_saved_norm(save, 1), abs=1e-3)  # printed with 3 decimals
    save2 = str(tmp_path / "save2")
    two = run(args + ["--save", save2, "--tensor-model-parallel-size", 2], nproc=2)
    assert _figure(two.stdout, "params norm")[1] == pytest.approx(_saved_norm(save2, 2), abs=1e-3)
    assert _figure(one.stdout, "muon NS GFLOP") == [_tiny_ns_flops(tp=1) / 1e9] * 2
    assert _figure(two.stdout, "muon NS GFLOP") == [_tiny_ns_flops(tp=2) / 1e9] * 2
    assert _figure(two.stdout, "muon exchange bytes") == [0.0, 0.0]  # no DistOpt: no exchange
    scalars = _tensorboard_scalars(tb)
    validation = scalars["lm loss validation"]  # at 2 in the loop, then after the last step
    assert [step for step, _ in validation] == [2, 2]
    ppl = [(step, pytest.approx(math.exp(loss), rel=1e-5)) for step, loss in validation]
    assert scalars["lm loss validation ppl"] == ppl
    assert [v for _, v in scalars["params-norm"]] == pytest.approx(norms, abs=1e-3)
    assert [v for _, v in scalars["num-zeros"]] == zeros


def _tiny_ns_flops(tp: int, steps: int = 5) -> float:
    """Newton-Schulz FLOPs per step of TINY's Muon matrices on one rank: per (s x l) block and
    step X X^T and B X (2 s^2 l each) and A A (2 s^3). Per layer Q, K, V blocks (32 x 32 rows
    split by TP), proj 32 x 32 (columns split), fc1 128 x 32 (rows), fc2 32 x 128 (columns);
    the learned position embedding (16 x 32) is an embedding: AdamW's."""

    def cost(m, n):
        s, big = min(m, n), max(m, n)
        return steps * (4 * s * s * big + 2 * s**3)

    layer = 3 * cost(32 // tp, 32) + cost(32, 32 // tp) + cost(128 // tp, 32) + cost(32, 128 // tp)
    return 2 * layer


def _saved_norm(save: str, tp: int) -> float:
    """Norm of the iteration-2 checkpoint's params over the TP shard files: a param equal in
    every file is replicated (norms, row-parallel biases) and counts once; others are shards."""
    folder = os.path.join(save, "iter_0000002")
    files = [os.path.join(folder, f"mp_rank_{r:02d}", "model_optim_rng.pt") for r in range(tp)]
    models = [torch.load(f, map_location="cpu", weights_only=False)["model"] for f in files]
    total = 0.0
    for name, first in models[0].items():
        if not (torch.is_tensor(first) and first.is_floating_point()):
            continue
        shards = [m[name] for m in models]
        replicated = all(s.shape == first.shape and torch.equal(s, first) for s in shards)
        total += sum(s.double().square().sum().item() for s in shards[: 1 if replicated else tp])
    return math.sqrt(total)


# Llama-shaped (RMSNorm, SwiGLU, no biases, RoPE, GQA, untied output): the layout that
# bench/projection.py rebuilds, so its exchange plan is the one this run executes.
LLAMA = (
    "--num-layers 3 --hidden-size 32 --num-attention-heads 4 --group-query-attention "
    "--num-query-groups 2 --ffn-hidden-size 64 --normalization RMSNorm --swiglu "
    "--disable-bias-linear --position-embedding-type rope --untie-embeddings-and-output-weights"
).split()
LLAMA_SHAPE = dict(layers=3, hidden=32, ffn=64, heads=4, kv=2, vocab=128, tp=1)  # vocab padded
LOG_FLAGS = (
    "--log-interval 1 --tensorboard-log-interval 2 --timing-log-level 2 --timing-log-option "
    "minmax --log-timers-to-tensorboard --log-memory-to-tensorboard --log-memory-interval 2 "
    "--log-world-size-to-tensorboard --no-log-loss-scale-to-tensorboard --tensorboard-queue-size "
    "5 --log-throughput --log-muon-figures --log-progress --save-interval 2"
).split()
_TIMER = re.compile(r"^    (\S+) \.+: \((\S+), (\S+)\)$", re.M)


def test_timers_memory_throughput_progress_and_muon_figures(tmp_path):
    """One DP=2 DistOpt Muon launch with every logging flag: timers printed (min, max) and in
    TensorBoard (> 0, Muon's NS and exchange among them), CPU memory (RSS > 0), world size,
    no loss scale, per-step scalars every 2nd step equal to the console's, throughput = the
    model FLOPs counted by hand / time, progress.txt lines, and Muon's bytes and FLOPs equal
    to the exchange plan of bench/projection.py for this layout (the busiest of the 2 ranks),
    whose summary the log prints at start. The same launch profiles step 2 on rank 0
    (--profile --use-pytorch-profiler): one torch.profiler trace, of that step only."""
    save, tb = str(tmp_path / "save"), str(tmp_path / "tb")
    args = _drop(TINY, "--num-layers", "--hidden-size", "--num-attention-heads", "--log-interval")
    args += LLAMA + LOG_FLAGS + ["--optimizer", "muon", "--use-distributed-optimizer"]
    args += ["--train-iters", 4, "--save", save, "--tensorboard-dir", tb, "--ckpt-format", "torch"]
    args += "--profile --use-pytorch-profiler --profile-step-start 2 --profile-step-end 3".split()
    proc = run(args, nproc=2)
    table = losses(proc)
    assert sorted(table) == [1, 2, 3, 4]
    _check_timers(proc.stdout)
    scalars = _tensorboard_scalars(tb)
    _check_tensorboard(scalars, table)
    _check_muon_figures(proc.stdout, scalars)
    assert re.findall(r"\[Rank 0\] \(after (\d) iterations\) memory \(MB\) \| rss: ", proc.stdout)
    assert proc.stdout.count("memory (MB)") == 2  # iterations 2 and 4, DP rank 0 only
    _check_progress(os.path.join(save, "progress.txt"))
    _check_profile(tb)


def _check_profile(tb: str) -> None:
    """Megatron-LM's schedule: --profile-step-start 2 --profile-step-end 3 records step 2."""
    traces = [name for name in os.listdir(tb) if name.endswith(".pt.trace.json")]
    assert len(traces) == 1, os.listdir(tb)  # --profile-ranks defaults to [0]
    with open(os.path.join(tb, traces[0])) as f:
        names = {event.get("name") for event in json.load(f)["traceEvents"]}
    assert {n for n in names if n and n.startswith("ProfilerStep#")} == {"ProfilerStep#2"}
    assert "aten::mm" in names  # the step's matmuls are in it


def _drop(flags: list, *names) -> list:
    out, skip = [], False
    for item in flags:
        if skip:
            skip = False
        elif item in names:
            skip = True
        else:
            out.append(item)
    return out


def _check_timers(stdout: str) -> None:
    timed = {}
    for name, low, high in _TIMER.findall(stdout):
        timed.setdefault(name, []).append((float(low), float(high)))
    for name in ("forward-backward", "optimizer", "optimizer-inner-step", "forward-compute"):
        assert len(timed[name]) == 4, (name, stdout[-3000:])  # one report per log line
    for name in ("muon-newton-schulz", "muon-dp-exchange", "params-all-gather", "batch-generator"):
        assert len(timed[name]) == 4 and all(0 < lo <= hi for lo, hi in timed[name]), name


def _check_tensorboard(scalars: dict, table: dict) -> None:
    assert [s for s, _ in scalars["lm loss"]] == [2, 4]  # --tensorboard-log-interval 2
    for step, value in scalars["lm loss"]:  # this step's loss, as the console's (interval 1)
        assert value == pytest.approx(float(table[step][0]), rel=1e-5)
    assert [s for s, _ in scalars["lm loss vs samples"]] == [8, 16]  # 4 samples per step
    assert "loss-scale" not in scalars and scalars["world-size"] == [(2, 2.0), (4, 2.0)]
    rss, peak = scalars["mem-rss-bytes"], scalars["mem-max-rss-bytes"]
    assert all(v > 1e7 for _, v in rss) and all(p >= r for (_, p), (_, r) in zip(peak, rss))
    for tag in ("iteration-time", "forward-backward-time", "optimizer-time"):
        assert [s for s, _ in scalars[tag]] == [1, 2, 3, 4] and all(v > 0 for _, v in scalars[tag])
    for (_, seconds), (_, tflops) in zip(scalars["iteration-time"], scalars["throughput"]):
        assert tflops * seconds * 1e12 * 2 == pytest.approx(_model_flops(batch=4), rel=1e-5)


def _model_flops(batch: int, seq: int = 16) -> float:
    """Megatron-LM's count by hand: 3 GEMM passes x 2 FLOPs per multiply-add; per token and
    layer qkv h(q + 2kv), attention q s (causal half of QK^T and AV), proj q h, SwiGLU 3 h f;
    logits h V once."""
    s = LLAMA_SHAPE
    h, q, kv = s["hidden"], s["hidden"], s["hidden"] // s["heads"] * s["kv"]
    layer = h * (q + 2 * kv) + q * seq + q * h + 3 * h * s["ffn"]
    return 6 * batch * seq * (s["layers"] * layer + h * s["vocab"])


def _check_muon_figures(stdout: str, scalars: dict) -> None:
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import projection  # noqa: E402 (bench/ is not a package)

    params = projection.model_params(*LLAMA_SHAPE.values())
    # the run's sizes: bf16 Newton-Schulz, bf16 both ways (the plan chooses by them)
    sizes = dict(ns_itemsize=2, exchange_itemsizes=2 + 2)
    ns = projection.cost_model(1, "duplicated", nodes=(0, 0), **sizes)  # both ranks on this host
    plan = projection.build_plan(params, 2, None, ns)
    assert f" > {plan.summary()}\n" in stdout  # printed once at start, by rank 0
    # default --muon-fp32-matmul-prec medium: bf16 Newton-Schulz, so bf16 goes out and comes
    # back (unscaled: holders scale it, muon_distopt.exchange_dtypes)
    moved = max(plan.bytes_per_step(2, 2, rank=r) for r in range(2))
    flops = max(plan.ns_flops_per_rank())
    assert moved > 0 and flops > min(plan.ns_flops_per_rank())  # owners cross shards, unequal
    printed = [float(x) for x in re.findall(r" muon exchange bytes: (\S+) \|", stdout)]
    assert printed == [moved] * 4
    assert [v for _, v in scalars["muon-dp-exchange-bytes"]] == [moved] * 4
    gangs = max(plan.sum_bytes_per_step(rank=r) for r in range(2))  # DP=2: no matrix splits
    assert [v for _, v in scalars["muon-dp-gang-bytes"]] == [gangs] * 4 == [0.0] * 4
    assert [v for _, v in scalars["muon-newton-schulz-flops"]] == pytest.approx([flops] * 4)
    for tag in ("muon-newton-schulz-time", "muon-dp-exchange-time"):
        assert len(scalars[tag]) == 4 and all(v > 0 for _, v in scalars[tag]), tag


def _check_progress(path: str) -> None:
    lines = [line.split("\t") for line in open(path).read().splitlines()]
    assert [cells[3] for cells in lines] == ["Starting job", "Saved checkpoint", "Saved checkpoint"]
    assert all(cells[2] == "# GPUs: 2" for cells in lines)
    assert [cells[4] for cells in lines[1:]] == ["Iteration: 2", "Iteration: 4"]
    flops = [float(cells[7].split(": ")[1]) for cells in lines[1:]]
    assert flops == pytest.approx([_model_flops(8), _model_flops(16)], rel=1e-2)  # 3 digits
