"""Muon with and without QK-clip (``bench/convergence.py --qk-clip TAU``): does the max attention
logit grow without the clip on this small model, and what does the clip cost in loss?

Two ``pretrain_gpt.py`` runs (our Muon, the seed's recipe, one process) that differ only in
``--qk-clip --qk-clip-threshold TAU``, both with ``--log-max-attention-logit`` and a log line every
evaluation interval, at Muon's lr (the one given with ``--qk-clip-lr``). Upstream's loop logs the
max logit to TensorBoard (``max_attention_logit``), read back from each run's ``--tensorboard-dir``.
Prints the model-wide max logit per logged step for both and their final validation losses;
writes ``<out>/qk_clip.csv``.
"""

import csv
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

# The setup its recorded results (bench/results/qk_clip.csv) were made with: the model and flags
# of the convergence study before that study moved to 3 seeds, 2 corpora and full validation.
SIZE = dict(layers=4, hidden=128, heads=4, seq=128, gbs=16, iters=400, eval_interval=10)
QUICK = dict(layers=2, hidden=64, heads=4, seq=64, gbs=8, iters=60, eval_interval=10)


def base_args(quick: bool, lr: float, data: str) -> list[str]:
    """pretrain_gpt.py flags of the Muon run (``run`` adds the logging and clip flags)."""
    from convergence import CPU_FLAGS

    from megatron.training.muon_recipe import SEED_RECIPE_FLAGS

    size = QUICK if quick else SIZE
    warmup = max(1, size["iters"] // 20)
    flags = f"""
        --optimizer muon --lr {lr} --min-lr {lr / 10} --lr-decay-style cosine
        --lr-warmup-iters {warmup} --weight-decay 0.1 --clip-grad 1.0 --seed 1234
        --num-layers {size["layers"]} --hidden-size {size["hidden"]}
        --num-attention-heads {size["heads"]} --num-query-groups 2 --group-query-attention
        --seq-length {size["seq"]} --max-position-embeddings {size["seq"]}
        --position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear
        --untie-embeddings-and-output-weights --attention-dropout 0.0 --hidden-dropout 0.0
        --micro-batch-size {size["gbs"]} --global-batch-size {size["gbs"]}
        --train-iters {size["iters"]} --eval-interval {size["eval_interval"]} --eval-iters 8
        --log-interval {size["iters"]} --data-path {data} --split 98,2,0
        --tokenizer-type NullTokenizer --vocab-size 257 {CPU_FLAGS}
    """
    return flags.split() + SEED_RECIPE_FLAGS


def run(root, base_args: list, tau) -> dict:
    """{'max_logit': [(step, value)], 'val': [(step, loss)]} of one run; ``tau`` None: no clip."""
    from convergence import VALID, backend, launch_env

    tb = tempfile.mkdtemp(prefix="qk_clip_tb_")
    extra = [
        "--log-max-attention-logit",
        "--log-interval",
        base_args[base_args.index("--eval-interval") + 1],
        "--tensorboard-dir",
        tb,
    ]
    if tau is not None:
        extra += ["--qk-clip", "--qk-clip-threshold", str(tau)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **launch_env())
    cmd = [sys.executable, "pretrain_gpt.py", *backend(), *base_args, *extra]
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"qk-clip={tau} failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return {
        "max_logit": max_logits(tb),
        "val": [(int(i), float(v)) for i, v in VALID.findall(proc.stdout)],
    }


def max_logits(log_dir: str) -> list:
    """[(step, max attention logit)] that upstream's loop wrote to TensorBoard."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(log_dir)
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars("max_attention_logit")]


def study(root, base_args: list, tau: float, out: str, header=()) -> str:
    with ThreadPoolExecutor(2) as pool:
        plain, clipped = pool.map(lambda t: run(root, base_args, t), [None, tau])
    with open(os.path.join(out, "qk_clip.csv"), "w", newline="") as f:
        f.writelines(f"# {line}\n" for line in header)
        writer = csv.writer(f)
        writer.writerow(["run", "iteration", "max_attention_logit"])
        for name, result in (("muon", plain), (f"muon+qk_clip({tau})", clipped)):
            writer.writerows([name, step, f"{v:.6f}"] for step, v in result["max_logit"])
    lines = [f"{'step':>6} {'max logit, Muon':>16} {f'Muon + QK-clip {tau}':>22}"]
    for (step, a), (_, b) in zip(plain["max_logit"], clipped["max_logit"]):
        lines.append(f"{step:>6} {a:>16.3f} {b:>22.3f}")
    lines.append(
        f"final val loss: Muon {plain['val'][-1][1]:.4f}, "
        f"Muon + QK-clip {clipped['val'][-1][1]:.4f}"
    )
    return "\n".join(lines)
