# Copyright (c) 2025, NVIDIA CORPORATION. All rights reserved.

"""The persistent async checkpoint worker (--async-save --use-persistent-ckpt-worker) on a host
without CUDA: the worker process is started fresh, and its loop called
torch.cuda.set_device(rank % torch.cuda.device_count()) (ZeroDivisionError) and each request's
preload torch.cuda.synchronize() (no driver): the worker died and every rank waited on it for
ever. Both are now skipped where CUDA is unavailable. Each step runs in a fresh interpreter, as
in the worker."""

import os
import subprocess
import sys

import pytest
import torch

# async_utils.PersistentAsyncCaller.async_loop, its queue holding the stop request; and
# filesystem_async.FileSystemWriterAsync.preload_tensors, the preload of every torch_dist request
WORKER = """
import multiprocessing as mp, sys, torch
from megatron.core.dist_checkpointing.strategies import async_utils, filesystem_async
if sys.argv[1] == "loop":
    queue = mp.JoinableQueue()
    queue.put("DONE")
    async_utils.PersistentAsyncCaller.async_loop(0, queue, mp.JoinableQueue(), mp.Queue())
else:
    data = torch.arange(6.0)
    buckets = [("f.distcp", "key", ([], [("item", data)]))]
    out = filesystem_async.FileSystemWriterAsync.preload_tensors(buckets, non_blocking=True)
    assert torch.equal(out[0][2][1][0][1], data)
print("worker ok")
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the defect is a host without CUDA's")
@pytest.mark.parametrize("step", ["loop", "preload"])
def test_the_async_worker_runs_without_cuda(step):
    env = {k: v for k, v in os.environ.items() if k != "MEGATRON_CPU_MODE"}
    done = subprocess.run(
        [sys.executable, "-c", WORKER, step], env=env, capture_output=True, text=True, timeout=300
    )
    # before the fix: ZeroDivisionError (loop), "Torch not compiled with CUDA"/no driver (preload)
    assert done.returncode == 0 and "worker ok" in done.stdout, done.stderr.strip().splitlines()[
        -1:
    ]
