"""Smoke test of bench/: the baseline is exact Muon, and the counted figures add up.

    .venv/bin/python -m pytest tests/unit/test_bench.py -q

No timing is asserted: the benchmarks time on shared machines; only counts are checked here.
"""

import os
import sys

import pytest
import torch
from harness import run_distributed
from tiny_gpt import TinyGPT, train

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))

import projection  # noqa: E402
import step_cost  # noqa: E402
from gather_everything import distopts, use_gather_everything  # noqa: E402

from megatron.core.optimizer.muon_functional import MuonParamInfo  # noqa: E402
from megatron.core.optimizer.muon_plan import ns_cost  # noqa: E402
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
        "planned": plan.bytes_per_step(4, 4),
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


LAYOUT_BUCKET = 9000  # small DDP buckets: matrices straddle shards and buckets end padded


def _real_layout():
    """The real DDP buffer and DistOpt plan of the tiny GPT next to the projection's."""
    from tiny_gpt import build_model, build_optimizer

    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.muon_megatron import muon_param_infos

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
        "critical": plan.critical_path_flops(),
    }


def test_projection_layout_and_plan_are_the_real_ones():
    """``projection.ddp_layout`` rebuilds DDP's real buffer (order, padding, bucket ends), and
    the optimizer's planning code on it gives the plan the optimizer built: same matrices,
    owners, pieces and critical path."""
    import math

    for real, params in run_distributed(_real_layout, 2):
        numels = [math.prod(shape) for _, shape, _ in params]
        layout = projection.ddp_layout(numels, 2, LAYOUT_BUCKET)
        assert [(start, end) for start, end, _ in layout] == real["buckets"]
        index = {i: r for _, _, members in layout for i, r in members.items()}
        assert [index[i] for i in range(len(params))] == real["index"]
        plan = projection.build_plan(
            params, 2, LAYOUT_BUCKET, projection.cost_model(1, "duplicated")
        )
        assert len(real["buckets"]) > 2 and _plan_figures(plan) == real["plan"]
