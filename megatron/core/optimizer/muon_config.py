"""Muon's settings in ``OptimizerConfig``: narrow types, defaults and validation.

``OptimizerConfig`` (patch ``0001-optimizer-config-muon.patch``) declares the ``muon_*`` fields
with the types and defaults below and calls ``validate_muon_config`` from ``__post_init__``. The
defaults come from the Muon modules themselves (``muon.py``, ``newton_schulz.py``), so a default
has one home; this module only names them for the config and checks user values.
"""

from typing import Literal

from .muon import DEFAULT_MATCHED_ADAMW_RMS, DEFAULT_MOMENTUM
from .muon_functional import SCALE_MODES, resolve_scale
from .newton_schulz import COEFFICIENT_SETS, DEFAULT_STEPS, PRECISIONS

TPMode = Literal["blockwise", "duplicated", "distributed"]
ScaleMode = Literal["spectral", "shape_scaling", "unit_rms_norm"]
CoefficientType = Literal["simple", "quintic", "polar_express"]
MatmulPrecision = Literal["highest", "high", "medium", "low", "fp32", "bf16"]
ExchangeDtype = Literal["fp32", "bf16"]

TP_MODES = ("blockwise", "duplicated", "distributed")
EXCHANGE_DTYPES = ("fp32", "bf16")

DEFAULT_TP_MODE: TPMode = "duplicated"
DEFAULT_COEFFICIENTS: CoefficientType = "simple"
DEFAULT_PRECISION: MatmulPrecision = "medium"  # upstream 0.16.1's default: bf16 Newton-Schulz
DEFAULT_EXCHANGE_DTYPE: ExchangeDtype = "fp32"
__all__ = [
    "DEFAULT_MATCHED_ADAMW_RMS",
    "DEFAULT_MOMENTUM",
    "DEFAULT_STEPS",
    "validate_muon_config",
]

# (field, allowed values) for the fields that take one of a few names.
_CHOICES = {
    "muon_tp_mode": TP_MODES,
    "muon_scale_mode": tuple(SCALE_MODES),
    "muon_coefficient_type": tuple(COEFFICIENT_SETS),
    "muon_fp32_matmul_prec": tuple(PRECISIONS),
    "muon_distopt_exchange_dtype": EXCHANGE_DTYPES,
}


def validate_muon_config(config) -> None:
    """Raise ``ValueError`` naming the ``OptimizerConfig`` field, its value and what is allowed."""
    for name, allowed in _CHOICES.items():
        value = getattr(config, name)
        _require(value in allowed, name, value, f"one of {list(allowed)}")
    for name in ("muon_split_qkv", "muon_use_nesterov"):
        _require(isinstance(getattr(config, name), bool), name, getattr(config, name), "a bool")
    mu = config.muon_momentum
    _require(0.0 <= mu < 1.0, "muon_momentum", mu, "a float in [0, 1)")
    steps = config.muon_num_ns_steps
    ok = isinstance(steps, int) and not isinstance(steps, bool) and steps >= 1
    _require(ok, "muon_num_ns_steps", steps, "an int >= 1")
    factor = config.muon_extra_scale_factor
    _require(factor > 0, "muon_extra_scale_factor", factor, "a float > 0")
    rms = config.muon_matched_adamw_rms
    _require(rms is None or rms > 0, "muon_matched_adamw_rms", rms, "None or a float > 0")
    try:
        resolve_scale(rms, config.muon_scale_mode, factor)
    except ValueError as err:
        raise ValueError(f"OptimizerConfig muon_matched_adamw_rms/muon_scale_mode: {err}") from None


def _require(ok: bool, name: str, value, allowed: str) -> None:
    if not ok:
        raise ValueError(f"OptimizerConfig.{name}={value!r} is not allowed; expected {allowed}")
