"""--mtp-num-layers / --mtp-loss-scaling-factor: the built GPTModel's Multi-Token Prediction
layers, their loss reaching the backward with the configured weight, and the ``mtp_<k> loss``
figures averaged over data-parallel ranks (megatron/training/mtp_log.py).

    .venv/bin/python -m pytest -q tests/unit/test_mtp.py
"""

import pytest

from tests.harness import run_distributed
from tests.unit.test_model_flags import _build


def _reported(values_by_rank: list):
    """Each DP rank's tracker holds its sums over 2 micro-batches; what mtp_losses reports."""
    import torch
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    from megatron.training.mtp_log import mtp_losses

    rank = torch.distributed.get_rank()
    MTPLossLoggingHelper.tracker.clear()
    if values_by_rank[rank] is not None:
        MTPLossLoggingHelper.tracker["values"] = torch.tensor(values_by_rank[rank])
    reported = mtp_losses(2)
    left = MTPLossLoggingHelper.tracker.get("values")
    return reported, None if left is None else left.tolist()


def test_mtp_losses_average_micro_batches_and_data_parallel_ranks():
    results = run_distributed(_reported, 2, args=([[1.0, 3.0], [3.0, 5.0]],))
    # mtp_1: ((1 + 3) / 2 micro-batches) / 2 ranks = 1; mtp_2: (3 + 5) / 2 / 2 = 2
    assert results == [({"mtp_1 loss": 1.0, "mtp_2 loss": 2.0}, [0.0, 0.0])] * 2


def test_mtp_losses_without_mtp_layers_report_nothing():
    assert run_distributed(_reported, 1, args=([None],)) == [({}, None)]


def _mtp_facts(factor: float) -> dict:
    """Decoder gradients of the per-token LM loss of an MTP model against a model without MTP
    holding the same weights; the MTP loss enters through megatron-core's MTPLossAutoScaler."""
    import torch
    from megatron.core.transformer.multi_token_prediction import (
        MTPLossAutoScaler,
        MTPLossLoggingHelper,
    )

    common = "--position-embedding-type rope --attention-dropout 0 --hidden-dropout 0"
    _, plain = _build(common)
    _, mtp = _build(f"{common} --mtp-num-layers 2 --mtp-loss-scaling-factor {factor}")
    missing = mtp.load_state_dict(plain.state_dict(), strict=False).missing_keys
    gen = torch.Generator().manual_seed(0)
    tokens, labels = (torch.randint(0, 64, (2, 16), generator=gen) for _ in range(2))
    position_ids = torch.arange(16).expand(2, 16)
    MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    MTPLossLoggingHelper.tracker.clear()
    grads = []
    for model in (plain, mtp):
        model.train()  # no dropout (above): both see the same activations
        model(tokens, position_ids, None, labels=labels).sum().backward()
        grads.append(model.decoder.layers[0].self_attention.linear_qkv.weight.grad.clone())
    return {
        "layers": len(mtp.mtp.layers),
        "only_mtp_missing": all(k.startswith("mtp.") for k in missing) and bool(missing),
        "tracked": MTPLossLoggingHelper.tracker["values"].tolist(),
        "grad_diff": (grads[1] - grads[0]).abs().max().item(),
        "grad_scale": grads[0].abs().max().item(),
    }


@pytest.mark.parametrize("factor", [0.0, 0.5])
def test_mtp_layers_are_built_and_their_loss_reaches_the_backward(factor):
    facts = run_distributed(_mtp_facts, 1, args=(factor,))[0]
    assert facts["layers"] == 2 and facts["only_mtp_missing"]
    # two MTP losses near ln(128) at init (untrained, 64-token data in a 128-row vocabulary)
    assert len(facts["tracked"]) == 2 and all(3 < v < 6 for v in facts["tracked"])
    if factor == 0.0:  # weight 0: the decoder sees the LM loss only, as without MTP
        assert facts["grad_diff"] == 0.0
    else:  # the MTP losses back-propagate into the shared decoder
        assert facts["grad_diff"] > 1e-3 * facts["grad_scale"]
