"""Muon with and without QK-clip (``bench/convergence.py --qk-clip TAU``): does the max attention
logit grow without the clip on this small model, and what does the clip cost in loss?

Two ``pretrain_gpt.py`` runs that differ only in ``--qk-clip --qk-clip-threshold TAU``, both with
``--log-max-attention-logit`` and a log line every evaluation interval, at Muon's lr (the one given
with ``--qk-clip-lr``). Prints the model-wide max logit per logged step for both and their final
validation losses; writes ``<out>/qk_clip.csv``.
"""

import csv
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

MAX_LOGIT = re.compile(r"iteration\s+(\d+)/.*? max attention logit: (\S+) \|")


def run(root, base_args: list, tau) -> dict:
    """{'max_logit': [(step, value)], 'val': [(step, loss)]} of one run; ``tau`` None: no clip."""
    from convergence import VALID, free_port

    extra = [
        "--log-max-attention-logit",
        "--log-interval",
        base_args[base_args.index("--eval-interval") + 1],
    ]
    if tau is not None:
        extra += ["--qk-clip", "--qk-clip-threshold", str(tau)]
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_PORT=str(free_port()))
    env.update(PYTHONWARNINGS="ignore")
    env.pop("RANK", None)
    cmd = [sys.executable, "pretrain_gpt.py", *base_args, *extra]
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"qk-clip={tau} failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return {
        "max_logit": [(int(i), float(v)) for i, v in MAX_LOGIT.findall(proc.stdout)],
        "val": [(int(i), float(v)) for i, v in VALID.findall(proc.stdout)],
    }


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
