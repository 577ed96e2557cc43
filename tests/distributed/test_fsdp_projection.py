"""bench/projection_fsdp.py's per-rank counts are what a real Megatron-FSDP step does.

A tiny real GPT trains two steps with our Muon under Megatron-FSDP (``optim_grads_params``) on
gloo CPU ranks; the second step's collectives are recorded as they are called
(bench/collectives.py) and the matrices each rank's owners orthogonalize are watched. The
projection, fed the model's names and shapes only, must give every rank: the framework's param
all-gathers and grad reduce-scatters call by call (elements, element size), the bytes of our
exchange's all-to-alls, and the Newton-Schulz FLOPs of what the rank orthogonalized. Negative
control: the schedule without the backward all-gather (one collective per group missing) must
not match.

    .venv/bin/python -m pytest tests/distributed/test_fsdp_projection.py -q
"""

import functools
import os
import sys
from collections import Counter

import pytest
from harness import run_distributed
from tiny_gpt import TinyGPT, global_batches, train_step

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))

FRAMEWORK_OPS = ("all_gather_into_tensor", "reduce_scatter_tensor")


def _recording(inner, done, updates, infos, spec):
    done.extend(infos)
    return inner(updates, infos, spec)


def real_and_projected(spec: TinyGPT) -> dict:
    """On this rank: the recorded second step, the projection's counts for it, and ("missing")
    those of the schedule without the backward all-gathers (the negative control)."""
    import fsdp_figures
    import projection
    import projection_fsdp
    from collectives import CollectiveRecorder

    from megatron.core.optimizer.megatron_muon.planner.cost_model import DEFAULT_LINKS
    from megatron.core.optimizer.megatron_muon.planner.plan import ns_cost

    kind, settings = fsdp_figures.VARIANTS["muon_fsdp"]
    model, optimizer = fsdp_figures.build(spec, kind, settings)
    ortho = optimizer.optimizer.orthogonalizer
    steps = optimizer.optimizer.ortho_specs()[0].steps
    done = []
    for ex in ortho.exchanges:
        ex.inner = functools.partial(_recording, ex.inner, done)
    first, second = global_batches(spec, 2)
    train_step(spec, model, optimizer, first)
    done.clear()
    with CollectiveRecorder() as calls:
        train_step(spec, model, optimizer, second)
    (plan,) = fsdp_figures.plans(optimizer)
    infos = {m.name: m.info for m in plan.matrices}
    # what the projection is fed: names, TP-local shapes (a DTensor's shape is the unsharded
    # one), which are Muon matrices; nothing of the run's layout
    params = [
        (name, tuple(p.shape), infos.get(name))
        for name, p in model[0].module.module.named_parameters()
    ]
    assert sum(info is not None for _, _, info in params) == len(infos) > 0
    world = plan.world
    model_ns = projection.cost_model(
        1, "duplicated", **DEFAULT_LINKS.link_costs(), ns_itemsize=4, exchange_itemsizes=8
    )
    groups = projection_fsdp.fsdp_layout(params, world, None)
    rank = plan.rank
    micro = spec.global_batch_size // (spec.micro_batch_size * world)
    projected = projection_fsdp.counts(params, world, model_ns, None, micro)
    missing = projection_fsdp.counts(params, world, model_ns, None, micro, backward_gathers=False)
    schedule = functools.partial(projection_fsdp.schedule, groups, world, 4, 4, micro)
    return dict(
        micro_batches=micro,
        recorded=Counter((c.op, c.numel, c.itemsize) for c in calls if c.op in FRAMEWORK_OPS),
        scheduled=Counter(schedule()),
        missing=dict(scheduled=Counter(schedule(backward_gathers=False)), **missing[rank]),
        recorded_fsdp_bytes=sum(c.bytes for c in calls if c.op in FRAMEWORK_OPS),
        recorded_exchange=sum(c.bytes for c in calls if c.op == "all_to_all_single"),
        orthogonalized_flops=sum(ns_cost(info, steps) for info in done),
        **projected[rank],
    )


@pytest.fixture(scope="module")
def ranks() -> list:
    return run_distributed(real_and_projected, 2, args=(TinyGPT(),))


def test_fsdp_projection_counts_are_a_real_step(ranks):
    """Every rank: the framework's collectives call by call, their bytes, the exchange's bytes
    and the NS FLOPs, as projected from names and shapes alone."""
    for r in ranks:
        assert r["micro_batches"] == 2  # the schedule's per-micro-batch collectives are tested
        assert r["recorded"] == r["scheduled"]
        assert r["recorded_fsdp_bytes"] == r["fsdp_bytes"] > 0
        assert r["recorded_exchange"] == r["exchange_bytes"] > 0
        assert r["orthogonalized_flops"] == r["ns_flops"]
    assert sum(r["ns_flops"] for r in ranks) > 0


def test_negative_control_schedule_missing_a_collective_misses(ranks):
    """The schedule without the param all-gather before each backward does not match."""
    for r in ranks:
        assert r["missing"]["scheduled"] != r["recorded"]
        assert r["missing"]["fsdp_bytes"] != r["recorded_fsdp_bytes"]
        assert r["missing"]["fsdp_bytes"] < r["fsdp_bytes"]
