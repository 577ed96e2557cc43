"""Comparing a distributed run with the one-process reference."""

import math

import torch


def update_rel_error(initial: dict, ref: dict, got: dict) -> dict:
    """Per param: ||got - ref|| / ||ref - initial||, the error relative to what training changed.

    Relative to the *update* rather than the weight, so a tolerance means the same thing whatever
    the learning rate and number of steps; Frobenius norms, so the few coordinates whose tiny
    gradients flip sign under another fp32 summation order (Adam turns them into +-lr) weigh in
    proportion to their number, not as a max.
    """
    assert set(ref) == set(got), f"param names differ: {sorted(set(ref) ^ set(got))}"
    return {k: ((got[k] - ref[k]).norm() / (ref[k] - initial[k]).norm()).item() for k in ref}


def last_stage_losses(results: list) -> list:
    """The loss sequence of any last-stage rank (others report nan)."""
    for _, _, losses in results:
        if not any(math.isnan(x) for x in losses):
            return losses
    raise AssertionError("no rank reported losses")


def assert_close_runs(ref_result, results, *, tol: float, loss_rtol: float):
    initial, ref, ref_losses = ref_result
    for rank_initial, _, _ in results:
        assert all(torch.equal(rank_initial[k], initial[k]) for k in initial), "init not invariant"
    errors = update_rel_error(initial, ref, results[0][1])
    worst = max(errors, key=errors.get)
    assert errors[worst] <= tol, f"{worst}: update rel. error {errors[worst]:.2e} > {tol:.0e}"
    torch.testing.assert_close(
        torch.tensor(last_stage_losses(results)), torch.tensor(ref_losses), rtol=loss_rtol, atol=0
    )
    return errors
