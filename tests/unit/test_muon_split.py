"""The gang plan's arithmetic (``planner/cost_model.py``): blocks of a flat shard, the schedule's
critical path, and plans at projection scale that cover every element once
and never lengthen the path.

    .venv/bin/python -m pytest tests/unit/test_muon_split.py -q
"""

import dataclasses
import itertools
import math
import sys
from pathlib import Path

import pytest
import torch

from megatron.core.optimizer.megatron_muon.exchange import Block, block_views
from megatron.core.optimizer.megatron_muon.newton_schulz import (
    packed_size,
    polynomial_ranges,
    upper_gram_flops,
)
from megatron.core.optimizer.megatron_muon.planner import cost_model, placement
from megatron.core.optimizer.megatron_muon.planner import figures as plan_figures
from megatron.core.optimizer.megatron_muon.planner.cost_model import (
    ALL,
    POST,
    WAIT,
    Gather,
    Partial,
    Sum,
    critical_path,
    member_events,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import projection  # noqa: E402

BLOCKS = [Block(0, 5, 0, 7), Block(1, 4, 0, 7), Block(0, 5, 2, 5), Block(2, 3, 6, 7)]


@pytest.mark.parametrize("block", BLOCKS)
def test_block_views_and_range_match_brute_force(block):
    """Every flat range of a 5 x 7 matrix: the views hold the block's elements in the range, in
    the block's row-major order, and ``range_of`` is where they sit in the block."""
    rows, cols = 5, 7
    matrix = torch.arange(rows * cols)
    inside = [x for x in range(rows * cols) if block.r0 <= x // cols < block.r1]
    inside = [x for x in inside if block.c0 <= x % cols < block.c1]
    for lo, hi in itertools.combinations(range(rows * cols + 1), 2):
        views = block_views(matrix[lo:hi], lo, cols, block)
        got = torch.cat([v.reshape(-1) for v in views]) if views else torch.empty(0)
        want = [x for x in inside if lo <= x < hi]
        assert got.tolist() == want
        start, end = block.range_of(lo, hi, cols)
        assert inside[start:end] == want


EVERYONE = (0, 1, 2)


def test_critical_path_overlaps_a_posted_collective_with_the_main_threads_work():
    # Ranks 0 and 1 post a sum after 5 and 2 FLOPs: it runs 5 -> 9 (sync = elements) while
    # rank 0 computes 3 more (5 -> 8); rank 0 waits until 9, the all-to-all ends when the last
    # arrives. Blocking on the sum instead would end rank 0 at 5 + 4 + 3 = 12.
    traces = [
        [(5, POST, (0, 1), 4), (3, WAIT, (0, 1), 4), (0, ALL, EVERYONE, 0)],
        [(2, POST, (0, 1), 4), (0, WAIT, (0, 1), 4), (0, ALL, EVERYONE, 0)],
        [(1, ALL, EVERYONE, 0)],
    ]
    assert critical_path(traces, sync=lambda members, n: n) == 9
    assert critical_path(traces) == 8  # free links: the sum ends when its last member posts


def test_arrival_times_are_each_ranks_own_end_before_the_all_to_all():
    # The first test's traces: rank 0 reaches the all-to-all at 9 (its wait), rank 1 at 9 (it
    # waits for the same sum), rank 2 at 1; the latest is the critical path.
    traces = [
        [(5, POST, (0, 1), 4), (3, WAIT, (0, 1), 4), (0, ALL, EVERYONE, 0)],
        [(2, POST, (0, 1), 4), (0, WAIT, (0, 1), 4), (0, ALL, EVERYONE, 0)],
        [(1, ALL, EVERYONE, 0)],
    ]
    sync = lambda members, n: n  # noqa: E731
    ends = cost_model.arrival_times(traces, sync=sync)
    assert ends == [9, 9, 1] and max(ends) == critical_path(traces, sync=sync)


def test_critical_path_prices_equal_sized_collectives_of_other_kinds_apart():
    # A Sum, a Gather and a Partial of 4 elements are equal ints; the schedule prices each
    # collective once, so its key must tell them (and their tp) apart. One rank, one after the
    # other: link time tp each (1 + 2 + 2), main-thread time 1 before a Partial's post.
    collectives = [Sum(4, 1), Sum(4, 2), Gather(4, 2), Partial(4, 2)]
    trace = [e for n in collectives for e in ((0, POST, (0,), n), (0, WAIT, (0,), n))]
    busy = lambda n: (1.0, 0.0) if isinstance(n, Partial) else (0.0, 0.0)  # noqa: E731
    sync = lambda members, n: float(getattr(n, "tp", 0))  # noqa: E731
    assert critical_path([trace + [(0, ALL, (0,), 0)]], sync=sync, busy=busy) == 8.0


def test_critical_path_serves_a_ranks_posts_one_at_a_time_in_order():
    # Rank 0 posts to (0, 1), then (0, 2); rank 1 posts late (6): its sum runs 6 -> 8, and only
    # then does rank 0's gang link (one post at a time, in the model) start the sum with rank 2
    # (8 -> 10), although rank 2 posted at 0.
    traces = [
        [(1, POST, (0, 1), 2), (0, POST, (0, 2), 2), (0, WAIT, (0, 1), 2), (0, WAIT, (0, 2), 2)],
        [(6, POST, (0, 1), 2), (0, WAIT, (0, 1), 2)],
        [(0, POST, (0, 2), 2), (0, WAIT, (0, 2), 2)],
    ]
    traces = [t + [(0, ALL, EVERYONE, 0)] for t in traces]
    assert critical_path(traces, sync=lambda members, n: n) == 10


def test_tp_collectives_around_a_gang_collective_hold_the_main_thread():
    # gangs.py runs them synchronously: before the post (a partial sum's reduce-scatter, 0.5)
    # and after the wait (the all-gather of the slices, 0.25). Rank 0 posts at 1 + 0.5, the sum
    # rings 1.5 -> 5.5 under its 5 FLOPs (-> 6.5), then gathers: 6.75, then 2: 8.75. Charged
    # inside the async link time instead (4.75) it would hide under the FLOPs: 8.
    traces = [[(1, POST, (0, 1), 4), (5, WAIT, (0, 1), 4), (2, ALL, (0, 1), 0)]] * 2
    busy = lambda n: (0.5, 0.25) if n else (0.0, 0.0)  # noqa: E731
    assert critical_path(traces, sync=lambda members, n: n, busy=busy) == 8.75
    assert critical_path(traces, sync=lambda members, n: n + 0.75 if n else 0) == 8


def test_cost_model_charges_a_partial_sums_tp_collectives_apart_from_its_link_time():
    """A 70B fc1 Gram sum in the ``distributed`` mode (a ``Partial`` over TP 8): the exchange
    of the partials' slices over TP before its post and the all-gather after its wait, both in
    the NS dtype, are main-thread time (``busy_flops``), at NVLink; its link time
    (``sync_flops``) is the gang's ring only; run alone it costs both (``collective_flops``,
    what ``busiest`` and ``splits`` weigh)."""
    chunk = -(-packed_size(8192) // 8)
    for itemsize, dtype in ((4, "float32"), (2, "bfloat16")):
        model = projection.cost_model(8, "distributed", ns_itemsize=itemsize)
        gram = Partial(packed_size(8192), 8)
        before, after = model.tp_around(gram)
        # 7 chunks sent and 7 received: a fp32 reduce-scatter's bytes in fp32, half in bf16
        assert [(c.op, c.elements, c.dtype, c.moved) for c in before] == [
            ("all_to_all_single", 8 * chunk, dtype, 14 * chunk)
        ]
        assert [(c.op, c.elements, c.dtype) for c in after] == [
            ("all_gather_into_tensor", chunk, dtype)
        ]
        per_byte = model.tp_link_flops_per_byte
        one_way = 7 * chunk * itemsize * per_byte
        assert model.busy_flops(gram) == pytest.approx((one_way,) * 2, rel=1e-12)
    model, gang = projection.cost_model(8, "distributed"), (0, 1, 2)
    slow, fast = model.ring_bytes(gang, gram)
    link = slow * model.link_flops_per_byte + fast * per_byte
    assert model.sync_flops(gang, gram) == pytest.approx(link, rel=1e-12)
    assert model.collective_flops(gang, gram) == pytest.approx(
        link + sum(model.busy_flops(gram)), rel=1e-12
    )
    norm = Partial(1, 8)  # too small to slice: all-reduced over TP first, nothing after
    assert [c.op for c in model.tp_around(norm)[0]] == ["all_reduce"]
    assert model.tp_around(norm)[1] == [] and model.tp_around(Sum(1)) == ([], [])


def test_critical_path_refuses_members_posting_one_collective_with_different_sizes():
    # the first post over (0, 1) is 4 elements on rank 0 and 5 on rank 1: a real run would
    # hang or fail, so the model must not time it
    traces = [
        [(1, POST, (0, 1), 4), (0, WAIT, (0, 1), 4), (0, ALL, EVERYONE, 0)],
        [(1, POST, (0, 1), 5), (0, WAIT, (0, 1), 5), (0, ALL, EVERYONE, 0)],
        [(1, ALL, EVERYONE, 0)],
    ]
    with pytest.raises(AssertionError, match="different sizes"):
        critical_path(traces)
    traces[1][0] = (1, POST, (0, 1), 4)
    assert critical_path(traces) == 1


def test_critical_path_refuses_a_schedule_that_waits_in_a_circle():
    posts = [((0, 1), (0, 2)), ((1, 2), (0, 1)), ((0, 2), (1, 2))]  # no one global order
    traces = [[(0, POST, m, 1) for m in mine] + [(0, WAIT, m, 1) for m in mine] for mine in posts]
    with pytest.raises(AssertionError, match="circle"):
        critical_path(traces)


def _plan(model: str, dp: int, mode: str = "duplicated", **kwargs):
    cfg = projection.MODELS[model]
    params = projection.model_params(*cfg)
    ns = projection.cost_model(cfg[-1], mode)
    return projection.build_plan(
        params, projection.byte_level(params, dp, projection.ddp_bucket_size(dp)), dp, ns, **kwargs
    )


@pytest.fixture(scope="module")
def plan_1b_dp256():
    return _plan("1B", 256)


def test_gang_pieces_cover_every_element_once(plan_1b_dp256):
    """Per matrix, the units' blocks tile it and the pieces sent to each unit tile its block:
    nothing lost, nothing twice (both orders of the exchange come from these pieces)."""
    plan = plan_1b_dp256
    assert any(len(m.units) > 2 for m in plan.matrices), "1B at DP 256 splits matrices"
    for ex in plan.exchanges:
        for i in ex.matrices:
            slot = plan.matrices[i]
            assert sum(u.block.shape[0] * u.block.shape[1] for u in slot.units) == (
                slot.end - slot.start
            )
            for unit in slot.units:
                got = sorted(
                    (p.lo, p.hi) for p in ex.pieces if p.matrix == i and p.owner == unit.owner
                )
                size = unit.block.shape[0] * unit.block.shape[1]
                assert got[0][0] == 0 and got[-1][1] == size
                assert all(a[1] == b[0] for a, b in zip(got, got[1:]))


def test_gangs_shorten_the_critical_path_and_the_plan_is_deterministic(plan_1b_dp256):
    """Past DP ~ matrices, gangs cut the busiest rank's NS work (1B at DP 256: 0.12 -> ~0.67
    efficiency, duplicated TP mode); building the plan again gives the same plan."""
    plan = plan_1b_dp256
    unsplit = plan.rebuilt(model=None)
    assert plan_figures.critical_path_flops(plan) < plan_figures.critical_path_flops(unsplit) / 4
    assert plan_figures.efficiency(unsplit) < 0.2 < 0.6 < plan_figures.efficiency(plan) <= 1.0
    again = _plan("1B", 256)
    assert [p.key + (p.lo, p.hi) for p in again.exchanges[0].pieces] == [
        p.key + (p.lo, p.hi) for p in plan.exchanges[0].pieces
    ]
    assert (
        plan_figures.sync_points(plan)
        > plan_figures.sync_points(plan.rebuilt(model=None))
        == len(plan.exchanges)
    )
    split = sum(len(m.units) > 1 for m in plan.matrices)
    line = f"64 matrices, 256 DP ranks, 1 exchange(s), {split} split over gangs of "
    text = plan_figures.summary(plan)
    assert line in text and f"efficiency {plan_figures.efficiency(plan):.3f}," in text


@pytest.fixture(scope="module")
def flops_only_1b_dp256(plan_1b_dp256):
    """The plan a planner blind to the link chooses: what ``--muon-plan-dp-link-gbps inf
    --muon-plan-nvlink-gbps inf`` asks for (links that cost 0 FLOPs per byte)."""
    links = cost_model.PlanLinks(dp_link_gbps=math.inf, nvlink_gbps=math.inf).link_costs()
    assert links == dict(link_flops_per_byte=0.0, tp_link_flops_per_byte=0.0)
    return plan_1b_dp256.rebuilt(model=dataclasses.replace(plan_1b_dp256.model, **links))


def test_flops_only_plan_balances_with_disjoint_split_gangs(flops_only_1b_dp256):
    """By FLOPs alone, disjoint gangs (``bundle_units``) whose members split the polynomial
    (``NSCostModel.splits``) keep the busiest rank within 10% of total / dp; no rank is in two
    gangs."""
    plan = flops_only_1b_dp256
    assert plan_figures.efficiency(plan) >= 0.9
    sets = {u.members for m in plan.matrices for u in m.units if u.gang}
    ranks = [r for s in sets for r in s]
    assert sets and len(ranks) == len(set(ranks))
    assert any(u.splits for m in plan.matrices for u in m.units)


# The planner's default machine (396 TFLOP/s achieved, 50 GB/s between nodes, NVLink 450 GB/s)
RATE, LINK, TP_LINK = 0.4 * 990e12, 50e9, 450e9


def _seconds(plan) -> float:
    """NS, gang collectives and exchange of ``plan``, as the projection times them."""
    ns = projection.ns_seconds(plan, RATE, LINK, TP_LINK)
    return ns + projection.exchange_seconds(plan, 4, 4, LINK)


def test_the_chosen_plan_is_the_fastest_at_the_planning_link(plan_1b_dp256, flops_only_1b_dp256):
    """At the link the planner assumes (``LINK_FLOPS_PER_BYTE``: 396 TFLOP/s, 50 GB/s), the
    plan it chose takes no longer (NS, gang collectives and exchange, as the projection times
    them) than the FLOPs-only plan, which in turn has the shorter FLOP critical path."""
    assert cost_model.LINK_FLOPS_PER_BYTE == RATE / LINK
    assert cost_model.TP_LINK_FLOPS_PER_BYTE == RATE / TP_LINK

    chosen, flops_only = plan_1b_dp256, flops_only_1b_dp256
    assert _seconds(chosen) <= _seconds(flops_only) * (1 + placement.TIME_SLACK)
    assert plan_figures.critical_path_flops(flops_only) <= plan_figures.critical_path_flops(chosen)


def test_an_efficiency_floor_picks_the_fastest_plan_that_reaches_it(
    plan_1b_dp256, flops_only_1b_dp256
):
    """``--muon-plan-min-efficiency 0.9``: where the fastest plan is less balanced (1B at DP
    256, nodes unknown: ~0.67), the planner takes the fastest candidate at >= 0.9 counted FLOP
    efficiency; it is slower than the fastest and no slower than the FLOPs-only plan. A floor
    no candidate reaches (1.5 here; above 1.0 a plan's split blocks run fewer FLOPs than whole
    ones, ``figures.efficiency``, as this one's best at 1.08) still gets the best balanced one."""

    def floored(floor):
        model = dataclasses.replace(plan_1b_dp256.model, min_efficiency=floor)
        return plan_1b_dp256.rebuilt(model=model)

    fastest, flops_only, floor = plan_1b_dp256, flops_only_1b_dp256, floored(0.9)
    assert plan_figures.efficiency(fastest) < 0.9 <= plan_figures.efficiency(floor)
    assert _seconds(fastest) < _seconds(floor) <= _seconds(flops_only) * (1 + placement.TIME_SLACK)
    best = floored(1.5)
    critical = plan_figures.critical_path_flops
    assert plan_figures.efficiency(best) < 1.5 and critical(best) <= critical(floor)
    below = "(below the floor 1.5, which no plan reaches: the best balanced)"
    assert below in plan_figures.summary(best)
    assert "below the floor" not in plan_figures.summary(floor)


def test_a_gang_splits_its_polynomial_where_it_saves_time():
    """Tall fc1 of 8B (28672 x 4096) over 8 members: splitting saves FLOPs, so with a free link
    it splits; with a slow link the gather of the 4096^2 polynomial costs more than it saves."""
    cfg = projection.MODELS["8B"]
    info = next(i for n, _, i in projection.model_params(*cfg) if n.endswith("fc1.weight"))
    model = projection.cost_model(1, "duplicated")
    free = dataclasses.replace(model, link_flops_per_byte=0.0)
    slow = dataclasses.replace(model, link_flops_per_byte=1e6)
    assert free.splits(info, 0, info.shape[0], 8) and not slow.splits(info, 0, info.shape[0], 8)
    assert free.busiest(info, 0, info.shape[0], 8) < slow.busiest(info, 0, info.shape[0], 8)


def test_stacked_gangs_stay_on_one_node():
    """1B at DP 64, 8 ranks per node, fc1 and fc2 split at 0.9 x total / dp
    (``placement._assign``; at 1.1 fc2 stays whole, since one member's sharded steps, Gram in
    blocks, do 5/6 of its whole FLOPs): every gang that fits a node is placed on one (its sums
    on the fast link); blind to the nodes (the negative control) the least-loaded ranks
    straddle them.
    With it the plan chosen balances fc2 too (efficiency >= 0.9; 0.897 with fc2 whole)."""
    nodes = tuple(r // 8 for r in range(64))
    cfg = projection.MODELS["1B"]
    params = projection.model_params(*cfg)
    model = projection.cost_model(1, "duplicated", nodes=nodes)
    plan = projection.build_plan(
        params, projection.byte_level(params, 64, projection.ddp_bucket_size(64)), 64, model
    )
    works = [plan._work(plan.matrices[i]) for i in plan.exchanges[0].matrices]
    target = 0.9 * sum(w.cost for w in works) / 64

    def crossing(shape_model):
        units, gangs = placement._assign(works, 64, shape_model, target)
        assert len(gangs) == 32  # 16 fc1, 16 fc2
        return [i for i in gangs if len({nodes[u.owner] for u in units[i]}) > 1]

    assert crossing(model) == []
    assert crossing(dataclasses.replace(model, nodes=())) != []
    assert plan_figures.efficiency(plan) >= 0.9


def test_spare_ranks_balance_flops_within_the_time_bound(monkeypatch):
    """1B at DP 1024, 8 ranks per node, disjoint gangs shaped at the link cost
    (``bundle_units``): fc1's gang collectives set the time bound, under which the runs need
    fewer ranks than there are. The spare ranks go, a gang size at a time (``sizes``: one node
    or whole nodes), to the run executing the most FLOPs where its load stays within the bound
    (``_Runs._spread``): every rank works, the FLOP critical path shortens (efficiency 0.598)
    and the modeled time does not grow; the plan chosen is this one. Negative control: spare
    ranks left idle (0.336)."""
    dp = 1024
    model = projection.cost_model(1, "duplicated", nodes=tuple(r // 8 for r in range(dp)))
    params = projection.model_params(*projection.MODELS["1B"])
    plan = projection.build_plan(
        params, projection.byte_level(params, dp, projection.ddp_bucket_size(dp)), dp, model
    )
    works = [plan._work(plan.matrices[i]) for i in plan.exchanges[0].matrices]
    ideal = sum(w.cost for w in works) / dp

    def shaped():
        units, gangs = placement.bundle_units(works, dp, model, 1)
        owners = {u.owner for matrix_units in units for u in matrix_units}
        time = placement.span(works, units, gangs, dp, model)
        return time, ideal / placement.span(works, units, gangs, dp, model, False), owners

    time, efficiency, owners = shaped()
    monkeypatch.setattr(placement._Runs, "_growth", lambda self, runs, n, bound: None)
    idle_time, idle_efficiency, idle_owners = shaped()
    assert owners == set(range(dp)) and len(idle_owners) < dp
    assert efficiency >= 0.55 > 0.4 > idle_efficiency
    assert time <= idle_time
    assert (
        plan_figures.efficiency(plan) >= 0.55
    )  # the plan chosen (one exchange: these are its matrices)


@pytest.mark.parametrize("mode", ["blockwise", "distributed", "duplicated", "owner"])
def test_summary_says_when_the_tp_mode_keeps_matrices_whole(mode):
    """At TP 8 a TP-sharded matrix splits over DP in the ``duplicated`` TP mode, and in the
    ``distributed`` one where TP shards its long side (fc1, fc2, proj; not QKV); in the others
    ``--muon-plan-*`` only weigh the exchange. The start-up line says which stay whole rather
    than leaving the user to wonder why the flags changed nothing. At DP 256 (512 for
    ``distributed``, whose whole matrices still fit at 256)."""
    cfg = projection.MODELS["70B"]
    params = projection.model_params(*cfg)
    ns = projection.cost_model(cfg[-1], mode)
    dp = 512 if mode == "distributed" else 256
    plan = projection.build_plan(
        params, projection.byte_level(params, dp, projection.ddp_bucket_size(dp)), dp, ns
    )
    note = f"TP-sharded cannot split in the {mode} TP mode"
    assert (note in plan_figures.summary(plan)) == (mode != "duplicated")
    qkv = [m for m in plan.matrices if m.info.qkv_split is not None]
    if mode in ("blockwise", "owner"):
        assert all(len(m.units) == 1 for m in plan.matrices)
        assert f"({len(plan.matrices)} TP-sharded" in plan_figures.summary(plan)
    if mode == "distributed":  # fc1 splits here (planner/cost_model.py, ``axis``)
        assert any(len(m.units) > 1 for m in plan.matrices)
        assert all(len(m.units) == 1 for m in qkv)
        assert f"({len(qkv)} TP-sharded" in plan_figures.summary(plan)


@pytest.mark.parametrize("mode", ["duplicated", "distributed"])
def test_tp_gathers_inside_gang_collectives_are_what_the_cost_model_times(mode):
    """70B at TP 8 x DP 256 (TP-sharded matrices split over gangs): the TP collectives
    ``figures.tp_schedule`` counts around each sliced gang collective (the all-gather after it;
    ``distributed``, a partial sum's all-to-all before it too) take, per TP rank, the
    main-thread time ``NSCostModel.busy_flops`` charges those collectives (their bytes each way
    at the TP link, plus a ring step's latency each). ``duplicated``: before them each
    gang block is TP-gathered once (update dtype, fp32), which the projection adds
    (``projection.with_tp``); ``distributed`` (at DP 512, where it splits): no block is
    gathered."""
    plan = _plan("70B", 512 if mode == "distributed" else 256, mode)
    model = plan.model
    checked = 0
    for rank in range(0, plan.world, 37):
        for ex in plan.exchanges:
            gathered, sliced, _ = plan_figures.tp_schedule(plan, ex, rank)
            posts = [n for _, op, _, n in plan_figures._schedule(plan, ex)[rank] if op == POST]
            charged = sum(sum(model.busy_flops(n)) for n in posts)
            counted = sum(c.link_bytes() for c in sliced) * model.tp_link_flops_per_byte
            counted += len(sliced) * model.step_latency_flops
            assert counted == pytest.approx(charged, rel=1e-12)
            blocks = [plan.matrices[i].unit_of(rank) for i in ex.gangs]
            blocks = [math.prod(u.block.shape) for u in blocks if u is not None]
            if mode == "distributed":
                blocks = []
                ops = {c.op for c in sliced}
                # (the squared norm's 1 element is all-reduced over TP, not sliced)
                assert not sliced or ops == {
                    "all_reduce",
                    "all_to_all_single",
                    "all_gather_into_tensor",
                }
            assert [(c.op, c.elements, c.dtype) for c in gathered] == [
                ("all_gather", n, "float32") for n in blocks
            ]
            checked += len(sliced)
    assert checked > 0


def test_distributed_gang_members_iterate_on_their_tp_part():
    """``distributed`` mode, 70B fc1 (57344 x 8192, TP 8 on rows) in a gang of 4: each member's
    TP rank iterates on its own 7168 / 4 rows, sums its Gram partials over TP and the gang
    (``Partial``), and computes its piece of the split polynomial, cut over all 32 places
    (``places``, ``polynomial_rows``); its FLOPs are those of a 1792-row block: its Gram in
    blocks (``upper_gram``), its piece, its update."""
    cfg = projection.MODELS["70B"]
    fc1 = next(i for _, _, i in projection.model_params(*cfg) if i is not None and i.shape[0] > 5e4)
    model = projection.cost_model(cfg[-1], "distributed")
    assert model.axis(fc1) == 0 and model.partial(fc1)
    assert model.lines(fc1, 7168 // 4, 0) == 1792  # not TP-gathered
    place, places, split = model.places(fc1, (1, 4, True))  # TP rank t's place: t * 4 + 1
    assert place % 4 == 1 and (places, split) == (32, True)
    events = member_events(model, fc1, 0, 1792, (1, 4, True))
    sums = [e for e in events if isinstance(e, Sum) and not isinstance(e, Gather)]
    assert sums and all(isinstance(e, Partial) and e.tp == 8 for e in sums)
    g = 8192
    assert sum(isinstance(e, Gather) for e in events) == model.steps
    flops = sum(e for e in events if isinstance(e, float))
    gram = upper_gram_flops(g, 1792)  # 16 blocks of 512 rows: 17/32 of 2 g^2 1792
    assert 32 * gram == 17 * 2 * g * g * 1792
    start, end = polynomial_ranges(g, 32)[place]  # its piece: rows from their diagonal on
    assert flops == model.steps * (gram + 2.0 * g * g * 1792 + 2.0 * g * (end - start))


def _projected_plan(dp: int, model):
    """70B at DP ``dp`` planned as bench/projection.py plans it, with ``model``."""
    cfg = projection.MODELS["70B"]
    params = projection.model_params(*cfg)
    _, buckets, _ = projection.ours_layout(params, dp, projection.ddp_bucket_size(dp))
    return projection.build_plan(params, buckets, dp, model)


def test_the_planner_times_whole_matrices_with_their_tp_collectives():
    """70B TP 8 x DP 384, ``distributed``: the planner times each candidate with its owners'
    whole TP-sharded matrices run as tp.py's stream runs them (``with_streams``), so a lone
    matrix's Gram sums count. The plan it chooses has a shorter projected NS time (with TP
    collectives, ``projection.ns_seconds``) than the one chosen with whole matrices as bare
    FLOPs (``stream`` None, the negative control, which leaves a lone matrix's TP sums
    exposed): 12.2 ms against 12.6 ms (13.5 against 14.6 before the stream computed and summed
    its Grams in chunks, ``staged_gram``, which hides most of those sums; 13.9 against 16.3
    before it summed them in bf16, half the TP bytes: ``tp.sums_in``). Pure arithmetic: the
    margin is the plans', not noise."""
    a = projection.parse_args(["--tp-mode", "distributed", "--dps", "384"])
    rate, link = a.peak_tflops * 1e12 * a.mfu, a.link_gbps / 8 * 1e9
    links = projection.PlanLinks(rate / 1e12, a.link_gbps, a.tp_link_gbps).link_costs()
    nodes = tuple(range(384))  # 8-GPU nodes hold one TP 8 group each
    exchange = sum(projection.wire_bytes(a))
    model = projection.cost_model(
        8, "distributed", **links, ns_itemsize=a.ns_bytes, exchange_itemsizes=exchange, nodes=nodes
    )
    assert model.stream is not None
    blind = dataclasses.replace(model, stream=None)
    seconds = [
        projection.ns_seconds(_projected_plan(384, m), rate, link, a.tp_link_gbps / 8 * 1e9)
        for m in (model, blind)
    ]
    assert seconds[0] < 0.98 * seconds[1]


def test_streamed_traces_keep_each_ranks_flops():
    """``with_streams`` moves an owner's whole TP-sharded matrices out of its last entry into
    their stream (posts and waits on the owner's own link): every rank's FLOPs stay the same;
    with a free TP link the critical path is the FLOP one, with NVLink priced it is longer."""
    plan = _plan("70B", 64, "distributed")
    ex = plan.exchanges[0]
    infos = [plan.matrices[i].info for i in ex.matrices]
    units = [plan.matrices[i].units for i in ex.matrices]
    traces = cost_model.exchange_schedule(infos, units, [], plan.world, plan.model)
    streamed = cost_model.with_streams(traces, infos, units, plan.model)
    flops = [sum(e[0] for e in t) for t in traces]
    assert [sum(e[0] for e in t) for t in streamed] == pytest.approx(flops, rel=1e-12)
    assert any(len(s) > len(t) for s, t in zip(streamed, traces))
    free = plan.model.free_links()
    priced = cost_model.critical_path(streamed, sync=plan.model.sync_flops)
    bare = cost_model.critical_path(streamed, sync=free.sync_flops)
    assert bare == pytest.approx(max(flops), rel=1e-12) and priced > bare
