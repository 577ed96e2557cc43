"""The DistOpt Muon exchange plan: who orthogonalizes which matrix (or gang block), what every
rank sends where, and the counted figures of that schedule. Pure arithmetic on the layout (no
collectives, no tensors); the piece order both sides of a link agree on, and what each figure
counts: docs/distopt_exchange.md.
"""

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Optional

from .muon_functional import MuonParamInfo
from .muon_placement import BUNDLES, TARGETS, Work, assign_units
from .muon_split import (
    ALL,
    NSCostModel,
    Unit,
    critical_path,
    exchange_schedule,
    member_events,
)
from .newton_schulz import ns_flops, splits_polynomial


@dataclass
class MatrixSlot:
    """A Muon matrix as the DistributedOptimizer lays it out: a range of one bucket."""

    name: str
    bucket: int  # index into MuonExchangePlan.buckets
    start: int  # element range within the bucket
    end: int
    local_shape: tuple[int, int]  # TP-local shape, as stored
    info: MuonParamInfo  # TP-global shape and QKV split: what the math needs
    cost: float  # Newton-Schulz FLOPs its owner executes when whole (per TP rank)
    units: list[Unit] = field(default_factory=list)  # one owner, or one block per gang member

    @property
    def owner(self) -> int:
        """The owner of a whole matrix; -1 for one split over a gang."""
        return self.units[0].owner if len(self.units) == 1 else -1

    def unit_of(self, rank: int) -> Optional[Unit]:
        """The unit DP rank ``rank`` orthogonalizes of this matrix; None if it owns none."""
        return next((u for u in self.units if u.owner == rank), None)


@dataclass
class BucketSlot:
    """One DP-sharded bucket: its DP group (None in a projection) and its Muon matrices."""

    group: object
    shard_size: int
    matrices: list[int] = field(default_factory=list)  # in bucket order


@dataclass(frozen=True)
class Piece:
    """The part ``[lo, hi)`` of a flattened matrix that DP rank ``holder`` holds."""

    matrix: int
    holder: int
    owner: int
    lo: int
    hi: int

    @property
    def key(self) -> tuple[int, int, int]:
        """THE order of every exchange: senders group by destination, receivers by source."""
        return (self.owner, self.holder, self.matrix)

    @property
    def size(self) -> int:
        return self.hi - self.lo


@dataclass
class Exchange:
    """One DP-wide sync point: a forward and a return ``all_to_all`` around owners' NS."""

    group: object
    buckets: list[int]
    matrices: list[int]
    pieces: list[Piece] = field(default_factory=list)  # sorted by Piece.key
    gangs: list[int] = field(default_factory=list)  # split matrices, in the order all run them

    def sends(self, rank: int) -> list[Piece]:
        """The pieces DP rank ``rank`` holds (sends to their owners, self-copies included)."""
        return [p for p in self.pieces if p.holder == rank]

    def receives(self, rank: int) -> list[Piece]:
        """The pieces DP rank ``rank`` owns (receives from their holders, its own included)."""
        return [p for p in self.pieces if p.owner == rank]

    def split_sizes(self, rank: int, world: int) -> tuple[list[int], list[int]]:
        """Forward (send, receive) elements per peer; the return exchange swaps them.

        Args:
            rank: this rank's index in the exchange's DP group.
            world: the DP group's size.

        Returns:
            (send, receive): ``world`` element counts each, as ``all_to_all`` split sizes.
        """
        send, recv = [0] * world, [0] * world
        for p in self.pieces:
            if p.holder == rank:
                send[p.owner] += p.size
            if p.owner == rank:
                recv[p.holder] += p.size
        return send, recv


def ns_cost(info: MuonParamInfo, steps: int, form: str = "standard") -> float:
    """Newton-Schulz matmul FLOPs for one whole matrix (per QKV block when split).

    ``newton_schulz.ns_flops``: standard steps ``X X^T`` (2 s^2 l), ``A A`` (2 s^3) and
    ``B X`` (2 s^2 l) each, s = min(m, n), l = max(m, n), or the Gram form's count where
    ``form`` runs it; elementwise work is left out.

    Args:
        info: the matrix's global shape and QKV split.
        steps: Newton-Schulz iterations.
        form: Newton-Schulz's form (``OrthoSpec.form``) for a matrix orthogonalized whole.

    Returns:
        Matmul FLOPs of all steps.
    """
    return float(sum(ns_flops(*b, steps, form) for b in _blocks(info)))


def _blocks(info: MuonParamInfo) -> list[tuple[int, int]]:
    rows, cols = info.shape
    if info.qkv_split is None:
        return [(rows, cols)]
    groups = rows // sum(info.qkv_split)
    return [(groups * r, cols) for r in info.qkv_split]


def tp_ns_cost(
    info: MuonParamInfo, steps: int, mode: str, tp: int, form: str = "standard"
) -> float:
    """NS FLOPs each TP rank of the owner executes, per TP mode (``muon_tp.py``).

    duplicated: the whole matrix on every TP rank; blockwise: the TP-local slice; distributed:
    the own row (column) shard with the n x n (m x m) Gram matrix and ``ceil(n / tp)`` rows of
    its polynomial (``newton_schulz.splits_polynomial``), ``4 r n^2 + 2 n^2 ceil(n / tp)`` per
    step.

    Args:
        info: the matrix's TP-global info (``partition_dim`` where TP-sharded).
        steps: Newton-Schulz iterations.
        mode: the TP mode, "duplicated", "blockwise" or "distributed".
        tp: the tensor-parallel size.
        form: Newton-Schulz's form where a rank orthogonalizes a whole matrix (duplicated,
            blockwise); the distributed mode's sharded steps are the standard ones.

    Returns:
        Matmul FLOPs of all steps on one TP rank.
    """
    dim = getattr(info, "partition_dim", None)
    if tp == 1 or dim is None or mode == "duplicated":
        return ns_cost(info, steps, form)
    if mode == "blockwise":
        shape = list(info.shape)
        shape[dim] //= tp
        return ns_cost(MuonParamInfo(tuple(shape), info.qkv_split), steps, form)
    total = 0.0
    for rows, cols in _blocks(info):
        split, whole = (rows // tp, cols) if dim == 0 else (cols // tp, rows)
        # The polynomial split over TP (``muon_tp``): the busiest rank's ceil(g / tp) rows.
        poly = -(-whole // tp) if splits_polynomial(whole, split * tp, tp, False) else whole
        total += steps * (4 * split * whole**2 + 2 * whole**2 * poly)
    return total


def piece(slot: MatrixSlot, rank: int, shard_size: int) -> tuple[int, int]:
    """The part of ``slot`` (bucket-relative range) that DP rank ``rank`` holds; may be empty.

    Args:
        slot: the matrix.
        rank: a DP rank of the bucket's group.
        shard_size: elements of the bucket each DP rank holds.

    Returns:
        (lo, hi) bucket-relative, end exclusive; ``hi <= lo`` when empty.
    """
    return max(slot.start, rank * shard_size), min(slot.end, (rank + 1) * shard_size)


def _holders(slot: MatrixSlot, shard_size: int) -> range:
    return range(slot.start // shard_size, (slot.end - 1) // shard_size + 1)


def group_exchanges(buckets: list[BucketSlot], matrices, window: Optional[int]) -> list[Exchange]:
    """Buckets -> exchanges: one per DP group, or (``window``) consecutive buckets of a group
    holding at least ``window`` Muon elements each (``window=1``: one per bucket).

    Args:
        buckets: every DP-sharded bucket, in buffer order.
        matrices: the Muon ``MatrixSlot``s the buckets' ``matrices`` index.
        window: Muon elements per exchange, or None for one exchange per DP group.

    Returns:
        The exchanges (pieces and gangs not yet filled), in bucket order.
    """
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
    used every step.

    A pure function of the layout (no collectives): the optimizer builds it from DistOpt's range
    maps, ``bench/projection.py`` from Megatron's bucket rule at any DP size. ``model`` (the NS
    cost of whole matrices and gang members) lets matrices split over gangs (``muon_split``);
    without it every matrix has one owner.
    """

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
        self.exchanges = group_exchanges(buckets, matrices, window)
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

    def with_window(self, window: Optional[int]) -> "MuonExchangePlan":
        """The same layout under a former schedule: one owner per matrix (no gangs), one
        exchange per ``window`` (see ``group_exchanges``; 1: bucket by bucket). Matrix indices
        are kept, so ``ShardInfo``s stay valid."""
        return self.rebuilt(window, None)

    def rebuilt(
        self, window=None, model: Optional[NSCostModel] = None, targets=TARGETS, bundles=BUNDLES
    ):
        """The same layout planned again: another window, ``model=None`` (no splits), another
        model (e.g. another link cost) or other candidates (``muon_placement.assign_units``).

        Args:
            window: Muon elements per exchange (see ``group_exchanges``); None: one per group.
            model: the Newton-Schulz cost model; None: no splits.
            targets: per-rank FLOP targets to try, as fractions of the mean load.
            bundles: the most matrices a disjoint gang may hold, one candidate each.

        Returns:
            A new plan; this one is left unchanged.
        """
        matrices = [dataclasses.replace(m, units=[]) for m in self.matrices]
        args = (self.rank, self.world, window, model, targets, bundles)
        return MuonExchangePlan(self.buckets, matrices, *args)

    # ---------------------------------------------------------------- counted figures
    def ns_flops(self, ex: Exchange) -> list[float]:
        """NS FLOPs each rank executes between the two all-to-alls of ``ex``."""
        flops = [0.0] * self.world
        for i in ex.matrices:
            for unit in self.matrices[i].units:
                flops[unit.owner] += unit.cost
        return flops

    def ns_flops_per_rank(self) -> list[float]:
        """NS FLOPs each DP rank executes per step, summed over the exchanges."""
        per_ex = [self.ns_flops(ex) for ex in self.exchanges]
        return [sum(f[r] for f in per_ex) for r in range(self.world)]

    def trace(self, rank: int) -> list[tuple]:
        """What ``rank``'s main thread executes in a step, as ``(matmul FLOPs before, op,
        members, elements)`` entries (``muon_split.exchange_schedule``): per exchange the forward
        all-to-all, the posts of its gang collectives and the waits for them, then its whole
        matrices and the return all-to-all."""
        everyone, out = tuple(range(self.world)), []
        for ex in self.exchanges:
            out.append((0.0, ALL, everyone, 0))
            out += self._schedule(ex)[rank]
        return out

    def _schedule(self, ex: Exchange) -> list[list[tuple]]:
        """``muon_split.exchange_schedule`` of ``ex`` (every rank's), computed once."""
        cache = self.__dict__.setdefault("_schedule_cache", {})
        if id(ex) not in cache:
            at = {i: j for j, i in enumerate(ex.matrices)}
            infos = [self.matrices[i].info for i in ex.matrices]
            units = [self.matrices[i].units for i in ex.matrices]
            gangs = [at[i] for i in ex.gangs]
            cache[id(ex)] = exchange_schedule(infos, units, gangs, self.world, self.model)
        return cache[id(ex)]

    def critical_path_flops(self) -> float:
        """NS FLOPs on the step's critical path: the schedule of ``trace`` run by
        ``muon_split.critical_path`` (without gangs: per exchange, the busiest rank)."""
        if "_critical" not in self.__dict__:
            self._critical = critical_path([self.trace(r) for r in range(self.world)])
        return self._critical

    def efficiency(self) -> float:
        """Ideal (total / dp) over the critical path: 1.0 = perfect, 1/dp = one rank does all."""
        total = sum(m.cost for m in self.matrices)
        return total / self.world / self.critical_path_flops() if self.matrices else 1.0

    def gang_sums(self, ex: Exchange) -> list[tuple[tuple[int, ...], int]]:
        """(members, elements) of every collective the gangs of ``ex`` run: sums, and gathers
        of split polynomials (``muon_split.Gather``)."""
        out = []
        for i in ex.gangs:
            unit = self.matrices[i].units[0]
            info = self.matrices[i].info
            events = member_events(self.model, info, unit.axis, unit.lines, unit.part)
            out += [(unit.members, e) for e in events if not isinstance(e, float)]
        return out

    def summary(self) -> str:
        """The plan in one line, for the training log: its matrices, DP ranks (and nodes, where
        known), exchanges, which matrices split over gangs of how many ranks, the counted NS
        FLOP efficiency (and where it stays below the efficiency floor, that no plan reaches it)
        and the sync points per step.

        Returns:
            One line of text.
        """
        split = [m for m in self.matrices if len(m.units) > 1]
        sizes = "/".join(str(k) for k in sorted({len(m.units) for m in split}))
        nodes = len(set(self.model.nodes)) if self.model is not None and self.model.nodes else 0
        where = f"{self.world} DP ranks" + (f" on {nodes} node(s)" if nodes else "")
        gangs = f"{len(split)} split over gangs of {sizes} ranks" if split else "none split"
        return (
            f"Muon exchange plan: {len(self.matrices)} matrices, {where}, "
            f"{len(self.exchanges)} exchange(s), {gangs}{self._unsplittable()}; NS FLOP "
            f"efficiency {self.efficiency():.3f}{self._short_of_floor()}, "
            f"{self.sync_points()} sync points per step"
        )

    def _short_of_floor(self) -> str:
        """For the summary: where the efficiency floor (``--muon-plan-min-efficiency``) was out
        of reach, say so (the planner then kept the best balanced plan). Empty otherwise."""
        floor = self.model.min_efficiency if self.model is not None else 0.0
        if not floor or self.efficiency() >= floor:
            return ""
        return f" (below the floor {floor:g}, which no plan reaches: the best balanced)"

    def _unsplittable(self) -> str:
        """Why some matrices cannot split over DP, for the summary: a TP-sharded matrix splits
        only in the ``duplicated`` TP mode (the others run NS per TP rank or over TP), so there
        ``--muon-plan-*`` only weigh the exchange. Empty where every matrix could split."""
        model = self.model
        if model is None:
            return ""
        fixed = sum(model.axis(m.info) is None for m in self.matrices)
        if not fixed:
            return ""
        return (
            f" ({fixed} TP-sharded cannot split in the {model.mode} TP mode; "
            "--muon-tp-mode duplicated can)"
        )

    def sync_points(self) -> int:
        """Exchanges (DP-wide) plus gang collectives (within a gang) per step."""
        return len(self.exchanges) + sum(len(self.gang_sums(ex)) for ex in self.exchanges)

    def traffic(self, ex: Exchange) -> tuple[list[int], list[int]]:
        """Elements each rank sends and receives in the forward direction of ``ex`` (the return
        direction swaps them), self-copies excluded."""
        sent, received = [0] * self.world, [0] * self.world
        for p in ex.pieces:
            if p.holder != p.owner:
                sent[p.holder] += p.size
                received[p.owner] += p.size
        return sent, received

    def sum_traffic(self, ex: Exchange) -> list[float]:
        """Bytes each rank sends (and as many receives) in the gang collectives of ``ex``, as
        rings move them, over both links (``NSCostModel.ring_bytes``)."""
        out = [0.0] * self.world
        for members, n in self.gang_sums(ex):
            for m in members:
                out[m] += sum(self.model.ring_bytes(members, n))
        return out

    def moved(self, ex: Exchange, rank: Optional[int] = None) -> int:
        """Elements ``rank`` sends plus receives in one direction of ``ex``.

        Args:
            ex: one of this plan's exchanges.
            rank: a DP rank; None: this plan's rank.

        Returns:
            Elements, self-copies excluded.
        """
        rank = self.rank if rank is None else rank
        sent, received = self.traffic(ex)
        return sent[rank] + received[rank]

    def bytes_per_step(self, forward_itemsize: int, return_itemsize: int, rank=None) -> int:
        """Bytes ``rank`` sends plus receives per step in the all-to-alls, both directions,
        self-copies excluded (gang sums: ``sum_bytes_per_step``).

        Args:
            forward_itemsize: bytes per element of the forward exchange (update dtype).
            return_itemsize: bytes per element of the return exchange (result dtype).
            rank: a DP rank; None: this plan's rank.

        Returns:
            Bytes per optimizer step.
        """
        moved = sum(self.moved(ex, rank) for ex in self.exchanges)
        return moved * (forward_itemsize + return_itemsize)

    def sum_bytes_per_step(self, rank=None) -> float:
        """Bytes ``rank`` sends plus receives per step in its gang collectives (ring model)."""
        rank = self.rank if rank is None else rank
        return 2 * sum(self.sum_traffic(ex)[rank] for ex in self.exchanges)

    def transient_bytes(self, forward_itemsize, return_itemsize, working_set, rank=None) -> int:
        """Upper bound of the exchange's transient memory on ``rank`` (module docstring):
        the largest phase of one exchange, plus the working sets (``working_set(slot, unit)``:
        bytes NS holds while orthogonalizing a unit) of all its gang blocks together (they are
        in flight at once, muon_gangs.py) or of its largest whole matrix.

        Args:
            forward_itemsize: bytes per element of the forward exchange.
            return_itemsize: bytes per element of the return exchange.
            working_set: ``(slot, unit) -> bytes``, e.g. ``working_set_bytes`` bound to dtypes.
            rank: a DP rank; None: this plan's rank.

        Returns:
            Bytes, an upper bound over the step's exchanges.
        """
        rank = self.rank if rank is None else rank
        f, r = forward_itemsize, return_itemsize
        worst = 0
        for ex in self.exchanges:
            held = sum(p.size for p in ex.sends(rank))
            owned = sum(p.size for p in ex.receives(rank))
            mine = [(self.matrices[i], self.matrices[i].unit_of(rank)) for i in ex.matrices]
            sets = [(bool(u.gang), working_set(m, u)) for m, u in mine if u is not None]
            # gang blocks are all in flight together, then whole matrices one at a time
            work = max(sum(b for gang, b in sets if gang), *(b for gang, b in sets if not gang), 0)
            results = 0 if f == r else owned * r  # else written over the received pieces
            # Held parts of split matrices come back in pieces and are assembled into a copy.
            split = sum(p.size for p in ex.sends(rank) if len(self.matrices[p.matrix].units) > 1)
            # The communication library may keep the forward send buffer until its work is
            # released (gloo and NCCL hold the tensors of a collective), so it counts throughout.
            buffers = held * f + owned * f + results
            worst = max(worst, buffers + max(work, (held + split) * r))  # NS, or the return
        return worst


def working_set_bytes(
    slot: MatrixSlot, update_itemsize: int, ns_itemsize: int, tp: int, unit: Optional[Unit] = None
) -> int:
    """Bytes live while one owned matrix (or gang block, ``unit``) is orthogonalized: the
    assembled block, its TP-global gather and result (update dtype), NS's input copy and two X
    buffers (a gang block also an fp32 copy for its norm), Gram and polynomial (a gang sums the
    Gram in fp32), plus the QKV path's block copies. An upper bound; measured in the tests.

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
    """The largest Gram side of a gang block: columns of row blocks; rows of (the largest Q/K/V
    block of) column blocks."""
    rows, cols = slot.info.shape
    if unit.axis == 0:
        return cols
    split = slot.info.qkv_split or (rows,)
    return rows // sum(split) * max(split)
