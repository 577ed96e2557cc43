"""The Muon factory on a real GPT: which params take Muon, Megatron's wrappers and param-group
machinery, clear errors for what is not supported, and upstream's entry-point signature."""

import ast
import inspect
import sys
import tarfile
import warnings
from pathlib import Path

import pytest
import torch
from harness import RankFailure, run_distributed
from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params, FP32Optimizer
from tiny_gpt import (
    TinyGPT,
    build_model,
    build_optimizer,
    gather_all_params,
    global_batches,
    train_step,
)

from megatron.core.optimizer import (
    ChainedOptimizer,
    OptimizerConfig,
    ParamKey,
    get_megatron_optimizer,
)
from megatron.core.optimizer.megatron_muon.factory import MegatronMuon
from megatron.core.optimizer.muon import get_megatron_muon_optimizer
from megatron.training.muon_recipe import SEED_RECIPE

ROOT = Path(__file__).resolve().parents[2]
# our Muon: optimizer='muon' alone builds upstream's emerging_optimizers Muon on 0.19.2
OURS = dict(optimizer="muon", muon_impl="megatron_muon")
sys.path.insert(0, str(ROOT / "tools"))
import fork  # noqa: E402


def _names(model):
    return {id(p): n.removeprefix("module.") for n, p in model[0].named_parameters()}


def selection_run(dtype, tie):
    spec = TinyGPT(dtype=dtype, num_layers=2, tie_embeddings=tie)
    model = build_model(spec)
    optimizer = build_optimizer(spec, model, **OURS)
    inner = optimizer.chained_optimizers[0]
    muon = inner.optimizer
    # the wrapper swaps bf16 params for fp32 main params: map back by position
    model_groups = getattr(inner, "float16_groups", None)
    names, groups = _names(model), []
    for i, group in enumerate(muon.param_groups):
        params = model_groups[i] if model_groups else group["params"]
        groups.append(
            dict(
                use_muon=group["use_muon"],
                names=sorted(names[id(p)] for p in params),
                is_muon=[muon.is_muon(p) for p in group["params"]],
                dtypes={str(p.dtype) for p in group["params"]},
                wd_mult=group["wd_mult"],
            )
        )
    infos = {names[id(p)]: muon.param_info[m] for p, m in _pairs(inner, muon)}
    return dict(
        chained=type(optimizer) is ChainedOptimizer,
        wrapper=type(inner).__name__,
        inner=type(muon).__name__,
        scaler=type(inner.grad_scaler).__name__ if hasattr(inner, "grad_scaler") else None,
        groups=groups,
        infos={k: (v.shape, v.qkv_split, v.partition_dim) for k, v in infos.items()},
    )


def _pairs(inner, muon):
    model_groups = getattr(inner, "float16_groups", None)
    for i, group in enumerate(muon.param_groups):
        if group["use_muon"]:
            yield from zip(model_groups[i] if model_groups else group["params"], group["params"])


ALL = ("self_attention.linear_qkv.weight", "self_attention.linear_proj.weight")
ALL += ("mlp.linear_fc1.weight", "mlp.linear_fc2.weight")


@pytest.mark.parametrize("dtype,tie", [("fp32", False), ("bf16", True), ("fp16", False)])
def test_muon_takes_hidden_matrices_adamw_the_rest(dtype, tie):
    out = run_distributed(selection_run, 1, args=(dtype, tie))[0]
    assert out["chained"] and out["inner"] == MegatronMuon.__name__
    wrapper = FP32Optimizer if dtype == "fp32" else Float16OptimizerWithFloat16Params
    assert out["wrapper"] == wrapper.__name__
    assert out["scaler"] == {"fp32": None, "bf16": "NoneType", "fp16": "DynamicGradScaler"}[dtype]
    muon = [n for g in out["groups"] if g["use_muon"] for n in g["names"]]
    adamw = [n for g in out["groups"] if not g["use_muon"] for n in g["names"]]
    assert sorted(muon) == sorted(f"decoder.layers.{i}.{k}" for i in range(2) for k in ALL)
    assert "embedding.word_embeddings.weight" in adamw
    assert ("output_layer.weight" in adamw) != tie  # tied: one tensor, the embedding
    assert all("norm" in n or "embedding" in n or "output_layer" in n for n in adamw)
    for g in out["groups"]:
        assert all(g["is_muon"]) == g["use_muon"] or not g["names"]
        if dtype != "fp32" and g["names"]:
            assert g["dtypes"] == {"torch.float32"}, "fp32 main params in the inner optimizer"
        if any("norm" in n for n in g["names"]):
            assert g["wd_mult"] == 0.0  # Megatron's standard override for 1-D params
    # global shapes and the GQA split (4 heads / 2 groups, kv 16): q 2*16 rows, k and v 16
    qkv = out["infos"]["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert qkv == ((128, 64), (32, 16, 16), 0)
    assert out["infos"]["decoder.layers.0.mlp.linear_fc2.weight"] == ((64, 96), None, 1)


def overrides_run():
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    spec = TinyGPT(num_layers=1)
    model = build_model(spec)
    overrides = {
        ParamKey(name="*linear_fc2.weight"): {"wd_mult": 0.5},
        ParamKey(attr="is_embedding_or_output_parameter"): {"max_lr": 3e-3},
    }
    config = OptimizerConfig(**OURS, lr=1e-2, min_lr=1e-2, weight_decay=0.1)
    optimizer = get_megatron_muon_optimizer(config, model, config_overrides=overrides)
    sched = OptimizerParamScheduler(
        optimizer,
        init_lr=1e-2,
        max_lr=1e-2,
        min_lr=1e-2,
        lr_warmup_steps=0,
        lr_decay_steps=10,
        lr_decay_style="constant",
        start_wd=0.1,
        end_wd=0.1,
        wd_incr_steps=10,
        wd_incr_style="constant",
    )
    sched.step(1)
    names = _names(model)
    out = {}
    for group in optimizer.chained_optimizers[0].optimizer.param_groups:
        for p in group["params"]:
            out[names[id(p)]] = (group["use_muon"], group["lr"], group["weight_decay"])
    return out


def test_param_group_machinery_wd_mult_and_lr_overrides():
    out = run_distributed(overrides_run, 1)[0]
    # (the scheduler applies wd_mult; lr overrides come as max_lr/min_lr)
    assert out["decoder.layers.0.mlp.linear_fc2.weight"] == (True, 1e-2, 0.05)  # wd_mult 0.5
    assert out["decoder.layers.0.mlp.linear_fc1.weight"] == (True, 1e-2, 0.1)
    assert out["embedding.word_embeddings.weight"] == (False, 3e-3, 0.1)  # its own max_lr
    assert out["output_layer.weight"] == (False, 3e-3, 0.1)


def error_run(case):
    spec = TinyGPT(num_layers=1)
    model = build_model(spec)
    return build_optimizer(spec, model, **OURS, decoupled_weight_decay=False)


# (use_distributed_optimizer with Muon raised here until the DistOpt integration, which owns it)
ERRORS = {
    "l2": "decoupled_weight_decay=False",
}

# the seed's recipe at fp32 Newton-Schulz, lr and wd as build_optimizer's defaults
LAYER_WISE = dict(lr=1e-2, weight_decay=0.01, clip_grad=0.0, muon_fp32_matmul_prec="highest")
LAYER_WISE.update(SEED_RECIPE)


def layer_wise_run(distopt: bool, upstream_entry: bool):
    """Two steps through upstream's dist_muon entry point, or through our DistOpt path."""
    spec = TinyGPT(num_layers=1)
    model = build_model(spec, distopt=distopt)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if upstream_entry:  # upstream's callers pass optimizer='adam' or 'dist_muon'
            # (LAYER_WISE has muon_impl='megatron_muon': our Muon, whatever optimizer names)
            config = OptimizerConfig(optimizer="adam", **LAYER_WISE)
            optimizer = get_megatron_muon_optimizer(
                config, model, layer_wise_distributed_optimizer=True
            )
        else:
            optimizer = get_megatron_optimizer(
                OptimizerConfig(optimizer="muon", use_distributed_optimizer=distopt, **LAYER_WISE),
                model,
            )
    model[0].module.config.grad_scale_func = optimizer.scale_loss
    for batch in global_batches(spec, 2):
        train_step(spec, model, optimizer, batch)
    return dict(
        notices=[str(w.message) for w in caught if w.category is DeprecationWarning],
        inner=sorted({type(o).__name__ for o in optimizer.chained_optimizers}),
        params=gather_all_params(model, spec),
    )


@pytest.mark.parametrize("distopt", [True, False], ids=["ddp_distopt", "ddp_plain"])
def test_layer_wise_distributed_optimizer_runs_muon_through_distopt_with_a_notice(distopt):
    # DP=2: the DistOpt path really shards (each rank steps half of every bucket)
    got = run_distributed(layer_wise_run, 2, args=(distopt, True))
    want = run_distributed(layer_wise_run, 2, args=(distopt, False))
    for ours, ref in zip(got, want):
        # the same code path, so the same numbers bit for bit
        assert ours["params"].keys() == ref["params"].keys()
        for name, value in ours["params"].items():
            assert torch.equal(value, ref["params"][name]), name
        assert ref["notices"] == []
        (notice,) = ours["notices"]
        assert "layer_wise_distributed_optimizer=True" in notice and "deprecated" in notice
        if distopt:
            assert ours["inner"] == ["MuonDistributedOptimizer"]
            assert "runs inside the DistributedOptimizer" in notice
        else:
            assert ours["inner"] != ["MuonDistributedOptimizer"]
            assert "NOT sharded" in notice and "use_distributed_optimizer=True" in notice


@pytest.mark.parametrize("case", ERRORS)
def test_unsupported_combinations_raise_value_error(case):
    with pytest.raises(RankFailure, match=r"ValueError: .*" + ERRORS[case].replace("(", r"\(")):
        run_distributed(error_run, 1, args=(case,))


def grouped_weight_run():
    """A MoE GPT (SequentialMLP experts) whose config says its experts' weights are one grouped
    param (``moe_single_grouped_weight``, set after build: it needs Transformer Engine >= 2.14),
    given to our Muon."""
    spec = TinyGPT(num_layers=1, num_moe_experts=4)
    model = build_model(spec)
    model[0].config.moe_single_grouped_weight = True
    build_optimizer(spec, model, **OURS)


def test_experts_in_one_param_are_refused():
    """Each expert is its own Muon matrix, as one-process Muon over SequentialMLP has it; a
    single grouped weight mixes the local experts (and their number depends on EP). (0.16.1's
    legacy GroupedMLP, refused the same way, is gone upstream since 0.17: TEGroupedMLP keeps one
    param per expert unless moe_single_grouped_weight.) Breaking the check in
    check_experts_apart builds the optimizer: no RankFailure, the test fails."""
    with pytest.raises(RankFailure, match=r"ValueError: .*moe_single_grouped_weight=True"):
        run_distributed(grouped_weight_run, 1)


def _upstream_source(module: str) -> ast.Module:
    name = f"megatron_core-{fork.UPSTREAM_VERSION}/megatron/core/optimizer/{module}"
    with tarfile.open(fork.archive_path()) as tar:
        return ast.parse(tar.extractfile(name).read())


def _upstream_function(module: str, name: str) -> ast.FunctionDef:
    return next(n for n in _upstream_source(module).body if getattr(n, "name", "") == name)


def _upstream_signature():
    """What upstream 0.19.2's shim ``get_megatron_muon_optimizer(*args, **kwargs)`` takes:
    ``get_megatron_optimizer``'s parameters (it forwards them as given) and the keyword
    ``layer_wise_distributed_optimizer`` (it pops that one)."""
    shim = _upstream_function("muon.py", "get_megatron_muon_optimizer")
    assert shim.args.vararg and shim.args.kwarg and not shim.args.args  # forwards everything
    assert "kwargs.pop('layer_wise_distributed_optimizer', False)" in ast.unparse(shim)
    args = _upstream_function("__init__.py", "get_megatron_optimizer").args
    defaults = [None] * (len(args.args) - len(args.defaults)) + args.defaults
    forwarded = [
        (a.arg, None if d is None else ast.literal_eval(d), "POSITIONAL_OR_KEYWORD")
        for a, d in zip(args.args, defaults)
    ]
    return forwarded + [("layer_wise_distributed_optimizer", False, "KEYWORD_ONLY")]


def test_get_megatron_muon_optimizer_signature_matches_upstream():
    """Positional calls bind as upstream's shim binds them (pg_collection 5th), and every
    keyword it takes is taken, with its default."""
    ours = inspect.signature(get_megatron_muon_optimizer).parameters.values()
    empty = inspect.Parameter.empty
    assert [(p.name, None if p.default is empty else p.default, p.kind.name) for p in ours] == (
        _upstream_signature()
    )
    from megatron.core.optimizer import muon

    if hasattr(muon, "get_megatron_muon_optimizer"):  # upstream's home for it
        assert inspect.signature(muon.get_megatron_muon_optimizer) == inspect.signature(
            get_megatron_muon_optimizer
        )


def test_muon_config_reaches_the_optimizer():
    out = run_distributed(_config_run, 1)[0]
    assert out == dict(
        momentum=0.9,
        nesterov=False,
        ns_steps=3,
        ns_coefficients="quintic",
        ns_precision="highest",
        ns_form="auto",
        matched_adamw_rms=None,
        scale_mode="unit_rms_norm",
        extra_scale_factor=2.0,
        betas=(0.8, 0.99),
        eps=1e-6,
        mode="distributed",
    )


def _config_run():
    spec = TinyGPT(num_layers=1)
    model = build_model(spec)
    optimizer = build_optimizer(
        spec,
        model,
        **OURS,
        muon_momentum=0.9,
        muon_nesterov=False,
        muon_num_ns_steps=3,
        muon_coefficient_type="quintic",
        muon_fp32_matmul_prec="highest",
        muon_ns_form="auto",
        muon_matched_adamw_rms=None,
        muon_scale_mode="unit_rms_norm",
        muon_extra_scale_factor=2.0,
        adam_beta1=0.8,
        adam_beta2=0.99,
        adam_eps=1e-6,
        muon_tp_mode="distributed",
    )
    muon = optimizer.chained_optimizers[0].optimizer
    group = next(g for g in muon.param_groups if g["use_muon"])
    keys = (
        "momentum",
        "nesterov",
        "ns_steps",
        "ns_coefficients",
        "ns_precision",
        "ns_form",
        "matched_adamw_rms",
        "scale_mode",
        "extra_scale_factor",
        "betas",
        "eps",
    )
    return {**{k: group[k] for k in keys}, "mode": muon.orthogonalizer.mode}
