"""Muon inside Megatron's DistributedOptimizer (ZeRO-1): exact, balanced, one exchange per step.

DistOpt shards ignore param boundaries; Newton-Schulz needs whole matrices. Per step and DP group
one ``all_to_all`` sends every shard piece of every Muon matrix to its owner (or to the members
of its gang, ``muon_split.py``), owners orthogonalize, one ``all_to_all`` returns the pieces. The
only collectives are in ``_all_to_all``, ``_gang_sum`` and ``_gang_gather``; the math comes in as
``matrix_fn``. Schedule, precision, memory and bytes: docs/distopt_exchange.md.
"""

import dataclasses
import functools
import queue
import socket
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor
from torch.distributed import P2POp

from .distopt_layout import in_bucket, param_name
from .muon_config import EXCHANGE_DTYPES
from .muon_functional import (
    EXCHANGE_TIMER,
    MatrixFn,
    MuonParamInfo,
    Orthogonalizer,
    orthogonalize_sharded_steps,
    scale_flat_,
    timed,
)
from .muon_plan import (
    BucketSlot,
    Exchange,
    MatrixSlot,
    MuonExchangePlan,
    Piece,
    ns_cost,
    tp_ns_cost,
)
from .muon_split import (
    DEFAULT_LINKS,
    NSCostModel,
    PlanLinks,
    block_views,
    cut,
    node_layout,
    ring_traffic,
)
from .muon_tp import TPOrthogonalizer, all_gather_ranges, ortho_spec_of
from .newton_schulz import GATHER, SUM, compute_dtype

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True, eq=False)
class ShardInfo(MuonParamInfo):
    """A Muon shard main param: the whole matrix's info plus where this shard sits in it."""

    matrix: int = -1  # index into MuonExchangePlan.matrices
    offset: int = 0  # first element of the shard within the (TP-local, flattened) matrix


class DistributedMuonOrthogonalizer:
    """Orthogonalizer for DP-sharded Muon params; wraps the TP orthogonalizer run by owners."""

    def __init__(
        self,
        plan: MuonExchangePlan,
        inner: Orthogonalizer,
        exchange_dtype: str,
        ns_dtype: torch.dtype = torch.float32,
        update_dtype: torch.dtype = torch.float32,
        device=None,
    ):
        if exchange_dtype not in EXCHANGE_DTYPES:
            raise ValueError(
                f"muon exchange dtype {exchange_dtype!r} unknown; allowed: {list(EXCHANGE_DTYPES)}"
            )
        self.plan, self.inner = plan, inner
        wire = exchange_dtypes(exchange_dtype, ns_dtype, update_dtype)
        self.forward_dtype, self.return_dtype, self.scale_at_holder = wire
        self.update_dtype = update_dtype  # DistOpt's main params (fp32)
        self.device = device  # of the grad buffers: where a rank without Muon shards exchanges
        self.bytes_moved = 0  # of the last step, counted from the split sizes actually used
        self.timers = getattr(inner, "timers", None)  # Megatron's: times the all-to-alls
        self.sum_bytes = 0.0  # of the last step's gang sums (ring model)
        self.streams: Optional[CommStreams] = None  # made at the first step with gangs

    @property
    def dtype(self) -> torch.dtype:
        """The dtype results come back in (``exchange_dtypes``)."""
        return self.return_dtype

    def __call__(
        self, updates: list[Tensor], infos: list[MuonParamInfo], matrix_fn: MatrixFn
    ) -> list[Tensor]:
        by_matrix = {info.matrix: (u.reshape(-1), info.offset) for u, info in zip(updates, infos)}
        if len(by_matrix) != len(updates) or any(not isinstance(i, ShardInfo) for i in infos):
            raise AssertionError("DistributedMuonOrthogonalizer needs one ShardInfo per matrix")
        assert all(u.dtype == self.update_dtype for u in updates), "updates in the main dtype"
        device = updates[0].device if updates else self.device
        self.bytes_moved, self.sum_bytes, out = 0, 0.0, {}
        owner_fn = _unscaled(matrix_fn) if self.scale_at_holder else matrix_fn
        for ex in self.plan.exchanges:
            out.update(self._run(ex, by_matrix, owner_fn, device))
        results = [out[info.matrix].view(u.shape).to(u.dtype) for u, info in zip(updates, infos)]
        if self.scale_at_holder:  # the owner's product, here: bit-identical
            spec = ortho_spec_of(matrix_fn)
            for r, info in zip(results, infos):
                cols = self.plan.matrices[info.matrix].local_shape[1]
                scale_flat_(r.view(-1), self._scale_info(info.matrix), info.offset, cols, spec)
        return results

    def _scale_info(self, i: int) -> MuonParamInfo:
        """The info the owner's orthogonalizer scales matrix ``i``'s result by: the TP-local
        slice's in the ``blockwise`` TP mode (``TPOrthogonalizer.scale_info``), else the
        whole matrix's (its plan slot's TP-global info, which says how TP shards it)."""
        slot = self.plan.matrices[i]
        scale_info = getattr(self.inner, "scale_info", None)
        return slot.info if scale_info is None else scale_info(slot.info, slot.local_shape)

    def _run(self, ex: Exchange, by_matrix: dict, matrix_fn, device) -> dict[int, Tensor]:
        """One sync point: pieces to owners, owners' NS, result pieces back to their holders."""
        rank = self.plan.rank
        sends, receives = ex.sends(rank), ex.receives(rank)
        flat = [self._held_part(p, by_matrix) for p in sends]
        assert [t.numel() for t in flat] == [p.size for p in sends], "held part = piece"
        received = self._all_to_all(ex, flat, self.forward_dtype, device, forward=True)
        del flat
        results = self._orthogonalize_owned(ex, receives, received, matrix_fn)
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
        """Each held shard's result: a slice of ``back`` for a whole matrix, assembled from the
        gang members' pieces for a split one."""
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
        self, ex: Exchange, receives: list[Piece], received: Tensor, matrix_fn
    ):
        """NS of the owned units: gang blocks together, interleaved (``_run_gangs``), then
        whole matrices one at a time; results laid out like ``received`` (same pieces, same
        order), in the return dtype: over ``received`` itself when the dtypes agree."""
        same = self.return_dtype == self.forward_dtype
        results = received if same else torch.empty_like(received, dtype=self.return_dtype)
        at = _offsets_by_matrix(receives)
        gangs = [i for i in ex.gangs if i in at]
        if gangs:
            blocks = [self._assemble(i, at[i], received) for i in gangs]
            orths = self._run_gangs(ex, gangs, blocks, matrix_fn)
            del blocks
            for i, orth in zip(gangs, orths):
                self._scatter(at[i], orth.reshape(-1), results)
            del orths
        for i in [i for i in at if i not in set(gangs)]:
            block = self._assemble(i, at[i], received)
            orth = self.inner([block], [self.plan.matrices[i].info], matrix_fn)[0]
            del block
            self._scatter(at[i], orth.reshape(-1), results)
        return results

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

    def _run_gangs(self, ex: Exchange, gangs: list[int], blocks: list[Tensor], matrix_fn):
        """``s * NS`` of this rank's gang blocks, all in flight together: each block's
        iteration (``orthogonalize_sharded_steps``) runs on this thread, its sums and gathers
        over the gang on a communication thread (``_interleave``), so one block's collective
        overlaps the others' matmuls. In the ``duplicated`` TP mode the blocks are TP-gathered
        all first and sliced after (``TPOrthogonalizer.together``): the main thread runs no
        collective while the communication thread does."""
        slots = [self.plan.matrices[i] for i in gangs]
        units = [slot.unit_of(self.plan.rank) for slot in slots]
        spec = ortho_spec_of(matrix_fn)

        def gang_fn(updates: list[Tensor], infos: list) -> list[Tensor]:
            steps, serve = [], []
            for u, info, unit in zip(updates, infos, units):
                members = unit.members
                part = (members.index(self.plan.rank), len(members)) if unit.splits else None
                steps.append(orthogonalize_sharded_steps(u, info, spec, unit.axis, True, part))
                tp = self._sharing(info)
                serve.append(
                    {
                        SUM: functools.partial(self._gang_sum, ex, members, tp),
                        GATHER: functools.partial(self._gang_gather, ex, members, tp),
                    }
                )
            return self._interleave(steps, serve, [unit.members for unit in units])

        infos = [slot.info for slot in slots]
        if isinstance(self.inner, TPOrthogonalizer):
            return self.inner.together(blocks, infos, gang_fn)
        return gang_fn(blocks, infos)

    def _interleave(self, steps: list, serve: list[dict], members: list[tuple]) -> list[Tensor]:
        """Run the generators ``steps`` (gang order) in rounds: in each, every unit still
        running waits for its last request to be served, computes up to its next request and
        posts it to a communication thread, which serves posts one at a time in post order
        (``muon_split.pipelined`` is this schedule; ``critical_path`` its time). Every member of
        a gang posts its requests in the same global order (round, gang order), so the rings of
        different gangs never wait on each other in a circle; the thread lives for this call
        only (none is left when a process forks)."""
        out: list = [None] * len(steps)
        pending: list = [None] * len(steps)
        live = list(range(len(steps)))
        if self.streams is None:
            self.streams = CommStreams.of(self.device)
        pool = CommThread(self.streams.enter)
        try:
            while live:
                for i in list(live):
                    if pending[i] is not None:
                        self._wait(pending[i])
                    try:
                        kind, t = next(steps[i]) if pending[i] is None else steps[i].send(None)
                    except StopIteration as done:
                        out[i] = done.value
                        live.remove(i)
                        continue
                    pending[i] = self._post(pool, serve[i][kind], t, members[i])
        except BaseException:
            # Raise now: a posted collective may wait for peers forever, and joining the
            # thread would hide the error behind a hang (it is a daemon: exit does not join it).
            pool.close(wait=False)
            raise
        pool.close(wait=True)
        return out

    def _post(self, pool, serve, t: Tensor, members: tuple) -> "Posted":
        """Hand ``serve(t)`` (a gang collective over ``members``) to the communication thread."""
        return Posted(pool.submit(self.streams.serve, serve, t, self.streams.ready()), t, members)

    def _wait(self, posted: "Posted") -> None:
        """Wait until a posted collective is done (re-raising what it raised)."""
        self.streams.done(posted.future.result())

    def _sharing(self, info):
        """The TP group whose ranks orthogonalize the same gathered block (``duplicated`` mode),
        so that each sums only a slice of a gang's tensors over DP; None where there is none."""
        inner = self.inner
        if isinstance(inner, TPOrthogonalizer) and inner.mode == "duplicated":
            return inner._group(info)
        return None

    def _gang_sum(self, ex: Exchange, members: tuple[int, ...], tp, t: Tensor) -> None:
        """A gang's sum: ``t`` summed in place over its members by rings of point-to-point
        messages inside the DP group (``node_all_reduce``: hierarchical where the gang has as
        many members on each of several nodes), so a gang needs no process group of its own
        (making one is a collective over the whole world). TP ranks holding the same block
        (``tp``) each sum one slice over DP and all-gather the slices over TP, so a rank's DP
        link carries ``1 / tp`` of the tensor."""
        flat = t.view(-1)
        lo, hi, slices, p = _tp_slice(flat.numel(), tp)
        nodes = self.plan.model.nodes
        node_all_reduce(flat[lo:hi], members, self.plan.rank, ex.group, nodes)
        if slices:
            all_gather_ranges(flat, slices, p, tp)
        moved = ring_traffic(hi - lo, t.element_size(), 2, node_layout(members, nodes))
        self.sum_bytes += 2 * sum(moved)

    def _gang_gather(self, ex: Exchange, members: tuple[int, ...], tp, poly: Tensor) -> None:
        """A gang's other collective: the rows of a split polynomial (``newton_schulz.
        splits_polynomial``) that the other members computed, gathered in place by a ring, or,
        across nodes (``node_all_reduce``), summed with the other rows zeroed (exact); per TP
        slice where TP ranks share the block, as ``_gang_sum``."""
        flat, cols = poly.view(-1), poly.shape[1]
        lo, hi, slices, p = _tp_slice(flat.numel(), tp)
        rows = [
            (min(max(a * cols, lo), hi), min(max(b * cols, lo), hi))
            for a, b in cut(poly.shape[0], len(members))
        ]
        nodes = self.plan.model.nodes
        m, n = node_layout(members, nodes)
        if m > 1 and n > 1:  # as a sum of zero-filled rows
            a, b = rows[members.index(self.plan.rank)]
            flat[lo:a].zero_()
            flat[b:hi].zero_()
            node_all_reduce(flat[lo:hi], members, self.plan.rank, ex.group, nodes)
        else:
            ring_all_gather(flat, rows, members, self.plan.rank, ex.group)
        if slices:
            all_gather_ranges(flat, slices, p, tp)
        moved = ring_traffic(hi - lo, poly.element_size(), 1, (m, n))
        self.sum_bytes += 2 * sum(moved)

    def _all_to_all(self, ex: Exchange, chunks: list, dtype, device, forward: bool) -> Tensor:
        """The DP-wide collective: forward split sizes, or swapped for the return exchange."""
        if all(p.holder == p.owner for p in ex.pieces):  # all own what they hold: nothing moves
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
        self.bytes_moved += (sum(send) + sum(recv) - send[rank] - recv[rank]) * _itemsize(dtype)
        return out


def exchange_dtypes(exchange_dtype: str, ns_dtype: torch.dtype, update_dtype: torch.dtype):
    """The dtypes the exchange moves: (forward, return, whether holders apply the scale).

    Forward: the narrower of ``exchange_dtype`` and the NS dtype (NS casts its input first, so
    a narrower NS dtype rounds the same values, only earlier). Return: where NS computes in a
    dtype narrower than the update's (bf16 NS, fp32 main params) its unscaled output is exactly
    that dtype's values, so owners return it unscaled in the NS dtype and holders apply the
    scale (``muon_functional.scale_flat_``: the owner's product, bit-identical); else the
    scaled update in ``exchange_dtype``.

    Args:
        exchange_dtype: ``muon_distopt_exchange_dtype`` ("fp32" or "bf16").
        ns_dtype: Newton-Schulz's compute dtype.
        update_dtype: the dtype of the updates (DistOpt's fp32 main params).

    Returns:
        (forward dtype, return dtype, scale at the holder).
    """
    named = DTYPES[exchange_dtype]
    forward = min((named, ns_dtype), key=_itemsize)
    if _itemsize(ns_dtype) < _itemsize(update_dtype):
        return forward, ns_dtype, True
    return forward, named, False


def _unscaled(matrix_fn):
    """Muon's ``orthogonalize_matrices`` partial with the scale left out (``apply_scale``)."""
    spec = dataclasses.replace(ortho_spec_of(matrix_fn), apply_scale=False)
    return functools.partial(matrix_fn.func, spec=spec)


def node_all_reduce(flat: Tensor, members: tuple[int, ...], rank: int, group, nodes) -> None:
    """``ring_all_reduce``, hierarchical where ``members`` are ``m > 1`` ranks on each of
    ``n > 1`` nodes (``nodes[r]``: DP rank r's node): a ring reduce-scatter among a node's
    members (``m`` chunks), a ring all-reduce of each chunk over the nodes among the members
    holding it, and a ring all-gather within the node. The slow links then carry ``1 / m`` of
    the tensor. Every chunk is summed in one fixed order: all members end with the same bits.

    Args:
        flat: the 1-D tensor to sum, same size on every member; summed in place.
        members: the gang's ranks within ``group``, sorted.
        rank: this process's rank within ``group`` (one of ``members``).
        group: the DP process group the members belong to.
        nodes: the node of every rank of ``group`` (empty: unknown, one flat ring).
    """
    m, n = node_layout(members, nodes)
    if m == 1 or n == 1:
        ring_all_reduce(flat, members, rank, group)
        return
    by_node: dict[int, list[int]] = {}
    for r in members:
        by_node.setdefault(nodes[r], []).append(r)
    local = by_node[nodes[rank]]
    p = local.index(rank)
    nxt, prev = local[(p + 1) % m], local[(p - 1) % m]
    chunks = [flat[a:b] for a, b in cut(flat.numel(), m)]
    own = _ring_reduce_scatter(chunks, p, nxt, prev, group)
    peers = tuple(sorted(ranks[p] for ranks in by_node.values()))  # chunk ``own`` everywhere
    ring_all_reduce(chunks[own], peers, rank, group)
    _ring_gather(chunks, own, nxt, prev, group)


def ring_all_reduce(flat: Tensor, members: tuple[int, ...], rank: int, group) -> None:
    """Sum ``flat`` in place over ``members`` (ranks of ``group``, sorted) with a ring: k - 1
    steps of reduce-scatter, then k - 1 of all-gather, each a send to the next member and a
    receive from the previous one. Every chunk is summed once, on one member, in ring order, and
    copied to the others: all members end with the same bits. Only the members take part (torch
    allows point-to-point within a subset of a group once the group has run a collective: the
    DP group has, the all-to-all just before).

    Args:
        flat: the 1-D fp32 tensor to sum, same size on every member; summed in place.
        members: the gang's ranks within ``group``, sorted.
        rank: this process's rank within ``group`` (one of ``members``).
        group: the DP process group the members belong to.
    """
    k, p = len(members), members.index(rank)
    nxt, prev = members[(p + 1) % k], members[(p - 1) % k]
    chunks = [flat[a:b] for a, b in cut(flat.numel(), k)]
    _ring_gather(chunks, _ring_reduce_scatter(chunks, p, nxt, prev, group), nxt, prev, group)


def _ring_reduce_scatter(chunks: list[Tensor], p: int, nxt: int, prev: int, group) -> int:
    """k - 1 ring steps after which chunk ``p + 1`` is summed here; returns that index."""
    k = len(chunks)
    scratch = chunks[0].new_empty(max(c.numel() for c in chunks))
    for s in range(k - 1):
        send, recv = chunks[(p - s) % k], chunks[(p - s - 1) % k]
        _exchange(send, scratch[: recv.numel()], nxt, prev, group)
        recv.add_(scratch[: recv.numel()])
    return (p + 1) % k


def ring_all_gather(flat: Tensor, bounds, members: tuple[int, ...], rank: int, group) -> None:
    """Fill ``flat`` in place: the ``p``-th member holds ``flat[bounds[p][0]:bounds[p][1]]`` and
    receives every other member's range, passed along a ring (k - 1 steps).

    Args:
        flat: the 1-D tensor, same size on every member; this member's range is filled.
        bounds: ``k`` (start, end) ranges of ``flat``, one per member in ``members`` order.
        members: the gang's ranks within ``group``, sorted.
        rank: this process's rank within ``group`` (one of ``members``).
        group: the DP process group the members belong to.
    """
    k, p = len(members), members.index(rank)
    chunks = [flat[a:b] for a, b in bounds]
    _ring_gather(chunks, p, members[(p + 1) % k], members[(p - 1) % k], group)


def _ring_gather(chunks: list[Tensor], own: int, nxt: int, prev: int, group) -> None:
    """k - 1 ring steps after which every member holds every chunk; it starts with ``own``."""
    k = len(chunks)
    for s in range(k - 1):
        _exchange(chunks[(own - s) % k], chunks[(own - s - 1) % k], nxt, prev, group)


def _tp_slice(n: int, group) -> tuple[int, int, Optional[list], int]:
    """(start, end) of the slice of an ``n``-element gang tensor this TP rank sums over DP, the
    slices of all TP ranks (None: no TP sharing, or fewer elements than ranks: sum it all) and
    this rank's index in ``group``."""
    k = group.size() if group is not None else 1
    if k == 1 or n < k:
        return 0, n, None, 0
    p = torch.distributed.get_rank(group)
    slices = cut(n, k)
    return (*slices[p], slices, p)


def _exchange(send: Tensor, recv: Tensor, to: int, frm: int, group) -> None:
    """Send to one peer while receiving from another; an empty chunk is not sent (its receiver
    sees the same empty chunk: both cut the same tensor the same way)."""
    ops = []
    if send.numel():
        ops.append(P2POp(torch.distributed.isend, send, group=group, group_peer=to))
    if recv.numel():
        ops.append(P2POp(torch.distributed.irecv, recv, group=group, group_peer=frm))
    for work in torch.distributed.batch_isend_irecv(ops) if ops else []:
        work.wait()


def _offsets_by_matrix(receives: list[Piece]) -> dict[int, list[tuple[Piece, int]]]:
    """{owned matrix: [(piece, offset in the received buffer)]}, matrices in first-seen order."""
    out: dict[int, list] = {}
    at = 0
    for p in receives:
        out.setdefault(p.matrix, []).append((p, at))
        at += p.size
    return out


class CommThread:
    """The communication thread of one ``_interleave`` call: serves submitted calls one at a
    time in submission order. A daemon thread: a rank whose main thread failed while a posted
    collective waits for peers that never come must still exit with its error (Python joins
    other threads at exit, a ``ThreadPoolExecutor``'s worker included, and torchrun would see
    a hang instead of a failure)."""

    def __init__(self, initializer: Callable[[], None]):
        self._posts: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(
            target=self._run, args=(initializer,), name="muon-gang", daemon=True
        )
        self._thread.start()

    def submit(self, fn: Callable, *args) -> Future:
        """``fn(*args)`` on the thread, after every call submitted before it.

        Args:
            fn: the call (e.g. ``CommStreams.serve``).
            *args: its arguments.

        Returns:
            A future of its result (or of what it raised).
        """
        future: Future = Future()
        self._posts.put((future, fn, args))
        return future

    def close(self, wait: bool) -> None:
        """End the thread once it has served what was submitted; ``wait``: join it."""
        self._posts.put(None)
        if wait:
            self._thread.join()

    def _run(self, initializer) -> None:
        failed = None
        try:
            initializer()
        except BaseException as err:  # every call fails with it: the main thread raises it
            failed = err
        while (post := self._posts.get()) is not None:
            future, fn, args = post
            try:
                if failed is not None:
                    raise failed
                future.set_result(fn(*args))
            except BaseException as err:
                future.set_exception(err)


@dataclass(frozen=True)
class Posted:
    """A gang collective handed to the communication thread: its future (an event or None),
    the tensor it works on in place, the gang's members."""

    future: Future
    tensor: Tensor
    members: tuple[int, ...]


class CommStreams:
    """How the communication thread's work is ordered against the main thread's matmuls on an
    accelerator: it runs on a stream of its own (so its transfers and ring adds do not queue
    behind matmuls posted later, as ``muon_split.critical_path`` assumes), after an event the
    main thread records on its compute stream when it posts a tensor, and the main thread's
    stream waits for an event recorded after the collective before it uses the tensor again.
    A tensor is only touched by the other side between those events, and is freed by the main
    thread after its wait, so the caching allocator cannot hand its memory to the other stream
    early. On CPU (``compute`` None) every method is a no-op: gloo's collectives are done when
    they return."""

    def __init__(self, compute=None, comm=None):
        self.compute, self.comm = compute, comm

    @classmethod
    def of(cls, device) -> "CommStreams":
        """The streams for ``device``: none on CPU, else its current stream and a new one."""
        if device is None or torch.device(device).type == "cpu":
            return cls()
        return cls(torch.accelerator.current_stream(device), torch.Stream(device=device))

    def enter(self) -> None:
        """The communication thread's initializer: its current stream is ``comm``."""
        if self.comm is not None:
            torch.accelerator.set_stream(self.comm)

    def ready(self):
        """Main thread, at a post: an event after the work that produced the tensor."""
        return self.compute.record_event() if self.compute is not None else None

    def serve(self, serve, t: Tensor, ready):
        """Communication thread: ``serve(t)`` after ``ready``.

        Args:
            serve: the collective, in place on ``t`` (``_gang_sum`` or ``_gang_gather``).
            t: the tensor the main thread posted.
            ready: the event ``ready()`` gave at the post (None on CPU).

        Returns:
            An event recorded after the collective (None on CPU), for ``done``.
        """
        if ready is not None:
            self.comm.wait_event(ready)
        serve(t)
        return self.comm.record_event() if self.comm is not None else None

    def done(self, event) -> None:
        """Main thread, at a wait: its stream waits for the collective's ``event``."""
        if event is not None:
            self.compute.wait_event(event)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.finfo(dtype).bits // 8


# ------------------------------------------------------------------ building the plan from DistOpt


def build_plan(distopt, tp_info_of, model: NSCostModel, window=None) -> MuonExchangePlan:
    """The exchange plan from DistOpt's range maps.

    ``tp_info_of(model_param)`` gives the TP-global ``MuonParamInfo`` of a Muon model param and
    None for AdamW params; ``model`` the NS FLOPs of owners and gang members. Every rank builds
    the same plan: bucket layouts are identical across the DP group (and across TP ranks), and
    owners are a pure function of them.

    Args:
        distopt: the ``DistributedOptimizer`` (its buffers, buckets and param names).
        tp_info_of: model param -> TP-global ``MuonParamInfo``, or None for AdamW params.
        model: the Newton-Schulz cost model (whole matrices and gang members).
        window: Muon elements per exchange; None: one exchange per DP group.

    Returns:
        This DP rank's ``MuonExchangePlan``.
    """
    buckets, matrices = [], []
    for buffer in distopt.buffers:
        for bucket in buffer.buckets:
            group = buffer.data_parallel_group
            slot = BucketSlot(group=group, shard_size=bucket.grad_data.numel() // group.size())
            for param in bucket.params_list:
                info = tp_info_of(param)
                if info is None:
                    continue
                start, end = in_bucket(buffer, bucket, param)
                slot.matrices.append(len(matrices))
                matrices.append(
                    MatrixSlot(
                        name=param_name(distopt, param),
                        bucket=len(buckets),
                        start=start,
                        end=end,
                        local_shape=tuple(param.shape),
                        info=info,
                        cost=model.whole(info),
                    )
                )
            slot.matrices.sort(key=lambda i: matrices[i].start)
            buckets.append(slot)
    group = buckets[0].group if buckets else None
    rank, world = (group.rank(), group.size()) if group is not None else (0, 1)
    return MuonExchangePlan(buckets, matrices, rank, world, window, model)


def shard_infos(distopt, plan: MuonExchangePlan, muon_params: set) -> dict:
    """{shard main param: ShardInfo} for the Muon params among DistOpt's shards.

    Args:
        distopt: the ``DistributedOptimizer`` whose inner optimizer holds the shards.
        plan: the exchange plan built from the same ``distopt``.
        muon_params: the model params Muon steps.

    Returns:
        {1-D shard main param: its ``ShardInfo`` (global shape, QKV split, matrix, offset)}.
    """
    index = {slot.name: i for i, slot in enumerate(plan.matrices)}
    out = {}
    for param, (gi, order) in distopt.model_param_group_index_map.items():
        if param not in muon_params:
            continue
        shard = distopt.optimizer.param_groups[gi]["params"][order]
        i = index[param_name(distopt, param)]
        info = plan.matrices[i].info
        offset = distopt._get_model_param_range_map(param)["param"].start
        out[shard] = ShardInfo(info.shape, info.qkv_split, i, offset)
    return out


def shard_location(distopt, shard) -> tuple[MatrixSlot, int]:
    """(the matrix, the shard's first element within the flattened TP-local matrix) of a Muon
    shard main param of ``distopt``: what e.g. QK-clip needs to find its rows.

    Args:
        distopt: a ``DistributedOptimizer`` with Muon attached (``attach``).
        shard: one of its 1-D Muon shard main params.

    Returns:
        (matrix slot, element offset).
    """
    info = distopt.optimizer.param_info[shard]
    return distopt.muon_plan.matrices[info.matrix], info.offset


def host_nodes(group) -> tuple[int, ...]:
    """The node of every rank of ``group``: ranks on one host share an id (first-seen order).
    One ``all_gather_object`` of the host names: every rank gets the same tuple.

    Args:
        group: the DP process group.

    Returns:
        One node id per rank of ``group``, in group rank order.
    """
    names: list = [None] * group.size()
    torch.distributed.all_gather_object(names, socket.gethostname(), group=group)
    first = {name: i for i, name in reversed(list(enumerate(names)))}
    ids = {name: n for n, name in enumerate(sorted(set(names), key=first.get))}
    return tuple(ids[name] for name in names)


def domain_nodes(group, size: int) -> tuple[int, ...]:
    """The NVLink domain of every rank of ``group`` where ``size`` consecutive global ranks
    share one (``--muon-plan-nvlink-domain``; ranks numbered node-major, as torchrun and Slurm
    number them). No collective.

    Args:
        group: the DP process group.
        size: GPUs per NVLink domain.

    Returns:
        One domain id per rank of ``group``, in group rank order.
    """
    return tuple(r // size for r in torch.distributed.get_process_group_ranks(group))


def shared_layout(nodes: tuple[int, ...], groups: list) -> tuple[int, ...]:
    """The node layout TP rank 0 of each of ``groups`` found, on all its ranks. The TP ranks of
    a DP rank must run one plan (the ``duplicated`` and ``distributed`` modes gather or sum over
    TP inside it), but a layout from global ranks or host names can differ between them: an
    NVLink domain that is not a multiple of the TP size, a TP group across hosts. One
    ``all_gather_object`` per group of more than one rank; every TP peer calls it at the same
    point (``attach``, with the same params).

    Args:
        nodes: this rank's layout of its DP group (``domain_nodes`` or ``host_nodes``).
        groups: the TP groups sharding this optimizer's Muon params (``_tp_groups``).

    Returns:
        The layout every rank of those groups plans with.
    """
    for group in groups:
        got: list = [None] * group.size()
        torch.distributed.all_gather_object(got, nodes, group=group)
        nodes = got[0]
    return nodes


def _tp_groups(inner, infos: list) -> list:
    """The TP (or expert TP) groups of more than one rank that shard ``infos``' params
    (``TPOrthogonalizer._group``), in one order on every rank (dense, then expert)."""
    if not isinstance(inner, TPOrthogonalizer):
        return []
    groups = {}
    for info in infos:
        group = inner._group(info)
        if group is not None:
            groups.setdefault(bool(getattr(info, "expert", False)), group)
    return [groups[expert] for expert in sorted(groups)]


def cost_model(
    inner, steps: int, ns_itemsize: int = 4, exchange_itemsizes: int = 8, form: str = "standard"
):
    """NS FLOPs an owner's TP rank executes, per the inner orthogonalizer's TP mode.

    Args:
        inner: Muon's orthogonalizer before ``attach`` wraps it (local or ``TPOrthogonalizer``).
        steps: Newton-Schulz iterations.
        ns_itemsize: bytes per element of Newton-Schulz's compute dtype.
        exchange_itemsizes: bytes per element of the forward plus the return exchange.
        form: Newton-Schulz's form (``OrthoSpec.form``): counted where a matrix is
            orthogonalized whole; gang blocks run (and are counted as) the standard steps.

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
    return NSCostModel(steps, whole, tp_of, inner.mode, **sizes)


def attach(
    distopt,
    muon,
    exchange_dtype: str = "fp32",
    window: Optional[int] = None,
    links: PlanLinks = DEFAULT_LINKS,
) -> None:
    """Make ``muon`` (the DistributedOptimizer's inner optimizer) step DP-sharded params exactly.

    Called once from ``DistributedOptimizer.__init__`` after it replaced the inner optimizer's
    params by 1-D shard main params. ``muon.param_info`` still maps the *model* params to their
    TP-global infos; afterwards it maps the shards to ``ShardInfo``s, and ``muon.orthogonalizer``
    routes whole matrices to their owners around the tensor-parallel orthogonalizer it had.

    Args:
        distopt: the ``DistributedOptimizer`` being built.
        muon: its inner Muon optimizer; modified in place.
        exchange_dtype: the exchange's dtype where NS does not set it, in ``EXCHANGE_DTYPES``
            ("fp32", "bf16"; ``exchange_dtypes``).
        window: Muon elements per exchange; None: one exchange per DP group.
        links: the machine the planner assumes and its efficiency floor (``muon_split.PlanLinks``).
    """
    specs = muon.ortho_specs()
    if len(specs) > 1:
        raise ValueError(
            "with use_distributed_optimizer all Muon param groups must share the Newton-Schulz "
            f"and scale settings (one owner runs each matrix); got {len(specs)} different ones"
        )
    steps = specs[0].steps if specs else 0
    form = specs[0].form if specs else "standard"
    ns_dtype = compute_dtype(specs[0].precision) if specs else torch.float32
    muon_params = {p for p in distopt.model_param_group_index_map if muon.param_info.get(p)}
    dtype = exchange_dtype if exchange_dtype in DTYPES else "fp32"  # unknown: refused below
    forward, back, _ = exchange_dtypes(dtype, ns_dtype, torch.float32)
    sizes = (_itemsize(ns_dtype), _itemsize(forward) + _itemsize(back))
    model = dataclasses.replace(
        cost_model(muon.orthogonalizer, steps, *sizes, form=form),
        **links.link_costs(),
        min_efficiency=links.min_efficiency or 0.0,
    )
    if distopt.buffers:  # gangs within a node, or spread evenly over nodes, ring over NVLink
        group = distopt.buffers[0].data_parallel_group
        size = links.nvlink_domain
        nodes = domain_nodes(group, size) if size else host_nodes(group)
        infos = [muon.param_info.get(p) for p in muon_params]
        nodes = shared_layout(nodes, _tp_groups(muon.orthogonalizer, infos))
        model = dataclasses.replace(model, nodes=nodes)
    plan = build_plan(distopt, muon.param_info.get, model, window)
    muon.param_info = shard_infos(distopt, plan, muon_params)
    device = distopt.buffers[0].grad_data.device if distopt.buffers else None
    muon.orthogonalizer = DistributedMuonOrthogonalizer(
        plan, muon.orthogonalizer, exchange_dtype, ns_dtype, device=device
    )
    # A per-rank raise on a non-finite grad would leave the other DP ranks waiting in the
    # exchange; Megatron's own checks (grad scaler found_inf, DDP's NaN check) are collective.
    muon.on_nonfinite_grad = "ignore"
    distopt.muon_plan = plan
