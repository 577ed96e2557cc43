"""Randomized invariants of the DistOpt Muon planner (``muon_plan``, ``muon_placement``,
``muon_split``): many small plans from random but valid layouts, every one checked for what must
hold of any plan, each check with a hand-made negative control that shows it can fail.

    .venv/bin/python -m pytest tests/unit/test_muon_plan_random.py -q

A case varies DP (every size 1..24, primes included), nodes (unknown, 2/4/8 ranks per node, the
last node partly filled where DP is not a multiple), matrix shapes (tall, wide, square, tiny ones
with fewer lines than DP ranks, fused QKV with ``qkv_split``), TP 1 or 2 (``duplicated``), the
bucket layout (one bucket, one param per bucket, buckets of a random size; shards cut matrices
anywhere, mid-row included), the link model (default, free, fast, very slow), the ring-step
latency, the NS dtype's width, NS steps and the exchange window. Each case checks three plans:
the one chosen, the no-split plan (``rebuilt(model=None)``) and stacked gangs alone at a random
split target (rarely chosen, the subtlest schedule). Invariants:

1. the units of every matrix tile it; the pieces of an exchange tile every unit's block, each
   piece held by its holder (``block_views`` of the holder's shard give exactly its elements);
2. units have >= 1 line; gang members are distinct; ranks of ``bundle_units``' runs are
   disjoint; the plan (units, gang order, pieces) does not depend on the rank it is built on;
3. the schedule has no circular wait; the chosen plan is no slower (``span`` at the link model)
   than the no-split plan beyond ``TIME_SLACK``; its FLOP critical path is >= total / dp and >=
   the busiest rank's FLOPs; ``efficiency()`` is in (0, 1];
4. counted figures agree: per-rank FLOPs with the unit costs and with the traces the critical
   path runs; sent with received elements, with ``exchange_elements`` and with the all-to-all
   split sizes of both ends; every member of a gang runs the same collectives, each posted once
   by every member, in the same order as every other member of that member set;
   ``sync_points`` counts them;
5. building the same plan twice gives identical units and pieces.
"""

import copy
import dataclasses
import math
import random
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest
import torch

from megatron.core.optimizer.megatron_muon.exchange import (
    Block,
    BucketSlot,
    MatrixSlot,
    Unit,
    block_views,
)
from megatron.core.optimizer.megatron_muon.factory import MegatronMuonParamInfo
from megatron.core.optimizer.megatron_muon.planner import figures as plan_figures
from megatron.core.optimizer.megatron_muon.planner.cost_model import (
    POST,
    collectives,
    critical_path,
    cut,
    lone_gangs,
    member_events,
)
from megatron.core.optimizer.megatron_muon.planner.placement import (
    BUNDLES,
    TARGETS,
    TIME_SLACK,
    bundle_units,
    exchange_elements,
    gang_units,
    span,
    whole_unit,
)
from megatron.core.optimizer.megatron_muon.planner.plan import MuonExchangePlan, piece

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import projection  # noqa: E402

SEED = 20261201
CASES = 120  # every DP size 1..24 five times
SIDE, MATRICES = 40, 8  # the longest random side, the most matrices of a case (small: fast)
# Float sums in another order (critical path vs per-rank totals): relative rounding, far below
# any real difference (a unit's FLOPs are integers >= 1 of magnitude <= 1e9 here).
REL = 1e-9
LINKS = {  # link_flops_per_byte, tp_link_flops_per_byte; None: the model's default
    "default": None,
    "free": (0.0, 0.0),
    "fast": (1.0, 0.1),  # cheap enough that gangs pay off on these small matrices
    "slow": (1e9, 1e8),  # no gang collective pays off
}


@dataclass(frozen=True)
class Case:
    """One random layout: what the plan is built from (``build``)."""

    dp: int
    tp: int
    per_node: int  # 0: nodes unknown
    params: tuple  # (TP-local shape, MegatronMuonParamInfo or None for a non-Muon param)
    bucket_size: Optional[int]  # None: one bucket
    align: int  # param starts aligned to this many elements
    pad: int  # bucket ends padded to a multiple of this (a multiple of dp)
    links: str
    latency: float  # step_latency_flops
    ns_itemsize: int  # NS dtype's bytes (a split polynomial is gathered in it)
    steps: int
    window: Optional[int]
    target: float  # a split target of the stacked-gang plan, in multiples of total / dp

    def model(self):
        nodes = tuple(r // self.per_node for r in range(self.dp)) if self.per_node else ()
        kw = dict(nodes=nodes, step_latency_flops=self.latency, ns_itemsize=self.ns_itemsize)
        if LINKS[self.links] is not None:
            kw.update(zip(("link_flops_per_byte", "tp_link_flops_per_byte"), LINKS[self.links]))
        model = projection.cost_model(self.tp, "duplicated", self.steps, **kw)
        return model.free_links() if self.links == "free" else model


def random_matrix(rng: random.Random, dp: int, tp: int) -> tuple:
    """(TP-local shape, info) of a tall, wide, square, tiny or fused QKV matrix; TP shards rows,
    columns or nothing (a QKV weight: its query groups)."""
    kind = rng.choice(("tall", "wide", "square", "tiny", "qkv"))
    split, dim = None, rng.choice((0, 1, None)) if tp > 1 else None
    if kind == "qkv":
        groups, heads = tp * rng.choice((1, 2)), rng.choice((1, 2, 4))
        head_dim = rng.randint(1, max(1, SIDE // 10))
        split, dim = (heads * head_dim, head_dim, head_dim), (0 if tp > 1 else None)
        shape = [groups * sum(split), rng.randint(2, SIDE // 2)]
    elif kind == "tiny":  # fewer lines than DP ranks
        shape = [rng.randint(1, max(1, dp - 1)), rng.randint(1, 3)]
        shape = shape if rng.random() < 0.5 else shape[::-1]
    else:
        a, b = sorted((rng.randint(1, SIDE), rng.randint(1, SIDE)))
        shape = {"tall": [b + 1, a], "wide": [a, b + 1], "square": [a, a]}[kind]
    if dim is not None and kind != "qkv":
        shape[dim] *= tp
    local = list(shape)
    if dim is not None:
        local[dim] //= tp
    info = MegatronMuonParamInfo(tuple(shape), split, partition_dim=dim)
    return tuple(local), info


def random_case(rng: random.Random, dp: int) -> Case:
    tp = rng.choice((1, 2))
    params = []
    for _ in range(rng.randint(1, MATRICES)):
        if rng.random() < 0.3:  # a layernorm-like param between the matrices
            params.append(((rng.randint(1, 50),), None))
        params.append(random_matrix(rng, dp, tp))
    total = sum(math.prod(shape) for shape, _ in params)
    bucket = rng.choice(("one", "each", "cut", "cut"))
    size = {"one": None, "each": 1, "cut": rng.randint(1, total)}[bucket]
    window = rng.choice((None, None, 1, rng.randint(1, total)))
    return Case(
        dp=dp,
        tp=tp,
        per_node=rng.choice((0, 2, 4, 8)),
        params=tuple(params),
        bucket_size=size,
        align=rng.choice((1, 1, 8, 64)),
        pad=dp * rng.choice((1, 1, 3)),
        links=rng.choice(tuple(LINKS)),
        latency=rng.choice((0.0, 0.0, 1e2, 1e5)),
        ns_itemsize=rng.choice((2, 4)),
        steps=rng.randint(1, 5),
        window=window,
        target=rng.choice(TARGETS[:-1]),
    )


def layout(case: Case) -> list[tuple[int, int, dict]]:
    """Buckets (start, end, {param index: (start, end)}) of a DDP-like buffer: starts aligned,
    a bucket closed once it holds >= ``bucket_size`` elements, its end padded to ``pad``."""
    buckets, current, first, at = [], {}, 0, 0
    for i, (shape, _) in enumerate(case.params):
        start = -(-at // case.align) * case.align
        current[i], at = (start, start + math.prod(shape)), start + math.prod(shape)
        if case.bucket_size is not None and at - first >= case.bucket_size:
            end = -(-at // case.pad) * case.pad
            buckets.append((first, end, current))
            current, first, at = {}, end, end
    if current:
        buckets.append((first, -(-at // case.pad) * case.pad, current))
    return buckets


def build(case: Case, rank: int = 0) -> MuonExchangePlan:
    """The plan of ``case`` as DP rank ``rank`` builds it (fresh slots: the plan fills them)."""
    model = case.model()
    buckets, matrices = [], []
    for start, end, members in layout(case):
        bucket = BucketSlot(group=None, shard_size=(end - start) // case.dp)
        for i, (lo, hi) in members.items():
            shape, info = case.params[i]
            if info is None:
                continue
            bucket.matrices.append(len(matrices))
            cost = model.whole(info)
            slot = MatrixSlot(f"p{i}", len(buckets), lo - start, hi - start, shape, info, cost)
            matrices.append(slot)
        buckets.append(bucket)
    return MuonExchangePlan(buckets, matrices, rank, case.dp, case.window, model)


def works_of(plan: MuonExchangePlan, ex) -> list:
    return [plan._work(plan.matrices[i]) for i in ex.matrices]


def assignment(plan: MuonExchangePlan, ex) -> tuple[list, list[int]]:
    """``ex`` as the planner's ``assign_units`` returned it: units per matrix of the exchange,
    the gang order as positions among them."""
    at = {i: j for j, i in enumerate(ex.matrices)}
    return [plan.matrices[i].units for i in ex.matrices], [at[i] for i in ex.gangs]


# ------------------------------------------------------------------ the invariants


def check_tiling(plan: MuonExchangePlan) -> None:
    """1: units tile each matrix; pieces tile each unit's block, each from its holder."""
    for ex in plan.exchanges:
        keys = [p.key for p in ex.pieces]
        assert keys == sorted(keys) and len(set(keys)) == len(keys), "pieces: one sorted key each"
        checked = 0
        for i in ex.matrices:
            slot = plan.matrices[i]
            rows, cols = slot.local_shape
            count = torch.zeros(rows, cols, dtype=torch.int64)
            for u in slot.units:
                b = u.block
                assert 0 <= b.r0 < b.r1 <= rows and 0 <= b.c0 < b.c1 <= cols, f"{slot.name} {b}"
                count[b.r0 : b.r1, b.c0 : b.c1] += 1
            assert bool((count == 1).all()), f"{slot.name}: units do not tile the matrix"
            for u in slot.units:
                checked += _check_unit_pieces(plan, ex, i, u)
        assert checked == len(ex.pieces), "pieces outside the exchange's units"


def _check_unit_pieces(plan, ex, i: int, u: Unit) -> int:
    slot = plan.matrices[i]
    cols, shard = slot.local_shape[1], plan.buckets[slot.bucket].shard_size
    grid = torch.arange(math.prod(slot.local_shape)).view(slot.local_shape)
    order = grid[u.block.r0 : u.block.r1, u.block.c0 : u.block.c1].reshape(-1)
    mine = sorted((p.lo, p.hi, p.holder) for p in ex.pieces if (p.matrix, p.owner) == (i, u.owner))
    at = 0
    for lo, hi, holder in mine:
        assert lo == at < hi, f"{slot.name} unit of {u.owner}: gap or overlap at {at}"
        held_lo, held_hi = (x - slot.start for x in piece(slot, holder, shard))
        views = block_views(torch.arange(held_lo, max(held_lo, held_hi)), held_lo, cols, u.block)
        got = torch.cat([v.reshape(-1) for v in views]) if views else order[:0]
        assert torch.equal(got, order[lo:hi]), f"{slot.name}: rank {holder} holds other elements"
        at = hi
    assert at == order.numel(), f"{slot.name} unit of {u.owner}: {at} of {order.numel()} sent"
    return len(mine)


def check_units(plan: MuonExchangePlan) -> None:
    """2: every unit has >= 1 line; a gang's members are distinct and own one block each,
    near-equal and consecutive along the model's axis in gang order (``cut``: what the cost
    model's busiest member assumes), with their block's TP-gathered lines."""
    for slot in plan.matrices:
        owners = [u.owner for u in slot.units]
        assert owners and len(set(owners)) == len(owners), f"{slot.name}: owners {owners}"
        assert all(0 <= r < plan.world for r in owners), f"{slot.name}: owners {owners}"
        assert all(min(u.block.shape) >= 1 and u.cost > 0 for u in slot.units), slot.name
        if len(slot.units) == 1:
            u = slot.units[0]
            assert not u.gang and u.block == Block(0, slot.local_shape[0], 0, slot.local_shape[1])
            continue
        axis = plan.model.axis(slot.info)
        spans = [
            (u.block.r0, u.block.r1) if axis == 0 else (u.block.c0, u.block.c1) for u in slot.units
        ]
        assert spans == cut(slot.local_shape[axis], len(spans)), f"{slot.name}: blocks {spans}"
        for u in slot.units:
            assert u.gang == tuple(owners) and u.axis == axis is not None, f"{slot.name}: {u}"
            local = u.block.shape[axis]
            assert u.lines == plan.model.lines(slot.info, local, axis) >= 1, f"{slot.name}: {u}"
            assert u.splits == slot.units[0].splits, f"{slot.name}: one decision per gang"
    for ex in plan.exchanges:
        split = [i for i in ex.matrices if len(plan.matrices[i].units) > 1]
        assert sorted(ex.gangs) == split, f"gang order {ex.gangs} is not the split matrices"


def check_disjoint(units: list, gangs: list[int]) -> None:
    """2: in a ``bundle_units`` candidate, no rank serves two runs: gangs are equal or
    disjoint, and no gang member owns a whole matrix."""
    sets = {u.members for i in gangs for u in units[i]}
    ranks = [r for s in sets for r in s]
    assert len(ranks) == len(set(ranks)), f"a rank in two gangs: {sorted(sets)}"
    whole = {u.owner for matrix_units in units for u in matrix_units if not u.gang}
    assert not whole & set(ranks), f"ranks {sorted(whole & set(ranks))} in a gang and whole"


def check_same(plan: MuonExchangePlan, other: MuonExchangePlan) -> None:
    """2 and 5: ``other`` (built again, or on another rank) decides exactly what ``plan`` did:
    exchanges, gang order, pieces, every matrix's units."""

    def decided(p):
        exchanges = [(ex.matrices, ex.gangs, ex.pieces) for ex in p.exchanges]
        return exchanges, [m.units for m in p.matrices]

    assert decided(other) == decided(plan), f"rank {other.rank} planned differently"


def check_times(plan: MuonExchangePlan, unsplit: Optional[MuonExchangePlan]) -> None:
    """3: no circular wait; no slower than ``unsplit`` (if given) at the link model; FLOP
    critical path bounds and efficiency."""
    model = plan.model
    path = plan_figures.critical_path_flops(plan)  # asserts on a circular wait
    if model is not None:
        critical_path(
            [plan_figures.trace(plan, r) for r in range(plan.world)], sync=model.sync_flops
        )
    spans = 0.0  # what the planner weighed: each exchange's FLOP span, between two all-to-alls
    for ex in plan.exchanges:
        spans += span(works_of(plan, ex), *assignment(plan, ex), plan.world, model, link=False)
    assert math.isclose(path, spans, rel_tol=REL), f"path {path} != the planner's spans {spans}"
    if unsplit is not None:
        _check_no_slower(plan, unsplit)
    # A split matrix runs at least half its whole FLOPs: its Gram's upper triangle and its
    # polynomial's pieces hold each symmetric element once (3 g^2 L + g^3 a step, whole 4 g^2 L
    # + 2 g^3; newton_schulz.upper_gram, polynomial_rows).
    least = sum(m.cost / (1 if len(m.units) == 1 else 2) for m in plan.matrices)
    ideal, busiest = least / plan.world, max(plan_figures.ns_flops_per_rank(plan))
    assert path >= max(ideal, busiest) * (1 - REL), f"path {path} < {max(ideal, busiest)}"
    assert 0 < plan_figures.efficiency(plan) <= 2 + REL, (
        f"efficiency {plan_figures.efficiency(plan)}"
    )


def _check_no_slower(plan: MuonExchangePlan, unsplit: MuonExchangePlan) -> None:
    """Per exchange, the plan's ``span`` at its link model is within ``TIME_SLACK`` of the
    no-split plan's (a candidate the planner weighed)."""
    model = plan.model
    for ex, base in zip(plan.exchanges, unsplit.exchanges, strict=True):
        assert ex.matrices == base.matrices
        works = works_of(plan, ex)
        mine = span(works, *assignment(plan, ex), plan.world, model)
        theirs = span(works, *assignment(unsplit, base), plan.world, model)
        assert mine <= theirs * (1 + TIME_SLACK), f"slower than no split: {mine} > {theirs}"


def check_counts(plan: MuonExchangePlan) -> None:
    """4: traffic and gang collectives agree with each other and with the traces; per-rank
    FLOPs with the unit costs and with the traces the critical path runs."""
    traces = [plan_figures.trace(plan, r) for r in range(plan.world)]
    want: Counter = Counter()
    for ex in plan.exchanges:
        _check_traffic(plan, ex)
        _check_gang_events(plan, ex)
        for members, n in plan_figures.gang_sums(plan, ex):
            want[members, int(n), type(n)] += len(members)
    posted = Counter((e[2], int(e[3]), type(e[3])) for t in traces for e in t if e[1] == POST)
    assert posted == want, "posted collectives are not the gangs' sums, once per member"
    _check_matched(traces)
    count = sum(ex.moves for ex in plan.exchanges) + sum(
        len(plan_figures.gang_sums(plan, ex)) for ex in plan.exchanges
    )
    assert plan_figures.sync_points(plan) == count
    per_rank = plan_figures.ns_flops_per_rank(plan)
    units = sum(u.cost for m in plan.matrices for u in m.units)
    assert math.isclose(sum(per_rank), units, rel_tol=REL), f"{sum(per_rank)} != {units}"
    for r, trace in enumerate(traces):
        ran = sum(entry[0] for entry in trace)
        assert math.isclose(ran, per_rank[r], rel_tol=REL), f"rank {r} runs {ran} != {per_rank[r]}"


def _check_matched(traces: list) -> None:
    """The k-th collective a rank posts to a member set is, on every member, of the same kind
    and size (a real collective over those ranks would hang or fail otherwise; the critical
    path pairs them by count alone)."""
    posts: dict = {}
    for r, trace in enumerate(traces):
        for _, op, members, n in trace:
            if op == POST:
                posts.setdefault(members, {}).setdefault(r, []).append((type(n), int(n)))
    for members, by_rank in posts.items():
        assert sorted(by_rank) == list(members), f"{members}: posted by {sorted(by_rank)}"
        runs = {tuple(v) for v in by_rank.values()}
        assert len(runs) == 1, f"{members}: members post collectives in another order"


def _check_traffic(plan: MuonExchangePlan, ex) -> None:
    sent, received = plan.__dict__.get("_traffic", plan_figures.traffic)(plan, ex)
    assert sum(sent) == sum(received), f"sent {sum(sent)} != received {sum(received)}"
    units = [plan.matrices[i].units for i in ex.matrices]
    counted = exchange_elements(works_of(plan, ex), units, plan.world)
    assert (sent, received) == counted, "traffic is not what exchange_elements counts"
    sizes = [ex.split_sizes(r, plan.world) for r in range(plan.world)]
    for r, (send, recv) in enumerate(sizes):
        assert send[:r] + send[r + 1 :] == [sizes[o][1][r] for o in range(plan.world) if o != r]
        assert sum(send) - send[r] == sent[r] and sum(recv) - recv[r] == received[r]


def _check_gang_events(plan: MuonExchangePlan, ex) -> None:
    """Every member of a gang runs the same collectives, of the sizes ``gang_sums`` counts."""
    counted = Counter(plan_figures.gang_sums(plan, ex))
    lone = lone_gangs([m.units for m in plan.matrices], ex.gangs)
    for i in ex.gangs:
        slot = plan.matrices[i]
        runs = set()
        for u in slot.units:
            events = member_events(plan.model, slot.info, u.axis, u.lines, u.part, i in lone)
            runs.add(
                tuple((type(e), getattr(e, "phase", None), int(e)) for e in collectives(events))
            )
        assert len(runs) == 1, f"{slot.name}: members run different collectives"
        for kind, _, n in runs.pop():
            counted[slot.units[0].members, kind(n)] -= 1
    assert not +counted and not -counted, "gang_sums is not what the members run"


def check_plan(case: Case) -> dict:
    """All invariants on the plan of ``case`` and on its no-split plan; what it exercised."""
    plan = build(case, 0)
    unsplit = plan.rebuilt(case.window, model=None)
    # Stacked gangs alone (``_assign`` at one target): rarely the best, the subtlest schedule.
    stacked = plan.rebuilt(case.window, plan.model, targets=(case.target,), bundles=())
    for p in (plan, unsplit, stacked):
        check_tiling(p)
        check_units(p)
        check_counts(p)
        check_times(p, unsplit if p is plan else None)
    check_same(plan, build(case, 0))  # 5
    check_same(plan, build(case, case.dp - 1))  # 2 (for dp 1: 5 again)
    for ex in plan.exchanges:
        works = works_of(plan, ex)
        for model in {plan.model, plan.model.free_links()}:
            for n in BUNDLES:
                got = bundle_units(works, plan.world, model, n)
                if got is not None:
                    check_disjoint(*got)
    units = [u for m in plan.matrices for u in m.units]
    return dict(
        gangs=any(u.gang for u in units),
        splits=any(u.splits for u in units),
        stacked=_stacked(plan) or _stacked(stacked),
        qkv_gang=any(len(m.units) > 1 and m.info.qkv_split for m in plan.matrices),
        tp_gang=any(len(m.units) > 1 and m.info.partition_dim is not None for m in plan.matrices),
        cut=any(len(ex.pieces) > len(ex.matrices) for ex in plan.exchanges),
        exchanges=len(plan.exchanges) > 1,
    )


def _stacked(plan: MuonExchangePlan) -> bool:
    """Whether a rank is in two gangs of different members."""
    sets = {plan.matrices[i].units[0].members for ex in plan.exchanges for i in ex.gangs}
    return sum(map(len, sets)) > len(set().union(*sets))


def cases() -> list[Case]:
    rng = random.Random(SEED)
    return [random_case(rng, 1 + n % 24) for n in range(CASES)]


def test_random_plans_keep_every_invariant():
    """``CASES`` random layouts, each plan (and its no-split plan) checked for 1-5; the run
    must have exercised gangs, split polynomials, stacked gangs, QKV and TP gangs, matrices cut
    across shards and several exchanges, else the generator tests too little."""
    seen: Counter = Counter()
    for n, case in enumerate(cases()):
        try:
            seen.update(k for k, v in check_plan(case).items() if v)
        except AssertionError as error:
            raise AssertionError(f"case {n}: {case}") from error
    kinds = ("gangs", "splits", "stacked", "qkv_gang", "tp_gang")
    assert all(seen[k] >= CASES // 10 for k in kinds), seen
    assert seen["cut"] >= CASES // 4 and seen["exchanges"] >= CASES // 10, seen


# ------------------------------------------------------------------ negative controls

# dp 4, free links: gangs (0, 1) on the tall matrix and (2, 3) on the other three (a disjoint
# gang of three matrices, split polynomials), one bucket whose shards cut every large matrix.
BASE = Case(
    dp=4,
    tp=1,
    per_node=0,
    params=tuple(
        (shape, MegatronMuonParamInfo(shape, split))
        for shape, split in [((48, 8), None), ((8, 40), None), ((12, 6), (2, 1, 1)), ((3, 5), None)]
    ),
    bucket_size=None,
    align=1,
    pad=4,
    links="free",
    latency=0.0,
    ns_itemsize=4,
    steps=2,
    window=None,
    target=1.0,
)


def _unit(plan, name: str, k: int, **change) -> None:
    slot = next(m for m in plan.matrices if m.name == name)
    slot.units[k] = dataclasses.replace(slot.units[k], **change)


def _piece(plan, k: int, **change) -> None:
    pieces = plan.exchanges[0].pieces
    pieces[k] = dataclasses.replace(pieces[k], **change)
    pieces.sort(key=lambda p: p.key)


def _all_on_rank_0(plan) -> None:
    for slot in plan.matrices:
        slot.units = [Unit(0, Block(0, slot.local_shape[0], 0, slot.local_shape[1]), slot.cost)]
    plan.exchanges[0].gangs = []


def _reversed_on(plan, rank: int) -> None:
    """``rank`` runs the plan's gangs in the reverse order."""
    reverse = copy.copy(plan)
    reverse.exchanges = [dataclasses.replace(ex, gangs=ex.gangs[::-1]) for ex in plan.exchanges]
    reverse.__dict__.pop("_schedule_cache", None)
    for ex, rex in zip(plan.exchanges, reverse.exchanges):  # its rows of the cached schedule
        rows = list(plan_figures._schedule(plan, ex))
        rows[rank] = plan_figures._schedule(reverse, rex)[rank]
        plan._schedule_cache[id(ex)] = rows


def _circle(plan) -> None:
    """Gangs (0, 1), (1, 2), (0, 2) (stacked, by hand), rank 0 running them in reverse: each
    rank's gang link (modeled one post at a time) waits first for a collective its neighbour
    posts later."""
    ex = plan.exchanges[0]
    model, works = plan.model, works_of(plan, ex)
    for j, members in enumerate([[0, 1], [1, 2], [0, 2]]):
        plan.matrices[ex.matrices[j]].units = gang_units(works[j], members, 0, model)
    plan.matrices[ex.matrices[3]].units = [whole_unit(works[3], 3)]
    ex.gangs = ex.matrices[:3]
    _reversed_on(plan, 0)


def _traffic_with_self_copies(plan) -> None:
    def traffic(plan, ex):
        sent, received = [0] * plan.world, [0] * plan.world
        for p in ex.pieces:
            sent[p.holder] += p.size
            received[p.owner] += p.size
        return sent, received

    plan._traffic = traffic  # read by _check_traffic in place of the counted figure


def _stale(plan) -> None:
    plan_figures.critical_path_flops(plan)
    _all_on_rank_0(plan)


def _costlier(plan) -> None:
    plan.matrices[1].cost *= 10


def _times(plan) -> None:
    check_times(plan, plan.rebuilt(BASE.window, model=None))


# fmt: off
CONTROLS = [  # (invariant, what is broken, mutation, check, message)
    ("1", "a piece dropped", lambda p: p.exchanges[0].pieces.pop(5), check_tiling, "gap|sent"),
    ("1", "a block a row short", lambda p: _unit(p, "p0", 1, block=Block(25, 48, 0, 8)),
     check_tiling, "tile"),
    ("1", "a piece from another holder", lambda p: _piece(p, 0, holder=3), check_tiling,
     "holds other"),
    ("2", "a member twice", lambda p: _unit(p, "p1", 1, owner=2), check_units, "owners"),
    ("2", "a block of no line", lambda p: _unit(p, "p3", 0, block=Block(0, 3, 0, 0)),
     check_units, "p3"),
    ("2", "a rank in two gangs", lambda p: _unit(p, "p0", 1, owner=2, gang=(0, 2)),
     lambda p: check_disjoint(*assignment(p, p.exchanges[0])), "two gangs"),
    ("2", "gang order by rank", lambda p: p.exchanges[0].gangs.reverse(),
     lambda p: check_same(build(BASE, 3), p), "differently"),
    ("3", "a circular wait", _circle, _times, "circle"),
    ("3", "slower than no split", _all_on_rank_0, _times, "slower"),
    ("3", "a matrix costlier than its units run", _costlier, _times, "path"),
    ("3", "a critical path cached before a change", _stale, _times, "planner's spans"),
    ("4", "gangs run in another order on one rank", lambda p: _reversed_on(p, 2), check_counts,
     "another order"),
    ("4", "a member's FLOPs miscounted", lambda p: _unit(p, "p1", 0, cost=1.0), check_counts,
     "runs"),
    ("4", "self-copies counted as traffic", _traffic_with_self_copies, check_counts,
     "exchange_elements"),
    ("4", "one member not splitting its polynomial", lambda p: _unit(p, "p2", 0, splits=False),
     check_counts,
     "different collectives"),
    ("5", "a piece moved", lambda p: _piece(p, 0, lo=1), lambda p: check_same(build(BASE), p),
     "differently"),
]
# fmt: on


@pytest.mark.parametrize(
    "invariant, broken, mutate, check, message", CONTROLS, ids=[c[1] for c in CONTROLS]
)
def test_each_check_catches_a_broken_plan(invariant, broken, mutate, check, message):
    """Negative controls: each check passes on ``BASE``'s plan and fails once one thing in it
    is broken by hand (its invariant's number in the table)."""
    check(build(BASE))
    plan = build(BASE)
    mutate(plan)
    with pytest.raises(AssertionError, match=message):
        check(plan)
