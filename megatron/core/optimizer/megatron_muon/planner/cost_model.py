"""The cost model of gang blocks (a matrix's Newton-Schulz split over DP ranks) and the schedule's
critical path; pure arithmetic (docs/gangs.md)."""

import dataclasses
import functools
import math
from collections import Counter, deque
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Optional

from ..newton_schulz import (
    EARLY,
    SUM,
    Then,
    gram_chunks,
    interleave,
    packed_size,
    polynomial_ranges,
    polynomial_size,
    reassociates,
    splits_polynomial,
    staged_gram_flops,
    staged_size,
    upper_gram_flops,
)

# Planning default: matmul FLOPs per byte through a gang member's link, H100-class: 40% of
# 990 TFLOP/s bf16 over 400 Gb/s (50 GB/s) per direction. It only chooses among exact plans.
LINK_FLOPS_PER_BYTE = 0.4 * 990e12 / 50e9
# ... and per byte through the TP group's link (NVLink, 450 GB/s per direction).
TP_LINK_FLOPS_PER_BYTE = 0.4 * 990e12 / 450e9


@dataclass(frozen=True)
class PlanLinks:
    """The machine the planner weighs gang collectives and the exchange on (``--muon-plan-*``;
    None: the H100-class default). It only chooses among exact plans (docs/gangs.md)."""

    tflops: Optional[float] = None  # achieved matmul TFLOP/s per GPU (default 396)
    dp_link_gbps: Optional[float] = None  # per GPU and direction between nodes (default 400)
    nvlink_gbps: Optional[float] = None  # per GPU and direction inside a node (default 3600)
    nvlink_domain: Optional[int] = None  # GPUs sharing NVLink (default: those on one host)
    min_efficiency: Optional[float] = None  # the fastest plan at least this balanced

    def link_costs(self) -> dict:
        """``NSCostModel``'s two ``*link_flops_per_byte`` fields (inf bandwidth: 0)."""
        rate = (self.tflops or 0.4 * 990) * 1e12

        def per_byte(gbps: float) -> float:
            return 0.0 if math.isinf(gbps) else rate / (gbps / 8 * 1e9)

        return dict(
            link_flops_per_byte=per_byte(self.dp_link_gbps or 400.0),
            tp_link_flops_per_byte=per_byte(self.nvlink_gbps or 3600.0),
        )


DEFAULT_LINKS = PlanLinks()


# Bytes per element of the dtypes Muon's TP collectives move (``TPCollective.dtype``).
ITEMSIZES = {"float32": 4, "bfloat16": 2, "float16": 2}
NS_DTYPES = {2: "bfloat16", 4: "float32"}  # ``NSCostModel.ns_itemsize`` -> dtype name


@dataclass(frozen=True)
class TPCollective:
    """One collective over a TP group as tp.py / planner/gangs.py call it (what
    bench/collectives.py records): torch.distributed's op, the elements of this rank's input
    tensor, its dtype (torch's name without ``torch.``), the group size."""

    # "all_gather" (list form), "all_gather_into_tensor", "all_reduce", "all_to_all_single"
    op: str
    elements: int
    dtype: str
    tp: int
    moved: int = 0  # all_to_all_single: elements sent to plus received from other ranks

    def link_bytes(self) -> float:
        """Bytes one TP rank sends (as many it receives) in a ring over the TP link: an
        all-reduce ``2 (tp - 1) / tp`` of its tensor, a gather ``tp - 1`` times its input, an
        all-to-all half of what it moves."""
        size = self.elements * ITEMSIZES[self.dtype]
        if self.op == "all_to_all_single":
            return self.moved * ITEMSIZES[self.dtype] / 2
        if self.op == "all_reduce":
            return 2 * (self.tp - 1) / self.tp * size
        return float((self.tp - 1) * size)


@dataclass(frozen=True)
class NSCostModel:
    """Newton-Schulz FLOPs an owner's TP rank executes, whole or as a gang member.

    ``whole(info)`` is the TP mode's per-rank cost (planner/plan.py); a matrix splits over DP only
    where its owner sees it whole or TP-gathered (docs/gangs.md)."""

    steps: int
    whole: Callable[[object], float]
    tp_of: Callable[[object], int]
    mode: str = "duplicated"
    # Planning only: what a byte through a gang member's DP link and through its TP group's
    # link (NVLink) costs, in matmul FLOPs (rate / bandwidth), and the NS dtype's width (a split
    # polynomial is gathered in it).
    link_flops_per_byte: float = LINK_FLOPS_PER_BYTE
    ns_itemsize: int = 4
    exchange_itemsizes: int = 8  # forward + return bytes per element of the exchange
    tp_link_flops_per_byte: float = TP_LINK_FLOPS_PER_BYTE
    # The node of each DP rank (ranks of one node share its fast link, as TP does); empty:
    # unknown, every gang collective is a ring over the slow link.
    nodes: tuple[int, ...] = ()
    # The latency of one ring step (a send to the next member and a receive from the previous),
    # in matmul FLOPs; 0: collectives cost their bytes only.
    step_latency_flops: float = 0.0
    # Planning only: the least counted NS FLOP efficiency (ideal / FLOP critical path) the
    # chosen plan must reach where a candidate does (else the best balanced); 0: the fastest.
    min_efficiency: float = 0.0
    # Planning only: the main-thread trace of an owner's whole TP-sharded matrices as it runs
    # them, ``stream(infos, model) -> (entries, FLOPs after)`` (the ``distributed`` mode's
    # ``plan.owner_stream``), so a candidate is timed with their TP collectives
    # (``with_streams``); None: whole matrices are their FLOPs alone.
    stream: Optional[Callable] = None
    # The TP rank whose part of a ``partial`` gang block is counted (its polynomial piece);
    # None: the busiest TP rank's, what a step waits for (planning, projections).
    tp_rank: Optional[int] = None

    def ring_bytes(self, members: tuple, elements: int) -> tuple[float, float]:
        """Bytes a member sends (and receives) in one gang collective, by layout.

        Args:
            members: the gang's ranks.
            elements: the collective's elements (a ``Sum`` or ``Gather``).

        Returns:
            (slow-link bytes, fast-link bytes) each way per member.
        """
        size, layout = _itemsize(elements, self.ns_itemsize), self.layout(members)
        return ring_traffic(_slice(elements), size, _passes(elements), layout, _nested(elements))

    def free_links(self) -> "NSCostModel":
        """A copy with links that cost nothing: the model FLOPs-only candidates are shaped with."""
        return dataclasses.replace(
            self, link_flops_per_byte=0.0, tp_link_flops_per_byte=0.0, step_latency_flops=0.0
        )

    def layout(self, members: tuple) -> tuple[int, int]:
        """(members per node, nodes) of a gang (``node_layout``)."""
        return node_layout(members, self.nodes)

    def tp_around(self, elements: int) -> tuple[list, list]:
        """The TP collectives around gang collective ``elements`` (``around_gang``): before its
        post and after its wait, on the main thread."""
        return around_gang(elements, NS_DTYPES[self.ns_itemsize])

    def busy_flops(self, elements: int) -> tuple[float, float]:
        """Main-thread time before a gang collective's post and after its wait, in FLOP units:
        its TP collectives (``critical_path``'s ``busy``), each at the TP link plus a ring
        step's latency."""
        if isinstance(elements, TPCollective):  # a ``stream``'s: posted, nothing around it
            return 0.0, 0.0
        per_byte, latency = self.tp_link_flops_per_byte, self.step_latency_flops
        return tuple(
            sum(c.link_bytes() * per_byte + latency for c in side)
            for side in self.tp_around(elements)
        )

    def sync_flops(self, members: tuple, elements: int) -> float:
        """A gang collective's link time in matmul-FLOP units (``critical_path``'s ``sync``):
        the async part, not the TP collectives around it (``busy_flops``).

        Args:
            members: the gang's ranks.
            elements: the collective's elements (0: the exchange marker, free).

        Returns:
            Link time in FLOP units.
        """
        if isinstance(elements, TPCollective):  # a ``stream``'s, on the owner's TP link
            return elements.link_bytes() * self.tp_link_flops_per_byte
        if not elements:
            return 0.0
        slow, fast = self.ring_bytes(members, elements)
        latency = self.ring_steps(members, elements) * self.step_latency_flops
        return slow * self.link_flops_per_byte + fast * self.tp_link_flops_per_byte + latency

    def collective_flops(self, members: tuple, elements: int) -> float:
        """A gang collective's whole cost run alone: its link time and the TP collectives
        around it (what ``busiest`` and ``splits`` weigh).

        Args:
            members: the gang's ranks.
            elements: the collective's elements.

        Returns:
            FLOP units.
        """
        return self.sync_flops(members, elements) + sum(self.busy_flops(elements))

    def ring_steps(self, members: tuple, elements: int) -> int:
        """Dependent ring steps of one gang collective (modeled as a ring), latency's count (the
        TP collectives around it: ``busy_flops``).

        Args:
            members: the gang's ranks.
            elements: the collective's elements (a ``Sum`` or ``Gather``).

        Returns:
            Steps, each one send and one receive per member.
        """
        m, n = self.layout(members)
        if m > 1 and n > 1:
            steps = _nested(elements) * (m - 1 + n - 1)
        else:
            steps = _passes(elements) * (max(m, n) - 1)
        return steps

    def sharing(self, info) -> int:
        """TP ranks that each carry one slice of a gang collective over DP: those holding the
        same gathered block (``duplicated``) or parts of it (``partial``), else 1."""
        return self.tp_of(info) if self.mode == "duplicated" or self.partial(info) else 1

    def partial(self, info) -> bool:
        """Whether a gang member's TP ranks each hold a part of its block (``distributed``): its
        sums add over TP too, its split polynomial's rows are cut over TP x gang (docs/gangs.md)."""
        return self.mode == "distributed" and self.tp_of(info) > 1

    def axis(self, info) -> Optional[int]:
        """The axis a matrix splits along over DP (0: rows, 1: columns), None where it cannot:
        in the ``distributed`` mode, TP's own axis where it is the long one (no QKV)."""
        rows, cols = info.shape
        if self.partial(info):
            dim = getattr(info, "partition_dim", None)
            if info.qkv_split is not None or dim is None or info.shape[dim] < info.shape[1 - dim]:
                return None
            return dim
        if self.tp_of(info) > 1 and self.mode != "duplicated":
            return None
        if info.qkv_split is not None:
            return 1  # Q/K/V blocks: square or wide; a row split would need their cols^2 Gram
        return 0 if rows >= cols else 1

    def places(self, info, part: tuple) -> tuple[int, int, bool]:
        """A member's ``part`` among all the places splitting its polynomial: ``partial``, TP
        rank t's place ``t k + p`` of ``tp k`` (gangs.py), ``tp_rank``'s or the busiest TP
        rank's; else ``part``.

        Args:
            info: the matrix's TP-global ``MuonParamInfo``.
            part: ``(place, gang size, splits)``.

        Returns:
            ``(place, places, splits)``.
        """
        if not self.partial(info):
            return part
        p, k, split = part
        tp, g = self.tp_of(info), self._grams(info, self.axis(info))[0]
        if self.tp_rank is not None:
            return self.tp_rank * k + p, tp * k, split
        ranges = polynomial_ranges(g, tp * k)
        place = max((t * k + p for t in range(tp)), key=lambda q: ranges[q][1] - ranges[q][0])
        return place, tp * k, split

    def slots(self, info) -> Optional[int]:
        """The slots a gang's split polynomial's pieces are laid out in (``polynomial_ranges``):
        one per TP rank where TP ranks each hold a part (``partial``); else None, whole rows
        (gangs.py's ``_place``)."""
        return self.tp_of(info) if self.partial(info) else None

    def lines(self, info, local: int, axis: int) -> int:
        """Lines of the block a member's TP rank iterates on, from the TP-local block's.

        Args:
            info: the matrix's TP-global ``MuonParamInfo``.
            local: lines of the TP-local block.
            axis: the split axis (0: rows, 1: columns).

        Returns:
            ``local`` times the TP size where TP shards along ``axis`` and gathers (not
            ``partial``).
        """
        gathered = info.partition_dim == axis and not self.partial(info)
        return local * (self.tp_of(info) if gathered else 1)

    def _grams(self, info, axis: int) -> list[int]:
        """Gram side of each NS block (functional.py's ``orthogonalize`` order)."""
        if axis == 0:
            return [info.shape[1]]
        split = info.qkv_split or (info.shape[0],)
        groups = info.shape[0] // sum(split)
        return [
            groups * split[i] for r in dict.fromkeys(split) for i, s in enumerate(split) if s == r
        ]

    def member(self, info, axis: int, lines: int, part: tuple[int, int]) -> float:
        """Matmul FLOPs of a member with ``lines`` lines (nondecreasing in ``lines``).

        Args:
            info: the matrix's TP-global ``MuonParamInfo``.
            axis: the split axis (0: rows, 1: columns).
            lines: the member's lines of the TP-gathered block.
            part: ``(place, gang size, splits)``.

        Returns:
            Matmul FLOPs over all ``steps``.
        """
        flops = 0.0
        for g in self._grams(info, axis):
            place = self.places(info, part)
            events = _after_sum(g, lines, info.shape[axis], place, slots=self.slots(info))
            flops += upper_gram_flops(g, lines) + sum(e for e in events if isinstance(e, float))
        return self.steps * flops

    # The planner asks the same sizes many times; bounded, and models are few and small.
    @functools.lru_cache(maxsize=1 << 16)  # noqa: B019
    def busiest(self, info, axis: int, local: int, k: int, with_link: bool = False) -> float:
        """The busiest of ``k`` members' FLOPs on the matrix (plus link time if ``with_link``).

        Args:
            info: the matrix's TP-global ``MuonParamInfo``.
            axis: the split axis (0: rows, 1: columns).
            local: the matrix's TP-local lines along ``axis``.
            k: the gang size.
            with_link: add the gang collectives' link time.

        Returns:
            FLOP units over all ``steps``.
        """
        lines = self.lines(info, -(-local // k), axis)
        part = (k - 1, k, self.splits(info, axis, local, k))
        members = tuple(range(k))
        return sum(
            e if isinstance(e, float) else self.collective_flops(members, e) if with_link else 0.0
            for e in member_events(self, info, axis, lines, part)
        )

    def splits(self, info, axis: int, local: int, k: int) -> bool:
        """Whether a gang of ``k`` splits its polynomials by rows: where it lowers the busiest
        member's FLOPs plus gather time. Same inputs on every member: one decision per gang.

        Args:
            info: the matrix's TP-global ``MuonParamInfo``.
            axis: the split axis (0: rows, 1: columns).
            local: the matrix's TP-local lines along ``axis``.
            k: the gang size.

        Returns:
            True where the split form is cheaper.
        """
        lines = self.lines(info, -(-local // k), axis)
        members, tp = tuple(range(k)), self.sharing(info)

        def cost(split: bool) -> float:
            flops, part = 0.0, self.places(info, (k - 1, k, split))
            for g in self._grams(info, axis):
                for e in _after_sum(g, lines, info.shape[axis], part, tp, self.slots(info)):
                    flops += e if isinstance(e, float) else self.collective_flops(members, e)
            return flops

        return k > 1 and cost(True) < cost(False)


# How a gang sums a tensor (``Sum.phase``): one fp32 all-reduce, or two collectives
# (``spreads``): an fp32 reduce-scatter, then an all-gather of the summed slices in the NS dtype.
ALL_REDUCE, REDUCE, SPREAD = "all", "reduce", "spread"


class Sum(int):
    """A gang collective's elements, summed: an ``int`` that also carries ``tp``, the TP ranks
    that each sum one slice of it, and ``phase``: the whole sum (``ALL_REDUCE``) or one of its
    two collectives (``REDUCE``, ``SPREAD``; ``spreads``)."""

    tp: int
    phase: str

    def __new__(cls, elements: int, tp: int = 1, phase: str = ALL_REDUCE) -> "Sum":
        out = super().__new__(cls, elements)
        out.tp, out.phase = tp, phase
        return out


class Gather(Sum):
    """A gang collective's elements that are gathered (a split polynomial's pieces), not summed."""


class Partial(Sum):
    """A gang sum whose TP ranks each hold a partial sum of the whole tensor (``distributed``):
    reduced over TP into slices (``tp.reduce_scatter_ranges``), each slice summed over the gang,
    all-gathered over TP."""


def spreads(elements: int, members: int, ns_itemsize: int) -> bool:
    """Whether a lone gang (``lone_gangs``) of ``members`` sums a slice of ``elements`` as an
    fp32 reduce-scatter and an all-gather of the sums in the NS dtype (``REDUCE`` then
    ``SPREAD``), not one fp32 all-reduce: where the NS dtype is narrower and every member gets
    elements. Only packed Grams are that large, and their consumer (``unpack_symmetric``)
    rounds to the NS dtype, so the gather changes no bit and moves ``ns_itemsize / 4`` of the
    all-reduce's second half; each sum is computed on one member and gathered, so all members
    hold the same bits.

    Args:
        elements: the slice's elements (``_slice``).
        members: the gang's size.
        ns_itemsize: bytes per element of the NS dtype.

    Returns:
        True for the two collectives.
    """
    return ns_itemsize < 4 and 1 < members <= elements


def lone_gangs(units: list, gangs: list[int]) -> set[int]:
    """The gangs (matrix indices) whose every member runs no other gang unit in the exchange:
    their sums may be two collectives (``spreads``). A rank running several units posts their
    collectives one after another on its link, so another unit's would come between a sum's
    two halves and delay the second (``critical_path``); those keep one all-reduce.

    Args:
        units: per matrix its ``Unit`` list.
        gangs: the split matrices' indices.

    Returns:
        Indices into ``units``.
    """
    held = Counter(u.owner for i in gangs for u in units[i])
    return {i for i in gangs if all(held[u.owner] == 1 for u in units[i])}


def sum_events(
    total: type, elements: int, tp: int, members: int, ns_itemsize: int, lone: bool
) -> list:
    """A gang sum of ``elements`` as the collectives a member posts (``spreads``).

    Args:
        total: ``Sum`` or ``Partial``.
        elements: the tensor's elements.
        tp: TP ranks that each sum one slice.
        members: the gang's size.
        ns_itemsize: bytes per element of the NS dtype.
        lone: the gang is one of ``lone_gangs``.

    Returns:
        One ``total`` whole, or its ``REDUCE`` and ``SPREAD`` phases.
    """
    whole = total(elements, tp)
    if not lone or not spreads(_slice(whole), members, ns_itemsize):
        return [whole]
    return [total(elements, tp, REDUCE), total(elements, tp, SPREAD)]


def around_gang(elements: int, ns_dtype: str) -> tuple[list, list]:
    """The TP collectives gangs.py runs on the main thread around gang collective ``elements``
    (``Sum``, ``Gather`` or ``Partial``), the one description the cost model and the counts
    (``figures.tp_schedule``) share.

    Args:
        elements: the gang collective.
        ns_dtype: Newton-Schulz's dtype name (a split polynomial's rows move in it).

    Returns:
        (before its post, after its wait): a ``Partial`` sum's reduce over TP, sliced an
        all-to-all of the partials' slices in the NS dtype (``tp.reduce_scatter_ranges``; a
        sliced sum is a packed Gram of NS-dtype matmuls), too small to slice an fp32
        all-reduce; a sliced collective's all-gather of the slices, in the NS dtype (the
        Gram's consumer rounds to it). Lists of ``TPCollective``.
    """
    tp, phase = getattr(elements, "tp", 1), getattr(elements, "phase", ALL_REDUCE)
    if tp == 1:
        return [], []
    n, chunk = int(elements), -(-int(elements) // tp)
    before = []
    if phase == SPREAD:
        pass  # a sum's second collective: its TP reduce ran before the first
    elif isinstance(elements, Partial) and n < tp:
        before = [TPCollective("all_reduce", n, "float32", tp)]
    elif isinstance(elements, Partial):  # each rank sends tp - 1 chunks, receives as many
        moved = 2 * (tp - 1) * chunk
        before = [TPCollective("all_to_all_single", tp * chunk, ns_dtype, tp, moved)]
    after = []
    if n >= tp and phase != REDUCE:  # a sum's first collective: the slices come after its second
        after = [TPCollective("all_gather_into_tensor", chunk, ns_dtype, tp)]
    return before, after


def node_layout(members: tuple, nodes: tuple) -> tuple[int, int]:
    """(members per node, nodes) of a gang: ``(k, 1)`` in one node, ``(m, n)`` for ``m`` on each
    of ``n`` nodes, else ``(1, k)`` (one slow ring; also where ``nodes`` is empty).

    Args:
        members: the gang's DP ranks.
        nodes: the node of every DP rank, or empty.

    Returns:
        (m, n).
    """
    if not nodes:
        return 1, len(members)
    counts: dict[int, int] = {}
    for r in members:
        counts[nodes[r]] = counts.get(nodes[r], 0) + 1
    sizes = set(counts.values())
    return (sizes.pop(), len(counts)) if len(sizes) == 1 else (1, len(members))


def _itemsize(elements: int, ns_itemsize: int) -> int:
    """Bytes per element of a gang collective: fp32 sums, gathers (and a sum's ``SPREAD``) in
    the NS dtype."""
    spread = getattr(elements, "phase", None) == SPREAD
    return ns_itemsize if isinstance(elements, Gather) or spread else 4


def ring_traffic(
    n: float, itemsize: int, passes: int, layout: tuple[int, int], nested: int = 2
) -> tuple:
    """(slow-link, fast-link) bytes each way per member of a gang collective modeled as rings
    (also gangs.py's count): one ring per layout, or ``nested`` passes in a node and over the
    nodes.

    Args:
        n: elements of the (TP slice of the) tensor.
        itemsize: bytes per element.
        passes: 2 for a sum, 1 for a gather or one phase of a sum.
        layout: ``node_layout`` of the gang.
        nested: passes on each level across nodes: 2 for a sum or a gather, 1 for one phase
            of a sum (its reduce-scatter, or its all-gather).

    Returns:
        (slow-link bytes, fast-link bytes).
    """
    m, nodes = layout
    if nodes == 1:
        return 0.0, _ring_bytes(n, m, itemsize, passes)
    if m == 1:
        return _ring_bytes(n, nodes, itemsize, passes), 0.0
    return _ring_bytes(n / m, nodes, itemsize, nested), _ring_bytes(n, m, itemsize, nested)


def _passes(elements: int) -> int:
    """Ring passes of a collective: 2 for a sum (reduce-scatter, all-gather), 1 for a gather or
    one phase of a sum."""
    whole = getattr(elements, "phase", ALL_REDUCE) == ALL_REDUCE
    return 1 if isinstance(elements, Gather) or not whole else 2


def _nested(elements: int) -> int:
    """``ring_traffic``'s passes per level across nodes: 1 for one phase of a sum, else 2."""
    return 2 if getattr(elements, "phase", ALL_REDUCE) == ALL_REDUCE else 1


def _ring_bytes(n: float, k: int, itemsize: int, passes: int) -> float:
    """Bytes each way per member of a ring of ``k`` over ``n`` elements."""
    return passes * (k - 1) / k * n * itemsize


def _slice(elements: int) -> int:
    """The most elements one TP rank moves over DP in a sliced collective (``_tp_slice``)."""
    tp = getattr(elements, "tp", 1)
    return int(elements) if elements < tp else -(-int(elements) // tp)


def _after_sum(g: int, lines: int, long_side: int, part: tuple, tp: int = 1, slots=None) -> tuple:
    """One NS step after the Gram sum, in one of the three forms (docs/gangs.md): FLOPs
    (floats) and, for a split polynomial, its gather (``Gather``: its pieces' buffer, in
    ``slots`` slots; None: whole rows, the ``g x g`` matrix)."""
    p, k, split = part
    if split and slots is None and splits_polynomial(g, long_side, k, True, pieces=False):
        rows = (p + 1) * g // k - p * g // k
        return (2.0 * g * g * rows, Gather(g * g, tp), 2.0 * g * g * lines)
    if split and slots is not None and splits_polynomial(g, long_side, k, reassociate=True):
        start, end = polynomial_ranges(g, k, slots)[p]
        size = polynomial_size(g, k, slots)
        return (2.0 * g * (end - start), Gather(size, tp), 2.0 * g * g * lines)
    if reassociates(g, lines):
        return (4.0 * g * g * lines,)
    return (2.0 * g**3 + 2.0 * g * g * lines,)


def member_events(
    model: NSCostModel, info, axis: int, lines: int, part: tuple, lone: bool = False
) -> list:
    """What a gang member runs, in order: FLOPs (floats) and collectives (``Sum``/``Gather``).

    Args:
        model: the cost model.
        info: the matrix's TP-global ``MuonParamInfo``.
        axis: the split axis (0: rows, 1: columns).
        lines: the member's lines of the TP-gathered block.
        part: ``Unit.part``.
        lone: the gang is one of ``lone_gangs`` (its Gram sums may be two collectives).

    Returns:
        The member's events in execution order.
    """
    out: list = []
    tp, place = model.sharing(info), model.places(info, part)
    total = Partial if model.partial(info) else Sum
    for g in model._grams(info, axis):
        out += sum_events(total, 1, tp, part[1], model.ns_itemsize, lone)  # the squared norm
        if lone and len(gram_chunks(g)) > 1:  # newton_schulz.staged_gram
            each = dict(tp=tp, members=part[1], ns_itemsize=model.ns_itemsize, lone=True)
            gram = [staged_sum(g, lines, functools.partial(sum_events, total, **each))]
        else:
            sums = sum_events(total, packed_size(g), tp, part[1], model.ns_itemsize, lone)
            gram = [float(upper_gram_flops(g, lines)), *sums]
        for _ in range(model.steps):
            after = _after_sum(g, lines, info.shape[axis], place, tp, model.slots(info))
            out += [*gram, *after]
    return out


class StagedSum(NamedTuple):
    """A Gram computed and summed in chunks (``newton_schulz.staged_gram``; a lone gang's, the
    ``distributed`` stream's): per chunk its matmul FLOPs and the collectives that sum it, each
    chunk's sum requested as soon as it is computed (``event_steps``)."""

    chunks: tuple[tuple[float, tuple], ...]


def staged_sum(g: int, lines: int, chunk_sum: Callable[[int], Sequence]) -> StagedSum:
    """A ``g x g`` Gram of ``lines`` lines as ``newton_schulz.staged_gram`` computes it, each
    chunk summed by the collectives ``chunk_sum(elements)`` gives.

    Args:
        g: the Gram's side.
        lines: the shard's length along the summed dimension.
        chunk_sum: a chunk's collectives, from its packed elements.

    Returns:
        The events' ``StagedSum``.
    """
    return StagedSum(
        tuple(
            (float(staged_gram_flops(g, lines, lo, hi)), tuple(chunk_sum(staged_size(g, lo, hi))))
            for lo, hi in gram_chunks(g)
        )
    )


def matmul_flops(events: list) -> float:
    """The matmul FLOPs among events (``member_events``', ``plan.distributed_events``'), a
    ``StagedSum``'s chunks' too.

    Args:
        events: the events.

    Returns:
        FLOPs.
    """
    return sum(
        sum(f for f, _ in e.chunks) if isinstance(e, StagedSum) else e
        for e in events
        if isinstance(e, (float, StagedSum))
    )


def collectives(events: list) -> list:
    """The collectives among ``member_events``' events, a ``StagedSum``'s chunk by chunk.

    Args:
        events: the events.

    Returns:
        ``Sum``/``Gather`` per collective.
    """
    out: list = []
    for e in events:
        if isinstance(e, StagedSum):
            out += [c for _, sums in e.chunks for c in sums]
        elif not isinstance(e, float):
            out.append(e)
    return out


# What a rank's main thread does at a point of its trace (``exchange_schedule``): hand a gang
# collective (async, on the gang's links), wait for one it posted earlier, or run a
# collective of its own (an all-to-all over the whole DP group).
POST, WAIT, ALL = "post", "wait", "all"


def exchange_schedule(infos: list, units: list, gangs: list[int], world: int, model) -> list:
    """Every rank's main-thread trace between an exchange's two all-to-alls: its gang units
    (``pipelined``), then its whole matrices and the return all-to-all. The one source of the
    planner's ``span`` and planner/figures.py's ``trace``.

    Args:
        infos: each matrix's TP-global ``MuonParamInfo``.
        units: per matrix its ``Unit`` list.
        gangs: indices of the split matrices, in the order every rank runs them.
        world: the DP group's size.
        model: the cost model.

    Returns:
        One trace per rank.
    """
    held: list[list] = [[] for _ in range(world)]
    lone = lone_gangs(units, gangs)
    for i in gangs:
        for u in units[i]:
            events = member_events(model, infos[i], u.axis, u.lines, u.part, i in lone)
            held[u.owner].append((u.members, events))
    whole = [0.0] * world
    for matrix_units in units:
        for u in matrix_units:
            if not u.gang:
                whole[u.owner] += u.cost
    everyone, traces = tuple(range(world)), []
    for r in range(world):
        trace, tail = pipelined(held[r])
        traces.append(trace + [(tail + whole[r], ALL, everyone, 0)])
    return traces


def with_streams(traces: list, infos: list, units: list, model) -> list:
    """``exchange_schedule``'s traces with each owner's whole TP-sharded matrices run as
    ``model.stream`` runs them (in matrix order): their FLOPs out of the last entry, their TP
    collectives posted and waited for on the owner's own TP link (members ``(rank,)``), as
    bench/projection.py's ``with_tp`` times a plan.

    Args:
        traces: ``exchange_schedule``'s.
        infos: each matrix's TP-global ``MuonParamInfo``.
        units: per matrix its ``Unit`` list.
        model: the cost model, its ``stream`` set.

    Returns:
        One trace per rank.
    """
    owned: list[list] = [[] for _ in traces]
    for info, matrix_units in zip(infos, units):
        for u in matrix_units:
            if not u.gang and model.tp_of(info) > 1:
                owned[u.owner].append((info, u.cost))
    return [
        [*trace[:-1], *streamed(r, owned[r], trace[-1], model, model.stream)] if owned[r] else trace
        for r, trace in enumerate(traces)
    ]


def streamed(rank: int, owned: list[tuple], entry: tuple, model, stream: Callable) -> list:
    """A trace ``entry`` (``(FLOPs before, op, members, elements)``) whose FLOPs include an
    owner's whole matrices ``owned`` (``(info, FLOPs)``, in the order it runs them), with those
    run as ``stream`` runs them: their FLOPs out of the entry, their collectives posted and
    waited for on the owner's own TP link (members ``(rank,)``). The one rule ``with_streams``
    (the planner, ``model.stream``) and bench/projection.py's ``with_tp`` (the step as it runs,
    whatever the planner saw) share.

    Args:
        rank: the owner's DP rank.
        owned: its whole matrices and their FLOPs.
        entry: the entry they run before.
        model: the cost model.
        stream: ``NSCostModel.stream``'s kind of call (``plan.owner_stream``).

    Returns:
        The stream's entries, then ``entry`` less their FLOPs.
    """
    entries, tail = stream([info for info, _ in owned], model)
    flops, *rest = entry
    run = [(f, kind, (rank,), c) for f, kind, c in entries]
    return run + [(flops - sum(cost for _, cost in owned) + tail, *rest)]


def pipelined(held: list[tuple]) -> tuple[list[tuple], float]:
    """The main thread's trace of a rank's gang units (``(members, member_events)``, gang order)
    run interleaved in rounds as gangs.py runs them (docs/gangs.md): ``(FLOPs before, POST or
    WAIT, members, elements)`` entries, and the FLOPs after the last."""
    if any(isinstance(e, StagedSum) for _, events in held for e in events):
        assert len(held) == 1, "a staged sum is a lone gang's: its members run no other unit"
        return staged_trace(*held[0])
    live = [(members, *_rounds(events)) for members, events in held]
    trace, flops, j = [], 0.0, 0
    while live:
        for unit in list(live):
            members, segments, collectives = unit
            if j:
                trace.append((flops, WAIT, members, collectives[j - 1]))
                flops = 0.0
            flops += segments[j]
            if j < len(collectives):
                trace.append((flops, POST, members, collectives[j]))
                flops = 0.0
            else:
                live.remove(unit)
        j += 1
    return trace, flops


def staged_trace(members: tuple, events: list) -> tuple[list[tuple], float]:
    """``pipelined``'s trace of a rank's one gang unit, whose Gram sums are staged (a lone
    gang's), run by gangs.py's own ``interleave`` (``event_steps``): each chunk's FLOPs, its sum
    posted (``EARLY``), then every earlier chunk's sum moved on by one collective, newest first
    (its wait, and its next collective's post); after the last chunk, those rounds until all
    are done. Every other collective is posted and waited for in turn.

    Args:
        members: the gang's DP ranks.
        events: the unit's ``member_events``.

    Returns:
        As ``pipelined``.
    """
    trace: list = []
    clock = [0.0]
    post, wait = chain_recorder(trace, clock, lambda f, op, c: (f, op, members, c))
    interleave([event_steps(events, clock)], post, wait)
    return trace, clock[0]


def event_steps(events: list, clock: list) -> Generator:
    """A unit's events (``member_events``', ``plan.distributed_block_events``') as the request
    generator that runs them: its FLOPs added to ``clock[0]`` where the real one computes them,
    each collective a request ``(SUM, (collectives, 0))``, a ``StagedSum``'s chunks ``EARLY``
    but the last (``newton_schulz.sharded_newton_schulz_steps``).

    Args:
        events: the events.
        clock: FLOPs run since the trace's last entry (``chain_recorder``'s).

    Returns:
        The generator.
    """
    for e in events:
        if isinstance(e, float):
            clock[0] += e
        elif isinstance(e, StagedSum):
            for j, (flops, sums) in enumerate(e.chunks):
                clock[0] += flops
                yield EARLY if j + 1 < len(e.chunks) else SUM, (sums, 0)
        else:
            yield SUM, ((e,), 0)


def chain_recorder(trace: list, clock: list, entry: Callable) -> tuple[Callable, Callable]:
    """``interleave``'s ``post`` and ``wait`` for ``event_steps``' requests, each appending
    ``entry(FLOPs since the last entry, POST or WAIT, collective)`` to ``trace``; a request of
    several collectives (a chunk's sum) posts the next at the previous one's wait (``Then``).

    Args:
        trace: the trace appended to.
        clock: FLOPs run since the last entry, reset at each.
        entry: makes an entry.

    Returns:
        (post, wait).
    """

    def record(op: str, c) -> None:
        trace.append(entry(clock[0], op, c))
        clock[0] = 0.0

    def post(i: int, kind: str, handle: tuple) -> tuple:  # (a sum's collectives, the posted)
        collectives, at = handle
        record(POST, collectives[at])
        return handle

    def wait(handle: tuple) -> Optional[Then]:
        collectives, at = handle
        record(WAIT, collectives[at])
        more = at + 1 < len(collectives)
        return Then(post(-1, SUM, (collectives, at + 1))) if more else None

    return post, wait


def _rounds(events: list) -> tuple[list[float], list[int]]:
    """A member's events as FLOPs segments around its collectives."""
    segments, collectives = [0.0], []
    for e in events:
        if isinstance(e, float):
            segments[-1] += e
        else:
            collectives.append(e)
            segments.append(0.0)
    return segments, collectives


def split_count(model: NSCostModel, w, target: float, world: int) -> tuple[int, int]:
    """(members, axis) for matrix ``w``: the fewest members whose busiest works <= ``target``
    (binary search; 1 and None where it stays whole).

    Args:
        model: the Newton-Schulz cost model.
        w: the matrix.
        target: the most FLOPs one rank should spend on it.
        world: the DP ranks available.

    Returns:
        (members, axis).
    """
    axis = model.axis(w.info) if w.cost > target and world > 1 else None
    if axis is None:
        return 1, None
    local = w.local_shape[axis]
    lo, hi = 1, max(1, min(world, local))
    while lo < hi:
        k = (lo + hi) // 2
        if model.busiest(w.info, axis, local, k) <= target:
            hi = k
        else:
            lo = k + 1
    return lo, axis


def cut(n: int, k: int) -> list[tuple[int, int]]:
    """``[0, n)`` in ``k`` near-equal consecutive ranges.

    Args:
        n: the length to cut.
        k: the number of ranges, >= 1.

    Returns:
        ``k`` (start, end) pairs.
    """
    return [(j * n // k, (j + 1) * n // k) for j in range(k)]


def critical_path(
    traces: Sequence[Sequence[tuple]],
    work: Callable[[float], float] = float,
    sync: Callable[[tuple, int], float] = lambda members, n: 0.0,
    busy: Optional[Callable[[int], tuple[float, float]]] = None,
) -> float:
    """When the last rank's main thread ends a schedule (``exchange_schedule``'s traces).

    Each rank runs its trace on a main thread and serves its posts, in order, on a communication
    thread; a posted collective starts when every member has it next and is free; ``ALL`` is an
    all-to-all of the main threads (docs/gangs.md).

    Args:
        traces: per rank, its entries (flops before, op, members, elements).
        work: time a count of FLOPs takes.
        sync: time a collective over ``members`` of ``elements`` elements takes (a pure
            function: called once per distinct pair).
        busy: main-thread time before posting and after waiting for a collective of
            ``elements`` (its TP collectives: ``NSCostModel.busy_flops``; called once per
            distinct ``elements``); None: none.

    Returns:
        The time the last main thread finishes.
    """
    return _Schedule(traces, work, sync, busy).run()


def arrival_times(
    traces: Sequence[Sequence[tuple]],
    work: Callable[[float], float] = float,
    sync: Callable[[tuple, int], float] = lambda members, n: 0.0,
    busy: Optional[Callable[[int], tuple[float, float]]] = None,
) -> list[float]:
    """When each rank's main thread reaches its last ``ALL`` (an exchange's return all-to-all)
    in ``critical_path``'s run: what its own work and waits take, before the all-to-all evens
    them out. The latest is the critical path where the traces end with that ``ALL`` of no
    elements, as ``exchange_schedule``'s do.

    Args:
        traces: per rank, its entries (``critical_path``'s).
        work: time a count of FLOPs takes.
        sync: time a collective over ``members`` of ``elements`` elements takes.
        busy: main-thread time around a collective (``critical_path``'s); None: none.

    Returns:
        Per rank, the time it reaches its last ``ALL`` (0.0 for a rank with none).
    """
    schedule = _Schedule(traces, work, sync, busy)
    schedule.run()
    return schedule.reached


def _priced_once(fn: Callable) -> Callable:
    """``fn`` computed once per distinct arguments, told apart by type, ``tp`` and ``phase`` too:
    a ``Sum``, a ``Gather`` and a ``Partial`` of one size (or of two TP sizes, or two phases)
    are equal ints, but their collectives cost differently."""
    done: dict = {}

    def priced(*args):
        key = tuple((type(a), getattr(a, "tp", None), getattr(a, "phase", None), a) for a in args)
        if key not in done:
            done[key] = fn(*args)
        return done[key]

    return priced


class _Schedule:
    """``critical_path``'s event-driven run."""

    def __init__(self, traces, work, sync, busy):
        n = len(traces)
        self.traces, self.work = traces, work
        # a step repeats few collective sizes (and gangs) many times: each priced once
        self.sync = _priced_once(sync)
        self.busy = _priced_once(busy or (lambda elements: (0.0, 0.0)))
        self.clock, self.at, self.charged = [0.0] * n, [0] * n, [False] * n
        self.free = [0.0] * n  # when each rank's gang link is free (one post at a time)
        self.line = [deque() for _ in range(n)]  # posted, unresolved keys, in order
        self.ends: list[list] = [[] for _ in range(n)]  # end of each post (None: unresolved)
        self.waited, self.seen = [0] * n, [dict() for _ in range(n)]
        self.posts: dict[tuple, dict[int, tuple]] = {}  # key: {rank: (time, index, elements)}
        self.arrived: dict[tuple, dict[int, float]] = {}
        self.ready = list(range(n))
        self.reached = [0.0] * n  # when each rank last reached an ALL

    def run(self) -> float:
        while self.ready:
            self._advance(self.ready.pop())
        done = all(a == len(t) for a, t in zip(self.at, self.traces))
        assert done, "the schedule waits in a circle"
        return max(self.clock, default=0.0)

    def _key(self, r: int, members: tuple, kind: str) -> tuple:
        count = self.seen[r].get((kind, members), 0)
        self.seen[r][(kind, members)] = count + 1
        return (kind, members, count)

    def _advance(self, r: int) -> None:
        trace = self.traces[r]
        while self.at[r] < len(trace):
            flops, op, members, n = trace[self.at[r]]
            if not self.charged[r]:
                self.clock[r] += self.work(flops)
                self.charged[r] = True
            if op == WAIT:
                end = self.ends[r][self.waited[r]]
                if end is None:
                    return  # resumed when that collective resolves
                self.clock[r] = max(self.clock[r], end) + self.busy(n)[1]
                self.waited[r] += 1
            elif op == POST:
                self.clock[r] += self.busy(n)[0]
                key = self._key(r, members, POST)
                self.posts.setdefault(key, {})[r] = (self.clock[r], len(self.ends[r]), n)
                self.line[r].append(key)
                self.ends[r].append(None)
                self._resolve(key)
            else:
                key = self._key(r, members, ALL)
                self.arrived.setdefault(key, {})[r] = self.reached[r] = self.clock[r]
                if len(self.arrived[key]) < len(members):
                    self._next(r)
                    return  # resumed by the last member to arrive
                end = max(self.arrived.pop(key).values()) + self.sync(members, n)
                for m in members:
                    self.clock[m] = end
                    if m != r:
                        self.ready.append(m)
            self._next(r)

    def _next(self, r: int) -> None:
        self.at[r] += 1
        self.charged[r] = False

    def _resolve(self, key: tuple) -> None:
        """Resolve ``key`` if it is due, then whatever that makes due (a work list)."""
        todo = [key]
        while todo:
            key = todo.pop()
            posts, members = self.posts.get(key, {}), key[1]
            due = len(posts) == len(members) and all(self.line[m][0] == key for m in members)
            if not due:
                continue
            sizes = {n for _, _, n in posts.values()}
            assert len(sizes) == 1, f"members post {key[:2]} with different sizes {sizes}"
            start = max(max(t, self.free[m]) for m, (t, _, _) in posts.items())
            end = start + self.sync(members, next(iter(posts.values()))[2])
            for m, (_, i, _) in self.posts.pop(key).items():
                self.line[m].popleft()
                self.free[m], self.ends[m][i] = end, end
                if self.waited[m] == i and self.at[m] < len(self.traces[m]):
                    if self.traces[m][self.at[m]][1] == WAIT and self.charged[m]:
                        self.ready.append(m)  # it was waiting for this one
                if self.line[m]:
                    todo.append(self.line[m][0])
