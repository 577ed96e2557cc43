"""OptimizerConfig's Muon fields: defaults (one home) and the validation error table."""

import dataclasses
import inspect

import pytest

from megatron.core.optimizer import OptimizerConfig, newton_schulz
from megatron.core.optimizer import muon as muon_module


def test_defaults_come_from_the_muon_modules():
    config = OptimizerConfig(optimizer="muon")
    assert config.muon_momentum == muon_module.DEFAULT_MOMENTUM == 0.95
    assert config.muon_matched_adamw_rms == muon_module.DEFAULT_MATCHED_ADAMW_RMS == 0.2
    assert config.muon_num_ns_steps == newton_schulz.DEFAULT_STEPS == 5
    assert config.muon_use_nesterov is True  # upstream 0.16.1: False
    assert config.muon_tp_mode == "duplicated"  # upstream 0.16.1: blockwise
    assert config.muon_split_qkv is True
    assert config.muon_coefficient_type == "simple"
    assert config.muon_fp32_matmul_prec == "medium"
    assert config.muon_distopt_exchange_dtype == "fp32"


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
    (dict(muon_num_ns_steps=0), ["muon_num_ns_steps", ">= 1"]),
    (dict(muon_num_ns_steps=2.5), ["muon_num_ns_steps", "int"]),
    (dict(muon_extra_scale_factor=0.0, muon_matched_adamw_rms=None), ["muon_extra_scale_factor"]),
    (dict(muon_matched_adamw_rms=-1.0), ["muon_matched_adamw_rms", "None or a float > 0"]),
    (dict(muon_use_nesterov="yes"), ["muon_use_nesterov", "bool"]),
    (dict(muon_split_qkv=1), ["muon_split_qkv", "bool"]),
    # matched RMS fixes the scale: combining it with upstream's scale knobs is ambiguous
    (dict(muon_scale_mode="shape_scaling"), ["muon_matched_adamw_rms", "shape_scaling", "None"]),
    (dict(muon_extra_scale_factor=2.0), ["muon_matched_adamw_rms", "extra_scale_factor=2.0"]),
]


@pytest.mark.parametrize("overrides,words", BAD, ids=[next(iter(o)) for o, _ in BAD])
def test_bad_value_raises_value_error_naming_field_and_allowed(overrides, words):
    with pytest.raises(ValueError) as err:
        OptimizerConfig(optimizer="muon", **overrides)
    for word in words:
        assert word in str(err.value), f"{word!r} not in {err.value}"


GOOD = [
    dict(muon_tp_mode="blockwise"),
    dict(muon_tp_mode="distributed"),
    dict(muon_matched_adamw_rms=None, muon_scale_mode="unit_rms_norm", muon_extra_scale_factor=2),
    dict(muon_coefficient_type="polar_express", muon_fp32_matmul_prec="highest"),
    dict(muon_distopt_exchange_dtype="bf16", muon_momentum=0.0, muon_num_ns_steps=1),
]


@pytest.mark.parametrize("overrides", GOOD)
def test_good_values_are_accepted(overrides):
    config = OptimizerConfig(optimizer="muon", **overrides)
    for name, value in overrides.items():
        assert getattr(config, name) == value
