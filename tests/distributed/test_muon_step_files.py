"""One DistributedOptimizer Muon step reads in few of our files: which ones, measured on a run.

The common case (DP=2, TP=1, whole matrices: no gangs) runs functions of the optimizer, the
math and the exchange only; the TP orthogonalizer and the gangs are plug-ins entered where TP
shards a matrix or the plan splits one (issue #28; docs/muon_in_megatron.md, "Module map").
A profiler records the files of ours (``megatron/core/optimizer/``) whose functions run inside
``optimizer.step()``, not at construction. Reproduce by hand:

    .venv/bin/python -m pytest tests/distributed/test_muon_step_files.py -q -s
"""

import dataclasses
import os
import sys
import threading
from pathlib import Path

import pytest
from harness import run_distributed
from test_muon_distopt import BUCKET, MUON, distopts
from tiny_gpt import TinyGPT, build_model, build_optimizer, global_batches, train_step

OPT = Path(__file__).parents[2] / "megatron/core/optimizer"
# Our files, by path under megatron/core/optimizer/ ("megatron_muon/exchange.py", "muon.py", ...)
OURS = {p.relative_to(OPT).as_posix() for p in OPT.rglob("*.py")}

# The step's files in the common case: the optimizer (the DistOpt subclass and Muon), the math
# (the stages of a step, Newton-Schulz), the exchange. Before issue #28's cut: these and
# config, planner/plan, planner/cost_model and tp.
COMMON_STEP = {
    "megatron_muon/distrib_optimizer.py",
    "megatron_muon/optimizer.py",
    "megatron_muon/functional.py",
    "megatron_muon/newton_schulz.py",
    "megatron_muon/exchange.py",
}


def _record_step(optimizer, files: set) -> None:
    """Wrap ``optimizer.step``: add the file name of every function of ours it calls."""
    step = optimizer.step

    def profile(frame, event, arg):
        if event == "call":
            path = frame.f_code.co_filename.replace(os.sep, "/")
            _, found, name = path.rpartition("/megatron/core/optimizer/")
            if found and name in OURS:
                files.add(name)

    def recorded():
        threading.setprofile_all_threads(profile)  # gang collectives may run on a thread
        try:
            return step()
        finally:
            threading.setprofile_all_threads(None)

    optimizer.step = recorded


def _gangs(optimizer) -> None:
    """Plan with a low split target, by FLOPs alone: every large matrix splits over DP=2."""
    for distopt in distopts(optimizer):
        ortho = distopt.optimizer.orthogonalizer
        model = dataclasses.replace(
            ortho.plan.model, link_flops_per_byte=0.0, tp_link_flops_per_byte=0.0
        )
        plan = ortho.plan.rebuilt(model=model, targets=(0.1,), bundles=())
        assert any(len(m.units) > 1 for m in plan.matrices), "no matrix split"
        ortho.plan = distopt.muon_plan = plan
        ortho.gangs.make_groups(plan)


def _step_files(gangs: bool, precision: str) -> list[str]:
    """One real DistOpt Muon step on this rank; the files of ours it ran functions of."""
    spec = TinyGPT()
    model = build_model(spec, distopt=True, bucket_size=BUCKET, overlap_grad_reduce=True)
    muon = dict(MUON, muon_fp32_matmul_prec=precision)
    optimizer = build_optimizer(spec, model, use_distributed_optimizer=True, **muon)
    if gangs:
        _gangs(optimizer)
    files: set = set()
    _record_step(optimizer, files)
    train_step(spec, model, optimizer, global_batches(spec, 1)[0])
    assert sys.getprofile() is None
    return sorted(files)


def _files(world_size: int, tp: int = 1, gangs: bool = False, precision="highest") -> set:
    ranks = run_distributed(_step_files, world_size, tp=tp, args=(gangs, precision))
    files = set().union(*ranks)
    print(
        f"\nstep files (world {world_size}, tp {tp}, gangs {gangs}, {precision}): {sorted(files)}"
    )
    return files


# "highest": fp32 Newton-Schulz, owners return the scaled update; "medium" (the default): bf16
# Newton-Schulz, owners return it unscaled and holders scale (exchange.exchange_dtypes).
@pytest.mark.parametrize("precision", ["highest", "medium"])
def test_common_step_reads_the_optimizer_the_math_and_the_exchange(precision):
    assert _files(2, precision=precision) == COMMON_STEP


def test_tp_and_gangs_are_plug_ins_the_common_step_never_enters():
    """Negative controls: the same measurement sees tp.py at TP=2 and gangs.py with gangs."""
    assert _files(2, tp=2) - COMMON_STEP == {"megatron_muon/tp.py"}
    assert "megatron_muon/planner/gangs.py" in _files(2, gangs=True) - COMMON_STEP
