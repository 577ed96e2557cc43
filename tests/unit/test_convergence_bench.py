"""bench/convergence.py's arithmetic: reaching a target loss, the schedule-matched figure, the lr
grid extension, and the counted parameters against a real run of the flags it passes, on
upstream's loop (base 0.19.2), read with the bench's own regexes of upstream's console.

Negative control (checked by hand): the old PARAMS regex (our loop's "number of parameters: N")
finds nothing in upstream's console and test_counted_params_match_a_real_run fails."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))

import convergence  # noqa: E402


def test_steps_to_reach_interpolates_between_evaluations():
    curve = [(10, 3.0), (20, 2.0), (30, 1.0)]
    assert convergence.steps_to_reach(curve, 1.5) == pytest.approx(25.0)
    assert convergence.steps_to_reach(curve, 3.5) == 10.0  # already there at the first point
    assert convergence.steps_to_reach(curve, 0.5) is None


def test_schedule_to_reach_is_exact_inside_and_a_bound_below():
    finals = [(240, 1.0), (108, 1.4), (156, 1.2)]  # unsorted on purpose
    steps, exact = convergence.schedule_to_reach(finals, 1.3)
    assert exact and steps == pytest.approx(132.0)  # halfway between 108 and 156
    assert convergence.schedule_to_reach(finals, 1.5) == (108.0, False)  # <= the shortest run
    assert convergence.schedule_to_reach(finals, 0.9)[0] is None


def test_lr_grid_grows_only_at_an_edge():
    assert convergence.next_lr([1e-3, 3e-3, 1e-2], 1e-2) == 3e-2
    assert convergence.next_lr([1e-3, 3e-3, 1e-2], 1e-3) == 3e-4
    assert convergence.next_lr([1e-3, 3e-3, 1e-2], 3e-3) is None
    assert convergence.next_lr([3e-3], 3e-3) is None  # one lr: nothing to bracket


def test_flops_count_newton_schulz_per_matrix():
    size = dict(convergence.QUICK)
    adam, muon = (convergence.flops_per_step(size, o) for o in ("adam", "muon"))
    assert adam["model"] == muon["model"]
    p = convergence.model_params(size)
    # One 128 x 64 fc1 (s=64, l=128) per layer among the Muon matrices, by hand:
    assert [2 * size["ffn"], size["hidden"]] in p["muon"]
    ns = sum(5 * (4 * min(m) ** 2 * max(m) + 2 * min(m) ** 3) for m in p["muon"])
    rest = p["total"] - sum(r * c for r, c in p["muon"])
    assert muon["optimizer"] == ns + 12 * rest
    assert adam["optimizer"] == 12 * p["total"]


def test_muon_recipe_is_the_seeds():
    """The bench runs our Muon with muon_recipe's flags, spelled out in MUON_RECIPE."""
    from megatron.training.muon_recipe import SEED_RECIPE_FLAGS

    assert convergence.MUON_RECIPE.split() == SEED_RECIPE_FLAGS


def test_log_regexes_read_upstreams_console():
    """Lines as upstream 0.19.2's training.py prints them (copied from a run)."""
    log = (
        " [2026-12-02 09:33:10.349287] iteration       50/     150 | consumed samples:"
        "         1600 | elapsed time per iteration (ms): 487.2 | learning rate: 2.491711E-03 |"
        " global batch size:    32 | lm loss: 2.430138E+00 | loss scale: 1.0 |\n"
        " validation loss at iteration 50 | lm loss value: 2.363831E+00 | lm loss PPL: 1.06E+01 |"
        "\n validation loss at iteration 150 on validation set | lm loss value: 2.05E+00 |\n"
        " > number of parameters on (tensor, gtp_weight_remat, pipeline) model parallel rank"
        " (0, 0, 0): 443520\n"
    )
    assert convergence.VALID.findall(log) == [("50", "2.363831E+00")]  # not the one after
    assert convergence.TIMED.findall(log) == [("50", "487.2")]
    assert convergence.PARAMS.search(log)[1] == "443520"


@pytest.mark.timeout(600)
def test_counted_params_match_a_real_run():
    """The count the FLOPs come from is the model the study's flags build: a short Muon run of
    the quick study's model on its data, launched and read by run_one (pretrain_gpt.py on
    upstream's loop, --full-validation on the held-out split at the last step: patch 0062),
    prints that many parameters. Without patch 0062 the run exits 1 (TypeError at the first
    evaluation); with our loop's console regexes parse_log finds nothing."""
    size = dict(convergence.QUICK)
    data = convergence.corpora(size, ["stdlib"])["stdlib"]  # built once under ~/.cache
    run = ("stdlib", "muon", 1e-2, 1234, 4)  # 4 steps: more than the warmup, then evaluated
    result = convergence.run_one(size, run, data, None)
    assert result["params"] == convergence.model_params(size)["total"]
    assert [it for it, _ in result["valid"]] == [4]
