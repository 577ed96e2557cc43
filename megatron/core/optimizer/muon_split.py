"""Splitting one matrix's Newton-Schulz over a group of DP ranks: the plan side, pure arithmetic.

Past DP ~ the number of Muon matrices, one owner per matrix leaves most ranks idle while the
busiest orthogonalizes a whole fused fc1. A matrix whose NS work exceeds a *target* per rank is
therefore cut into ``k`` blocks along its long side (rows of a tall matrix, columns of a wide one
and of a fused QKV weight, whose Q/K/V blocks are wide or square), one block per member of a
*gang* of ``k`` DP ranks. Each member iterates on its block; only the squared norm and one Gram
matrix per step, ``g x g`` with ``g`` the short side, are summed over the gang
(``muon_functional.orthogonalize_sharded``, the math the ``distributed`` TP mode runs over TP).
A member of a block of ``r`` lines executes ``steps * (4 g^2 r + 2 g^3)`` matmul FLOPs in the
Gram form, whose ``2 g^3`` polynomial is not divided; where ``r < g`` it runs the reassociated
form instead (``newton_schulz.reassociates``: ``steps * 6 g^2 r``, no ``g^3`` term), so a
member's work falls with its block down to one line.

Schedule on every rank, between the two all-to-alls of an exchange: first its gangs, in the
plan's gang order (the same total order on every rank, so no two gangs wait on each other in a
circle), then its whole matrices back to back. ``critical_path`` runs that schedule: a
collective ends when its last participant arrives; the step's NS critical path is when the
return all-to-all can start.

Choice, per exchange, deterministic (same inputs -> same plan on every rank): for a few targets
(multiples of total / dp) each matrix above the target gets the smallest ``k`` whose busiest
member's work is <= the target (``split_count``); gangs are placed largest first on the least-loaded
ranks, then whole matrices by longest-processing-time greedy; ties go to the rank that already
holds most of the matrix (fewer bytes moved). The choice with the shortest critical path wins,
"no splits" included, so splitting never lengthens it.
"""

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Optional

from torch import Tensor

from .newton_schulz import reassociates

# Targets tried, in multiples of total / dp (math.inf: no split).
TARGETS = (1.0, 1.25, 1.5, 2.0, 3.0, math.inf)


@dataclass(frozen=True)
class Block:
    """Rows ``[r0, r1)`` x columns ``[c0, c1)`` of a (TP-local, row-major) matrix."""

    r0: int
    r1: int
    c0: int
    c1: int

    @property
    def shape(self) -> tuple[int, int]:
        return (self.r1 - self.r0, self.c1 - self.c0)

    def count_before(self, x: int, cols: int) -> int:
        """Elements of the block at flat positions < ``x`` of the matrix.

        Args:
            x: a flat (row-major) element position in the TP-local matrix.
            cols: the matrix's column count.

        Returns:
            How many of the block's elements lie before ``x``.
        """
        row, col = divmod(x, cols)
        full = min(max(row, self.r0), self.r1) - self.r0
        partial = min(max(col, self.c0), self.c1) - self.c0 if self.r0 <= row < self.r1 else 0
        return full * (self.c1 - self.c0) + partial

    def range_of(self, lo: int, hi: int, cols: int) -> tuple[int, int]:
        """The block's elements among flat positions ``[lo, hi)``, as a range of the block's own
        row-major order: contiguous, since a flat range cuts the block's rows only at its ends.

        Args:
            lo: first flat position of the range (e.g. a DistOpt shard's start).
            hi: end of the range, exclusive.
            cols: the matrix's column count.

        Returns:
            (start, end) in the block's own row-major element order.
        """
        return self.count_before(lo, cols), self.count_before(hi, cols)


def block_views(flat: Tensor, start: int, cols: int, block: Block) -> list[Tensor]:
    """Views of ``flat`` (flat positions ``[start, start + len)`` of a matrix with ``cols``
    columns) covering the block's elements there, in the block's row-major order.

    Args:
        flat: a 1-D piece of the matrix (e.g. this rank's DistOpt shard of it).
        start: the flat position of ``flat[0]`` in the matrix.
        cols: the matrix's column count.
        block: the block whose elements are wanted.

    Returns:
        Views (no copies) of ``flat``; empty where the piece holds none of the block.
    """
    end = start + flat.numel()
    if (block.c0, block.c1) == (0, cols):  # whole rows: one contiguous slice
        lo, hi = max(start, block.r0 * cols), min(end, block.r1 * cols)
        return [flat[lo - start : hi - start]] if hi > lo else []
    out, row = [], max(block.r0, start // cols)
    last = min(block.r1, -(-end // cols))
    while row < last:
        if row * cols >= start and (row + 1) * cols <= end:  # a run of whole rows
            n = min(last, end // cols) - row
            at = row * cols - start
            out.append(flat[at : at + n * cols].view(n, cols)[:, block.c0 : block.c1])
            row += n
            continue
        lo, hi = max(start, row * cols + block.c0), min(end, row * cols + block.c1)
        if hi > lo:
            out.append(flat[lo - start : hi - start])
        row += 1
    return out


@dataclass(frozen=True)
class Unit:
    """The part of a matrix one rank orthogonalizes: all of it, or one block of a gang."""

    owner: int
    block: Block
    cost: float  # matmul FLOPs the owner executes for it
    gang: tuple[int, ...] = ()  # the members, in block order (empty for a whole matrix)
    axis: Optional[int] = None  # None: whole; 0: row blocks; 1: column blocks
    lines: int = 0  # rows (columns) of the member's TP-gathered block

    @property
    def members(self) -> tuple[int, ...]:
        """The gang as a sorted tuple: who takes part in its sums."""
        return tuple(sorted(self.gang))


@dataclass(frozen=True)
class NSCostModel:
    """Newton-Schulz FLOPs an owner's TP rank executes, whole or as a gang member.

    ``whole(info)`` is the per-TP-rank cost of the TP mode (``muon_distopt.tp_ns_cost``); a
    matrix splits over DP only where its owner sees it whole or TP-gathered (tp == 1 or the
    ``duplicated`` mode): the blocks of the other modes are no matrix of their own.
    """

    steps: int
    whole: Callable[[object], float]
    tp_of: Callable[[object], int]
    mode: str = "duplicated"

    def axis(self, info) -> Optional[int]:
        """The axis a matrix splits along over DP (0: rows, 1: columns), None where it cannot."""
        if self.tp_of(info) > 1 and self.mode != "duplicated":
            return None
        if info.qkv_split is not None:
            return 1  # Q/K/V blocks: square or wide; a row split would need their cols^2 Gram
        rows, cols = info.shape
        return 0 if rows >= cols else 1

    def lines(self, info, local: int, axis: int) -> int:
        """Lines (rows or columns) of the TP-gathered block, from the TP-local block's.

        Args:
            info: the matrix's TP-global ``MuonParamInfo`` (with ``partition_dim``).
            local: lines of the TP-local block.
            axis: the split axis (0: rows, 1: columns).

        Returns:
            ``local`` times the TP size where TP shards along ``axis``, else ``local``.
        """
        return local * (self.tp_of(info) if info.partition_dim == axis else 1)

    def grams(self, info, axis: int) -> list[int]:
        """Gram side of each block NS runs on, in ``muon_functional.orthogonalize``'s order.

        Args:
            info: the matrix's TP-global ``MuonParamInfo``.
            axis: the split axis (0: rows, 1: columns).

        Returns:
            One Gram side (elements) per Newton-Schulz block.
        """
        if axis == 0:
            return [info.shape[1]]
        split = info.qkv_split or (info.shape[0],)
        groups = info.shape[0] // sum(split)
        return [
            groups * split[i] for r in dict.fromkeys(split) for i, s in enumerate(split) if s == r
        ]

    def member(self, info, axis: int, lines: int) -> float:
        """Matmul FLOPs of a member with ``lines`` lines: nondecreasing in ``lines``.

        Args:
            info: the matrix's TP-global ``MuonParamInfo``.
            axis: the split axis (0: rows, 1: columns).
            lines: the member's lines of the TP-gathered block.

        Returns:
            Matmul FLOPs over all ``steps``.
        """
        per_step = (2.0 * g * g * lines + sum(_after_sum(g, lines)) for g in self.grams(info, axis))
        return self.steps * sum(per_step)


def _after_sum(g: int, lines: int) -> tuple[float, ...]:
    """Matmul FLOPs of one step after the Gram sum: reassociated ``G X`` and ``G (b X + c G X)``,
    or the polynomial ``G^2`` and ``p(G) X`` (``sharded_newton_schulz``)."""
    if reassociates(g, lines):
        return (4.0 * g * g * lines,)
    return (2.0 * g**3 + 2.0 * g * g * lines,)


def member_events(model: NSCostModel, info, axis: int, lines: int) -> list:
    """What a gang member runs, in order: matmul FLOPs (floats) and gang reductions (ints: the
    elements summed); ``orthogonalize_sharded`` per NS block: norm, then per step Gram, sum,
    and the update (``_after_sum``).

    Args:
        model: the cost model (its ``steps`` and Gram sides).
        info: the matrix's TP-global ``MuonParamInfo``.
        axis: the split axis (0: rows, 1: columns).
        lines: the member's lines of the TP-gathered block.

    Returns:
        The member's events in execution order: floats are FLOPs, ints reduced elements.
    """
    out: list = []
    for g in model.grams(info, axis):
        out.append(1)  # the squared norm
        for _ in range(model.steps):
            out += [2.0 * g * g * lines, g * g, *_after_sum(g, lines)]
    return out


def split_count(model: NSCostModel, w: "Work", target: float, world: int) -> tuple[int, int]:
    """(members, axis) for matrix ``w``: 1 at or under ``target``, else the fewest members whose
    busiest (``ceil(lines / k)`` lines) works <= target, at most ``world`` and one line each
    (that many where none fits). A binary search: member work is nondecreasing in lines.

    Args:
        model: the Newton-Schulz cost model.
        w: the matrix.
        target: the most FLOPs one rank should spend on it.
        world: the DP ranks available (the most members a gang can have).

    Returns:
        (members, axis); axis is None when the matrix stays whole.
    """
    axis = model.axis(w.info) if w.cost > target and world > 1 else None
    if axis is None:
        return 1, None
    local = w.local_shape[axis]
    lo, hi = 1, max(1, min(world, local))
    while lo < hi:
        k = (lo + hi) // 2
        if model.member(w.info, axis, model.lines(w.info, -(-local // k), axis)) <= target:
            hi = k
        else:
            lo = k + 1
    return lo, axis


def cut(n: int, k: int) -> list[tuple[int, int]]:
    """``[0, n)`` in ``k`` near-equal consecutive ranges.

    Args:
        n: the length to cut.
        k: the number of ranges, >= 1.

    Returns:
        ``k`` (start, end) pairs, end exclusive, covering ``[0, n)``.
    """
    return [(j * n // k, (j + 1) * n // k) for j in range(k)]


def critical_path(
    traces: Sequence[Sequence[tuple]],
    work: Callable[[float], float] = float,
    sync: Callable[[tuple, int], float] = lambda members, n: 0.0,
) -> float:
    """When the last collective of a schedule ends. ``traces[r]``: rank r's collectives in order,
    each ``(flops before it, members, elements)``; a collective starts when its last member
    arrives (after ``work(flops)``) and lasts ``sync(members, elements)``. The k-th collective
    of a member set on one rank is the k-th on every member (they run one order).

    Args:
        traces: per rank, its collectives as (flops before it, members tuple, elements).
        work: seconds (or any time unit) that a count of FLOPs takes.
        sync: time a collective over ``members`` of ``elements`` elements takes.

    Returns:
        The time the last rank finishes its last collective.
    """
    clock, at = [0.0] * len(traces), [0] * len(traces)
    seen: list[dict] = [{} for _ in traces]
    arrived: dict[tuple, dict[int, float]] = {}
    ready = list(range(len(traces)))
    while ready:
        r = ready.pop()
        while at[r] < len(traces[r]):
            flops, members, n = traces[r][at[r]]
            key = (members, seen[r].get(members, 0))
            arrived.setdefault(key, {})[r] = clock[r] + work(flops)
            if len(arrived[key]) < len(members):
                break  # resumed by the last member to arrive
            end = max(arrived.pop(key).values()) + sync(members, n)
            for m in members:
                clock[m], at[m] = end, at[m] + 1
                seen[m][members] = seen[m].get(members, 0) + 1
            ready += [m for m in members if m != r]
    assert all(a == len(t) for a, t in zip(at, traces)), "the schedule waits in a circle"
    return max(clock, default=0.0)


@dataclass
class Work:
    """One matrix as the planner sees it."""

    info: object  # TP-global MuonParamInfo
    cost: float  # NS FLOPs of its owner when whole
    local_shape: tuple[int, int]
    held: dict[int, tuple[int, int]]  # rank: (first held element, elements held)


def assign_units(works: list[Work], world: int, model: Optional[NSCostModel], targets=TARGETS):
    """Units of each matrix and the gang order (matrix indices) of the best choice; no model:
    no splits.

    Args:
        works: the Muon matrices of one exchange, as the planner sees them.
        world: the DP group's size (ranks that can own units).
        model: the Newton-Schulz cost model, or None for whole matrices only.
        targets: per-rank FLOP targets to try, as fractions of the mean load.

    Returns:
        (units, gangs): per matrix its ``Unit`` list, and the split matrices' indices in order.
    """
    targets = targets if model is not None else (math.inf,)
    total = sum(w.cost for w in works)
    best = None
    for f in targets:
        units, gangs, span = _assign(works, world, model, f * total / max(world, 1))
        if best is None or span < best[2]:
            best = (units, gangs, span)
    return best[0], best[1]


def _assign(works: list[Work], world: int, model: NSCostModel, target: float):
    loads = [0.0] * world
    units: list = [None] * len(works)
    gangs = []
    order = sorted(range(len(works)), key=lambda i: (-works[i].cost, i))
    for i in order:
        k, axis = split_count(model, works[i], target, world)
        if k > 1:
            units[i] = _gang(works[i], k, axis, loads, model)
            gangs.append(i)
    for i in order:
        if units[i] is None:
            w = works[i]
            owner = min(range(world), key=lambda r: (loads[r], -w.held.get(r, (0, 0))[1], r))
            loads[owner] += w.cost
            units[i] = [Unit(owner, Block(0, w.local_shape[0], 0, w.local_shape[1]), w.cost)]
    return units, gangs, max(loads, default=0.0)


def _gang(w: Work, k: int, axis: int, loads: list[float], model: NSCostModel) -> list[Unit]:
    """``k`` least-loaded ranks (holders first on ties), blocks in the order the members hold
    the matrix; they all start when the last is free and end together (one sum per step)."""
    none = (math.inf, 0)
    members = sorted(range(len(loads)), key=lambda r: (loads[r], -w.held.get(r, none)[1], r))[:k]
    members.sort(key=lambda r: (w.held.get(r, none)[0], r))
    rows, cols = w.local_shape
    units = []
    for m, (a, b) in zip(members, cut(rows if axis == 0 else cols, k)):
        block = Block(a, b, 0, cols) if axis == 0 else Block(0, rows, a, b)
        lines = model.lines(w.info, b - a, axis)
        units.append(Unit(m, block, model.member(w.info, axis, lines), tuple(members), axis, lines))
    end = max(loads[m] for m in members) + max(u.cost for u in units)
    for m in members:
        loads[m] = end
    return units
