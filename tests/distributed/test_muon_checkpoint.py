"""DistributedOptimizer + Muon checkpoints resume bit-exactly, in every DistOpt format.

Each case trains a tiny GPT (small buckets: matrices straddle DP shards), saves, trains on, and
compares with a fresh model (other init) that loads the checkpoint and trains the same steps.
Reproduce one case: ``.venv/bin/python -m pytest tests/distributed/test_muon_checkpoint.py -k
'torch and fp32' -q``.
"""

import io

import pytest
import torch
from checkpoint_io import FORMATS, load, save, sync_params
from harness import RankFailure, run_distributed
from parity import update_rel_error, within, worst
from tiny_gpt import TinyGPT, build_model, build_optimizer, full_params, global_batches, train_step

from megatron.core.optimizer.megatron_muon import checkpoint
from megatron.core.optimizer.megatron_muon.layout import is_shard_aligned
from megatron.training.muon_recipe import SEED_RECIPE

BEFORE, AFTER = 2, 2
BUCKET = 6000  # as test_muon_distopt.py: ~12 buckets, matrices straddle DP shard boundaries
MUON = dict(optimizer="muon", muon_fp32_matmul_prec="highest", **SEED_RECIPE)


def build(spec, optimizer_kwargs, seed=0, muon_layout=False):
    model = build_model(
        spec,
        distopt=True,
        bucket_size=BUCKET,
        overlap_grad_reduce=True,
        overlap_param_gather=True,
        seed=seed,
        muon_layout=muon_layout,
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
    return [checkpoint.gather_state(d, everywhere=True) for d in distopts(optimizer)]


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


# Every format at both layouts in fp32; bf16 (fp32 main params, bf16 model) once per format at
# TP2 x DP2: the torch_dist writer's worker processes make each of those cases cost ~10 s here.
CASES = [(fmt, "fp32", layout, "muon") for fmt in FORMATS for layout in ("dp2", "tp2_dp2")]
CASES += [(fmt, "bf16", "tp2_dp2", "muon") for fmt in FORMATS]
# torch's AdamW keeps upstream's format: tests/distributed/test_adam_checkpoint.py.
OPTIMIZERS = {"muon": MUON}
LAYOUT = {"dp2": dict(world_size=2), "tp2_dp2": dict(world_size=4, tp=2)}


@pytest.mark.parametrize("fmt,dtype,layout,optimizer", CASES)
def test_resume_is_bit_exact(tmp_path, fmt, dtype, layout, optimizer):
    spec, kwargs = TinyGPT(dtype=dtype), OPTIMIZERS[optimizer]
    results = run_distributed(
        save_then_resume, **LAYOUT[layout], args=(spec, fmt, str(tmp_path), kwargs)
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
    saved = torch.load(
        io.BytesIO(_dump([model[0].state_dict(), optimizer.state_dict()])), weights_only=False
    )
    uninterrupted = steps(spec, model, optimizer, batches[BEFORE:])
    model2 = build_model(spec, seed=1)
    optimizer2 = build_optimizer(spec, model2, **MUON)
    model2[0].load_state_dict(saved[0])
    optimizer2.load_state_dict(saved[1])
    kinds = [g["use_muon"] for o in distopts(optimizer2) for g in o.optimizer.param_groups]
    return uninterrupted, steps(spec, model2, optimizer2, batches[BEFORE:]), kinds


def _dump(obj) -> bytes:
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


def _upstream_list_form(optimizer) -> None:
    """Make ``optimizer.sharded_state_dict`` list the main params per group as pristine
    upstream does (the negative control of patch 0043)."""

    def as_lists(original):
        def sharded_state_dict(*args, **kwargs):
            out = original(*args, **kwargs)
            groups = out["fp32_from_fp16_params"]
            out["fp32_from_fp16_params"] = [groups[i] for i in range(len(groups))]
            return out

        return sharded_state_dict

    for sub in distopts(optimizer):  # each Float16 optimizer of a ChainedOptimizer
        sub.sharded_state_dict = as_lists(sub.sharded_state_dict)


def plain_torch_dist_round_trip(spec, directory, as_list=False):
    """Without DistOpt, bf16 (Float16OptimizerWithFloat16Params over Muon's Muon/AdamW halves,
    one of them empty): a torch_dist save and load (patch 0043). ``as_list``: the main params
    in upstream's list form; the load's error is returned."""
    batches = global_batches(spec, BEFORE + AFTER)
    model = build_model(spec)
    optimizer = build_optimizer(spec, model, **MUON)
    if as_list:
        _upstream_list_form(optimizer)
    steps(spec, model, optimizer, batches[:BEFORE])
    save("fully_reshardable", directory, model, optimizer)
    uninterrupted = steps(spec, model, optimizer, batches[BEFORE:])
    model2 = build_model(spec, seed=1)
    optimizer2 = build_optimizer(spec, model2, **MUON)
    if as_list:
        _upstream_list_form(optimizer2)
    empty = [len(g["params"]) == 0 for o in distopts(optimizer2) for g in o.optimizer.param_groups]
    try:
        load("fully_reshardable", directory, model2, optimizer2)
    except ValueError as err:
        return None, None, empty, str(err)
    return uninterrupted, steps(spec, model2, optimizer2, batches[BEFORE:]), empty, None


def test_non_distopt_bf16_torch_dist_resume_is_bit_exact(tmp_path):
    ((uninterrupted, resumed, empty, error),) = run_distributed(
        plain_torch_dist_round_trip, 1, args=(TinyGPT(dtype="bf16"), str(tmp_path))
    )
    assert error is None and any(empty) and not all(empty)  # the case: an empty group
    for name, tensor in uninterrupted.items():
        assert torch.equal(resumed[name], tensor), f"{name} differs after resume"


def test_upstream_list_form_fails_with_an_empty_group(tmp_path):
    """Negative control: the main params as pristine upstream lists them fail at load."""
    ((_, _, empty, error),) = run_distributed(
        plain_torch_dist_round_trip, 1, args=(TinyGPT(dtype="bf16"), str(tmp_path), True)
    )
    assert any(empty) and error is not None and "Cannot merge two lists" in error


# ------------------------------------------------------------------- another DP size on resume


def save_at(spec, fmt, directory, muon_layout=False):
    """Train, save; return the model-space state saved and the uninterrupted continuation."""
    batches = global_batches(spec, BEFORE + AFTER)
    model, optimizer = build(spec, MUON, muon_layout=muon_layout)
    steps(spec, model, optimizer, batches[:BEFORE])
    saved = model_space_state(optimizer)
    save(fmt, directory, model, optimizer)
    start = full_params(model, spec)
    return saved, start, steps(spec, model, optimizer, batches[BEFORE:])


def resume_at(spec, fmt, directory, muon_layout=False):
    """Load into a fresh model at this rank count; return the loaded state, the continuation
    and whether the layout was shard-aligned (``megatron_muon/layout.py``)."""
    model, optimizer = build(spec, MUON, seed=1, muon_layout=muon_layout)
    aligned = any(is_shard_aligned(b) for d in distopts(optimizer) for b in d.buffers)
    load(fmt, directory, model, optimizer)
    loaded = model_space_state(optimizer)
    batches = global_batches(spec, BEFORE + AFTER)
    return loaded, steps(spec, model, optimizer, batches[BEFORE:]), aligned


# The state must arrive unchanged (exact); the continuation runs at another DP size, which only
# reorders fp32 gradient sums: the DistOpt parity tolerance of test_muon_distopt.py (1e-4).
RESHARD_TOL = 1e-4


@pytest.mark.parametrize(
    "fmt,saved_dp,loaded_dp",
    [("fully_reshardable", 4, 2), ("dp_reshardable", 4, 2), ("torch", 2, 4)],
)
def test_checkpoint_saved_at_one_dp_size_resumes_at_another(tmp_path, fmt, saved_dp, loaded_dp):
    spec = TinyGPT()
    saved, start, uninterrupted = run_distributed(
        save_at, saved_dp, args=(spec, fmt, str(tmp_path))
    )[0]
    loaded, resumed, _ = run_distributed(resume_at, loaded_dp, args=(spec, fmt, str(tmp_path)))[0]
    _assert_resharded(saved, loaded, start, uninterrupted, resumed)


def _assert_resharded(saved, loaded, start, uninterrupted, resumed):
    for before, after in zip(saved, loaded):
        assert before.keys() == after.keys()
        for name in before:
            for key, value in before[name].items():
                assert _equal(after[name][key], value), f"{name}/{key} changed across DP sizes"
    errors = update_rel_error(start, uninterrupted, resumed)
    assert within(errors, RESHARD_TOL)[1] <= RESHARD_TOL, worst(errors)


def _save_and_resume(spec, fmt, directory):
    """``save_at`` and ``resume_at`` with our layout, in one launch (each costs ~10 s)."""
    saved = save_at(spec, fmt, directory, muon_layout=True)
    return saved, resume_at(spec, fmt, directory, muon_layout=True)


def test_shard_aligned_layout_resumes_bit_exactly_and_reshards(tmp_path):
    """torch_dist dp_reshardable with our layout: at DP=2 the tiny GPT's matrices balance whole
    (shard-aligned buffers) and a resume is bit-exact; the same checkpoint loads at DP=4, where
    they do not (DistOpt's byte-level layout): state unchanged, the continuation within the
    DistOpt parity tolerance."""
    spec, fmt, where = TinyGPT(), "dp_reshardable", str(tmp_path)
    ranks = run_distributed(_save_and_resume, 2, args=(spec, fmt, where))
    for (_, _, uninterrupted), (_, resumed, aligned) in ranks:
        assert aligned
        for name, tensor in uninterrupted.items():
            assert torch.equal(resumed[name], tensor), f"{name} differs after resume"
    (saved, start, uninterrupted), _ = ranks[0]
    kwargs = dict(muon_layout=True)
    loaded, resumed, aligned = run_distributed(
        resume_at, 4, args=(spec, fmt, where), kwargs=kwargs
    )[0]
    assert not aligned
    _assert_resharded(saved, loaded, start, uninterrupted, resumed)


def _equal(a, b) -> bool:
    return a == b if not isinstance(a, torch.Tensor) else torch.equal(a, b)


# ---------------------------------------------------------------------- mismatched checkpoints


def save_with(spec, optimizer_kwargs, directory):
    model, optimizer = build(spec, optimizer_kwargs)
    steps(spec, model, optimizer, global_batches(spec, 1))
    save("torch", directory, model, optimizer)


def load_with(spec, optimizer_kwargs, directory):
    model, optimizer = build(spec, optimizer_kwargs, seed=1)
    load("torch", directory, model, optimizer, model=False)


ADAM = dict(optimizer="adam")


@pytest.mark.parametrize(
    "saved_by,loaded_by,saved_spec,message",
    [
        (MUON, ADAM, TinyGPT(), r"saved by MegatronMuon; this optimizer is AdamW \(upstream"),
        (
            ADAM,
            MUON,
            TinyGPT(),
            r"saved by Adam \(upstream's format: no declared state\); this optimizer is "
            r"MegatronMuon",
        ),
        (
            MUON,
            MUON,
            TinyGPT(ffn_hidden_size=64),
            r"does not match .*linear_fc1.weight: shape \(128, 64\) saved, \(192, 64\) now",
        ),
    ],
    ids=["muon_into_adam", "adam_into_muon", "other_model_shape"],
)
def test_mismatched_checkpoint_is_a_clear_error(tmp_path, saved_by, loaded_by, saved_spec, message):
    run_distributed(save_with, 2, args=(saved_spec, saved_by, str(tmp_path)))
    with pytest.raises(RankFailure, match=message) as failure:
        run_distributed(load_with, 2, args=(TinyGPT(), loaded_by, str(tmp_path)))
    assert "ValueError" in str(failure.value) and "KeyError" not in str(failure.value)


# ------------------------------------------------------------------------ MoE: two DistOpts

MOE = TinyGPT(num_layers=2, num_moe_experts=4, moe_token_dispatcher_type="allgather")


def moe_meta_keys(spec):
    """The declared-state metadata key of the dense and of the expert DistOpt on this rank."""
    from megatron.core.optimizer.megatron_muon.checkpoint_sharded import _meta_key

    _, optimizer = build(spec, MUON)
    return [(d.data_parallel_group_idx, _meta_key(d)) for d in distopts(optimizer)]


def test_moe_dense_and_expert_distopts_keep_apart_their_metadata():
    """Premise and fix: on rank 0 both DistOpts have dp_group_idx 0 (the collision with
    chained_optim_avoid_prefix=True), yet their metadata keys differ."""
    (dense, expert), _ = run_distributed(moe_meta_keys, 2, ep=2, args=(MOE,))
    assert dense[0] == expert[0] == 0
    assert dense[1] != expert[1] and expert[1].endswith(".expert.declared_state_meta")


@pytest.mark.parametrize("fmt", FORMATS)
def test_moe_ep2_resume_is_bit_exact(tmp_path, fmt):
    """MoE EP2 + DistOpt (a ChainedOptimizer of a dense and an expert DistOpt), saved with
    Megatron-LM's metadata (chained_optim_avoid_prefix=True), resumes bit-exactly."""
    results = run_distributed(
        save_then_resume, 2, ep=2, args=(MOE, fmt, str(tmp_path), MUON), timeout=300
    )
    for uninterrupted, resumed in results:
        assert any(".experts." in name for name in uninterrupted)
        for name, tensor in uninterrupted.items():
            assert torch.equal(resumed[name], tensor), f"{name} differs after resume"
