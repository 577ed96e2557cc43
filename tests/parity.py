"""Comparing a distributed run with the one-process reference."""

import json
import math
import os

import torch

# Margin measurements (issue 26): with PARITY_REPORT=FILE every check appends one JSON line,
# {"test", "kind", "param", "error", "bound"}; tools/parity_margins.py runs the parity files under
# other summation orders and prints the worst error / bound per test.
REPORT = os.environ.get("PARITY_REPORT")


def record(kind: str, name: str, error: float, bound: float) -> None:
    if not REPORT:
        return
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0]
    row = dict(test=test, kind=kind, param=name, error=error, bound=bound)
    with open(REPORT, "a") as f:
        f.write(json.dumps(row) + "\n")


def update_rel_error(initial: dict, ref: dict, got: dict, pool_vectors: bool = False) -> dict:
    """Per param: ||got - ref|| / ||ref - initial||, the error relative to what training changed.

    Relative to the *update* rather than the weight, so a tolerance means the same thing whatever
    the learning rate and number of steps; Frobenius norms, so the few coordinates whose tiny
    gradients flip sign under another fp32 summation order (Adam turns them into +-lr) weigh in
    proportion to their number, not as a max.

    ``pool_vectors``: the 1-D params (norms, biases) count as one vector, ``VECTORS``. In bf16 a
    gradient differs between layouts by ~1e-2 (bf16 partial sums), which flips the sign-like
    early Adam steps of a few percent of the coordinates; each flip moves the error of a 64-element
    norm weight by ~0.08 over 3 steps, so one such vector's error is a count of a few flips, spread
    0.03-0.2 over the norms of one run (measured), and its worst is an outlier another CPU moves.
    Pooled, the same flips are averaged over all norms: the fraction flipped, the quantity the
    model and the bf16 rounding set.
    """
    assert set(ref) == set(got), f"param names differ: {sorted(set(ref) ^ set(got))}"
    pooled = [k for k in ref if pool_vectors and ref[k].dim() == 1]
    errors = {k: _rel(initial, ref, got, [k]) for k in ref if k not in pooled}
    return {**errors, VECTORS: _rel(initial, ref, got, pooled)} if pooled else errors


VECTORS = "1-D params, pooled"


def _rel(initial: dict, ref: dict, got: dict, names: list) -> float:
    diff = sum((got[k] - ref[k]).float().norm() ** 2 for k in names)
    step = sum((ref[k] - initial[k]).float().norm() ** 2 for k in names)
    return (diff.sqrt() / step.sqrt()).item()


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
    name, error = worst(errors)
    record("control", name, error, bound)
    return not error <= bound


def within(errors: dict, bound: float) -> tuple:
    """The worst (name, error) pair, recorded as a parity check against ``bound``."""
    name, error = worst(errors)
    record("parity", name, error, bound)
    return name, error


def grad_rel_error(ref: dict, got: dict) -> dict:
    """Per param: ||got - ref|| / ||ref|| (grads: no initial value to measure a change from)."""
    assert set(ref) == set(got) and ref, f"params differ: {sorted(set(ref) ^ set(got))}"
    return {k: ((got[k] - ref[k]).norm() / ref[k].norm()).item() for k in ref}


def assert_close_step(ref: tuple, got: tuple, *, grad_tol, step_tol, loss_rtol) -> None:
    """One rank's (initial params, grads, params after one step, loss) against the reference's:
    the same initial params; grads, updates and the loss each within its relative tolerance."""
    initial, ref_grads, ref_params, ref_loss = ref
    rank_initial, grads, params, loss = got
    assert all(torch.equal(rank_initial[k], initial[k]) for k in initial), "init differs"
    name, error = within(grad_rel_error(ref_grads, grads), grad_tol)
    assert error <= grad_tol, f"{name}: grad rel. error {error:.2e} > {grad_tol:.0e}"
    name, error = within(update_rel_error(initial, ref_params, params), step_tol)
    assert error <= step_tol, f"{name}: update rel. error {error:.2e} > {step_tol:.0e}"
    record("loss", "loss", abs(loss - ref_loss) / abs(ref_loss), loss_rtol)
    assert abs(loss - ref_loss) <= loss_rtol * abs(ref_loss), f"loss {loss} vs {ref_loss}"


def last_stage_losses(results: list) -> list:
    """The loss sequence of any last-stage rank (others report nan)."""
    for _, _, losses in results:
        if not any(math.isnan(x) for x in losses):
            return losses
    raise AssertionError("no rank reported losses")


def assert_close_runs(ref_result, results, *, tol: float, loss_rtol: float, pool_vectors=False):
    initial, ref, ref_losses = ref_result
    for rank_initial, _, _ in results:
        assert all(torch.equal(rank_initial[k], initial[k]) for k in initial), "init not invariant"
    errors = update_rel_error(initial, ref, results[0][1], pool_vectors)
    name, error = within(errors, tol)
    assert error <= tol, f"{name}: update rel. error {error:.2e} > {tol:.0e}"
    losses, ref_losses = torch.tensor(last_stage_losses(results)), torch.tensor(ref_losses)
    record("loss", "loss", ((losses - ref_losses).abs() / ref_losses.abs()).max().item(), loss_rtol)
    torch.testing.assert_close(losses, ref_losses, rtol=loss_rtol, atol=0)
    return errors


def split_key_bias(snapshot: dict, groups: int, heads: int) -> tuple:
    """(snapshot with each ``linear_qkv.bias`` cut to its query and value rows, the key rows).

    The key bias's gradient is zero in exact arithmetic (``q . b_k`` adds the same value to every
    logit of a query, which a softmax ignores), so fp32 computes rounding noise of ~1e-8, the size
    of Adam's eps, and ``g / (sqrt(v) + eps)`` turns it into steps of up to lr: the key bias moves
    as far as the other biases, by an amount the summation order alone decides (measured: 100x the
    relative error of the query and value rows, and 4x apart on another CPU). Its rows can only be
    held to Adam's step bound; the query and value rows keep the parity tolerance.

    Args:
        snapshot: per param name, its full (TP-gathered) tensor.
        groups: query groups; each group's rows are [its query heads, key, value].
        heads: attention heads.
    """
    qv, keys = dict(snapshot), {}
    for name, bias in snapshot.items():
        if name.endswith("linear_qkv.bias"):
            rows = bias.view(groups, heads // groups + 2, -1)
            keys[name] = rows[:, -2].reshape(-1)
            qv[name] = torch.cat([rows[:, :-2], rows[:, -1:]], dim=1).reshape(-1)
    return qv, keys


def first_difference(results, others):
    """The first (rank, param) whose params differ in any bit between two runs of one layout
    (``run_distributed``'s results, rank by rank), or None where every rank's are identical."""
    assert len(results) == len(others)
    for rank, ((_, params, _), (_, other, _)) in enumerate(zip(results, others)):
        assert params.keys() == other.keys(), rank
        for name in params:
            if not torch.equal(params[name], other[name]):
                return rank, name
    return None
