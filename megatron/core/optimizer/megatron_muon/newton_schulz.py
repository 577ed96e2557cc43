"""Newton-Schulz orthogonalization for Muon: pure functions, no process groups.

Upstream megatron-core's coefficient sets, normalization and matmul precision (the same numbers
for a setting both name); ours, opt-in: the Gram form and sharded steps that yield their sums
and gathers to the caller. Algebra, costs, numerics: docs/newton_schulz.md.
"""

import contextlib
import functools
from collections import deque
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple, Optional

import torch
from torch import Tensor

from .config import (
    DEFAULT_COEFFICIENTS,
    DEFAULT_EPS,
    DEFAULT_NS_FORM,
    DEFAULT_PRECISION,
    DEFAULT_STEPS,
)

Triple = tuple[float, float, float]


@dataclass(frozen=True)
class CoefficientSet:
    """Per-step (a, b, c) triples, and past the list either ``'cycle'`` (upstream's rule) or
    ``'repeat_last'`` (sets whose last triple is a fixed point)."""

    triples: tuple[Triple, ...]
    after: Literal["cycle", "repeat_last"] = "cycle"

    def schedule(self, steps: int) -> list[Triple]:
        """The ``steps`` triples to run."""
        n = len(self.triples)
        if self.after == "cycle":
            return [self.triples[i % n] for i in range(steps)]
        return [self.triples[min(i, n - 1)] for i in range(steps)]


# The numbers below are data: each set's triples as upstream megatron-core 0.19's
# emerging_optimizers 0.3 lists them (rounded to 4 digits), credited to their source.

# Keller Jordan, "Muon: An optimizer for hidden layers" (2024), github.com/KellerJordan/Muon:
# one triple, chosen to maximize the slope at zero; singular values end near [0.7, 1.2].
SIMPLE = CoefficientSet(((3.4445, -4.7750, 2.0315),))

# modded-nanogpt (KellerJordan/modded-nanogpt, train_gpt_medium.py; @YouJiacheng, @leloykun,
# leloykun.github.io/ponder/muon-opt-coeffs): five per-step triples that converge closer to 1 in
# the same five steps; a sixth step starts the five again.
QUINTIC = CoefficientSet(
    (
        (4.0848, -6.8946, 2.9270),
        (3.9505, -6.3029, 2.6377),
        (3.7418, -5.5913, 2.3037),
        (2.8769, -3.1427, 1.2046),
        (2.8366, -3.0525, 1.2012),
    )
)

# Polar Express, Amsel, Persson, Musco, Gower (arXiv 2505.16932), lower bound l = 1e-3, degree 5.
# The paper's safety factor 1.01 is folded into every triple but the last (a / 1.01, b / 1.01^3,
# c / 1.01^5), as its Algorithm 1 states; the input is normalized by ||X||_F alone. The last
# triple (15/8, -5/4, 3/8) is the fixed point the iteration then repeats.
POLAR_EXPRESS = CoefficientSet(
    (
        (8.2051, -22.9019, 16.4607),
        (4.0664, -2.8612, 0.5184),
        (3.9096, -2.8234, 0.5250),
        (3.2856, -2.4153, 0.4853),
        (2.2779, -1.6198, 0.3985),
        (1.8726, -1.2307, 0.3585),
        (1.8564, -1.2132, 0.3568),
        (1.8750, -1.2500, 0.3750),
    ),
    after="repeat_last",
)

# CANS, Grishina, Smirnov, Rakhuba (arXiv 2506.10935): Remez polynomials on an adaptive interval,
# generated with github.com/GrishKate/accelerating_orthogonalization (polynomials.py).
CANS = CoefficientSet(
    (
        (8.4703, -25.1081, 18.6293),
        (4.1828, -3.1087, 0.5806),
        (3.9619, -2.9541, 0.5630),
        (3.2866, -2.4647, 0.5074),
        (2.2737, -1.6447, 0.4162),
    ),
    after="repeat_last",
)

# AOL (flash-newton-schulz, github.com/thib-s/flash-newton-schulz, newton_schulz_triton.py): the
# four triples that code runs after its AOL preconditioning; here, as upstream, on X / ||X||_F.
AOL = CoefficientSet(
    (
        (4.0098, -7.0585, 2.4635),
        (3.4585, -5.5479, 2.5959),
        (2.7573, -3.2939, 1.4254),
        (2.7215, -3.0494, 1.3169),
    )
)

# DeepSeek-V4 (deepseek-ai/DeepSeek-V4-Pro, DeepSeek_V4.pdf): Keller Jordan's triple 8 times, then
# twice (2, -1.5, 0.5), whose polynomial fixes 1 with zero slope there (pulls the values to 1).
DEEPSEEK_V4 = CoefficientSet(
    ((3.4445, -4.7750, 2.0315),) * 8 + ((2.0, -1.5, 0.5),) * 2,
    after="repeat_last",
)

COEFFICIENT_SETS: dict[str, CoefficientSet] = {
    "simple": SIMPLE,
    "quintic": QUINTIC,
    "polar_express": POLAR_EXPRESS,
    "cans": CANS,
    "aol": AOL,
    "deepseekv4": DEEPSEEK_V4,
}

# Upstream's names (OptimizerConfig.muon_fp32_matmul_prec), those of
# torch.set_float32_matmul_precision, which upstream sets around Newton-Schulz: 'highest' = fp32
# matmuls, 'high' = fp32 with TF32 allowed (CUDA's TF32 tensor cores; other devices run fp32),
# 'medium' = bf16 matmuls (upstream normalizes in fp32, then casts; we cast first: _normalized).
PRECISIONS: dict[str, torch.dtype] = {
    "highest": torch.float32,
    "high": torch.float32,
    "medium": torch.bfloat16,
}


def coefficient_set(coefficients: str | CoefficientSet | Sequence[Triple]) -> CoefficientSet:
    """Resolve a set name, a ``CoefficientSet`` or (a, b, c) triples (these cycle)."""
    if isinstance(coefficients, CoefficientSet):
        return coefficients
    if isinstance(coefficients, str):
        if coefficients not in COEFFICIENT_SETS:
            raise ValueError(
                f"unknown Newton-Schulz coefficient set {coefficients!r}; "
                f"allowed: {sorted(COEFFICIENT_SETS)} or a sequence of (a, b, c) triples"
            )
        return COEFFICIENT_SETS[coefficients]
    triples = tuple(tuple(float(v) for v in t) for t in coefficients)
    if not triples or any(len(t) != 3 for t in triples):
        raise ValueError(
            f"Newton-Schulz coefficients must be (a, b, c) triples, got {coefficients}"
        )
    return CoefficientSet(triples)


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype Newton-Schulz runs its matmuls in, from a precision name."""
    if precision not in PRECISIONS:
        raise ValueError(
            f"unknown Newton-Schulz precision {precision!r}; allowed: {list(PRECISIONS)} "
            "(torch.set_float32_matmul_precision's names: fp32, fp32 with TF32 on CUDA, bf16)"
        )
    return PRECISIONS[precision]


@contextlib.contextmanager
def matmul_precision(precision: str, device: torch.device):
    """Run the block's fp32 matmuls on CUDA under ``torch.set_float32_matmul_precision``, as
    upstream does around Newton-Schulz; elsewhere, and for ``'medium'``, a no-op.

    Args:
        precision: a name in ``PRECISIONS``.
        device: the device the block's matmuls run on.
    """
    if device.type != "cuda" or precision not in ("highest", "high"):
        yield
        return
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def newton_schulz(
    x: Tensor,
    steps: int = DEFAULT_STEPS,
    coefficients: str | CoefficientSet | Sequence[Triple] = DEFAULT_COEFFICIENTS,
    precision: str = DEFAULT_PRECISION,
    eps: float = DEFAULT_EPS,
    form: str = DEFAULT_NS_FORM,
) -> Tensor:
    """Orthogonalize ``x`` of shape (..., m, n), one Frobenius norm per matrix; ``x`` unchanged.

    Args:
        x: the matrix, or a batch of matrices.
        steps: iterations k >= 1.
        coefficients: a name in ``COEFFICIENT_SETS``, a ``CoefficientSet`` or (a, b, c) triples.
        precision: a name in ``PRECISIONS``.
        eps: the Frobenius norm's floor (upstream's F.normalize).
        form: one of ``FORMS`` (``'auto'``: the Gram form where ``uses_gram``).

    Returns:
        ``NS_k(x)``, same shape and dtype as ``x``.
    """
    if x.ndim < 2:
        raise ValueError(f"Newton-Schulz needs a (..., m, n) tensor, got shape {tuple(x.shape)}")
    m, n = x.shape[-2:]
    flat = x.reshape(-1, m, n) if x.ndim > 2 else x
    buf = _normalized(flat, compute_dtype(precision), eps)
    out = _iterate_normalized(buf, steps, coefficients, precision, form)
    return out.reshape(x.shape).to(x.dtype)


def newton_schulz_stack(xs: Sequence[Tensor], *ns) -> Tensor:
    """``newton_schulz(torch.stack(xs), *ns)``, stacked straight into the compute dtype.

    Args:
        xs: same-shape, same-dtype 2-D matrices.
        *ns: ``newton_schulz``'s settings after ``x`` (steps, coefficients, precision, eps, form).

    Returns:
        ``NS_k`` of each, as one (len(xs), m, n) tensor in their dtype.
    """
    steps, coefficients, precision, eps, form = _settings(*ns)
    x = xs[0]
    buf = torch.empty((len(xs), *x.shape), dtype=compute_dtype(precision), device=x.device)
    torch.stack(xs, out=buf)  # the cast rounds as ``_normalized``'s ``copy_``
    return _iterate_normalized(_normalize_(buf, eps), steps, coefficients, precision, form).to(
        x.dtype
    )


def _settings(
    steps=DEFAULT_STEPS,
    coefficients=DEFAULT_COEFFICIENTS,
    precision=DEFAULT_PRECISION,
    eps=DEFAULT_EPS,
    form=DEFAULT_NS_FORM,
):
    return steps, coefficients, precision, eps, form


def _iterate_normalized(buf: Tensor, steps, coefficients, precision, form) -> Tensor:
    if steps < 1:
        raise ValueError(f"Newton-Schulz steps must be >= 1, got {steps}")
    schedule = coefficient_set(coefficients).schedule(steps)
    m, n = buf.shape[-2:]
    gram = uses_gram(m, n, steps, form)
    with matmul_precision(precision, buf.device):
        iterate = _gram_iterate if gram else _iterate
        return iterate(buf, schedule, tall=m > n)


# ``form``'s values: ``config.NS_FORMS`` plus ``'gram'`` (always the Gram form).
FORMS = ("standard", "gram", "auto")
# ``'auto'`` takes the Gram form where it does at most this share of the standard form's FLOPs.
# By FLOPs alone it always wins (k = 5: ``3.5 r + 25.5`` against ``20 r + 10`` in units of m^3,
# r = n / m >= 1; 29 against 30 on a square), but its m x m products run in fp32, where the
# standard form's run in bf16 ('medium'), at a lower rate on tensor-core GPUs: a near-tie is a
# loss in time. With 3/4, k = 5 takes it from n >= ~1.6 m: the MLP and K/V blocks of an 8B
# layer (3.5x, 7x, 4x), not its square Q and output projections.
GRAM_MAX_SHARE = 0.75


def standard_flops(m: int, n: int, steps: int) -> float:
    """Matmul FLOPs of the standard form on an ``m x n`` matrix: ``k (4 s^2 l + 2 s^3)``.

    Args:
        m: rows.
        n: columns.
        steps: iterations k.

    Returns:
        FLOPs (elementwise work left out).
    """
    s, l_ = min(m, n), max(m, n)
    return float(steps * (4 * s * s * l_ + 2 * s**3))


def gram_flops(m: int, n: int, steps: int) -> float:
    """Matmul FLOPs of the Gram form: ``3.5 s^2 l + (4k - 3) 1.5 s^3`` for an even ``s``.

    Args:
        m: rows.
        n: columns.
        steps: iterations k.

    Returns:
        FLOPs (an odd ``s``'s halves a little uneven: ``_sym_mm_flops``).
    """
    s, l_ = min(m, n), max(m, n)
    products = 4 * steps - 3 if steps > 1 else 1
    return float(_sym_mm_flops(s, l_) + products * _sym_mm_flops(s, s) + 2 * s * s * l_)


def _sym_mm_flops(g: int, k: int) -> int:
    """Matmul FLOPs of ``_sym_mm`` on (g, k) by (k, g): ``1.5 g^2 k`` for an even ``g``."""
    h = g // 2
    return 2 * h * k * g + 2 * (g - h) ** 2 * k


def uses_gram(m: int, n: int, steps: int, form: str) -> bool:
    """Whether ``newton_schulz(form=form)`` runs an ``m x n`` matrix in the Gram form.

    Args:
        m: rows.
        n: columns.
        steps: iterations k.
        form: one of ``FORMS``.

    Returns:
        True for ``'gram'``, and for ``'auto'`` within ``GRAM_MAX_SHARE`` of the standard FLOPs.
    """
    if form not in FORMS:
        raise ValueError(
            f"unknown Newton-Schulz form {form!r}; allowed: {list(FORMS)} ('standard': "
            "upstream's steps, 'auto': the Gram form where it does fewer FLOPs)"
        )
    if form == "auto":
        return gram_flops(m, n, steps) <= GRAM_MAX_SHARE * standard_flops(m, n, steps)
    return form == "gram"


def ns_flops(m: int, n: int, steps: int, form: str = DEFAULT_NS_FORM) -> float:
    """Matmul FLOPs ``newton_schulz(form=form)`` runs on an ``m x n`` matrix (the planner's count).

    Args:
        m: rows.
        n: columns.
        steps: iterations k.
        form: one of ``FORMS``.

    Returns:
        ``gram_flops`` or ``standard_flops``.
    """
    return gram_flops(m, n, steps) if uses_gram(m, n, steps, form) else standard_flops(m, n, steps)


def _gram_iterate(
    x: Tensor, schedule: list[Triple], tall: bool, inner: torch.dtype = torch.float32
) -> Tensor:
    """The Gram form of ``_iterate``; the ``g x g`` part in ``inner`` (fp32, no TF32: errors
    compound; docs/newton_schulz.md), ``Q_k X_0`` in ``x``'s dtype."""
    x0 = x.mT if tall else x  # the wide view: (..., g, l)
    with matmul_precision("highest", x.device):
        wide = x0.to(inner)  # bf16 is exact in fp32: bf16 products summed in fp32
        a_t = _sym_mm(wide, wide.mT)
        del wide
        q = None
        for t, (a, b, c) in enumerate(schedule):
            a2 = _sym_mm(a_t, a_t)
            poly = torch.mul(a2, c).add_(a_t, alpha=b)  # P = a I + b A + c A^2
            poly.diagonal(dim1=-2, dim2=-1).add_(a)
            q = poly if q is None else _sym_mm(poly, q)
            if t < len(schedule) - 1:
                pa = _sym_mm(a2, a_t).mul_(c).add_(a2, alpha=b).add_(a_t, alpha=a)  # P A
                a_t = _sym_mm(poly, pa)  # P A P = P (P A)
            del a2, poly
    q = q.to(x.dtype)
    return x @ q if tall else q @ x  # (Q X0^T)^T = X0 Q for the tall view


def _sym_mm(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` for a product known to be symmetric: half computed, the rest mirrored (3/4 of
    the FLOPs; exactly symmetric)."""
    g = a.shape[-2]
    h = g // 2
    out = torch.empty((*a.shape[:-1], g), dtype=a.dtype, device=a.device)
    top = out[..., :h, :]
    top.copy_(a[..., :h, :] @ b)
    out[..., h:, h:] = a[..., h:, :] @ b[..., :, h:]
    out[..., h:, :h] = top[..., :, h:].mT
    return out


def _normalized(x: Tensor, dtype: torch.dtype, eps: float) -> Tensor:
    """x / max(||x||_F, eps) per matrix in a fresh ``dtype`` buffer (``_normalize_``)."""
    return _normalize_(torch.empty(x.shape, dtype=dtype, device=x.device).copy_(x), eps)


def _normalize_(buf: Tensor, eps: float) -> Tensor:
    """buf / max(||buf||_F, eps) per matrix, in place on the input already cast to the compute
    dtype, so the result depends on the rounded input alone (docs/newton_schulz.md)."""
    norm = torch.linalg.vector_norm(buf, dim=None if buf.ndim == 2 else (-2, -1), keepdim=True)
    return buf.div_(norm.clamp_min_(eps))


def _iterate(x: Tensor, schedule: list[Triple], tall: bool) -> Tensor:
    """The polynomial steps in two ping-pong X buffers; a tall X iterates on its right Gram."""
    fma = torch.addmm if x.ndim == 2 else torch.baddbmm
    k = x.shape[-1] if tall else x.shape[-2]
    gram = torch.empty((*x.shape[:-2], k, k), dtype=x.dtype, device=x.device)
    poly = torch.empty_like(gram)
    spare = torch.empty_like(x)
    for a, b, c in schedule:
        torch.matmul(*((x.mT, x) if tall else (x, x.mT)), out=gram)
        fma(gram, gram, gram, beta=b, alpha=c, out=poly)  # b A + c A A
        fma(x, *((x, poly) if tall else (poly, x)), beta=a, out=spare)  # a X + (b A + c A A) X
        x, spare = spare, x
    return x


# What a sharded iteration asks its caller to do, in place, before it resumes
# (``sharded_newton_schulz_steps``): sum a tensor over all shards, or fill the ``Pieces`` other
# shards computed (``part``); ``EARLY``: sum it, but the iteration may resume before the sum is
# done (a staged Gram's chunk, ``staged_gram``): it is done by the next ``SUM``'s resumption.
SUM, GATHER, EARLY = "sum", "gather", "early"


class Pieces(NamedTuple):
    """A ``GATHER`` request: a flat tensor of which place ``q`` computed ``flat[ranges[q]]`` (in
    place order); the gather fills the others' ranges."""

    flat: Tensor
    ranges: list[tuple[int, int]]

    def numel(self) -> int:
        """The elements gathered (as a tensor request's)."""
        return self.flat.numel()


class Staged(NamedTuple):
    """A packed Gram computed in chunks (``staged_gram``): ``fill(j)`` writes chunk ``j`` of
    ``flat`` (``flat[ranges[j]]``), each chunk summed apart (``EARLY``, the last ``SUM``), so
    its sum may run while the next chunk is computed."""

    flat: Tensor
    ranges: list[tuple[int, int]]
    fill: Callable[[int], None]


Request = tuple[str, Tensor | Pieces]


def sharded_newton_schulz(
    x: Tensor,
    dim: int,
    reduce: Callable[[Tensor], object],
    steps: int = DEFAULT_STEPS,
    coefficients: str | CoefficientSet | Sequence[Triple] = DEFAULT_COEFFICIENTS,
    precision: str = DEFAULT_PRECISION,
    eps: float = DEFAULT_EPS,
    reassociate: bool = False,
    part: Optional[tuple[int, int, Callable[[Tensor], object]]] = None,
) -> Tensor:
    """This shard of ``NS_k(X)`` for X sharded along ``dim``: ``sharded_newton_schulz_steps`` run
    to the end, each request served at once.

    Args:
        x: this place's shard of the 2-D matrix X, any float dtype (kept).
        dim: 0 for row shards, 1 for column shards.
        reduce: sums a tensor in place over all shards.
        steps: iterations k >= 1.
        coefficients: a name in ``COEFFICIENT_SETS``, a ``CoefficientSet`` or (a, b, c) triples.
        precision: a name in ``PRECISIONS``.
        eps: the Frobenius norm's floor.
        reassociate: apply the step reassociated where ``reassociates``.
        part: ``(p, k, gather)``: compute rows ``cut(g, k)[p]`` of ``p(G)``, ``gather`` the
            rest (a ``Pieces`` of whole rows).

    Returns:
        This shard of ``NS_k(X)``, same shape and dtype as ``x``.
    """
    place = part[:2] if part is not None else None
    gather = part[2] if part is not None else None
    steps_ = sharded_newton_schulz_steps(
        x, dim, steps, coefficients, precision, eps, reassociate, place
    )
    return serve(steps_, {SUM: reduce, GATHER: gather})


def serve(steps: Generator[Request, None, Tensor], handlers: dict) -> Tensor:
    """Run a request generator to its end, serving each ``(kind, t)`` by ``handlers[kind](t)``.

    Args:
        steps: the generator.
        handlers: ``{SUM: ..., GATHER: ...}``, each in place.

    Returns:
        The generator's return value.
    """
    try:
        kind, t = next(steps)
        while True:
            handlers[SUM if kind == EARLY else kind](t)
            kind, t = steps.send(None)
    except StopIteration as done:
        return done.value


class Then(NamedTuple):
    """``interleave``'s ``wait`` returns it where a request's next collective is posted."""

    handle: object


def interleave(
    steps: Sequence[Generator], post: Callable, wait: Callable, window: Optional[int] = None
) -> list:
    """Run request generators round-robin, at most ``window`` started and unfinished at once (a
    finished one's place goes to the next, at once): each request is handed to ``post(i, kind,
    t)`` (an ``EARLY`` one as a ``SUM``), and at generator ``i``'s next turn its collectives in
    flight move on by one, newest first: ``wait`` gets each handle, and returns ``Then(handle)``
    where the request's next collective is posted (a gang sum's all-gather after its
    reduce-scatter), anything else where it is served. Generator ``i`` resumes at a turn where
    none is left, or where its last request was ``EARLY`` (then first: its next request posted,
    before the older ones move on). The posts come in one order, fixed by the generators'
    requests alone, so peers running the same list post alike (docs/gangs.md).

    Args:
        steps: the generators.
        post: starts serving request ``(kind, t)`` of generator ``i``; returns a handle.
        wait: until a handle's collective is done; returns ``Then(handle)`` of the request's
            next collective, anything else when the request is served.
        window: the most generators running together; None: all.

    Returns:
        The generators' return values, in order.
    """
    out: list = [None] * len(steps)
    later = iter(range(window or len(steps), len(steps)))
    live = deque(range(min(window or len(steps), len(steps))))
    pending: dict = {}  # i: (its collectives in flight, newest first; whether it waits for them)
    while live:
        i = live.popleft()
        handles, blocked = pending.pop(i, ([], False))
        if blocked:
            handles = _onward(handles, wait)
            if handles:
                pending[i] = handles, True
                live.append(i)
                continue
        try:
            kind, t = steps[i].send(None)
        except StopIteration as done:
            assert not handles, "a generator ended with its sums in flight"
            out[i] = done.value
            nxt = next(later, None)
            if nxt is not None:
                live.appendleft(nxt)
            continue
        handle = post(i, SUM if kind == EARLY else kind, t)
        pending[i] = [handle, *_onward(handles, wait)], kind != EARLY
        live.append(i)
    return out


def _onward(live: list, wait: Callable) -> list:
    """Each handle of ``live`` waited for, in order; the next collectives posted, in order."""
    out = []
    for handle in live:
        then = wait(handle)
        if isinstance(then, Then):
            out.append(then.handle)
    return out


def sharded_newton_schulz_steps(
    x: Tensor,
    dim: int,
    steps: int = DEFAULT_STEPS,
    coefficients: str | CoefficientSet | Sequence[Triple] = DEFAULT_COEFFICIENTS,
    precision: str = DEFAULT_PRECISION,
    eps: float = DEFAULT_EPS,
    reassociate: bool = False,
    part: Optional[tuple[int, int]] = None,
    staged: bool = False,
) -> Generator[Request, None, Tensor]:
    """``sharded_newton_schulz``'s math as a generator yielding ``(SUM, t)`` and ``(GATHER,
    pieces)`` requests to serve in place, so a caller can interleave matrices
    (docs/newton_schulz.md, "Sharded matrices").

    Args:
        x: this place's shard of the 2-D matrix X, any float dtype (kept).
        dim: 0 for row shards, 1 for column shards.
        steps: iterations k >= 1.
        coefficients: a name in ``COEFFICIENT_SETS``, a ``CoefficientSet`` or (a, b, c) triples.
        precision: a name in ``PRECISIONS``.
        eps: the Frobenius norm's floor.
        reassociate: apply the step reassociated where ``reassociates``.
        part: ``(p, k)``: compute rows ``cut(g, k)[p]`` of ``p(G)``; ``(p, k, slots)``:
            its piece ``p`` (``polynomial_rows``, laid out by ``polynomial_ranges``); then
            yield a gather of the rest.
        staged: compute each Gram in chunks (``staged_gram``) where it has several
            ``gram_chunks``, each chunk's sum requested once it is computed (``EARLY``, the
            last ``SUM``).

    Returns:
        This shard of ``NS_k(X)``, same shape and dtype as ``x``.
    """
    dtype = compute_dtype(precision)
    steps_ = _sharded_steps(x, dim, steps, coefficients, dtype, eps, reassociate, part, staged)
    return (yield from _under(steps_, precision, x.device))


def _sharded_steps(x, dim, steps, coefficients, dtype, eps, reassociate, part, staged=False):
    """``sharded_newton_schulz_steps``'s body, matmuls in ``dtype`` (its stretches run under
    the precision: ``_under``, a staged Gram's chunks too)."""
    buf = x.to(dtype, copy=True)  # cast first, as ``_normalized``
    sq = buf.float().square().sum()
    yield SUM, sq
    buf.div_(sq.sqrt().clamp_min_(eps).to(dtype))
    for a, b, c in coefficient_set(coefficients).schedule(steps):
        wide = buf.mT if dim == 0 else buf
        if staged and len(gram_chunks(wide.shape[0])) > 1:
            packed = staged_gram(wide)
            for j, (lo, hi) in enumerate(packed.ranges):
                packed.fill(j)
                yield EARLY if j + 1 < len(packed.ranges) else SUM, packed.flat[lo:hi]
            gram = unpack_staged(packed.flat, wide.shape[0], dtype)
        else:
            gram = upper_gram(wide)
            packed = pack_symmetric(gram)
            del gram
            yield SUM, packed
            gram = unpack_symmetric(packed, dtype)
        del packed, wide
        if part is not None:
            pieces = _split_polynomial(gram, b, c, *part)
            del gram
            yield GATHER, pieces
            g = buf.shape[1 - dim]
            poly = pieces.flat.view(g, g) if len(part) < 3 else _joined_polynomial(pieces, g)
            del pieces
        elif reassociate and reassociates(buf.shape[1 - dim], buf.shape[dim]):
            buf = _reassociated_step(buf, gram, dim, a, b, c)
            continue
        else:
            poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)  # b G + c G G
        buf = (
            torch.addmm(buf, buf, poly, beta=a) if dim == 0 else torch.addmm(buf, poly, buf, beta=a)
        )
    return buf.to(x.dtype)


def gathered_newton_schulz_steps(x: Tensor, dim: int, part: tuple[int, int], *ns) -> Generator:
    """This shard of ``NS_k(X)``, X whole on every place: one ``GATHER`` request fills X's rows
    (``dim`` 1: X^T's; ``Pieces``, place ``q``'s its equal row range), then ``newton_schulz``
    as on one place. Equal shards.

    Args:
        x: this place's shard of X, shard ``p`` of ``k`` along ``dim``.
        dim: 0 for row shards, 1 for column shards.
        part: ``(p, k)`` (more entries are ignored).
        *ns: ``newton_schulz``'s settings after ``x``.

    Returns:
        This shard of ``NS_k(X)``, same shape and dtype as ``x``.
    """
    (p, k), lines = part[:2], x.shape[dim]
    rows = x.new_empty((lines * k, x.shape[1 - dim]))
    rows[p * lines : (p + 1) * lines] = x if dim == 0 else x.mT
    size = lines * x.shape[1 - dim]
    yield GATHER, Pieces(rows.view(-1), [(q * size, (q + 1) * size) for q in range(k)])
    return newton_schulz(rows if dim == 0 else rows.mT, *ns).narrow(dim, p * lines, lines)


def gathers(gram_side: int, lines: int, parts: int) -> bool:
    """Whether ``parts`` places sharing a matrix along its ``lines`` (Gram side g when split)
    orthogonalize it with fewer matmul FLOPs each whole, after gathering it
    (``gathered_newton_schulz_steps``), than split (``sharded_newton_schulz_steps``, reassociated
    where it may: ``sharded_step_flops``): per step, ``ns_flops(lines, g)`` against
    ``sharded_step_flops(g, lines, parts)``. A K or V block of a GQA weight under TP is.

    Args:
        gram_side: g.
        lines: the whole matrix's size along the split dimension.
        parts: k, the number of places.

    Returns:
        Whether it is gathered.
    """
    return ns_flops(lines, gram_side, 1, "standard") <= sharded_step_flops(gram_side, lines, parts)


def sharded_step_flops(gram_side: int, lines: int, parts: int) -> int:
    """Matmul FLOPs of one step of ``sharded_newton_schulz_steps`` on one of ``parts`` equal
    shards, reassociated where it may, the polynomial split where ``splits_polynomial``: the
    Gram's upper triangle (``upper_gram_flops``), then ``2 g (P + g l)`` split (``P``: the
    largest piece, ``polynomial_piece_flops``), ``4 g^2 l`` reassociated (``reassociates``), else
    ``2 g^3 + 2 g^2 l`` (``l = lines / k``).

    Args:
        gram_side: g.
        lines: the whole matrix's size along the split dimension.
        parts: k.

    Returns:
        FLOPs.
    """
    g, local = gram_side, lines // parts
    if splits_polynomial(g, lines, parts, True):
        after = polynomial_piece_flops(g, parts) + 2 * g * g * local
    elif reassociates(g, local):
        after = 4 * g * g * local
    else:
        after = 2 * g**3 + 2 * g * g * local
    return upper_gram_flops(g, local) + after


def _under(steps: Generator, precision: str, device: torch.device) -> Generator:
    """``steps``, each stretch between requests under ``matmul_precision`` (never across one)."""
    reply = None
    while True:
        with matmul_precision(precision, device):
            try:
                request = steps.send(reply)
            except StopIteration as done:
                return done.value
        reply = yield request


# A sharded step's Gram ``W W^T`` (``W``: g x l, this shard's wide view) in blocks of rows of at
# least this many, each block from its diagonal on (an upper trapezoid; the rest is its mirror):
# ``(k + 1) / 2k`` of the whole product's FLOPs for k blocks (17/32 for a 70B MLP's g = 8192),
# each block still a large matmul (512 x l by l x >= 512).
GRAM_BLOCK_ROWS = 512


def gram_blocks(g: int) -> list[tuple[int, int]]:
    """The row blocks ``upper_gram`` computes a ``g x g`` Gram in: near-equal, at least
    ``GRAM_BLOCK_ROWS`` rows each (one block below twice that).

    Args:
        g: the Gram's side.

    Returns:
        (start, end) row ranges covering ``[0, g)`` in order.
    """
    k = max(1, g // GRAM_BLOCK_ROWS)
    return [(j * g // k, (j + 1) * g // k) for j in range(k)]


def upper_gram(wide: Tensor) -> Tensor:
    """``wide @ wide^T``'s upper triangle (diagonal included), in ``gram_blocks``: each block of
    rows from its diagonal on, one matmul each. Below the diagonal blocks nothing is written:
    only ``pack_symmetric`` reads the result.

    Args:
        wide: a ``g x l`` matrix (a view of a shard: the Gram of its rows).

    Returns:
        A new ``g x g`` matrix in ``wide``'s dtype, its upper triangle set.
    """
    g = wide.shape[0]
    out = wide.new_empty((g, g))
    for lo, hi in gram_blocks(g):
        torch.mm(wide[lo:hi], wide[lo:].mT, out=out[lo:hi, lo:])
    return out


def upper_gram_flops(g: int, lines: int) -> int:
    """Matmul FLOPs of ``upper_gram`` on a ``g x lines`` matrix: ``2 lines (hi - lo) (g - lo)``
    per block, ``(k + 1) / 2k`` of the whole product's ``2 g^2 lines`` for k equal blocks.

    Args:
        g: the Gram's side.
        lines: the shard's length along the summed dimension.

    Returns:
        FLOPs.
    """
    return sum(2 * lines * (hi - lo) * (g - lo) for lo, hi in gram_blocks(g))


# A staged Gram (a lone gang's, planner/cost_model.py's ``lone_gangs``; the ``distributed`` TP
# stream's) is computed and summed in at most this many chunks of its ``gram_blocks``, each sum
# posted as soon as its chunk is computed, so it runs under the next chunks' matmuls
# (docs/gangs.md, "Staged Gram sums").
GRAM_CHUNKS = 8


def gram_chunks(g: int) -> list[tuple[int, int]]:
    """The row ranges a staged Gram is computed and summed in: ``gram_blocks`` in at most
    ``GRAM_CHUNKS`` consecutive runs of near-equal block counts.

    Args:
        g: the Gram's side.

    Returns:
        (start, end) row ranges covering ``[0, g)`` in order, on block bounds.
    """
    blocks = gram_blocks(g)
    n = len(blocks)
    k = min(GRAM_CHUNKS, n)
    return [(blocks[j * n // k][0], blocks[(j + 1) * n // k - 1][1]) for j in range(k)]


def staged_size(g: int, lo: int, hi: int) -> int:
    """Packed elements of a staged Gram's rows ``[lo, hi)`` (on ``gram_blocks`` bounds): per
    block its diagonal square packed (``packed_size``) and its rectangle right of it; over all
    rows, ``packed_size(g)``.

    Args:
        g: the Gram's side.
        lo: the first row.
        hi: the row after the last.

    Returns:
        Elements.
    """
    return sum(packed_size(b - a) + (b - a) * (g - b) for a, b in gram_blocks(g) if lo <= a < hi)


def staged_gram_flops(g: int, lines: int, lo: int, hi: int) -> int:
    """Matmul FLOPs of a staged Gram's rows ``[lo, hi)``: ``upper_gram``'s blocks among them.

    Args:
        g: the Gram's side.
        lines: the shard's length along the summed dimension.
        lo: the first row.
        hi: the row after the last.

    Returns:
        FLOPs.
    """
    return sum(2 * lines * (b - a) * (g - a) for a, b in gram_blocks(g) if lo <= a < hi)


def staged_gram(wide: Tensor) -> Staged:
    """``wide @ wide^T``'s upper triangle, to compute in chunks (``Staged``): chunk ``j`` is
    the rows ``gram_chunks(g)[j]``, each block of them computed as ``upper_gram`` does (the
    same matmuls, the same bits) and packed (``staged_size``), in fp32 like ``pack_symmetric``.
    Its matmuls run under whatever precision holds where ``fill`` is called (in
    ``sharded_newton_schulz_steps``: ``_under``'s).

    Args:
        wide: a ``g x l`` matrix.

    Returns:
        The chunks to fill; ``unpack_staged`` reads their sums.
    """
    g = wide.shape[0]
    flat = torch.empty(packed_size(g), dtype=torch.float32, device=wide.device)
    chunks = gram_chunks(g)
    ranges, start = [], 0
    for lo, hi in chunks:
        ranges.append((start, start + staged_size(g, lo, hi)))
        start = ranges[-1][1]

    def fill(j: int) -> None:
        lo, hi = chunks[j]
        at = ranges[j][0]
        for a, b in (block for block in gram_blocks(g) if lo <= block[0] < hi):
            rows = torch.mm(wide[a:b], wide[a:].mT)
            square, rect = packed_size(b - a), (b - a) * (g - b)
            pack_symmetric(rows[:, : b - a], out=flat[at : at + square])
            flat[at + square : at + square + rect].view(b - a, g - b).copy_(rows[:, b - a :])
            at += square + rect

    return Staged(flat, ranges, fill)


def unpack_staged(flat: Tensor, g: int, dtype: torch.dtype) -> Tensor:
    """The ``g x g`` matrix ``staged_gram`` packed (summed), in ``dtype``: each element rounded
    once, as ``unpack_symmetric`` rounds it.

    Args:
        flat: the packed vector.
        g: the Gram's side.
        dtype: the result's dtype.

    Returns:
        A new ``g x g`` matrix.
    """
    out = torch.empty((g, g), dtype=dtype, device=flat.device)
    at = 0
    for a, b in gram_blocks(g):
        square, rect = packed_size(b - a), (b - a) * (g - b)
        out[a:b, a:b] = unpack_symmetric(flat[at : at + square], dtype)
        block = flat[at + square : at + square + rect].view(b - a, g - b)
        out[a:b, b:] = block
        out[b:, a:b] = block.mT
        at += square + rect
    return out


def packed_size(side: int) -> int:
    """Elements of a packed symmetric ``side x side`` matrix: ``g (g + 1) / 2``."""
    return side * (side + 1) // 2


def pack_symmetric(a: Tensor, out: Optional[Tensor] = None) -> Tensor:
    """A symmetric matrix's upper triangle as one fp32 vector (half the bytes of a Gram sum),
    new or ``out``; LAPACK's rectangular full packing (docs/newton_schulz.md). Only the upper
    triangle (diagonal included) is read: ``upper_gram`` leaves the rest unset.

    Args:
        a: the ``g x g`` matrix.
        out: an fp32 vector of ``packed_size(g)`` elements to pack into; None: a new one.

    Returns:
        The packed vector.
    """
    g = a.shape[0]
    t, s = g // 2, g - g // 2
    if out is None:
        out = torch.empty(packed_size(g), dtype=torch.float32, device=a.device)
    rect = out[: (t + 1) * s].view(t + 1, s)
    rect[:s].copy_(a[t:, t:]).triu_()  # zeroes (never multiplies) what is below: unset is fine
    rect[s:].zero_()
    rect[1:, :t].add_(a[:t, :t].mT.tril())  # the top-left block's lower half, from its upper
    out[(t + 1) * s :].view(t, s).copy_(a[:t, t:])
    return out


def unpack_symmetric(packed: Tensor, dtype: torch.dtype) -> Tensor:
    """The ``g x g`` matrix ``pack_symmetric`` packed, in ``dtype`` (one rounding per element).

    Args:
        packed: the packed vector.
        dtype: the result's dtype.

    Returns:
        A new ``g x g`` matrix.
    """
    g = round(((8 * packed.numel() + 1) ** 0.5 - 1) / 2)
    t, s = g // 2, g - g // 2
    rect = packed[: (t + 1) * s].view(t + 1, s)
    out = torch.empty((g, g), dtype=dtype, device=packed.device)
    _symmetrize(out[t:, t:], rect[:s].triu(), upper=True)
    _symmetrize(out[:t, :t], rect[1:, :t].tril(), upper=False)
    corner = packed[(t + 1) * s :].view(t, s)
    out[:t, t:].copy_(corner)
    out[t:, :t].copy_(corner.mT)
    return out


def _symmetrize(out: Tensor, half: Tensor, upper: bool) -> None:
    """``out = half + half^T`` less the doubled diagonal."""
    out.copy_(half)
    out.add_((half.triu(1) if upper else half.tril(-1)).mT)


def reassociates(gram_side: int, lines: int) -> bool:
    """Whether a shard is cheaper reassociated: ``6 g^2 l`` per step vs ``4 g^2 l + 2 g^3``.

    Args:
        gram_side: g, the side of the reduced Gram matrix.
        lines: l, the shard's size along its sharded dimension.

    Returns:
        ``lines < gram_side``.
    """
    return lines < gram_side


def splits_polynomial(
    gram_side: int, long_side: int, parts: int, reassociate: bool, pieces: bool = True
) -> bool:
    """Whether ``parts`` places sharing a Gram split its polynomial by rows (docs/newton_schulz.md);
    shared sizes only, so every place decides alike.

    Args:
        gram_side: g, the Gram matrix's side.
        long_side: L, the whole matrix's size along the split dimension.
        parts: k, the number of places.
        reassociate: whether the places may run the reassociated step instead.
        pieces: the polynomial split in pieces (``polynomial_rows``); False: in whole rows,
            ``cut(g, k)``.

    Returns:
        True where the split polynomial does fewer FLOPs on the busiest place: its largest
        piece, ``2 g P`` (``polynomial_piece_flops``; whole rows: ``2 g^2 ceil(g / k)``),
        against the reassociated step's extra ``2 g^2 ceil(L / k)``.
    """
    if parts < 2:
        return False
    lines = -(-long_side // parts)
    if not pieces:
        return not reassociate or -(-gram_side // parts) < lines
    return not reassociate or polynomial_piece_flops(gram_side, parts) < 2 * gram_side**2 * lines


@functools.lru_cache(maxsize=256)
def polynomial_rows(g: int, k: int) -> tuple[tuple[int, int], ...]:
    """The rows each of ``k`` places computes of a split ``g x g`` polynomial, each from its
    diagonal on: place ``q`` with rows ``(lo, hi)`` computes the piece ``p(G)[lo:hi, lo:]``; the
    rest is its mirror. Contiguous, in order, balanced by piece size ``(hi - lo) (g - lo)``
    (the largest as small as whole rows allow), so every place's FLOPs and bytes are near
    ``g^2 / 2k``: about 0.58 of a whole-row split's at k = 8, where the diagonal blocks are
    computed whole. A place may get no rows (``(g, g)``) where ``k > g``.

    Args:
        g: the polynomial's side.
        k: the number of places.

    Returns:
        One ``(lo, hi)`` per place.
    """
    lo, hi = -(-g * g // (2 * k)), g * g  # the least largest piece fitting all g rows
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if _fit_rows(g, k, mid) else (mid + 1, hi)
    return _fit_rows(g, k, lo)


def _fit_rows(g: int, k: int, most: int) -> Optional[tuple[tuple[int, int], ...]]:
    """``polynomial_rows`` with pieces of at most ``most`` elements (None: g rows don't fit)."""
    out, lo = [], 0
    for _ in range(k):
        hi = min(g, lo + most // (g - lo)) if lo < g else g
        out.append((lo, hi))
        lo = hi
    return tuple(out) if lo == g else None


# A split polynomial's pieces are gathered in a buffer of a multiple of this many elements, so
# that even TP slices of it (gangs.py) are equal for every TP size dividing it.
PIECES_ALIGN = 128


@functools.lru_cache(maxsize=256)
def polynomial_ranges(g: int, k: int, slots: int = 1) -> tuple[tuple[int, int], ...]:
    """Each place's range of the flat buffer a split polynomial's pieces are gathered in
    (``polynomial_rows``' pieces, row-major, in place order): ``slots`` equal slots of
    ``k / slots`` consecutive places each, their pieces back to back from the slot's start (a
    slot per TP rank whose places are its gang's: equal TP slices, gangs.py).

    Args:
        g: the polynomial's side.
        k: the number of places (a multiple of ``slots``).
        slots: the number of slots.

    Returns:
        One ``(start, end)`` per place.
    """
    sizes, per = [(hi - lo) * (g - lo) for lo, hi in polynomial_rows(g, k)], k // slots
    slot = max(sum(sizes[s * per : (s + 1) * per]) for s in range(slots))
    out = []
    for q, size in enumerate(sizes):
        start = out[-1][1] if q % per else q // per * slot
        out.append((start, start + size))
    return tuple(out)


def polynomial_size(g: int, k: int, slots: int = 1) -> int:
    """Elements of the buffer ``polynomial_ranges`` lays out: ``slots`` slots, one slot's
    size a multiple of ``PIECES_ALIGN``.

    Args:
        g: the polynomial's side.
        k: the number of places.
        slots: the number of slots.

    Returns:
        Elements.
    """
    ranges = polynomial_ranges(g, k, slots)
    if slots == 1:
        return -(-ranges[-1][1] // PIECES_ALIGN) * PIECES_ALIGN
    return slots * max(ranges[q][1] - ranges[q - q % (k // slots)][0] for q in range(k))


def polynomial_piece_flops(g: int, k: int) -> int:
    """Matmul FLOPs of the largest piece of a ``g x g`` polynomial split over ``k`` places:
    ``2 g (hi - lo) (g - lo)`` (its rows of ``G`` times ``G``'s columns from ``lo`` on).

    Args:
        g: the polynomial's side.
        k: the number of places.

    Returns:
        FLOPs.
    """
    return 2 * g * max((hi - lo) * (g - lo) for lo, hi in polynomial_rows(g, k))


def _split_polynomial(gram: Tensor, b: float, c: float, p: int, k: int, slots=None) -> Pieces:
    """Piece ``p`` of ``p(G) = b G + c G G`` (``polynomial_rows``) in a flat buffer of all, laid
    out in ``slots``; ``slots`` None: rows ``cut(g, k)[p]``, whole, in the ``g x g`` matrix."""
    g = gram.shape[0]
    if slots is None:
        rows = [(q * g // k * g, (q + 1) * g // k * g) for q in range(k)]
        poly, (lo, hi) = torch.empty_like(gram), (p * g // k, (p + 1) * g // k)
        torch.addmm(gram[lo:hi], gram[lo:hi], gram, beta=b, alpha=c, out=poly[lo:hi])
        return Pieces(poly.view(-1), rows)
    (lo, hi), ranges = polynomial_rows(g, k)[p], list(polynomial_ranges(g, k, slots))
    flat = gram.new_empty(polynomial_size(g, k, slots))
    for (_, end), (start, _) in zip(ranges, ranges[1:] + [(flat.numel(), 0)]):
        flat[end:start].zero_()  # the padding: every place gathers the same bits
    piece = flat[ranges[p][0] : ranges[p][1]].view(hi - lo, g - lo)
    torch.addmm(gram[lo:hi, lo:], gram[lo:hi], gram[:, lo:], beta=b, alpha=c, out=piece)
    return Pieces(flat, ranges)


def _joined_polynomial(pieces: Pieces, g: int) -> Tensor:
    """The ``g x g`` polynomial from its gathered pieces: each piece and its mirror."""
    poly = pieces.flat.new_empty((g, g))
    for (lo, hi), (start, end) in zip(polynomial_rows(g, len(pieces.ranges)), pieces.ranges):
        piece = pieces.flat[start:end].view(hi - lo, g - lo)
        poly[lo:hi, lo:] = piece
        poly[hi:, lo:hi] = piece[:, hi - lo :].mT
    return poly


def _reassociated_step(x: Tensor, gram: Tensor, dim: int, a: float, b: float, c: float) -> Tensor:
    """``a X + p(G) X`` as ``a X + G (b X + c G X)`` (``X p(G)`` for ``dim=0``), no third buffer."""
    if dim == 0:
        inner = torch.mm(x, gram).mul_(c).add_(x, alpha=b)
        return torch.addmm(x, inner, gram, beta=a)
    inner = torch.mm(gram, x).mul_(c).add_(x, alpha=b)
    return torch.addmm(x, gram, inner, beta=a)
