"""torch Adam + DistOpt checkpoints (patch 0015): upstream's format, resumable, both ways.

Plain upstream megatron-core of the installed base, 0.16.1 or 0.19.2 (the pristine archive, in a
subprocess: ``upstream_core.py``) trains a tiny bf16 GPT with torch's Adam under the
DistributedOptimizer, saves in each format Megatron-LM writes (``torch``:
``save_parameter_state``; ``torch_dist``: ``dp_reshardable``, its default, and
``fully_reshardable``) and trains on. The fork loads that checkpoint into a fresh
model and trains the same steps: params and losses must equal upstream's uninterrupted run
exactly (same kernels, same order; the state must arrive bit for bit). The fork's own
checkpoints resume exactly too, with many buckets, in fp32 and bf16.
Reproduce: ``.venv/bin/python -m pytest tests/distributed/test_adam_checkpoint.py -q``.
"""

import pytest
import torch
from checkpoint_io import FORMATS, load, save
from harness import run_distributed
from tiny_gpt import TinyGPT, global_batches
from upstream_core import (
    AFTER,
    BEFORE,
    build,
    case_dir,
    load_and_continue,
    pristine_tree,
    run_upstream,
    save_and_continue,
    steps,
)

from megatron.core.optimizer.repairs import distopt_adam_checkpoint, distopt_layout

SPEC = TinyGPT(dtype="bf16")


@pytest.fixture(scope="module")
def upstream(tmp_path_factory):
    """{(format, buckets): (checkpoint dir, upstream's results per rank)} of every UPSTREAM case,
    written by plain upstream (the installed base's) in one subprocess."""
    tree = pristine_tree(tmp_path_factory.mktemp("pristine"))
    root = tmp_path_factory.mktemp("upstream")
    run_upstream(tree, root, UPSTREAM)
    out = {}
    for fmt, buckets in UPSTREAM:
        where = case_dir(root, fmt, buckets)
        results = torch.load(where / "upstream.pt", weights_only=False)
        assert all(core.startswith(str(tree)) for *_, core in results), "not upstream's core"
        out[fmt, buckets] = (str(where / "ckpt"), results)
    return out


def _assert_same(reference, resumed) -> None:
    (params, losses), (params2, losses2) = reference, resumed
    assert losses2 == losses, "losses differ after resume"
    for name, tensor in params.items():
        assert torch.equal(params2[name], tensor), f"{name} differs after resume"


# fully_reshardable from plain 0.16.1 with one bucket per buffer: with several, 0.16.1 saves
# the state of every param after the first bucket shifted (defect 4 in distopt_adam_checkpoint).
# dp_zero_gather_scatter: deprecated upstream, still written when asked for. (0.16.1 cannot save
# its default, fully_sharded_model_space: "ShardedTensor.flattened_range is not supported".)
UPSTREAM = [
    ("torch", "many"),
    ("dp_reshardable", "many"),
    ("fully_reshardable", "one"),
    ("dp_zero_gather_scatter", "many"),
]


@pytest.mark.parametrize("fmt,buckets", UPSTREAM)
def test_checkpoint_of_plain_upstream_resumes_exactly(upstream, fmt, buckets):
    directory, results = upstream[fmt, buckets]
    resumed = run_distributed(load_and_continue, 2, args=(SPEC, fmt, buckets, directory))
    for (params, losses, _), mine in zip(results, resumed):
        _assert_same((params, losses), mine)


def load_without_repair(spec, fmt, buckets, directory):
    """Negative control: the loaded params share one step tensor again (upstream's defect 3)."""
    distopt_adam_checkpoint.unshare_steps = lambda optimizer: None
    return load_and_continue(spec, fmt, buckets, directory)


def test_shared_step_after_load_breaks_the_resume(upstream):
    directory, ((params, losses, _), *_) = upstream["torch", "many"]
    (params2, losses2), *_ = run_distributed(
        load_without_repair, 2, args=(SPEC, "torch", "many", directory)
    )
    assert losses2[0] == losses[0]  # the first step after the load sees the restored params
    assert any(not torch.equal(params2[n], t) for n, t in params.items())


def save_padded_offsets_then_resume(spec, directory):
    """Negative control: fully_reshardable saved at param_index_map offsets (defect 4)."""
    distopt_layout.unpadded_index_map = lambda buffer: buffer.param_index_map
    return save_then_resume(spec, "fully_reshardable", directory)


def test_padded_offsets_break_a_fully_reshardable_resume(tmp_path):
    (uninterrupted, resumed), *_ = run_distributed(
        save_padded_offsets_then_resume, 2, args=(SPEC, str(tmp_path))
    )
    (params, losses), (params2, losses2) = uninterrupted, resumed
    assert losses2[0] == losses[0]  # the model params load right; the main params do not
    assert any(not torch.equal(params2[n], t) for n, t in params.items())


def save_then_resume(spec, fmt, directory):
    """(uninterrupted, resumed) params and losses, both in the fork, many buckets."""
    batches = global_batches(spec, BEFORE + AFTER)
    model, optimizer = build(spec, "many")
    steps(spec, model, optimizer, batches[:BEFORE])
    save(fmt, directory, model, optimizer)
    uninterrupted = steps(spec, model, optimizer, batches[BEFORE:])
    model, optimizer = build(spec, "many", seed=1)
    load(fmt, directory, model, optimizer)
    return uninterrupted, steps(spec, model, optimizer, batches[BEFORE:])


# fp32 for torch and dp_reshardable (loading copies into fp32 main params, which are views of
# the model params: defect 2's no_grad); bf16 for each format. fully_reshardable with many
# buckets is defect 4's case. Each torch_dist case costs ~10 s (the writer's processes).
FORK = [(fmt, "bf16") for fmt in FORMATS] + [("torch", "fp32"), ("dp_reshardable", "fp32")]


@pytest.mark.parametrize("fmt,dtype", FORK)
def test_fork_checkpoint_resumes_exactly(tmp_path, fmt, dtype):
    results = run_distributed(save_then_resume, 2, args=(TinyGPT(dtype=dtype), fmt, str(tmp_path)))
    for uninterrupted, resumed in results:
        _assert_same(uninterrupted, resumed)


def test_fork_checkpoint_is_upstreams_format(tmp_path):
    """What the fork writes for torch Adam is what upstream writes: no marker of ours."""
    run_distributed(save_and_continue, 2, args=(SPEC, "torch", "many", str(tmp_path)))
    common = torch.load(tmp_path / "common_tp0_pp0.pt", weights_only=False)["optimizer"]
    state = torch.load(tmp_path / "param_state_tp0_pp0.pt", weights_only=False)
    assert set(common) == {"optimizer"} and {g["step"] for g in common["optimizer"]["param_groups"]}
    (buffer,) = state[0].values()  # one per dtype
    assert state["buckets_coalesced"]
    assert set(buffer) == {"param", "exp_avg", "exp_avg_sq", "numel_unpadded"}
