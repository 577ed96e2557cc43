"""torch's SGD under a torch_dcp resume (``fsdp_checkpoint.sgd_momentum_for_loading``).

torch creates SGD's ``momentum_buffer`` at the first step, so the state dict a fresh optimizer
offers DCP to load into has no key for it: the checkpoint's momentum was silently not loaded,
and the resumed run stepped as if from scratch. A zero buffer is allocated first; DCP overwrites
it. Where a checkpoint has none, the zero buffer must step as torch's lazy one does. The
upstream-form test (tests/unit_tests/dist_checkpointing/test_torch_dcp_chained_optimizer_load.py)
runs the same through ``load_checkpoint`` under FSDP2 on 2 ranks.
"""

import pytest
import torch
import torch.distributed.checkpoint as dcp

from megatron.training.fsdp_checkpoint import sgd_momentum_for_loading


def _trained(nesterov=False, steps=2):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=nesterov)
    for _ in range(steps):
        sgd.zero_grad()
        model(torch.randn(5, 4)).square().sum().backward()
        sgd.step()
    return model, sgd


def _momentum(sgd) -> list:
    return [sgd.state[p].get("momentum_buffer") for g in sgd.param_groups for p in g["params"]]


@pytest.mark.parametrize("allocate", [True, False], ids=["allocated", "control"])
def test_sgd_momentum_survives_a_dcp_round_trip(tmp_path, allocate):
    _, sgd = _trained()
    dcp.save(sgd.state_dict(), checkpoint_id=str(tmp_path))
    model = torch.nn.Linear(4, 3)
    fresh = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if allocate:
        sgd_momentum_for_loading(fresh)
    template = fresh.state_dict()
    dcp.load(template, checkpoint_id=str(tmp_path))
    fresh.load_state_dict(template)
    if allocate:
        for loaded, saved in zip(_momentum(fresh), _momentum(sgd)):
            assert torch.equal(loaded, saved)
    else:  # upstream's: nothing to load into, the momentum is lost without a word
        assert _momentum(fresh) == [None, None]


@pytest.mark.parametrize("nesterov", [False, True])
def test_a_zero_buffer_steps_as_torchs_lazy_one(nesterov):
    lazy_model, lazy = _trained(nesterov, steps=0)
    zero_model, zero = _trained(nesterov, steps=0)
    sgd_momentum_for_loading(zero)
    for model, sgd in ((lazy_model, lazy), (zero_model, zero)):
        torch.manual_seed(1)
        for _ in range(3):
            sgd.zero_grad()
            model(torch.randn(5, 4)).square().sum().backward()
            sgd.step()
    for a, b in zip(lazy_model.parameters(), zero_model.parameters()):
        assert torch.equal(a, b)  # bit for bit: 0 * momentum + grad is grad
    for a, b in zip(_momentum(lazy), _momentum(zero)):
        assert torch.equal(a, b)


def test_no_buffer_where_a_zero_one_would_step_differently():
    model = torch.nn.Linear(4, 3)
    plain = torch.optim.SGD(model.parameters(), lr=0.1)  # no momentum: no buffer
    damped = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, dampening=0.5)
    for sgd in (plain, damped):
        sgd_momentum_for_loading(sgd)
        assert _momentum(sgd) == [None, None]
