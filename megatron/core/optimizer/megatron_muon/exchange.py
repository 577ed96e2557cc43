"""Muon inside Megatron's DistributedOptimizer (ZeRO-1): exact, balanced, one exchange per step.

Per exchange one ``all_to_all`` sends every shard piece of a Muon matrix to its owner (or gang:
planner/gangs.py), owners orthogonalize, one ``all_to_all`` returns the pieces; ``_all_to_all`` is
the only collective here. Also the plan's step-time data, filled in by planner/plan.py. Schedule,
precision, memory and bytes: docs/distopt_exchange.md.
"""

import dataclasses
import functools
import math
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor

from .config import EXCHANGE_DTYPES
from .functional import (
    EXCHANGE_TIMER,
    MuonParamInfo,
    Orthogonalizer,
    OrthoSpec,
    batches,
    scale_flat_,
    timed,
)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


# ------------------------------------------------------------------ the plan's step-time data
# What the planner (planner/plan.py) fills in and each step reads: where a matrix lies, who
# orthogonalizes which block of it, and which pieces every rank sends where.


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

    def _count_before(self, x: int, cols: int) -> int:
        """Elements of the block at flat positions < ``x`` of the matrix."""
        row, col = divmod(x, cols)
        full = min(max(row, self.r0), self.r1) - self.r0
        partial = min(max(col, self.c0), self.c1) - self.c0 if self.r0 <= row < self.r1 else 0
        return full * (self.c1 - self.c0) + partial

    def range_of(self, lo: int, hi: int, cols: int) -> tuple[int, int]:
        """The block's elements among flat positions ``[lo, hi)`` as a range of its own row-major
        order (contiguous: a flat range cuts the block's rows only at its ends).

        Args:
            lo: first flat position of the range.
            hi: end of the range, exclusive.
            cols: the matrix's column count.

        Returns:
            (start, end) in the block's own element order.
        """
        return self._count_before(lo, cols), self._count_before(hi, cols)


def block_views(flat: Tensor, start: int, cols: int, block: Block) -> list[Tensor]:
    """Views (no copies) of ``flat`` covering the block's elements there, in the block's order.

    Args:
        flat: a 1-D piece of the matrix (e.g. this rank's DistOpt shard of it).
        start: the flat position of ``flat[0]`` in the matrix.
        cols: the matrix's column count.
        block: the block whose elements are wanted.

    Returns:
        Views; empty where the piece holds none of the block.
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
    splits: bool = False  # the gang splits its polynomials by rows (``NSCostModel.splits``)

    @property
    def members(self) -> tuple[int, ...]:
        """The gang as a sorted tuple: who takes part in its sums."""
        return tuple(sorted(self.gang))

    @property
    def part(self) -> tuple[int, int, bool]:
        """(place among the sorted members, gang size, whether polynomials split by rows)."""
        return (self.members.index(self.owner), len(self.gang), self.splits)


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

    @property
    def moves(self) -> bool:
        """Whether any piece leaves its holder (else no all-to-all: layout.py)."""
        return any(p.holder != p.owner for p in self.pieces)

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
            (send, receive), ``world`` counts each.
        """
        send, recv = [0] * world, [0] * world
        for p in self.pieces:
            if p.holder == rank:
                send[p.owner] += p.size
            if p.owner == rank:
                recv[p.holder] += p.size
        return send, recv


@dataclass(frozen=True, eq=False)
class ShardInfo(MuonParamInfo):
    """A Muon shard main param: the whole matrix's info plus where this shard sits in it."""

    matrix: int = -1  # index into MuonExchangePlan.matrices
    offset: int = 0  # first element of the shard within the (TP-local, flattened) matrix


class DistributedMuonOrthogonalizer:
    """Orthogonalizer for DP-sharded Muon params around the one owners run (local, or TP);
    ``gangs`` (planner/gangs.py's ``GangRunner``) runs split matrices only where one exists."""

    def __init__(
        self,
        plan,
        inner: Orthogonalizer,
        exchange_dtype: str,
        ns_dtype: torch.dtype = torch.float32,
        update_dtype: torch.dtype = torch.float32,
        device=None,
        gangs=None,
    ):
        assert exchange_dtype in EXCHANGE_DTYPES, f"a validated dtype, got {exchange_dtype!r}"
        self.plan, self.inner = plan, inner
        wire = exchange_dtypes(exchange_dtype, ns_dtype, update_dtype)
        self.forward_dtype, self.return_dtype, self.scale_at_holder = wire
        self.update_dtype = update_dtype  # DistOpt's main params (fp32)
        self.device = device  # of the grad buffers: where a rank without Muon shards exchanges
        self.bytes_moved = 0  # of the last step, counted from the split sizes actually used
        self.timers = getattr(inner, "timers", None)  # Megatron's: times the all-to-alls
        self.sum_bytes = 0.0  # of the last step's gang collectives (ring model)
        self.gangs = gangs

    @property
    def dtype(self) -> torch.dtype:
        """The dtype results come back in (``exchange_dtypes``)."""
        return self.return_dtype

    def __call__(
        self, updates: list[Tensor], infos: list[MuonParamInfo], spec: OrthoSpec
    ) -> list[Tensor]:
        by_matrix = {info.matrix: (u.reshape(-1), info.offset) for u, info in zip(updates, infos)}
        if len(by_matrix) != len(updates) or any(not isinstance(i, ShardInfo) for i in infos):
            raise AssertionError("DistributedMuonOrthogonalizer needs one ShardInfo per matrix")
        assert all(u.dtype == self.update_dtype for u in updates), "updates in the main dtype"
        device = updates[0].device if updates else self.device
        self.bytes_moved, self.sum_bytes, out = 0, 0.0, {}
        owner_spec = dataclasses.replace(spec, apply_scale=False) if self.scale_at_holder else spec
        for ex in self.plan.exchanges:
            out.update(self._run(ex, by_matrix, owner_spec, device))
        results = [out[info.matrix].view(u.shape).to(u.dtype) for u, info in zip(updates, infos)]
        if self.scale_at_holder:  # the owner's product, here: bit-identical
            for r, info in zip(results, infos):
                cols = self.plan.matrices[info.matrix].local_shape[1]
                scale_flat_(r.view(-1), self._scale_info(info.matrix), info.offset, cols, spec)
        return results

    def _scale_info(self, i: int) -> MuonParamInfo:
        """The info the owner scales matrix ``i``'s result by (``TPOrthogonalizer.scale_info``)."""
        slot = self.plan.matrices[i]
        scale_info = getattr(self.inner, "scale_info", None)
        return slot.info if scale_info is None else scale_info(slot.info, slot.local_shape)

    def _run(self, ex: Exchange, by_matrix: dict, spec: OrthoSpec, device) -> dict[int, Tensor]:
        """One sync point: pieces to owners, owners' NS, result pieces back to their holders."""
        rank = self.plan.rank
        sends, receives = ex.sends(rank), ex.receives(rank)
        flat = [self._held_part(p, by_matrix) for p in sends]
        assert [t.numel() for t in flat] == [p.size for p in sends], "held part = piece"
        received = self._all_to_all(ex, flat, self.forward_dtype, device, forward=True)
        del flat
        results = self._orthogonalize_owned(ex, receives, received, spec)
        back = self._all_to_all(ex, [results], self.return_dtype, device, forward=False)
        return self._held_results(sends, back, by_matrix)

    def _views(self, p: Piece, flat: Tensor, offset: int) -> list[Tensor]:
        """Views of a holder's flat shard (or its result) covering piece ``p``."""
        slot = self.plan.matrices[p.matrix]
        return block_views(flat, offset, slot.local_shape[1], slot.unit_of(p.owner).block)

    def _held_part(self, p: Piece, by_matrix: dict) -> Tensor:
        shard, offset = by_matrix[p.matrix]
        parts = [v.reshape(-1).to(self.forward_dtype) for v in self._views(p, shard, offset)]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _held_results(self, sends: list[Piece], back: Tensor, by_matrix: dict) -> dict:
        """Each held shard's result: a slice of ``back``, or assembled from gang members' pieces."""
        out, at = {}, 0
        for p in sends:
            part, at = back[at : at + p.size], at + p.size
            if len(self.plan.matrices[p.matrix].units) == 1:
                out[p.matrix] = part
                continue
            shard, offset = by_matrix[p.matrix]
            if p.matrix not in out:
                out[p.matrix] = back.new_empty(shard.numel())
            done = 0
            for view in self._views(p, out[p.matrix], offset):
                view.copy_(part[done : done + view.numel()].view(view.shape))
                done += view.numel()
        return out

    def _orthogonalize_owned(
        self, ex: Exchange, receives: list[Piece], received: Tensor, spec: OrthoSpec
    ):
        """NS of the owned units (gang blocks together, then whole matrices), laid out like
        ``received``, in the return dtype (over ``received`` where the dtypes agree)."""
        same = self.return_dtype == self.forward_dtype
        results = received if same else torch.empty_like(received, dtype=self.return_dtype)
        at = _offsets_by_matrix(receives)
        gangs = [i for i in ex.gangs if i in at]
        if gangs:
            assert self.gangs is not None, "a plan with gangs needs a GangRunner (planner/gangs.py)"
            blocks = [self._assemble(i, at[i], received) for i in gangs]
            orths = self.gangs.run(self.plan, ex, gangs, blocks, spec)
            self.sum_bytes += self.gangs.sum_bytes
            del blocks
            for i, orth in zip(gangs, orths):
                self._scatter(at[i], orth.reshape(-1), results)
            del orths
        whole = [i for i in at if i not in set(gangs)]
        size = itemsize(self.update_dtype)
        runs = owned_runs(self.plan, whole, self.plan.rank, size, spec.batch_bytes)
        if getattr(self.inner, "streams", False):  # tp.py's distributed mode: TP-sharded ones
            whole = self._stream([i for run in runs for i in run], at, received, results, spec)
            runs = owned_runs(self.plan, whole, self.plan.rank, size, spec.batch_bytes)
        if getattr(self.inner, "batches", False) and whole:  # one call: tp.py's owner mode
            runs = [whole]
        for ids in runs:
            blocks = [self._assemble(i, at[i], received) for i in ids]
            orths = self.inner(blocks, [self.plan.matrices[i].info for i in ids], spec)
            del blocks
            for i, orth in zip(ids, orths):
                self._scatter(at[i], orth.reshape(-1), results)
            del orths
        return results

    def _stream(self, ids: list[int], at: dict, received: Tensor, results: Tensor, spec):
        """Whole matrices ``ids`` through the inner ``stream``: each assembled when it starts,
        scattered into ``results`` when it ends; returns those it left (TP does not shard)."""

        def store(k: int, orth: Tensor) -> None:
            self._scatter(at[ids[k]], orth.reshape(-1), results)

        loads = [functools.partial(self._assemble, i, at[i], received) for i in ids]
        left = self.inner.stream(loads, [self.plan.matrices[i].info for i in ids], spec, store)
        return [ids[k] for k in left]

    def _assemble(self, i: int, pieces: list, received: Tensor) -> Tensor:
        """This rank's unit of matrix ``i`` from its received pieces, in the update dtype."""
        unit = self.plan.matrices[i].unit_of(self.plan.rank)
        block = received.new_empty(unit.block.shape, dtype=self.update_dtype)
        flat = block.view(-1)
        for p, offset in pieces:
            flat[p.lo : p.hi] = received[offset : offset + p.size]
        return block

    @staticmethod
    def _scatter(pieces: list, orth: Tensor, results: Tensor) -> None:
        for p, offset in pieces:
            results[offset : offset + p.size] = orth[p.lo : p.hi]

    def _all_to_all(self, ex: Exchange, chunks: list, dtype, device, forward: bool) -> Tensor:
        """The DP-wide collective: forward split sizes, or swapped for the return exchange."""
        if not ex.moves:  # all own what they hold: no collective
            none = torch.empty(0, dtype=dtype, device=device)
            return torch.cat([c.to(dtype) for c in chunks] or [none])
        send, recv = ex.split_sizes(self.plan.rank, self.plan.world)
        if not forward:
            send, recv = recv, send
        if len(chunks) == 1:
            inp = chunks[0]  # the results buffer: no copy
        else:
            inp = torch.cat(chunks) if chunks else torch.empty(0, dtype=dtype, device=device)
        out = torch.empty(sum(recv), dtype=dtype, device=device)
        with timed(self.timers, EXCHANGE_TIMER):
            torch.distributed.all_to_all_single(
                out, inp, output_split_sizes=recv, input_split_sizes=send, group=ex.group
            )
        rank = self.plan.rank  # counted from the split sizes used, self-copies excluded
        self.bytes_moved += (sum(send) + sum(recv) - send[rank] - recv[rank]) * itemsize(dtype)
        return out


def exchange_dtypes(exchange_dtype: str, ns_dtype: torch.dtype, update_dtype: torch.dtype):
    """The exchange's (forward dtype, return dtype, whether holders apply the scale): the narrower
    dtype each way, and an NS-dtype unscaled return where NS is narrower than the update
    (docs/distopt_exchange.md, "Precision").

    Args:
        exchange_dtype: ``muon_distopt_exchange_dtype`` ("fp32" or "bf16").
        ns_dtype: Newton-Schulz's compute dtype.
        update_dtype: the updates' dtype (DistOpt's fp32 main params).

    Returns:
        (forward dtype, return dtype, scale at the holder).
    """
    named = DTYPES[exchange_dtype]
    forward = min((named, ns_dtype), key=itemsize)
    if itemsize(ns_dtype) < itemsize(update_dtype):
        return forward, ns_dtype, True
    return forward, named, False


def owned_runs(plan, whole: list[int], rank: int, itemsize: int, budget: int) -> list[list[int]]:
    """The whole matrices an owner orthogonalizes together: sorted by shape (same shapes batch),
    in runs of at most ``budget`` bytes (``functional.batches``).

    Args:
        plan: the ``MuonExchangePlan``.
        whole: indices of matrices ``rank`` owns whole.
        rank: the owner's DP rank.
        itemsize: bytes per element of the assembled matrices (the update dtype).
        budget: ``OrthoSpec.batch_bytes``.

    Returns:
        The runs of matrix indices, in the order they run.
    """
    shape = lambda i: plan.matrices[i].unit_of(rank).block.shape  # noqa: E731
    whole = sorted(whole, key=shape)
    runs = batches([math.prod(shape(i)) * itemsize for i in whole], budget)
    return [[whole[j] for j in run] for run in runs]


def _offsets_by_matrix(receives: list[Piece]) -> dict[int, list[tuple[Piece, int]]]:
    """{owned matrix: [(piece, offset in the received buffer)]}, matrices in first-seen order."""
    out: dict[int, list] = {}
    at = 0
    for p in receives:
        out.setdefault(p.matrix, []).append((p, at))
        at += p.size
    return out


def itemsize(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype``."""
    return torch.finfo(dtype).bits // 8
