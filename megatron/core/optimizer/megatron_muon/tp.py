"""Tensor-parallel orthogonalizers for Muon (``muon_tp_mode``): every TP collective of Muon
lives here. ``duplicated``, ``distributed`` and ``owner`` are exact, ``blockwise`` is not
TP-invariant: docs/tp_modes.md.
"""

import functools
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from .config import TP_MODES
from .functional import (
    NS_TIMER,
    LocalOrthogonalizer,
    MuonParamInfo,
    Orthogonalizer,
    OrthoSpec,
    orthogonalize,
    orthogonalize_matrices,
    qkv_blocks,
    sharded_block_steps,
    timed,
)
from .newton_schulz import SUM, Pieces, Then, compute_dtype, gathers, interleave, ns_flops
from .planner.cost_model import cut


class TPOrthogonalizer:
    """Muon ``Orthogonalizer`` for TP-sharded params (infos carry ``partition_dim``, ``expert``);
    ``groups`` maps ``info.expert`` to its (expert) TP group, ``replicas`` (``owner`` mode without
    DistOpt) to its DP group. Unsharded params are orthogonalized as they are."""

    def __init__(self, mode: str, groups: dict[bool, Any], timers=None, replicas=None) -> None:
        assert mode in TP_MODES, f"a validated TP mode, got {mode!r}"
        self.mode = mode
        self.groups = groups
        self.timers = timers
        self.replicas = replicas or {}

    @property
    def batches(self) -> bool:
        """Whether a call must see all of a step's matrices at once (``owner``: one exchange)."""
        return self.mode == "owner"

    def __call__(self, updates: list[Tensor], infos: list, spec: OrthoSpec) -> list[Tensor]:
        out: list = [None] * len(updates)
        if self.streams:
            self.stream([(lambda u=u: u) for u in updates], infos, spec, out.__setitem__)
        with timed(self.timers, NS_TIMER):
            if self.mode == "owner":
                return self._owned(updates, infos, spec)
            for i, (u, info) in enumerate(zip(updates, infos)):
                if out[i] is None and not self._local(info):
                    out[i] = self._one(u, info, spec)
            here = [i for i, o in enumerate(out) if o is None]  # no collective: batched chains
            infos_here = [self.scale_info(infos[i], updates[i].shape) for i in here]
            orths = orthogonalize_matrices([updates[i] for i in here], infos_here, spec)
            for i, orth in zip(here, orths):
                out[i] = orth
            return out

    @property
    def streams(self) -> bool:
        """Whether ``stream`` runs the calls (``distributed``: matrices interleaved)."""
        return self.mode == "distributed"

    def stream(self, loads: list, infos: list, spec: OrthoSpec, store) -> list[int]:
        """``distributed`` mode: ``store(i, s * NS(loads[i]()))`` of the TP-sharded matrices,
        their blocks ``TP_WINDOW`` at a time in ``stream_order``, interleaved (``interleave``:
        one block's sums run under another's matmuls, one order on every TP rank), each matrix
        loaded when its first block starts, stored when its last ends.

        Args:
            loads: per matrix, a call giving this rank's shard (or whole matrix).
            infos: their TP-global infos.
            spec: Newton-Schulz and scale settings.
            store: takes each index and its result, laid out like its shard.

        Returns:
            The indices left, whole on this rank: the caller batches them.
        """
        with timed(self.timers, NS_TIMER):
            for expert in (False, True):
                idx = [i for i, info in enumerate(infos) if self._sharded(info, expert)]
                if idx:
                    group = self.groups[expert]
                    parts = [_Streamed(loads[i], infos[i], spec, group, store, i) for i in idx]
                    order = stream_order([infos[i] for i in idx], group.size())
                    jobs = [parts[m].block(b) for m, b in order]
                    ns_dtype = compute_dtype(spec.precision)
                    post = functools.partial(_post, group=group, ns_dtype=ns_dtype)
                    interleave(jobs, post, _wait, TP_WINDOW)
        return [i for i, info in enumerate(infos) if self._group(info) is None]

    def _sharded(self, info, expert: bool) -> bool:
        return self._group(info) is not None and bool(getattr(info, "expert", False)) == expert

    def _local(self, info) -> bool:
        """Whether ``_one`` orthogonalizes ``info``'s matrix with no collective."""
        return self.mode == "blockwise" or self._group(info) is None

    def _owned(self, updates: list[Tensor], infos: list, spec: OrthoSpec) -> list[Tensor]:
        """``owner`` mode: each TP-sharded matrix orthogonalized whole by one rank of TP x DP."""
        out: list = [None] * len(updates)
        local = [i for i, info in enumerate(infos) if self._group(info) is None]
        done = orthogonalize_matrices([updates[i] for i in local], [infos[i] for i in local], spec)
        for i, o in zip(local, done):
            out[i] = o
        for expert in (False, True):
            idx = [
                i
                for i, info in enumerate(infos)
                if out[i] is None and getattr(info, "expert", False) == expert
            ]
            if idx:
                group, dp = self.groups[expert], self.replicas.get(expert)
                got = owner_orthogonalize(
                    [updates[i] for i in idx], [infos[i] for i in idx], spec, group, dp
                )
                for i, o in zip(idx, got):
                    out[i] = o
        return out

    def without_replicas(self) -> "TPOrthogonalizer":
        """This orthogonalizer over TP only (DistOpt's exchange already spreads owners over DP)."""
        return TPOrthogonalizer(self.mode, self.groups, self.timers)

    def together(self, updates: list[Tensor], infos: list, fn) -> list[Tensor]:
        """As a call, but ``fn`` sees all matrices at once, gathered before and sliced after
        (no TP collective while it runs, so it may interleave them). ``duplicated`` mode only.

        Args:
            updates: this rank's shards (or whole matrices).
            infos: their TP-global infos.
            fn: the function of all gathered matrices (and their infos) at once.

        Returns:
            The results, laid out like ``updates``.
        """
        groups = [self._group(info) for info in infos]
        if self.mode != "duplicated" and any(g is not None for g in groups):
            raise ValueError(f"together() needs muon_tp_mode 'duplicated', not {self.mode!r}")
        with timed(self.timers, NS_TIMER):
            full = [
                u if g is None else _all_gather_dim(u, info.partition_dim, g)
                for u, info, g in zip(updates, infos, groups)
            ]
            out = fn(full, infos)
            del full
            return [
                o if g is None else o.chunk(g.size(), dim=info.partition_dim)[g.rank()]
                for o, info, g in zip(out, infos, groups)
            ]

    def scale_info(self, info, local_shape: tuple[int, int]) -> MuonParamInfo:
        """The info the scale of ``info``'s update comes from (``blockwise``: the TP-local slice's),
        which whoever scales an unscaled result must use.

        Args:
            info: the param's TP-global info.
            local_shape: the param's TP-local 2-D shape.

        Returns:
            ``info`` itself, or the local slice's ``MuonParamInfo``.
        """
        if self.mode == "blockwise" and self._group(info) is not None:
            return _local_info(info, local_shape)
        return info

    def _group(self, info):
        """The process group sharding this param, None when it is whole on this rank."""
        group = self.groups.get(getattr(info, "expert", False))
        dim = getattr(info, "partition_dim", None)
        if dim is None or group is None or dist.get_world_size(group) == 1:
            return None
        return group

    def _one(self, u: Tensor, info, spec: OrthoSpec) -> Tensor:
        """``s * NS(U)`` of this rank's part of one matrix, per the mode where TP shards it."""
        group = self._group(info)
        if group is None:
            return orthogonalize(u, info, spec)
        if self.mode == "blockwise":
            return orthogonalize(u, _local_info(info, u.shape), spec)
        assert self.mode == "duplicated", f"{self.mode!r} runs in stream()"
        orth = orthogonalize(_all_gather_dim(u, info.partition_dim, group), info, spec)
        return orth.chunk(dist.get_world_size(group), dim=info.partition_dim)[dist.get_rank(group)]


def _local_info(info, local_shape) -> MuonParamInfo:
    """A TP-local slice as ``blockwise`` sees it: its own shape, the per-group Q/K/V split kept."""
    split = info.qkv_split
    assert split is None or local_shape[0] % sum(split) == 0, "a TP shard holds whole groups"
    return MuonParamInfo(tuple(local_shape), split)


def _all_gather_dim(x: Tensor, dim: int, group) -> Tensor:
    """The TP shards of ``x`` concatenated along ``dim`` in rank order."""
    shards = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(shards, x.contiguous(), group=group)
    return torch.cat(shards, dim=dim)


# ``distributed`` mode: TP-sharded matrices in flight at once (``TPOrthogonalizer.stream``):
# while one waits for a sum, the next computes. Two bound the NS working set to two matrices'.
TP_WINDOW = 2


def stream_order(infos: list, tp: int) -> list[tuple[int, int]]:
    """The ``distributed`` stream's order of (matrix, block) (``functional.qkv_blocks``): each
    matrix's summing blocks, then the previous matrix's gathered ones (``gathers``: a GQA
    weight's K and V blocks, one gather and matmuls alone, which run under the next matrix's
    sums), the last matrix's at the end. One matrix's results wait for at most the next's.

    Args:
        infos: the TP-sharded matrices' TP-global infos, in the order the owner runs them.
        tp: the TP size.

    Returns:
        (index into ``infos``, block index) per block.
    """
    out, lagging = [], []
    for m, info in enumerate(infos):
        gathered = [whole for _, _, whole in stream_blocks(info, tp)]
        out += [(m, b) for b, whole in enumerate(gathered) if not whole] + lagging
        lagging = [(m, b) for b, whole in enumerate(gathered) if whole]
    return out + lagging


def stream_blocks(info, tp: int) -> list[tuple[int, int, bool]]:
    """Each NS block of a TP-sharded matrix (``functional.qkv_blocks`` order) as the
    ``distributed`` stream sees it: the one rule ``stream_order`` and the planner's count
    (``plan.distributed_block_events``) share.

    Args:
        info: the matrix's TP-global info (``partition_dim`` set).
        tp: the TP size.

    Returns:
        Per block ``(g, lines, gathered)``: its Gram side, its lines along TP's axis, and
        whether it is cheaper gathered whole than split (``gathers``: no Gram sum).
    """
    dim, out = info.partition_dim, []
    for rows, cols in qkv_blocks(info):  # Q, K, V blocks all share the Gram side (dim 0)
        g, lines = (cols, rows) if dim == 0 else (rows, cols)
        out.append((g, lines, gathers(g, lines, tp)))
    return out


class _Streamed:
    """One matrix of the ``distributed`` stream, its blocks run apart (``stream_order``): its
    shard loaded when a first block starts, the result stored when the last ends; the math gets
    sums, never the group."""

    def __init__(self, load, info, spec: OrthoSpec, group, store, i: int) -> None:
        self.load, self.info, self.spec, self.group = load, info, spec, group
        self.store, self.i = store, i
        self.blocks: Optional[list] = None
        self.results: dict[int, Tensor] = {}

    def block(self, b: int):
        """Block ``b``'s request generator."""
        if self.blocks is None:
            k, p = dist.get_world_size(self.group), dist.get_rank(self.group)
            shard, self.load = self.load(), None
            dim = self.info.partition_dim
            self.blocks, self.join = sharded_block_steps(
                shard, self.info, self.spec, dim, True, (p, k, 1), gather=True, staged=True
            )
        steps = self.blocks[b][1]
        self.blocks[b] = None  # its working set goes with it
        self.results[b] = yield from steps
        if len(self.results) == len(self.blocks):
            self.store(self.i, self.join([self.results[j] for j in range(len(self.blocks))]))
            self.results, self.join = {}, None


# The stream's second collective of a Gram sum in the NS dtype (``sums_in``): the sums gathered.
SUMMED = "summed"


def _post(i: int, kind: str, t, group, ns_dtype=None) -> tuple:
    """Post request ``(kind, t)`` over ``group``: (work, the fill after its wait or None, the
    post of its next collective or None). A sum ``sums_in`` the NS dtype is two: its partials
    exchanged (``post_reduce_scatter_ranges``), then (``SUMMED``) the sums gathered."""
    if kind == SUM and sums_in(t.numel(), group.size(), ns_dtype):
        flat, p = t.view(-1), dist.get_rank(group)
        work, finish = post_reduce_scatter_ranges(
            flat, cut(flat.numel(), group.size()), p, group, ns_dtype
        )
        return work, finish, lambda: _post(i, SUMMED, t, group, ns_dtype)
    if kind == SUM:
        return dist.all_reduce(t, group=group, async_op=True), None, None
    if kind == SUMMED:
        flat, p = t.view(-1), dist.get_rank(group)
        bounds = cut(flat.numel(), group.size())
        return (*post_gather_ranges(flat, bounds, p, group, ns_dtype), None)
    return (*post_pieces(t, group), None)


def _wait(posted: tuple) -> Optional[Then]:
    """Until ``_post``'s collective is done; then its next one posted, if any."""
    work, fill, then = posted
    work.wait()
    if fill is not None:
        fill()
    return Then(then()) if then is not None else None


def sums_in(n: int, tp: int, ns_dtype) -> bool:
    """Whether the ``distributed`` stream sums a tensor of ``n`` elements (a packed Gram) over
    ``tp`` ranks in the NS dtype, as a partial gang sum's TP collectives do
    (``cost_model.around_gang``): each rank's partials are NS-dtype matmul results, exact in
    it, exchanged and added in fp32 (``reduce_scatter_ranges``), and the sums come back in it
    (their consumer, ``unpack_symmetric``, rounds to it): half the bytes of an fp32 all-reduce
    in bf16, no bit changed. Else (fp32 NS, the squared norm) one fp32 all-reduce.

    Args:
        n: the tensor's elements.
        tp: the TP size.
        ns_dtype: Newton-Schulz's compute dtype (None: fp32).

    Returns:
        True for the two collectives.
    """
    return ns_dtype is not None and ns_dtype.itemsize < 4 and n >= tp


def post_pieces(pieces: Pieces, group) -> tuple:
    """Post the all-gather that fills the ranges of ``pieces`` other TP ranks computed (a split
    polynomial's, a gathered block's rows): ``post_gather_ranges`` of them.

    Args:
        pieces: the request; this rank's range filled, the buffer completed in place.
        group: the tensor-parallel process group.

    Returns:
        As ``post_gather_ranges``.
    """
    return post_gather_ranges(pieces.flat, pieces.ranges, dist.get_rank(group), group)


def all_gather_ranges(
    flat: Tensor, bounds: list[tuple[int, int]], p: int, group, dtype=None
) -> None:
    """Fill ``flat`` from every rank's ``flat[bounds[q]]`` with one ``all_gather_into_tensor`` (the
    ranges padded to the longest: uneven ranges need no second collective).

    Args:
        flat: a 1-D tensor of the same size on every rank; this rank's range is filled.
        bounds: one (start, end) per rank of ``group``, in rank order.
        p: this rank's index in ``group``.
        group: the process group.
        dtype: the dtype the ranges move in (None: ``flat``'s); a narrower one rounds every
            range, this rank's too.
    """
    work, fill = post_gather_ranges(flat, bounds, p, group, dtype)
    work.wait()
    fill()


def reduce_scatter_ranges(
    flat: Tensor, bounds: list[tuple[int, int]], p: int, group, dtype=None
) -> None:
    """``flat[bounds[p]]`` = its sum over ``group``: every rank's ranges exchanged with one
    ``all_to_all_single`` in ``dtype`` (the ranges padded to the longest, as
    ``all_gather_ranges``), then summed in ``flat``'s dtype by one reduction; the rest of
    ``flat`` is left. As many bytes as a ``reduce_scatter_tensor`` of ``flat``'s dtype, half of
    them in a 2-byte ``dtype``.

    Args:
        flat: a 1-D tensor of the same size on every rank, each holding a partial sum.
        bounds: one (start, end) per rank of ``group``, in rank order.
        p: this rank's index in ``group``.
        group: the process group.
        dtype: the dtype the ranges move in (None: ``flat``'s); exact only where every partial
            is representable in it (a Gram of NS-dtype matmuls, packed in fp32).
    """
    work, finish = post_reduce_scatter_ranges(flat, bounds, p, group, dtype)
    work.wait()
    finish()


def post_reduce_scatter_ranges(
    flat: Tensor, bounds: list[tuple[int, int]], p: int, group, dtype=None
) -> tuple:
    """``reduce_scatter_ranges`` posted async.

    Args:
        flat: as ``reduce_scatter_ranges``.
        bounds: as ``reduce_scatter_ranges``.
        p: as ``reduce_scatter_ranges``.
        group: as ``reduce_scatter_ranges``.
        dtype: as ``reduce_scatter_ranges``.

    Returns:
        (the work, a call that sums the received partials into ``flat[bounds[p]]`` after its
        wait).
    """
    chunk = max(hi - lo for lo, hi in bounds)
    padded = flat.new_zeros(len(bounds) * chunk, dtype=dtype)
    for q, (lo, hi) in enumerate(bounds):
        padded[q * chunk : q * chunk + hi - lo] = flat[lo:hi]
    parts = torch.empty_like(padded)
    work = dist.all_to_all_single(parts, padded, group=group, async_op=True)

    def finish() -> None:
        lo, hi = bounds[p]
        flat[lo:hi] = parts.view(len(bounds), chunk)[:, : hi - lo].sum(0, dtype=flat.dtype)

    return work, finish


def post_gather_ranges(
    flat: Tensor, bounds: list[tuple[int, int]], p: int, group, dtype=None
) -> tuple:
    """``all_gather_ranges`` posted async.

    Args:
        flat: as ``all_gather_ranges``.
        bounds: as ``all_gather_ranges``.
        p: as ``all_gather_ranges``.
        group: as ``all_gather_ranges``.
        dtype: as ``all_gather_ranges``.

    Returns:
        (the work, a call that copies the other ranks' ranges into ``flat`` after its wait;
        in a narrower ``dtype``, this rank's rounded range too).
    """
    chunk = max(hi - lo for lo, hi in bounds)
    own = flat.new_zeros(chunk, dtype=dtype)
    own[: bounds[p][1] - bounds[p][0]] = flat[bounds[p][0] : bounds[p][1]]
    chunks = flat.new_empty(len(bounds) * chunk, dtype=dtype)
    work = dist.all_gather_into_tensor(chunks, own, group=group, async_op=True)

    def fill() -> None:  # a narrower dtype: this rank's range too, so all hold the same bits
        for q, (lo, hi) in enumerate(bounds):
            if q != p or chunks.dtype != flat.dtype:
                flat[lo:hi] = chunks[q * chunk : q * chunk + hi - lo]

    return work, fill


def owners_orthogonalizer(inner: Orthogonalizer, infos: list) -> Orthogonalizer:
    """Owners' orthogonalizer: ``inner`` where TP shards a Muon matrix, else a local one.

    Args:
        inner: Muon's orthogonalizer.
        infos: the Muon matrices' TP-global infos.

    Returns:
        The orthogonalizer owners run (at TP=1 the step never enters tp.py).
    """
    if isinstance(inner, TPOrthogonalizer) and any(inner._group(i) is not None for i in infos):
        return inner.without_replicas() if inner.replicas else inner
    return LocalOrthogonalizer(getattr(inner, "timers", None))


# ------------------------------------------------------------------ the owner mode
def owner_cells(infos: list, cells: int) -> list[int]:
    """Each matrix's owner cell ``d * tp + t`` (TP rank t of DP replica d), balanced (LPT).

    Args:
        infos: the matrices' TP-global infos, in the order every rank of the grid lists them.
        cells: TP size x replicas.

    Returns:
        One cell per matrix.
    """
    return lpt([_ns_weight(info) for info in infos], cells)


def lpt(weights: list[float], cells: int) -> list[int]:
    """Longest processing time first: each weight, largest first (ties: lower index), onto the
    least-loaded cell (ties: lower cell).

    Args:
        weights: the items' weights.
        cells: the number of cells.

    Returns:
        One cell per item.
    """
    load, out = [0.0] * cells, [0] * len(weights)
    for i in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        out[i] = min(range(cells), key=lambda c: (load[c], c))
        load[out[i]] += weights[i]
    return out


def _ns_weight(info) -> float:
    """One standard NS step's FLOPs, ``4 max(m, n) min(m, n)^2 + 2 min(m, n)^3``, per NS block."""
    rows, cols = info.shape
    split = info.qkv_split
    blocks = [(rows, cols)] if split is None else [(rows // sum(split) * r, cols) for r in split]
    return float(sum(ns_flops(m, n, 1, "standard") for m, n in blocks))


def owner_orthogonalize(
    updates: list[Tensor], infos: list, spec: OrthoSpec, group, replicas=None
) -> list[Tensor]:
    """``s * NS(U)`` of this rank's TP shards, each matrix whole on its owner (``owner_cells``);
    collectives: docs/tp_modes.md.

    Args:
        updates: this rank's TP shards (same list, order and shapes on every rank of the grid).
        infos: their TP-global infos (``partition_dim`` set).
        spec: the Newton-Schulz and scale settings.
        group: the TP process group.
        replicas: the DP group whose ranks hold the same shards (plain DDP), or None.

    Returns:
        The results, laid out like ``updates``, in their dtype.
    """
    tp, t = dist.get_world_size(group), dist.get_rank(group)
    one = replicas is None
    r, d = (1, 0) if one else (dist.get_world_size(replicas), dist.get_rank(replicas))
    cells = owner_cells(infos, tp * r)
    dtype, sizes = updates[0].dtype, [u.numel() for u in updates]
    mine = sorted((i for i, c in enumerate(cells) if c // tp == d), key=lambda i: (cells[i], i))
    owned = [i for i in mine if cells[i] % tp == t]
    send = [sum(sizes[i] for i in mine if cells[i] % tp == q) for q in range(tp)]
    recv = [sum(sizes[i] for i in owned)] * tp
    got = _all_to_all(
        [updates[i].reshape(-1).to(dtype) for i in mine], send, recv, group, updates[0]
    )
    shards = [part.split([sizes[i] for i in owned]) for part in got.split(recv)]
    whole = [
        torch.cat([s[k].view(updates[i].shape) for s in shards], dim=infos[i].partition_dim)
        for k, i in enumerate(owned)
    ]
    del got, shards
    orth = orthogonalize_matrices(whole, [infos[i] for i in owned], spec)
    del whole
    back = [
        o.to(dtype).chunk(tp, dim=infos[i].partition_dim)[q].reshape(-1)
        for q in range(tp)
        for o, i in zip(orth, owned)
    ]
    flat = _all_to_all(back, recv, send, group, updates[0])
    if r > 1:
        flat = _gather_replicas(flat, cells, sizes, tp, replicas)
        mine = sorted(range(len(updates)), key=lambda i: (cells[i] // tp, cells[i], i))
    out: list = [None] * len(updates)
    for i, part in zip(mine, flat.split([sizes[i] for i in mine])):
        out[i] = part.view(updates[i].shape)
    return out


def _all_to_all(chunks: list, send: list[int], recv: list[int], group, like: Tensor) -> Tensor:
    """One ``all_to_all_single`` of ``chunks`` (grouped by destination) over ``group``."""
    inp = torch.cat(chunks) if chunks else like.new_empty(0)
    out = inp.new_empty(sum(recv))
    dist.all_to_all_single(out, inp, output_split_sizes=recv, input_split_sizes=send, group=group)
    return out


def _gather_replicas(flat: Tensor, cells: list[int], sizes: list[int], tp: int, replicas):
    """Every replica's results (each its own matrices', by cell) in one all-gather."""
    r, d = dist.get_world_size(replicas), dist.get_rank(replicas)
    per = [sum(n for c, n in zip(cells, sizes) if c // tp == q) for q in range(r)]
    starts = [sum(per[:q]) for q in range(r)]
    full = flat.new_empty(sum(per))
    full[starts[d] : starts[d] + per[d]] = flat
    all_gather_ranges(full, [(s, s + n) for s, n in zip(starts, per)], d, replicas)
    return full
