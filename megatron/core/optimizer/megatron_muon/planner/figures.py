"""Counted figures of a plan for benches, logs and tests (docs/distopt_exchange.md)."""

import math
from typing import Optional

from ..config import DEFAULT_NS_BATCH_BYTES as NS_BATCH
from ..exchange import Exchange, MatrixSlot, Unit, owned_runs
from ..tp import TP_WINDOW
from .cost_model import (
    ALL,
    NS_DTYPES,
    POST,
    WAIT,
    TPCollective,
    around_gang,
    collectives,
    critical_path,
    exchange_schedule,
    lone_gangs,
    member_events,
)
from .plan import (
    MuonExchangePlan,
    owner_collectives,
    stream_trace,
    tp_collectives,
)


def with_window(plan: MuonExchangePlan, window: Optional[int]) -> MuonExchangePlan:
    """The same layout with one owner per matrix and one exchange per ``window``, to compare.

    Args:
        plan: the plan.
        window: Muon elements per exchange (1: bucket by bucket).

    Returns:
        A new plan, matrix indices kept.
    """
    return plan.rebuilt(window, None)


def exchange_ns_flops(plan: MuonExchangePlan, ex: Exchange) -> list[float]:
    """NS FLOPs each rank executes between the two all-to-alls of ``ex``.

    Args:
        plan: the plan.
        ex: one of its exchanges.

    Returns:
        FLOPs per DP rank.
    """
    flops = [0.0] * plan.world
    for i in ex.matrices:
        for unit in plan.matrices[i].units:
            flops[unit.owner] += unit.cost
    return flops


def ns_flops_per_rank(plan: MuonExchangePlan) -> list[float]:
    """NS FLOPs each DP rank executes per step, summed over the exchanges."""
    per_ex = [exchange_ns_flops(plan, ex) for ex in plan.exchanges]
    return [sum(f[r] for f in per_ex) for r in range(plan.world)]


def trace(plan: MuonExchangePlan, rank: int) -> list[tuple]:
    """What ``rank``'s main thread executes in a step (an exchange moving nothing skips its
    all-to-alls: they stay as the rank's own, no wait).

    Args:
        plan: the plan.
        rank: a DP rank.

    Returns:
        ``(matmul FLOPs before, op, members, elements)`` entries.
    """
    everyone, out = tuple(range(plan.world)), []
    for ex in plan.exchanges:
        members = everyone if ex.moves else (rank,)
        out.append((0.0, ALL, members, 0))
        out += [
            (f, op, members if op == ALL else m, n) for f, op, m, n in _schedule(plan, ex)[rank]
        ]
    return out


def _schedule(plan: MuonExchangePlan, ex: Exchange) -> list[list[tuple]]:
    """``cost_model.exchange_schedule`` of ``ex`` (every rank's), computed once per plan."""
    cache = plan.__dict__.setdefault("_schedule_cache", {})
    if id(ex) not in cache:
        at = {i: j for j, i in enumerate(ex.matrices)}
        infos = [plan.matrices[i].info for i in ex.matrices]
        units = [plan.matrices[i].units for i in ex.matrices]
        gangs = [at[i] for i in ex.gangs]
        cache[id(ex)] = exchange_schedule(infos, units, gangs, plan.world, plan.model)
    return cache[id(ex)]


def critical_path_flops(plan: MuonExchangePlan) -> float:
    """NS FLOPs on the step's critical path (the ``trace``s run); cached on the plan."""
    if "_critical" not in plan.__dict__:
        plan._critical = critical_path([trace(plan, r) for r in range(plan.world)])
    return plan._critical


def efficiency(plan: MuonExchangePlan) -> float:
    """Ideal (total / dp, the matrices' whole FLOPs) over the critical path: 1.0 = the whole
    matrices spread perfectly, 1/dp = one rank does all; above 1.0 where split blocks run fewer
    FLOPs than whole (their Grams' upper triangles alone: ``newton_schulz.upper_gram``)."""
    total = sum(m.cost for m in plan.matrices)
    return total / plan.world / critical_path_flops(plan) if plan.matrices else 1.0


def tp_schedule(
    plan: MuonExchangePlan,
    ex: Exchange,
    rank: int,
    update_dtype: str = "float32",
    model=None,
    tp_rank: int = 0,
):
    """The TP collectives DP rank ``rank``'s TP ranks issue in ``ex``, in the step's order: gang
    blocks' gathers, slices after sliced gang collectives, whole matrices' (distopt_exchange.md).

    Args:
        plan: the plan (its ``model`` gives the TP mode, sizes, steps and NS dtype).
        ex: one of its exchanges.
        rank: a DP rank.
        update_dtype: the update's dtype (DistOpt's fp32 main params).
        model: the ``NSCostModel`` to count with; None: the plan's.
        tp_rank: the TP rank (``owner`` mode: its all-to-alls depend on what it owns).

    Returns:
        (gathered, sliced, whole): three lists of ``TPCollective``.
    """
    model = plan.model if model is None else model
    ns_dtype = NS_DTYPES[model.ns_itemsize]
    owned = _owned(plan, ex).get(rank, [])
    gangs = [i for i in ex.gangs if i in owned]
    gathered = []
    for i in gangs:
        slot, tp = plan.matrices[i], model.tp_of(plan.matrices[i].info)
        if tp > 1 and model.mode == "duplicated":
            n = math.prod(slot.unit_of(rank).block.shape)
            gathered.append(TPCollective("all_gather", n, update_dtype, tp))
    sliced = []
    for _, op, _, n in _schedule(plan, ex)[rank] if gangs else []:
        sliced += around_gang(n, ns_dtype)[op == WAIT]
    whole = []
    if model.mode == "owner":
        infos = [plan.matrices[i].info for i in owned if i not in gangs]
        tp = max([model.tp_of(info) for info in infos] or [1])
        return gathered, sliced, owner_collectives(infos, tp, tp_rank, update_dtype)
    infos = [plan.matrices[i].info for i in owned_whole(plan, ex, rank, update_dtype)]
    if model.mode == "distributed":
        trace, _ = stream_trace(infos, model, ns_dtype)
        return gathered, sliced, [c for _, op, c in trace if op == POST]
    for info in infos:
        whole += tp_collectives(info, model.steps, model.mode, model.tp_of(info), ns_dtype)
    return gathered, sliced, whole


def owned_whole(plan: MuonExchangePlan, ex: Exchange, rank: int, update_dtype="float32") -> list:
    """The matrices ``rank`` owns whole in ``ex``, in the order it runs them (``owned_runs``).

    Args:
        plan: the plan.
        ex: one of its exchanges.
        rank: a DP rank.
        update_dtype: the update's dtype (its batches' bytes).

    Returns:
        Matrix indices.
    """
    owned = _owned(plan, ex).get(rank, [])
    rest = [i for i in owned if i not in set(ex.gangs)]
    itemsize = {v: k for k, v in NS_DTYPES.items()}[update_dtype]
    return [i for run in owned_runs(plan, rest, rank, itemsize, NS_BATCH) for i in run]


def _owned(plan: MuonExchangePlan, ex: Exchange) -> dict[int, list[int]]:
    """{rank: the matrices it receives pieces of in ``ex``, first-seen (its NS) order}, computed
    once per plan (one pass over the pieces, not one per rank)."""
    cache = plan.__dict__.setdefault("_owned_cache", {})
    if id(ex) not in cache:
        owned: dict[int, dict] = {}
        for p in ex.pieces:
            owned.setdefault(p.owner, {})[p.matrix] = None
        cache[id(ex)] = {r: list(m) for r, m in owned.items()}
    return cache[id(ex)]


def tp_collectives_per_step(plan: MuonExchangePlan, rank=None, tp_rank=0) -> list[TPCollective]:
    """Every TP collective DP rank ``rank``'s TP ranks issue in a step, in order (``tp_schedule``
    of each exchange).

    Args:
        plan: the plan.
        rank: a DP rank; None: the plan's rank.
        tp_rank: the TP rank (``tp_schedule``).

    Returns:
        The collectives.
    """
    rank = plan.rank if rank is None else rank
    runs = (tp_schedule(plan, ex, rank, tp_rank=tp_rank) for ex in plan.exchanges)
    return [c for three in runs for run in three for c in run]


def gang_sums(plan: MuonExchangePlan, ex: Exchange) -> list[tuple[tuple[int, ...], int]]:
    """Every collective the gangs of ``ex`` run: sums, and gathers of split polynomials.

    Args:
        plan: the plan.
        ex: one of its exchanges.

    Returns:
        (members, elements) per collective (a gather's elements: a ``cost_model.Gather``).
    """
    out = []
    lone = lone_gangs([m.units for m in plan.matrices], ex.gangs)
    for i in ex.gangs:
        unit = plan.matrices[i].units[0]
        info = plan.matrices[i].info
        events = member_events(plan.model, info, unit.axis, unit.lines, unit.part, i in lone)
        out += [(unit.members, e) for e in collectives(events)]
    return out


def sync_points(plan: MuonExchangePlan) -> int:
    """Exchanges that move anything plus gang collectives, per step."""
    moving = sum(ex.moves for ex in plan.exchanges)
    return moving + sum(len(gang_sums(plan, ex)) for ex in plan.exchanges)


def summary(plan: MuonExchangePlan, layout: str = "") -> str:
    """The plan in one line, for a log.

    Args:
        plan: the plan.
        layout: the DDP layout's name, or "" to leave it out.

    Returns:
        One line.
    """
    split = [m for m in plan.matrices if len(m.units) > 1]
    sizes = "/".join(str(k) for k in sorted({len(m.units) for m in split}))
    nodes = len(set(plan.model.nodes)) if plan.model is not None and plan.model.nodes else 0
    where = f"{plan.world} DP ranks" + (f" on {nodes} node(s)" if nodes else "")
    gangs = f"{len(split)} split over gangs of {sizes} ranks" if split else "none split"
    return (
        f"Muon exchange plan{f' ({layout} layout)' if layout else ''}: "
        f"{len(plan.matrices)} matrices, {where}, {len(plan.exchanges)} exchange(s)"
        f"{_moved(plan)}, {gangs}{_unsplittable(plan)}; NS FLOP "
        f"efficiency {efficiency(plan):.3f}{_short_of_floor(plan)}, "
        f"{sync_points(plan)} sync points per step"
    )


def _moved(plan: MuonExchangePlan) -> str:
    """How many matrices move, where each lies whole on one rank; else empty."""
    holders: dict[int, set] = {}
    for ex in plan.exchanges:
        for p in ex.pieces:
            holders.setdefault(p.matrix, set()).add(p.holder)
    if any(len(h) > 1 for h in holders.values()):
        return ""
    moved = {p.matrix for ex in plan.exchanges for p in ex.pieces if p.holder != p.owner}
    return f" ({len(moved)} matrices moved)"


def _short_of_floor(plan: MuonExchangePlan) -> str:
    """A note where the efficiency floor was out of reach; else empty."""
    floor = plan.model.min_efficiency if plan.model is not None else 0.0
    if not floor or efficiency(plan) >= floor:
        return ""
    return f" (below the floor {floor:g}, which no plan reaches: the best balanced)"


def _unsplittable(plan: MuonExchangePlan) -> str:
    """A note on TP-sharded matrices that cannot split over DP: all but in the ``duplicated``
    mode, and in the ``distributed`` mode Q/K/V and those TP shards along their short side."""
    model = plan.model
    if model is None:
        return ""
    fixed = sum(model.axis(m.info) is None for m in plan.matrices)
    if not fixed:
        return ""
    why = " (Q/K/V, or TP shards the short side)" if model.mode == "distributed" else ""
    return (
        f" ({fixed} TP-sharded cannot split in the {model.mode} TP mode{why}; "
        "--muon-tp-mode duplicated can)"
    )


def traffic(plan: MuonExchangePlan, ex: Exchange) -> tuple[list[int], list[int]]:
    """Elements each rank sends and receives in ``ex``'s forward all-to-all, self-copies
    excluded.

    Args:
        plan: the plan.
        ex: one of its exchanges.

    Returns:
        (sent, received) per DP rank.
    """
    sent, received = [0] * plan.world, [0] * plan.world
    for p in ex.pieces:
        if p.holder != p.owner:
            sent[p.holder] += p.size
            received[p.owner] += p.size
    return sent, received


def _sum_traffic(plan: MuonExchangePlan, ex: Exchange) -> list[float]:
    """Bytes each rank sends (as many received) in ``ex``'s gang collectives, ring model."""
    out = [0.0] * plan.world
    for members, n in gang_sums(plan, ex):
        for m in members:
            out[m] += sum(plan.model.ring_bytes(members, n))
    return out


def bytes_per_step(plan: MuonExchangePlan, forward_itemsize: int, return_itemsize: int, rank=None):
    """Bytes ``rank`` sends plus receives per step in the all-to-alls, self-copies excluded.

    Args:
        plan: the plan.
        forward_itemsize: bytes per element of the forward exchange.
        return_itemsize: bytes per element of the return exchange.
        rank: a DP rank; None: the plan's rank.

    Returns:
        Bytes per optimizer step.
    """
    rank = plan.rank if rank is None else rank
    moved = 0
    for ex in plan.exchanges:
        sent, received = traffic(plan, ex)
        moved += sent[rank] + received[rank]
    return moved * (forward_itemsize + return_itemsize)


def sum_bytes_per_step(plan: MuonExchangePlan, rank=None) -> float:
    """Bytes ``rank`` sends plus receives per step in its gang collectives (ring model).

    Args:
        plan: the plan.
        rank: a DP rank; None: the plan's rank.

    Returns:
        Bytes per optimizer step.
    """
    rank = plan.rank if rank is None else rank
    return 2 * sum(_sum_traffic(plan, ex)[rank] for ex in plan.exchanges)


def transient_bytes(
    plan, forward_itemsize, return_itemsize, working_set, rank=None, batch_bytes=NS_BATCH
) -> int:
    """Upper bound of the exchange's transient memory on ``rank`` (docs/distopt_exchange.md,
    "Memory").

    Args:
        plan: the plan.
        forward_itemsize: bytes per element of the forward exchange.
        return_itemsize: bytes per element of the return exchange.
        working_set: ``(slot, unit) -> bytes``, e.g. ``working_set_bytes`` bound to dtypes.
        rank: a DP rank; None: the plan's rank.
        batch_bytes: ``OrthoSpec.batch_bytes``: whole matrices run in batches of this size.

    Returns:
        Bytes, an upper bound over the step's exchanges.
    """
    rank = plan.rank if rank is None else rank
    f, r = forward_itemsize, return_itemsize
    worst = 0
    for ex in plan.exchanges:
        held = sum(p.size for p in ex.sends(rank))
        owned = sum(p.size for p in ex.receives(rank))
        mine = [(plan.matrices[i], plan.matrices[i].unit_of(rank)) for i in ex.matrices]
        sets = [(bool(u.gang), working_set(m, u)) for m, u in mine if u is not None]
        whole = [i for i in ex.matrices if (u := plan.matrices[i].unit_of(rank)) and not u.gang]
        ws = {i: working_set(plan.matrices[i], plan.matrices[i].unit_of(rank)) for i in whole}
        streamed = []
        if plan.model is not None and plan.model.mode == "distributed":  # tp.py's ``stream``
            streamed = [i for i in whole if plan.model.tp_of(plan.matrices[i].info) > 1]
            whole = [i for i in whole if i not in set(streamed)]
        runs = owned_runs(plan, whole, rank, 4, batch_bytes)  # DistOpt's fp32 main params
        runs.append(sorted(streamed, key=lambda i: -ws[i])[:TP_WINDOW])  # at most in flight
        # gang blocks are all in flight together, then whole matrices a batch at a time
        work = max(sum(b for gang, b in sets if gang), *(sum(ws[i] for i in r) for r in runs), 0)
        results = 0 if f == r else owned * r  # else written over the received pieces
        # Held parts of split matrices come back in pieces and are assembled into a copy.
        split = sum(p.size for p in ex.sends(rank) if len(plan.matrices[p.matrix].units) > 1)
        # The communication library may keep the forward send buffer until its work is
        # released (gloo and NCCL hold the tensors of a collective), so it counts throughout.
        buffers = held * f + owned * f + results
        worst = max(worst, buffers + max(work, (held + split) * r))  # NS, or the return
    return worst


def working_set_bytes(
    slot: MatrixSlot, update_itemsize: int, ns_itemsize: int, tp: int, unit: Optional[Unit] = None
) -> int:
    """Upper bound of the bytes live while one owned matrix (or gang block) is orthogonalized:
    the block, its TP gather and result, NS's copies, Gram and polynomial (fp32 in a gang).

    Args:
        slot: the matrix.
        update_itemsize: bytes per element of the update (exchange) dtype.
        ns_itemsize: bytes per element of Newton-Schulz's compute dtype.
        tp: the tensor-parallel size (> 1: the block is TP-gathered first).
        unit: the gang block owned, or None for the whole matrix.

    Returns:
        Bytes.
    """
    gang = unit is not None and bool(unit.gang)
    local = math.prod(unit.block.shape) if gang else math.prod(slot.local_shape)
    whole = math.prod(slot.info.shape) * local // math.prod(slot.local_shape)  # TP-gathered
    gathered = whole if tp > 1 else 0
    blocks = 2 * whole if slot.info.qkv_split is not None else 0
    g = _gram_side(slot, unit) if gang else min(slot.info.shape)
    return (
        (local + gathered + whole + blocks) * update_itemsize
        + 3 * whole * max(ns_itemsize, 4 if gang else 0)
        + 2 * g * g * (ns_itemsize + (4 if gang else 0))
    )


def _gram_side(slot: MatrixSlot, unit: Unit) -> int:
    """The largest Gram side of a gang block (columns of row blocks, else rows of a block)."""
    rows, cols = slot.info.shape
    if unit.axis == 0:
        return cols
    split = slot.info.qkv_split or (rows,)
    return rows // sum(split) * max(split)
