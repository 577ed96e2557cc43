"""Tensor-parallel orthogonalizers for Muon (``muon_tp_mode``): every TP collective of Muon
lives here. ``duplicated`` and ``distributed`` are exact, ``blockwise`` is not TP-invariant:
docs/tp_modes.md.
"""

import functools
from typing import Any

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
    orthogonalize_sharded_steps,
    timed,
)
from .newton_schulz import GATHER, SUM, serve


class TPOrthogonalizer:
    """Muon ``Orthogonalizer`` for TP-sharded params (infos carry ``partition_dim``, ``expert``);
    ``groups`` maps ``info.expert`` to its (expert) TP group. Unsharded params are orthogonalized
    as they are."""

    def __init__(self, mode: str, groups: dict[bool, Any], timers=None) -> None:
        assert mode in TP_MODES, f"a validated TP mode, got {mode!r}"
        self.mode = mode
        self.groups = groups
        self.timers = timers

    def __call__(self, updates: list[Tensor], infos: list, spec: OrthoSpec) -> list[Tensor]:
        with timed(self.timers, NS_TIMER):
            out = [
                None if self._local(info) else self._one(u, info, spec)
                for u, info in zip(updates, infos)
            ]
            here = [i for i, o in enumerate(out) if o is None]  # no collective: batched chains
            infos_here = [self.scale_info(infos[i], updates[i].shape) for i in here]
            orths = orthogonalize_matrices([updates[i] for i in here], infos_here, spec)
            for i, orth in zip(here, orths):
                out[i] = orth
            return out

    def _local(self, info) -> bool:
        """Whether ``_one`` orthogonalizes ``info``'s matrix with no collective."""
        return self.mode == "blockwise" or self._group(info) is None

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
        if self.mode == "duplicated":
            orth = orthogonalize(_all_gather_dim(u, info.partition_dim, group), info, spec)
            return orth.chunk(dist.get_world_size(group), dim=info.partition_dim)[
                dist.get_rank(group)
            ]
        return _distributed_orthogonalize(u, info, spec, group)


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


def _distributed_orthogonalize(u: Tensor, info, spec: OrthoSpec, group) -> Tensor:
    """``s * NS(U)`` of this rank's shard in the ``distributed`` mode; the math gets a sum over
    ``group``, never the group."""
    dim = info.partition_dim
    assert info.qkv_split is None or dim == 0, "a fused QKV weight is split by rows"
    reduce = functools.partial(dist.all_reduce, group=group)
    k, p = dist.get_world_size(group), dist.get_rank(group)
    gather = functools.partial(gather_rows, p=p, k=k, group=group)
    steps = orthogonalize_sharded_steps(u, info, spec, dim, part=(p, k))
    return serve(steps, {SUM: reduce, GATHER: gather})


def gather_rows(poly: Tensor, p: int, k: int, group) -> None:
    """Fill the rows of ``poly`` that other TP ranks computed (``cut(g, k)``) with one all-gather.

    Args:
        poly: the ``g x g`` polynomial, this rank's rows filled; completed in place.
        p: this rank's index in ``group``.
        k: the size of ``group``.
        group: the tensor-parallel process group.
    """
    g, cols = poly.shape
    bounds = [(q * g // k * cols, (q + 1) * g // k * cols) for q in range(k)]
    all_gather_ranges(poly.view(-1), bounds, p, group)


def all_gather_ranges(flat: Tensor, bounds: list[tuple[int, int]], p: int, group) -> None:
    """Fill ``flat`` from every rank's ``flat[bounds[q]]`` with one ``all_gather_into_tensor`` (the
    ranges padded to the longest: uneven ranges need no second collective).

    Args:
        flat: a 1-D tensor of the same size on every rank; this rank's range is filled.
        bounds: one (start, end) per rank of ``group``, in rank order.
        p: this rank's index in ``group``.
        group: the process group.
    """
    chunk = max(hi - lo for lo, hi in bounds)
    own = flat.new_zeros(chunk)
    own[: bounds[p][1] - bounds[p][0]] = flat[bounds[p][0] : bounds[p][1]]
    chunks = flat.new_empty(len(bounds) * chunk)
    dist.all_gather_into_tensor(chunks, own, group=group)
    for q, (lo, hi) in enumerate(bounds):
        if q != p:
            flat[lo:hi] = chunks[q * chunk : q * chunk + hi - lo]


def owners_orthogonalizer(inner: Orthogonalizer, infos: list) -> Orthogonalizer:
    """Owners' orthogonalizer: ``inner`` where TP shards a Muon matrix, else a local one.

    Args:
        inner: Muon's orthogonalizer.
        infos: the Muon matrices' TP-global infos.

    Returns:
        The orthogonalizer owners run (at TP=1 the step never enters tp.py).
    """
    if isinstance(inner, TPOrthogonalizer) and any(inner._group(i) is not None for i in infos):
        return inner
    return LocalOrthogonalizer(getattr(inner, "timers", None))
