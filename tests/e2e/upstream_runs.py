"""Launches of pretrain_gpt.py on upstream's own training loop (base megatron-core 0.19.2) for
the tests in this folder: torchrun on 2 ranks (gloo CPU ranks where CUDA is absent, else up to 2
GPUs), a tiny GPT, and readers of what a run leaves (logged losses, stand-ins hit, checkpoints).

Upstream's console quirk: the first iteration logged after a (re)start does not reset the
loss accumulators (training_log's ``is_first_iteration``), so with ``--log-interval 1`` the next
line shows the mean of both iterations; ``step_losses`` undoes it.
"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]

CPU = not torch.cuda.is_available()
RANKS = 2 if CPU else min(2, torch.cuda.device_count())
# tiny GPT; upstream's defaults otherwise (--num-workers 2, linear decay, dropout 0.1, torch_dist)
TINY = (
    "--mock-data --tokenizer-type NullTokenizer --vocab-size 128 --num-layers 2 --hidden-size 64"
    " --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 --micro-batch-size 2"
    " --global-batch-size 8 --lr 1e-3 --log-interval 1 --eval-interval 1000 --eval-iters 1"
    # no TE/Apex: torch layers, and the fusions that have no torch fallback off
    " --transformer-impl local --no-persist-layer-norm --no-gradient-accumulation-fusion"
).split()
LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?\| lm loss: ([0-9.E+-]+) \|")
FINAL = re.compile(r"validation loss at iteration \d+ on (\w+) set \| lm loss value: ([0-9.E+-]+)")


def launch_env(tmp: Path, name: str) -> dict:
    """The environment of every launch in this folder but the recipes': one thread per rank, the
    CPU stand-ins each rank hits written to ``tmp/NAME.hits``, and torch.compile off.

    Upstream compiles its fused bias-GeLU, SwiGLU and dropout-add (``megatron/core/jit.py``:
    ``jit_fuser = torch.compile``); on CPU inductor builds them as C++ in every rank of every
    launch: 9 of a 2-rank launch's 29 CPU-seconds (measured, 3 iterations). These tests are about
    the loop, the optimizer and checkpoints, and every run a test compares is launched alike, so
    none compares compiled with eager numbers. The compiled path stays covered where users run
    it: ``make demo``, upstream's Muon recipe resumed bit for bit (``test_upstream_muon_recipes``)
    and the convergence benchmark's run (``tests/unit/test_convergence_bench.py``); the other
    recipe tests were already eager (``TORCHDYNAMO_DISABLE``)."""
    hits = str(tmp / f"{name}.hits")
    return dict(
        os.environ, OMP_NUM_THREADS="1", MEGATRON_CPU_LOOP_HITS=hits, TORCH_COMPILE_DISABLE="1"
    )


def command(tmp: Path, name: str, iters: int, *flags: str) -> tuple:
    """(argv, env) of a torchrun launch of pretrain_gpt.py (``launch_env``)."""
    env = launch_env(tmp, name)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={RANKS}"]
    cmd += ["--standalone", str(ROOT / "pretrain_gpt.py"), *TINY, "--train-iters", str(iters)]
    cmd += ["--distributed-backend", "gloo" if CPU else "nccl", *flags]
    return cmd, env


def launch(tmp: Path, name: str, iters: int, *flags: str, rc: int = 0) -> str:
    """Run pretrain_gpt.py under torchrun; its console output (kept in ``tmp/NAME.log``), after
    asserting torchrun's exit status is ``rc``."""
    cmd, env = command(tmp, name, iters, *flags)
    done = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=480)
    out = done.stdout + done.stderr
    (tmp / f"{name}.log").write_text(out)
    assert done.returncode == rc, f"{name}: rc {done.returncode}, not {rc}\n{out[-4000:]}"
    return out


def resume(tmp: Path, straight: Path, at: int, iters: int, *flags: str) -> tuple:
    """Resume from the straight run's iteration-AT checkpoint alone (copied into
    ``tmp/resumed`` as the latest) to ITERS, saving there: (that folder, the console output)."""
    resumed, name = tmp / "resumed", f"iter_{at:07d}"
    resumed.mkdir()
    shutil.copytree(straight / name, resumed / name)
    (resumed / "latest_checkpointed_iteration.txt").write_text(str(at))
    out = launch(tmp, "resumed", iters, *flags, "--load", str(resumed), "--save", str(resumed))
    return resumed, out


def same_checkpoints(tmp: Path, straight: Path, resumed: Path, iteration: int) -> dict:
    """Both runs' ITERATION checkpoints, asserted equal bit for bit in every tensor and value
    (not only the top level); the straight run's entries."""
    name = f"iter_{iteration:07d}"
    a = checkpoint(straight / name, tmp / "a.pt")
    b = checkpoint(resumed / name, tmp / "b.pt")
    assert leaves(a) > 20  # what is compared: every tensor and value, not only the top level
    assert differences(a, b) == []
    return a


def logged(out: str) -> dict:
    """{iteration: lm loss} as the console shows them."""
    return {int(i): float(v) for i, v in LOSS.findall(out)}


def step_losses(out: str) -> dict:
    """Each iteration's own lm loss (to the 7 digits printed): the second line after a start
    shows the mean of the first two iterations (module docstring)."""
    shown = logged(out)
    first = min(shown)
    steps = dict(shown)
    if first + 1 in shown:
        steps[first + 1] = 2 * shown[first + 1] - shown[first]
    return steps


def hits(tmp: Path, name: str) -> set:
    """The CPU stand-ins rank 0 of launch NAME hit (cpu_loop's names)."""
    counts = json.loads((tmp / f"{name}.hits" / "hits.0.json").read_text())
    return {key.split(" ")[0] for key in counts}


def rank_exits(tmp: Path, name: str) -> dict:
    """{rank: exit status} as each rank of launch NAME recorded it (cpu_loop.exit_status)."""
    folder = tmp / f"{name}.hits"
    return {int(f.suffix[1:]): int(f.read_text()) for f in sorted(folder.glob("exit.*"))}


def expected_stand_ins() -> set:
    from megatron.training import cpu_loop  # ours, in this process and in the installed tree

    return set(cpu_loop.STAND_INS) if CPU else {"P1"}


def checkpoint(folder: Path, scratch: Path) -> dict:
    """Every entry of one iteration's checkpoint, read without a process group: a torch_dist
    one through torch's converter, a torch one as {file path: its contents}."""
    files = sorted(folder.rglob("*.pt"))
    if files:  # --ckpt-format torch: mp_rank_*/model_optim_rng.pt (and distrib_optim.pt)
        return {str(f.relative_to(folder)): torch.load(f, weights_only=False) for f in files}
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(folder, scratch)
    return torch.load(scratch, weights_only=False)


def differences(a, b, where="") -> list:
    """Where two checkpoints' entries differ bitwise; a run's flags (``args``) are not compared:
    --load differs by design."""
    if isinstance(a, dict) and isinstance(b, dict):
        keys = (set(a) | set(b)) - {"args"}
        return [
            d
            for k in sorted(keys, key=str)
            for d in differences(a.get(k), b.get(k), f"{where}/{k}")
        ]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{where}[{i}]")]
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        same = a.dtype == b.dtype and a.shape == b.shape
        same = same and torch.equal(
            a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)
        )
        return [] if same else [where]
    if type(a).__module__ == "numpy":
        import numpy as np

        return [] if type(a) is type(b) and np.array_equal(a, b) else [where]
    if hasattr(a, "getvalue") and hasattr(b, "getvalue"):  # BytesIO (ShardedObject payloads)
        return [] if a.getvalue() == b.getvalue() else [where]
    return [] if type(a) is type(b) and a == b else [where]


def leaves(entry) -> int:
    """How many values (tensors, numbers...) a nested checkpoint entry holds."""
    if isinstance(entry, dict):
        return sum(leaves(v) for v in entry.values())
    if isinstance(entry, (list, tuple)):
        return sum(leaves(v) for v in entry)
    return 1
