"""Splitting one matrix's Newton-Schulz over a gang of DP ranks: the cost model of its blocks
(``Block``, ``Unit``: muon_distopt.py) and the schedule's critical path. Pure arithmetic; the
three forms a member runs and the schedule: docs/gangs.md.
"""

import dataclasses
import functools
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Optional

from .newton_schulz import packed_size, reassociates, splits_polynomial

# Planning default: matmul FLOPs per byte through a gang member's link, H100-class: 40% of
# 990 TFLOP/s bf16 over 400 Gb/s (50 GB/s) per direction. It only chooses among exact plans.
LINK_FLOPS_PER_BYTE = 0.4 * 990e12 / 50e9
# ... and per byte through the TP group's link (NVLink, 450 GB/s per direction).
TP_LINK_FLOPS_PER_BYTE = 0.4 * 990e12 / 450e9


@dataclass(frozen=True)
class PlanLinks:
    """The machine the planner weighs gang collectives and the exchange on (``--muon-plan-*``);
    None: the H100-class default above. Only the choice among exact plans depends on it, and on
    ``min_efficiency``: a floor on the plan's counted NS FLOP efficiency (None: the fastest)."""

    tflops: Optional[float] = None  # achieved matmul TFLOP/s per GPU (default 396)
    dp_link_gbps: Optional[float] = None  # per GPU and direction between nodes (default 400)
    nvlink_gbps: Optional[float] = None  # per GPU and direction inside a node (default 3600)
    nvlink_domain: Optional[int] = None  # GPUs sharing NVLink (default: those on one host)
    min_efficiency: Optional[float] = None  # the fastest plan at least this balanced

    def link_costs(self) -> dict:
        """``NSCostModel``'s ``link_flops_per_byte`` and ``tp_link_flops_per_byte`` for these
        figures: the matmul FLOPs one byte's transfer takes; an infinite bandwidth costs 0 (the
        planner then balances FLOPs alone where both are).

        Returns:
            The two fields (``LINK_FLOPS_PER_BYTE`` and ``TP_LINK_FLOPS_PER_BYTE`` where nothing
            is set).
        """
        rate = (self.tflops or 0.4 * 990) * 1e12

        def per_byte(gbps: float) -> float:
            return 0.0 if math.isinf(gbps) else rate / (gbps / 8 * 1e9)

        return dict(
            link_flops_per_byte=per_byte(self.dp_link_gbps or 400.0),
            tp_link_flops_per_byte=per_byte(self.nvlink_gbps or 3600.0),
        )


DEFAULT_LINKS = PlanLinks()


@dataclass(frozen=True)
class NSCostModel:
    """Newton-Schulz FLOPs an owner's TP rank executes, whole or as a gang member.

    ``whole(info)`` is the per-TP-rank cost of the TP mode (muon_plan.py, ``tp_ns_cost``); a
    matrix splits over DP only where its owner sees it whole or TP-gathered (tp == 1 or the
    ``duplicated`` mode): the blocks of the other modes are no matrix of their own.
    """

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

    def ring_bytes(self, members: tuple, elements: int) -> tuple[float, float]:
        """Bytes a member sends (and as many receives) in one gang collective, as rings move
        them, over the slow (inter-node) link and over its node's fast link: a sum (fp32)
        ``2 (k - 1) / k`` of the tensor per ring, a gather (``Gather``, NS dtype) ``(k - 1) /
        k``, of ``1 / tp`` of it where ``tp`` TP ranks share the block (``Sum.tp``: each moves one
        slice, muon_gangs.py's ``_gang_sum``). By ``layout``: a gang within one node rings over the
        fast link only; one with ``m`` members on each of ``n`` nodes reduce-scatters and
        all-gathers among a node's ``m`` (fast) and rings ``1 / m`` of the tensor over the
        ``n`` nodes (slow; a gather then runs as a sum of zero-filled rows); else one ring over
        the slow link.

        Args:
            members: the gang's ranks.
            elements: the collective's elements (a ``Sum`` or ``Gather``).

        Returns:
            (slow-link bytes, fast-link bytes) each way per member.
        """
        size = _itemsize(elements, self.ns_itemsize)
        return ring_traffic(_slice(elements), size, _passes(elements), self.layout(members))

    def free_links(self) -> "NSCostModel":
        """This model with links that cost nothing (no bytes, no latency): the one the planner
        shapes FLOPs-only candidates with, and the FLOPs-only plan's.

        Returns:
            A copy; this model is unchanged.
        """
        return dataclasses.replace(
            self, link_flops_per_byte=0.0, tp_link_flops_per_byte=0.0, step_latency_flops=0.0
        )

    def layout(self, members: tuple) -> tuple[int, int]:
        """(members per node, nodes) of a gang (``node_layout`` on ``nodes``).

        Args:
            members: the gang's ranks.

        Returns:
            (m, n); the collectives run hierarchically where ``m > 1`` and ``n > 1``.
        """
        return node_layout(members, self.nodes)

    def tp_bytes(self, elements: int) -> float:
        """Bytes a TP rank receives (and sends) in the all-gather of the slices over TP that
        follows a sliced gang collective (``ring_bytes``); 0 without slices.

        Args:
            elements: the collective's elements (a ``Sum`` or ``Gather``).

        Returns:
            Bytes each way per TP rank.
        """
        tp = getattr(elements, "tp", 1)
        if tp == 1 or elements < tp:
            return 0.0
        itemsize = self.ns_itemsize if isinstance(elements, Gather) else 4
        return (tp - 1) * _slice(elements) * itemsize

    def sync_flops(self, members: tuple, elements: int) -> float:
        """A gang collective's link time in matmul-FLOP units (``critical_path``'s ``sync``).

        Args:
            members: the gang's ranks.
            elements: the collective's elements (a ``Sum`` or ``Gather``; 0: an exchange).

        Returns:
            ``ring_bytes`` and ``tp_bytes`` at their links' cost; 0 for the exchange marker.
        """
        if not elements:
            return 0.0
        slow, fast = self.ring_bytes(members, elements)
        fast += self.tp_bytes(elements)
        latency = self.ring_steps(members, elements) * self.step_latency_flops
        return slow * self.link_flops_per_byte + fast * self.tp_link_flops_per_byte + latency

    def ring_steps(self, members: tuple, elements: int) -> int:
        """Dependent ring steps of one gang collective (muon_gangs.py's rings): ``passes (k -
        1)`` in one ring, ``2 (m - 1) + 2 (n - 1)`` hierarchically (reduce-scatter and
        all-gather in a node, all-reduce over the nodes), one more for the TP all-gather of a
        sliced collective.

        Args:
            members: the gang's ranks.
            elements: the collective's elements (a ``Sum`` or ``Gather``).

        Returns:
            Steps, each one send and one receive per member.
        """
        m, n = self.layout(members)
        if m > 1 and n > 1:
            steps = 2 * (m - 1) + 2 * (n - 1)
        else:
            steps = _passes(elements) * (max(m, n) - 1)
        return steps + (self.tp_bytes(elements) > 0)

    def sharing(self, info) -> int:
        """TP ranks that hold the same gathered gang block (``duplicated`` mode), else 1."""
        return self.tp_of(info) if self.mode == "duplicated" else 1

    def axis(self, info) -> Optional[int]:
        """The axis a matrix splits along over DP (0: rows, 1: columns), None where it cannot."""
        if self.tp_of(info) > 1 and self.mode != "duplicated":
            return None
        if info.qkv_split is not None:
            return 1  # Q/K/V blocks: square or wide; a row split would need their cols^2 Gram
        rows, cols = info.shape
        return 0 if rows >= cols else 1

    def lines(self, info, local: int, axis: int) -> int:
        """Lines (rows or columns) of the TP-gathered block, from the TP-local block's.

        Args:
            info: the matrix's TP-global ``MuonParamInfo`` (with ``partition_dim``).
            local: lines of the TP-local block.
            axis: the split axis (0: rows, 1: columns).

        Returns:
            ``local`` times the TP size where TP shards along ``axis``, else ``local``.
        """
        return local * (self.tp_of(info) if info.partition_dim == axis else 1)

    def grams(self, info, axis: int) -> list[int]:
        """Gram side of each block NS runs on, in ``muon_functional.orthogonalize``'s order.

        Args:
            info: the matrix's TP-global ``MuonParamInfo``.
            axis: the split axis (0: rows, 1: columns).

        Returns:
            One Gram side (elements) per Newton-Schulz block.
        """
        if axis == 0:
            return [info.shape[1]]
        split = info.qkv_split or (info.shape[0],)
        groups = info.shape[0] // sum(split)
        return [
            groups * split[i] for r in dict.fromkeys(split) for i, s in enumerate(split) if s == r
        ]

    def member(self, info, axis: int, lines: int, part: tuple[int, int]) -> float:
        """Matmul FLOPs of a member with ``lines`` lines: nondecreasing in ``lines``.

        Args:
            info: the matrix's TP-global ``MuonParamInfo``.
            axis: the split axis (0: rows, 1: columns).
            lines: the member's lines of the TP-gathered block.
            part: ``(p, k, splits)``: the member's place among the gang's sorted members, the
                gang size, whether the gang splits its polynomials (``splits``).

        Returns:
            Matmul FLOPs over all ``steps``.
        """
        flops = 0.0
        for g in self.grams(info, axis):
            events = _after_sum(g, lines, info.shape[axis], part)
            flops += 2.0 * g * g * lines + sum(e for e in events if isinstance(e, float))
        return self.steps * flops

    # The planner asks the same sizes many times; bounded, and models are few and small.
    @functools.lru_cache(maxsize=1 << 16)  # noqa: B019
    def busiest(self, info, axis: int, local: int, k: int, with_link: bool = False) -> float:
        """What the busiest of ``k`` members sharing ``local`` TP-local lines (equal cut)
        spends on the matrix: its matmul FLOPs, plus (``with_link``) its collectives' link time
        in FLOP units (``sync_flops``).

        Args:
            info: the matrix's TP-global ``MuonParamInfo``.
            axis: the split axis (0: rows, 1: columns).
            local: the matrix's TP-local lines along ``axis``.
            k: the gang size.
            with_link: add the gang collectives' link time.

        Returns:
            FLOP units over all ``steps``: the most lines and the most polynomial rows.
        """
        lines = self.lines(info, -(-local // k), axis)
        part = (k - 1, k, self.splits(info, axis, local, k))
        members = tuple(range(k))
        return sum(
            e if isinstance(e, float) else self.sync_flops(members, e) if with_link else 0.0
            for e in member_events(self, info, axis, lines, part)
        )

    def splits(self, info, axis: int, local: int, k: int) -> bool:
        """Whether a gang of ``k`` splits its polynomials by rows: where that makes its busiest
        member's matmul FLOPs plus link time (the gather's bytes at ``link_flops_per_byte``)
        smaller. The same inputs on every member: one decision per gang.

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
            flops = 0.0
            for g in self.grams(info, axis):
                for e in _after_sum(g, lines, info.shape[axis], (k - 1, k, split), tp):
                    flops += e if isinstance(e, float) else self.sync_flops(members, e)
            return flops

        return k > 1 and cost(True) < cost(False)


class Sum(int):
    """A gang collective's elements, summed: an ``int`` (traces compare equal to counted sizes)
    that also says how many TP ranks share it (``tp``: each sums one slice over DP)."""

    tp: int

    def __new__(cls, elements: int, tp: int = 1) -> "Sum":
        out = super().__new__(cls, elements)
        out.tp = tp
        return out


class Gather(Sum):
    """A gang collective's elements that are gathered (a split polynomial's rows), not summed."""


def node_layout(members: tuple, nodes: tuple) -> tuple[int, int]:
    """(members per node, nodes) of a gang: ``(k, 1)`` within one node, ``(m, n)`` with ``m``
    members on each of ``n`` nodes, ``(1, k)`` otherwise (one ring over the slow link; also
    where ``nodes`` is empty: unknown).

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
    """Bytes per element of a gang collective: fp32 sums, gathers in the NS dtype."""
    return ns_itemsize if isinstance(elements, Gather) else 4


def ring_traffic(n: float, itemsize: int, passes: int, layout: tuple[int, int]) -> tuple:
    """(slow-link, fast-link) bytes each way per member of a gang collective over ``n``
    elements (``NSCostModel.ring_bytes``; the executor counts with it too): ``passes`` rings
    (2: a sum, 1: a gather) within one node or over the slow link; for ``m`` members on each of
    ``n`` nodes two passes among a node's ``m`` and two over the nodes of ``1 / m`` of them.

    Args:
        n: elements of the (TP slice of the) tensor.
        itemsize: bytes per element.
        passes: 2 for a sum, 1 for a gather.
        layout: ``node_layout`` of the gang, (members per node, nodes).

    Returns:
        (slow-link bytes, fast-link bytes).
    """
    m, nodes = layout
    if nodes == 1:
        return 0.0, _ring_bytes(n, m, itemsize, passes)
    if m == 1:
        return _ring_bytes(n, nodes, itemsize, passes), 0.0
    return _ring_bytes(n / m, nodes, itemsize, 2), _ring_bytes(n, m, itemsize, 2)


def _passes(elements: int) -> int:
    """Ring passes of a collective: 2 for a sum (reduce-scatter, all-gather), 1 for a gather."""
    return 1 if isinstance(elements, Gather) else 2


def _ring_bytes(n: float, k: int, itemsize: int, passes: int) -> float:
    """Bytes each way per member of a ring of ``k`` over ``n`` elements: ``(k - 1) / k`` of
    them per pass."""
    return passes * (k - 1) / k * n * itemsize


def _slice(elements: int) -> int:
    """The most elements one TP rank moves over DP in a sliced collective (``_tp_slice``)."""
    tp = getattr(elements, "tp", 1)
    return int(elements) if elements < tp else -(-int(elements) // tp)


def _after_sum(g: int, lines: int, long_side: int, part: tuple, tp: int = 1) -> tuple:
    """One step after the Gram sum (``sharded_newton_schulz``): matmul FLOPs (floats) and the
    polynomial's gather (``Gather``) where the gang splits it by rows (``splits_polynomial``),
    else the reassociated ``G X`` and ``G (b X + c G X)``, or the polynomial and ``p(G) X``."""
    p, k, split = part
    if split and splits_polynomial(g, long_side, k, reassociate=True):
        rows = (p + 1) * g // k - p * g // k
        return (2.0 * g * g * rows, Gather(g * g, tp), 2.0 * g * g * lines)
    if reassociates(g, lines):
        return (4.0 * g * g * lines,)
    return (2.0 * g**3 + 2.0 * g * g * lines,)


def member_events(model: NSCostModel, info, axis: int, lines: int, part: tuple) -> list:
    """What a gang member runs, in order: matmul FLOPs (floats) and gang collectives (ints: the
    elements summed; ``Gather``: gathered); ``orthogonalize_sharded`` per NS block: norm, then
    per step Gram, sum, and the update (``_after_sum``).

    Args:
        model: the cost model (its ``steps`` and Gram sides).
        info: the matrix's TP-global ``MuonParamInfo``.
        axis: the split axis (0: rows, 1: columns).
        lines: the member's lines of the TP-gathered block.
        part: ``Unit.part``: place among the sorted members, gang size, split polynomials.

    Returns:
        The member's events in execution order: floats are FLOPs, ints collectives' elements.
    """
    out: list = []
    tp = model.sharing(info)
    for g in model.grams(info, axis):
        out.append(Sum(1, tp))  # the squared norm
        for _ in range(model.steps):
            after = _after_sum(g, lines, info.shape[axis], part, tp)
            out += [2.0 * g * g * lines, Sum(packed_size(g), tp), *after]
    return out


# What a rank's main thread does at a point of its trace (``exchange_schedule``): hand a gang
# collective to the communication thread, wait for one it handed over earlier, or run a
# collective of its own (an all-to-all over the whole DP group).
POST, WAIT, ALL = "post", "wait", "all"


def exchange_schedule(infos: list, units: list, gangs: list[int], world: int, model) -> list:
    """What every rank's main thread runs between the two all-to-alls of one exchange, as a
    trace of ``(matmul FLOPs before it, op, members, elements)``: its gang units interleaved
    (``pipelined``), then its whole matrices and the return all-to-all ``(FLOPs, ALL,
    everyone, 0)``. The one source of muon_plan_figures.py's ``trace`` and of the planner's
    ``span``.

    Args:
        infos: each matrix's TP-global ``MuonParamInfo``.
        units: per matrix its ``Unit`` list.
        gangs: indices (into ``units``) of the split matrices, in the order every rank runs them.
        world: the DP group's size.
        model: the cost model (unused without gangs).

    Returns:
        One trace per rank.
    """
    held: list[list] = [[] for _ in range(world)]
    for i in gangs:
        for u in units[i]:
            held[u.owner].append(
                (u.members, member_events(model, infos[i], u.axis, u.lines, u.part))
            )
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


def pipelined(held: list[tuple]) -> tuple[list[tuple], float]:
    """The main thread's trace of a rank running its gang units interleaved, in rounds
    (muon_gangs.py, ``GangRunner._interleave``): in round ``j`` each unit still running (in
    gang order) waits for its collective ``j - 1``, computes up to its collective ``j`` and posts
    it to the communication thread, which serves posts one at a time in order. While one unit's
    sum is in flight, the rank computes the others'. Every member posts a gang's collectives in
    the same global order (round, gang order), so no two gangs wait on each other in a circle.

    Args:
        held: per gang unit of the rank (gang order), ``(members, member_events)``.

    Returns:
        ``(FLOPs before, POST or WAIT, members, elements)`` entries, and the FLOPs after the
        last one (the last units' tails).
    """
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


def _rounds(events: list) -> tuple[list[float], list[int]]:
    """A member's events as FLOPs segments and collectives: ``segments[j]`` runs before
    collective ``j``, ``segments[-1]`` after the last."""
    segments, collectives = [0.0], []
    for e in events:
        if isinstance(e, float):
            segments[-1] += e
        else:
            collectives.append(e)
            segments.append(0.0)
    return segments, collectives


def split_count(model: NSCostModel, w, target: float, world: int) -> tuple[int, int]:
    """(members, axis) for matrix ``w``: 1 at or under ``target``, else the fewest members whose
    busiest (``ceil(lines / k)`` lines) works <= target, at most ``world`` and one line each
    (that many where none fits). A binary search: member work is nondecreasing in lines.

    Args:
        model: the Newton-Schulz cost model.
        w: the matrix.
        target: the most FLOPs one rank should spend on it.
        world: the DP ranks available (the most members a gang can have).

    Returns:
        (members, axis); axis is None when the matrix stays whole.
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
        ``k`` (start, end) pairs, end exclusive, covering ``[0, n)``.
    """
    return [(j * n // k, (j + 1) * n // k) for j in range(k)]


def critical_path(
    traces: Sequence[Sequence[tuple]],
    work: Callable[[float], float] = float,
    sync: Callable[[tuple, int], float] = lambda members, n: 0.0,
) -> float:
    """When the last rank's main thread ends a schedule (``exchange_schedule``'s traces).

    Each rank has a main thread, which runs ``traces[r]`` in order, and a communication
    thread, which serves the main thread's posts one at a time in post order. An entry
    ``(flops, op, members, elements)`` first runs ``work(flops)`` on the main thread, then:
    ``POST`` hands a collective to the communication thread and goes on; ``WAIT`` waits for
    the end of the rank's oldest collective not yet waited for (posts and waits come in one
    order); ``ALL`` is a collective of the main threads themselves (an all-to-all). A posted
    collective starts when every member's communication thread has it next and is free, and
    lasts ``sync(members, elements)``; an ``ALL`` starts when its last member arrives. The
    k-th collective over a member set on one rank is the k-th on every member (they post in
    one global order).

    Args:
        traces: per rank, its main thread's entries (flops before, op, members, elements).
        work: seconds (or any time unit) that a count of FLOPs takes.
        sync: time a collective over ``members`` of ``elements`` elements takes.

    Returns:
        The time the last main thread finishes its last entry.
    """
    return _Schedule(traces, work, sync).run()


class _Schedule:
    """``critical_path``'s event-driven run: ranks run until they wait on something unknown;
    a collective resolves once every member has posted it and has it first in line."""

    def __init__(self, traces, work, sync):
        n = len(traces)
        self.traces, self.work, self.sync = traces, work, sync
        self.clock, self.at, self.charged = [0.0] * n, [0] * n, [False] * n
        self.free = [0.0] * n  # when each communication thread is free
        self.line = [deque() for _ in range(n)]  # posted, unresolved keys, in order
        self.ends: list[list] = [[] for _ in range(n)]  # end of each post (None: unresolved)
        self.waited, self.seen = [0] * n, [dict() for _ in range(n)]
        self.posts: dict[tuple, dict[int, tuple]] = {}  # key: {rank: (time, index, elements)}
        self.arrived: dict[tuple, dict[int, float]] = {}
        self.ready = list(range(n))

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
                self.clock[r] = max(self.clock[r], end)
                self.waited[r] += 1
            elif op == POST:
                key = self._key(r, members, POST)
                self.posts.setdefault(key, {})[r] = (self.clock[r], len(self.ends[r]), n)
                self.line[r].append(key)
                self.ends[r].append(None)
                self._resolve(key)
            else:
                key = self._key(r, members, ALL)
                self.arrived.setdefault(key, {})[r] = self.clock[r]
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
