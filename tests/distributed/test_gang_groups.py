"""The gangs' process groups and a failing rank on real gloo ranks (planner/gangs.py): groups of
overlapping gangs made once, each summing over its members only; an error on a rank's main
thread raised while its posted collective still waits for its peer. Reproduce by
hand:

    .venv/bin/python -m pytest tests/distributed/test_gang_groups.py -q
"""

import os
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from harness import run_distributed

from megatron.core.optimizer.megatron_muon.exchange import Block, Exchange, Unit
from megatron.core.optimizer.megatron_muon.newton_schulz import SUM
from megatron.core.optimizer.megatron_muon.planner.gangs import GangRunner

# Stacked gangs sharing ranks in every way at DP=3: a rank in more of the earlier gangs holds
# more groups, which torch's group names count (docs/gangs.md, "Groups, once").
GANGS = [(0, 1), (1, 2), (0, 2), (0, 1, 2), (0, 1)]


def _plan(gangs: list[tuple]) -> SimpleNamespace:
    """The parts of a ``MuonExchangePlan`` the runner reads: one exchange over the world."""
    group = torch.distributed.group.WORLD
    slots = [
        SimpleNamespace(units=[Unit(m, Block(0, 1, 0, 1), 0.0, gang) for m in gang])
        for gang in gangs
    ]
    ex = Exchange(group, [], list(range(len(gangs))), gangs=list(range(len(gangs))))
    rank = torch.distributed.get_rank()
    return SimpleNamespace(
        exchanges=[ex], matrices=slots, rank=rank, model=SimpleNamespace(nodes=())
    )


def _sums_over_each_gang() -> list:
    plan = _plan(GANGS)
    runner = GangRunner(None)
    runner.make_groups(plan)
    runner.make_groups(plan)  # again (a re-plan with the same gangs): nothing new
    ranks = list(range(torch.distributed.get_world_size()))
    got = []
    for gang in dict.fromkeys(GANGS):
        if plan.rank not in gang:
            assert runner.groups[gang] is None
            continue
        t = torch.tensor([float(10**plan.rank)])
        torch.distributed.all_reduce(t, group=runner._group(ranks, gang))
        got.append((gang, t.item()))
    return got


def test_groups_of_overlapping_gangs_sum_over_their_members():
    """Each gang's all-reduce sums its members' values only (10^rank: which ranks took part
    shows in the digits). Without the one-rank groups non-members make, these gangs hang at
    creation (seen by hand on gloo)."""
    for rank, got in enumerate(run_distributed(_sums_over_each_gang, 3, timeout=60)):
        want = [(g, float(sum(10**r for r in g))) for g in dict.fromkeys(GANGS) if rank in g]
        assert got == want


def _fail_while_posted(flag: str):
    """Rank 0 posts a gang sum and fails; rank 1 joins the sum only once rank 0 has raised
    (``flag`` written), so a rank 0 that waited in Python for the sum would never raise."""
    plan = _plan([(0, 1)])
    runner = GangRunner(None)
    runner.make_groups(plan)
    runner.plan = plan
    group = runner._group([0, 1], (0, 1))
    t = torch.ones(4)
    if plan.rank == 1:
        deadline = time.monotonic() + 60
        while not os.path.exists(flag) and time.monotonic() < deadline:
            time.sleep(0.05)
        raised = os.path.exists(flag)
        torch.distributed.all_reduce(t, group=group)  # completes rank 0's posted sum either way
        return raised, t.tolist()

    def unit():
        yield SUM, t

    def failing():
        raise RuntimeError("out of memory")
        yield  # a generator function

    serve = [{SUM: lambda x: runner._gang_sum(group, (0, 1), None, None, None, x)}, {}]
    try:
        runner._interleave([unit(), failing()], serve, [(0, 1), (0, 1)])
    except RuntimeError as err:
        Path(flag).write_text(str(err))
        return str(err)
    return None


def test_an_error_is_raised_while_a_posted_collective_waits_for_its_peer(tmp_path):
    """Rank 0 posts a gang sum, then fails: it raises before its peer joins the sum (nothing in
    Python waits: the peer joins only after the error); the peer then completes the sum with
    rank 0's part, and both processes end (gloo's group waits for the posted work at exit)."""
    failed, (raised, summed) = run_distributed(
        _fail_while_posted, 2, args=(str(tmp_path / "raised"),), timeout=120
    )
    assert failed == "out of memory" and raised
    assert summed == [2.0] * 4
