"""A matrix's Newton-Schulz split over a gang of DP ranks is still exact Muon, and its counted
figures are what the step runs.

Past DP ~ the number of matrices the plan cuts large matrices into row or column blocks, one per
gang member, the Gram matrices summed over the gang inside every iteration
(``planner/cost_model.py``).
The tiny GPT has too few FLOPs per matrix for DP=4 to need that, so the tests plan with low
split targets (``plan.rebuilt(targets=...)``): every matrix above 0.15 x total/dp splits, which
gives gangs of 2 and 4 ranks, row blocks (fc1, proj) and column blocks (QKV, fc2), gangs that
share ranks, members that run the reassociated step and members that run the polynomial. A
resume with gangs is bit-exact (the exchange holds no state). Reproduce by hand:

    .venv/bin/python -m pytest tests/distributed/test_muon_gangs.py -q
"""

import copy
import dataclasses
import functools
import hashlib
import math

import pytest
import torch
from checkpoint_io import load, save
from harness import run_distributed
from parity import assert_close_runs, first_difference, misses, update_rel_error
from test_muon_checkpoint import build, steps
from test_muon_distopt import (
    BUCKET,
    CONTROL_STEPS,
    LOSS_RTOL,
    MUON,
    STEPS,
    TOL,
    MatmulFlops,
    count_optimizer_step,
    distopts,
    record_peaks,
    reference,
    run_layout,
)
from tiny_gpt import (
    TinyGPT,
    build_model,
    build_optimizer,
    global_batches,
    train,
    train_step,
)

from megatron.core import parallel_state
from megatron.core.optimizer.megatron_muon import newton_schulz
from megatron.core.optimizer.megatron_muon.planner import cost_model, gangs
from megatron.core.optimizer.megatron_muon.planner import figures as plan_figures
from megatron.core.optimizer.megatron_muon.planner.cost_model import ALL, POST, WAIT, critical_path
from megatron.core.optimizer.megatron_muon.planner.figures import working_set_bytes
from megatron.core.optimizer.megatron_muon.planner.plan import tp_ns_cost
from megatron.core.optimizer.megatron_muon.tp import all_gather_ranges, reduce_scatter_ranges

# x total/dp: every matrix splits: fc1 (row blocks) over 4 ranks, proj (row blocks), QKV and fc2
# (column blocks) over 2. Both forms of a member's step run: blocks narrower than their Gram
# reassociated (fc1, proj, fc2, the Q block), the K and V blocks (32 lines, 32 x 32 Gram) with
# the polynomial (``newton_schulz.reassociates``).
TARGETS = (0.1,)


def _gang_sizes(plan) -> set[int]:
    return {len(m.units) for m in plan.matrices if len(m.units) > 1}


def _flops_only(plan):
    """The plan's cost model with free links: the planner chooses by FLOPs alone."""
    return dataclasses.replace(plan.model, link_flops_per_byte=0.0, tp_link_flops_per_byte=0.0)


def _split(
    optimizer,
    broken_sum=False,
    broken_gather=False,
    broken_tp=False,
    broken_partial=False,
    fp32_tp=False,
    nodes=(),
    all_spread=False,
    **kw,
):
    """Hook: plan with low targets (gangs of 2 to 4 at DP=4), by FLOPs alone (so gangs split
    their polynomials wherever that saves FLOPs); ``broken_sum`` / ``broken_gather``: negative
    controls, members skip the Gram sums (each iterates on its block's own Gram) or the gather
    of the split polynomial (the other members' rows stay zero), or (``broken_tp``) TP ranks
    sharing a block never all-gather the slices they summed over DP (the collectives still run,
    on copies, so peers stay paired), or (``broken_partial``, ``distributed``) never add their
    partial sums over TP before the gang sum (no rank runs it). ``fp32_tp``: a Gram sum's TP
    collectives (``distributed``: the partials' exchange; the summed slices' all-gather) move
    fp32, not the NS dtype. ``nodes``: pretend the DP ranks sit on
    these nodes (the plan's model says where). ``all_spread``: every gang sums as a lone gang
    does (``cost_model.spreads``), in the runner and in the plan's model alike."""
    if all_spread:
        for module in (gangs, cost_model, plan_figures):
            module.lone_gangs = lambda units, split: set(split)
    for distopt in distopts(optimizer):
        ortho = distopt.optimizer.orthogonalizer
        model = _flops_only(ortho.plan)
        model = dataclasses.replace(model, nodes=nodes) if nodes else model
        plan = ortho.plan.rebuilt(model=model, targets=TARGETS, bundles=())
        ortho.plan = distopt.muon_plan = plan
        ortho.gangs.make_groups(plan)
        sizes = _gang_sizes(plan)
        assert {2, plan.world} <= sizes, sizes  # same plan on every rank: all or none
        assert any(u.splits for m in plan.matrices for u in m.units), "no split polynomial"
        if broken_sum:
            ortho.gangs._gang_sum = functools.partial(_norm_sum_only, ortho.gangs._gang_sum)
        if broken_gather:
            gather = ortho.gangs._gang_gather
            ortho.gangs._gang_gather = functools.partial(_own_rows_only, gather, plan.rank)
        if broken_tp:
            gangs.all_gather_ranges = lambda flat, bounds, p, group, dtype=None: None
        if broken_partial:
            gangs.reduce_scatter_ranges = lambda flat, bounds, p, group, dtype=None: None
        if fp32_tp:
            gangs.all_gather_ranges = _in_flat_dtype(all_gather_ranges)
            gangs.reduce_scatter_ranges = _in_flat_dtype(reduce_scatter_ranges)
    assert not kw, kw


def _in_flat_dtype(ranges_op):
    """``ranges_op`` (``tp.all_gather_ranges``, ``tp.reduce_scatter_ranges``) moving ``flat``'s
    dtype, whatever ``dtype`` asks."""

    def op(flat, bounds, p, group, dtype=None):
        ranges_op(flat, bounds, p, group)

    return op


def _norm_sum_only(gang_sum, group, members, tp, ns_dtype, spread, t):
    """The squared norm summed; the Gram matrices stay partial (summed on a copy)."""
    return gang_sum(group, members, tp, ns_dtype, spread, t if t.numel() == 1 else t.clone())


def _own_rows_only(gather, rank, group, members, tp, pieces):
    """No gather (it runs on a copy): the pieces the other members computed are zeros."""
    lo, hi = pieces.ranges[members.index(rank)]
    own = pieces.flat[lo:hi].clone()
    pieces.flat.zero_()
    pieces.flat[lo:hi] = own
    return gather(group, members, tp, pieces._replace(flat=pieces.flat.clone()))


def test_gangs_at_dp4_match_one_process():
    """Tolerance as the DistOpt parity tests (1e-4 on the fp32 update): a gang sums fp32 Gram
    partials, which only reorders fp32 sums (~1e-6)."""
    got = run_layout("fp32", 4, hook=_split)
    assert_close_runs(reference("fp32"), got, tol=TOL["fp32"], loss_rtol=LOSS_RTOL["fp32"])


def test_gangs_over_tp_duplicated_match_one_process():
    """TP=2 x DP=2 (``duplicated``): gang blocks are TP-gathered before the iteration; the two
    TP ranks of a member each sum (gather) half of every Gram (polynomial) over DP and
    all-gather the halves over TP (planner/gangs.py, ``_gang_sum``). Negative control: without that
    all-gather the result misses."""
    got = run_layout("fp32", 4, tp=2, hook=_split)
    assert_close_runs(reference("fp32"), got, tol=TOL["fp32"], loss_rtol=LOSS_RTOL["fp32"])
    initial, ref, _ = reference("fp32", steps=CONTROL_STEPS)
    broken_tp = functools.partial(_split, broken_tp=True)
    broken = run_layout("fp32", 4, tp=2, hook=broken_tp, steps=CONTROL_STEPS)
    assert misses(update_rel_error(initial, ref, broken[0][1]), 100 * TOL["fp32"])


def test_gangs_over_tp_distributed_match_one_process():
    """TP=2 x DP=2 (``distributed``): each matrix's NS runs once over the 4 GPUs of its gang, a
    block per TP rank of each member: every Gram is reduce-scattered over TP, each half summed
    over the gang, all-gathered over TP; a split polynomial's rows are cut over all 4 and
    gathered over the gang, then over TP (planner/gangs.py). The sums reorder fp32 adds only,
    so the DistOpt tolerance holds. Negative control: without the TP reduce-scatter (each TP
    rank's half holds its own partials) the result misses."""
    got = run_layout("fp32", 4, tp=2, hook=_split, muon_tp_mode="distributed")
    assert_close_runs(reference("fp32"), got, tol=TOL["fp32"], loss_rtol=LOSS_RTOL["fp32"])
    initial, ref, _ = reference("fp32", steps=CONTROL_STEPS)
    broken_partial = functools.partial(_split, broken_partial=True)
    broken = run_layout(
        "fp32", 4, tp=2, hook=broken_partial, steps=CONTROL_STEPS, muon_tp_mode="distributed"
    )
    assert misses(update_rel_error(initial, ref, broken[0][1]), 100 * TOL["fp32"])


def test_tp_collectives_of_gram_sums_in_the_ns_dtype_change_no_bit():
    """TP=2 x DP=2 (``distributed``), bf16 Newton-Schulz: a gang's Gram sum moves bf16 over TP,
    half the bytes of fp32, both ways: the TP ranks' partial Grams are exchanged in bf16 (they
    are bf16 matmul results, exact in it) and summed in fp32, and each rank's
    summed slice comes back in bf16 (its consumer, ``unpack_symmetric``, rounds the Gram to
    bf16). So every rank's params end bit-identical to moving both in fp32
    (test_muon_tp_collectives.py checks that the bf16 collectives run). Negative control, run
    by hand: fp16 in place of bf16 breaks the identity."""
    bf16_ns = dict(muon_tp_mode="distributed", muon_fp32_matmul_prec="medium")
    got = run_layout("fp32", 4, tp=2, hook=_split, steps=CONTROL_STEPS, **bf16_ns)
    wide = functools.partial(_split, fp32_tp=True)
    fp32 = run_layout("fp32", 4, tp=2, hook=wide, steps=CONTROL_STEPS, **bf16_ns)
    assert first_difference(got, fp32) is None


# Sizes no cut divides: hidden 66 (heads of 16, as rope needs an even head dim) gives fc1 and
# fc2 Gram sides of 66 (4 places: 16 / 17 / 16 / 17 polynomial rows; TP 2's row slices 33 / 33)
# and packed Grams of 2211 elements (TP slices 1105 / 1106).
UNEVEN = TinyGPT(hidden_size=66, ffn_hidden_size=90, extra=dict(kv_channels=16))


def test_gangs_over_tp_distributed_with_uneven_cuts_match_one_process():
    """As above, at sizes where every cut (TP slices of the sums, polynomial rows over TP x gang,
    TP row slices) is uneven; tolerance as above."""
    kwargs = dict(MUON, distopt=True, bucket_size=BUCKET, overlap=True, muon_tp_mode="distributed")
    got = run_distributed(
        train, 4, tp=2, args=(UNEVEN, STEPS), kwargs=dict(kwargs, optimizer_hook=_split)
    )
    ref = run_distributed(train, 1, args=(UNEVEN, STEPS), kwargs=MUON)[0]
    assert_close_runs(ref, got, tol=TOL["fp32"], loss_rtol=LOSS_RTOL["fp32"])


@pytest.mark.parametrize("broken", ["broken_sum", "broken_gather"])
def test_negative_control_gangs_without_a_collective_miss_the_reference(broken):
    initial, ref, _ = reference("fp32", steps=CONTROL_STEPS)
    hook = functools.partial(_split, **{broken: True})
    got = run_layout("fp32", 4, hook=hook, steps=CONTROL_STEPS)
    # blocks that disagree diverge (NaN counts as a miss)
    assert misses(update_rel_error(initial, ref, got[0][1]), 100 * TOL["fp32"])


# ------------------------------------------------------------------------- counted figures


def _own_tp_trace(plan) -> list:
    """The plan's trace of this rank with this TP rank's polynomial pieces (``partial`` gangs
    and the ``distributed`` stream compute one each; ``NSCostModel.tp_rank``)."""
    model, t = plan.model, parallel_state.get_tensor_model_parallel_rank()

    def whole(info) -> float:  # the ``distributed`` stream's matrices: this TP rank's pieces
        if model.mode != "distributed" or model.tp_of(info) == 1:
            return model.whole(info)
        return tp_ns_cost(info, model.steps, model.mode, model.tp_of(info), tp_rank=t)

    own = copy.copy(plan)
    own.model = dataclasses.replace(model, tp_rank=t, whole=whole)
    own.matrices = [copy.copy(m) for m in plan.matrices]
    for m in own.matrices:
        if len(m.units) == 1:
            m.units = [dataclasses.replace(m.units[0], cost=whole(m.info))]
    return plan_figures.trace(own, plan.rank)


def _counted_split_step(
    nodes=(), disjoint=False, tp_mode=None, precision=None, all_spread=False, gram_rows=None
):
    """One real DP=4 step with gangs (stacked, or ``disjoint`` on the wide one-layer model):
    matmul FLOPs between collectives, the collectives' members and sizes, bytes and the peak of
    the exchange's allocations, next to the plan's. ``gram_rows``: ``GRAM_BLOCK_ROWS`` (the
    model's 64 x 64 Grams in several chunks: a lone gang's staged)."""
    spec = TinyGPT(**WIDE) if disjoint else TinyGPT()
    model = build_model(spec, distopt=True, bucket_size=BUCKET, overlap_grad_reduce=True)
    muon = dict(MUON, muon_tp_mode=tp_mode) if tp_mode else MUON
    muon = dict(muon, muon_fp32_matmul_prec=precision) if precision else muon
    optimizer = build_optimizer(spec, model, use_distributed_optimizer=True, **muon)
    if disjoint:
        _bundle(optimizer, gram_rows=gram_rows)
    else:
        assert gram_rows is None, "stacked gangs share ranks: none is lone"
        _split(optimizer, nodes=nodes, all_spread=all_spread)
    (distopt,) = distopts(optimizer)
    ortho, plan = distopt.optimizer.orthogonalizer, distopt.muon_plan
    counter, trace = MatmulFlops(), []
    everyone = tuple(range(plan.world))
    _mark(ortho, "_all_to_all", lambda *a, **k: (ALL, everyone, 0), counter, trace)
    _mark(ortho.gangs, "_post", lambda serve, t, m: (POST, m, t.numel()), counter, trace)
    _mark(ortho.gangs, "_wait", lambda p: (WAIT, p.members, p.tensor.numel()), counter, trace)
    sums = _record_results(ortho.gangs)
    peaks = record_peaks(ortho)
    count_optimizer_step(optimizer, counter)
    train_step(spec, model, optimizer, global_batches(spec, 1)[0])
    return {
        "trace": trace,
        "after": counter.flops,
        "plan_trace": _own_tp_trace(plan),
        "critical": plan_figures.critical_path_flops(plan),
        "sync_points": plan_figures.sync_points(plan),
        "sizes": _gang_sizes(plan),
        "forms": {u.splits for m in plan.matrices for u in m.units if u.gang},
        "layouts": {plan.model.layout(u.members) for m in plan.matrices for u in m.units[:1]},
        "bytes": (ortho.bytes_moved, plan_figures.bytes_per_step(plan, 4, 4)),
        "sum_bytes": (ortho.sum_bytes, plan_figures.sum_bytes_per_step(plan)),
        "sums": sums,
        "dp_rank": plan.rank,
        "peak": max(peaks),
        "bound": plan_figures.transient_bytes(
            plan, 4, 4, lambda m, u: working_set_bytes(m, 4, 4, 1, u)
        ),
    }


def _most_in_flight(trace: list) -> int:
    """The most gang collectives a rank's main thread had posted and not yet waited for."""
    most = now = 0
    for _, op, _, _ in trace:
        now += (op == POST) - (op == WAIT)
        most = max(most, now)
    return most


def _record_results(runner) -> dict:
    """Each gang collective's result on this rank after its wait, (size, digest of its bits) by
    the gang's members, in wait order (the same on every member: one global order)."""
    got: dict = {}
    wait = runner._wait

    def recorded(posted):
        then = wait(posted)
        if posted.then is not None:  # a sum's reduce-scatter: its all-gather ends the sum
            return then
        bits = posted.tensor.detach().reshape(-1).view(torch.uint8).numpy().tobytes()
        digest = hashlib.sha1(bits).hexdigest()
        got.setdefault(posted.members, []).append((posted.tensor.numel(), digest))
        return then

    runner._wait = recorded
    return got


def _same_sum(counted: float, planned: float) -> bool:
    """Gang bytes counted by the executor equal the plan's, > 0. The same fractional ring terms
    (``(k - 1) / k`` of a tensor) are added in another order (the units' posts
    interleave), so equal up to fp64 rounding of the sum: 1e-12 relative."""
    return planned > 0 and math.isclose(counted, planned, rel_tol=1e-12)


def _mark(ortho, name, describe, counter, trace):
    """Wrap a point where ``ortho``'s main thread meets communication: record (FLOPs since the
    previous one, op, members, size)."""
    call = getattr(ortho, name)

    def marked(*args, **kwargs):
        trace.append((counter.flops, *describe(*args, **kwargs)))
        counter.flops = 0.0
        return call(*args, **kwargs)

    setattr(ortho, name, marked)


@functools.cache
def counted_split_runs(
    tp: int = 1, nodes: tuple = (), disjoint: bool = False, tp_mode=None, precision=None, **kw
):
    args = (
        nodes,
        disjoint,
        tp_mode,
        precision,
        kw.pop("all_spread", False),
        kw.pop("gram_rows", None),
    )
    assert not kw, kw
    return run_distributed(_counted_split_step, 4, tp=tp, args=args)


# DP ranks 0, 1 on one pretended node and 2, 3 on another: the plan weighs the gang of 4's
# collectives as hierarchical rings (2 per node); torch's collective picks its own algorithm.
NODES = (0, 0, 1, 1)


def test_gangs_over_nodes_match_one_process_and_the_plans_bytes():
    """A plan made for two nodes gives the one-process result (tolerance as above: fp32 sums
    reordered), and each rank's collectives, FLOPs and modeled bytes (both links) are the
    plan's."""
    got = run_layout("fp32", 4, hook=functools.partial(_split, nodes=NODES))
    assert_close_runs(reference("fp32"), got, tol=TOL["fp32"], loss_rtol=LOSS_RTOL["fp32"])
    for r in counted_split_runs(nodes=NODES):
        assert r["trace"] == r["plan_trace"] and r["after"] == 0.0
        assert _same_sum(*r["sum_bytes"])
        assert r["layouts"] >= {(2, 2)}, r["layouts"]  # the gang of 4: 2 ranks on each node


TP2 = {"tp": 2, "tp_mode": "distributed"}


# bf16 Newton-Schulz: the summed slices come back over TP in bf16 (tp.all_gather_ranges rounds
# every slice, the rank's own too)
TP2_BF16 = {**TP2, "precision": "medium"}

# bf16 Newton-Schulz on the disjoint plan: the gang of ranks 0, 1 runs fc1 alone (a lone gang),
# the gang of 2, 3 three matrices
DISJOINT_BF16 = {"disjoint": True, "precision": "medium"}

# TP 2 x DP 2 (``distributed``), bf16 NS, every gang sum as two collectives (forced: the stacked
# gangs share ranks): reduced over TP, reduce-scattered in fp32 over the gang of 2, all-gathered
# in bf16 over the gang, then over TP
TP2_SPREAD = {**TP2_BF16, "all_spread": True}


# The lone gang's 64 x 64 Grams in 16 blocks of 4 rows, computed and summed in 8 chunks of 2
# blocks (``newton_schulz.gram_chunks``), bf16 NS (each chunk two collectives) or fp32 (one)
STAGED_BF16 = {**DISJOINT_BF16, "gram_rows": 4}
STAGED_FP32 = {"disjoint": True, "gram_rows": 4}


@pytest.mark.parametrize(
    "case",
    [
        {},
        {"nodes": NODES},
        {"disjoint": True},
        TP2,
        TP2_BF16,
        DISJOINT_BF16,
        TP2_SPREAD,
        STAGED_BF16,
    ],
)
def test_every_member_of_a_gang_holds_the_same_bits(case):
    """The members' blocks are rows (columns) of one result, so each gang sum (squared norm,
    packed Gram) and gathered polynomial must be bit-identical on every member: torch's
    collectives give no fixed summation order of ours (docs/gangs.md, "Exactness"). Every
    rank's every gang result is compared with every other member's, in wait order; at TP 2
    (``distributed``) with every TP rank of every member (each ends with the whole sum), also
    with bf16 NS, where the TP ranks all-gather their summed slices in bf16."""
    runs = counted_split_runs(**case)
    tp = case.get("tp", 1)
    assert sum(len(v) for r in runs for v in r["sums"].values()) > 0
    for rank, r in enumerate(runs):
        for members, results in r["sums"].items():
            assert r["dp_rank"] in members
            holders = [q for q, run in enumerate(runs) if run["dp_rank"] in members]
            assert len(holders) == tp * len(members)
            for peer in holders:
                assert runs[peer]["sums"][members] == results, (rank, peer, members)


@pytest.mark.parametrize("tp_mode", ["duplicated", "distributed"])
def test_counted_step_with_tp_sliced_gangs_is_the_plans_schedule(tp_mode):
    """TP=2 x DP=2: each TP rank's matmul FLOPs between gang collectives and its DP-link bytes
    (its half of every Gram matrix and polynomial; the TP collectives run inside the gang
    collective) are the plan's, whose cost model counts ``1 / tp`` of each tensor; in the
    ``distributed`` mode each TP rank iterates on its own part of the block, so its FLOPs are
    about half the ``duplicated`` mode's."""
    runs = counted_split_runs(tp=2, tp_mode=tp_mode)
    for r in runs:
        assert r["trace"] == r["plan_trace"] and r["after"] == 0.0
        assert _same_sum(*r["sum_bytes"])
    if tp_mode == "distributed":
        flops = lambda rs: sum(f for r in rs for f, *_ in r["trace"])  # noqa: E731
        assert flops(runs) < 0.75 * flops(counted_split_runs(tp=2, tp_mode="duplicated"))


def test_counted_step_with_gangs_is_the_plans_schedule():
    """Per rank, the real step's matmul FLOPs between the points where its main thread posts a
    gang collective (async), waits for one, or runs an all-to-all, and who
    takes part in each collective with how many elements, are the plan's trace (gang units
    interleaved, ``cost_model.pipelined``); so the critical path run on the counted traces is
    the plan's, and the sync points are the collectives counted."""
    ranks = counted_split_runs()
    for r in ranks:
        assert r["trace"] == r["plan_trace"] and r["after"] == 0.0
    counted = [r["trace"] for r in ranks]
    assert critical_path(counted) == ranks[0]["critical"]
    exchanges = sum(1 for _, op, _, _ in counted[0] if op == ALL) // 2
    gang_sums = sum(
        1 for r, t in enumerate(counted) for _, op, m, _ in t if op == POST and m[0] == r
    )
    assert exchanges == 1 and gang_sums > 0
    assert ranks[0]["sync_points"] == exchanges + gang_sums
    assert max(_most_in_flight(t) for t in counted) >= 2  # a sum overlapped another unit's work
    assert {2, 4} <= ranks[0]["sizes"]
    assert ranks[0]["forms"] == {True, False}  # split polynomials and unsplit ones both ran


def test_gang_bytes_and_transient_memory_are_the_plans():
    """All-to-all bytes counted from the split sizes used equal the plan's; gang-sum bytes (ring
    model) likewise; the measured peak of the exchange's allocations stays within the plan's
    bound, which counts each gang block's working set (fp32 norm copy and Gram sums)."""
    for r in counted_split_runs():
        assert r["bytes"][0] == r["bytes"][1] > 0
        assert _same_sum(*r["sum_bytes"])
        assert 0 < r["peak"] <= r["bound"], r


# ------------------------------------------------------------------------- resume


def _resume_with_gangs(directory: str):
    """Train 2 steps with gangs, save (legacy ``torch`` format), train 1 more; a fresh model
    (other init) with gangs loads and trains the same 1: the exchange holds no state. One step
    after the load reads all the loaded state (momentum, AdamW moments and step, params) and
    runs every gang collective (a gang step costs ~1 s here: 130 collectives on 4 ranks)."""
    spec = TinyGPT()
    batches = global_batches(spec, 3)
    model, optimizer = build(spec, MUON)
    _split(optimizer)
    steps(spec, model, optimizer, batches[:2])
    save("torch", directory, model, optimizer)
    uninterrupted = steps(spec, model, optimizer, batches[2:])
    model, optimizer = build(spec, MUON, seed=1)
    _split(optimizer)
    load("torch", directory, model, optimizer)
    resumed = steps(spec, model, optimizer, batches[2:])
    return [k for k in uninterrupted if not torch.equal(uninterrupted[k], resumed[k])]


def test_resume_with_gangs_is_bit_exact(tmp_path):
    for differing in run_distributed(_resume_with_gangs, 4, args=(str(tmp_path),)):
        assert differing == []


# ------------------------------------------------------------------------- disjoint gangs

# One layer with a wide MLP: fc1 (768 x 64) alone is above total/dp at DP=4, so the bundle
# planner gives fc1 a gang and fc2, QKV and proj another, the two on disjoint ranks.
WIDE = dict(num_layers=1, ffn_hidden_size=384)


def _bundle(
    optimizer, one_all_reduce=False, broken_spread=False, gram_rows=None, broken_staged=False
):
    """Hook: disjoint gangs of up to 3 matrices (``placement.bundle_units``), by FLOPs.
    ``one_all_reduce``: no lone gang sums in two collectives (``cost_model.spreads``);
    ``broken_spread``: negative control, a two-collective sum's all-gather lands nowhere (each
    member keeps its own partials). ``gram_rows``: ``newton_schulz.GRAM_BLOCK_ROWS`` (small: the
    lone gang's 64 x 64 Grams computed and summed in chunks, ``staged_gram``);
    ``broken_staged``: negative control, a staged Gram's chunks after the first are summed on
    copies."""
    if one_all_reduce:
        gangs.lone_gangs = lambda units, split: set()
    if gram_rows is not None:
        newton_schulz.GRAM_BLOCK_ROWS = gram_rows
    for distopt in distopts(optimizer):
        ortho = distopt.optimizer.orthogonalizer
        plan = ortho.plan.rebuilt(model=_flops_only(ortho.plan), targets=(), bundles=(3,))
        ortho.plan = distopt.muon_plan = plan
        ortho.gangs.make_groups(plan)
        if broken_spread:
            ortho.gangs._reduce = functools.partial(_spread_dropped, ortho.gangs._reduce)
        if broken_staged:
            ortho.gangs._post = functools.partial(_later_chunks_unsummed, ortho.gangs._post)
        sets = [u.members for m in plan.matrices for u in m.units[:1] if u.gang]
        assert sorted(set(sets)) == [(0, 1), (2, 3)], sets  # disjoint member sets
        assert sorted(sets.count(g) for g in set(sets)) == [1, 3]  # fc1 | fc2, QKV, proj


def test_disjoint_gangs_match_one_process_and_run_the_plans_schedule():
    """Tolerance as the gang tests above: only fp32 sums are reordered. Each rank's matmul FLOPs
    between collectives, the collectives and their bytes are the plan's."""
    for r in counted_split_runs(disjoint=True):
        assert r["trace"] == r["plan_trace"] and r["after"] == 0.0
        assert _same_sum(*r["sum_bytes"])
    spec = TinyGPT(**WIDE)
    ref = run_distributed(train, 1, args=(spec, STEPS), kwargs=MUON)[0]
    kwargs = {**MUON, "distopt": True, "bucket_size": BUCKET, "overlap": True}
    got = run_distributed(
        train, 4, args=(spec, STEPS), kwargs={**kwargs, "optimizer_hook": _bundle}
    )
    assert_close_runs(ref, got, tol=TOL["fp32"], loss_rtol=LOSS_RTOL["fp32"])


def _spread_dropped(reduce, *args):
    """``GangRunner._reduce`` whose all-gather runs but is never copied into the sum."""
    posted = reduce(*args)

    def then(t):
        return dataclasses.replace(posted.then(t), fill=None)

    return dataclasses.replace(posted, then=then)


def _later_chunks_unsummed(post, serve, t, members):
    """``GangRunner._post`` that sums a staged Gram's chunks after the first (views into its
    packed vector past its start) on copies (peers stay paired): each member keeps its own
    partial rows of the Gram there."""
    later = isinstance(t, torch.Tensor) and t.storage_offset() > 0
    return post(serve, t.clone() if later else t, members)


def test_a_lone_gang_sums_in_two_collectives_as_the_plan_counts():
    """bf16 NS: the lone gang sums each packed Gram as an fp32 reduce-scatter, then an
    all-gather of the sums in bf16 (``cost_model.spreads``: 3/4 of an fp32 all-reduce's
    bytes); the other gang, whose members run three matrices, keeps one all-reduce per sum.
    Each rank's FLOPs between collectives, its collectives (both halves posted and waited
    for) and their ring bytes are the plan's."""
    runs = counted_split_runs(**DISJOINT_BF16)
    for r in runs:
        assert r["trace"] == r["plan_trace"] and r["after"] == 0.0
        assert _same_sum(*r["sum_bytes"])
    phases = lambda r: {getattr(n, "phase", None) for _, op, _, n in r["plan_trace"]}  # noqa: E731
    assert {cost_model.REDUCE, cost_model.SPREAD} <= phases(runs[0])
    assert cost_model.REDUCE not in phases(runs[2]) and cost_model.ALL_REDUCE in phases(runs[2])


def _bundled_bf16_runs(**hook) -> list:
    """Every rank's run of ``CONTROL_STEPS`` on the wide one-layer model at DP 4, bf16 NS, with
    the disjoint gangs of ``_bundle(**hook)``."""
    spec, bf16 = TinyGPT(**WIDE), {**MUON, "muon_fp32_matmul_prec": "medium"}
    kwargs = {**bf16, "distopt": True, "bucket_size": BUCKET, "overlap": True}
    kwargs["optimizer_hook"] = functools.partial(_bundle, **hook)
    return run_distributed(train, 4, args=(spec, CONTROL_STEPS), kwargs=kwargs)


def test_a_lone_gangs_two_collectives_change_no_bit():
    """bf16 NS: the lone gang's sums as two collectives leave every rank's params bit-identical
    to one fp32 all-reduce each: a gang of 2 adds its two fp32 partials alike in either order,
    and the Gram's consumer (``unpack_symmetric``) rounds the sum to bf16 either way.
    Negative control: with the all-gather dropped the params differ."""
    run = _bundled_bf16_runs
    got, one, broken = run(), run(one_all_reduce=True), run(broken_spread=True)
    assert first_difference(got, one) is None
    assert first_difference(broken, one) is not None


@pytest.mark.parametrize("case", [STAGED_BF16, STAGED_FP32])
def test_a_lone_gangs_staged_gram_sums_are_the_plans_schedule(case, monkeypatch):
    """The lone gang computes each Gram in chunks and posts each chunk's sum as soon as it is
    computed, then moves every earlier chunk's sum on by one collective (``EARLY`` requests in
    ``newton_schulz.interleave``): each rank's FLOPs between collectives (a chunk's matmuls before
    its post), its collectives in order and their ring bytes are the plan's
    (``cost_model.staged_trace``), and the lone gang's members have several sums in flight."""
    runs = counted_split_runs(**case)
    for r in runs:
        assert r["trace"] == r["plan_trace"] and r["after"] == 0.0
        assert _same_sum(*r["sum_bytes"])
    lone = [r for r in runs if r["dp_rank"] in (0, 1)]
    monkeypatch.setattr(newton_schulz, "GRAM_BLOCK_ROWS", case["gram_rows"])
    chunks = len(newton_schulz.gram_chunks(64))
    assert chunks == 8 and all(_most_in_flight(r["trace"]) >= 2 for r in lone)
    grams = [n for _, op, _, n in lone[0]["trace"] if op == POST and n > 1]
    assert len(grams) >= chunks


def test_a_lone_gangs_staged_gram_sums_change_no_bit():
    """bf16 NS: the staged Grams (the same block matmuls, packed in another order, each element
    summed by the same two members) leave every rank's params bit-identical to the unstaged
    sums. Negative control: with the chunks after the first summed on copies the params
    differ."""
    run = _bundled_bf16_runs
    got, unstaged = run(gram_rows=4), run()
    broken = run(gram_rows=4, broken_staged=True)
    assert first_difference(got, unstaged) is None
    assert first_difference(broken, unstaged) is not None


def test_sums_in_two_collectives_over_tp_change_no_bit_and_are_the_plans():
    """As a lone gang of 70B fc1 blocks sums in the ``distributed`` mode: every rank's params
    end bit-identical to one fp32 all-reduce per sum (a gang of 2 adds two fp32 partials alike
    in either order; the Gram's consumer rounds to bf16 either way), and each TP rank's FLOPs
    between collectives, its collectives and their ring bytes are the plan's."""
    for r in counted_split_runs(**TP2_SPREAD):
        assert r["trace"] == r["plan_trace"] and r["after"] == 0.0
        assert _same_sum(*r["sum_bytes"])
        assert cost_model.SPREAD in {getattr(n, "phase", None) for *_, n in r["plan_trace"]}
    bf16_ns = dict(muon_tp_mode="distributed", muon_fp32_matmul_prec="medium")
    spread = functools.partial(_split, all_spread=True)
    got = run_layout("fp32", 4, tp=2, hook=spread, steps=CONTROL_STEPS, **bf16_ns)
    one = run_layout("fp32", 4, tp=2, hook=_split, steps=CONTROL_STEPS, **bf16_ns)
    assert first_difference(got, one) is None


def _planning_model(**overrides):
    """The cost model the optimizer planned with, built from ``OptimizerConfig`` overrides."""
    spec = TinyGPT()
    model = build_model(spec, distopt=True, bucket_size=BUCKET)
    optimizer = build_optimizer(spec, model, use_distributed_optimizer=True, **MUON, **overrides)
    (distopt,) = distopts(optimizer)
    m = distopt.muon_plan.model
    return m.link_flops_per_byte, m.tp_link_flops_per_byte, m.nodes, m.min_efficiency


def _planning_models(settings: list) -> list:
    return [_planning_model(**overrides) for overrides in settings]


def test_plan_settings_reach_the_planner():
    """``--muon-plan-*`` (``OptimizerConfig.muon_plan_*``) set the machine the DP=4 plan is
    weighed on (and ``--muon-plan-min-efficiency`` its floor): free links (inf) cost 0 per
    byte, and an NVLink domain of 2 GPUs puts ranks
    0, 1 and 2, 3 in two domains; unset, the built-in H100-class figures and one domain per host
    (this machine: one)."""
    free = dict(
        muon_plan_dp_link_gbps=math.inf, muon_plan_nvlink_gbps=math.inf, muon_plan_nvlink_domain=2
    )
    slow = dict(muon_plan_tflops=100.0, muon_plan_dp_link_gbps=8.0, muon_plan_min_efficiency=0.9)
    # the three DP=4 settings in one fork: each builds its own model and optimizer
    for got in run_distributed(_planning_models, 4, args=([free, slow, {}],)):
        assert got[0] == (0.0, 0.0, (0, 0, 1, 1), 0.0)
        assert got[1][:2] == (100e12 / 1e9, 100e12 / 450e9) and got[1][2:] == ((0, 0, 0, 0), 0.9)
        default = cost_model.LINK_FLOPS_PER_BYTE, cost_model.TP_LINK_FLOPS_PER_BYTE
        assert got[2] == (*default, (0, 0, 0, 0), 0.0)
    # TP 2 x DP 2, domains of 3 GPUs: the DP group of TP rank 0 (global 0, 2) lies in one
    # domain, that of TP rank 1 (1, 3) in two; both TP ranks plan with TP rank 0's layout
    # (``shared_layout``; without it, (0, 0) and (0, 1): two plans for one DP rank).
    odd = dict(muon_plan_nvlink_domain=3)  # MUON: the duplicated mode
    assert [got[2] for got in run_distributed(_planning_model, 4, tp=2, kwargs=odd)] == [(0, 0)] * 4
