"""Convergence: Muon vs AdamW on real text, same tokens, batch and schedule, each at its best lr.

    .venv/bin/python bench/convergence.py            # full study (~15-25 min on 2 busy cores)
    .venv/bin/python bench/convergence.py --quick    # tiny model, few steps, one lr each

Every run is ``pretrain_gpt.py`` (the real training stack: GPTModel, DDP, Megatron's optimizer
and lr schedule) on the built-in corpus (the Python stdlib's sources, byte-level tokens), one
process, two runs at a time. Both optimizers see the same data order (same ``--seed``), batch,
warmup and cosine decay; only ``--optimizer`` and ``--lr`` differ, plus the seed's Muon recipe
flags (``megatron/training/muon_recipe.py``): its matched-AdamW-RMS scale lets one lr grid serve
both. Validation loss is read from the log lines.

Figure: the first (linearly interpolated) step at which the best Muon run's validation loss
reaches the best AdamW run's final validation loss, divided by the number of training steps.
Writes ``<out>/convergence.csv`` (header lines: command, versions) and ``<out>/convergence.png``.
"""

import argparse
import csv
import os
import re
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from megatron.training.muon_recipe import SEED_RECIPE_FLAGS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VALID = re.compile(r"validation loss at iteration (\d+) \| lm loss value: ([0-9.Ee+-]+)")

FULL = dict(layers=4, hidden=128, heads=4, seq=128, gbs=16, iters=400, eval_interval=10)
QUICK = dict(layers=2, hidden=64, heads=4, seq=64, gbs=8, iters=60, eval_interval=10)
FULL_LRS = {"adam": [1e-3, 3e-3, 1e-2], "muon": [1e-3, 3e-3, 1e-2, 3e-2]}
QUICK_LRS = {"adam": [3e-3], "muon": [3e-3]}


def train_args(size: dict, optimizer: str, lr: float, data: str) -> list[str]:
    """pretrain_gpt.py flags; everything but optimizer and lr is shared by all runs."""
    warmup = max(1, size["iters"] // 20)
    flags = f"""
        --optimizer {optimizer} --lr {lr} --min-lr {lr / 10} --lr-decay-style cosine
        --lr-warmup-iters {warmup} --weight-decay 0.1 --clip-grad 1.0 --seed 1234
        --num-layers {size["layers"]} --hidden-size {size["hidden"]}
        --num-attention-heads {size["heads"]} --num-query-groups 2 --group-query-attention
        --seq-length {size["seq"]} --max-position-embeddings {size["seq"]}
        --position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear
        --untie-embeddings-and-output-weights --attention-dropout 0.0 --hidden-dropout 0.0
        --micro-batch-size {size["gbs"]} --global-batch-size {size["gbs"]}
        --train-iters {size["iters"]} --eval-interval {size["eval_interval"]} --eval-iters 8
        --log-interval {size["iters"]} --data-path {data} --split 98,2,0
        --tokenizer-type ByteLevelTokenizer --num-workers 0
    """
    recipe = SEED_RECIPE_FLAGS if optimizer == "muon" else []  # the seed's Muon recipe
    return flags.split() + recipe


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_one(size: dict, optimizer: str, lr: float, data: str) -> list[tuple]:
    """[(iteration, validation loss)] of one training run; raises with the log tail on failure."""
    port = free_port()  # other runs (ours or anyone's) may hold a fixed one
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_PORT=str(port), PYTHONWARNINGS="ignore")
    env.pop("RANK", None)
    cmd = [sys.executable, "pretrain_gpt.py", *train_args(size, optimizer, lr, data)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    curve = [(int(i), float(v)) for i, v in VALID.findall(proc.stdout)]
    if proc.returncode != 0 or not curve:
        tail = (proc.stdout + proc.stderr)[-3000:]
        raise RuntimeError(f"{optimizer} lr={lr} failed (exit {proc.returncode}):\n{tail}")
    return curve


def sweep(size: dict, lrs: dict, data: str, jobs: int, done: dict) -> dict:
    """{(optimizer, lr): curve}, ``jobs`` runs at a time (each on one thread); runs already in
    ``done`` are kept, not repeated."""
    runs = [(opt, lr) for opt in lrs for lr in lrs[opt] if (opt, lr) not in done]
    with ThreadPoolExecutor(jobs) as pool:
        futures = {run: pool.submit(run_one, size, *run, data) for run in runs}
        new = {run: future.result() for run, future in futures.items()}
    return {run: done.get(run) or new[run] for opt in lrs for run in ((opt, lr) for lr in lrs[opt])}


def read_csv(path: str) -> tuple[dict, list[str]]:
    """Curves and header lines of an earlier study (``--reuse``)."""
    curves, header = {}, []
    with open(path) as f:
        lines = f.read().splitlines()
    header = [line[2:] for line in lines if line.startswith("# ")]
    for row in csv.DictReader(line for line in lines if not line.startswith("#")):
        run = (row["optimizer"], float(row["lr"]))
        curves.setdefault(run, []).append((int(row["iteration"]), float(row["val_loss"])))
    return curves, header


def best(curves: dict, optimizer: str) -> tuple:
    """The (optimizer, lr) whose final validation loss is lowest."""
    mine = [run for run in curves if run[0] == optimizer]
    return min(mine, key=lambda run: curves[run][-1][1])


def steps_to_reach(curve: list[tuple], target: float) -> float | None:
    """First step at which the loss reaches ``target``, interpolated between evaluations."""
    prev_step, prev_loss = 0, None
    for step, loss in curve:
        if loss <= target:
            if prev_loss is None or prev_loss == loss:
                return float(step)
            return prev_step + (step - prev_step) * (prev_loss - target) / (prev_loss - loss)
        prev_step, prev_loss = step, loss
    return None


def summarize(curves: dict, iters: int) -> dict:
    adam, muon = best(curves, "adam"), best(curves, "muon")
    target = curves[adam][-1][1]
    reach = steps_to_reach(curves[muon], target)
    return {
        "adam": adam,
        "muon": muon,
        "target": target,
        "muon_final": curves[muon][-1][1],
        "muon_steps": reach,
        "fraction": None if reach is None else reach / iters,
    }


def versions() -> str:
    import torch
    from megatron.core.package_info import __version__ as core

    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    python = sys.version.split()[0]
    return f"python {python}, torch {torch.__version__}, megatron-core {core}, git {commit}"


def write_csv(path: str, curves: dict, header: list[str]) -> None:
    with open(path, "w", newline="") as f:
        for line in header:
            f.write(f"# {line}\n")
        writer = csv.writer(f)
        writer.writerow(["optimizer", "lr", "iteration", "val_loss"])
        for (opt, lr), curve in curves.items():
            for step, loss in curve:
                writer.writerow([opt, lr, step, f"{loss:.6f}"])


def plot(path: str, curves: dict, summary: dict, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = {"adam": "tab:blue", "muon": "tab:red"}
    for (opt, lr), curve in curves.items():
        top = (opt, lr) == summary[opt]
        name = "AdamW" if opt == "adam" else "Muon"
        ax.plot(
            *zip(*curve),
            color=colors[opt],
            lw=2.0 if top else 0.8,
            alpha=1.0 if top else 0.45,
            label=f"{name} lr={lr:g}" + (" (best)" if top else ""),
        )
    ax.axhline(summary["target"], color="gray", ls=":", lw=1, label="AdamW final (best lr)")
    ax.set(xlabel="iteration", ylabel="validation loss (nats/byte)", title=title)
    low = min(v for c in curves.values() for _, v in c)
    ax.set_ylim(low - 0.05, min(4.0, max(v for c in curves.values() for _, v in c[1:])))
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def report(curves: dict, summary: dict) -> str:
    lines = [f"{'optimizer':>9} {'lr':>8} {'final val loss':>15}"]
    for (opt, lr), curve in sorted(curves.items()):
        mark = "  <- best" if (opt, lr) == summary[opt] else ""
        lines.append(f"{opt:>9} {lr:>8g} {curve[-1][1]:>15.4f}{mark}")
    frac = summary["fraction"]
    lines.append(
        f"Muon reaches AdamW's final val loss {summary['target']:.4f} at step "
        f"{summary['muon_steps'] if frac is None else round(summary['muon_steps'], 1)}"
        f" -> fraction of AdamW's steps: {'not reached' if frac is None else f'{frac:.3f}'}"
    )
    return "\n".join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, 60 steps, one lr each")
    parser.add_argument("--out", default=None, help="default bench/results (quick: a temp dir)")
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time")
    parser.add_argument("--iters", type=int, default=None, help="override the step count")
    parser.add_argument(
        "--reuse", action="store_true", help="keep the runs already in <out>/convergence.csv"
    )
    parser.add_argument(
        "--qk-clip",
        type=float,
        default=None,
        metavar="TAU",
        help="instead: Muon with and "
        "without QK-clip at threshold TAU, max attention logits (bench/qk_clip_study.py)",
    )
    parser.add_argument("--qk-clip-lr", type=float, default=1e-2, help="Muon lr of --qk-clip")
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    size = dict(QUICK if args.quick else FULL)
    size["iters"] = args.iters or size["iters"]
    lrs = QUICK_LRS if args.quick else FULL_LRS
    out = args.out or (
        os.path.join("/tmp", "bench-quick") if args.quick else os.path.join(ROOT, "bench/results")
    )
    os.makedirs(out, exist_ok=True)
    from megatron.training.corpus import build_corpus

    if args.qk_clip is not None:
        import qk_clip_study

        base = train_args(size, "muon", args.qk_clip_lr, build_corpus())
        cmd = "python bench/convergence.py " + " ".join(sys.argv[1:] if argv is None else argv)
        header = [f"command: {cmd.strip()}", f"versions: {versions()}"]
        print(qk_clip_study.study(ROOT, base, args.qk_clip, out, header))
        return {}
    start, made_by = time.perf_counter(), versions()  # the code the runs use, not HEAD at the end
    done, before = read_csv(os.path.join(out, "convergence.csv")) if args.reuse else ({}, [])
    curves = sweep(size, lrs, build_corpus(), args.jobs, done)
    summary = summarize(curves, size["iters"])
    cmd = "python bench/convergence.py " + " ".join(sys.argv[1:] if argv is None else argv)
    model = ", ".join(f"{k}={v}" for k, v in size.items())
    header = [f"command: {cmd.strip()}", f"versions: {made_by}", f"model/run: {model}"]
    header.append(f"date: {time.strftime('%Y-%m-%d')}, wall {time.perf_counter() - start:.0f}s")
    header += [f"reused runs from: {line}" for line in before if not line.startswith("reused")]
    write_csv(os.path.join(out, "convergence.csv"), curves, header)
    title = f"GPT {size['layers']}x{size['hidden']} on the stdlib corpus, {size['iters']} steps"
    plot(os.path.join(out, "convergence.png"), curves, summary, title)
    print(report(curves, summary))
    print(f"wrote {out}/convergence.csv and convergence.png")
    return summary


if __name__ == "__main__":
    main()
