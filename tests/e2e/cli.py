"""Drive the real CLI (pretrain_gpt.py, tools/preprocess_data.py) in subprocesses on CPU.

One rank runs ``python pretrain_gpt.py``; several run under ``python -m torch.distributed.run
--standalone`` as users launch them. Ranks get OMP_NUM_THREADS=1: they share the cores."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TINY = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
    "--micro-batch-size 2 --global-batch-size 4 --lr 1e-2 --mock-data --vocab-size 64 "
    "--log-interval 1 --eval-interval 2 --eval-iters 1 --num-workers 0"
).split()

_LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?\| lm loss: (\S+) \|.*?grad norm: (\S+) \|")


def command(args, nproc: int = 1) -> tuple[list, dict]:
    """(argv, environment) of one launch."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.pop("WORLD_SIZE", None)
    launcher = [sys.executable]
    if nproc > 1:
        launcher += ["-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--standalone"]
    return launcher + [os.path.join(ROOT, "pretrain_gpt.py"), *map(str, args)], env


def run(args, nproc: int = 1, timeout: int = 300) -> subprocess.CompletedProcess:
    cmd, env = command(args, nproc)
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def start(args, nproc: int = 1) -> subprocess.Popen:
    """A launch whose output is read while it runs (stderr merged into stdout)."""
    cmd, env = command(args, nproc)
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def losses(proc: subprocess.CompletedProcess) -> dict:
    """{iteration: (lm loss, grad norm)} as printed (6 significant digits / 3 decimals)."""
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return {int(m[1]): (m[2], m[3]) for m in _LINE.finditer(proc.stdout)}


def floats(table: dict) -> list:
    return [float(table[i][0]) for i in sorted(table)]
