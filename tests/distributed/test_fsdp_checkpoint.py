"""Our Muon's ZeRO-3 checkpoints reshard: saved at DP 4, loaded at DP 2, the run goes on as one
process that never stopped.

Megatron-FSDP (``fsdp_dtensor``) and torch FSDP2 (``torch_dcp``): upstream's own save and load
calls of ``megatron/training/checkpointing.py`` (``generate_state_dict``,
``preprocess_fsdp_dtensor_state_dict``, DCP) on a tiny real GPT on gloo CPU ranks; every DP 2
rank's params after the continuation are compared with one process's that never stopped.
Reproduce one case:

    .venv/bin/python -m pytest tests/distributed/test_fsdp_checkpoint.py -k megatron -q
"""

import types

import pytest
import torch
from harness import run_distributed
from parity import misses, update_rel_error
from test_fsdp_adam import build_wrapped, full_params
from test_fsdp_muon import (
    MUON,
    TOL,
    _gathered_fsdp,
    assert_every_rank_close,
    build_megatron_fsdp,
    reference,
)
from tiny_gpt import TinyGPT, build_optimizer, global_batches, train_step

BEFORE, AFTER = 2, 2
SAVED_DP, LOADED_DP = 4, 2
# small buckets (as test_fsdp_muon.py at DP 4): matrices cut by 4 shards, some ranks hold none
BUCKET = 6000


def _args(fmt="fsdp_dtensor"):
    """The fields of Megatron-LM's args that its fsdp_dtensor and torch_dcp saves and loads
    read here."""
    return types.SimpleNamespace(
        ckpt_format=fmt,
        no_save_optim=False,
        no_save_rng=True,
        use_distributed_optimizer=True,  # --use-megatron-fsdp forces it
        swiglu=False,  # the fused fc1 is saved as it is (its split gathers unevenly: docs/fsdp.md)
        num_experts=None,
    )


def _state_dict(chunks, optimizer, loading: bool, fmt="fsdp_dtensor") -> dict:
    from megatron.training.checkpointing import generate_state_dict

    kwargs = dict(metadata={}, is_loading=True) if loading else dict(metadata={})
    return generate_state_dict(
        _args(fmt), chunks, optimizer, None, None, iteration=BEFORE, optim_sd_kwargs=kwargs
    )


def save_fsdp_dtensor(directory: str, chunks, optimizer) -> None:
    """``save_checkpoint``'s fsdp_dtensor path: its state dict, preprocessed, written by DCP."""
    from megatron.training.checkpointing import preprocess_fsdp_dtensor_state_dict

    from megatron.training import fsdp_checkpoint

    state = _state_dict(chunks, optimizer, loading=False)
    state = fsdp_checkpoint.with_empty_shard_state(state, chunks[0])  # as save_checkpoint does
    state = preprocess_fsdp_dtensor_state_dict(_args(), state, chunks[0])
    torch.distributed.checkpoint.save(state, checkpoint_id=directory)


def load_fsdp_dtensor(directory: str, chunks, optimizer) -> None:
    """``load_checkpoint``'s fsdp_dtensor path."""
    from megatron.training.checkpointing import preprocess_fsdp_dtensor_state_dict
    from torch.distributed.checkpoint import FileSystemReader, default_planner

    from megatron.training import fsdp_checkpoint

    state = _state_dict(chunks, optimizer, loading=True)
    raw = {k: state[k].copy() for k in ("model", "optimizer") if k in state}
    state = fsdp_checkpoint.with_empty_shard_state(state, chunks[0])  # as load_checkpoint does
    state = preprocess_fsdp_dtensor_state_dict(_args(), state, chunks[0])
    torch.distributed.checkpoint.load_state_dict(
        state_dict=state,
        storage_reader=FileSystemReader(directory),
        planner=default_planner.DefaultLoadPlanner(allow_partial_load=True),
    )
    state.update(raw)
    chunks[0].load_state_dict(state["model"], strict=False)
    optimizer.load_state_dict(state["optimizer"])


def _zero_muon_momentum(optimizer) -> None:
    """Zero every Muon momentum buffer of ``optimizer`` (the negative control)."""
    buffers = [
        state["momentum_buffer"]
        for chained in getattr(optimizer, "chained_optimizers", [optimizer])
        for state in chained.optimizer.state.values()
        if "momentum_buffer" in state
    ]
    assert buffers, "the optimizer holds Muon momentum"
    for buffer in buffers:
        buffer.detach().zero_()


def megatron_fsdp_run(spec, directory, steps, *, save=False, load=False, zero_momentum=False):
    """Under Megatron-FSDP (optim_grads_params): load (``load``), train the global batches
    ``steps`` (a slice), save (``save``); this rank's (initial, final params, losses)."""
    chunks = build_megatron_fsdp(spec, "optim_grads_params", BUCKET)
    initial = _gathered_fsdp(chunks, spec)
    optimizer = build_optimizer(spec, chunks, use_distributed_optimizer=True, **MUON)
    if load:
        load_fsdp_dtensor(directory, chunks, optimizer)
        if zero_momentum:
            _zero_muon_momentum(optimizer)
    batches = global_batches(spec, BEFORE + AFTER)[steps]
    losses = [train_step(spec, chunks, optimizer, b)["loss"] for b in batches]
    chunks[0].module.synchronize_param_gather()
    if save:
        save_fsdp_dtensor(directory, chunks, optimizer)
    return initial, _gathered_fsdp(chunks, spec), losses


# ------------------------------------------------------------------ torch FSDP2 (torch_dcp)


def save_torch_dcp(directory: str, chunks, optimizer) -> None:
    """``save_checkpoint``'s torch_dcp path: model and optimizer ``state_dict``s by DCP."""
    state = _state_dict(chunks, optimizer, loading=False, fmt="torch_dcp")
    torch.distributed.checkpoint.save(state, checkpoint_id=directory)


def load_torch_dcp(directory: str, chunks, optimizer) -> None:
    """``load_checkpoint``'s torch_dcp path (with patch 0081's optimizer state to load into)."""
    from torch.distributed.checkpoint import FileSystemReader

    from megatron.training import fsdp_checkpoint

    state = {"model": chunks[0].state_dict()}
    state["optimizer"] = fsdp_checkpoint.optimizer_state_for_loading(optimizer)
    torch.distributed.checkpoint.load_state_dict(state, storage_reader=FileSystemReader(directory))
    chunks[0].load_state_dict(state["model"], strict=False)
    optimizer.load_state_dict(state["optimizer"])


def fsdp2_run(spec, directory, steps, *, save=False, load=False, zero_momentum=False):
    """``megatron_fsdp_run`` under Megatron's FSDP2 wrapper (``--use-torch-fsdp2``)."""
    chunks = build_wrapped(spec, "torch_fsdp2")
    initial = full_params(chunks[0], spec)
    optimizer = build_optimizer(spec, chunks, **MUON)  # FSDP2 refuses the DistOpt (upstream)
    if load:
        load_torch_dcp(directory, chunks, optimizer)
        if zero_momentum:
            _zero_muon_momentum(optimizer)
    batches = global_batches(spec, BEFORE + AFTER)[steps]
    losses = [train_step(spec, chunks, optimizer, b)["loss"] for b in batches]
    if save:
        save_torch_dcp(directory, chunks, optimizer)
    return initial, full_params(chunks[0], spec), losses


RUNS = {"megatron_fsdp-fsdp_dtensor": megatron_fsdp_run, "torch_fsdp2-torch_dcp": fsdp2_run}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{setup: (its DP 4 checkpoint's directory, the DP 4 run's result)}, each saved once."""
    out = {}

    def get(setup):
        if setup not in out:
            directory = str(tmp_path_factory.mktemp(setup) / "ckpt")
            args = (TinyGPT(), directory, slice(0, BEFORE))
            ranks = run_distributed(RUNS[setup], SAVED_DP, args=args, kwargs=dict(save=True))
            out[setup] = directory, ranks[0]
        return out[setup]

    return get


def _resumed(saved, setup, **load_kwargs):
    """Every DP 2 rank's result of resuming the DP 4 checkpoint saved after BEFORE steps, as
    (the DP 4 run's initial params, final params, the losses of all steps)."""
    directory, (initial, _, before) = saved(setup)
    args = (TinyGPT(), directory, slice(BEFORE, None))
    kwargs = dict(load=True, **load_kwargs)
    resumed = run_distributed(RUNS[setup], LOADED_DP, args=args, kwargs=kwargs)
    return [(initial, params, before + losses) for _, params, losses in resumed]


@pytest.mark.parametrize("setup", list(RUNS))
def test_dp4_checkpoint_resumes_at_dp2(saved, setup):
    """Every DP 2 rank's params after the continuation, and each step's loss, are one
    process's that trained all the steps (TOL: test_fsdp_muon.py's, for its reason: resharding
    moves values unchanged, so only the fp32 reduction order differs)."""
    assert_every_rank_close(reference(BEFORE + AFTER), _resumed(saved, setup))


@pytest.mark.parametrize("setup", list(RUNS))
def test_resume_with_muon_momentum_zeroed_misses(saved, setup):
    """Negative control: the same resume with Muon's momentum zeroed after the load (AdamW's
    moments kept) must miss the reference by far: the checkpoint carries Muon's state across
    the DP change, not only the weights."""
    initial, ref, _ = reference(BEFORE + AFTER)
    for _, params, _ in _resumed(saved, setup, zero_momentum=True):
        errors = update_rel_error(initial, ref, params)
        muon = {k: v for k, v in errors.items() if ".linear_" in k and k.endswith(".weight")}
        assert muon and misses(muon, 100 * TOL)
