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


def worst(errors: dict) -> tuple:
    """(name, error) of the largest error, a NaN first: ``max`` skips a NaN that is not the
    first value it sees (NaN compares False), so a param whose update went NaN would hide behind
    the finite errors of the others.

    Args:
        errors: per param, its error (``update_rel_error``).

    Returns:
        The worst (name, error) pair.
    """
    nan = [(k, e) for k, e in errors.items() if math.isnan(e)]
    return nan[0] if nan else max(errors.items(), key=lambda kv: kv[1])


def misses(errors: dict, bound: float) -> bool:
    """A negative control's verdict: some param's error is NaN or above ``bound``."""
    return not worst(errors)[1] <= bound


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
    name, error = worst(errors)
    assert error <= tol, f"{name}: update rel. error {error:.2e} > {tol:.0e}"
    torch.testing.assert_close(
        torch.tensor(last_stage_losses(results)), torch.tensor(ref_losses), rtol=loss_rtol, atol=0
    )
    return errors
