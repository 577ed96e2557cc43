"""The DistOpt Muon exchange planner: who orthogonalizes which matrix (or gang block) and what
every rank sends where. Pure arithmetic on the layout, run once at construction; the data it
fills in lives in exchange.py, its counted figures in planner/figures.py, the piece order
in docs/distopt_exchange.md.
"""

import dataclasses
import math
from typing import Optional

import torch

from ..exchange import BucketSlot, Exchange, MatrixSlot, Piece, exchange_dtypes, itemsize
from ..functional import MuonParamInfo, qkv_blocks
from ..newton_schulz import (
    compute_dtype,
    gram_chunks,
    interleave,
    ns_flops,
    packed_size,
    polynomial_ranges,
    reassociates,
    splits_polynomial,
    upper_gram_flops,
)
from ..tp import TP_WINDOW, TPOrthogonalizer, owner_cells, stream_blocks, stream_order, sums_in
from .cost_model import (
    NS_DTYPES,
    NSCostModel,
    Partial,
    PlanLinks,
    TPCollective,
    around_gang,
    chain_recorder,
    collectives,
    event_steps,
    matmul_flops,
    staged_sum,
)
from .placement import BUNDLES, TARGETS, Work, assign_units


def ns_cost(info: MuonParamInfo, steps: int, form: str = "standard") -> float:
    """Newton-Schulz matmul FLOPs for one whole matrix (per QKV block when split; ``ns_flops``).

    Args:
        info: the matrix's global shape and QKV split.
        steps: Newton-Schulz iterations.
        form: ``OrthoSpec.form``.

    Returns:
        Matmul FLOPs of all steps.
    """
    return float(sum(ns_flops(*b, steps, form) for b in qkv_blocks(info)))


def tp_ns_cost(
    info: MuonParamInfo,
    steps: int,
    mode: str,
    tp: int,
    form: str = "standard",
    gather=True,
    tp_rank=None,
) -> float:
    """NS FLOPs each TP rank of the owner executes, per TP mode (tp.py, docs/tp_modes.md).

    Args:
        info: the matrix's TP-global info (``partition_dim`` where TP-sharded).
        steps: Newton-Schulz iterations.
        mode: "duplicated", "blockwise" or "distributed".
        tp: the tensor-parallel size.
        form: ``OrthoSpec.form`` for whole matrices (distributed runs the standard steps).
        gather: ``distributed_events``' (False: upstream's distributed mode).
        tp_rank: ``distributed_events``' (None: the busiest TP rank).

    Returns:
        Matmul FLOPs of all steps on one TP rank.
    """
    dim = getattr(info, "partition_dim", None)
    if tp == 1 or dim is None or mode == "duplicated":
        return ns_cost(info, steps, form)
    if mode == "owner":  # one TP rank runs it whole: on average 1/tp per TP rank
        return ns_cost(info, steps, form) / tp
    if mode == "blockwise":
        shape = list(info.shape)
        shape[dim] //= tp
        return ns_cost(MuonParamInfo(tuple(shape), info.qkv_split), steps, form)
    return matmul_flops(distributed_events(info, steps, tp, gather=gather, tp_rank=tp_rank))


def tp_collectives(
    info: MuonParamInfo,
    steps: int,
    mode: str,
    tp: int,
    ns_dtype: str = "bfloat16",
    update_dtype: str = "float32",
    gather: bool = True,
) -> list[TPCollective]:
    """The TP collectives one TP rank issues, in order, to orthogonalize one whole matrix
    (``TPOrthogonalizer.__call__``: tp.py; each mode's list: docs/tp_modes.md).

    Args:
        info: the matrix's TP-global info (``partition_dim`` where TP-sharded).
        steps: Newton-Schulz iterations.
        mode: "duplicated", "blockwise" or "distributed".
        tp: the tensor-parallel size.
        ns_dtype: Newton-Schulz's compute dtype (the polynomial's rows move in it).
        update_dtype: the update's dtype (DistOpt's fp32 main params).
        gather: ``distributed_events``'.

    Returns:
        The collectives, in the order the step issues them.
    """
    dim = getattr(info, "partition_dim", None)
    if tp == 1 or dim is None or mode == "blockwise":
        return []
    if mode == "duplicated":
        return [TPCollective("all_gather", math.prod(info.shape) // tp, update_dtype, tp)]
    return collectives(distributed_events(info, steps, tp, ns_dtype, update_dtype, gather))


def distributed_events(
    info: MuonParamInfo,
    steps: int,
    tp: int,
    ns_dtype="bfloat16",
    update_dtype="float32",
    gather=True,
    tp_rank=None,
) -> list:
    """What one TP rank runs to orthogonalize one TP-sharded matrix in the ``distributed`` mode
    (tp.py's ``_Streamed``), block after block: matmul FLOPs (floats) and ``TPCollective``.

    Args:
        info: the matrix's TP-global info (``partition_dim`` set).
        steps: Newton-Schulz iterations.
        tp: the tensor-parallel size.
        ns_dtype: Newton-Schulz's compute dtype (the polynomial's rows move in it).
        update_dtype: the update's dtype (a gathered block moves in it).
        gather: gather the blocks ``gathers`` (False: split every block, as upstream's mode).
        tp_rank: the TP rank whose polynomial pieces are counted; None: the largest.

    Returns:
        The events.
    """
    args = (steps, tp, ns_dtype, update_dtype, gather, tp_rank)
    return [e for block in distributed_block_events(info, *args) for e in block]


def distributed_block_events(
    info: MuonParamInfo, steps: int, tp: int, ns_dtype, update_dtype, gather, tp_rank
) -> list[list]:
    """``distributed_events`` per block (``functional.qkv_blocks``), as tp.py's stream runs
    them (``stream_order``).

    Args:
        info: as ``distributed_events``.
        steps: as ``distributed_events``.
        tp: as ``distributed_events``.
        ns_dtype: as ``distributed_events``.
        update_dtype: as ``distributed_events``.
        gather: as ``distributed_events``.
        tp_rank: as ``distributed_events``.

    Returns:
        One list of events per block.
    """
    out = []
    for g, lines, whole in stream_blocks(info, tp):
        local = lines // tp
        if gather and whole:  # whole on every TP rank
            gathered = TPCollective("all_gather_into_tensor", local * g, update_dtype, tp)
            out.append([gathered, float(ns_flops(g, lines, steps, "standard"))])
            continue
        block = [TPCollective("all_reduce", 1, "float32", tp)]  # the squared norm
        for _ in range(steps):
            block += _distributed_step(g, lines, tp, ns_dtype, gather, tp_rank)
        out.append(block)
    return out


def _distributed_step(g: int, lines: int, tp: int, ns_dtype: str, ours: bool, tp_rank=None) -> list:
    """One Newton-Schulz step of a split block on one TP rank: ours (tp.py's ``_Streamed``)
    computes the Gram's upper triangle (``upper_gram``), sums it in the NS dtype where
    ``tp.sums_in`` (the partials exchanged, the sums gathered: ``around_gang``'s two TP
    collectives of a partial sum), splits the polynomial in pieces (``polynomial_rows``) and
    reassociates where that does fewer FLOPs (``sharded_step_flops``: no gather); upstream's
    whole Gram, one fp32 all-reduce, polynomial always split in whole rows."""
    local, rows = lines // tp, -(-g // tp)
    split = splits_polynomial(g, lines, tp, ours)
    if ours and len(gram_chunks(g)) > 1:  # newton_schulz.staged_gram: its chunks summed EARLY
        out: list = [staged_sum(g, local, lambda n: _tp_sum(n, tp, ns_dtype, ours))]
    else:
        gram = upper_gram_flops(g, local) if ours else 2 * local * g * g
        out = [float(gram), *_tp_sum(packed_size(g), tp, ns_dtype, ours)]
    if split and ours:  # its piece of b G + c G G, the pieces gathered (padded to the largest)
        sizes = [end - start for start, end in polynomial_ranges(g, tp)]
        piece = max(sizes)
        out.append(2.0 * g * (piece if tp_rank is None else sizes[tp_rank]))
        out.append(TPCollective("all_gather_into_tensor", piece, ns_dtype, tp))
        return out + [2.0 * local * g * g]  # a X + p(G) X
    if split:  # upstream's: whole rows
        out.append(2.0 * g * g * rows)
        out.append(TPCollective("all_gather_into_tensor", rows * g, ns_dtype, tp))
        return out + [2.0 * local * g * g]
    assert reassociates(g, local), "a block with fewer lines than its Gram side splits"
    return out + [4.0 * local * g * g]  # reassociated: a X + G (b X + c G X)


def _tp_sum(n: int, tp: int, ns_dtype: str, ours: bool) -> tuple:
    """The TP collectives of a packed Gram's sum of ``n`` elements in the stream: ours in the NS
    dtype where ``tp.sums_in`` (the partials exchanged, the sums gathered: ``around_gang``'s two
    TP collectives of a partial sum), else one fp32 all-reduce."""
    if ours and sums_in(n, tp, getattr(torch, ns_dtype)):
        return tuple(c for side in around_gang(Partial(n, tp), ns_dtype) for c in side)
    return (TPCollective("all_reduce", n, "float32", tp),)


def stream_trace(infos: list, model, ns_dtype: str = "bfloat16") -> tuple[list, float]:
    """The ``distributed`` mode's main-thread trace of an owner's whole matrices as tp.py's
    ``stream`` runs them: TP-sharded ones ``TP_WINDOW`` at a time, interleaved by the same
    ``interleave``, dense then expert; then the others.

    Args:
        infos: the matrices' TP-global infos, in the order the owner runs them.
        model: the ``NSCostModel`` (``steps``, ``tp_of``, ``whole``).
        ns_dtype: Newton-Schulz's compute dtype.

    Returns:
        ``(FLOPs before, POST or WAIT, TPCollective)`` entries, and the FLOPs after the last.
    """
    trace: list = []
    clock = [0.0]  # FLOPs run since the last entry
    post, wait = chain_recorder(trace, clock, lambda f, op, c: (f, op, c))
    for expert in (False, True):
        sharded = [
            info
            for info in infos
            if model.tp_of(info) > 1 and bool(getattr(info, "expert", False)) == expert
        ]
        blocks = [
            distributed_block_events(
                i, model.steps, model.tp_of(i), ns_dtype, "float32", True, model.tp_rank
            )
            for i in sharded
        ]
        order = stream_order(sharded, model.tp_of(sharded[0])) if sharded else []
        steps = [event_steps(blocks[m][b], clock) for m, b in order]
        interleave(steps, post, wait, TP_WINDOW)
    return trace, clock[0] + sum(model.whole(i) for i in infos if model.tp_of(i) == 1)


def owner_stream(infos: list, model) -> tuple[list, float]:
    """``stream_trace`` in the model's NS dtype: the ``distributed`` mode's
    ``NSCostModel.stream``.

    Args:
        infos: an owner's TP-sharded whole matrices (TP-global infos), in the order it runs them.
        model: the ``NSCostModel``.

    Returns:
        As ``stream_trace``.
    """
    return stream_trace(infos, model, NS_DTYPES[model.ns_itemsize])


def owner_collectives(infos: list, tp: int, t: int, dtype: str = "float32") -> list[TPCollective]:
    """The two ``all_to_all_single`` TP rank ``t`` issues in one ``owner``-mode call (no replicas).

    Args:
        infos: the call's TP-global infos (its unsharded matrices move nothing).
        tp: the tensor-parallel size.
        t: the TP rank.
        dtype: the updates' dtype (DistOpt's fp32 main params).

    Returns:
        The collectives, forward then return (none where nothing is TP-sharded).
    """
    out = []
    for expert in (False, True):  # one call per (expert) TP group: tp.py's ``_owned``
        sharded = [i for i in infos if i.partition_dim is not None and i.expert == expert]
        if tp == 1 or not sharded:
            continue
        local = [math.prod(i.shape) // tp for i in sharded]
        own = sum(n for n, c in zip(local, owner_cells(sharded, tp)) if c == t)
        other, total = (tp - 1) * own, sum(local)
        out.append(TPCollective("all_to_all_single", total, dtype, tp, total - own + other))
        out.append(TPCollective("all_to_all_single", tp * own, dtype, tp, other + total - own))
    return out


def piece(slot: MatrixSlot, rank: int, shard_size: int) -> tuple[int, int]:
    """The part of ``slot`` (bucket-relative range) that DP rank ``rank`` holds; may be empty.

    Args:
        slot: the matrix.
        rank: a DP rank of the bucket's group.
        shard_size: elements of the bucket each DP rank holds.

    Returns:
        (lo, hi), end exclusive; ``hi <= lo`` when empty.
    """
    return max(slot.start, rank * shard_size), min(slot.end, (rank + 1) * shard_size)


def _holders(slot: MatrixSlot, shard_size: int) -> range:
    return range(slot.start // shard_size, (slot.end - 1) // shard_size + 1)


def _group_exchanges(buckets: list[BucketSlot], matrices, window: Optional[int]) -> list[Exchange]:
    """Buckets -> exchanges: one per DP group, or runs of a group's buckets of >= ``window``
    Muon elements each."""
    by_group: dict[int, list[int]] = {}
    for b, bucket in enumerate(buckets):
        if bucket.matrices:
            by_group.setdefault(id(bucket.group), []).append(b)
    out = []
    for ids in by_group.values():
        run, size = [], 0
        for b in ids:
            run.append(b)
            size += sum(matrices[i].end - matrices[i].start for i in buckets[b].matrices)
            if window is not None and size >= window:
                out.append(run)
                run, size = [], 0
        if run:
            out.append(run)
    return [
        Exchange(buckets[r[0]].group, r, [i for b in r for i in buckets[b].matrices]) for r in out
    ]


class MuonExchangePlan:
    """Who orthogonalizes which matrix (or block) and what every rank sends where; built once,
    used every step. A pure function of the layout (also bench/projection.py's); without ``model``
    every matrix has one owner, with it matrices may split over gangs (docs/gangs.md)."""

    def __init__(
        self,
        buckets: list[BucketSlot],
        matrices: list[MatrixSlot],
        rank: int,
        world: int,
        window: Optional[int] = None,
        model: Optional[NSCostModel] = None,
        targets: tuple[float, ...] = TARGETS,
        bundles: tuple[int, ...] = BUNDLES,
    ):
        self.buckets, self.matrices, self.rank, self.world = buckets, matrices, rank, world
        self.model, self.targets = model, targets
        self.exchanges = _group_exchanges(buckets, matrices, window)
        for ex in self.exchanges:
            works = [self._work(matrices[i]) for i in ex.matrices]
            units, gangs = assign_units(works, world, model, targets, bundles)
            for i, matrix_units in zip(ex.matrices, units):
                matrices[i].units = matrix_units
            ex.gangs = [ex.matrices[j] for j in gangs]
            ex.pieces = sorted(self._pieces(ex), key=lambda p: p.key)

    def _work(self, slot: MatrixSlot) -> Work:
        shard = self.buckets[slot.bucket].shard_size
        held = {}
        for r in _holders(slot, shard):
            lo, hi = piece(slot, r, shard)
            held[r] = (lo - slot.start, hi - lo)  # (first held element, elements held)
        return Work(slot.info, slot.cost, slot.local_shape, held)

    def _pieces(self, ex: Exchange):
        for i in ex.matrices:
            slot = self.matrices[i]
            shard, cols = self.buckets[slot.bucket].shard_size, slot.local_shape[1]
            for holder in _holders(slot, shard):
                lo, hi = piece(slot, holder, shard)
                for unit in slot.units:
                    blo, bhi = unit.block.range_of(lo - slot.start, hi - slot.start, cols)
                    if bhi > blo:
                        yield Piece(i, holder, unit.owner, blo, bhi)

    def rebuilt(
        self, window=None, model: Optional[NSCostModel] = None, targets=TARGETS, bundles=BUNDLES
    ):
        """The same layout planned again with other settings; this plan is unchanged.

        Args:
            window: Muon elements per exchange; None: one per group.
            model: the Newton-Schulz cost model; None: no splits.
            targets: per-rank FLOP targets to try, as fractions of the mean load.
            bundles: the most matrices a disjoint gang may hold, one candidate each.

        Returns:
            A new plan.
        """
        matrices = [dataclasses.replace(m, units=[]) for m in self.matrices]
        args = (self.rank, self.world, window, model, targets, bundles)
        return MuonExchangePlan(self.buckets, matrices, *args)


def ns_cost_model(
    inner, steps: int, ns_itemsize: int = 4, exchange_itemsizes: int = 8, form: str = "standard"
):
    """NS FLOPs an owner's TP rank executes, per the inner orthogonalizer's TP mode.

    Args:
        inner: Muon's orthogonalizer before ``attach`` wraps it.
        steps: Newton-Schulz iterations.
        ns_itemsize: bytes per element of Newton-Schulz's compute dtype.
        exchange_itemsizes: bytes per element of the forward plus the return exchange.
        form: ``OrthoSpec.form``, counted for whole matrices (gang blocks run the standard steps).

    Returns:
        The ``NSCostModel`` the planner splits matrices with.
    """
    sizes = dict(ns_itemsize=ns_itemsize, exchange_itemsizes=exchange_itemsizes)
    if not isinstance(inner, TPOrthogonalizer):
        whole = lambda info: ns_cost(info, steps, form)  # noqa: E731
        return NSCostModel(steps, whole, lambda info: 1, **sizes)

    def tp_of(info) -> int:
        group = inner._group(info)
        return group.size() if group is not None else 1

    whole = lambda info: tp_ns_cost(info, steps, inner.mode, tp_of(info), form)  # noqa: E731
    stream = owner_stream if inner.mode == "distributed" else None
    return NSCostModel(steps, whole, tp_of, inner.mode, stream=stream, **sizes)


def exchange_cost_model(muon, exchange_dtype: str, links: PlanLinks, where: str) -> tuple:
    """The cost model an exchange of ``muon``'s matrices plans with, and Newton-Schulz's dtype.

    Args:
        muon: the ``Muon`` whose orthogonalizer the exchange will wrap.
        exchange_dtype: a name in ``exchange.DTYPES``.
        links: the machine the planner assumes.
        where: the setting, for the error (``"with use_distributed_optimizer"``).

    Returns:
        (``NSCostModel`` with the links' costs, NS's compute dtype).
    """
    specs = muon.ortho_specs()
    if len(specs) > 1:
        raise ValueError(
            f"{where} all Muon param groups must share the Newton-Schulz and scale settings "
            f"(one owner runs each matrix); got {len(specs)} different ones"
        )
    steps = specs[0].steps if specs else 0
    form = specs[0].form if specs else "standard"
    ns_dtype = compute_dtype(specs[0].precision) if specs else torch.float32
    forward, back, _ = exchange_dtypes(exchange_dtype, ns_dtype, torch.float32)
    sizes = (itemsize(ns_dtype), itemsize(forward) + itemsize(back))
    model = dataclasses.replace(
        ns_cost_model(muon.orthogonalizer, steps, *sizes, form=form),
        **links.link_costs(),
        min_efficiency=links.min_efficiency or 0.0,
    )
    return model, ns_dtype
