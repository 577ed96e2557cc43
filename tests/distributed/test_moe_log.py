"""The MoE auxiliary-loss figures (megatron/training/moe_log.py) reduce as megatron-core's
track_moe_metrics does, on PP2 x DP2 gloo ranks with hand-placed tracker values.

Per rank the routers of its stage's layer would have added their per-micro-batch losses; here
each stage's layer gets a value that depends on the DP rank. load_balancing_loss (reduced over
its TP x CP group, without DP) is summed over the stages and averaged over DP; z_loss (no group)
is summed over the stages only, so each DP rank keeps its own. Both are then divided by the
micro-batches and the MoE layers. The reference below is that formula computed by hand; a
stage without MoE layers still joins with zeros (no hang), and a loss the flags turn off is left
out.

    .venv/bin/python -m pytest -q tests/distributed/test_moe_log.py
"""

from types import SimpleNamespace

import pytest
import torch
from harness import run_distributed

ARGS = dict(num_experts=2, num_layers=2, mtp_num_layers=None, moe_layer_freq=1)
MICRO = 4


def _value(stage: int, dp: int) -> float:
    return 1.0 + stage + 10.0 * dp  # exact in fp32


def _figures(kinds, z_coeff, stage_has_moe=True):
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    from megatron.core import parallel_state as ps
    from megatron.training import moe_log

    moe_log.start_step()
    stage, dp = ps.get_pipeline_model_parallel_rank(), ps.get_data_parallel_rank()
    tracker = get_moe_layer_wise_logging_tracker()
    tracker.clear()
    if stage_has_moe or stage == 0:
        for name, group in (("load_balancing_loss", ps.get_tensor_and_context_parallel_group()),):
            values = torch.zeros(2)
            values[stage] = _value(stage, dp)
            tracker[name] = dict(values=values, reduce_group=group, reduce_group_has_dp=False)
        values = torch.zeros(2)
        values[stage] = 0.5 * _value(stage, dp)
        tracker["z_loss"] = dict(values=values, reduce_group=None)
    args = SimpleNamespace(**ARGS, moe_router_load_balancing_type=kinds, moe_z_loss_coeff=z_coeff)
    return stage, dp, moe_log.moe_losses(args, MICRO, torch.device("cpu"))


def _expected(dp: int, stages) -> dict:
    lb = sum(_value(s, d) for s in stages for d in range(2)) / 2  # stages summed, DP mean
    z = sum(0.5 * _value(s, dp) for s in stages)  # this DP rank's own
    return {
        "load_balancing_loss": pytest.approx(lb / (MICRO * 2), rel=1e-6),
        "z_loss": pytest.approx(z / (MICRO * 2), rel=1e-6),
    }


def test_aux_losses_reduce_as_track_moe_metrics():
    out = run_distributed(_figures, 4, pp=2, args=(["aux_loss"], 1e-3))
    assert [figures for _, dp, figures in out] == [_expected(dp, range(2)) for _, dp, _ in out]


def test_a_stage_without_moe_layers_joins_with_zeros():
    """Its ranks hold no tracker entries (megatron-core force-initializes zeros, as here): the
    reductions still pair up, and the MoE stage's ranks get their layers' figures."""
    out = run_distributed(_figures, 4, pp=2, args=(["aux_loss"], 1e-3, False))
    assert [f for stage, _, f in out if stage == 0] == [
        _expected(dp, range(1)) for stage, dp, _ in out if stage == 0
    ]


def test_losses_the_flags_turn_off_are_left_out():
    out = run_distributed(_figures, 2, args=(["seq_aux_loss"], None))
    assert all(figures == {} for _, _, figures in out)  # no z-loss; seq loss never recorded
