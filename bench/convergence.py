"""Convergence: Muon vs AdamW on code and on English text, 3 seeds, each optimizer at its best lr.

    .venv/bin/python bench/convergence.py            # full study (~1 h on 2 busy cores)
    .venv/bin/python bench/convergence.py --quick    # tiny model, few steps, one lr, one seed

Every run is ``pretrain_gpt.py`` on Megatron-LM's own training loop (upstream's ``pretrain()``,
base megatron-core 0.19.2: GPTModel, DDP, Megatron's optimizer and lr schedule), one process (a
gloo CPU rank where CUDA is absent), ``--jobs`` runs at a time; its console lines are read
(``VALID``, ``TIMED``, ``PARAMS``). Two corpora, byte-level (upstream's NullTokenizer with
``--vocab-size 257``: bytes 0..255, eod 256):
- ``stdlib``: training = the built-in corpus (megatron/training/corpus.py: the Python stdlib's
  own sources, machine-made files left out, seeded order, 4 MiB); validation = stdlib files the
  corpus does NOT contain (the next ones in its seeded order, ~48 kB): held-out code.
- ``shakespeare``: 41 works for training, one whole play held out (megatron/training/
  shakespeare.py; the ``shakespeare`` package, requirements/bench.txt).
Validation is ``--full-validation``: every evaluation reads the same whole validation split.

Both optimizers: the same tokens in the same order per seed (``--seed`` sets init and data
order), batch, warmup, cosine decay to lr/10, weight decay 0.1, clip 1.0, Adam beta2 0.95 (the
Adam part of Muon too). Muon is ours (``--muon-impl megatron_muon``) with the seed's recipe passed
explicitly (``MUON_RECIPE``, megatron/training/muon_recipe.py: matched-AdamW RMS 0.2, Nesterov,
momentum 0.95, the "simple" quintic coefficients), so one lr grid serves both.

Protocol, per corpus:
1. lr sweep at the first seed; a grid whose best lr is at an edge grows by the next lr on the
   ladder (up to ``MAX_EXTEND`` times), so each optimizer's best is inside its grid;
2. the other seeds at each optimizer's best lr;
3. schedule-matched Muon: for each seed, Muon trained with a SHORTER total schedule (warmup the
   same, cosine to lr/10 at its own end) of ``MATCHED`` x AdamW's steps. Each seed's figure is the
   schedule length at which Muon's FINAL validation loss reaches that seed's AdamW final loss
   (linear between the lengths run: ``MATCHED`` and the full one), over AdamW's steps.
Also per seed: the first step at which the full-schedule Muon run reaches AdamW's final loss
(mid-schedule, the old figure), and the same in wall-clock seconds and in counted FLOPs (model
forward + backward, plus the optimizer: AdamW's elementwise update, Muon's Newton-Schulz matmuls).

Writes ``<out>/convergence.csv`` (header lines: command, versions, model, FLOP counts),
``<out>/convergence.png`` (lr sweep; loss vs steps, seconds and FLOPs, mean and min-max over
seeds) and ``<out>/schedule_matched.png``.
"""

import argparse
import csv
import os
import re
import shlex
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Upstream's console (megatron/training/training.py): the evaluations in the loop (not the one
# after it, "... at iteration N on validation set | ...": the same split again), each logged
# iteration's average time over its interval, the parameters of the (only) model-parallel rank
VALID = re.compile(r"validation loss at iteration (\d+) \| lm loss value: ([0-9.Ee+-]+)")
TIMED = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([0-9.]+)")
PARAMS = re.compile(
    r"number of parameters on \([a-z_, ]+\) model parallel rank \([0-9, ]+\): (\d+)"
)

FULL = dict(layers=4, hidden=128, heads=4, groups=2, ffn=384, seq=64, gbs=16, iters=240)
# heldout_bytes: Python 3.12's first held-out files are http/client.py (57 kB), then 21, 3 and
# 9 kB ones (3.11's fit 48 and 16 kB): 96 kB holds those four, 64 kB the first
FULL.update(eval_interval=40, log_interval=10, heldout_bytes=96 * 1024)
QUICK = dict(layers=2, hidden=64, heads=4, groups=2, ffn=192, seq=64, gbs=8, iters=40)
QUICK.update(eval_interval=20, log_interval=10, heldout_bytes=64 * 1024)
LADDER = [1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1]
FULL_LRS = {"adam": [1e-3, 3e-3, 1e-2], "muon": [3e-3, 1e-2, 3e-2]}
QUICK_LRS = {"adam": [3e-3], "muon": [1e-2]}
SEEDS = [1234, 1235, 1236]
MATCHED = (0.45, 0.65)  # Muon's shorter schedules, as fractions of AdamW's steps
QUICK_MATCHED = (0.5,)
MAX_EXTEND = 2
# our Muon and muon_recipe.SEED_RECIPE_FLAGS (a test keeps them equal; not imported: the bench
# process stays light)
MUON_RECIPE = (
    "--muon-impl megatron_muon --muon-matched-adamw-rms 0.2 --muon-nesterov --muon-momentum 0.95"
    " --muon-coefficient-type simple --muon-tp-mode duplicated"
)
# A CPU rank (gloo) takes torch layers (no TE/Apex) and the fusions without a torch fallback off;
# on GPUs the same flags run (nccl)
CPU_FLAGS = (
    "--transformer-impl local --no-persist-layer-norm --no-gradient-accumulation-fusion"
    " --no-rope-fusion"
)
NS_STEPS = 5  # Newton-Schulz iterations per Muon step (the default --muon-num-ns-steps)
ADAM_FLOPS_PER_PARAM = 12  # moments, bias correction, sqrt, divide, decay: elementwise
BYTE_VOCAB_PADDED = 384  # 257 byte-level ids padded to a multiple of 128, as Megatron pads


# ------------------------------------------------------------------------------ runs


def train_args(size, run, data) -> list[str]:
    """pretrain_gpt.py flags of ``run`` = (corpus, optimizer, lr, seed, iters)."""
    _, opt, lr, seed, iters = run
    prefix, split = data
    warmup = max(1, size["iters"] // 20)  # the same in steps for every schedule length
    evals = size["eval_interval"] if iters == size["iters"] else iters  # short ones: the end
    flags = f"""
        --optimizer {opt} --lr {lr} --min-lr {lr / 10} --lr-decay-style cosine
        --lr-warmup-iters {warmup} --weight-decay 0.1 --clip-grad 1.0 --adam-beta2 0.95
        --seed {seed} --num-layers {size["layers"]} --hidden-size {size["hidden"]}
        --ffn-hidden-size {size["ffn"]} --num-attention-heads {size["heads"]}
        --num-query-groups {size["groups"]} --group-query-attention
        --seq-length {size["seq"]} --max-position-embeddings {size["seq"]}
        --position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear
        --untie-embeddings-and-output-weights --attention-dropout 0.0 --hidden-dropout 0.0
        --micro-batch-size {size["gbs"]} --global-batch-size {size["gbs"]}
        --train-iters {iters} --eval-interval {evals} --full-validation
        --log-interval {size["log_interval"]} --data-path {prefix} --split {split}
        --tokenizer-type NullTokenizer --vocab-size 257 {CPU_FLAGS}
    """
    return flags.split() + (MUON_RECIPE.split() if opt == "muon" else [])


def matched(size: dict) -> tuple:
    return QUICK_MATCHED if size.get("quick") else MATCHED


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_one(size, run, data, log_dir) -> dict:
    """{"valid": [(iteration, loss)], "seconds": [(iteration, cumulative train s)], "params"};
    raises with the log tail on failure. The log is kept under ``log_dir``."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.update(launch_env())
    cmd = [sys.executable, "pretrain_gpt.py", *backend(), *train_args(size, run, data)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    result = parse_log(proc.stdout, run) if proc.returncode == 0 else None
    if log_dir and result:  # only finished runs: --reuse takes them as done
        with open(os.path.join(log_dir, log_name(run)), "w") as f:
            f.write(" ".join(cmd[1:]) + "\n" + proc.stdout + proc.stderr)
    if result is None:
        tail = (proc.stdout + proc.stderr)[-3000:]
        raise RuntimeError(f"{run} failed (exit {proc.returncode}):\n{tail}")
    return result


def launch_env() -> dict:
    """One process as rank 0 of 1 (what torchrun would tell it), on a free port."""
    return dict(
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
    )


def backend() -> list[str]:
    """Gloo where CUDA is absent (the run's rank is a CPU one there), else upstream's nccl."""
    import torch

    return [] if torch.cuda.is_available() else ["--distributed-backend", "gloo"]


def log_name(run) -> str:
    return "_".join(map(str, run)) + ".log"


def parse_log(text: str, run) -> dict | None:
    """The result of a run from its console output; None unless it evaluated at its last step."""
    valid = [(int(i), float(v)) for i, v in VALID.findall(text)]
    params = PARAMS.search(text)
    if not valid or params is None or valid[-1][0] != run[4]:
        return None
    return {"valid": valid, "seconds": seconds(text), "params": int(params[1])}


def from_logs(log_dir: str, size: dict, datas: dict, runs) -> dict:
    """Finished runs among ``runs`` whose kept log was launched with exactly today's flags."""
    found = {}
    for run in runs:
        path = os.path.join(log_dir, log_name(run))
        if run[0] not in datas or not os.path.exists(path):
            continue
        with open(path) as f:
            first, text = f.readline().strip(), f.read()
        if first.endswith(" ".join(train_args(size, run, datas[run[0]]))):
            result = parse_log(text, run)
            if result:
                found[run] = result
    return found


def seconds(log: str) -> list[tuple]:
    """Cumulative training seconds at each logged iteration (Megatron's per-interval average
    times the interval; evaluation time is not in it)."""
    total, out, last = 0.0, [(0, 0.0)], 0
    for it, ms in TIMED.findall(log):
        total += (int(it) - last) * float(ms) / 1000
        last = int(it)
        out.append((last, total))
    return out


def run_all(size, runs, datas, jobs, done, log_dir, reuse=False) -> dict:
    """{run: result} for ``runs``, reusing ``done`` (and with ``reuse`` the finished runs logged
    under ``log_dir`` with the same flags); ``jobs`` at a time."""
    todo = [r for r in runs if r not in done]
    if reuse:
        done.update(from_logs(log_dir, size, datas, todo))
        todo = [r for r in runs if r not in done]
    if jobs == 0:  # --jobs 0: report on the finished runs only
        return done
    with ThreadPoolExecutor(max(1, jobs)) as pool:
        futures = {r: pool.submit(run_one, size, r, datas[r[0]], log_dir) for r in todo}
        for r, future in futures.items():
            done[r] = future.result()
    return done


def next_lr(lrs: list[float], best: float) -> float | None:
    """The ladder's neighbour beyond ``best`` when it is at the grid's edge, else None."""
    grid = sorted(lrs)
    i = LADDER.index(best) if best in LADDER else -1
    if best == grid[-1] and len(grid) > 1 and 0 <= i < len(LADDER) - 1:
        return LADDER[i + 1]
    if best == grid[0] and len(grid) > 1 and i > 0:
        return LADDER[i - 1]
    return None


def final(result: dict) -> float:
    return result["valid"][-1][1]


def best_lr(results: dict, corpus: str, opt: str, seed: int, iters: int) -> float:
    """The lr whose run at ``seed`` over the full ``iters`` ended lowest (None: no such run)."""
    mine = {
        r[2]: final(v)
        for r, v in results.items()
        if r[:2] == (corpus, opt) and r[3:] == (seed, iters)
    }
    return min(mine, key=mine.get) if mine else None


def study_corpus(size, corpus, lrs, seeds, datas, jobs, done, log_dir, save, reuse) -> dict:
    """Runs all three phases for one corpus; returns {opt: best lr}."""
    n, s0 = size["iters"], seeds[0]
    grids = {opt: list(v) for opt, v in lrs.items()}
    for _ in range(MAX_EXTEND + 1):
        runs = [(corpus, o, lr, s0, n) for o in grids for lr in grids[o]]
        run_all(size, runs, datas, jobs, done, log_dir, reuse)
        save()
        grew = False
        for opt in grids:
            more = next_lr(grids[opt], best_lr(done, corpus, opt, s0, n))
            if more is not None:
                grids[opt].append(more)
                grew = True
        if not grew:
            break
    best = {opt: best_lr(done, corpus, opt, s0, n) for opt in grids}
    if None in best.values():  # --jobs 0 before the sweep finished
        return best
    runs = [(corpus, o, best[o], s, n) for s in seeds[1:] for o in best]
    runs += [(corpus, "muon", best["muon"], s, round(f * n)) for s in seeds for f in matched(size)]
    run_all(size, runs, datas, jobs, done, log_dir, reuse)
    save()
    return best


# ----------------------------------------------------------------------------- counts


def model_params(size: dict) -> dict:
    """Parameter counts of the GPT the flags build (checked against the run's printed count):
    ``muon`` = the [rows, cols] of every matrix Muon orthogonalizes (QKV per Q/K/V block),
    ``linear`` = parameters of all matmuls (hidden layers + output layer), ``total``."""
    h, f, heads, groups = size["hidden"], size["ffn"], size["heads"], size["groups"]
    d = h // heads
    per_layer = [[heads * d, h], [groups * d, h], [groups * d, h], [h, heads * d]]
    per_layer += [[2 * f, h], [h, f]]  # SwiGLU fc1 (gate and up, one matrix), fc2
    muon = per_layer * size["layers"]
    hidden = sum(r * c for r, c in muon)
    output = BYTE_VOCAB_PADDED * h
    norms = (2 * size["layers"] + 1) * h
    total = hidden + 2 * output + norms  # untied embedding and output layer
    return {"muon": muon, "linear": hidden + output, "total": total}


def flops_per_step(size: dict, opt: str) -> dict:
    """Counted FLOPs of one training step: model = 3 x forward (2 per multiply-add of every
    matmul, attention scores and values counted over the full sequence), optimizer = AdamW's
    elementwise update over its params, or Newton-Schulz (``NS_STEPS`` x (4 s^2 l + 2 s^3) per
    matrix, s/l its short/long side) + AdamW's update for the rest (embeddings, output, norms)."""
    p = model_params(size)
    tokens = size["gbs"] * size["seq"]
    attention = 2 * 2 * size["seq"] * size["hidden"] * size["layers"]
    model = 3 * tokens * (2 * p["linear"] + attention)
    if opt == "adam":
        return {"model": model, "optimizer": ADAM_FLOPS_PER_PARAM * p["total"]}
    ns = sum(NS_STEPS * (4 * min(m) ** 2 * max(m) + 2 * min(m) ** 3) for m in p["muon"])
    rest = p["total"] - sum(r * c for r, c in p["muon"])
    return {"model": model, "optimizer": ns + ADAM_FLOPS_PER_PARAM * rest}


# ---------------------------------------------------------------------------- figures


def steps_to_reach(curve: list[tuple], target: float) -> float | None:
    """First x at which the loss reaches ``target``, linear between points."""
    prev_x, prev_y = 0, None
    for x, y in curve:
        if y <= target:
            if prev_y is None or prev_y == y:
                return float(x)
            return prev_x + (x - prev_x) * (prev_y - target) / (prev_y - y)
        prev_x, prev_y = x, y
    return None


def schedule_to_reach(finals: list[tuple], target: float) -> tuple[float | None, bool]:
    """(schedule length, exact) at which the final loss reaches ``target``: linear between the
    lengths run, sorted. At or below the shortest one: (shortest, False), i.e. an upper bound."""
    finals = sorted(finals)
    if finals[0][1] <= target:
        return float(finals[0][0]), False
    return steps_to_reach(finals, target), True


def at(curve: list[tuple], x: float) -> float:
    """``curve`` (x increasing) linearly interpolated at ``x``."""
    for (x0, y0), (x1, y1) in zip(curve, curve[1:]):
        if x0 <= x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0) if x1 > x0 else y1
    return curve[-1][1]


def summarize(size, results, corpus, best, seeds) -> dict:
    n = size["iters"]
    adam_f, muon_f = (flops_per_step(size, o) for o in ("adam", "muon"))
    flops = {o: sum(f.values()) for o, f in (("adam", adam_f), ("muon", muon_f))}
    rows = []
    full = [(corpus, o, best[o], s, n) for s in seeds for o in ("adam", "muon")]
    seeds = [s for s in seeds if all(r in results for r in full if r[3] == s)]  # --jobs 0
    for s in seeds:
        adam = results[(corpus, "adam", best["adam"], s, n)]
        muon = results[(corpus, "muon", best["muon"], s, n)]
        target = final(adam)
        mid = steps_to_reach(muon["valid"], target)
        finals = [(n, final(muon))] + [
            (k, final(results[(corpus, "muon", best["muon"], s, k)]))
            for k in (round(f * n) for f in matched(size))
            if (corpus, "muon", best["muon"], s, k) in results
        ]
        sched, exact = schedule_to_reach(finals, target)
        row = {"seed": s, "target": target, "muon_final": final(muon), "mid_steps": mid}
        row.update(sched_steps=sched, sched_exact=exact, finals=finals)
        row["adam_seconds"] = adam["seconds"][-1][1]
        row["mid_seconds"] = None if mid is None else at(muon["seconds"], mid)
        per_step = muon["seconds"][-1][1] / n  # Muon's measured seconds per step
        row["sched_seconds"] = None if sched is None else sched * per_step
        row["sched_flops_ratio"] = (
            None if sched is None else sched * flops["muon"] / (n * flops["adam"])
        )
        rows.append(row)
    if not rows:
        return None
    fr = [r["sched_steps"] / n for r in rows if r["sched_steps"] is not None]
    mid = [r["mid_steps"] / n for r in rows if r["mid_steps"] is not None]
    return {
        "corpus": corpus,
        "best": best,
        "seeds": rows,
        "flops_per_step": {"adam": adam_f, "muon": muon_f},
        "fraction": max(fr) if len(fr) == len(rows) else None,  # the worst seed
        "fractions": fr,
        "mid_fractions": mid,
        "target": sum(r["target"] for r in rows) / len(rows),
        "muon_final": sum(r["muon_final"] for r in rows) / len(rows),
    }


def plot(path, size, results, summaries) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"adam": "tab:blue", "muon": "tab:red"}
    names = {"adam": "AdamW", "muon": "Muon"}
    n = size["iters"]
    fig, axes = plt.subplots(len(summaries), 4, figsize=(17, 4.2 * len(summaries)), squeeze=False)
    for row, summ in zip(axes, summaries):
        corpus, best = summ["corpus"], summ["best"]
        seeds = [r["seed"] for r in summ["seeds"]]
        for opt in ("adam", "muon"):
            sweep = sorted(
                (r[2], final(v))
                for r, v in results.items()
                if r[:2] == (corpus, opt) and r[3] == seeds[0] and r[4] == n
            )
            row[0].plot(*zip(*sweep), "o-", color=colors[opt], label=names[opt])
            runs = [results[(corpus, opt, best[opt], s, n)] for s in seeds]
            step_flops = sum(summ["flops_per_step"][opt].values())
            for ax, xs in (
                (row[1], lambda r: [x for x, _ in r["valid"]]),
                (row[2], lambda r: [at(r["seconds"], x) for x, _ in r["valid"]]),
                (row[3], lambda r, f=step_flops: [x * f / 1e12 for x, _ in r["valid"]]),
            ):
                _band(
                    ax,
                    [(xs(r), [y for _, y in r["valid"]]) for r in runs],
                    colors[opt],
                    f"{names[opt]} lr={best[opt]:g} ({len(runs)} seeds)",
                )
        row[0].set(
            xscale="log",
            xlabel="lr",
            ylabel="final val loss (nats/byte)",
            title=f"{corpus}: lr sweep (seed {seeds[0]})",
        )
        for ax, label in zip(
            row[1:], ("iteration", "training seconds (shared CPU: noisy)", "TFLOPs (counted)")
        ):
            ax.axhline(summ["target"], color="gray", ls=":", lw=1, label="AdamW final (mean)")
            ax.set(xlabel=label, ylabel="val loss", title=f"{corpus}: full schedule")
            ax.set_ylim(summ["muon_final"] - 0.05, summ["target"] + 0.6)
        for ax in row:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _band(ax, curves, color, label) -> None:
    """Mean over seeds and the min-max band (seeds share evaluation steps)."""
    xs = [sum(c[0][i] for c in curves) / len(curves) for i in range(len(curves[0][0]))]
    ys = list(zip(*[c[1] for c in curves]))
    ax.plot(xs, [sum(y) / len(y) for y in ys], color=color, label=label)
    ax.fill_between(xs, [min(y) for y in ys], [max(y) for y in ys], color=color, alpha=0.25)


def plot_matched(path, size, summaries) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = size["iters"]
    fig, axes = plt.subplots(1, len(summaries), figsize=(6.5 * len(summaries), 4.3), squeeze=False)
    for ax, summ in zip(axes[0], summaries):
        for i, r in enumerate(summ["seeds"]):
            shade = 0.4 + 0.3 * i
            xs, ys = zip(*sorted(r["finals"]))
            ax.plot(
                [x / n for x in xs],
                ys,
                "o-",
                color=(shade, 0.1, 0.1),
                label=f"Muon final, seed {r['seed']}",
            )
            ax.axhline(
                r["target"],
                color=(0.1, 0.1, shade),
                ls="--",
                lw=1,
                label=f"AdamW final ({n} steps), seed {r['seed']}",
            )
            if r["sched_steps"] is not None:
                ax.axvline(r["sched_steps"] / n, color=(shade, 0.1, 0.1), ls=":", lw=1)
        ax.axvline(0.65, color="gray", lw=1, label="goal 0.65")
        parts = [
            "not reached"
            if r["sched_steps"] is None
            else ("" if r["sched_exact"] else "<=") + f"{r['sched_steps'] / n:.2f}"
            for r in summ["seeds"]
        ]
        spread = ", ".join(parts)
        ax.set(
            xlabel="Muon's schedule length / AdamW's steps (cosine to its own end)",
            ylabel="final val loss (nats/byte)",
            title=f"{summ['corpus']}: schedule-matched Muon reaches AdamW's final\n"
            f"loss at {spread} x AdamW's steps (per seed)",
        )
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# --------------------------------------------------------------------------- csv, report


def write_csv(path, results, header) -> None:
    with open(path, "w", newline="") as f:
        for line in header:
            f.write(f"# {line}\n")
        w = csv.writer(f)
        w.writerow(
            [
                "corpus",
                "optimizer",
                "lr",
                "seed",
                "schedule",
                "iteration",
                "val_loss",
                "train_seconds",
                "params",
            ]
        )
        for run, res in results.items():
            for it, loss in res["valid"]:
                secs = at(res["seconds"], it)
                w.writerow([*run, it, f"{loss:.6f}", f"{secs:.2f}", res["params"]])


def read_csv(path) -> tuple[dict, list[str]]:
    """Runs of an earlier study (``--reuse``; their seconds are kept at evaluation points) and
    its header lines."""
    out: dict = {}
    if not os.path.exists(path):
        return out, []
    with open(path) as f:
        text = f.read().splitlines()
    header = [line[2:] for line in text if line.startswith("# ")]
    lines = [line for line in text if not line.startswith("#")]
    for row in csv.DictReader(lines):
        run = (
            row["corpus"],
            row["optimizer"],
            float(row["lr"]),
            int(row["seed"]),
            int(row["schedule"]),
        )
        res = out.setdefault(run, {"valid": [], "seconds": [(0, 0.0)], "params": 0})
        res["valid"].append((int(row["iteration"]), float(row["val_loss"])))
        res["seconds"].append((int(row["iteration"]), float(row["train_seconds"])))
        res["params"] = int(row["params"])
    return out, header


def report(size, summ) -> str:
    n, best = size["iters"], summ["best"]
    fl = summ["flops_per_step"]
    lines = [
        f"== {summ['corpus']}: best lr AdamW {best['adam']:g}, Muon {best['muon']:g}; "
        f"FLOPs/step AdamW {sum(fl['adam'].values()) / 1e9:.2f} G, "
        f"Muon {sum(fl['muon'].values()) / 1e9:.2f} G (NS {fl['muon']['optimizer'] / 1e9:.2f})"
    ]
    lines.append(
        f"{'seed':>5} {'AdamW final':>11} {'Muon final':>10} {'mid-sched':>9} "
        f"{'sched-matched':>13} {'time ratio':>10} {'FLOP ratio':>10}"
    )
    for r in summ["seeds"]:
        mid = "-" if r["mid_steps"] is None else f"{r['mid_steps'] / n:.3f}"
        if r["sched_steps"] is None:
            sched = "not reached"
        else:
            sched = ("" if r["sched_exact"] else "<=") + f"{r['sched_steps'] / n:.3f}"
        tr = "-" if r["sched_seconds"] is None else f"{r['sched_seconds'] / r['adam_seconds']:.3f}"
        fr = "-" if r["sched_flops_ratio"] is None else f"{r['sched_flops_ratio']:.3f}"
        lines.append(
            f"{r['seed']:>5} {r['target']:>11.4f} {r['muon_final']:>10.4f} {mid:>9} "
            f"{sched:>13} {tr:>10} {fr:>10}"
        )
    fr = summ["fractions"]
    if fr:
        marks = [
            ("" if r["sched_exact"] else "<=") + f"{r['sched_steps'] / n:.3f}"
            for r in summ["seeds"]
            if r["sched_steps"] is not None
        ]
        lines.append(
            f"schedule-matched fraction of AdamW's steps per seed: {', '.join(marks)} "
            f"(<=: the shortest schedule run already got there); worst {max(fr):.3f}"
        )
    return "\n".join(lines)


def versions() -> str:
    import torch
    from megatron.core.package_info import __version__ as core

    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    python = sys.version.split()[0]
    return f"python {python}, torch {torch.__version__}, megatron-core {core}, git {commit}"


# ------------------------------------------------------------------------------ main


def corpora(size, names) -> dict:
    """{name: (prefix, split)} built under ~/.cache (once)."""
    from megatron.training import corpus as stdlib
    from megatron.training import shakespeare

    out = {}
    if "stdlib" in names:
        train = [d["text"] for d in stdlib.stdlib_documents()]
        held = [d["text"] for d in stdlib.heldout_documents(size["heldout_bytes"])]
        if not held:  # upstream's loop would fail with a bare TypeError on the empty split
            first = stdlib.heldout_documents(10**15)[0]
            raise SystemExit(
                f"heldout_bytes {size['heldout_bytes']} holds no held-out document: the first, "
                f"{first['path']}, has {len(first['text'].encode('utf-8'))} bytes"
            )
        tag = f"bench-stdlib-v{stdlib.RULE_VERSION}-heldout{size['heldout_bytes']}"
        prefix = os.path.join(stdlib.corpus_dir(), tag, "stdlib_heldout_text_document")
        stdlib.build_indexed_once(prefix, lambda: iter(train + held))
        out["stdlib"] = (prefix, f"{len(train)},{len(held)},0")
        print(stdlib.format_report(stdlib.near_copy_report(train + held, out["stdlib"][1])))
    if "shakespeare" in names:
        prefix, split, rep = shakespeare.build()
        out["shakespeare"] = (prefix, split)
        print(stdlib.format_report(rep))
    return out


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, one lr, one seed")
    parser.add_argument("--out", default=None, help="default bench/results (quick: a temp dir)")
    parser.add_argument(
        "--jobs", type=int, default=2, help="runs at a time (0: report on finished runs only)"
    )
    parser.add_argument(
        "--corpora", default=None, help="default stdlib,shakespeare (quick: stdlib)"
    )
    parser.add_argument(
        "--reuse", action="store_true", help="keep finished runs (<out>/convergence.csv, logs)"
    )
    parser.add_argument("--note", action="append", default=[], help="a header line for the CSV")
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
    size = dict(QUICK, quick=True) if args.quick else dict(FULL)
    lrs, seeds = (QUICK_LRS, SEEDS[:1]) if args.quick else (FULL_LRS, SEEDS)
    chosen = args.corpora or ("stdlib" if args.quick else "stdlib,shakespeare")
    names = [c for c in chosen.split(",") if c]
    if not names or set(names) - {"stdlib", "shakespeare"}:
        raise SystemExit(f"--corpora {chosen!r}: choose from stdlib,shakespeare")
    out = args.out or (
        os.path.join("/tmp", "bench-quick") if args.quick else os.path.join(ROOT, "bench/results")
    )
    logs = os.path.join(out if args.quick else os.path.join(ROOT, "bench/out"), "convergence_logs")
    os.makedirs(out, exist_ok=True)
    os.makedirs(logs, exist_ok=True)
    if args.qk_clip is not None:  # its own setup (bench/qk_clip_study.py), the built-in corpus
        import qk_clip_study

        from megatron.training.corpus import build_corpus

        base = qk_clip_study.base_args(args.quick, args.qk_clip_lr, build_corpus())
        cmd = "python bench/convergence.py " + shlex.join(sys.argv[1:] if argv is None else argv)
        header = [f"command: {cmd.strip()}", f"versions: {versions()}"]
        print(qk_clip_study.study(ROOT, base, args.qk_clip, out, header))
        return {}
    start, made_by = time.perf_counter(), versions()  # the code the runs use, not HEAD at the end
    csv_path = os.path.join(out, "convergence.csv")
    results, before = read_csv(csv_path) if args.reuse else ({}, [])
    cmd = "python bench/convergence.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    header = [
        f"command: {cmd.strip()}",
        f"versions: {made_by}",
        "model/run: " + ", ".join(f"{k}={v}" for k, v in size.items()),
        f"muon recipe: {MUON_RECIPE}; both: --adam-beta2 0.95 --full-validation",
        f"date: {time.strftime('%Y-%m-%d %H:%M')} UTC start",
    ]
    header += [f"reused runs from: {line}" for line in before if not line.startswith("reused")]
    header += [f"note: {line}" for line in args.note]

    def save():
        write_csv(csv_path, results, header)

    datas = corpora(size, names)
    for name in names:
        datas_for = {name: datas[name]}
        best = study_corpus(
            size, name, lrs, seeds, datas_for, args.jobs, results, logs, save, args.reuse
        )
        datas[name + "/best"] = best
    summaries = []
    for name in names:
        best = datas[name + "/best"]
        summ = None if None in best.values() else summarize(size, results, name, best, seeds)
        if summ is None:
            print(f"== {name}: no seed has both full runs yet")
            continue
        summaries.append(summ)
        expected = model_params(size)["total"]
        got = {r["params"] for k, r in results.items() if k[0] == name}
        if got != {expected}:
            raise RuntimeError(f"counted params {expected} != printed {got}: fix model_params")
        print(report(size, summ))
    header.append(f"wall {time.perf_counter() - start:.0f}s")
    save()
    plot(os.path.join(out, "convergence.png"), size, results, summaries)
    plot_matched(os.path.join(out, "schedule_matched.png"), size, summaries)
    print(f"wrote {out}/convergence.csv, convergence.png, schedule_matched.png; logs in {logs}")
    return summaries[0]


if __name__ == "__main__":
    main()
