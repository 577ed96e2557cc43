"""OptimizerConfig's Muon fields: upstream's defaults (one home), validation where Muon is used."""

import ast
import dataclasses
import importlib.util
import inspect
import math
import tarfile
from pathlib import Path

import pytest

from megatron.core.optimizer import OptimizerConfig
from megatron.core.optimizer.megatron_muon import config as muon_config
from megatron.core.optimizer.megatron_muon import newton_schulz
from megatron.core.optimizer.megatron_muon import optimizer as muon_optimizer
from megatron.core.optimizer.megatron_muon.config import validate_muon_config
from megatron.core.optimizer.megatron_muon.factory import check_muon_supported

# upstream 0.19.2's OptimizerConfig, read from the pinned archive (tests/meta/test_fork_build.py
# checks its hash): every field it defines keeps its default
UPSTREAM_DEFAULTS = {
    "muon_momentum": 0.95,
    "muon_split_qkv": True,
    "muon_nesterov": False,
    "muon_scale_mode": "spectral",
    "muon_fp32_matmul_prec": "medium",
    "muon_coefficient_type": "quintic",
    "muon_num_ns_steps": 5,
    "muon_tp_mode": "blockwise",
    "muon_extra_scale_factor": 1.0,
    "muon_scalar_optimizer": "adam",
}
OURS_OFF = {
    "muon_impl": "emerging",  # optimizer='muon' builds upstream's emerging_optimizers Muon
    "muon_matched_adamw_rms": None,
    "muon_distopt_exchange_dtype": "fp32",
    "muon_ns_form": "standard",  # upstream's Newton-Schulz steps everywhere
    "muon_plan_tflops": None,  # None: the planner's built-in (H100-class) machine
    "muon_plan_dp_link_gbps": None,
    "muon_plan_nvlink_gbps": None,
    "muon_plan_nvlink_domain": None,
    "muon_plan_min_efficiency": None,  # None: the fastest plan, however balanced
}


def _upstream_config_source() -> str:
    path = Path(__file__).resolve().parents[2] / "tools" / "fork.py"
    spec = importlib.util.spec_from_file_location("fork_for_config", path)
    fork = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fork)
    name = f"megatron_core-{fork.UPSTREAM_VERSION}/megatron/core/optimizer/optimizer_config.py"
    with tarfile.open(fork.archive_path()) as tar:
        return tar.extractfile(name).read().decode()


def _upstream_muon_defaults() -> dict:
    """{field: literal default} of upstream's OptimizerConfig muon_* fields."""
    tree = ast.parse(_upstream_config_source())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "OptimizerConfig"]
    return {
        n.target.id: ast.literal_eval(n.value)
        for n in cls.body
        if isinstance(n, ast.AnnAssign) and n.target.id.startswith("muon_")
    }


def test_upstream_fields_keep_upstream_defaults_and_ours_are_off():
    config = OptimizerConfig()
    assert _upstream_muon_defaults() == UPSTREAM_DEFAULTS  # the table above is upstream's
    for name, value in {**UPSTREAM_DEFAULTS, **OURS_OFF}.items():
        assert getattr(config, name) == value, name


def test_one_home_muon_and_newton_schulz_take_the_config_defaults():
    sig = inspect.signature(muon_optimizer.Muon).parameters
    config = OptimizerConfig()
    assert sig["momentum"].default == config.muon_momentum == muon_config.DEFAULT_MOMENTUM
    assert sig["nesterov"].default is config.muon_nesterov is False
    assert sig["ns_steps"].default == config.muon_num_ns_steps
    assert sig["ns_coefficients"].default == config.muon_coefficient_type
    assert sig["ns_precision"].default == config.muon_fp32_matmul_prec
    assert sig["matched_adamw_rms"].default is config.muon_matched_adamw_rms is None
    assert sig["scale_mode"].default == config.muon_scale_mode
    assert sig["extra_scale_factor"].default == config.muon_extra_scale_factor
    assert sig["ns_form"].default == config.muon_ns_form == "standard"
    ns = inspect.signature(newton_schulz.newton_schulz).parameters
    assert ns["steps"].default == config.muon_num_ns_steps
    assert ns["coefficients"].default == config.muon_coefficient_type
    assert ns["precision"].default == config.muon_fp32_matmul_prec
    assert ns["form"].default == config.muon_ns_form
    # the vocabularies name exactly what the math implements
    assert tuple(newton_schulz.COEFFICIENT_SETS) == muon_config.COEFFICIENT_TYPES
    assert set(newton_schulz.PRECISIONS) == set(muon_config.MATMUL_PRECISIONS)
    assert set(muon_config.NS_FORMS) <= set(newton_schulz.FORMS)  # 'gram': tests and bench only


def test_muon_checks_do_not_run_for_other_optimizers():
    # an Adam user's config is not Muon's business (no Muon validation in __post_init__)
    # nor is upstream's emerging_optimizers Muon (optimizer='muon', muon_impl='emerging'): only
    # ours (muon_impl='megatron_muon') is checked here
    config = OptimizerConfig(optimizer="adam", muon_tp_mode="rowwise", muon_impl="megatron_muon")
    check_muon_supported(config, [])  # returns: only optimizer='muon' is checked
    check_muon_supported(dataclasses.replace(config, optimizer="muon", muon_impl="emerging"), [])
    with pytest.raises(ValueError, match="muon_tp_mode"):
        check_muon_supported(dataclasses.replace(config, optimizer="muon"), [])


def test_every_muon_field_has_a_docstring():
    # dataclass fields carry no docstrings at runtime: read the patched source
    text = inspect.getsource(OptimizerConfig)
    for f in dataclasses.fields(OptimizerConfig):
        if f.name.startswith("muon_"):
            after = text.split(f"    {f.name}:", 1)[1].split("\n", 2)[1]
            assert after.strip().startswith('"""'), f"{f.name} has no docstring"


# (field overrides, words the message must contain)
BAD = [
    (dict(muon_tp_mode="rowwise"), ["muon_tp_mode", "'rowwise'", "duplicated"]),
    (dict(muon_scale_mode="rms", muon_matched_adamw_rms=None), ["muon_scale_mode", "spectral"]),
    (dict(muon_coefficient_type="cubic"), ["muon_coefficient_type", "polar_express"]),
    (dict(muon_fp32_matmul_prec="fp8"), ["muon_fp32_matmul_prec", "medium"]),
    (dict(muon_distopt_exchange_dtype="fp16"), ["muon_distopt_exchange_dtype", "bf16"]),
    (dict(muon_momentum=1.0), ["muon_momentum", "[0, 1)"]),
    (dict(muon_momentum=-0.1), ["muon_momentum", "-0.1"]),
    (dict(muon_num_ns_steps=0), ["muon_num_ns_steps", ">= 1", "num_ns_steps must be at least 1"]),
    (dict(muon_num_ns_steps=2.5), ["muon_num_ns_steps", "int"]),
    (dict(muon_extra_scale_factor=0.0, muon_matched_adamw_rms=None), ["muon_extra_scale_factor"]),
    (dict(muon_matched_adamw_rms=-1.0), ["muon_matched_adamw_rms", "None or a float > 0"]),
    (dict(muon_nesterov="yes"), ["muon_nesterov", "bool"]),
    (dict(muon_impl="mine"), ["muon_impl", "'mine'", "megatron_muon"]),
    (dict(muon_ns_form="gram"), ["muon_ns_form", "'gram'", "'standard', 'auto'"]),
    (dict(muon_split_qkv=1), ["muon_split_qkv", "bool"]),
    (dict(muon_plan_tflops=0.0), ["muon_plan_tflops", "a number in (0, 1e+06]"]),
    (dict(muon_plan_tflops=math.inf), ["muon_plan_tflops", "(0, 1e+06]"]),
    (dict(muon_plan_tflops=1e300), ["muon_plan_tflops", "(0, 1e+06]"]),  # a byte's cost: inf
    (dict(muon_plan_dp_link_gbps=-1.0), ["muon_plan_dp_link_gbps", "inf: a free link"]),
    (dict(muon_plan_nvlink_gbps=1e-310), ["muon_plan_nvlink_gbps", ">= 0.001"]),
    (dict(muon_plan_nvlink_gbps=math.nan), ["muon_plan_nvlink_gbps", ">= 0.001"]),
    (dict(muon_plan_nvlink_domain=0), ["muon_plan_nvlink_domain", "int >= 1"]),
    (dict(muon_plan_nvlink_domain=8.0), ["muon_plan_nvlink_domain", "int >= 1"]),
    (dict(muon_plan_min_efficiency=0.0), ["muon_plan_min_efficiency", "a number in (0, 1]"]),
    (dict(muon_plan_min_efficiency=1.5), ["muon_plan_min_efficiency", "(0, 1]"]),
    (dict(muon_plan_min_efficiency=math.nan), ["muon_plan_min_efficiency", "(0, 1]"]),
    # matched RMS fixes the scale: combining it with upstream's scale knobs is ambiguous
    # giving both scale rules explicitly is an error: two rules for one number
    (
        dict(muon_scale_mode="shape_scaling", muon_matched_adamw_rms=0.2),
        ["muon_matched_adamw_rms", "shape_scaling", "one scale rule"],
    ),
    (
        dict(muon_extra_scale_factor=2.0, muon_matched_adamw_rms=0.2),
        ["muon_matched_adamw_rms", "extra_scale_factor=2.0"],
    ),
]


@pytest.mark.parametrize("overrides,words", BAD, ids=[next(iter(o)) for o, _ in BAD])
def test_bad_value_raises_value_error_naming_field_and_allowed(overrides, words):
    with pytest.raises(ValueError) as err:
        validate_muon_config(OptimizerConfig(optimizer="muon", **overrides))
    for word in words:
        assert word in str(err.value), f"{word!r} not in {err.value}"


GOOD = [
    # giving one scale rule is not an error, whichever it is
    dict(muon_matched_adamw_rms=0.2),
    dict(muon_scale_mode="shape_scaling"),
    dict(muon_extra_scale_factor=2.0),
    dict(muon_tp_mode="blockwise"),
    dict(muon_tp_mode="distributed"),
    dict(muon_tp_mode="owner"),  # ours
    dict(muon_matched_adamw_rms=None, muon_scale_mode="unit_rms_norm", muon_extra_scale_factor=2),
    dict(muon_coefficient_type="polar_express", muon_fp32_matmul_prec="highest"),
    dict(muon_distopt_exchange_dtype="bf16", muon_momentum=0.0, muon_num_ns_steps=1),
    dict(muon_plan_tflops=800.0, muon_plan_dp_link_gbps=math.inf, muon_plan_nvlink_domain=72),
    dict(muon_plan_min_efficiency=1.0),
    dict(muon_ns_form="auto"),
]


@pytest.mark.parametrize("overrides", GOOD)
def test_good_values_are_accepted(overrides):
    config = OptimizerConfig(optimizer="muon", **overrides)
    validate_muon_config(config)
    for name, value in overrides.items():
        assert getattr(config, name) == value
