"""DistributedOptimizer + Muon checkpoints resume bit-exactly, in every DistOpt format.

Each case trains a tiny GPT (small buckets: matrices straddle DP shards), saves, trains on, and
compares with a fresh model (other init) that loads the checkpoint and trains the same steps.
Reproduce one case: ``.venv/bin/python -m pytest tests/distributed/test_muon_checkpoint.py -k
'torch and fp32' -q``.
"""

import pytest
import torch
from checkpoint_io import FORMATS, load, save, sync_params
from harness import run_distributed
from tiny_gpt import TinyGPT, build_model, build_optimizer, full_params, global_batches, train_step

from megatron.core.optimizer import muon_checkpoint

BEFORE, AFTER = 2, 2
BUCKET = 6000  # as test_muon_distopt.py: ~12 buckets, matrices straddle DP shard boundaries
MUON = dict(optimizer="muon", muon_fp32_matmul_prec="fp32")


def build(spec, optimizer_kwargs, seed=0):
    model = build_model(
        spec,
        distopt=True,
        bucket_size=BUCKET,
        overlap_grad_reduce=True,
        overlap_param_gather=True,
        seed=seed,
    )
    return model, build_optimizer(spec, model, use_distributed_optimizer=True, **optimizer_kwargs)


def steps(spec, model, optimizer, batches):
    for batch in batches:
        train_step(spec, model, optimizer, batch)
    sync_params(model)
    return full_params(model, spec)


def distopts(optimizer):
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def model_space_state(optimizer):
    """Every param's main param and state, whole, by name: comparable across DP sizes."""
    return [muon_checkpoint.gather_state(d, everywhere=True) for d in distopts(optimizer)]


def save_then_resume(spec, fmt, directory, optimizer_kwargs):
    """(uninterrupted params, resumed params) at the same layout."""
    batches = global_batches(spec, BEFORE + AFTER)
    model, optimizer = build(spec, optimizer_kwargs)
    steps(spec, model, optimizer, batches[:BEFORE])
    save(fmt, directory, model, optimizer)
    uninterrupted = steps(spec, model, optimizer, batches[BEFORE:])
    model, optimizer = build(spec, optimizer_kwargs, seed=1)  # nothing may survive but the ckpt
    load(fmt, directory, model, optimizer)
    return uninterrupted, steps(spec, model, optimizer, batches[BEFORE:])


CASES = [
    (fmt, dtype, layout)
    for fmt in FORMATS
    for dtype in ("fp32", "bf16")
    for layout in ("dp2", "tp2_dp2")
]
LAYOUT = {"dp2": dict(world_size=2), "tp2_dp2": dict(world_size=4, tp=2)}


@pytest.mark.parametrize("fmt,dtype,layout", CASES)
def test_resume_is_bit_exact(tmp_path, fmt, dtype, layout):
    results = run_distributed(
        save_then_resume, **LAYOUT[layout], args=(TinyGPT(dtype=dtype), fmt, str(tmp_path), MUON)
    )
    for uninterrupted, resumed in results:
        for name, tensor in uninterrupted.items():
            assert torch.equal(resumed[name], tensor), f"{name} differs after resume"


def plain_round_trip(spec):
    """Without DistOpt (FP32Optimizer / Float16OptimizerWithFloat16Params): state_dict resume."""
    batches = global_batches(spec, BEFORE + AFTER)
    model = build_model(spec)
    optimizer = build_optimizer(spec, model, **MUON)
    steps(spec, model, optimizer, batches[:BEFORE])
    saved = [model[0].state_dict(), optimizer.state_dict()]
    saved = torch.load(__import__("io").BytesIO(_dump(saved)), weights_only=False)
    uninterrupted = steps(spec, model, optimizer, batches[BEFORE:])
    model2 = build_model(spec, seed=1)
    optimizer2 = build_optimizer(spec, model2, **MUON)
    model2[0].load_state_dict(saved[0])
    optimizer2.load_state_dict(saved[1])
    kinds = [g["use_muon"] for o in distopts(optimizer2) for g in o.optimizer.param_groups]
    return uninterrupted, steps(spec, model2, optimizer2, batches[BEFORE:]), kinds


def _dump(obj) -> bytes:
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_non_distopt_resume_keeps_muon_groups_and_is_bit_exact(dtype):
    ((uninterrupted, resumed, kinds),) = run_distributed(
        plain_round_trip, 1, args=(TinyGPT(dtype=dtype),)
    )
    assert True in kinds and False in kinds
    assert kinds == [True, False] * (len(kinds) // 2), "a group took the other half's use_muon"
    for name, tensor in uninterrupted.items():
        assert torch.equal(resumed[name], tensor), f"{name} differs after resume"
