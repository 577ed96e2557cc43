"""Regressions from a review of Muon's optimizer state, checkpoints and training loop: a
resume keeps the command line's Muon settings, weights-only loads survive the first bf16 step,
learned position embeddings go to AdamW, the Q/K/V layouts Muon cannot split are refused at
build, and --decoupled-lr's group keeps its own lr bounds through a DistOpt resume. Each failed
before its fix (they were committed as strict xfails first)."""

import pytest
from checkpoint_io import sync_params
from harness import run_distributed
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from tiny_gpt import (
    TinyGPT,
    build_model,
    build_optimizer,
    full_params,
    global_batches,
    train_step,
    transformer_config,
)

from megatron.core import parallel_state as ps


# ------------------------------------------------------------------ 1. position embeddings
def learned_positions_run():
    """Which optimizer half (Muon or AdamW) takes each param of a GPT with learned absolute
    position embeddings: Megatron-LM's default --position-embedding-type."""
    spec = TinyGPT(num_layers=1)
    config = transformer_config(spec)
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=spec.vocab_size,
        max_sequence_length=spec.seq_length,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        position_embedding_type="learned_absolute",
    )
    ddp = DistributedDataParallel(
        config=config, ddp_config=DistributedDataParallelConfig(), module=model
    )
    optimizer = build_optimizer(spec, [ddp], optimizer="muon", muon_impl="megatron_muon")
    names = {id(p): n.removeprefix("module.") for n, p in ddp.named_parameters()}
    out = {}
    for group in optimizer.chained_optimizers[0].optimizer.param_groups:
        for p in group["params"]:
            out[names[id(p)]] = group["use_muon"]
    return out


def test_learned_position_embeddings_are_stepped_by_adamw_not_muon():
    taken = run_distributed(learned_positions_run, 1)[0]
    assert taken["embedding.word_embeddings.weight"] is False  # sanity: AdamW
    assert taken["decoder.layers.0.mlp.linear_fc1.weight"] is True  # sanity: Muon
    assert taken["embedding.position_embeddings.weight"] is False


# ------------------------------------------------------------------ 2. resumed hyper-parameters
def resumed_settings_run(distopt: bool):
    """Save a Muon optimizer built with one momentum / Newton-Schulz step count, load it into one
    built (as a resumed run with other flags builds it) with others: which values run on?"""
    spec = TinyGPT(num_layers=1)
    saved_with = dict(muon_momentum=0.95, muon_num_ns_steps=5, muon_nesterov=False)
    resumed_with = dict(muon_momentum=0.5, muon_num_ns_steps=3, muon_nesterov=True)
    kwargs = dict(optimizer="muon", muon_impl="megatron_muon", use_distributed_optimizer=distopt)
    model = build_model(spec, distopt=distopt)
    saved = build_optimizer(spec, model, **kwargs, **saved_with).state_dict()
    model = build_model(spec, distopt=distopt)
    optimizer = build_optimizer(spec, model, **kwargs, **resumed_with)
    optimizer.load_state_dict(saved)
    muon = [g for g in optimizer.chained_optimizers[0].optimizer.param_groups if g["use_muon"]]
    return {(g["momentum"], g["ns_steps"], g["nesterov"]) for g in muon}


@pytest.mark.parametrize("distopt", [False, True], ids=["plain", "distopt"])
def test_resume_runs_the_command_lines_muon_settings_or_refuses(distopt):
    settings = run_distributed(resumed_settings_run, 1, args=(distopt,))[0]
    assert settings == {(0.5, 3, True)}, f"resumed Muon groups run {settings}"


# ------------------------------------------------------------------ 3. weights-only loads, bf16
def _upstream_weights_only_branch() -> str:
    """The lines of upstream's ``load_checkpoint`` that a --finetune or --no-load-optim load
    runs instead of loading the optimizer: what ``weights_only_load_run`` replays."""
    import inspect

    from megatron.training import checkpointing

    source = inspect.getsource(checkpointing.load_checkpoint)
    guard = "if not release and (not args.finetune or gpt_compat_load_optim) and not args."
    guard += "no_load_optim:"
    assert guard in source, "upstream's optimizer-load guard changed: re-read load_checkpoint"
    branch = source.split(guard, 1)[1].split("    else:\n", 1)[1].split("\n\n", 1)[0]
    return branch


def test_upstream_weights_only_loads_reload_the_main_params():
    """What ``weights_only_load_run`` replays is what upstream's loop does: for --finetune and
    --no-load-optim alike (the guard above), bf16/fp16 runs call reload_model_params()."""
    branch = _upstream_weights_only_branch()
    assert "if (args.fp16 or args.bf16) and optimizer is not None:" in branch
    assert "optimizer.reload_model_params()" in branch


def weights_only_load_run(distopt: bool, reload: bool):
    """Train a bf16 model, load its weights (only) into a fresh bf16 model + optimizer as
    upstream's load_checkpoint does for --finetune / --no-load-optim (the model's
    load_state_dict, then the optimizer's reload_model_params), take one step at lr 0: the
    weights must stay the loaded ones. Returns the largest deviation from them.
    ``reload=False`` (negative control) skips reload_model_params: the step writes the fresh
    init's fp32 main params back."""
    spec = TinyGPT(num_layers=1, dtype="bf16")
    kwargs = dict(optimizer="muon", muon_impl="megatron_muon", use_distributed_optimizer=distopt)
    batches = global_batches(spec, 3)
    model = build_model(spec, distopt=distopt)
    optimizer = build_optimizer(spec, model, **kwargs)
    for batch in batches[:2]:
        train_step(spec, model, optimizer, batch)
    sync_params(model)
    loaded = model[0].state_dict()
    want = full_params(model, spec)
    fresh = build_model(spec, distopt=distopt, seed=1)  # another init, as a new run's
    fresh_opt = build_optimizer(spec, fresh, lr=0.0, weight_decay=0.0, **kwargs)
    fresh[0].load_state_dict(loaded, strict=True)
    if reload:
        fresh_opt.reload_model_params()
    train_step(spec, fresh, fresh_opt, batches[2])  # lr 0, wd 0: nothing may move
    sync_params(fresh)
    got = full_params(fresh, spec)
    return max((got[name] - want[name]).abs().max().item() for name in want)


@pytest.mark.parametrize("distopt", [False, True], ids=["plain", "distopt"])
def test_weights_only_load_survives_the_first_bf16_step(distopt):
    assert run_distributed(weights_only_load_run, 1, args=(distopt, True))[0] == 0.0
    assert run_distributed(weights_only_load_run, 1, args=(distopt, False))[0] > 0.0  # control


# ------------------------------------------------------------------ 4. QKV with an output gate
def gated_qkv_run():
    """The Q/K/V split Muon takes for ``linear_qkv.weight`` of a model with megatron-core's
    ``attention_output_gate`` (its rows per query group are [q; gate; k; v])."""
    spec = TinyGPT(num_layers=1, extra=dict(attention_output_gate=True))
    model = build_model(spec)
    try:
        optimizer = build_optimizer(
            spec, model, optimizer="muon", muon_impl="megatron_muon"
        )  # muon_split_qkv: default on
    except ValueError as err:
        return ("refused", str(err))
    muon = optimizer.chained_optimizers[0].optimizer
    for name, param in model[0].named_parameters():
        if name.endswith("linear_qkv.weight"):
            info = muon.param_info[param]
            return ("split", info.qkv_split, info.shape, spec.num_query_groups)
    raise AssertionError("no linear_qkv.weight")


def test_gated_qkv_is_split_per_block_or_refused():
    out = run_distributed(gated_qkv_run, 1)[0]
    if out[0] == "refused":
        assert "attention_output_gate" in out[1]
        return
    _, split, shape, groups = out
    assert sum(split) * groups == shape[0], f"split {split} of a {shape} gated QKV"


# ------------------------------------------------------------------ 5. fewer key heads than TP
def few_groups_run(mode: str):
    """Muon (split QKV, the default) on a GPT with num_query_groups (1) < TP (2), which
    megatron-core 0.16.1's attention supports (a query group's rows straddle TP ranks)."""
    spec = TinyGPT(num_layers=1, num_query_groups=1)
    model = build_model(spec)
    try:
        optimizer = build_optimizer(
            spec, model, optimizer="muon", muon_impl="megatron_muon", muon_tp_mode=mode
        )
    except ValueError as err:
        return ("refused at build", str(err))
    try:
        return ("stepped", train_step(spec, model, optimizer, global_batches(spec, 1)[0])["ok"])
    except Exception as err:  # what the first step raises today
        return ("crashed at the first step", f"{type(err).__name__}: {err}")


@pytest.mark.parametrize("mode", ["blockwise", "distributed"])
def test_fewer_query_groups_than_tp_steps_or_is_refused_at_build(mode):
    for outcome in run_distributed(few_groups_run, 2, tp=2, args=(mode,)):
        assert outcome == ("stepped", True) or (
            outcome[0] == "refused at build" and "num_query_groups" in outcome[1]
        ), outcome


# ------------------------------------------------------------------ 6. --decoupled-lr, DistOpt
def decoupled_lr_groups_run(optimizer_name: str, distopt: bool):
    """Each param group's (use_muon, #params, max_lr) before a DistOpt state_dict round trip and
    after loading it into a fresh optimizer, with Megatron's decoupled lr for the embedding and
    output layer (``OptimizerConfig.decoupled_lr``, the CLI's --decoupled-lr)."""
    spec = TinyGPT(num_layers=1)
    kwargs = dict(optimizer=optimizer_name, use_distributed_optimizer=distopt, decoupled_lr=3e-3)
    kwargs.update(muon_impl="megatron_muon")  # our Muon for 'muon' (Adam ignores it)

    def groups(optimizer):
        out = []
        for opt in optimizer.chained_optimizers:
            for g in opt.optimizer.param_groups:
                out.append((g.get("use_muon"), len(g["params"]), g["max_lr"]))
        return out

    model = build_model(spec, distopt=distopt)
    saved = build_optimizer(spec, model, **kwargs)
    before, state = groups(saved), saved.state_dict()
    model = build_model(spec, distopt=distopt)
    fresh = build_optimizer(spec, model, **kwargs)
    fresh.load_state_dict(state)
    return before, groups(fresh)


@pytest.mark.parametrize("distopt", [False, True], ids=["plain", "distopt"])
@pytest.mark.parametrize("optimizer_name", ["muon", "adam"])
def test_resume_keeps_each_groups_lr_bounds_with_decoupled_lr(optimizer_name, distopt):
    """Without DistOpt the load failed outright (the default and decoupled groups got one dict:
    "a parameter group that doesn't match the size"); with it the hidden matrices took the
    decoupled lr bounds. Groups of one identity are now matched in order (patch 0016)."""
    args = (optimizer_name, distopt)
    before, after = run_distributed(decoupled_lr_groups_run, 1, args=args)[0]
    assert any(lr == 3e-3 for *_, lr in before) and any(lr == 1e-2 for *_, lr in before)
    assert after == before
