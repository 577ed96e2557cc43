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
from parity import first_difference
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


def _step(mode: str, gangs: bool, gram_rows=None) -> dict:
    """One real step; the TP-group collectives of Muon's inner step and of the whole optimizer
    step, and the plan's count (also for another mode and one NS step fewer: controls).
    ``gram_rows``: ``newton_schulz.GRAM_BLOCK_ROWS`` (small: the stream computes and sums its
    Grams in chunks, ``staged_gram``)."""
    import torch.distributed as dist
    from collectives import CollectiveRecorder

    from megatron.core import parallel_state as ps
    from megatron.core.optimizer.megatron_muon import newton_schulz

    if gram_rows is not None:
        newton_schulz.GRAM_BLOCK_ROWS = gram_rows

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
    from megatron.core.optimizer.megatron_muon.newton_schulz import GATHER, SUM
    from megatron.core.optimizer.megatron_muon.planner.cost_model import POST, WAIT

    trace, counter = [], MatmulFlops()
    post, wait = tp._post, tp._wait

    def posted(i, kind, t, group, ns_dtype=None):
        # a sum in the NS dtype: its all-to-all's input, the slices padded to the longest, then
        # the all-gather's, one slice; a gather's: this rank's range of ``t``'s pieces, padded
        chunk = -(-t.numel() // group.size()) if kind != GATHER else 0
        if kind == SUM and tp.sums_in(t.numel(), group.size(), ns_dtype):
            n = group.size() * chunk
        else:
            n = {SUM: t.numel(), tp.SUMMED: chunk}.get(kind) or max(b - a for a, b in t.ranges)
        trace.append((counter.flops, POST, n))
        counter.flops = 0.0
        return post(i, kind, t, group, ns_dtype), n

    def waited(handle):
        trace.append((counter.flops, WAIT, handle[1]))
        counter.flops = 0.0
        return wait(handle[0])  # a sum's second collective: posted through ``posted``

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
def _runs(mode: str, gangs: bool = False, gram_rows=None) -> list[dict]:
    return run_distributed(_step, 4, tp=2, args=(mode, gangs, gram_rows))


# The stream's 64 x 64 (and 64 x 128) Grams in blocks of 8 rows, computed and summed in chunks
STAGED_ROWS = 8


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


@pytest.mark.parametrize("gram_rows", [None, STAGED_ROWS])
def test_distributed_mode_runs_the_planned_stream(gram_rows):
    """``distributed`` mode: each TP rank's posts and waits, and the matmul FLOPs between them,
    are ``figures.stream_trace``'s (the projection's trace): two matrices in flight at once,
    one's collectives posted before the other's are waited for. With small Gram blocks
    (``gram_rows``) each Gram is computed in chunks, each chunk's sum posted once computed
    (``EARLY``): more posts than unstaged, each with a chunk's FLOPs before it; the TP
    collectives (op, elements, dtype, bytes, in order) are still the count's."""
    for rank, r in enumerate(_runs("distributed", gram_rows=gram_rows)):
        planned, after = r["plan_trace"]
        assert r["trace"] == planned, rank
        assert r["after"] == after > 0
        ops = [op for _, op, _ in r["trace"]]
        assert ops[:2] == ["post", "post"], ops[:4]  # the second matrix posts before a wait
        assert r["muon"] == r["counted"], rank
    if gram_rows is not None:
        for staged, unstaged in zip(
            _runs("distributed", gram_rows=gram_rows), _runs("distributed")
        ):
            assert len(staged["trace"]) > 2 * len(unstaged["trace"])
            assert staged["after"] == unstaged["after"]


def _stream_sums(optimizer, fp32=False, dropped=False, gram_rows=None):
    """Hook: the ``distributed`` stream sums its Grams as one fp32 all-reduce (``fp32``), or
    (``dropped``: negative control) in the NS dtype with the gathered sums never copied back;
    ``gram_rows``: ``newton_schulz.GRAM_BLOCK_ROWS`` (small: each Gram in chunks)."""
    from megatron.core.optimizer.megatron_muon import newton_schulz, tp

    if gram_rows is not None:
        newton_schulz.GRAM_BLOCK_ROWS = gram_rows

    if fp32:
        tp.sums_in = lambda n, k, dtype: False
    if dropped:
        post = tp._post

        def no_fill(i, kind, t, group, ns_dtype=None):
            work, fill, then = post(i, kind, t, group, ns_dtype)
            return (work, None, then) if kind == tp.SUMMED else (work, fill, then)

        tp._post = no_fill


def test_stream_gram_sums_in_the_ns_dtype_change_no_bit():
    """TP 2 x DP 2 (``distributed``, no gangs), bf16 Newton-Schulz: the stream sums each packed
    Gram as its bf16 partials exchanged (bf16 matmul results, exact in it) and added in fp32,
    the sums gathered back in bf16 (``tp.sums_in``: half an fp32 all-reduce's bytes), and every
    rank's params end bit-identical to one fp32 all-reduce per sum: two partials add alike in
    either order, and the Gram's consumer rounds to bf16 either way. So do the staged Grams
    (computed and summed in chunks: the same block matmuls, the same sums). Negative control:
    with the gathered sums dropped the params differ."""
    from test_muon_distopt import CONTROL_STEPS, run_layout

    bf16_ns = dict(muon_tp_mode="distributed", muon_fp32_matmul_prec="medium")

    def run(**hook):
        hook = functools.partial(_stream_sums, **hook)
        return run_layout("fp32", 4, tp=2, hook=hook, steps=CONTROL_STEPS, **bf16_ns)

    got, one, broken = run(), run(fp32=True), run(dropped=True)
    assert first_difference(got, one) is None
    assert first_difference(broken, one) is not None
    staged, staged_broken = run(gram_rows=STAGED_ROWS), run(gram_rows=STAGED_ROWS, dropped=True)
    assert first_difference(staged, one) is None
    assert first_difference(staged_broken, one) is not None
