"""Plain upstream megatron-core as a reference: torch Adam + DistOpt runs on gloo ranks.

The pristine pinned archive (fetched and hash-checked by ``tools/fork.py``) gives the
``megatron/`` tree that goes first on ``PYTHONPATH`` of a subprocess, so ``megatron.core`` there
is upstream's, untouched; its ``megatron.training`` is our CPU mode alone (``pristine_tree``), the
test helpers come from this checkout. The test process,
which imports the fork, runs the other side. The subprocess, by hand (``pristine_tree(DIR)``
makes the tree):

    PYTHONPATH=DIR:tests .venv/bin/python tests/upstream_core.py /tmp/ckpts torch:many
"""

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
BEFORE, AFTER = 2, 2
ADAM = dict(optimizer="adam")
# (bucket size, overlap): ~12 buckets, so params straddle DP shards and buckets end in padding;
# or DDP's single bucket per buffer.
BUCKETS = {"many": (6000, True), "one": (None, False)}


def pristine_tree(dest: Path) -> Path:
    """The pinned archive's untouched ``megatron/core`` extracted into ``dest``, and a
    ``megatron/training`` of our CPU mode alone: the fork's (upstream's loop, patched to import
    our core modules) would not import over upstream's core."""
    spec = importlib.util.spec_from_file_location("fork_for_tests", ROOT / "tools" / "fork.py")
    fork = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fork)
    fork.extract(dest)
    training = dest / "megatron" / "training"
    shutil.rmtree(training)
    training.mkdir()
    (training / "__init__.py").write_text("")
    (training / "cpu_mode.py").symlink_to(ROOT / "megatron" / "training" / "cpu_mode.py")
    return dest


def case_dir(root: Path, fmt: str, buckets: str) -> Path:
    """Where a case's checkpoint (``ckpt``) and upstream's results (``upstream.pt``) go."""
    return Path(root) / f"{fmt}-{buckets}"


def run_upstream(tree: Path, root: Path, cases: list) -> None:
    """For each (format, buckets): train, save and train on under plain upstream, in one
    subprocess (one import of upstream); each case's files under ``case_dir``."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), str(TESTS)]))
    cmd = [sys.executable, __file__, str(root), *(f"{fmt}:{buckets}" for fmt, buckets in cases)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise AssertionError(f"upstream run failed ({' '.join(cmd)}):\n{done.stderr[-4000:]}")


def build(spec, buckets: str, seed: int = 0):
    """A tiny GPT under DDP + DistOpt with torch's Adam (Megatron's Adam without TE/Apex)."""
    from tiny_gpt import build_model, build_optimizer

    size, overlap = BUCKETS[buckets]
    model = build_model(
        spec,
        distopt=True,
        bucket_size=size,
        overlap_grad_reduce=overlap,
        overlap_param_gather=overlap,
        seed=seed,
    )
    return model, build_optimizer(spec, model, use_distributed_optimizer=True, **ADAM)


def steps(spec, model, optimizer, batches) -> tuple[dict, list]:
    """Train on ``batches``; (whole params by name, losses)."""
    from checkpoint_io import sync_params
    from tiny_gpt import full_params, train_step

    losses = [train_step(spec, model, optimizer, batch)["loss"] for batch in batches]
    sync_params(model)
    return full_params(model, spec), losses


def save_and_continue(spec, fmt: str, buckets: str, directory: str):
    """BEFORE steps, save, AFTER steps: the uninterrupted run a resume must reproduce."""
    from checkpoint_io import save
    from tiny_gpt import global_batches

    import megatron.core

    batches = global_batches(spec, BEFORE + AFTER)
    model, optimizer = build(spec, buckets)
    steps(spec, model, optimizer, batches[:BEFORE])
    save(fmt, directory, model, optimizer)
    return (*steps(spec, model, optimizer, batches[BEFORE:]), megatron.core.__path__[0])


def load_and_continue(spec, fmt: str, buckets: str, directory: str):
    """A fresh model (another init: only the checkpoint carries state) loads and trains on."""
    from checkpoint_io import load
    from tiny_gpt import global_batches

    model, optimizer = build(spec, buckets, seed=1)
    load(fmt, directory, model, optimizer)
    return steps(spec, model, optimizer, global_batches(spec, BEFORE + AFTER)[BEFORE:])


def main(root: str, *cases: str) -> None:
    import torch
    import torch._dynamo  # noqa: F401  (once here, not in every forked rank: see conftest.py)
    from harness import run_distributed
    from tiny_gpt import TinyGPT

    from megatron.training import cpu_mode

    cpu_mode.enable_if_needed()
    for case in cases:
        fmt, buckets = case.split(":")
        where = case_dir(root, fmt, buckets)
        args = (TinyGPT(dtype="bf16"), fmt, buckets, str(where / "ckpt"))
        results = run_distributed(save_and_continue, 2, args=args, timeout=300)
        torch.save(results, where / "upstream.pt")


if __name__ == "__main__":
    main(*sys.argv[1:])
