"""Muon inside Megatron's DistributedOptimizer (ZeRO-1): exact, balanced, one exchange per step.

DistOpt shards ignore param boundaries; Newton-Schulz needs whole matrices. Per step and DP group
one ``all_to_all`` sends every shard piece of every Muon matrix to its owner (or to the members
of its gang: muon_gangs.py, entered only where the plan splits a matrix), owners orthogonalize,
one ``all_to_all`` returns the pieces. The only collective here is ``_all_to_all``; the math
comes in as ``matrix_fn``. Schedule, precision, memory and bytes: docs/distopt_exchange.md.
"""

import dataclasses
import functools
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from .distopt_layout import in_bucket, param_name
from .muon_config import EXCHANGE_DTYPES
from .muon_functional import (
    EXCHANGE_TIMER,
    LocalOrthogonalizer,
    MatrixFn,
    MuonParamInfo,
    Orthogonalizer,
    ortho_spec_of,
    scale_flat_,
    timed,
)
from .muon_gangs import GangRunner, gang_nodes
from .muon_plan import (
    BucketSlot,
    Exchange,
    MatrixSlot,
    MuonExchangePlan,
    Piece,
    ns_cost,
    tp_ns_cost,
)
from .muon_split import DEFAULT_LINKS, NSCostModel, PlanLinks, block_views
from .muon_tp import TPOrthogonalizer
from .newton_schulz import compute_dtype

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True, eq=False)
class ShardInfo(MuonParamInfo):
    """A Muon shard main param: the whole matrix's info plus where this shard sits in it."""

    matrix: int = -1  # index into MuonExchangePlan.matrices
    offset: int = 0  # first element of the shard within the (TP-local, flattened) matrix


class DistributedMuonOrthogonalizer:
    """Orthogonalizer for DP-sharded Muon params; wraps the orthogonalizer owners run (the local
    one, or the TP one where TP shards a matrix). ``gangs`` (muon_gangs.py's ``GangRunner``) runs
    the blocks of matrices the plan splits: a plug-in, entered only where a gang exists."""

    def __init__(
        self,
        plan: MuonExchangePlan,
        inner: Orthogonalizer,
        exchange_dtype: str,
        ns_dtype: torch.dtype = torch.float32,
        update_dtype: torch.dtype = torch.float32,
        device=None,
        gangs=None,
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
        self.sum_bytes = 0.0  # of the last step's gang collectives (ring model)
        self.gangs = gangs

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
        """NS of the owned units: gang blocks together (muon_gangs.py), then whole matrices
        one at a time; results laid out like ``received`` (same pieces, same order), in the
        return dtype: over ``received`` itself when the dtypes agree."""
        same = self.return_dtype == self.forward_dtype
        results = received if same else torch.empty_like(received, dtype=self.return_dtype)
        at = _offsets_by_matrix(receives)
        gangs = [i for i in ex.gangs if i in at]
        if gangs:
            assert self.gangs is not None, "a plan with gangs needs a GangRunner (muon_gangs.py)"
            blocks = [self._assemble(i, at[i], received) for i in gangs]
            orths = self.gangs.run(self.plan, ex, gangs, blocks, matrix_fn)
            self.sum_bytes += self.gangs.sum_bytes
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
        self.bytes_moved += (sum(send) + sum(recv) - send[rank] - recv[rank]) * _itemsize(dtype)
        return out


def exchange_dtypes(exchange_dtype: str, ns_dtype: torch.dtype, update_dtype: torch.dtype):
    """The dtypes the exchange moves: (forward, return, whether holders apply the scale).

    Forward: the narrower of ``exchange_dtype`` and the NS dtype (NS casts its input first: the
    same rounding, earlier). Return: with NS narrower than the update, its unscaled output in the
    NS dtype, scaled by the holders (bit-identical); else the scaled update in
    ``exchange_dtype`` (docs/distopt_exchange.md, "Precision").

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


def owners_orthogonalizer(inner: Orthogonalizer, infos: list) -> Orthogonalizer:
    """What owners orthogonalize whole matrices with: ``inner`` (Muon's TP orthogonalizer)
    where TP shards one of ``infos``, else the local one (same numbers, with its timers): at
    TP=1 the step never enters muon_tp.py.

    Args:
        inner: Muon's orthogonalizer before ``attach`` wraps it.
        infos: the TP-global infos of the Muon params.

    Returns:
        ``inner``, or a ``LocalOrthogonalizer``.
    """
    if isinstance(inner, TPOrthogonalizer) and any(inner._group(i) is not None for i in infos):
        return inner
    return LocalOrthogonalizer(getattr(inner, "timers", None))


def _unscaled(matrix_fn):
    """Muon's ``orthogonalize_matrices`` partial with the scale left out (``apply_scale``)."""
    spec = dataclasses.replace(ortho_spec_of(matrix_fn), apply_scale=False)
    return functools.partial(matrix_fn.func, spec=spec)


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
    if distopt.buffers:  # where gangs may ring
        group = distopt.buffers[0].data_parallel_group
        infos = [muon.param_info.get(p) for p in muon_params]
        nodes = gang_nodes(group, links.nvlink_domain, muon.orthogonalizer, infos)
        model = dataclasses.replace(model, nodes=nodes)
    plan = build_plan(distopt, muon.param_info.get, model, window)
    infos = [muon.param_info[p] for p in muon_params]
    muon.param_info = shard_infos(distopt, plan, muon_params)
    device = distopt.buffers[0].grad_data.device if distopt.buffers else None
    muon.orthogonalizer = DistributedMuonOrthogonalizer(
        plan,
        owners_orthogonalizer(muon.orthogonalizer, infos),
        exchange_dtype,
        ns_dtype,
        device=device,
        gangs=GangRunner(muon.orthogonalizer, device),  # the TP one: gang blocks share TP
    )
    # A per-rank raise on a non-finite grad would leave the other DP ranks waiting in the
    # exchange; Megatron's own checks (grad scaler found_inf, DDP's NaN check) are collective.
    muon.on_nonfinite_grad = "ignore"
    distopt.muon_plan = plan
