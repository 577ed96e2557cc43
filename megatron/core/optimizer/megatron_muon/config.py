"""Muon's vocabularies and defaults: the one home of every Muon default, and its validation.

A leaf module (no torch): ``OptimizerConfig`` (patch 0001), ``Muon`` and newton_schulz.py take
their defaults from here. Upstream's fields keep upstream's defaults; ours default to off. The
seed's recipe is a set of flags, not a default (README.md).
"""

from typing import Literal, Optional, get_args

# The range ``--muon-plan-*`` accept (``cost_model.PlanLinks``): any real machine, with margin.
# Past it the cost of a byte overflows to inf, and inf x 0 is a NaN the planner would compare.
MAX_PLAN_TFLOPS = 1e6  # per GPU: 1 EFLOP/s
MIN_PLAN_GBPS = 1e-3  # per GPU and direction: 1 Mb/s (inf: a free link)

TPMode = Literal["blockwise", "duplicated", "distributed"]
ScaleMode = Literal["spectral", "shape_scaling", "unit_rms_norm"]
# Upstream's names (emerging_optimizers' NSCoeffT less 'custom'), same numbers (newton_schulz.py).
CoefficientType = Literal["simple", "quintic", "polar_express", "cans", "aol", "deepseekv4"]
# torch.set_float32_matmul_precision's names, as upstream: fp32, TF32 allowed on CUDA, bf16.
MatmulPrecision = Literal["highest", "high", "medium"]
ExchangeDtype = Literal["fp32", "bf16"]
# OptimizerConfig.muon_ns_form (ours): Newton-Schulz's standard steps (upstream's), or the Gram
# form where it does fewer FLOPs (newton_schulz.uses_gram; same polynomial, m x m part in fp32).
NSForm = Literal["standard", "auto"]
# OptimizerConfig.muon_impl (megatron-core >= 0.17 only): which Muon optimizer='muon' builds.
MuonImpl = Literal["emerging", "megatron_muon"]

TP_MODES: tuple[str, ...] = ("blockwise", "duplicated", "distributed")
SCALE_MODES: tuple[str, ...] = ("spectral", "shape_scaling", "unit_rms_norm")
COEFFICIENT_TYPES: tuple[str, ...] = get_args(CoefficientType)
MATMUL_PRECISIONS: tuple[str, ...] = get_args(MatmulPrecision)
EXCHANGE_DTYPES: tuple[str, ...] = ("fp32", "bf16")
MUON_IMPLS: tuple[str, ...] = ("emerging", "megatron_muon")
NS_FORMS: tuple[str, ...] = get_args(NSForm)

# Upstream's OptimizerConfig defaults (same values, same meanings).
DEFAULT_MOMENTUM = 0.95
DEFAULT_SPLIT_QKV = True
DEFAULT_NESTEROV = False
DEFAULT_SCALE_MODE: ScaleMode = "spectral"
DEFAULT_PRECISION: MatmulPrecision = "medium"  # bf16 Newton-Schulz matmuls
DEFAULT_STEPS = 5
DEFAULT_TP_MODE: TPMode = "blockwise"
DEFAULT_EXTRA_SCALE_FACTOR = 1.0
# Upstream's muon_coefficient_type default.
DEFAULT_COEFFICIENTS: CoefficientType = "quintic"
# Ours: off unless asked for. optimizer='muon' is upstream's (emerging_optimizers) unless
# muon_impl='megatron_muon' (patch 0001).
DEFAULT_MUON_IMPL: MuonImpl = "emerging"
DEFAULT_MATCHED_ADAMW_RMS: Optional[float] = None
DEFAULT_EXCHANGE_DTYPE: ExchangeDtype = "fp32"  # exact
# The DistOpt Muon planner's machine (``cost_model.PlanLinks``): None, the built-in H100-class one.
DEFAULT_PLAN_FIGURE = None
# Ours, off: the DistOpt Muon planner picks the fastest plan, however balanced in FLOPs.
DEFAULT_PLAN_MIN_EFFICIENCY = None
# Ours, off: upstream's Newton-Schulz steps on every matrix.
DEFAULT_NS_FORM: NSForm = "standard"
DEFAULT_EPS = 1e-7  # Newton-Schulz normalization: X / max(||X||_F, eps), as upstream


def is_megatron_muon(config) -> bool:
    """True where ``config`` asks for this fork's Muon (``muon_impl='megatron_muon'``)."""
    return config.optimizer == "muon" and config.muon_impl == "megatron_muon"


def resolve_scale(
    matched_adamw_rms: Optional[float], scale_mode: str, extra_scale_factor: float
) -> tuple[str, float]:
    """Map the two ways to name Muon's update scale onto one ``(scale_mode, factor)``:
    ``matched_adamw_rms=r`` is ``('spectral', r)``, an error with a non-default scale rule.

    Args:
        matched_adamw_rms: ``r``, or None for upstream's rule.
        scale_mode: one of ``SCALE_MODES``.
        extra_scale_factor: a float > 0 multiplying the ``scale_mode`` scale.

    Returns:
        ``(scale_mode, factor)``; ValueError naming a bad value.
    """
    if scale_mode not in SCALE_MODES:
        raise ValueError(f"unknown scale_mode {scale_mode!r}; allowed: {list(SCALE_MODES)}")
    if not extra_scale_factor > 0:
        raise ValueError(f"extra_scale_factor must be > 0, got {extra_scale_factor}")
    if matched_adamw_rms is None:
        return scale_mode, float(extra_scale_factor)
    if not matched_adamw_rms > 0:
        raise ValueError(f"matched_adamw_rms must be > 0 or None, got {matched_adamw_rms}")
    if scale_mode != DEFAULT_SCALE_MODE or extra_scale_factor != DEFAULT_EXTRA_SCALE_FACTOR:
        raise ValueError(
            f"matched_adamw_rms={matched_adamw_rms} fixes the scale to r*sqrt(max(m, n)); it "
            f"cannot be combined with scale_mode={scale_mode!r}, extra_scale_factor="
            f"{extra_scale_factor}: give one scale rule (matched_adamw_rms=None to use those)"
        )
    return "spectral", float(matched_adamw_rms)


# (field, allowed values) for the fields that take one of a few names.
_CHOICES = {
    "muon_tp_mode": TP_MODES,
    "muon_scale_mode": SCALE_MODES,
    "muon_coefficient_type": COEFFICIENT_TYPES,
    "muon_fp32_matmul_prec": MATMUL_PRECISIONS,
    "muon_distopt_exchange_dtype": EXCHANGE_DTYPES,
}


def validate_muon_config(config) -> None:
    """Check the ``muon_*`` fields of an ``OptimizerConfig`` used for Muon (ValueError naming
    the field); called where Muon is built, so an Adam user's config never trips over them."""
    for name, allowed in _CHOICES.items():
        value = getattr(config, name)
        _require(value in allowed, name, value, f"be one of {list(allowed)}")
    impl = config.muon_impl
    _require(impl in MUON_IMPLS, "muon_impl", impl, f"be one of {list(MUON_IMPLS)}")
    form = config.muon_ns_form  # ours (patch 0001)
    _require(form in NS_FORMS, "muon_ns_form", form, f"be one of {list(NS_FORMS)}")
    for name in ("muon_split_qkv", "muon_nesterov"):
        _require(isinstance(getattr(config, name), bool), name, getattr(config, name), "be a bool")
    mu = config.muon_momentum
    _require(0.0 <= mu < 1.0, "muon_momentum", mu, "be a float in [0, 1)")
    steps = config.muon_num_ns_steps
    ok = isinstance(steps, int) and not isinstance(steps, bool) and steps >= 1
    # "num_ns_steps must be at least 1": upstream's words for the same check
    _require(ok, "muon_num_ns_steps", steps, "be at least 1 (an int >= 1)")
    factor = config.muon_extra_scale_factor
    _require(factor > 0, "muon_extra_scale_factor", factor, "be a float > 0")
    _validate_plan(config)
    rms = config.muon_matched_adamw_rms
    _require(rms is None or rms > 0, "muon_matched_adamw_rms", rms, "be None or a float > 0")
    try:
        resolve_scale(rms, config.muon_scale_mode, factor)
    except ValueError as err:
        raise ValueError(f"OptimizerConfig muon_matched_adamw_rms/muon_scale_mode: {err}") from None


def _validate_plan(config) -> None:
    """The planner's machine figures and efficiency floor within their ranges."""
    rate = config.muon_plan_tflops
    ok = rate is None or (_is_number(rate) and 0 < rate <= MAX_PLAN_TFLOPS)
    _require(ok, "muon_plan_tflops", rate, f"be None or a number in (0, {MAX_PLAN_TFLOPS:g}]")
    for name in ("muon_plan_dp_link_gbps", "muon_plan_nvlink_gbps"):
        value = getattr(config, name)
        ok = value is None or (_is_number(value) and value >= MIN_PLAN_GBPS)
        _require(ok, name, value, f"be None or a number >= {MIN_PLAN_GBPS:g} (inf: a free link)")
    domain = config.muon_plan_nvlink_domain
    ok = domain is None or (isinstance(domain, int) and not isinstance(domain, bool) and domain > 0)
    _require(ok, "muon_plan_nvlink_domain", domain, "be None or an int >= 1 (GPUs)")
    floor = config.muon_plan_min_efficiency
    ok = floor is None or (_is_number(floor) and 0 < floor <= 1)
    _require(ok, "muon_plan_min_efficiency", floor, "be None or a number in (0, 1]")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _require(ok: bool, name: str, value, allowed: str) -> None:
    if not ok:
        raise ValueError(f"OptimizerConfig.{name} must {allowed}, got {value!r}")
