"""The ``owner`` TP mode (tp.py): each TP-sharded Muon matrix is orthogonalized whole on exactly
one rank of TP x DP, and equals one process (TP 1) on every rank, with and without DistOpt; NS
runs once per matrix over the grid (counted matmul FLOPs of a real step). Reproduce by hand:

    .venv/bin/python -m pytest tests/distributed/test_muon_tp_owner.py -q
"""

import functools

import pytest
from harness import run_distributed
from parity import assert_close_runs, misses, update_rel_error, within
from test_muon_distopt import MatmulFlops, count_optimizer_step
from test_muon_parity import LOSS_RTOL, MUON, STEPS, TOL, WRONG, reference, swap_partition_dim
from tiny_gpt import TinyGPT, train

# TP 2 x DP 2 on 4 gloo ranks: plain DDP (each DP replica holds whole TP shards; owners over
# TP x DP, results all-gathered over DP) and DistOpt (owners over DP by the exchange, then TP).
CASES = {"ddp": False, "distopt": True}


@functools.cache
def _run(distopt: bool, hook=None) -> list:
    kwargs = {**MUON, "muon_tp_mode": "owner", "distopt": distopt, "optimizer_hook": hook}
    return run_distributed(train, 4, tp=2, args=(TinyGPT(), STEPS), kwargs=kwargs)


@pytest.mark.parametrize("case", CASES)
def test_owner_mode_matches_one_process_on_every_rank(case):
    """Every rank's gathered params after 3 steps equal TP 1's within test_muon_parity's TOL
    (fp32 NS; TP and DP only reorder fp32 sums, the owner runs NS on the very matrix TP 1 does,
    up to duplicated's row permutation: docs/tp_modes.md; measured ~7e-6)."""
    got = _run(CASES[case])
    ref = reference()
    assert_close_runs(ref, got, tol=TOL, loss_rtol=LOSS_RTOL)
    initial, exact, _ = ref
    for rank, (_, params, _) in enumerate(got):
        name, error = within(update_rel_error(initial, exact, params), TOL)
        assert error <= TOL, (rank, name, error)
    assert all((exact[k] - initial[k]).norm() > 0 for k in exact)


def test_owner_mode_negative_control_wrong_partition_dim_misses():
    """Owners that join the TP shards along the wrong dim orthogonalize another matrix: every
    rank misses TP 1 by far more than TOL (so the parity above is not vacuous)."""
    initial, exact, _ = reference()
    for _, params, _ in _run(False, swap_partition_dim):
        assert misses(update_rel_error(initial, exact, params), WRONG)


_COUNTERS: list = []


def _count(optimizer) -> None:
    counter = MatmulFlops()
    count_optimizer_step(optimizer, counter)
    _COUNTERS.append(counter)


def _step_flops(mode: str, distopt: bool) -> float:
    """Matmul FLOPs of this rank's optimizer step in one real training step (all Muon's NS)."""
    kwargs = {**MUON, "muon_tp_mode": mode, "optimizer_hook": _count, "distopt": distopt}
    train(TinyGPT(), 1, **kwargs)
    return _COUNTERS[-1].flops


def test_owner_mode_runs_newton_schulz_once_over_the_grid():
    """TinyGPT's 16 Muon matrices (4 of each shape) at TP 2 x DP 2: under plain DDP each rank
    runs exactly 1/4 of TP 1's NS FLOPs (``duplicated``: all of it, on every rank); with DistOpt
    the 4 ranks together run TP 1's total once (``duplicated``: twice, 1/2 per rank)."""
    (total,) = run_distributed(_step_flops, 1, args=("owner", False))
    assert total > 0
    assert run_distributed(_step_flops, 4, tp=2, args=("owner", False)) == [total / 4] * 4
    assert run_distributed(_step_flops, 4, tp=2, args=("duplicated", False)) == [total] * 4
    owner = run_distributed(_step_flops, 4, tp=2, args=("owner", True))
    duplicated = run_distributed(_step_flops, 4, tp=2, args=("duplicated", True))
    assert sum(owner) == total and sum(duplicated) == 2 * total
    assert max(owner) < max(duplicated)
