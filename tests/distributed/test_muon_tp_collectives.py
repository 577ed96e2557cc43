"""The TP collectives a real TP=2 x DP=2 DistOpt Muon step issues are the ones the planner counts
(``planner/plan.py``'s ``tp_collectives`` per matrix, ``planner/figures.py``'s ``tp_schedule``
per DP rank), which bench/projection.py times at the NVLink bandwidth: op, elements, dtype and
order, in each TP mode, with and without gangs. Reproduce by hand:

    .venv/bin/python -m pytest tests/distributed/test_muon_tp_collectives.py -q
"""

import copy
import dataclasses
import functools
import os
import sys

import pytest
from harness import run_distributed
from test_muon_distopt import BUCKET, MUON, distopts
from test_muon_gangs import _split
from tiny_gpt import TinyGPT, build_model, build_optimizer, global_batches, train_step

from megatron.core import parallel_state
from megatron.core.optimizer.megatron_muon.planner import figures as plan_figures

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))

# bf16 Newton-Schulz: the polynomial's rows and (gangs) the summed Gram slices gathered over TP
# move in bf16, the Gram sums and the TP gathers of the (fp32) update in fp32, so a wrong dtype
# in the count shows.
PRECISION = "medium"


def _recorded(obj, name: str, recorder) -> None:
    """Record the collectives of every call of ``obj.name``."""
    call = getattr(obj, name)

    def recorded(*args, **kwargs):
        with recorder:
            return call(*args, **kwargs)

    setattr(obj, name, recorded)


def _step(mode: str, gangs: bool) -> dict:
    """One real step; the TP-group collectives of Muon's inner step and of the whole optimizer
    step, and the plan's count (also for another mode and one NS step fewer: controls)."""
    import torch.distributed as dist
    from collectives import CollectiveRecorder

    from megatron.core import parallel_state as ps

    spec = TinyGPT()
    model = build_model(spec, distopt=True, bucket_size=BUCKET, overlap_grad_reduce=True)
    muon = dict(MUON, muon_tp_mode=mode, muon_fp32_matmul_prec=PRECISION)
    optimizer = build_optimizer(spec, model, use_distributed_optimizer=True, **muon)
    if gangs:
        _split(optimizer)
    (distopt,) = distopts(optimizer)
    plan = distopt.muon_plan
    inner, outer = CollectiveRecorder(), CollectiveRecorder()
    _recorded(distopt.optimizer, "step", inner)
    _recorded(optimizer, "step", outer)
    trace, counter = _streamed(optimizer) if mode == "distributed" else ([], None)
    train_step(spec, model, optimizer, global_batches(spec, 1)[0])
    tp = tuple(dist.get_process_group_ranks(ps.get_tensor_model_parallel_group()))

    def ours(calls):
        return [(c.op, c.numel, c.dtype, c.world, c.bytes) for c in calls if c.ranks == tp]

    other = "distributed" if mode != "distributed" else "duplicated"
    t = ps.get_tensor_model_parallel_rank()
    return {
        "muon": ours(inner.calls),
        "step": ours(outer.calls),
        "counted": _counted(plan, t),
        "other_mode": _counted(_with_model(plan, mode=other), t),
        "fewer_steps": _counted(_with_model(plan, steps=plan.model.steps - 1), t),
        "gangs": sum(len(ex.gangs) for ex in plan.exchanges),
        "trace": trace,
        "after": counter and counter.flops,
        "plan_trace": _plan_stream(plan) if mode == "distributed" else ([], None),
    }


def _streamed(optimizer) -> tuple[list, object]:
    """Record tp.py's ``stream``: (matmul FLOPs of the step since the previous entry, post or
    wait, the collective's input elements), and the counter (its FLOPs after the last entry)."""
    from test_muon_distopt import MatmulFlops, count_optimizer_step

    from megatron.core.optimizer.megatron_muon import tp
    from megatron.core.optimizer.megatron_muon.newton_schulz import SUM
    from megatron.core.optimizer.megatron_muon.planner.cost_model import POST, WAIT

    trace, counter = [], MatmulFlops()
    post, wait = tp._post, tp._wait

    def posted(i, kind, t, group):
        # a gather's input: this rank's range of ``t``'s pieces, padded to the longest
        n = t.numel() if kind == SUM else max(hi - lo for lo, hi in t.ranges)
        trace.append((counter.flops, POST, n))
        counter.flops = 0.0
        return post(i, kind, t, group), n

    def waited(handle):
        trace.append((counter.flops, WAIT, handle[1]))
        counter.flops = 0.0
        wait(handle[0])

    tp._post, tp._wait = posted, waited
    count_optimizer_step(optimizer, counter)
    return trace, counter


def _plan_stream(plan) -> tuple[list, float]:
    """The plan's ``stream_trace`` of this rank's whole matrices (one exchange, no gangs), as
    ``_streamed`` records it (this TP rank's polynomial pieces); the FLOPs after the last
    entry."""
    (ex,) = plan.exchanges
    infos = [plan.matrices[i].info for i in plan_figures.owned_whole(plan, ex, plan.rank)]
    own = dataclasses.replace(plan.model, tp_rank=parallel_state.get_tensor_model_parallel_rank())
    events, after = plan_figures.stream_trace(infos, own, "bfloat16")
    return [(f, op, c.elements) for f, op, c in events], after


def _counted(plan, tp_rank: int) -> list[tuple]:
    """The plan's count, as recorded: bytes sent plus received (twice each way)."""
    return [
        (c.op, c.elements, c.dtype, c.tp, 2 * c.link_bytes())
        for c in plan_figures.tp_collectives_per_step(plan, tp_rank=tp_rank)
    ]


def _with_model(plan, **changes):
    """``plan`` with its cost model changed (its cached schedule dropped)."""
    other = copy.copy(plan)
    other.__dict__.pop("_schedule_cache", None)  # the owners stay: same pieces
    other.model = dataclasses.replace(plan.model, **changes)
    return other


@functools.cache
def _runs(mode: str, gangs: bool = False) -> list[dict]:
    return run_distributed(_step, 4, tp=2, args=(mode, gangs))


CASES = [
    ("duplicated", False),
    ("duplicated", True),
    ("distributed", False),
    ("distributed", True),
    ("blockwise", False),
    ("owner", False),
]


@pytest.mark.parametrize("mode,gangs", CASES)
def test_tp_collectives_of_a_step_are_the_counted_ones(mode, gangs):
    """Every TP-group collective of Muon's step (op, elements, dtype, group size, ring bytes, in
    order) is the count's, and the whole optimizer step issues no other TP collective (Megatron's
    grad norm sums over another group). Controls: the count for another TP mode, or (where
    it depends on the steps) one NS step fewer, differs."""
    for rank, r in enumerate(_runs(mode, gangs)):
        assert r["muon"] == r["counted"], rank
        assert r["step"] == r["muon"], rank
        assert (r["gangs"] > 0) == gangs
        if mode == "blockwise":
            assert r["counted"] == [] and r["other_mode"] != []
            continue
        assert r["counted"] and r["other_mode"] != r["counted"]
        if mode == "owner":  # one all-to-all to the owners, one back
            assert [c[0] for c in r["counted"]] == ["all_to_all_single"] * 2
        if mode == "distributed" or gangs:
            assert r["fewer_steps"] != r["counted"]


def test_distributed_mode_runs_the_planned_stream():
    """``distributed`` mode: each TP rank's posts and waits, and the matmul FLOPs between them,
    are ``figures.stream_trace``'s (the projection's trace): two matrices in flight at once,
    one's collectives posted before the other's are waited for."""
    for rank, r in enumerate(_runs("distributed")):
        planned, after = r["plan_trace"]
        assert r["trace"] == planned, rank
        assert r["after"] == after > 0
        ops = [op for _, op, _ in r["trace"]]
        assert ops[:2] == ["post", "post"], ops[:4]  # the second matrix posts before a wait
