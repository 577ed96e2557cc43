"""Muon's vocabularies and defaults: the one home of every Muon default and of every check.

A leaf module (no torch): ``OptimizerConfig`` (patch 0001), ``Muon`` and newton_schulz.py take
their defaults from here. Upstream's fields keep upstream's defaults; ours default to off. The
seed's recipe is a set of flags, not a default (README.md).
"""

import math
from typing import Literal, Optional, get_args

# The range ``--muon-plan-*`` accept (``cost_model.PlanLinks``): any real machine, with margin.
# Past it the cost of a byte overflows to inf, and inf x 0 is a NaN the planner would compare.
MAX_PLAN_TFLOPS = 1e6  # per GPU: 1 EFLOP/s
MIN_PLAN_GBPS = 1e-3  # per GPU and direction: 1 Mb/s (inf: a free link)

# ``owner`` (ours): each TP-sharded matrix orthogonalized whole on one rank of TP x DP (tp.py).
TPMode = Literal["blockwise", "duplicated", "distributed", "owner"]
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

TP_MODES: tuple[str, ...] = get_args(TPMode)
SCALE_MODES: tuple[str, ...] = ("spectral", "shape_scaling", "unit_rms_norm")
COEFFICIENT_TYPES: tuple[str, ...] = get_args(CoefficientType)
MATMUL_PRECISIONS: tuple[str, ...] = get_args(MatmulPrecision)
EXCHANGE_DTYPES: tuple[str, ...] = ("fp32", "bf16")
MUON_IMPLS: tuple[str, ...] = ("emerging", "megatron_muon")
NS_FORMS: tuple[str, ...] = get_args(NSForm)

# Upstream's OptimizerConfig defaults (same values, same meanings).
DEFAULT_MOMENTUM = 0.95
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
# Ours: same-shape matrices run as one batched Newton-Schulz chain of at most this many bytes of
# input (``Muon(ns_batch_bytes=...)``); a larger group is chunked (docs/newton_schulz.md).
DEFAULT_NS_BATCH_BYTES = 256 * 2**20


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
    "muon_impl": MUON_IMPLS,
    "muon_ns_form": NS_FORMS,  # ours (patch 0001)
}

# What this Muon does not do, by OptimizerConfig field: (refused when, why).
REFUSED = {
    "muon_scalar_optimizer": (
        lambda v: v != "adam",
        "its non-matrix params use AdamW (allowed: 'adam')",
    ),
    "optimizer_cpu_offload": (bool, "Muon has no CPU-offloaded (HybridDeviceOptimizer) variant"),
    "use_precision_aware_optimizer": (bool, "Muon keeps its state in the main params' dtype"),
    "optimizer_cuda_graph": (bool, "no CUDA graph of this Muon's step"),
    "use_layer_wise_distributed_optimizer": (
        bool,
        "upstream's LayerWise optimizer; this Muon shards inside the DistributedOptimizer "
        "(use_distributed_optimizer=True)",
    ),
    "decoupled_weight_decay": (
        lambda v: not v,
        "Muon's AdamW params use decoupled weight decay only",
    ),
}


def _config_error(message: str, fields: tuple[str, ...]) -> ValueError:
    """A ValueError naming the fields at fault in ``.fields`` (the CLI maps them to flags)."""
    error = ValueError(message)
    error.fields = fields
    return error


def check_choice(name: str, value, allowed) -> None:
    """ValueError ``{name} must be one of [...], got {value!r}`` unless ``value`` is allowed.

    Args:
        name: the setting's name, as the message shows it.
        value: its value.
        allowed: the allowed values.
    """
    if value not in allowed:
        raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}")


def validate_muon_config(config) -> None:
    """Check an ``OptimizerConfig`` used for this Muon: the one check of its settings, run by the
    factory and, on the flags' values, by the CLI (ValueError naming the field)."""
    for name, allowed in _CHOICES.items():
        value = getattr(config, name)
        _require(value in allowed, name, value, f"be one of {list(allowed)}")
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
    ok = rms is None or (_is_number(rms) and math.isfinite(rms) and rms > 0)
    _require(ok, "muon_matched_adamw_rms", rms, "be None or a float > 0 (finite)")
    try:
        resolve_scale(rms, config.muon_scale_mode, factor)
    except ValueError as err:
        fields = ("muon_matched_adamw_rms", "muon_scale_mode", "muon_extra_scale_factor")
        given = tuple(f for f in fields if getattr(config, f) != _DEFAULTS[f])
        message = f"OptimizerConfig muon_matched_adamw_rms/muon_scale_mode: {err}"
        raise _config_error(message, given) from None
    for name, (refused, why) in REFUSED.items():
        value = getattr(config, name, None)
        if value is not None and refused(value):
            message = f"OptimizerConfig.{name}={value!r} with muon_impl='megatron_muon': {why}"
            raise _config_error(message, (name,))


_DEFAULTS = {
    "muon_matched_adamw_rms": DEFAULT_MATCHED_ADAMW_RMS,
    "muon_scale_mode": DEFAULT_SCALE_MODE,
    "muon_extra_scale_factor": DEFAULT_EXTRA_SCALE_FACTOR,
}


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
        raise _config_error(f"OptimizerConfig.{name} must {allowed}, got {value!r}", (name,))


# ----------------------------------------------------------------------------- Muon's groups
def validate_group(group: dict) -> None:
    """A ``Muon`` param group's settings (ValueError naming the key and what is allowed); the
    coefficient set and precision are checked where newton_schulz.py resolves them."""
    _finite(group, "lr", ">= 0", lambda v: v >= 0)
    _finite(group, "weight_decay", ">= 0", lambda v: v >= 0)
    if not group["use_muon"]:
        betas = group["betas"]
        _check(
            isinstance(betas, (tuple, list)) and len(betas) == 2,
            f"betas must be a pair of numbers in [0, 1), got {betas!r}",
        )
        for beta in betas:
            _check(_is_real(beta) and 0 <= beta < 1, f"betas must be in [0, 1), got {betas}")
        _finite(group, "eps", ">= 0", lambda v: v >= 0)
        return
    _finite(group, "momentum", "in [0, 1)", lambda v: 0 <= v < 1)
    steps = group["ns_steps"]
    _check(
        isinstance(steps, int) and not isinstance(steps, bool) and steps >= 1,
        f"ns_steps must be an int >= 1, got {steps!r}",
    )
    _finite(group, "ns_eps", "> 0", lambda v: v > 0)
    if group["matched_adamw_rms"] is not None:
        _finite(group, "matched_adamw_rms", "> 0 (or None)", lambda v: v > 0)
    _finite(group, "extra_scale_factor", "> 0", lambda v: v > 0)
    check_choice("ns_form", group["ns_form"], NS_FORMS)
    resolve_scale(group["matched_adamw_rms"], group["scale_mode"], group["extra_scale_factor"])


def _is_real(value) -> bool:
    """A Python real, or a one-element floating tensor (duck-typed: no torch here)."""
    if isinstance(value, (int, float)):
        return not isinstance(value, bool)
    is_float = getattr(value, "is_floating_point", None)
    return callable(is_float) and value.numel() == 1 and is_float()


def _finite(group: dict, key: str, allowed: str, ok) -> None:
    value = group[key]
    _check(
        _is_real(value) and math.isfinite(float(value)) and ok(float(value)),
        f"{key} must be a finite number {allowed}, got {value!r}",
    )


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
