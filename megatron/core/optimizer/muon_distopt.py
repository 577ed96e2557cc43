"""Muon inside Megatron's DistributedOptimizer (ZeRO-1): exact, balanced, one exchange per step.

The DistributedOptimizer cuts every grad bucket into ``dp`` equal contiguous pieces that ignore
parameter boundaries, so a rank's Muon params are 1-D shards: a matrix may be spread over several
ranks, and a rank may hold none of it. Newton-Schulz needs whole matrices. Per step:

1. each rank updates momentum for its own shards (elementwise, in ``Muon``);
2. every Muon matrix has one *owner* rank in its DP group, chosen once to balance the
   Newton-Schulz FLOPs the owner executes (longest-processing-time greedy on ``ns_cost``);
3. per *exchange* (all Muon buckets of one DP group; dense and expert params have different DP
   groups) one ``all_to_all`` sends every piece of every matrix to its owner;
4. each owner orthogonalizes its matrices one after the other (through the tensor-parallel
   orthogonalizer, which makes them TP-global in exact TP modes: owners agree across TP ranks
   because bucket layouts do), and one ``all_to_all`` returns each rank exactly its pieces;
5. each rank applies weight decay and the scaled update to its shards (in ``Muon``).

Schedule. An exchange is the only DP-wide synchronization, so the Newton-Schulz time on the
critical path is, per exchange, the busiest owner's work: ``plan.critical_path_flops()`` (sum
over exchanges of the max over ranks). With one exchange per DP group every rank orthogonalizes
all the matrices it owns back to back, whatever the DDP bucket size: the critical path is the
busiest owner over the whole model (``plan.efficiency()`` = ideal / critical path, ideal =
total / dp). The former bucket-by-bucket schedule (one exchange per bucket) is still available
as ``window`` (elements per exchange) to show the difference (``bench/projection.py``).

Order. Every piece is ``(matrix, holder, owner, lo, hi)``; all pieces of an exchange are sorted
by one key, ``Piece.key = (owner, holder, matrix)``. A rank sends its held pieces in that order
(grouped by destination, as ``all_to_all_single`` needs) and an owner receives its pieces in that
order (grouped by source), so both sides of every link agree by construction.

Precision. The forward exchange moves the dtype Newton-Schulz consumes when that is narrower than
the configured exchange dtype: NS casts its input first, so rounding before or after the exchange
is the same rounding (bf16 NS moves bf16, exactly). Owners assemble whole matrices in the update
dtype (fp32 main params), so the scale is applied as in one process; the return exchange moves
the configured dtype (fp32: exact; bf16: rounds the update, as asked).

Memory, per rank and exchange (``plan.transient_bytes``): with S its own Muon shard elements and O
the elements of the matrices it owns, the exchange buffers hold at most ``S + O`` elements at a
time (the send buffer, which the communication library may hold until its work is released, and
the receive buffer, reused for the results when both directions use one dtype; the return
receive buffer replaces the forward one), plus the working set of ONE owned matrix while it is
orthogonalized (owners run their matrices one after the other). Balanced owners make ``O ~ S ~
M/dp`` (M = Muon elements of the DP group): ~``2 M/dp`` exchange elements + the largest owned
matrix's working set; a test measures the peak against this bound.

Bytes. Only owners receive whole matrices: per step a rank moves (sends + receives, each
direction) its own shard plus its owned matrices, ~``4 M/dp`` elements in all, against ``2 M``
for an all-gather plus reduce-scatter. Nothing here does arithmetic on the matrices; ``Muon``
hands the math in as ``matrix_fn``; the only collectives are in ``_all_to_all``.

Per-shard metadata (e.g. for QK-clip): ``muon.param_info[shard]`` is a ``ShardInfo``: ``matrix``
indexes ``distopt.muon_plan.matrices`` (a ``MatrixSlot``: name, TP-local shape, TP-global info)
and ``offset`` is the shard's first element within the flattened TP-local matrix;
``shard_location(distopt, shard)`` returns both.
"""

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor

from .muon_config import EXCHANGE_DTYPES
from .muon_functional import EXCHANGE_TIMER, MatrixFn, MuonParamInfo, Orthogonalizer, timed
from .newton_schulz import compute_dtype

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True, eq=False)
class ShardInfo(MuonParamInfo):
    """A Muon shard main param: the whole matrix's info plus where this shard sits in it."""

    matrix: int = -1  # index into MuonExchangePlan.matrices
    offset: int = 0  # first element of the shard within the (TP-local, flattened) matrix


@dataclass
class MatrixSlot:
    """A Muon matrix as the DistributedOptimizer lays it out: a range of one bucket."""

    name: str
    bucket: int  # index into MuonExchangePlan.buckets
    start: int  # element range within the bucket
    end: int
    local_shape: tuple[int, int]  # TP-local shape, as stored
    info: MuonParamInfo  # TP-global shape and QKV split: what the math needs
    cost: float  # Newton-Schulz FLOPs its owner executes (per TP rank)
    owner: int = -1


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

    def sends(self, rank: int) -> list[Piece]:
        return [p for p in self.pieces if p.holder == rank]

    def receives(self, rank: int) -> list[Piece]:
        return [p for p in self.pieces if p.owner == rank]

    def split_sizes(self, rank: int, world: int) -> tuple[list[int], list[int]]:
        """Forward (send, receive) elements per peer; the return exchange swaps them."""
        send, recv = [0] * world, [0] * world
        for p in self.pieces:
            if p.holder == rank:
                send[p.owner] += p.size
            if p.owner == rank:
                recv[p.holder] += p.size
        return send, recv


def ns_cost(info: MuonParamInfo, steps: int) -> float:
    """Newton-Schulz matmul FLOPs for one matrix (per QKV block when split).

    Per step ``X X^T`` (2 s^2 l), ``A A`` (2 s^3) and ``B X`` (2 s^2 l), s = min(m, n),
    l = max(m, n); elementwise work is left out.
    """
    return float(sum(steps * (4 * min(b) ** 2 * max(b) + 2 * min(b) ** 3) for b in _blocks(info)))


def _blocks(info: MuonParamInfo) -> list[tuple[int, int]]:
    rows, cols = info.shape
    if info.qkv_split is None:
        return [(rows, cols)]
    groups = rows // sum(info.qkv_split)
    return [(groups * r, cols) for r in info.qkv_split]


def tp_ns_cost(info: MuonParamInfo, steps: int, mode: str, tp: int) -> float:
    """NS FLOPs each TP rank of the owner executes, per TP mode (``muon_tp.py``).

    duplicated: the whole matrix on every TP rank; blockwise: the TP-local slice; distributed:
    the own row (column) shard with the n x n (m x m) Gram matrix, ``4 r n^2 + 2 n^3`` per step.
    """
    dim = getattr(info, "partition_dim", None)
    if tp == 1 or dim is None or mode == "duplicated":
        return ns_cost(info, steps)
    if mode == "blockwise":
        shape = list(info.shape)
        shape[dim] //= tp
        return ns_cost(MuonParamInfo(tuple(shape), info.qkv_split), steps)
    total = 0.0
    for rows, cols in _blocks(info):
        split, whole = (rows // tp, cols) if dim == 0 else (cols // tp, rows)
        total += steps * (4 * split * whole**2 + 2 * whole**3)
    return total


def assign_owners(costs: list[float], world: int) -> list[int]:
    """Longest-processing-time greedy: deterministic, so every rank computes the same owners."""
    loads = [0.0] * world
    owners = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = min(range(world), key=lambda r: (loads[r], r))
        owners[i] = rank
        loads[rank] += costs[i]
    return owners


def piece(slot: MatrixSlot, rank: int, shard_size: int) -> tuple[int, int]:
    """The part of ``slot`` (bucket-relative range) that DP rank ``rank`` holds; may be empty."""
    return max(slot.start, rank * shard_size), min(slot.end, (rank + 1) * shard_size)


def _holders(slot: MatrixSlot, shard_size: int) -> range:
    return range(slot.start // shard_size, (slot.end - 1) // shard_size + 1)


def group_exchanges(buckets: list[BucketSlot], matrices, window: Optional[int]) -> list[Exchange]:
    """Buckets -> exchanges: one per DP group, or (``window``) consecutive buckets of a group
    holding at least ``window`` Muon elements each (``window=1``: one per bucket)."""
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
    """Who owns which matrix and what every rank sends where; built once, used every step.

    A pure function of the layout (no collectives): the optimizer builds it from DistOpt's range
    maps, ``bench/projection.py`` from Megatron's bucket rule at any DP size.
    """

    def __init__(
        self,
        buckets: list[BucketSlot],
        matrices: list[MatrixSlot],
        rank: int,
        world: int,
        window: Optional[int] = None,
    ):
        self.buckets, self.matrices, self.rank, self.world = buckets, matrices, rank, world
        self.exchanges = group_exchanges(buckets, matrices, window)
        for ex in self.exchanges:
            owners = assign_owners([matrices[i].cost for i in ex.matrices], world)
            for i, owner in zip(ex.matrices, owners):
                matrices[i].owner = owner
            ex.pieces = sorted(self._pieces(ex), key=lambda p: p.key)

    def _pieces(self, ex: Exchange):
        for i in ex.matrices:
            slot = self.matrices[i]
            shard = self.buckets[slot.bucket].shard_size
            for holder in _holders(slot, shard):
                lo, hi = piece(slot, holder, shard)
                yield Piece(i, holder, slot.owner, lo - slot.start, hi - slot.start)

    def with_window(self, window: Optional[int]) -> "MuonExchangePlan":
        """The same layout under another schedule (``window``: see ``group_exchanges``); matrix
        indices are kept, so ``ShardInfo``s stay valid."""
        matrices = [dataclasses.replace(m, owner=-1) for m in self.matrices]
        return MuonExchangePlan(self.buckets, matrices, self.rank, self.world, window)

    # ---------------------------------------------------------------- counted figures
    def ns_flops(self, ex: Exchange) -> list[float]:
        """NS FLOPs each rank executes between the two all-to-alls of ``ex``."""
        flops = [0.0] * self.world
        for i in ex.matrices:
            flops[self.matrices[i].owner] += self.matrices[i].cost
        return flops

    def ns_flops_per_rank(self) -> list[float]:
        per_ex = [self.ns_flops(ex) for ex in self.exchanges]
        return [sum(f[r] for f in per_ex) for r in range(self.world)]

    def critical_path_flops(self) -> float:
        """Sum over the sync points (exchanges) of the busiest rank's NS FLOPs."""
        return sum(max(self.ns_flops(ex)) for ex in self.exchanges)

    def efficiency(self) -> float:
        """Ideal (total / dp) over the critical path: 1.0 = perfect, 1/dp = one rank does all."""
        total = sum(m.cost for m in self.matrices)
        return total / self.world / self.critical_path_flops() if self.matrices else 1.0

    def sync_points(self) -> int:
        return len(self.exchanges)

    def traffic(self, ex: Exchange) -> tuple[list[int], list[int]]:
        """Elements each rank sends and receives in the forward direction of ``ex`` (the return
        direction swaps them), self-copies excluded."""
        sent, received = [0] * self.world, [0] * self.world
        for p in ex.pieces:
            if p.holder != p.owner:
                sent[p.holder] += p.size
                received[p.owner] += p.size
        return sent, received

    def moved(self, ex: Exchange, rank: Optional[int] = None) -> int:
        """Elements ``rank`` sends plus receives in one direction of ``ex``."""
        rank = self.rank if rank is None else rank
        sent, received = self.traffic(ex)
        return sent[rank] + received[rank]

    def bytes_per_step(self, forward_itemsize: int, return_itemsize: int, rank=None) -> int:
        """Bytes ``rank`` sends plus receives per step, both directions, self-copies excluded."""
        moved = sum(self.moved(ex, rank) for ex in self.exchanges)
        return moved * (forward_itemsize + return_itemsize)

    def transient_bytes(self, forward_itemsize, return_itemsize, working_set, rank=None) -> int:
        """Upper bound of the exchange's transient memory on ``rank`` (module docstring):
        the largest phase of one exchange, plus ``working_set(slot)`` of its largest owned
        matrix (bytes NS holds while orthogonalizing it)."""
        rank = self.rank if rank is None else rank
        f, r = forward_itemsize, return_itemsize
        worst = 0
        for ex in self.exchanges:
            held = sum(p.size for p in ex.sends(rank))
            owned = sum(p.size for p in ex.receives(rank))
            mine = [self.matrices[i] for i in ex.matrices if self.matrices[i].owner == rank]
            work = max((working_set(m) for m in mine), default=0)
            results = 0 if f == r else owned * r  # else written over the received pieces
            # The communication library may keep the forward send buffer until its work is
            # released (gloo and NCCL hold the tensors of a collective), so it counts throughout.
            buffers = held * f + owned * f + results
            worst = max(worst, buffers + max(work, held * r))  # NS, or the return exchange
        return worst


def working_set_bytes(slot: MatrixSlot, update_itemsize: int, ns_itemsize: int, tp: int) -> int:
    """Bytes live while one owned matrix is orthogonalized: the assembled matrix, its TP-global
    gather and result (update dtype), NS's input copy and two X buffers, Gram and polynomial
    (NS dtype), plus the QKV path's block copies. An upper bound; measured in the tests."""
    local, whole = math.prod(slot.local_shape), math.prod(slot.info.shape)
    s = min(slot.info.shape)
    gathered = whole if tp > 1 else 0
    blocks = 2 * whole if slot.info.qkv_split is not None else 0
    return (
        (local + gathered + whole + blocks) * update_itemsize
        + 3 * whole * ns_itemsize
        + 2 * s * s * ns_itemsize
    )


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
        self.return_dtype = DTYPES[exchange_dtype]
        self.forward_dtype = min((self.return_dtype, ns_dtype), key=_itemsize)
        self.update_dtype = update_dtype  # DistOpt's main params (fp32)
        self.device = device  # of the grad buffers: where a rank without Muon shards exchanges
        self.bytes_moved = 0  # of the last step, counted from the split sizes actually used
        self.timers = getattr(inner, "timers", None)  # Megatron's: times the all-to-alls

    @property
    def dtype(self) -> torch.dtype:
        """The dtype results come back in (what ``muon_distopt_exchange_dtype`` names)."""
        return self.return_dtype

    def __call__(
        self, updates: list[Tensor], infos: list[MuonParamInfo], matrix_fn: MatrixFn
    ) -> list[Tensor]:
        by_matrix = {info.matrix: u for u, info in zip(updates, infos)}
        if len(by_matrix) != len(updates) or any(not isinstance(i, ShardInfo) for i in infos):
            raise AssertionError("DistributedMuonOrthogonalizer needs one ShardInfo per matrix")
        assert all(u.dtype == self.update_dtype for u in updates), "updates in the main dtype"
        device = updates[0].device if updates else self.device
        self.bytes_moved, out = 0, {}
        for ex in self.plan.exchanges:
            out.update(self._run(ex, by_matrix, matrix_fn, device))
        return [out[info.matrix].to(u.dtype) for u, info in zip(updates, infos)]

    def _run(self, ex: Exchange, by_matrix: dict, matrix_fn, device) -> dict[int, Tensor]:
        """One sync point: pieces to owners, owners' NS, result pieces back to their holders."""
        rank = self.plan.rank
        sends, receives = ex.sends(rank), ex.receives(rank)
        flat = [by_matrix[p.matrix].reshape(-1).to(self.forward_dtype) for p in sends]
        assert [t.numel() for t in flat] == [p.size for p in sends], "shard = held piece"
        received = self._all_to_all(ex, flat, self.forward_dtype, device, forward=True)
        del flat
        results = self._orthogonalize_owned(receives, received, matrix_fn)
        back = self._all_to_all(ex, [results], self.return_dtype, device, forward=False)
        at, out = 0, {}
        for p in sends:
            out[p.matrix] = back[at : at + p.size]
            at += p.size
        return out

    def _orthogonalize_owned(self, receives: list[Piece], received: Tensor, matrix_fn) -> Tensor:
        """NS of each owned matrix in turn; results laid out like ``received`` (same pieces,
        same order), in the return dtype: over ``received`` itself when the dtypes agree."""
        same = self.return_dtype == self.forward_dtype
        results = received if same else torch.empty_like(received, dtype=self.return_dtype)
        for i, at in _offsets_by_matrix(receives).items():
            slot = self.plan.matrices[i]
            whole = received.new_empty(math.prod(slot.local_shape), dtype=self.update_dtype)
            for p, offset in at:
                whole[p.lo : p.hi] = received[offset : offset + p.size]
            orth = self.inner([whole.view(slot.local_shape)], [slot.info], matrix_fn)[0]
            del whole
            orth = orth.reshape(-1)
            for p, offset in at:
                results[offset : offset + p.size] = orth[p.lo : p.hi]
        return results

    def _all_to_all(self, ex: Exchange, chunks: list, dtype, device, forward: bool) -> Tensor:
        """The only collective: forward split sizes, or swapped for the return exchange."""
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


def _offsets_by_matrix(receives: list[Piece]) -> dict[int, list[tuple[Piece, int]]]:
    """{owned matrix: [(piece, offset in the received buffer)]}, matrices in first-seen order."""
    out: dict[int, list] = {}
    at = 0
    for p in receives:
        out.setdefault(p.matrix, []).append((p, at))
        at += p.size
    return out


def _itemsize(dtype: torch.dtype) -> int:
    return torch.finfo(dtype).bits // 8


# ------------------------------------------------------------------ building the plan from DistOpt


def param_names(distopt) -> dict:
    """{model param: name}, unique over the model chunks: upstream's names for one chunk (expert
    indices global, as ``handle_experts_in_state_dict`` makes them); with virtual pipeline stages
    the chunks share local names, so each chunk's names get a ``chunk{i}.`` prefix."""
    if getattr(distopt, "muon_param_names", None) is None:
        from ..transformer.fsdp_dtensor_checkpoint import handle_experts_in_state_dict

        chunks = distopt.model_chunks
        experts = chunks[0].config.num_moe_experts if chunks else None
        names = {}
        for i, chunk in enumerate(chunks):
            named = handle_experts_in_state_dict(dict(chunk.named_parameters()), experts)
            prefix = f"chunk{i}." if len(chunks) > 1 else ""
            names.update({p: prefix + n for n, p in named.items()})
        distopt.muon_param_names = names
    return distopt.muon_param_names


def param_name(distopt, param) -> str:
    """The checkpoint name of a model param of ``distopt`` (see ``param_names``)."""
    return param_names(distopt)[param]


def build_plan(distopt, tp_info_of, cost_of: Callable, window=None) -> MuonExchangePlan:
    """The exchange plan from DistOpt's range maps.

    ``tp_info_of(model_param)`` gives the TP-global ``MuonParamInfo`` of a Muon model param and
    None for AdamW params; ``cost_of(info)`` the NS FLOPs its owner executes. Every rank builds
    the same plan: bucket layouts are identical across the DP group (and across TP ranks), and
    owners are a pure function of them.
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
                start, end, _ = buffer.param_index_map[param]
                slot.matrices.append(len(matrices))
                matrices.append(
                    MatrixSlot(
                        name=param_name(distopt, param),
                        bucket=len(buckets),
                        start=start - bucket.offset,
                        end=end - bucket.offset,
                        local_shape=tuple(param.shape),
                        info=info,
                        cost=cost_of(info),
                    )
                )
            slot.matrices.sort(key=lambda i: matrices[i].start)
            buckets.append(slot)
    group = buckets[0].group if buckets else None
    rank, world = (group.rank(), group.size()) if group is not None else (0, 1)
    return MuonExchangePlan(buckets, matrices, rank, world, window)


def shard_infos(distopt, plan: MuonExchangePlan, muon_params: set) -> dict:
    """{shard main param: ShardInfo} for the Muon params among DistOpt's shards."""
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
    shard main param of ``distopt``: what e.g. QK-clip needs to find its rows."""
    info = distopt.optimizer.param_info[shard]
    return distopt.muon_plan.matrices[info.matrix], info.offset


def _tp_cost_fn(inner, steps: int) -> Callable:
    """NS FLOPs an owner's TP rank executes for a matrix, per the inner orthogonalizer's mode."""
    from .muon_tp import TPOrthogonalizer

    if not isinstance(inner, TPOrthogonalizer):
        return lambda info: ns_cost(info, steps)

    def cost(info):
        group = inner._group(info)
        tp = group.size() if group is not None else 1
        return tp_ns_cost(info, steps, inner.mode, tp)

    return cost


def attach(distopt, muon, exchange_dtype: str = "fp32", window: Optional[int] = None) -> None:
    """Make ``muon`` (the DistributedOptimizer's inner optimizer) step DP-sharded params exactly.

    Called once from ``DistributedOptimizer.__init__`` after it replaced the inner optimizer's
    params by 1-D shard main params. ``muon.param_info`` still maps the *model* params to their
    TP-global infos; afterwards it maps the shards to ``ShardInfo``s, and ``muon.orthogonalizer``
    routes whole matrices to their owners around the tensor-parallel orthogonalizer it had.
    """
    specs = muon.ortho_specs()
    if len(specs) > 1:
        raise ValueError(
            "with use_distributed_optimizer all Muon param groups must share the Newton-Schulz "
            f"and scale settings (one owner runs each matrix); got {len(specs)} different ones"
        )
    steps = specs[0].steps if specs else 0
    ns_dtype = compute_dtype(specs[0].precision) if specs else torch.float32
    muon_params = {p for p in distopt.model_param_group_index_map if muon.param_info.get(p)}
    plan = build_plan(distopt, muon.param_info.get, _tp_cost_fn(muon.orthogonalizer, steps), window)
    muon.param_info = shard_infos(distopt, plan, muon_params)
    device = distopt.buffers[0].grad_data.device if distopt.buffers else None
    muon.orthogonalizer = DistributedMuonOrthogonalizer(
        plan, muon.orthogonalizer, exchange_dtype, ns_dtype, device=device
    )
    # A per-rank raise on a non-finite grad would leave the other DP ranks waiting in the
    # exchange; Megatron's own checks (grad scaler found_inf, DDP's NaN check) are collective.
    muon.on_nonfinite_grad = "ignore"
    distopt.muon_plan = plan
