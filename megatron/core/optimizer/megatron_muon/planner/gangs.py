"""Running gangs: a matrix split over several DP ranks, each orthogonalizing one block; the
gang's sums and gathers are async collectives on a process group per gang. docs/gangs.md.
"""

import functools
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from ..exchange import Exchange
from ..functional import OrthoSpec, orthogonalize_sharded_steps
from ..newton_schulz import GATHER, SUM, Pieces, Then, compute_dtype, interleave
from ..tp import TPOrthogonalizer, all_gather_ranges, post_gather_ranges, reduce_scatter_ranges
from .cost_model import cut, lone_gangs, node_layout, ring_traffic, spreads


class GangRunner:
    """Runs this rank's gang blocks of one exchange, all in flight together; ``sum_bytes``:
    the bytes its gang collectives moved (ring model, ``cost_model.ring_traffic``)."""

    def __init__(self, inner):
        # the TP orthogonalizer: ``duplicated``, TP ranks share a gathered block; ``distributed``
        # (``partial``), each TP rank holds its own part of the block and adds its partial sums
        self.inner = inner
        mode = inner.mode if isinstance(inner, TPOrthogonalizer) else None
        self.partial = mode == "distributed"
        self.plan = None  # of the exchange being run
        self.sum_bytes = 0.0  # of the last ``run``
        self.groups: dict[tuple[int, ...], object] = {}  # global ranks -> group (None: not in)

    def make_groups(self, plan) -> None:
        """One process group per distinct gang of ``plan``, in plan order; every rank of the DP
        group calls it, with the same plan (at ``attach``, and after any re-plan).

        Args:
            plan: the ``MuonExchangePlan``.
        """
        for ex in plan.exchanges:
            ranks = torch.distributed.get_process_group_ranks(ex.group)
            for i in ex.gangs:
                members = plan.matrices[i].units[0].members
                key = tuple(ranks[m] for m in members)
                if key in self.groups:
                    continue
                self.groups[key] = _new_group(ex.group, members, key, plan.rank in members)

    def run(self, plan, ex: Exchange, gangs: list[int], blocks: list[Tensor], spec: OrthoSpec):
        """``s * NS`` of this rank's gang blocks, their collectives overlapping the others'
        matmuls (in the ``duplicated`` TP mode, TP-gathered all first).

        Args:
            plan: the ``MuonExchangePlan`` ``ex`` belongs to.
            ex: the exchange.
            gangs: the split matrices this rank holds a block of, in the plan's gang order.
            blocks: this rank's block of each, in the update dtype.
            spec: Newton-Schulz and scale settings.

        Returns:
            The orthogonalized, scaled blocks, in ``gangs`` order.
        """
        self.plan, self.sum_bytes = plan, 0.0
        slots = [self.plan.matrices[i] for i in gangs]
        units = [slot.unit_of(self.plan.rank) for slot in slots]
        ranks = torch.distributed.get_process_group_ranks(ex.group)
        lone = lone_gangs([m.units for m in plan.matrices], ex.gangs)

        def gang_fn(updates: list[Tensor], infos: list) -> list[Tensor]:
            steps, serve, ns_dtype = [], [], compute_dtype(spec.precision)
            for i, u, info, unit in zip(gangs, updates, infos, units):
                members, tp = unit.members, self._sharing(info)
                spread = ns_dtype if i in lone else None
                part = self._place(unit, tp) if unit.splits else None
                steps.append(
                    orthogonalize_sharded_steps(
                        u, info, spec, unit.axis, True, part, staged=i in lone
                    )
                )
                group = self._group(ranks, members)
                serve.append(
                    {
                        SUM: functools.partial(
                            self._gang_sum, group, members, tp, ns_dtype, spread
                        ),
                        GATHER: functools.partial(self._gang_gather, group, members, tp),
                    }
                )
            return self._interleave(steps, serve, [unit.members for unit in units])

        infos = [slot.info for slot in slots]
        if isinstance(self.inner, TPOrthogonalizer) and not self.partial:
            return self.inner.together(blocks, infos, gang_fn)
        return gang_fn(blocks, infos)

    def _place(self, unit, tp) -> tuple[int, ...]:
        """(place, places[, slots]) of this rank's block in its split polynomials: ``unit.part``'s
        among the members (whole rows), or (``partial``) TP rank t's piece ``t k + p`` of ``tp
        k`` in ``tp`` slots, so TP rank t's members hold slot t's pieces together
        (``_gang_gather``). Whole rows outside the ``distributed`` TP mode: with pieces the
        planner picked slower plans at 1B and 8B DP 1024 (bench/README.md, session 28)."""
        p, k, _ = unit.part
        if not self.partial or tp is None:
            return p, k
        return torch.distributed.get_rank(tp) * k + p, tp.size() * k, tp.size()

    def _group(self, ranks: list[int], members: tuple[int, ...]):
        key = tuple(ranks[m] for m in members)
        if self.groups.get(key) is None:
            raise RuntimeError(f"no process group for the gang {key}: make_groups(plan) first")
        return self.groups[key]

    def _interleave(self, steps: list, serve: list[dict], members: list[tuple]) -> list[Tensor]:
        """Run the generators ``steps`` in rounds, posting each request as an async collective:
        one global order on every member, so no two gangs wait in a circle. A raise leaves the
        posted collectives to their peers (docs/gangs.md, "A failing rank")."""

        def post(i: int, kind: str, t: Tensor) -> "Posted":
            return self._post(serve[i][kind], t, members[i])

        return interleave(steps, post, lambda posted: self._wait(posted))

    def _post(self, serve: Callable, t: Tensor, members: tuple) -> "Posted":
        """Post ``serve(t)``, a gang collective over ``members``, in place on ``t``."""
        return serve(t)

    def _wait(self, posted: "Posted") -> Optional[Then]:
        """Until a posted collective is done (on NCCL: the current stream waits for it); then
        its next collective posted (a sum's ``SPREAD``), for ``interleave`` to wait for."""
        posted.work.wait()
        if posted.fill is not None:
            posted.fill()
        if posted.then is not None:
            return Then(self._post(posted.then, posted.tensor, posted.members))
        return None

    def _sharing(self, info):
        """The TP group whose ranks each sum a slice over DP: they share the gathered block
        (``duplicated``) or each hold a part of it (``partial``); else None."""
        inner = self.inner
        if isinstance(inner, TPOrthogonalizer) and inner.mode in ("duplicated", "distributed"):
            return inner._group(info)
        return None

    def _gang_sum(self, group, members, tp, ns_dtype, spread, t: Tensor) -> "Posted":
        """Post ``t``'s sum in place over the gang (per TP slice where TP ranks share the block;
        ``partial``: the TP ranks' parts summed over TP first, as ``cost_model.Partial``). A
        sliced sum is a packed Gram, so its TP collectives move ``ns_dtype`` and change no bit:
        its TP partials are exchanged in it (they are NS-dtype matmul results) and summed in
        fp32, and the summed slices come back in it (their consumer, ``unpack_symmetric``,
        rounds to it). The squared norm (1 element) is never sliced. A lone gang's
        (``spread``: the NS dtype; else None) large sums are a reduce-scatter and an all-gather
        in that dtype (``cost_model.spreads``)."""
        flat = t.view(-1)
        lo, hi, slices, p = _tp_slice(flat.numel(), tp)
        if self.partial and tp is not None:
            if slices:
                reduce_scatter_ranges(flat, slices, p, tp, ns_dtype)
            else:  # too small to slice
                torch.distributed.all_reduce(flat, group=tp)

        def then(fill=None):  # ``fill``, then the summed slices all-gathered over TP
            return _then_tp(fill, flat, slices, p, tp, ns_dtype)

        busiest = -(-flat.numel() // len(slices)) if slices else flat.numel()
        if spread is not None and spreads(busiest, len(members), spread.itemsize):
            return self._reduce(group, members, flat[lo:hi], spread, then, t)
        work = torch.distributed.all_reduce(flat[lo:hi], group=group, async_op=True)
        moved = ring_traffic(hi - lo, t.element_size(), 2, self._layout(members))
        self.sum_bytes += 2 * sum(moved)
        return Posted(work, then(), t, members)

    def _reduce(self, group, members, flat: Tensor, ns_dtype, then, t: Tensor) -> "Posted":
        """Post ``flat``'s fp32 sum over the gang as ``cost_model.spreads`` says: a
        reduce-scatter (``flat`` padded to equal chunks), and for after its wait the all-gather
        of the summed chunks in ``ns_dtype`` (``tp.post_gather_ranges``), its fill passed to
        ``then``."""
        k, n, p = len(members), flat.numel(), members.index(self.plan.rank)
        chunk = -(-n // k)
        bounds = [(min(q * chunk, n), min((q + 1) * chunk, n)) for q in range(k)]
        padded = flat.new_zeros(k * chunk)
        padded[:n] = flat
        mine = flat.new_empty(chunk)
        work = torch.distributed.reduce_scatter_tensor(mine, padded, group=group, async_op=True)
        layout = self._layout(members)
        for itemsize in (flat.element_size(), ns_dtype.itemsize):  # the two phases
            self.sum_bytes += 2 * sum(ring_traffic(n, itemsize, 1, layout, nested=1))

        def spread(_: Tensor) -> "Posted":
            lo, hi = bounds[p]
            flat[lo:hi] = mine[: hi - lo]
            work, fill = post_gather_ranges(flat, bounds, p, group, ns_dtype)
            return Posted(work, then(fill), t, members)

        return Posted(work, None, t, members, spread)

    def _gang_gather(self, group, members: tuple[int, ...], tp, pieces: Pieces) -> "Posted":
        """Post the gather of a split polynomial's pieces in place over the gang (one padded
        ``all_gather_into_tensor``); per TP slice as ``_gang_sum``."""
        flat, ranges = pieces.flat, pieces.ranges
        if self.partial and tp is not None:  # TP rank t holds the pieces t k .. t k + k-1
            lo, hi, slices, p = _pieces_slice(flat.numel(), tp)
            k = len(members)
            ranges = ranges[p * k : (p + 1) * k]
        else:
            lo, hi, slices, p = _tp_slice(flat.numel(), tp)
        own = [(min(max(a, lo), hi) - lo, min(max(b, lo), hi) - lo) for a, b in ranges]
        work, fill = post_gather_ranges(flat[lo:hi], own, members.index(self.plan.rank), group)
        moved = ring_traffic(hi - lo, flat.element_size(), 1, self._layout(members))
        self.sum_bytes += 2 * sum(moved)
        return Posted(work, _then_tp(fill, flat, slices, p, tp), flat, members)

    def _layout(self, members: tuple[int, ...]) -> tuple[int, int]:
        return node_layout(members, self.plan.model.nodes)


@dataclass(frozen=True)
class Posted:
    """A posted gang collective: its work, what completes it after the wait, its tensor, gang,
    and the collective to post after it (``then(tensor)``; a sum's ``SPREAD``), if any."""

    work: object
    fill: Optional[Callable[[], None]]
    tensor: Tensor
    members: tuple[int, ...]
    then: Optional[Callable[[Tensor], "Posted"]] = None


def _then_tp(fill, flat: Tensor, slices, p: int, tp, dtype=None) -> Optional[Callable[[], None]]:
    """``fill``, then (TP ranks sharing the block) the all-gather of the slices over TP, in
    ``dtype`` (None: ``flat``'s)."""
    if not slices:
        return fill

    def both() -> None:
        if fill is not None:
            fill()
        all_gather_ranges(flat, slices, p, tp, dtype)

    return both


def _pieces_slice(n: int, group) -> tuple[int, int, list, int]:
    """``_tp_slice`` of a split polynomial's ``n``-element buffer in ``group.size()`` equal slots
    (``newton_schulz.polynomial_ranges``): TP rank t's slot holds its gang's pieces."""
    p, tp = torch.distributed.get_rank(group), group.size()
    slices = [(t * n // tp, (t + 1) * n // tp) for t in range(tp)]
    return (*slices[p], slices, p)


def _new_group(dp_group, members: tuple[int, ...], ranks: tuple[int, ...], member: bool):
    """The gang's group (None on a non-member): ``new_group`` on its members only, or where the
    world is bound to a device (NCCL then splits the world's communicator, which every rank of the
    parent must enter) ``split_group`` of the DP group on all its ranks, as ``DeviceMesh`` does."""
    world = torch.distributed.group.WORLD
    if getattr(world, "bound_device_id", None) is not None and torch.accelerator.is_available():
        group = torch.distributed.split_group(dp_group, [list(members)])
    elif member:
        group = torch.distributed.new_group(
            list(ranks), use_local_synchronization=True, sort_ranks=False
        )
    else:
        group = None
    if group is None:
        # torch names a group by its ranks and how many groups this process holds: a non-member
        # makes one too, so all keep one count (else the members of a later gang name it apart
        # and wait for ever; docs/gangs.md)
        me = [torch.distributed.get_rank()]
        torch.distributed.new_group(me, backend="gloo", use_local_synchronization=True)
    return group


def _tp_slice(n: int, group) -> tuple[int, int, Optional[list], int]:
    """(start, end) of this TP rank's slice of ``n`` elements, all ranks' slices (None: sum it
    all) and this rank's index in ``group``."""
    k = group.size() if group is not None else 1
    if k == 1 or n < k:
        return 0, n, None, 0
    p = torch.distributed.get_rank(group)
    slices = cut(n, k)
    return (*slices[p], slices, p)


# ----------------------------------------------------- the nodes the planner weighs gangs on


def gang_nodes(group, nvlink_domain: Optional[int], inner, infos: list) -> tuple[int, ...]:
    """The node of every rank of the DP ``group`` as the planner sees it, the same on the TP
    peers of a DP rank.

    Args:
        group: the DP process group.
        nvlink_domain: GPUs per NVLink domain (``--muon-plan-nvlink-domain``); None: by host.
        inner: Muon's orthogonalizer before ``attach`` wraps it.
        infos: the TP-global infos of the optimizer's Muon params.

    Returns:
        One node id per rank of ``group``, in group rank order.
    """
    nodes = _domain_nodes(group, nvlink_domain) if nvlink_domain else _host_nodes(group)
    return shared_layout(nodes, _tp_groups(inner, infos))


def _host_nodes(group) -> tuple[int, ...]:
    """The node of every rank of ``group``, by host name (one collective)."""
    names: list = [None] * group.size()
    torch.distributed.all_gather_object(names, socket.gethostname(), group=group)
    first = {name: i for i, name in reversed(list(enumerate(names)))}
    ids = {name: n for n, name in enumerate(sorted(set(names), key=first.get))}
    return tuple(ids[name] for name in names)


def _domain_nodes(group, size: int) -> tuple[int, ...]:
    """The NVLink domain of every rank of ``group``: ``size`` consecutive global ranks each."""
    return tuple(r // size for r in torch.distributed.get_process_group_ranks(group))


def shared_layout(nodes: tuple[int, ...], groups: list) -> tuple[int, ...]:
    """TP rank 0's node layout on every rank of ``groups``: a DP rank's TP peers must run one
    plan, but their layouts can differ (a domain not a multiple of TP, TP across hosts).

    Args:
        nodes: this rank's layout of its DP group.
        groups: the TP groups sharding this optimizer's Muon params.

    Returns:
        The layout every rank of those groups plans with.
    """
    for group in groups:
        got: list = [None] * group.size()
        torch.distributed.all_gather_object(got, nodes, group=group)
        nodes = got[0]
    return nodes


def _tp_groups(inner, infos: list) -> list:
    """The (expert) TP groups of more than one rank sharding ``infos``' params, dense first."""
    if not isinstance(inner, TPOrthogonalizer):
        return []
    groups = {}
    for info in infos:
        group = inner._group(info)
        if group is not None:
            groups.setdefault(bool(getattr(info, "expert", False)), group)
    return [groups[expert] for expert in sorted(groups)]
