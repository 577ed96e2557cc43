"""The MoE auxiliary-loss figures (megatron/training/moe_log.py) reduce as megatron-core's
track_moe_metrics does, on PP2 x DP2 gloo ranks with hand-placed tracker values.

Per rank the routers of its stage's layer would have added their per-micro-batch losses; here
each stage's layer gets a value that depends on the DP rank. load_balancing_loss (reduced over
its TP x CP group, without DP) is summed over the stages and averaged over DP; z_loss (no group)
is summed over the stages only, so each DP rank keeps its own. Both are then divided by the
micro-batches and the MoE layers. The reference below is that formula computed by hand; a
stage without MoE layers still joins with zeros (no hang), and a loss the flags turn off is left
out. --moe-per-layer-logging's figures (``moe/<name>_layer_<i>``, for TensorBoard) are the same
reductions per layer, divided by the micro-batches only, checked in the same launches.

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


def _figures(kinds, z_coeff, stage_has_moe=True, per_layer=True):
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
    args.moe_per_layer_logging = per_layer
    figures = moe_log.moe_losses(args, MICRO, torch.device("cpu"))
    return stage, dp, figures, moe_log.per_layer_figures()


def _expected(dp: int, stages) -> dict:
    lb = sum(_value(s, d) for s in stages for d in range(2)) / 2  # stages summed, DP mean
    z = sum(0.5 * _value(s, dp) for s in stages)  # this DP rank's own
    return {
        "load_balancing_loss": pytest.approx(lb / (MICRO * 2), rel=1e-6),
        "z_loss": pytest.approx(z / (MICRO * 2), rel=1e-6),
    }


def _expected_per_layer(dp: int, stages) -> dict:
    """--moe-per-layer-logging: each layer's reduced loss over the micro-batches (layers of
    ``stages`` hold MoE values, the others 0), as track_moe_metrics writes it."""
    lb = [sum(_value(s, d) for d in range(2)) / 2 if s in stages else 0.0 for s in range(2)]
    z = [0.5 * _value(s, dp) if s in stages else 0.0 for s in range(2)]
    figures = {f"moe/load_balancing_loss_layer_{i}": v / MICRO for i, v in enumerate(lb)}
    figures.update({f"moe/z_loss_layer_{i}": v / MICRO for i, v in enumerate(z)})
    return {k: pytest.approx(v, rel=1e-6) for k, v in figures.items()}


def test_aux_losses_reduce_as_track_moe_metrics():
    out = run_distributed(_figures, 4, pp=2, args=(["aux_loss"], 1e-3))
    assert [figures for _, dp, figures, _ in out] == [_expected(dp, range(2)) for _, dp, *_ in out]
    assert [layers for *_, layers in out] == [
        _expected_per_layer(dp, range(2)) for _, dp, *_ in out
    ]
    # the layer average the console prints is the mean of the per-layer figures
    assert all(
        f[k] == pytest.approx((layers[f"moe/{k}_layer_0"] + layers[f"moe/{k}_layer_1"]) / 2)
        for *_, f, layers in out
        for k in f
    )


def test_a_stage_without_moe_layers_joins_with_zeros():
    """Its ranks hold no tracker entries (megatron-core force-initializes zeros, as here): the
    reductions still pair up, and the MoE stage's ranks get their layers' figures."""
    out = run_distributed(_figures, 4, pp=2, args=(["aux_loss"], 1e-3, False))
    first = [(dp, f, layers) for stage, dp, f, layers in out if stage == 0]
    assert [f for _, f, _ in first] == [_expected(dp, range(1)) for dp, _, _ in first]
    assert [layers for _, _, layers in first] == [
        _expected_per_layer(dp, [0]) for dp, _, _ in first
    ]


def test_losses_the_flags_turn_off_are_left_out():
    out = run_distributed(_figures, 2, args=(["seq_aux_loss"], None, True, False))
    # no z-loss; seq loss never recorded; no per-layer figures without --moe-per-layer-logging
    assert all(figures == {} and layers == {} for _, _, figures, layers in out)
