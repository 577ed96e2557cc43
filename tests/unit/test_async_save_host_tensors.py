"""Patch 0094: an async torch_dist save holds the values of the moment it was called.

The persistent checkpoint worker (``--async-save --use-persistent-ckpt-worker``, upstream's
recipes) receives each request through a queue, which moves a host tensor's storage into shared
memory: worker and trainer then hold one storage. Upstream's preload copied only GPU tensors, so
on CPU ranks (and for ``--optimizer-cpu-offload``'s state) the trainer's next step wrote into
what the worker, niced to 10, had not written yet. CI measured it through
tests/e2e/test_offline_recipe.py: resumed from iteration 2, params-norm 18.93507194519043 at 3
against the straight run's 18.935070037841797. The negative control runs upstream's preload on
the pinned archive's untouched tree.
"""

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))

from upstream_core import pristine_tree  # noqa: E402

# FileSystemWriterAsync.preload_tensors on a shared host tensor (as the worker receives it) and on
# a private one (a synchronous save's): prints whether each came back in the same storage
PRELOAD = """
import torch
from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
for trainer in (torch.arange(6.0).share_memory_(), torch.arange(6.0)):
    buckets = [("f.distcp", "key", ([], [("item", trainer)]))]
    out = FileSystemWriterAsync.preload_tensors(buckets, non_blocking=False)[0][2][1][0][1]
    assert torch.equal(out, torch.arange(6.0))
    same = out.untyped_storage().data_ptr() == trainer.untyped_storage().data_ptr()
    print("shared" if trainer.is_shared() else "private", "same" if same else "copied")
"""

# One rank saves a host tensor asynchronously through the persistent worker, updates it in place
# as the next optimizer step would, waits for the save, and loads it back. A file store, not a
# port: nothing to collide with other tests' ranks.
SAVE = """
import sys, torch, torch.distributed as dist
from megatron.training import cpu_mode
from megatron.core import dist_checkpointing as dc
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

def main(work):
    cpu_mode.enable_if_needed()
    dist.init_process_group("gloo", init_method=f"file://{work}/store", rank=0, world_size=1)
    state = torch.zeros(1 << 16)  # a whole tensor of its own, as the DistOpt's main params are
    sharded = lambda t: {"w": ShardedTensor.from_rank_offsets("w", t)}
    queue = AsyncCallsQueue(persistent=True)
    request = dc.save(sharded(state), f"{work}/ckpt", async_sharded_save=True,
                      async_strategy="mcore")
    queue.schedule_async_request(request)
    state.add_(1.0)
    queue.maybe_finalize_async_calls(blocking=True)
    loaded = dc.load(sharded(torch.empty_like(state)), f"{work}/ckpt")["w"]
    print("saved", sorted(set(loaded.tolist())))
    queue.close()
    dist.destroy_process_group()

if __name__ == "__main__":
    main(sys.argv[1])
"""


def _run(code: str, *argv: str, tree: Path = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = str(tree)
    cmd = [sys.executable, "-c", code, *argv]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def test_preload_copies_the_shared_host_tensor_only():
    done = _run(PRELOAD)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[:2] == ["shared copied", "private same"]


def test_upstream_preload_hands_the_worker_the_trainers_storage(tmp_path):
    """Negative control: upstream's preload returns the shared tensor itself."""
    done = _run(PRELOAD, tree=pristine_tree(tmp_path / "pristine"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[:2] == ["shared same", "private same"]


def test_persistent_async_save_holds_the_values_at_the_save_call(tmp_path):
    script = tmp_path / "save.py"  # a file: the worker's start method re-imports __main__
    script.write_text(SAVE)
    (tmp_path / "ckpt").mkdir()
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "saved [0.0]" in done.stdout, done.stdout  # before the fix: [1.0], the next step's
