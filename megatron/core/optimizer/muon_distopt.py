"""Muon inside Megatron's DistributedOptimizer (ZeRO-1): exact, balanced, bucketed.

The DistributedOptimizer cuts every grad bucket into ``dp`` equal contiguous pieces that ignore
parameter boundaries, so a rank's Muon params are 1-D shards: a matrix may be spread over several
ranks, and a rank may hold none of it. Newton-Schulz needs whole matrices. Per step:

1. each rank updates momentum for its own shards (elementwise, in ``Muon``);
2. every Muon matrix has one *owner* rank in the DP group, chosen once to balance Newton-Schulz
   FLOPs (longest-processing-time greedy on ``cost = steps * (4 s^2 l + 2 s^3)``, s = min(m, n),
   l = max(m, n), summed over QKV blocks);
3. per bucket, one ``all_to_all`` sends each shard piece of a matrix to the matrix's owner, which
   assembles it (TP-local; the tensor-parallel orthogonalizer then makes it TP-global in exact
   TP modes: owners agree across TP ranks because bucket layouts do);
4. the owner orthogonalizes, and a second ``all_to_all`` per bucket returns each rank exactly the
   pieces of the result that it holds;
5. each rank applies weight decay and the scaled update to its shards (in ``Muon``).

Steps 3-4 run bucket by bucket, so the transient buffers (pieces sent and received, the owned
whole matrices and their results) stay within about one bucket's Muon elements per rank.

Only owners receive whole matrices, so per step a rank moves (sends + receives) at most its own
Muon shard bytes plus the bytes of the matrices it owns, in each direction: about ``4 M / dp`` for
``M`` Muon bytes in the instance, against ``2 M`` for an all-gather plus reduce-scatter. Nothing
here does arithmetic on the matrices; ``Muon`` hands the math in as ``matrix_fn``.
"""

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor

from .muon_config import EXCHANGE_DTYPES
from .muon_functional import MatrixFn, MuonParamInfo, Orthogonalizer


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
    cost: float
    owner: int = -1


@dataclass
class BucketSlot:
    """One DP-sharded bucket: its group and the per-rank split sizes of both exchanges."""

    group: object  # the bucket's data-parallel process group
    shard_size: int
    matrices: list[int] = field(default_factory=list)  # in bucket order
    send: list[int] = field(default_factory=list)  # forward split sizes (elements) per rank
    recv: list[int] = field(default_factory=list)
    # Forward send order = backward receive order: this rank's pieces, by (owner, matrix).
    mine: list[int] = field(default_factory=list)
    # Forward receive order = backward send order: (matrix, lo, hi) pieces of the owned matrices,
    # by (source rank, matrix); lo, hi are element offsets within the flattened matrix.
    owned_pieces: list[tuple[int, int, int]] = field(default_factory=list)


def ns_cost(info: MuonParamInfo, steps: int) -> float:
    """Newton-Schulz matmul FLOPs for one matrix (per QKV block when split).

    Per step ``X X^T`` (2 s^2 l), ``A A`` (2 s^3) and ``B X`` (2 s^2 l), s = min(m, n),
    l = max(m, n); elementwise work is left out.
    """
    rows, cols = info.shape
    blocks = [(rows, cols)]
    if info.qkv_split is not None:
        groups = rows // sum(info.qkv_split)
        blocks = [(groups * r, cols) for r in info.qkv_split]
    return float(sum(steps * (4 * min(b) ** 2 * max(b) + 2 * min(b) ** 3) for b in blocks))


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


class MuonExchangePlan:
    """Who owns which matrix and what every rank sends where; built once, used every step."""

    def __init__(self, buckets: list[BucketSlot], matrices: list[MatrixSlot], rank: int):
        self.buckets, self.matrices, self.rank = buckets, matrices, rank
        world = buckets[0].group.size() if buckets else 1
        for slot, owner in zip(matrices, assign_owners([m.cost for m in matrices], world)):
            slot.owner = owner
        for bucket in buckets:
            self._split_sizes(bucket, world)

    def _split_sizes(self, bucket: BucketSlot, world: int) -> None:
        bucket.send, bucket.recv = [0] * world, [0] * world
        slots = [(i, self.matrices[i]) for i in bucket.matrices]
        for i, slot in sorted(slots, key=lambda item: (item[1].owner, item[0])):
            lo, hi = piece(slot, self.rank, bucket.shard_size)
            if hi > lo:
                bucket.send[slot.owner] += hi - lo
                bucket.mine.append(i)
        for src in range(world):
            for i, slot in slots:
                lo, hi = piece(slot, src, bucket.shard_size)
                if slot.owner == self.rank and hi > lo:
                    bucket.recv[src] += hi - lo
                    bucket.owned_pieces.append((i, lo - slot.start, hi - slot.start))

    def ns_flops_per_rank(self) -> list[float]:
        world = self.buckets[0].group.size() if self.buckets else 1
        flops = [0.0] * world
        for m in self.matrices:
            flops[m.owner] += m.cost
        return flops

    def moved(self, bucket: BucketSlot) -> int:
        """Elements this rank sends plus receives in one exchange of ``bucket`` (either
        direction: the backward exchange swaps the split sizes), self-copies excluded."""
        off_rank = [
            n for sizes in (bucket.send, bucket.recv) for r, n in enumerate(sizes) if r != self.rank
        ]
        return sum(off_rank)

    def bytes_per_step(self, itemsize: int) -> int:
        """Bytes this rank sends plus receives per step, both exchanges, self-copies excluded."""
        return 2 * itemsize * sum(self.moved(b) for b in self.buckets)


class DistributedMuonOrthogonalizer:
    """Orthogonalizer for DP-sharded Muon params; wraps the TP orthogonalizer run by owners."""

    def __init__(
        self, plan: MuonExchangePlan, inner: Orthogonalizer, exchange_dtype: str, device=None
    ):
        if exchange_dtype not in EXCHANGE_DTYPES:
            raise ValueError(
                f"muon exchange dtype {exchange_dtype!r} unknown; allowed: {list(EXCHANGE_DTYPES)}"
            )
        self.plan, self.inner = plan, inner
        self.device = device  # of the grad buffers: where a rank without Muon shards exchanges
        self.dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[exchange_dtype]
        self.itemsize = torch.finfo(self.dtype).bits // 8
        self.bytes_moved = 0  # of the last step, counted from the split sizes actually used

    def __call__(
        self, updates: list[Tensor], infos: list[MuonParamInfo], matrix_fn: MatrixFn
    ) -> list[Tensor]:
        by_matrix = {info.matrix: u for u, info in zip(updates, infos)}
        if len(by_matrix) != len(updates) or any(not isinstance(i, ShardInfo) for i in infos):
            raise AssertionError("DistributedMuonOrthogonalizer needs one ShardInfo per matrix")
        device = updates[0].device if updates else self.device
        pieces, self.bytes_moved = {}, 0
        for bucket in self.plan.buckets:  # one bucket at a time: transient memory ~ one bucket
            whole = self._gather_to_owners(bucket, by_matrix, device)
            owned = list(whole)
            infos_owned = [self.plan.matrices[i].info for i in owned]
            results = self.inner([whole[i] for i in owned], infos_owned, matrix_fn)
            pieces.update(self._scatter_from_owners(bucket, dict(zip(owned, results)), device))
        return [pieces[info.matrix].to(u.dtype) for u, info in zip(updates, infos)]

    def _gather_to_owners(self, bucket: BucketSlot, by_matrix: dict, device) -> dict[int, Tensor]:
        """Forward exchange: the owners in this bucket receive every piece of their matrices."""
        send = [by_matrix[i].to(self.dtype) for i in bucket.mine]
        recv = self._all_to_all(send, bucket.send, bucket.recv, bucket.group, device)
        self.bytes_moved += self.plan.moved(bucket) * self.itemsize
        flat, at = {}, 0
        for i, lo, hi in bucket.owned_pieces:
            if i not in flat:
                flat[i] = torch.empty(
                    _numel(self.plan.matrices[i]), dtype=self.dtype, device=device
                )
            flat[i][lo:hi] = recv[at : at + hi - lo]
            at += hi - lo
        return {i: data.view(self.plan.matrices[i].local_shape) for i, data in flat.items()}

    def _scatter_from_owners(self, bucket: BucketSlot, results: dict, device) -> dict[int, Tensor]:
        """Backward exchange: each rank receives exactly its pieces of the bucket's results."""
        send = [results[i].reshape(-1)[lo:hi].to(self.dtype) for i, lo, hi in bucket.owned_pieces]
        recv = self._all_to_all(send, bucket.recv, bucket.send, bucket.group, device)
        self.bytes_moved += self.plan.moved(bucket) * self.itemsize
        pieces, at = {}, 0
        for i in bucket.mine:
            lo, hi = piece(self.plan.matrices[i], self.plan.rank, bucket.shard_size)
            pieces[i] = recv[at : at + hi - lo]
            at += hi - lo
        return pieces

    def _all_to_all(self, send: list, send_sizes, recv_sizes, group, device) -> Tensor:
        inp = torch.cat(send) if send else torch.empty(0, dtype=self.dtype, device=device)
        out = torch.empty(sum(recv_sizes), dtype=self.dtype, device=device)
        torch.distributed.all_to_all_single(
            out,
            inp,
            output_split_sizes=list(recv_sizes),
            input_split_sizes=list(send_sizes),
            group=group,
        )
        return out


def _numel(slot: MatrixSlot) -> int:
    return math.prod(slot.local_shape)


# ------------------------------------------------------------------ building the plan from DistOpt


@dataclass(frozen=True)
class ShardMeta:
    """What a DistributedOptimizer shard main param covers; one per shard, built once."""

    name: str  # the model param's name
    buffer: int  # index into distopt.buffers
    bucket: int  # bucket index within that buffer
    param_range: tuple[int, int]  # elements of the flattened model param held here
    bucket_range: tuple[int, int]  # the same elements within the bucket
    shape: tuple[int, ...]  # the model param's (TP-local) shape
    partition_dim: int  # TP partition dim (-1: not TP-sharded)
    muon: Optional[ShardInfo]  # None: an AdamW param


def build_plan(distopt, tp_info_of, ns_steps: int) -> tuple[MuonExchangePlan, dict]:
    """The exchange plan and ``{shard main param: ShardMeta}``, from DistOpt's range maps.

    ``tp_info_of(model_param)`` gives the TP-global ``MuonParamInfo`` of a Muon model param and
    None for AdamW params. Every rank builds the same plan: bucket layouts are identical across
    the DP group (and across TP ranks), and owners are a pure function of them.
    """
    buckets, matrices, matrix_of = [], [], {}
    for buffer in distopt.buffers:
        for bucket in buffer.buckets:
            group = buffer.data_parallel_group
            slot = BucketSlot(group=group, shard_size=bucket.grad_data.numel() // group.size())
            for param in bucket.params_list:
                info = tp_info_of(param)
                if info is None:
                    continue
                start, end, _ = buffer.param_index_map[param]
                matrix_of[param] = len(matrices)
                slot.matrices.append(len(matrices))
                matrices.append(
                    MatrixSlot(
                        name=distopt._param_name(param),
                        bucket=len(buckets),
                        start=start - bucket.offset,
                        end=end - bucket.offset,
                        local_shape=tuple(param.shape),
                        info=info,
                        cost=ns_cost(info, ns_steps),
                    )
                )
            slot.matrices.sort(key=lambda i: matrices[i].start)
            buckets.append(slot)
    rank = buckets[0].group.rank() if buckets else 0
    plan = MuonExchangePlan(buckets, matrices, rank)
    return plan, _shard_metas(distopt, matrices, matrix_of)


def _shard_metas(distopt, matrices: list, matrix_of: dict) -> dict:
    metas = {}
    for param, (gi, order) in distopt.model_param_group_index_map.items():
        shard = distopt.optimizer.param_groups[gi]["params"][order]
        gbuf, _, bucket = distopt.model_param_gbuf_map[param]
        ranges = distopt._get_model_param_range_map(param)
        muon = None
        if param in matrix_of:
            info = matrices[matrix_of[param]].info
            muon = ShardInfo(info.shape, info.qkv_split, matrix_of[param], ranges["param"].start)
        metas[shard] = ShardMeta(
            name=distopt._param_name(param),
            buffer=gbuf,
            bucket=bucket,
            param_range=(ranges["param"].start, ranges["param"].end),
            bucket_range=(ranges["gbuf_world_in_bucket"].start, ranges["gbuf_world_in_bucket"].end),
            shape=tuple(param.shape),
            partition_dim=getattr(param, "partition_dim", -1)
            if getattr(param, "tensor_model_parallel", False)
            else -1,
            muon=muon,
        )
    return metas


def attach(distopt, muon, exchange_dtype: str = "fp32") -> None:
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
    plan, metas = build_plan(distopt, muon.param_info.get, steps)
    muon.param_info = {shard: meta.muon for shard, meta in metas.items() if meta.muon}
    device = distopt.buffers[0].grad_data.device if distopt.buffers else None
    muon.orthogonalizer = DistributedMuonOrthogonalizer(
        plan, muon.orthogonalizer, exchange_dtype, device
    )
    # A per-rank raise on a non-finite grad would leave the other DP ranks waiting in the
    # exchange; Megatron's own checks (grad scaler found_inf, DDP's NaN check) are collective.
    muon.on_nonfinite_grad = "ignore"
    distopt.shard_meta = metas
    distopt.muon_plan = plan
