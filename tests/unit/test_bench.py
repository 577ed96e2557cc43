"""Smoke test of bench/: the baseline is exact Muon, and the counted figures add up.

    .venv/bin/python -m pytest tests/unit/test_bench.py -q

No timing is asserted: the benchmarks time on shared machines; only counts are checked here.
"""

import math
import os
import sys

import pytest
import torch
from harness import run_distributed
from tiny_gpt import TinyGPT, train

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))

import projection  # noqa: E402
import projection_floor  # noqa: E402
import step_cost  # noqa: E402
from gather_everything import distopts, use_gather_everything  # noqa: E402

from megatron.core.optimizer.megatron_muon import newton_schulz  # noqa: E402
from megatron.core.optimizer.megatron_muon.functional import MuonParamInfo  # noqa: E402
from megatron.core.optimizer.megatron_muon.newton_schulz import (  # noqa: E402
    gram_chunks,
    staged_size,
)
from megatron.core.optimizer.megatron_muon.planner import figures as plan_figures  # noqa: E402
from megatron.core.optimizer.megatron_muon.planner import plan as plan_module  # noqa: E402
from megatron.core.optimizer.megatron_muon.planner.placement import HOLDER_SLACK  # noqa: E402
from megatron.core.optimizer.megatron_muon.planner.plan import (  # noqa: E402
    TPCollective,
    ns_cost,
    tp_collectives,
)
from megatron.training.muon_recipe import SEED_RECIPE  # noqa: E402

MUON = dict(optimizer="muon", muon_fp32_matmul_prec="highest", **SEED_RECIPE)
BUCKET = 6000  # several buckets; matrices straddle DP shard boundaries (as in the parity tests)


def _run(hook):
    figures = {}

    def record(optimizer):
        if hook:
            hook(optimizer)
        figures["optimizer"] = optimizer

    initial, final, losses = train(
        TinyGPT(), 2, distopt=True, bucket_size=BUCKET, overlap=True, optimizer_hook=record, **MUON
    )
    (distopt,) = distopts(figures["optimizer"])
    plan, ortho = distopt.muon_plan, distopt.optimizer.orthogonalizer
    return final, {
        "bytes": ortho.bytes_moved,
        "planned": plan_figures.bytes_per_step(plan, 4, 4),
        "pads": [max(sum(ortho._sizes(b, r)) for r in range(2)) for b in plan.buckets]
        if hook
        else None,
        "state": step_cost.muon_state_split(figures["optimizer"]),
    }


def _both():
    ours, ours_fig = _run(None)
    base, base_fig = _run(use_gather_everything)
    return ours, ours_fig, base, base_fig


@pytest.fixture(scope="module")
def dp2():
    return run_distributed(_both, 2)


def test_gather_everything_baseline_is_exact_muon(dp2):
    # Both orthogonalize the very same whole fp32 matrices; only who computes them differs.
    for ours, _, base, _ in dp2:
        for name in ours:
            torch.testing.assert_close(base[name], ours[name], rtol=1e-6, atol=1e-7)


def test_counted_bytes_match_the_exchanges(dp2):
    for _, ours_fig, _, base_fig in dp2:
        assert ours_fig["bytes"] == ours_fig["planned"] > 0
        # all-gather over DP=2 of each bucket's (padded) Muon elements: one piece out, one in
        assert base_fig["bytes"] == sum(2 * 1 * pad * 4 for pad in base_fig["pads"])


def test_muon_state_is_one_fp32_tensor_per_muon_param(dp2):
    muon_bytes, muon_elems, adam_bytes, adam_elems = dp2[0][1]["state"]
    assert muon_bytes == 4 * muon_elems > 0
    assert adam_bytes >= 8 * adam_elems > 0  # exp_avg, exp_avg_sq (+ a scalar step each)


def test_projection_counts_match_the_optimizer_and_its_formula():
    info = MuonParamInfo((512, 128))
    # per step X X^T (2 s^2 l), A A (2 s^3), B X (2 s^2 l); the projection uses the same count
    assert ns_cost(info, 5) == 5 * (4 * 128**2 * 512 + 2 * 128**3)
    for dp, floor in ((8, "0.9"), (1024, "0")):  # a third plan, floored, at DP 8 only
        r = projection.project("1B", dp, projection.parse_args(["--min-efficiency", floor]))
        assert r["base_ns"] / dp <= r["ns"] <= r["base_ns"]
        assert r["ns_flops"] <= r["unsplit_ns"] and 0 < r["efficiency"] <= 1
        assert r["ns"] + r["comm"] < r["base_ns"] + r["base_comm"]
        assert ("plan at efficiency >= 0.9" in projection.markdown([r])) == (dp == 8)
        assert r["floor_efficiency"] >= 0.9 if dp == 8 else r["floor"] is None


# 70B fc1 (57344 x 8192, TP rows) and proj (8192 x 8192, TP columns), 5 NS steps, TP 8: what one
# step's TP collectives are per TP rank (planner/plan.py's ``tp_collectives``; a real TP 2 step
# checks them: tests/distributed/test_muon_tp_collectives.py). ``distributed`` (bf16 NS): the
# packed 8192 x 8192 Gram (33,558,528 elements, 134 MB in fp32; the full one would be 268 MB)
# computed and summed in 8 chunks (``newton_schulz.staged_gram``: 16 blocks of 512 rows, 2 per
# chunk, 7,864,832 elements in the first, 524,800 in the last), each summed in bf16: its
# partials' slices exchanged (8 slices, padded) and the summed slices gathered (``tp.sums_in``);
# then the bf16 polynomial's pieces gathered, each padded to the largest (4,848,263 elements,
# ``polynomial_rows``: 0.58 of 1024 whole rows), every step: for the square proj too, whose
# piece costs less than reassociating (``splits_polynomial``).
GRAM, POLY = 8192 * 8193 // 2, 4848263
GRAM_CHUNKS = [staged_size(8192, lo, hi) for lo, hi in gram_chunks(8192)]
SLICES = [-(-n // 8) for n in GRAM_CHUNKS]
SPLIT_STEP = [
    c
    for chunk in SLICES
    for c in (
        TPCollective("all_to_all_single", 8 * chunk, "bfloat16", 8, 2 * 7 * chunk),
        TPCollective("all_gather_into_tensor", chunk, "bfloat16", 8),
    )
] + [TPCollective("all_gather_into_tensor", POLY, "bfloat16", 8)]
TP_COUNTS = [
    ("duplicated", 0, [TPCollective("all_gather", 57344 * 1024, "float32", 8)]),
    ("duplicated", 1, [TPCollective("all_gather", 8192 * 1024, "float32", 8)]),
    ("blockwise", 0, []),
    ("distributed", 0, [TPCollective("all_reduce", 1, "float32", 8)] + SPLIT_STEP * 5),
    ("distributed", 1, [TPCollective("all_reduce", 1, "float32", 8)] + SPLIT_STEP * 5),
]


@pytest.mark.parametrize("mode,dim,want", TP_COUNTS)
def test_tp_collectives_of_a_70b_matrix(mode, dim, want):
    from megatron.core.optimizer.megatron_muon.factory import MegatronMuonParamInfo

    shape = (57344, 8192) if dim == 0 else (8192, 8192)
    info = MegatronMuonParamInfo(shape, None, partition_dim=dim)
    got = tp_collectives(info, 5, mode, 8)
    assert got == want
    if mode == "distributed":  # ring bytes each way: 2 x 7 x 8.4 MB + 7 x 9.7 MB, per step
        assert sum(GRAM_CHUNKS) == GRAM and len(GRAM_CHUNKS) == 8
        assert (GRAM_CHUNKS[0], GRAM_CHUNKS[-1]) == (7864832, 524800)
        step = 2 * 7 * sum(SLICES) * 2 + 7 * POLY * 2
        assert sum(c.link_bytes() for c in got) == pytest.approx(5 * step + 2 * 7 / 8 * 4)
        # fp32 NS: one fp32 all-reduce per Gram chunk's sum (2 (7/8) x 134 MB in all: twice the
        # bytes)
        fp32 = tp_collectives(info, 5, mode, 8, ns_dtype="float32")
        want = [TPCollective("all_reduce", n, "float32", 8) for n in GRAM_CHUNKS]
        assert fp32[1:9] == want
        assert not any(c.op == "all_to_all_single" for c in fp32)
    assert tp_collectives(info, 5, mode, 1) == []  # no TP, no TP collective


@pytest.mark.parametrize(
    "mode,window", [("duplicated", 2), ("distributed", 1), ("distributed", 2), ("blockwise", 2)]
)
def test_projection_adds_each_ranks_tp_collectives_to_its_critical_path(mode, window, monkeypatch):
    """70B TP 8 x DP 8 (exact modes: shard-aligned, nothing moved, every rank runs alone): the NS
    time with TP is the busiest rank's matmuls plus its TP collectives' bytes at the NVLink
    bandwidth; ``blockwise`` has none. ``distributed`` runs two matrices at a time (``TP_WINDOW``),
    one's collectives under the other's matmuls, and each Gram's chunks' sums under its next
    chunks' matmuls (``staged_gram``): less than that sum, more than the matmuls; one matrix at
    a time, still less; one at a time and unstaged (``GRAM_CHUNKS`` 1), the sum. The
    gather-everything baseline pays every matrix's, LayerWise its busiest rank's."""
    monkeypatch.setattr(plan_figures, "TP_WINDOW", window)  # its NS working set
    monkeypatch.setattr(plan_module, "TP_WINDOW", window)  # ``stream_trace``'s
    if mode == "distributed" and window == 1:
        r, in_turn = _ns_and_in_turn(mode)
        assert r["max_flops"] / r["rate"] < r["ns"] < 0.99 * in_turn
        monkeypatch.setattr(newton_schulz, "GRAM_CHUNKS", 1)  # the control: unstaged
    r, in_turn = _ns_and_in_turn(mode)
    has_tp = mode != "blockwise"
    if window > 1 and mode == "distributed":
        assert r["max_flops"] / r["rate"] < r["ns"] < 0.99 * in_turn
    elif has_tp:
        assert r["ns"] == pytest.approx(in_turn, rel=1e-9)
    else:
        assert r["tp"] == [0.0] * 8 and r["ns"] == r["ns_no_tp"]
    every = sum(projection.matrix_tp_bytes(r["model"], i) for i in r["infos"]) / r["tp_link"]
    assert r["base_tp"] == pytest.approx(every)
    assert (r["ns"] > r["ns_no_tp"]) == (r["lw_tp"] > 0) == (r["base_tp"] > 0) == has_tp


def _ns_and_in_turn(mode: str) -> tuple[dict, float]:
    """70B TP 8 x DP 8's projection row (plus what the test compares it with), and its busiest
    rank's matmuls plus TP collectives' bytes at the NVLink bandwidth, one after another."""
    a = projection.parse_args(["--tp-mode", mode, "--min-efficiency", "0", "--dps", "8"])
    r = projection.project("70B", 8, a)
    has_tp = mode != "blockwise"
    assert r["layout"] == "shard-aligned (0 moved)" or not has_tp  # blockwise moves 28
    assert r["gangs"] == 0
    cfg = projection.MODELS["70B"]
    params = projection.model_params(*cfg)
    _, buckets, _ = projection.ours_layout(params, 8, projection.ddp_bucket_size(8))
    model = projection.cost_model(cfg[-1], mode, ns_itemsize=a.ns_bytes)
    plan = projection.build_plan(params, buckets, 8, model)
    rate, tp_link = a.peak_tflops * 1e12 * a.mfu, a.tp_link_gbps / 8 * 1e9
    flops = plan_figures.ns_flops_per_rank(plan)
    tp = [
        sum(c.link_bytes() for c in plan_figures.tp_collectives_per_step(plan, rank)) / tp_link
        for rank in range(8)
    ]
    in_turn = max(f / rate + t for f, t in zip(flops, tp))
    infos = [info for _, _, info in params if info is not None]
    extra = dict(max_flops=max(flops), rate=rate, tp=tp, model=model, infos=infos)
    return {**r, **extra, "tp_link": tp_link}, in_turn


def test_projection_owner_mode_balances_the_tp_ranks_of_the_grid():
    """70B TP 8 x DP 8, ``owner`` mode: the shard-aligned layout gives DP ranks 0-3 twenty fc1
    each, three of them on one TP rank. The planner balances TP ranks (``holder_owners`` with
    ``cells``): it moves matrices, and the busiest TP rank (tp.py's ``owner_cells`` on each
    owner's matrices: ``projection.owner_ns``) runs over 5% less NS than with every matrix on
    its holder (the plan without a cost model)."""
    a = projection.parse_args(["--tp-mode", "owner", "--min-efficiency", "0", "--dps", "8"])
    r = projection.project("70B", 8, a)
    assert r["layout"].startswith("shard-aligned (") and not r["layout"].startswith(
        "shard-aligned (0 "
    )
    assert r["ns_flops"] * (1 + HOLDER_SLACK) < r["unsplit_ns"]
    assert r["comm"] > 0 == r["unsplit_comm"]  # the moves cost exchange traffic


def test_by_rank_groups_every_rank_and_its_latest_end_is_the_critical_path():
    """``--by-rank`` at 70B TP 8 x DP 256, ``distributed``: the groups hold every DP rank once,
    each ends at or after its matmuls, the latest end is the row's NS time (the plan's critical
    path with its TP collectives), and fc1's gang members end last (13 ms of matmuls, done at
    18: their sums over TP and the gang show), each group's gap its TP and gang time. The owner
    mode refuses the flag (its NS is per TP rank)."""
    a = projection.parse_args(["--tp-mode", "distributed", "--dps", "256", "--by-rank"])
    r = projection.project("70B", 256, a)
    rows = r["by_rank"]
    assert sum(row["ranks"] for row in rows) == 256
    assert all(row["end"] >= row["matmuls"] > 0 for row in rows)
    assert rows[0]["end"] == pytest.approx(r["ns"], rel=1e-12)
    assert rows[0]["kind"] == "2 fc1/3" and rows[0]["end"] - rows[0]["matmuls"] > 0
    assert "| 2 fc1/3 | 114 |" in projection.by_rank_markdown("70B", 256, rows)
    with pytest.raises(SystemExit):
        projection.parse_args(["--tp-mode", "owner", "--by-rank"])


# DP 1024 in the mode closest to the floor there only: projecting a DP 1024 row takes ~20 s
@pytest.mark.parametrize(
    "dp,modes", [(8, ("owner", "distributed", "duplicated")), (1024, ("distributed",))]
)
def test_projection_floor_is_below_every_exact_schedule(dp, modes):
    """bench/projection_floor.py's floor bounds what the optimizer's schedules take: at 70B TP 8
    each exact TP mode's projected NS plus TP time (projection.py) is at or above it. A split
    over one GPU is the block's least FLOPs (``least_flops``, below one process's), no
    collective."""
    a = projection.parse_args(["--min-efficiency", "0", "--dps", str(dp), "--models", "70B"])
    floor = projection_floor.floor_row("70B", dp, a)
    for mode in modes:
        a.tp_mode = mode
        assert projection.project("70B", dp, a)["ns"] >= floor["floor"] > 0
    rate = a.peak_tflops * 1e12 * a.mfu
    whole = ns_cost(MuonParamInfo((512, 128)), projection.NS_STEPS) / rate
    least = projection.NS_STEPS * (3 * 128**2 * 512 + 128**3) / rate  # half Gram, half G G
    assert projection_floor.split_seconds((512, 128), 1, a) == least < whole


LAYOUT_BUCKET = 9000  # small DDP buckets: matrices straddle shards and buckets end padded


def _real_layout():
    """The real DDP buffer and DistOpt plan of the tiny GPT next to the projection's."""
    from tiny_gpt import build_model, build_optimizer

    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.megatron_muon.factory import muon_param_infos

    spec = TinyGPT(num_layers=3)
    model = build_model(spec, distopt=True, bucket_size=LAYOUT_BUCKET, overlap_grad_reduce=True)
    optimizer = build_optimizer(spec, model, use_distributed_optimizer=True, **MUON)
    (distopt,) = distopts(optimizer)
    (buffer,) = model[0].buffers
    infos = muon_param_infos(OptimizerConfig(**MUON), model)
    named = list(model[0].module.named_parameters())
    params = [(n, tuple(p.shape), infos.get(p)) for n, p in named]
    real = {
        "buckets": [tuple(b) for b in buffer.bucket_indices],
        "index": [buffer.param_index_map[p][:2] for _, p in named],
        "plan": _plan_figures(distopt.muon_plan),
    }
    return real, params


def _plan_figures(plan):
    return {
        "matrices": [(m.bucket, m.start, m.end, m.cost, m.units) for m in plan.matrices],
        "pieces": [p.key + (p.lo, p.hi) for ex in plan.exchanges for p in ex.pieces],
        "critical": plan_figures.critical_path_flops(plan),
    }


def test_projection_layout_and_plan_are_the_real_ones():
    """``projection.ddp_layout`` rebuilds DDP's real buffer (order, padding, bucket ends), and
    the optimizer's planning code on it gives the plan the optimizer built: same matrices,
    owners, pieces and critical path."""
    for real, params in run_distributed(_real_layout, 2):
        numels = [math.prod(shape) for _, shape, _ in params]
        layout = projection.ddp_layout(numels, 2, LAYOUT_BUCKET)
        assert [(start, end) for start, end, _ in layout] == real["buckets"]
        index = {i: r for _, _, members in layout for i, r in members.items()}
        assert [index[i] for i in range(len(params))] == real["index"]
        plan = projection.build_plan(params, layout, 2, projection.cost_model(1, "duplicated"))
        assert len(real["buckets"]) > 2 and _plan_figures(plan) == real["plan"]


def _real_aligned():
    """Our Muon's DDP layout as Megatron-LM builds it (``muon_layout``, one bucket: DP=2 takes
    the shard-aligned one), its plan, what rank 0 logs, and one step's all-to-alls."""
    import logging

    from collectives import CollectiveRecorder
    from tiny_gpt import build_model, build_optimizer, global_batches, train_step

    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.megatron_muon.factory import muon_param_infos

    logs = []
    handler = logging.Handler()
    handler.emit = lambda record: logs.append(record.getMessage())
    log = logging.getLogger("megatron.core.optimizer.megatron_muon.distrib_optimizer")
    log.addHandler(handler)
    log.setLevel(logging.INFO)  # Megatron-LM's --logging-level; Python's default shows warnings
    spec = TinyGPT()
    model = build_model(spec, distopt=True, muon_layout=True)
    optimizer = build_optimizer(spec, model, use_distributed_optimizer=True, **MUON)
    (distopt,) = [d for d in distopts(optimizer) if hasattr(d, "muon_plan")]
    named = list(model[0].module.named_parameters())
    at = {p: i for i, (_, p) in enumerate(named)}
    infos = muon_param_infos(OptimizerConfig(**MUON), model)
    buckets = []
    for buffer in model[0].buffers:
        members = [{} for _ in buffer.bucket_indices]
        for p, (start, end, b) in buffer.param_index_map.items():
            members[b][at[p]] = (start, end)
        buckets += [(*bucket, m) for bucket, m in zip(buffer.bucket_indices, members)]
    plan = distopt.muon_plan
    with CollectiveRecorder() as calls:
        train_step(spec, model, optimizer, global_batches(spec, 1)[0])
    return {
        "params": [(n, tuple(p.shape), infos.get(p)) for n, p in named],
        "buckets": buckets,
        "plan": _plan_figures(plan),
        "sync_points": plan_figures.sync_points(plan),
        "all_to_alls": sum(c.op == "all_to_all_single" for c in calls),
        "bytes": distopt.optimizer.orthogonalizer.bytes_moved,
        "logs": logs,
    }


def test_projection_takes_the_layout_and_sync_points_the_optimizer_takes():
    """Where our optimizer lays the matrices out shard-aligned, ``projection.ours_layout`` (its
    decision, on meta tensors) gives DDP's real buffers and the same plan; every matrix stays
    with its holder, so the step runs no all-to-all and ``sync_points`` counts none. Rank 0
    alone logs the plan, naming the layout."""
    for rank, real in enumerate(run_distributed(_real_aligned, 2)):
        aligned, buckets, _ = projection.ours_layout(real["params"], 2, None)
        assert aligned and buckets == real["buckets"]
        plan = projection.build_plan(
            real["params"], buckets, 2, projection.cost_model(1, "duplicated")
        )
        assert _plan_figures(plan) == real["plan"]
        assert real["all_to_alls"] == real["sync_points"] == plan_figures.sync_points(plan) == 0
        assert real["bytes"] == plan_figures.bytes_per_step(plan, 4, 4) == 0
        # negative control: DDP's byte-level layout (small buckets: matrices straddle shards)
        numels = [math.prod(s) for _, s, _ in real["params"]]
        byte_level = projection.ddp_layout(numels, 2, LAYOUT_BUCKET)
        moving = projection.build_plan(real["params"], byte_level, 2, plan.model)
        assert plan_figures.sync_points(moving) >= 1
        assert [("shard-aligned layout" in line) for line in real["logs"]] == [True] * (rank == 0)


# ------------------------------------------- upstream's LayerWise Muon beside ours (bf16, DP=2)


def _three_way():
    """AdamW+DistOpt, ours and upstream's LayerWise Muon as step_cost builds them (bf16, small
    buckets), one step each with its collectives recorded; the counts and LayerWise's real
    layout and assignment."""
    from collectives import CollectiveRecorder
    from tiny_gpt import global_batches, train_step

    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.megatron_muon.factory import muon_param_infos

    spec, out = TinyGPT(), {}
    (batch,) = global_batches(spec, 1)
    for who in step_cost.THREE:
        v = step_cost.BF16[(who, True)]
        v = step_cost.Variant(v.overrides, bucket=BUCKET, dtype="bf16", layer_wise=v.layer_wise)
        spec_v, model, optimizer = step_cost.build_variant(spec, v, distopt=True)
        with CollectiveRecorder() as calls:
            train_step(spec_v, model, optimizer, batch)
        fig = step_cost.variant_counts(model, optimizer, calls)
        fig["calls"] = [(c.op, c.numel, c.bytes) for c in calls]
        fig["split"] = step_cost.muon_state_split(optimizer)
        out[who] = fig
        if who != "layerwise":
            continue
        named = list(model[0].module.named_parameters())
        name = {p: n for n, p in named}
        infos = muon_param_infos(OptimizerConfig(**MUON), model)
        (lw,) = [o for o in distopts(optimizer) if type(o).__name__.startswith("LayerWise")]
        (buffer,) = [b for b in model[0].buffers if b.params[0].is_managed_by_layer_wise_optimizer]
        fig["params"] = [(n, tuple(p.shape), infos.get(p)) for n, p in named]
        fig["index"] = {name[p]: v[:3] for p, v in buffer.param_index_map.items()}
        fig["buckets"] = [tuple(b) for b in buffer.bucket_indices]
        fig["padding"] = buffer.numel - sum(p.numel() for p in buffer.params)
        fig["owners"] = [sorted(name[p] for p in ps) for ps in lw.dp_cp_params_list]
        local = [
            p
            for leaf in step_cost.leaves(lw)
            for g in leaf.optimizer.param_groups
            for p in g["params"]
        ]
        fig["local_numel"] = sum(p.numel() for p in local)
    return out


@pytest.fixture(scope="module")
def three_way():
    return run_distributed(_three_way, 2)


def test_counted_bytes_of_the_whole_iteration_are_the_recorded_ones(three_way):
    """Bytes per step counted from the DDP buffers (padding included) and our exchange are the
    bytes of the collectives the step called, op by op; the rest is scalars (loss, grad norm)."""
    for rank in three_way:
        for who, fig in rank.items():
            by_op = fig["recorded_by_op"]
            assert by_op["reduce_scatter_tensor"] == fig["reduce_scatter"] > 0, who
            assert by_op["all_gather_into_tensor"] == fig["all_gather"] > 0, who
            exchange = by_op.get("all_to_all_single", 0) + by_op.get("batch_isend_irecv", 0)
            assert exchange == fig["exchange"], who
            assert (fig["exchange"] > 0) == (who == "ours"), who
            # the rest moves bytes only as scalars (all-reduces over one-rank TP groups move none)
            rest = ("reduce_scatter_tensor", "all_gather_into_tensor", "all_to_all_single")
            scalars = [c for c in fig["calls"] if c[0] not in rest and c[2] > 0]
            assert all(op == "all_reduce" and numel <= 4 for op, numel, _ in scalars), scalars
            assert fig["recorded"] - fig["total"] == sum(b for _, _, b in scalars)
        # LayerWise pads its buffer: counting its params alone (negative control) misses bytes
        lw, adamw = rank["layerwise"], rank["adamw"]
        assert lw["padding"] > 0 and lw["reduce_scatter"] > adamw["reduce_scatter"]


def test_layer_wise_ns_flops_and_state_are_its_owned_matrices(three_way):
    """LayerWise's NS FLOPs per rank (from dp_cp_params_list) cover every matrix once and are the
    matrices this rank's optimizer steps; its Muon state is one fp32 momentum per owned element."""
    flops = three_way[0]["layerwise"]["ns_flops"]
    ours = three_way[0]["ours"]["ns_flops"]
    assert len(flops) == 2 and sum(flops) == pytest.approx(sum(ours))  # same matrices, same count
    for rank in three_way:
        lw = rank["layerwise"]
        assert lw["ns_flops"] == flops
        muon_bytes, muon_elems, _, _ = lw["split"]
        assert muon_bytes == 4 * muon_elems == 4 * lw["local_numel"] > 0


def test_layer_wise_model_is_the_real_assignment(three_way):
    """``projection.layer_wise`` on the tiny GPT gives the real LayerWiseDistributedOptimizer's
    layout (buckets, every matrix's place), owners, padding and NS FLOPs per rank."""
    lw = three_way[0]["layerwise"]
    params = lw["params"]
    model = projection.layer_wise(params, 2, BUCKET, projection.cost_model(1, "duplicated"))
    muon = [n for n, _, info in params if info is not None]
    assert model["layout"]["buckets"] == lw["buckets"] and len(lw["buckets"]) > 1
    assert {n: model["layout"]["index"][k][:2] for k, n in enumerate(muon)} == {
        n: lw["index"][n][:2] for n in muon
    }
    assert model["layout"]["padding"] == lw["padding"]
    assert [sorted(n for n, r in model["owner"].items() if r == rank) for rank in (0, 1)] == lw[
        "owners"
    ]
    assert model["flops"] == pytest.approx(lw["ns_flops"])


@pytest.mark.parametrize("size,dps", [("1B", (8, 64, 1024)), ("70B", (8, 1024))])
def test_layer_wise_layout_rule_is_upstreams_at_scale(size, dps):
    """``projection.layer_wise_layout`` = upstream's ``_compute_per_buffer_param_layout`` on the
    projected models' matrices (meta tensors: shapes only), DDP's bucket size at each DP."""
    import math

    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer.layer_wise_optimizer import LayerWiseDistributedOptimizer

    shapes = [s for _, s, info in projection.model_params(*projection.MODELS[size]) if info]
    for dp in dps:
        bucket = projection.ddp_bucket_size(dp)
        metas = [torch.nn.Parameter(torch.empty(s, device="meta")) for s in shapes]
        real = LayerWiseDistributedOptimizer._compute_per_buffer_param_layout(
            metas, bucket, dp, DistributedDataParallelConfig()
        )
        mine = projection.layer_wise_layout([math.prod(s) for s in shapes], dp, bucket)
        assert mine["buckets"] == [tuple(b) for b in real.bucket_indices]
        assert [mine["index"][k][:3] for k in range(len(metas))] == [
            real.param_index_map[p] for p in metas
        ]
