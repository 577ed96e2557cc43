"""Muon's functional core: per-param records and the three stages of a Muon step, plus AdamW.

1. ``muon_momentum_``  elementwise: ``B = mu B + G``; ``U = G + mu B`` (Nesterov) or ``U = B``.
2. an *orthogonalizer* hands whole matrices to ``orthogonalize_matrices``:
   ``O = s * NS_k(U)`` per matrix, or per Q/K/V block of a fused QKV weight.
3. ``muon_apply_``     elementwise: ``W = W (1 - lr wd)``; ``W = W - lr O``.

Stages 1 and 3 run on any shard; the scale ``s`` comes from ``MuonParamInfo`` (global), never
from the local tensor, so a shard's stage 2 can be fed the global layout.
"""

import contextlib
import functools
import math
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Optional, Protocol

import torch
from torch import Tensor
from torch.optim.adam import adam

from .config import DEFAULT_NS_BATCH_BYTES, SCALE_MODES
from .newton_schulz import (
    CoefficientSet,
    Request,
    Triple,
    gathered_newton_schulz_steps,
    gathers,
    newton_schulz,
    newton_schulz_stack,
    sharded_newton_schulz_steps,
    splits_polynomial,
)

# Update scale s = SCALE_FNS[mode](m, n) * factor, m x n the (block's) global shape; the names
# (and the matched-AdamW-RMS alias, resolve_scale) live in muon_config.
SCALE_FNS: dict[str, Callable[[int, int], float]] = {
    # Moonlight / Keller Jordan: RMS(O) = 1 / sqrt(max(m, n)), so this gives RMS(s O) = factor.
    "spectral": lambda m, n: math.sqrt(max(m, n)),
    # Keller Jordan's original Muon (torch.optim.Muon adjust_lr_fn="original").
    "shape_scaling": lambda m, n: math.sqrt(max(1.0, m / n)),
    # Scion / Bernstein: unit RMS->RMS operator norm.
    "unit_rms_norm": lambda m, n: math.sqrt(m / n),
}
assert tuple(SCALE_FNS) == SCALE_MODES, "config.SCALE_MODES names these rules"


@dataclass(frozen=True)
class MuonParamInfo:
    """What stage 2 needs to know about a Muon parameter, independent of its sharding: the global
    2-D ``shape`` and, for a fused QKV weight, ``qkv_split``, the row counts of ONE query group's
    Q/K/V blocks (Megatron lays out ``[q; k; v]`` per query group)."""

    shape: tuple[int, int]
    qkv_split: Optional[tuple[int, ...]] = None

    def __post_init__(self) -> None:
        if len(self.shape) != 2 or min(self.shape) < 1:
            raise ValueError(f"Muon needs a 2-D matrix shape, got {tuple(self.shape)}")
        split = self.qkv_split
        if split is None:
            return
        if not split or min(split) < 1:
            raise ValueError(f"qkv_split must be positive row counts, got {split}")
        if self.shape[0] % sum(split):
            raise ValueError(
                f"qkv_split {split} (sum {sum(split)}) does not divide the {self.shape[0]} rows "
                f"of a {self.shape} QKV weight"
            )

    @classmethod
    def of(cls, param: Tensor, qkv_split: Optional[Sequence[int]] = None) -> "MuonParamInfo":
        """Info for a parameter that is its whole matrix (ValueError unless 2-D).

        Args:
            param: a 2-D parameter (rows = outputs, cols = inputs).
            qkv_split: row counts of one query group's Q/K/V blocks for a fused QKV weight.

        Returns:
            The ``MuonParamInfo`` of ``param``.
        """
        if param.ndim != 2:
            raise ValueError(
                f"Muon only takes 2-D parameters, got shape {tuple(param.shape)}; put it in an "
                "AdamW group (use_muon=False) or pass its MuonParamInfo"
            )
        split = None if qkv_split is None else tuple(int(r) for r in qkv_split)
        return cls((int(param.shape[0]), int(param.shape[1])), split)


@dataclass(frozen=True)
class OrthoSpec:
    """Stage-2 settings of one param group: Newton-Schulz and the update scale."""

    steps: int
    coefficients: str | CoefficientSet | Sequence[Triple]
    precision: str
    eps: float
    scale_mode: str
    scale_factor: float
    # Newton-Schulz's form (``newton_schulz.FORMS``) where a matrix is orthogonalized whole on
    # one place (``newton_schulz``); the sharded forms (gangs, the distributed TP mode) always
    # run the standard steps (``sharded_newton_schulz``).
    form: str = "standard"
    # False: ``orthogonalize`` returns NS_k(U) unscaled, for a caller that scales it elsewhere
    # (``scale_flat_``: the DistOpt exchange returns bf16 NS output, exact, and holders scale).
    apply_scale: bool = True
    # The most bytes of matrices (in their own dtype) stacked into one batched chain.
    batch_bytes: int = DEFAULT_NS_BATCH_BYTES

    @property
    def ns(self) -> tuple:
        """``newton_schulz``'s arguments after the matrix (whole-matrix form)."""
        return (self.steps, self.coefficients, self.precision, self.eps, self.form)

    def scale(self, rows: int, cols: int) -> float:
        """The update scale ``s`` of a (block of) global shape ``rows x cols``.

        Args:
            rows: global row count (outputs).
            cols: global column count (inputs).

        Returns:
            ``SCALE_FNS[scale_mode](rows, cols) * scale_factor``.
        """
        return SCALE_FNS[self.scale_mode](rows, cols) * self.scale_factor


# ----------------------------------------------------------------------------- stage 1
def muon_momentum_(
    params: list[Tensor],
    grads: list[Tensor],
    bufs: list[Tensor],
    *,
    momentum: float,
    nesterov: bool,
    l2_weight_decay: float = 0.0,
) -> list[Tensor]:
    """Update momentum buffers in place; return the Newton-Schulz inputs U (elementwise).

    Args:
        params: the params (or shards), for L2 weight decay and the dtype.
        grads: their gradients.
        bufs: their momentum buffers, any state dtype; updated in place.
        momentum: beta.
        nesterov: U is ``g + beta * buf`` rather than ``buf``.
        l2_weight_decay: coefficient of ``p`` added to the gradient (0: off).

    Returns:
        U per param, in the param's dtype.
    """
    if not params:
        return []
    if l2_weight_decay:
        grads = torch._foreach_add(grads, params, alpha=l2_weight_decay)
    # the buffers themselves (``to`` returns the tensor where the dtype agrees) unless a
    # narrower state dtype was asked for
    work = [b.to(p.dtype) for p, b in zip(params, bufs)]
    _mul_all_(work, momentum)
    torch._foreach_add_(work, grads)  # one kernel per list where all share device and dtype
    for b, buf in zip(work, bufs):
        if b is not buf:
            buf.copy_(b)
    return list(torch._foreach_add(grads, work, alpha=momentum)) if nesterov else work


# ----------------------------------------------------------------------------- stage 2
class Orthogonalizer(Protocol):
    """Runs ``orthogonalize_matrices(..., spec)`` on whole matrices and returns results laid out
    like ``updates``; a distributed one gathers and scatters, so all collectives live there."""

    def __call__(
        self, updates: list[Tensor], infos: list[MuonParamInfo], spec: OrthoSpec
    ) -> list[Tensor]: ...


# Phase timers an orthogonalizer runs when handed Megatron's timers (``OptimizerConfig.timers``,
# a callable ``timers(name, log_level)`` returning an object with ``start()``/``stop()``):
# orthogonalizing whole matrices (Newton-Schulz, with the TP gathers of exact TP modes), and the
# DistributedOptimizer's exchange of shard pieces with their owners.
NS_TIMER = "muon-newton-schulz"
EXCHANGE_TIMER = "muon-dp-exchange"
TIMER_LOG_LEVEL = 2  # finer than Megatron's level-1 "optimizer-inner-step" they sit in


@contextlib.contextmanager
def timed(timers: Optional[Callable], name: str):
    """Time the block with ``timers(name)`` when timers are given.

    Args:
        timers: Megatron's ``timers(name, log_level)`` callable, or None.
        name: the timer's name.
    """
    if timers is None:
        yield
        return
    timer = timers(name, log_level=TIMER_LOG_LEVEL)
    timer.start()
    try:
        yield
    finally:
        timer.stop()


class LocalOrthogonalizer:
    """Single process: every update already is its whole matrix (timed as ``NS_TIMER``)."""

    def __init__(self, timers: Optional[Callable] = None) -> None:
        self.timers = timers

    def __call__(
        self, updates: list[Tensor], infos: list[MuonParamInfo], spec: OrthoSpec
    ) -> list[Tensor]:
        for u, info in zip(updates, infos):
            if tuple(u.shape) != info.shape:
                raise ValueError(
                    f"LocalOrthogonalizer needs whole matrices: tensor {tuple(u.shape)} vs "
                    f"MuonParamInfo.shape {info.shape}; sharded params need a distributed "
                    "orthogonalizer"
                )
        with timed(self.timers, NS_TIMER):
            return orthogonalize_matrices(updates, infos, spec)


def orthogonalize_matrices(
    updates: list[Tensor], infos: list[MuonParamInfo], spec: OrthoSpec
) -> list[Tensor]:
    """``s * NS_k(U)`` for each whole matrix, QKV weights block by block; the matrices and
    blocks of one shape, dtype and scale as one batched chain per ``spec.batch_bytes``.

    Args:
        updates: whole matrices U.
        infos: their ``MuonParamInfo``.
        spec: Newton-Schulz and scale settings.

    Returns:
        The scaled orthogonalized updates, laid out like ``updates``.
    """
    out: list = [None] * len(updates)
    jobs: dict[tuple, list[tuple[Tensor, Callable[[Tensor], None]]]] = {}

    def job(x: Tensor, shape: tuple[int, int], put: Callable[[Tensor], None]) -> None:
        key = (tuple(x.shape), x.dtype, spec.scale(*shape) if spec.apply_scale else None)
        jobs.setdefault(key, []).append((x, put))

    for i, (u, info) in enumerate(zip(updates, infos)):
        if info.qkv_split is None:
            job(u, info.shape, functools.partial(out.__setitem__, i))
            continue
        out[i] = torch.empty(u.shape, dtype=u.dtype, device=u.device)
        for r, starts in _qkv_heights(info.qkv_split):
            for s, block in zip(starts, _qkv_blocks(u, info, r, starts)):
                put = functools.partial(_qkv_put_, out[i], info, r, s)
                job(block, _block_shape(info, r), put)
    for (_, _, scale), xs in jobs.items():
        for chunk in batches([x.numel() * x.element_size() for x, _ in xs], spec.batch_bytes):
            orths = _batched_ns([xs[j][0] for j in chunk], spec)
            if scale is not None:  # the batch's one scale: the same product as per matrix
                orths.mul_(scale)  # after the cast back, as torch.optim.Muon (``_scale_``)
            for j, orth in zip(chunk, orths.unbind(0)):
                xs[j][1](orth)
    return out


def _batched_ns(xs: list[Tensor], spec: OrthoSpec) -> Tensor:
    """Unscaled ``NS_k`` of same-shape matrices as one (b, m, n) tensor (one chain)."""
    if len(xs) == 1:
        return newton_schulz(xs[0], *spec.ns).unsqueeze(0)
    return newton_schulz_stack(xs, *spec.ns)


def batches(sizes: list[int], budget: int) -> list[list[int]]:
    """Consecutive indices of ``sizes`` in runs of at most ``budget`` in all (one at least).

    Args:
        sizes: each item's bytes.
        budget: the most bytes of a run.

    Returns:
        The runs, in order.
    """
    runs: list[list[int]] = []
    total = budget + 1
    for i, size in enumerate(sizes):
        if total + size > budget:
            runs.append([])
            total = 0
        runs[-1].append(i)
        total += size
    return runs


def orthogonalize(u: Tensor, info: MuonParamInfo, spec: OrthoSpec) -> Tensor:
    """``s * NS_k(U)`` of one matrix, or of each Q/K/V block of a fused QKV weight, here.

    Args:
        u: the matrix, or a row shard of a fused QKV weight holding whole query groups.
        info: the global shape and QKV split.
        spec: Newton-Schulz and scale settings.

    Returns:
        The scaled orthogonalized update, shaped like ``u``.
    """
    return orthogonalize_matrices([u], [info], spec)[0]


# Unscaled Newton-Schulz of same-shape blocks as a generator of requests (``newton_schulz.
# sharded_newton_schulz_steps``) that returns the list.
BlocksSteps = Callable[[list[Tensor]], Generator[Request, None, list[Tensor]]]


def _qkv_heights(split: tuple[int, ...]) -> list[tuple[int, list[int]]]:
    """(r, first rows of the blocks r high) per distinct Q/K/V height: batched by shape."""
    starts = [sum(split[:i]) for i in range(len(split))]
    return [(r, [s for s, ri in zip(starts, split) if ri == r]) for r in dict.fromkeys(split)]


def _per_group(x: Tensor, info: MuonParamInfo) -> Tensor:
    """``x``'s rows as (query groups, rows of one group, cols): Megatron's ``[q; k; v]`` layout."""
    rows, cols = x.shape
    return x.view(rows // sum(info.qkv_split), sum(info.qkv_split), cols)


def _qkv_blocks(u: Tensor, info: MuonParamInfo, r: int, starts: list[int]) -> list[Tensor]:
    per_group = _per_group(u, info)
    return [per_group[:, s : s + r].reshape(-1, u.shape[1]) for s in starts]


def _qkv_put_(out: Tensor, info: MuonParamInfo, r: int, s: int, orth: Tensor) -> None:
    """Write the orthogonalized block ``r`` rows high from row ``s`` of each group into ``out``."""
    _per_group(out, info)[:, s : s + r] = orth.view(-1, r, out.shape[1])


def orthogonalize_sharded_steps(
    u: Tensor,
    info: MuonParamInfo,
    spec: OrthoSpec,
    dim: int,
    reassociate: bool = False,
    part: Optional[tuple[int, ...]] = None,
    gather: bool = False,
    staged: bool = False,
) -> Generator[Request, None, Tensor]:
    """This shard (along ``dim``) of ``s * NS_k(U)`` as a generator of ``SUM``/``GATHER`` requests
    (served by the TP ``distributed`` mode and gangs); a QKV shard holds whole query groups or
    whole columns: ``sharded_block_steps``' blocks run one after another.

    Args:
        u: this place's shard of U.
        info: the whole matrix's global shape and Q/K/V split.
        spec: Newton-Schulz and scale settings.
        dim: 0 for row shards, 1 for column shards.
        reassociate: use the reassociated step where it is cheaper.
        part: ``(p, k)`` (whole rows) or ``(p, k, slots)`` (pieces): split polynomials where
            ``splits_polynomial``.
        gather: (with ``part``, equal shards) gather a block where ``gathers``.
        staged: compute each Gram in chunks, each chunk's sum requested once it is computed
            (``newton_schulz.staged_gram``, ``EARLY``).

    Returns:
        This shard of ``s * NS_k(U)``, laid out like ``u``.
    """
    blocks, join = sharded_block_steps(u, info, spec, dim, reassociate, part, gather, staged)
    results = []
    for _, steps in blocks:
        results.append((yield from steps))
    return join(results)


def sharded_block_steps(
    u: Tensor,
    info: MuonParamInfo,
    spec: OrthoSpec,
    dim: int,
    reassociate: bool = False,
    part: Optional[tuple[int, ...]] = None,
    gather: bool = False,
    staged: bool = False,
) -> tuple[list[tuple[bool, Generator]], Callable[[list[Tensor]], Tensor]]:
    """``orthogonalize_sharded_steps`` as one request generator per Q/K/V block (``qkv_blocks``
    order; one for any other matrix), so a caller may run blocks apart (tp.py's stream).

    Args:
        u: as ``orthogonalize_sharded_steps``.
        info: as ``orthogonalize_sharded_steps``.
        spec: as ``orthogonalize_sharded_steps``.
        dim: as ``orthogonalize_sharded_steps``.
        reassociate: as ``orthogonalize_sharded_steps``.
        part: as ``orthogonalize_sharded_steps``.
        gather: as ``orthogonalize_sharded_steps``.
        staged: as ``orthogonalize_sharded_steps``.

    Returns:
        ``(blocks, join)``: per block whether it sums over the places (False: gathered whole,
        one gather and no sum) and its generator, which returns the block's orthogonalized,
        scaled shard; ``join`` lays the blocks' results out like ``u``.
    """

    def one(block: Tensor, shape: tuple[int, int]) -> tuple[bool, Generator]:
        g, lines, k = block.shape[1 - dim], shape[dim], part[1] if part is not None else 1
        if gather and gathers(g, lines, k):
            return False, _scaled(
                gathered_newton_schulz_steps(block, dim, part, *spec.ns), shape, spec
            )
        split = part is not None and splits_polynomial(g, lines, k, reassociate, len(part) > 2)
        ns = (spec.steps, spec.coefficients, spec.precision, spec.eps, reassociate)
        steps = sharded_newton_schulz_steps(
            block, dim, *ns, part=part if split else None, staged=staged
        )
        return True, _scaled(steps, shape, spec)

    if info.qkv_split is None:
        return [one(u, info.shape)], lambda results: results[0]
    starts = [sum(info.qkv_split[:i]) for i in range(len(info.qkv_split))]
    blocks = [
        one(_qkv_blocks(u, info, r, [s])[0], _block_shape(info, r))
        for r, s in zip(info.qkv_split, starts)
    ]

    def join(results: list[Tensor]) -> Tensor:
        out = torch.empty(u.shape, dtype=u.dtype, device=u.device)
        for r, s, orth in zip(info.qkv_split, starts, results):
            _qkv_put_(out, info, r, s, orth)
        return out

    return blocks, join


def qkv_blocks(info: MuonParamInfo) -> list[tuple[int, int]]:
    """The global shapes of the blocks orthogonalized apart: a fused QKV weight's Q, K and V
    blocks, in ``qkv_split`` order; else the matrix.

    Args:
        info: the matrix's global shape and Q/K/V split.

    Returns:
        (rows, cols) per block.
    """
    rows, cols = info.shape
    if info.qkv_split is None:
        return [(rows, cols)]
    return [_block_shape(info, r) for r in info.qkv_split]


def _scaled(steps: Generator, shape: tuple[int, int], spec: OrthoSpec) -> Generator:
    """``steps``' result scaled for a matrix (block) of global ``shape`` (``_scale_``)."""
    return _scale_((yield from steps), shape, spec)


def _scale_(x: Tensor, shape: tuple[int, int], spec: OrthoSpec) -> Tensor:
    # Scaled after the cast back to x's dtype (not folded into the bf16 polynomial) so that the
    # update rounds exactly as torch.optim.Muon's ``add_(O, alpha=-lr * s)``, up to fp32 ulps.
    return x.mul_(spec.scale(*shape)) if spec.apply_scale else x


def _block_shape(info: MuonParamInfo, rows: int) -> tuple[int, int]:
    """The global shape of the Q/K/V block with ``rows`` rows per query group (its scale's)."""
    return info.shape[0] // sum(info.qkv_split) * rows, info.shape[1]


def scale_flat_(x: Tensor, info: MuonParamInfo, start: int, cols: int, spec: OrthoSpec) -> Tensor:
    """``orthogonalize``'s scale applied in place to a flat piece of an unscaled update: the same
    elementwise product as the owner's, so bit-identical wherever it runs.

    Args:
        x: elements ``[start, start + x.numel())`` of the row-major matrix.
        info: the whole matrix's global shape and Q/K/V split.
        start: the flat position of ``x[0]`` (TP-local, ``cols`` columns).
        cols: the matrix's column count.
        spec: the scale settings.

    Returns:
        ``x``, scaled.
    """
    if info.qkv_split is None:
        return x.mul_(spec.scale(*info.shape))
    split, end = info.qkv_split, start + x.numel()
    scales = [spec.scale(*_block_shape(info, r)) for r in split]
    group = sum(split) * cols  # elements of one query group's rows
    for g in range(start // group, -(-end // group)):
        at = g * group
        for r, s in zip(split, scales):
            lo, hi = max(at, start), min(at + r * cols, end)
            if hi > lo:
                x[lo - start : hi - start].mul_(s)
            at += r * cols
    return x


# ----------------------------------------------------------------------------- stage 3
def muon_apply_(
    params: list[Tensor], updates: list[Tensor], *, lr: float, weight_decay: float
) -> None:
    """``W = W (1 - lr wd) - lr O`` in place (O already carries the scale).

    Args:
        params: the params (or shards) W.
        updates: the updates O, laid out like ``params``.
        lr: learning rate.
        weight_decay: decoupled weight decay coefficient (0: off).
    """
    if not params:
        return
    if weight_decay:
        _mul_all_(params, 1 - lr * weight_decay)
    torch._foreach_add_(params, updates, alpha=-lr)


def _mul_all_(tensors: list[Tensor], factor: float) -> None:
    """``t *= factor`` for each, as one foreach op where all are fp32 (torch's CPU foreach rounds
    the factor to a narrower dtype first: bf16 keeps the per-tensor ``mul_``)."""
    if all(t.dtype == torch.float32 for t in tensors):
        torch._foreach_mul_(tensors, factor)
        return
    for t in tensors:
        t.mul_(factor)


# ----------------------------------------------------------------------------- AdamW
def adamw_(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    steps: list[Tensor],
    *,
    foreach: Optional[bool] = None,
    **settings: float,
) -> None:
    """``torch.optim.AdamW``'s step (torch's functional Adam, decoupled decay); state narrower
    than its param is widened for it and rounded back once, one param at a time.

    Args:
        params: the params (or shards), updated in place.
        grads: their gradients.
        exp_avgs: first moments, updated in place.
        exp_avg_sqs: second moments, updated in place.
        steps: per-param step counts (CPU scalar tensors, as torch keeps them), incremented.
        foreach: torch's ``foreach`` (None: its default rule, foreach on CUDA).
        **settings: torch's ``lr``, ``beta1``, ``beta2``, ``eps``, ``weight_decay``.
    """
    grads = [g.to(p.dtype) for p, g in zip(params, grads)]
    same = [p.dtype == m.dtype == v.dtype for p, m, v in zip(params, exp_avgs, exp_avg_sqs)]
    pick = lambda xs, keep: [x for x, s in zip(xs, same) if s == keep]  # noqa: E731
    lists = (params, grads, exp_avgs, exp_avg_sqs, steps)
    if any(same):
        _torch_adamw(*(pick(xs, True) for xs in lists), foreach, settings)
    for p, g, m_state, v_state, step in zip(*(pick(xs, False) for xs in lists)):
        m, v = m_state.to(p.dtype), v_state.to(p.dtype)
        _torch_adamw([p], [g], [m], [v], [step], foreach, settings)
        m_state.copy_(m)
        v_state.copy_(v)


def _torch_adamw(params, grads, exp_avgs, exp_avg_sqs, steps, foreach, settings) -> None:
    # what torch.optim.AdamW.step calls (torch >= 2.6: AdamW is Adam with decoupled decay)
    adam(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        [],
        steps,
        foreach=foreach,
        decoupled_weight_decay=True,
        amsgrad=False,
        maximize=False,
        **settings,
    )
