"""Patch 0033: the persistent async checkpoint worker runs on a host without CUDA.

``--async-save --use-persistent-ckpt-worker`` (upstream's MoE Muon recipes, tests/e2e/
test_upstream_muon_recipes.py) hands each torch_dist save to a worker process started fresh by
multiprocessing: CPU mode (``cpu_mode``, enabled in the ranks) does not reach it. Its loop set a
CUDA device (``rank % device_count()``: ZeroDivisionError) and its preload synchronized CUDA (no
driver); the worker died and the ranks waited on it for ever. Here both functions run in a fresh
interpreter, as in the worker: the fork's return, plain upstream's raise (the negative control,
on the pinned archive's untouched tree).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))

from upstream_core import pristine_tree  # noqa: E402

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="the defect is a host without CUDA's"
)

# What the worker does with a save (async_utils.PersistentAsyncCaller.async_loop, started with
# its queue holding the stop request; filesystem_async.FileSystemWriterAsync.preload_tensors,
# the preload_fn of every torch_dist request), in a process where CPU mode was never enabled.
WORKER = """
import multiprocessing as mp, sys, torch
from megatron.core.dist_checkpointing.strategies import async_utils, filesystem_async
step = sys.argv[1]
if step == "loop":
    queue = mp.JoinableQueue()
    queue.put("DONE")
    async_utils.PersistentAsyncCaller.async_loop(0, queue, mp.JoinableQueue(), mp.Queue())
else:
    data = torch.arange(6.0)
    buckets = [("f.distcp", "key", ([], [("item", data)]))]
    out = filesystem_async.FileSystemWriterAsync.preload_tensors(buckets, non_blocking=True)
    assert torch.equal(out[0][2][1][0][1], data)
print("worker ok", filesystem_async.__file__)
"""


def _worker(step: str, tree: Path = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "MEGATRON_CPU_MODE"}
    if tree is not None:
        env["PYTHONPATH"] = str(tree)
    cmd = [sys.executable, "-c", WORKER, step]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("step", ["loop", "preload"])
def test_the_worker_runs_without_cuda(step):
    done = _worker(step)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "worker ok" in done.stdout and "build/fork" in done.stdout  # the fork's module


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return pristine_tree(tmp_path_factory.mktemp("pristine"))


@pytest.mark.parametrize(
    "step, error",
    [("loop", "ZeroDivisionError"), ("preload", "torch.cuda.synchronize()")],
)
def test_plain_upstream_worker_dies_without_cuda(pristine, step, error):
    """Negative control: upstream's own functions fail exactly where the patch guards them."""
    done = _worker(step, pristine)
    assert done.returncode != 0 and "worker ok" not in done.stdout
    assert error in done.stderr, done.stderr[-3000:]  # the guarded call raised
    assert str(pristine) in done.stderr  # upstream's module raised, not the fork's
