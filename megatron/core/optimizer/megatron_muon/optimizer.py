"""``Muon``: a plain torch optimizer holding Muon and AdamW param groups.

It knows nothing of Megatron or process groups: sharded params are stepped through an
``Orthogonalizer`` and a ``MuonParamInfo`` per param handed in (factory.py builds both);
the math is in functional.py and newton_schulz.py, the defaults in config.py.
"""

import copy
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, Optional

import torch
from torch import Tensor
from torch.optim.optimizer import Optimizer, ParamsT

from . import config as defaults
from .config import SCALE_MODES, resolve_scale, validate_group
from .functional import (
    LocalOrthogonalizer,
    MuonParamInfo,
    Orthogonalizer,
    OrthoSpec,
    adamw_,
    muon_apply_,
    muon_momentum_,
)
from .newton_schulz import Triple, coefficient_set, compute_dtype

__all__ = ["Muon", "MuonParamInfo", "LocalOrthogonalizer", "Orthogonalizer"]

# Param-group keys of the Muon rule that a resumed run takes from its own command line, not
# from the checkpoint (``load_state_dict``; ``muon_checkpoint_sharded`` with DistOpt).
RULE_SETTINGS = (
    "momentum",
    "nesterov",
    "ns_steps",
    "ns_coefficients",
    "ns_precision",
    "ns_eps",
    "ns_form",
    "matched_adamw_rms",
    "scale_mode",
    "extra_scale_factor",
)

# The group keys ``OrthoSpec`` is built from (``_ortho_spec``: the rule's but momentum):
# resolved again when they change.
SPEC_SETTINGS = tuple(k for k in RULE_SETTINGS if k not in ("momentum", "nesterov"))

MUON_STATE_KEYS = ("momentum_buffer",)
ADAMW_STATE_KEYS = ("exp_avg", "exp_avg_sq")
ADAMW_SCALAR_STATE_KEYS = ("step",)
NONFINITE_POLICIES = ("raise", "skip", "ignore")


class Muon(Optimizer):
    """Muon for 2-D weights (``use_muon=True`` groups, the default) and AdamW for the rest.

    Muon, per 2-D weight W (m x n) with gradient G, momentum buffer B (zero at start)::

        B = mu B + G                                   (l2: G = G + wd W first)
        U = G + mu B        if nesterov else   U = B
        O = s * NS_k(U)                                (per Q/K/V block for a fused QKV weight)
        W = W (1 - lr wd)                              (decoupled weight decay)
        W = W - lr O

    ``NS_k``: newton_schulz.py (``ns_form='auto'``: the Gram form where it saves FLOPs). Scale
    ``s``: ``scale_mode`` {modes} times ``extra_scale_factor`` (default ``{mode}`` x {factor}, as
    upstream), or with ``matched_adamw_rms=r`` (default {rms}: off) ``r * sqrt(max(m, n))``
    (Moonlight's). ``m, n`` come from ``param_info``, not the tensor, so shards can be stepped.
    AdamW groups: ``torch.optim.AdamW``'s functional step (``foreach``: torch's).

    State, lazy, in ``exp_avg_dtype``: Muon ``{muon_keys}``, AdamW ``{adamw_keys}`` and ``step``
    (``state_keys``). ``on_nonfinite_grad``: ``'raise'``, ``'skip'`` or ``'ignore'``; it sees only
    this process's grads (docs/muon.md, "State, resume and non-finite gradients")."""

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        weight_decay: float = 0.01,
        momentum: float = defaults.DEFAULT_MOMENTUM,
        nesterov: bool = defaults.DEFAULT_NESTEROV,
        ns_steps: int = defaults.DEFAULT_STEPS,
        ns_coefficients: str | Sequence[Triple] = defaults.DEFAULT_COEFFICIENTS,
        ns_precision: str = defaults.DEFAULT_PRECISION,
        ns_eps: float = defaults.DEFAULT_EPS,
        ns_form: str = defaults.DEFAULT_NS_FORM,
        matched_adamw_rms: Optional[float] = defaults.DEFAULT_MATCHED_ADAMW_RMS,
        scale_mode: str = defaults.DEFAULT_SCALE_MODE,
        extra_scale_factor: float = defaults.DEFAULT_EXTRA_SCALE_FACTOR,
        decoupled_weight_decay: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        *,
        param_info: Optional[Mapping[Tensor, MuonParamInfo]] = None,
        orthogonalizer: Optional[Orthogonalizer] = None,
        exp_avg_dtype: Optional[torch.dtype] = None,
        on_nonfinite_grad: Literal["raise", "skip", "ignore"] = "raise",
        foreach: Optional[bool] = None,
        ns_batch_bytes: int = defaults.DEFAULT_NS_BATCH_BYTES,
    ) -> None:
        if exp_avg_dtype is not None and not exp_avg_dtype.is_floating_point:
            raise ValueError(f"exp_avg_dtype must be a floating dtype or None, got {exp_avg_dtype}")
        if on_nonfinite_grad not in NONFINITE_POLICIES:
            raise ValueError(
                f"on_nonfinite_grad must be one of {NONFINITE_POLICIES}, got {on_nonfinite_grad!r}"
            )
        if ns_batch_bytes < 1:
            raise ValueError(f"ns_batch_bytes must be a positive byte count, got {ns_batch_bytes}")
        self.ns_batch_bytes = ns_batch_bytes  # the cap of one batched Newton-Schulz chain
        self.exp_avg_dtype = exp_avg_dtype
        self.on_nonfinite_grad = on_nonfinite_grad
        self.foreach = foreach  # the AdamW groups' (torch's; None: its default rule)
        self.orthogonalizer = orthogonalizer or LocalOrthogonalizer()
        self.skipped_steps = 0
        self._specs: dict[int, tuple[list, OrthoSpec]] = {}  # by group index (``_spec``)
        self._given_info = dict(param_info or {})
        self.param_info: dict[Tensor, MuonParamInfo] = {}  # Muon params only
        defaults = dict(
            use_muon=True,
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_steps=ns_steps,
            ns_coefficients=ns_coefficients,
            ns_precision=ns_precision,
            ns_eps=ns_eps,
            ns_form=ns_form,
            matched_adamw_rms=matched_adamw_rms,
            scale_mode=scale_mode,
            extra_scale_factor=extra_scale_factor,
            decoupled_weight_decay=decoupled_weight_decay,
            betas=betas,
            eps=eps,
        )
        super().__init__(params, defaults)

    # ------------------------------------------------------------------ groups and state
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (``use_muon`` picks the rule) after validating its settings."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            validate_group(group)
            if group["use_muon"]:
                coefficient_set(group["ns_coefficients"])  # names checked where resolved
                compute_dtype(group["ns_precision"])
                for p in group["params"]:
                    self.param_info[p] = self._given_info.get(p) or MuonParamInfo.of(p)
                self._spec(len(self.param_groups) - 1)
        except ValueError:
            self.param_groups.pop()
            raise

    def is_muon(self, param: Tensor) -> bool:
        """Whether ``param`` is stepped by Muon (else by AdamW)."""
        return param in self.param_info

    def state_keys(self, param: Tensor) -> tuple[str, ...]:
        """Names of the param-shaped state tensors (what a sharded checkpoint must carry)."""
        return MUON_STATE_KEYS if self.is_muon(param) else ADAMW_STATE_KEYS

    def scalar_state_keys(self, param: Tensor) -> tuple[str, ...]:
        """Names of per-param scalar state (not sharded: one value per param)."""
        return () if self.is_muon(param) else ADAMW_SCALAR_STATE_KEYS

    def state_dtype(self, param: Tensor) -> torch.dtype:
        """The dtype ``param``'s state is kept in: ``exp_avg_dtype``, else the param's."""
        return self.exp_avg_dtype or param.dtype

    def init_state(self, param: Tensor) -> dict[str, Tensor]:
        """Create the param's state if absent (lazy by default; checkpoint code may call it)."""
        state = self.state[param]
        if not state:
            for key in self.state_keys(param):
                state[key] = torch.zeros_like(param, dtype=self.state_dtype(param))
            for key in self.scalar_state_keys(param):
                # A CPU float32 scalar, like torch's AdamW: reading it never syncs a device.
                state[key] = torch.zeros((), dtype=torch.float32)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load, then restore declared state dtypes, unalias tensors, drop undeclared keys (a
        stale torch_dist ``step`` broke the next save), keep this run's ``RULE_SETTINGS``
        (docs/muon.md)."""
        given = [{k: g[k] for k in RULE_SETTINGS if k in g} for g in self.param_groups]
        super().load_state_dict(state_dict)
        for i, (group, settings) in enumerate(zip(self.param_groups, given)):
            group.update(settings)
            if group["use_muon"]:
                self._spec(i)
        for param, state in self.state.items():
            declared = {*self.state_keys(param), *self.scalar_state_keys(param)}
            for key in [key for key in state if key not in declared]:
                del state[key]
            for key in self.state_keys(param):
                if key in state:
                    state[key] = state[key].to(dtype=self.state_dtype(param), copy=True)
            for key in self.scalar_state_keys(param):
                if key in state:  # on the CPU, as torch keeps it: reading it never syncs
                    state[key] = state[key].to(device="cpu", dtype=torch.float32, copy=True)

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        """One step of every group: AdamW groups, then Muon groups; returns the closure's loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self._grads_usable():
            self.skipped_steps += 1
            return loss
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if params and not group["use_muon"]:
                self._adamw_step(group, params)
        self._muon_steps()
        return loss

    def ortho_specs(self) -> list[OrthoSpec]:
        """The distinct Newton-Schulz/scale settings of the Muon groups, in group order."""
        specs: list[OrthoSpec] = []
        for i, group in enumerate(self.param_groups):
            if group["use_muon"] and self._spec(i) not in specs:
                specs.append(self._spec(i))
        return specs

    def _spec(self, i: int) -> OrthoSpec:
        """Group ``i``'s ``OrthoSpec``, cached until its settings change (not resolved per step)."""
        group = self.param_groups[i]
        settings = [group[k] for k in SPEC_SETTINGS]
        cached = self._specs.get(i)
        if cached is None or cached[0] != settings:
            cached = self._specs[i] = (
                copy.deepcopy(settings),
                _ortho_spec(group, self.ns_batch_bytes),
            )
        return cached[1]

    def _muon_steps(self) -> None:
        """Every Muon group, one orthogonalizer call per distinct ``OrthoSpec``; called every
        step, also without Muon grads here (a distributed one's collectives need every rank)."""
        batches: list[tuple[OrthoSpec, list]] = []
        for i, group in enumerate(self.param_groups):
            if not group["use_muon"]:
                continue
            params = [p for p in group["params"] if p.grad is not None]
            spec = self._spec(i)
            if not batches or batches[-1][0] != spec:
                batches.append((spec, []))
            batches[-1][1].append((group, params, self._muon_momentum(group, params)))
        for spec, items in batches:
            updates = [u for _, _, us in items for u in us]
            infos = [self.param_info[p] for _, params, _ in items for p in params]
            orth = iter(self.orthogonalizer(updates, infos, spec))
            for group, params, _ in items:
                self._muon_apply(group, params, [next(orth) for _ in params])

    def _muon_momentum(self, group: dict[str, Any], params: list[Tensor]) -> list[Tensor]:
        decoupled = group["decoupled_weight_decay"]
        return muon_momentum_(
            params,
            [p.grad for p in params],
            [self.init_state(p)["momentum_buffer"] for p in params],
            momentum=group["momentum"],
            nesterov=group["nesterov"],
            l2_weight_decay=0.0 if decoupled else group["weight_decay"],
        )

    def _muon_apply(self, group: dict[str, Any], params: list[Tensor], orth: list) -> None:
        wd = group["weight_decay"] if group["decoupled_weight_decay"] else 0.0
        muon_apply_(params, orth, lr=group["lr"], weight_decay=wd)

    def _adamw_step(self, group: dict[str, Any], params: list[Tensor]) -> None:
        states = [self.init_state(p) for p in params]
        beta1, beta2 = group["betas"]
        adamw_(
            params,
            [p.grad for p in params],
            [s["exp_avg"] for s in states],
            [s["exp_avg_sq"] for s in states],
            [s["step"] for s in states],
            lr=group["lr"],
            beta1=beta1,
            beta2=beta2,
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            foreach=self.foreach,
        )

    def _grads_usable(self) -> bool:
        """False when the step must be skipped; raises under 'raise'. One sync for all grads."""
        if self.on_nonfinite_grad == "ignore":
            return True
        local_ok = self._local_grads_finite()
        if self._agree(local_ok):
            return True
        if self.on_nonfinite_grad == "skip":
            return False
        where = self._first_nonfinite() if not local_ok else "a peer rank's shard"
        raise FloatingPointError(
            f"non-finite gradient in {where}; nothing "
            "was updated. Use on_nonfinite_grad='skip' to skip such steps"
        )

    def _local_grads_finite(self) -> bool:
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        return not grads or bool(torch.stack([g.isfinite().all() for g in grads]).all())

    def _agree(self, local_ok: bool) -> bool:
        """Whether every rank sharing this step's collectives has finite grads (here: this one)."""
        return local_ok

    def _first_nonfinite(self) -> str:
        for gi, group in enumerate(self.param_groups):
            for pi, p in enumerate(group["params"]):
                if p.grad is not None and not p.grad.isfinite().all():
                    return f"param group {gi}, param {pi} (shape {tuple(p.shape)})"
        raise AssertionError("no non-finite gradient found")


def _ortho_spec(group: dict[str, Any], batch_bytes: int) -> OrthoSpec:
    mode, factor = resolve_scale(
        group["matched_adamw_rms"], group["scale_mode"], group["extra_scale_factor"]
    )
    return OrthoSpec(
        steps=group["ns_steps"],
        coefficients=group["ns_coefficients"],
        precision=group["ns_precision"],
        eps=group["ns_eps"],
        form=group["ns_form"],
        scale_mode=mode,
        scale_factor=factor,
        batch_bytes=batch_bytes,
    )


Muon.__doc__ = Muon.__doc__.format(
    rms=defaults.DEFAULT_MATCHED_ADAMW_RMS,
    mode=defaults.DEFAULT_SCALE_MODE,
    factor=defaults.DEFAULT_EXTRA_SCALE_FACTOR,
    modes=list(SCALE_MODES),
    muon_keys=MUON_STATE_KEYS,
    adamw_keys=ADAMW_STATE_KEYS,
)
