"""The planner's searches choose what full scans choose (``planner/placement.py``): the
least-loaded ranks found by load alone plus the holders, and the spare ranks handed out from
heaps. Against the scans they replace, written out here; plans at projection scale stay the
same (``test_muon_plan_random`` checks the plans' invariants, ``test_bench`` their figures).

    .venv/bin/python -m pytest tests/unit/test_placement_search.py -q
"""

import random
import sys
from pathlib import Path

import pytest

from megatron.core.optimizer.megatron_muon.planner import placement

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import projection  # noqa: E402


def _full_sort(ranks, k: int, loads: list, held: dict) -> list:
    return sorted(ranks, key=lambda r: (loads[r], -held.get(r, (0, 0))[1], r))[:k]


@pytest.mark.parametrize("seed", range(4))
def test_fewest_is_the_full_sort(seed):
    """Loads from 4 values (many ties), a few holders (some of 0 elements), the whole group or
    one node's ranks: ``_fewest`` gives the full sort's first ``k``. Negative control: the
    holders left out of the pool miss it where one ties past the first ``k`` by load."""
    rng = random.Random(seed)
    missed = 0
    for _ in range(300):
        world = rng.randint(1, 40)
        loads = [float(rng.randint(0, 3)) for _ in range(world)]
        picked = rng.sample(range(world), rng.randint(0, min(4, world)))
        held = {r: (0, rng.randint(0, 5)) for r in picked}
        ranks = range(world) if rng.random() < 0.5 else tuple(range(0, world, 2))
        k = rng.randint(1, max(1, len(ranks)))
        assert placement._fewest(ranks, k, loads, held) == _full_sort(ranks, k, loads, held)
        by_load = sorted(ranks, key=loads.__getitem__)[:k]
        missed += _full_sort(by_load, k, loads, held) != _full_sort(ranks, k, loads, held)
    assert missed > 0


def _scan_spread(runs_of: placement._Runs, runs: list, spare: int) -> None:
    """``_Runs._spread`` as a scan of every run per spare rank (the search it replaced)."""
    r = runs_of
    while spare:
        load, n = max((r.load(ids, k), n) for n, (ids, k) in enumerate(runs))
        ids, k = runs[n]
        if k >= r.most_ranks(ids) or r.load(ids, k + 1) >= load:
            break
        runs[n][1], spare = k + 1, spare - 1
    bound = max((r.load(ids, k) for ids, k in runs), default=0.0)
    while spare:
        grow = []
        for n, (ids, k) in enumerate(runs):
            bigger = [s for s in r.sizes(r.most_ranks(ids)) if s > k]
            if not bigger or bigger[0] - k > spare or r.load(ids, bigger[0]) > bound:
                continue
            if r.load(ids, bigger[0], link=False) < r.load(ids, k, link=False):
                grow.append((r.load(ids, k, link=False), n, bigger[0]))
        if not grow:
            return
        _, n, k2 = max(grow)
        spare -= k2 - runs[n][1]
        runs[n][1] = k2


@pytest.mark.parametrize("name,dp,mode", [("1B", 256, "duplicated"), ("8B", 96, "duplicated")])
def test_spread_grows_the_runs_a_scan_grows(name, dp, mode):
    """Runs covering the matrices under bounds from the tightest that fits to the loosest,
    1-3 matrices per gang, 8 ranks per node: the heaps hand the spare ranks to the runs the
    scan does; some bounds leave ranks spare."""
    nodes = tuple(r // 8 for r in range(dp))
    model = projection.cost_model(1, mode, nodes=nodes)
    params = projection.model_params(*projection.MODELS[name])
    buckets = projection.byte_level(params, dp, projection.ddp_bucket_size(dp))
    plan = projection.build_plan(params, buckets, dp, model)
    works = [plan._work(plan.matrices[i]) for i in plan.exchanges[0].matrices]
    grown = 0
    for most in (1, 2, 3):
        runs_of = placement._Runs(works, dp, model, most)
        lo = sum(w.cost for w in works) / dp
        for scale in (1.0, 1.2, 1.5, 2.0, 3.0, 6.0):
            need, runs = runs_of.cover(lo * scale)
            if need > dp:
                continue
            ours, scanned = [list(run) for run in runs], [list(run) for run in runs]
            runs_of._spread(ours, dp - int(need))
            _scan_spread(runs_of, scanned, dp - int(need))
            assert ours == scanned
            grown += ours != [list(run) for run in runs]
    assert grown > 0
