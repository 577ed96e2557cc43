"""A ChainedOptimizer's sub-optimizers (dense, expert) keep one loss scale under fp16 overflow.

.venv/bin/python -m pytest tests/unit/test_chained_grad_scaler.py -q
"""

import pytest
from megatron.core.optimizer.grad_scaler import DynamicGradScaler

from megatron.core.optimizer.repairs.chained_grad_scaler import prepare_grads_with_one_scale


class Sub:
    """A Megatron optimizer's prepare_grads: updates its own scaler with its own verdict."""

    def __init__(self, found_inf: bool, scaler=None):
        self.found_inf, self.grad_scaler = found_inf, scaler

    def prepare_grads(self) -> bool:
        if self.grad_scaler is not None:
            self.grad_scaler.update(self.found_inf)
        return self.found_inf


def scaler(scale=1024.0):
    return DynamicGradScaler(scale, 1.0, 2.0, 0.5, growth_interval=2, hysteresis=1)


def state(s) -> tuple:
    return s.scale.item(), s._growth_tracker, s._hysteresis_tracker


# (dense found inf, expert found inf) -> (the chain's verdict, the one scale after)
CASES = {
    "none": ((False, False), (False, 1024.0)),
    "dense_only": ((True, False), (True, 512.0)),
    "expert_only": ((False, True), (True, 512.0)),  # 0.16.1: dense 1024, expert 512
    "both": ((True, True), (True, 512.0)),
}


@pytest.mark.parametrize("case", CASES)
def test_every_scaler_takes_the_chains_verdict(case):
    (dense_inf, expert_inf), (verdict, scale) = CASES[case]
    dense, expert = Sub(dense_inf, scaler()), Sub(expert_inf, scaler())
    assert prepare_grads_with_one_scale([dense, expert]) is verdict
    assert state(dense.grad_scaler) == state(expert.grad_scaler)
    assert dense.grad_scaler.scale.item() == scale


def test_growth_intervals_stay_in_step():
    """Two finite steps grow the scale (interval 2) in both, also after an expert-only inf."""
    dense, expert = Sub(False, scaler()), Sub(True, scaler())
    prepare_grads_with_one_scale([dense, expert])
    expert.found_inf = False
    for _ in range(2):
        assert not prepare_grads_with_one_scale([dense, expert])
    assert state(dense.grad_scaler) == state(expert.grad_scaler) == (1024.0, 0, 1)


def test_scales_that_differ_at_start_follow_the_first():
    """The first optimizer's scale scaled the loss; a resumed expert scaler that differs (a
    checkpoint of 0.16.1) takes it before the unscale."""
    dense, expert = Sub(False, scaler(1024.0)), Sub(False, scaler(256.0))
    seen = []
    expert.prepare_grads = lambda: seen.append(expert.grad_scaler.scale.item()) or False
    prepare_grads_with_one_scale([dense, expert])
    assert seen == [1024.0] and state(expert.grad_scaler) == state(dense.grad_scaler)


def test_without_loss_scaling_the_verdicts_are_ored():
    assert prepare_grads_with_one_scale([Sub(False), Sub(True)])
    assert not prepare_grads_with_one_scale([Sub(False), Sub(False)])
