"""The log line's interval figures (megatron/training/log.py IntervalStats) count as Megatron-LM's
training_log does: ``number of nan iterations`` counts the skipped iterations (fp16 overflow)
whose loss was not finite, once per iteration; the losses average over the iterations that were
not skipped (a non-finite one shows as such, it is not counted as a nan iteration).

    .venv/bin/python -m pytest -q tests/unit/test_interval_stats.py
"""

import math

from megatron.training.log import IntervalStats

NAN, INF = float("nan"), float("inf")


def test_nan_iterations_are_skipped_iterations_with_a_non_finite_loss():
    stats = IntervalStats()
    stats.add({"lm loss": NAN, "mtp_1 loss": NAN}, skipped=True)  # one iteration, two keys
    stats.add({"lm loss": INF}, skipped=True)
    stats.add({"lm loss": 2.0}, skipped=True)  # skipped with a finite loss: not a nan iteration
    stats.add({"lm loss": 3.0, "mtp_1 loss": 1.0}, skipped=False)
    assert (stats.iterations, stats.skipped, stats.nan) == (4, 3, 2)
    assert stats.averages() == {"lm loss": 3.0, "mtp_1 loss": 1.0}


def test_a_non_finite_loss_of_an_applied_step_shows_in_the_average():
    stats = IntervalStats()
    stats.add({"lm loss": 3.0}, skipped=False)
    stats.add({"lm loss": NAN}, skipped=False)
    assert stats.nan == 0 and math.isnan(stats.averages()["lm loss"])
