"""Where an exchange's Newton-Schulz work runs: whole matrices and gangs on DP ranks. Pure
arithmetic, the same on every rank; the candidates and the choice: docs/gangs.md.
"""

import bisect
import functools
import heapq
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from ..exchange import Block, Unit
from ..tp import lpt
from .cost_model import (
    NSCostModel,
    critical_path,
    cut,
    exchange_schedule,
    split_count,
    with_streams,
)

# Targets tried, in multiples of total / dp (math.inf: no split).
TARGETS = (1.0, 1.1, 1.25, 1.5, 2.0, 3.0, math.inf)
# Candidates within this fraction of the fastest modeled time count as equally fast: the link
# time is a model (bandwidth at an assumed machine), the FLOPs are exact, so among them the one
# with the shortest FLOP critical path (the better balanced) wins.
TIME_SLACK = 0.02
# Disjoint gangs tried: at most this many matrices share one gang's members (``bundle_units``).
BUNDLES = (1, 2, 3)
# Where every matrix lies whole on one rank (the shard-aligned layout, layout.py), those
# holders own them, so the exchange moves nothing, while the busiest one's NS FLOPs stay within
# this fraction of the mean: a few % of NS time against the whole exchange (~4 M/dp elements
# per rank and step); past it a few matrices move (``holder_owners``, which also chooses the
# layout).
HOLDER_SLACK = 0.05


@dataclass
class Work:
    """One matrix as the planner sees it."""

    info: object  # TP-global MuonParamInfo
    cost: float  # NS FLOPs of its owner when whole
    local_shape: tuple[int, int]
    held: dict[int, tuple[int, int]]  # rank: (first held element, elements held)


def assign_units(
    works: list[Work],
    world: int,
    model: Optional[NSCostModel],
    targets=TARGETS,
    bundles=BUNDLES,
):
    """The best placement: holders where they balance, else the candidate fastest within
    ``TIME_SLACK``, then shortest in FLOPs (docs/gangs.md).

    Args:
        works: the Muon matrices of one exchange.
        world: the DP group's size.
        model: the Newton-Schulz cost model, or None for whole matrices only.
        targets: per-rank FLOP targets for stacked gangs, as fractions of the mean load.
        bundles: the most matrices one disjoint gang may hold, one candidate each.

    Returns:
        (units, gangs): per matrix its ``Unit`` list, and the split matrices' indices in order.
    """
    held = _holder_units(works, world, model)
    if held is not None:
        return held
    if model is None:
        targets, bundles = (math.inf,), ()
    total = sum(w.cost for w in works)
    candidates = []
    for shape in _shapers(model):  # placements shaped at the link cost and blind to it
        candidates += [_assign(works, world, shape, f * total / max(world, 1)) for f in targets]
        candidates += [bundle_units(works, world, shape, n) for n in bundles]
    timed = [(span(works, *c, world, model), c) for c in candidates if c is not None]
    if model is not None and model.min_efficiency:
        timed = _balanced_enough(timed, works, world, model, total / max(world, 1))
    fastest = min(length for length, _ in timed)
    if model is None:
        return next(c for length, c in timed if length == fastest)
    near = [c for length, c in timed if length <= fastest * (1 + TIME_SLACK)]
    flops = [span(works, *c, world, model, link=False) for c in near]
    return near[flops.index(min(flops))]  # the first of the best balanced


def _holder_units(works: list[Work], world: int, model: Optional[NSCostModel]):
    """``assign_units``' answer with every matrix whole on its holder (``holder_owners``), or
    None where a matrix lies on several ranks or moves cannot balance."""
    if any(len(w.held) != 1 for w in works):
        return None
    holders = [next(iter(w.held)) for w in works]
    floor = model.min_efficiency if model is not None else 0.0
    costs = [w.cost for w in works]
    owners = None
    for cells in dict.fromkeys((_cells_per_owner(works, model), 1)):
        owners = owners or holder_owners(costs, holders, world, floor, cells)
    if owners is None:
        return None
    return [[whole_unit(w, owner)] for w, owner in zip(works, owners)], []


def _cells_per_owner(works: list[Work], model: Optional[NSCostModel]) -> int:
    """The TP ranks a DP owner spreads its matrices over, each whole on one (the ``owner`` TP
    mode, tp.py's ``owner_cells``), where every matrix is sharded over one TP size; else 1."""
    if model is None or model.mode != "owner":
        return 1
    sizes = {model.tp_of(w.info) for w in works}
    return sizes.pop() if len(sizes) == 1 else 1


def holder_owners(
    costs: list[float], holders: list[int], world: int, min_efficiency=0.0, cells: int = 1
):
    """Owners of whole matrices: their holders, with few moves to balance the NS load within
    ``HOLDER_SLACK`` (docs/distopt_exchange.md).

    Args:
        costs: NS cost of each matrix (or anything proportional).
        holders: the DP rank holding each matrix whole.
        world: the DP group's size.
        min_efficiency: the planner's efficiency floor (0: none).
        cells: the ranks (``owner`` TP mode: TP ranks) over which an owner spreads its
            matrices, each whole on one; the loads balanced are theirs.

    Returns:
        The owner of each matrix, or None where no move helps before the loads balance.
    """
    if cells > 1 and costs:
        return _cell_owners(costs, holders, world, cells)
    owners, loads = list(holders), _loads(costs, holders, world)
    limit = sum(loads) / max(world, 1) * min(1 + HOLDER_SLACK, 1 / max(min_efficiency, 1e-9))
    while max(loads, default=0.0) > limit:  # each move lowers the sum of squared loads: it ends
        busy, idle = loads.index(max(loads)), loads.index(min(loads))
        gap = loads[busy] - loads[idle]
        movable = [i for i, o in enumerate(owners) if o == busy and 0 < costs[i] < gap]
        if not movable:
            return None  # no move helps before the loads balance
        i = min(movable, key=lambda i: (abs(costs[i] - gap / 2), i))
        owners[i], loads[busy], loads[idle] = idle, loads[busy] - costs[i], loads[idle] + costs[i]
    return owners


def _loads(costs: list[float], owners: list[int], world: int) -> list[float]:
    loads = [0.0] * world
    for cost, owner in zip(costs, owners):
        loads[owner] += cost
    return loads


def _cell_owners(costs: list[float], holders: list[int], world: int, cells: int):
    """``holder_owners`` where each owner spreads its matrices over ``cells`` ranks (``owner``
    TP mode): longest-processing-time over all ``world * cells`` ranks, a matrix kept on its
    holder where that costs at most ``HOLDER_SLACK``; None where the busiest cell
    (``_busiest_cell``) is not shorter by more than that (the moves cost exchange traffic)."""
    load = [0.0] * (world * cells)
    owners = list(holders)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        best = min(range(len(load)), key=lambda c: (load[c], c))
        home = min(range(holders[i] * cells, (holders[i] + 1) * cells), key=lambda c: (load[c], c))
        if load[home] + costs[i] <= (load[best] + costs[i]) * (1 + HOLDER_SLACK):
            best = home
        load[best] += costs[i]
        owners[i] = best // cells
    if _busiest_cell(costs, owners, cells) * (1 + HOLDER_SLACK) < _busiest_cell(
        costs, holders, cells
    ):
        return owners
    return None


def _busiest_cell(costs: list[float], owners: list[int], cells: int) -> float:
    """The busiest cell's load where each owner spreads its matrices as tp.py does."""
    return max(_loads(costs, _holder_cells(costs, owners, cells), (max(owners) + 1) * cells))


def _holder_cells(costs: list[float], holders: list[int], cells: int) -> list[int]:
    """Each matrix's cell ``holder * cells + c``, its holder's matrices spread as tp.py's
    ``owner_cells`` spreads them (``lpt``)."""
    out = [0] * len(costs)
    for holder in set(holders):
        mine = [i for i, h in enumerate(holders) if h == holder]
        for i, c in zip(mine, lpt([costs[i] for i in mine], cells)):
            out[i] = holder * cells + c
    return out


def _balanced_enough(timed: list, works: list[Work], world: int, model, ideal: float) -> list:
    """The candidates whose FLOP efficiency reaches ``model.min_efficiency``; where none does,
    the best balanced alone."""
    flops = [span(works, *c, world, model, link=False) for _, c in timed]
    enough = [pair for pair, f in zip(timed, flops) if ideal >= model.min_efficiency * f]
    return enough or [timed[flops.index(min(flops))]]


def span(works: list[Work], units, gangs: list[int], world: int, model, link=True) -> float:
    """The critical path of an assignment, as the exchange runs it (planner/cost_model.py).

    Args:
        works: the matrices.
        units: per matrix its ``Unit`` list.
        gangs: the split matrices' indices, in run order.
        world: the DP group's size.
        model: the cost model (None: no link cost).
        link: charge the gang collectives, the whole matrices' TP collectives where the model
            has a ``stream`` (``with_streams``) and the all-to-all (else: FLOPs only).

    Returns:
        Matmul FLOPs plus link time expressed in FLOPs.
    """
    infos = [w.info for w in works]
    traces = exchange_schedule(infos, units, gangs, world, model)
    if model is None or not link:
        return critical_path(traces)
    if model.stream is not None:
        traces = with_streams(traces, infos, units, model)
    moved = max(max(pair) for pair in zip(*exchange_elements(works, units, world)))
    exchange = moved * model.exchange_itemsizes * model.link_flops_per_byte
    return critical_path(traces, sync=model.sync_flops, busy=model.busy_flops) + exchange


def exchange_elements(works: list[Work], units, world: int) -> tuple[list[int], list[int]]:
    """Elements each rank sends and receives in the forward all-to-all, self-copies excluded.

    Args:
        works: the matrices.
        units: per matrix its ``Unit`` list.
        world: the DP group's size.

    Returns:
        (sent, received) per rank.
    """
    # A matrix's units cut it into disjoint blocks and its holders' ranges cover it once, so a
    # holder sends all it holds but what its own block takes, and an owner receives its whole
    # block but what it holds itself: one pass over holders and one over units, not their pairs.
    sent, received = [0] * world, [0] * world
    for w, matrix_units in zip(works, units):
        cols = w.local_shape[1]
        own = {u.owner: u.block for u in matrix_units}
        for holder, (first, n) in w.held.items():
            sent[holder] += n - _overlap(own.get(holder), first, n, cols)
        for u in matrix_units:
            rows, width = u.block.shape
            first, n = w.held.get(u.owner, (0, 0))
            received[u.owner] += rows * width - _overlap(u.block, first, n, cols)
    return sent, received


def _overlap(block: Optional[Block], first: int, n: int, cols: int) -> int:
    """Elements of ``block`` among flat positions ``[first, first + n)`` (0 without a block)."""
    if block is None or n == 0:
        return 0
    lo, hi = block.range_of(first, first + n, cols)
    return max(hi - lo, 0)


def _shapers(model: Optional[NSCostModel]) -> list:
    """``model``, and the same with free links where its links cost anything."""
    if model is None or model == model.free_links():
        return [model]
    return [model, model.free_links()]


def _assign(works: list[Work], world: int, model: NSCostModel, target: float):
    """Stacked gangs for matrices above ``target``, then whole matrices by LPT greedy."""
    loads = [0.0] * world
    units: list = [None] * len(works)
    gangs = []
    order = sorted(range(len(works)), key=lambda i: (-works[i].cost, i))
    for i in order:
        k, axis = split_count(model, works[i], target, world)
        if k > 1:
            units[i] = _gang(works[i], k, axis, loads, model)
            gangs.append(i)
    for i in order:
        if units[i] is None:
            w = works[i]
            (owner,) = _fewest(range(world), 1, loads, w.held)
            loads[owner] += w.cost
            units[i] = [whole_unit(w, owner)]
    return units, gangs


def _gang(w: Work, k: int, axis: int, loads: list[float], model: NSCostModel) -> list[Unit]:
    """A gang on ``k`` least-loaded ranks; its members start and end together."""
    none = (math.inf, 0)
    members = _least_loaded(w, k, loads, model.nodes)
    members.sort(key=lambda r: (w.held.get(r, none)[0], r))
    units = gang_units(w, members, axis, model)
    end = max(loads[m] for m in members) + max(u.cost for u in units)
    for m in members:
        loads[m] = end
    return units


def _least_loaded(w: Work, k: int, loads: list[float], nodes: tuple) -> list[int]:
    """The ``k`` least-loaded ranks (holders first on ties), of one node where one fits."""
    fits = [_fewest(ranks, k, loads, w.held) for ranks in _node_ranks(nodes) if len(ranks) >= k]
    if not fits:
        return _fewest(range(len(loads)), k, loads, w.held)
    return min(fits, key=lambda ms: (max(loads[r] for r in ms), sum(loads[r] for r in ms), ms))


def _fewest(ranks: Sequence[int], k: int, loads: list[float], held: dict) -> list[int]:
    """``sorted(ranks, key=(load, -elements held, rank))[:k]`` for ascending ``ranks``. Sorted
    by load alone (ties in rank order), the first ``k`` hold every rank the full order takes,
    but for holders tied with them on load: those few are added, and the full order decides."""
    by_load = (
        sorted(ranks, key=loads.__getitem__)[:k] if k > 1 else [min(ranks, key=loads.__getitem__)]
    )
    pool = set(by_load).union(r for r in held if r in ranks)
    return sorted(pool, key=lambda r: (loads[r], -held.get(r, (0, 0))[1], r))[:k]


@functools.lru_cache(maxsize=8)
def _node_ranks(nodes: tuple) -> tuple[tuple[int, ...], ...]:
    """The ranks of each node of ``nodes`` (a node per rank), nodes in first-seen order."""
    by_node: dict[int, list[int]] = {}
    for r, node in enumerate(nodes):
        by_node.setdefault(node, []).append(r)
    return tuple(tuple(ranks) for ranks in by_node.values())


def whole_unit(w: Work, owner: int) -> Unit:
    """The unit of ``w`` orthogonalized whole.

    Args:
        w: the matrix.
        owner: the DP rank that orthogonalizes it.

    Returns:
        A ``Unit`` covering the whole TP-local matrix.
    """
    return Unit(owner, Block(0, w.local_shape[0], 0, w.local_shape[1]), w.cost)


def gang_units(w: Work, members: list[int], axis: int, model: NSCostModel) -> list[Unit]:
    """Equal consecutive blocks of ``w`` along ``axis``, one per member.

    Args:
        w: the matrix.
        members: the gang's ranks, in block order.
        axis: the split axis (0: rows, 1: columns).
        model: the cost model.

    Returns:
        One ``Unit`` per member.
    """
    rows, cols = w.local_shape
    ring, k = sorted(members), len(members)
    split = model.splits(w.info, axis, w.local_shape[axis], k)
    units = []
    for m, (a, b) in zip(members, cut(rows if axis == 0 else cols, k)):
        block = Block(a, b, 0, cols) if axis == 0 else Block(0, rows, a, b)
        lines = model.lines(w.info, b - a, axis)
        cost = model.member(w.info, axis, lines, (ring.index(m), k, split))
        units.append(Unit(m, block, cost, tuple(members), axis, lines, split))
    return units


# ------------------------------------------------------------------ disjoint gangs (bundles)


def bundle_units(works: list[Work], world: int, model: NSCostModel, most: int):
    """Disjoint gangs: runs of matrices, each whole on one rank or on a gang of its own
    (docs/gangs.md).

    Args:
        works: the Muon matrices of one exchange.
        world: the DP group's size.
        model: the Newton-Schulz cost model.
        most: the most matrices one gang may hold.

    Returns:
        (units, gangs) as ``assign_units``, or None where no bound fits ``world`` ranks.
    """
    runs = _Runs(works, world, model, most).fit()
    if runs is None:
        return None
    units: list = [None] * len(works)
    gangs, taken = [], set()
    # Largest gangs first: they take whole nodes before smaller ones fragment them.
    for ids, k in sorted(runs, key=lambda run: (-run[1], -sum(works[i].cost for i in run[0]))):
        members = _members(works, ids, k, taken, world, model)
        if k == 1:
            for i in ids:
                units[i] = [whole_unit(works[i], members[0])]
            continue
        for i in ids:
            order = sorted(members, key=lambda r: (works[i].held.get(r, (math.inf, 0))[0], r))
            units[i] = gang_units(works[i], order, model.axis(works[i].info), model)
            gangs.append(i)
    return units, gangs


def _members(works: list[Work], ids: list[int], k: int, taken: set, world: int, model) -> list:
    """``k`` free ranks, those holding most of the run first; on one node or evenly over
    whole nodes where the nodes are known."""
    held: dict[int, int] = {}
    for i in ids:
        for r, (_, n) in works[i].held.items():
            if r not in taken:
                held[r] = held.get(r, 0) + n
    pool = _node_members(model.nodes, taken, held, k) if k > 1 and model.nodes else None
    if pool is None:
        pool = sorted(
            (r for r in range(world) if r not in taken), key=lambda r: (-held.get(r, 0), r)
        )
    members = pool[:k]
    taken.update(members)
    return members


def _node_members(nodes: tuple, taken: set, held: dict, k: int) -> Optional[list[int]]:
    """``k`` free ranks on one node, or ``m`` on each of ``k / m`` nodes (``m`` the largest
    divisor of ``k`` that fits); None where none fits."""
    free: dict[int, list[int]] = {}
    for r, node in enumerate(nodes):
        if r not in taken:
            free.setdefault(node, []).append(r)
    for ranks in free.values():
        ranks.sort(key=lambda r: (-held.get(r, 0), r))
    per_node = max(Counter(nodes).values())
    for m in (d for d in range(min(k, per_node), 0, -1) if k % d == 0):
        fits = [ranks for ranks in free.values() if len(ranks) >= m]
        if len(fits) >= k // m and m > 1:
            fits.sort(key=lambda ranks: (-sum(held.get(r, 0) for r in ranks[:m]), ranks[0]))
            return [r for ranks in fits[: k // m] for r in ranks[:m]]
    return None


class _Runs:
    """``bundle_units``' search: fewest ranks for a bound, by dynamic programming over the
    cost-ordered matrices."""

    def __init__(self, works: list[Work], world: int, model: NSCostModel, most: int):
        self.works, self.world, self.model, self.most = works, world, model, most
        self.order = sorted(range(len(works)), key=lambda i: (-works[i].cost, i))
        self.axes = [model.axis(w.info) for w in works]
        self.per_node = max(Counter(model.nodes).values(), default=0)  # DP ranks per node
        self._busiest: dict[tuple[int, int, bool], float] = {}
        self._sizes: dict[int, list[int]] = {}

    def load(self, ids: list[int], k: int, link: bool = True) -> float:
        """FLOPs of a run's busiest member over ``k`` ranks (plus link time if ``link``)."""
        if k == 1:
            return sum(self.works[i].cost for i in ids)
        out = 0.0
        for i in ids:
            if (i, k, link) not in self._busiest:
                w, a = self.works[i], self.axes[i]
                cost = self.model.busiest(w.info, a, w.local_shape[a], k, with_link=link)
                self._busiest[i, k, link] = cost
            out += self._busiest[i, k, link]
        return out

    def most_ranks(self, ids: list[int]) -> int:
        """The largest gang a run can have (one line per member at least); 1: no gang."""
        if len(ids) > self.most or any(self.axes[i] is None for i in ids):
            return 1
        return min([self.world] + [self.works[i].local_shape[self.axes[i]] for i in ids])

    def sizes(self, most: int) -> list[int]:
        """Gang sizes tried, up to ``most``: those fitting one node or filling whole nodes
        (computed once per ``most``; callers do not modify it)."""
        if most not in self._sizes:
            per_node = self.per_node
            self._sizes[most] = [
                k for k in range(2, most + 1) if per_node <= 1 or k <= per_node or k % per_node == 0
            ]
        return self._sizes[most]

    def ranks(self, ids: list[int], bound: float) -> Optional[int]:
        """Fewest ranks whose busiest member works <= bound (bisection over ``sizes``)."""
        if self.load(ids, 1) <= bound:
            return 1
        sizes = self.sizes(self.most_ranks(ids))
        if not sizes or self.load(ids, sizes[-1]) > bound:
            return None
        lo, hi = 0, len(sizes) - 1
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if self.load(ids, sizes[mid]) <= bound else (mid + 1, hi)
        return sizes[lo]

    def cover(self, bound: float) -> tuple[float, list]:
        """(ranks, runs as [ids, k]) of the cheapest partition under ``bound``."""
        order, n = self.order, len(self.order)
        need, choice = [0.0] + [math.inf] * n, [None] * (n + 1)
        for i in range(1, n + 1):
            cost = 0.0
            for j in range(i - 1, -1, -1):
                cost += self.works[order[j]].cost
                if i - j > self.most and cost > bound:
                    break
                k = self.ranks(order[j:i], bound) if need[j] < math.inf else None
                if k is not None and need[j] + k < need[i]:
                    need[i], choice[i] = need[j] + k, (j, k)
        runs, i = [], n
        while i > 0 and choice[i] is not None:
            j, k = choice[i]
            runs.append([order[j:i], k])
            i = j
        return need[n], runs[::-1]

    def fit(self) -> Optional[list]:
        """Runs under the smallest bound that fits ``world`` ranks, spare ranks spread."""
        if not self.works:
            return []
        lo = sum(w.cost for w in self.works) / self.world
        hi = max(lo, max(w.cost for w in self.works))
        need, runs = self.cover(hi)
        if need > self.world:
            return None
        while hi - lo > 1e-3 * hi:
            mid = (lo + hi) / 2
            got = self.cover(mid)
            lo, hi, need, runs = (lo, mid, *got) if got[0] <= self.world else (mid, hi, need, runs)
        self._spread(runs, self.world - int(need))
        return runs

    def _spread(self, runs: list, spare: int) -> None:
        """Spare ranks: first to lower the time bound, then to balance FLOPs under it. Each
        round grows the run a scan of all runs would pick; heaps keep the rounds' candidates,
        since a round changes only the run it grows (``spare`` only falls, so a run too big
        for it once stays so)."""
        busiest = [(-self.load(ids, k), -n, k) for n, (ids, k) in enumerate(runs)]
        heapq.heapify(busiest)
        while spare and busiest:
            neg_load, neg_n, k = busiest[0]
            n = -neg_n
            ids = runs[n][0]
            if k >= self.most_ranks(ids) or self.load(ids, k + 1) >= -neg_load:
                break
            runs[n][1], spare = k + 1, spare - 1
            heapq.heapreplace(busiest, (-self.load(ids, k + 1), -n, k + 1))
        bound = max((self.load(ids, k) for ids, k in runs), default=0.0)
        grow = [c for n in range(len(runs)) if (c := self._growth(runs, n, bound)) is not None]
        heapq.heapify(grow)
        while spare and grow:
            _, neg_n, k2 = heapq.heappop(grow)
            n = -neg_n
            if k2 - runs[n][1] > spare:
                continue
            spare -= k2 - runs[n][1]
            runs[n][1] = k2
            got = self._growth(runs, n, bound)
            if got is not None:
                heapq.heappush(grow, got)

    def _growth(self, runs: list, n: int, bound: float) -> Optional[tuple]:
        """Run ``n``'s next gang size as a heap entry (the largest FLOP load first, then the
        highest ``n``), where it stays under ``bound`` and lowers the run's FLOPs; else None."""
        ids, k = runs[n]
        sizes = self.sizes(self.most_ranks(ids))
        i = bisect.bisect_right(sizes, k)
        if i == len(sizes):
            return None
        k2, flops = sizes[i], self.load(ids, k, link=False)
        if self.load(ids, k2) > bound or self.load(ids, k2, link=False) >= flops:
            return None
        return (-flops, -n, k2)
