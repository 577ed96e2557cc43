"""Muon's elementwise half (``functional.muon_momentum_``, ``muon_apply_``): foreach ops over the
whole list, bit for bit what the per-tensor ops give, in a constant number of kernels.

    .venv/bin/python -m pytest -q tests/unit/test_muon_elementwise.py
"""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from dispatch_count import DispatchCounter  # noqa: E402

from megatron.core.optimizer.megatron_muon.functional import (  # noqa: E402
    muon_apply_,
    muon_momentum_,
)

SHAPES = [(8, 16), (16, 16), (3, 5)]
F32, BF16 = torch.float32, torch.bfloat16


def per_tensor_momentum(params, grads, bufs, momentum, nesterov, l2):
    """The per-tensor loop the foreach form replaced (the reference)."""
    updates = []
    for p, g, buf in zip(params, grads, bufs):
        if l2:
            g = g.add(p, alpha=l2)
        b = buf.to(p.dtype)
        b.mul_(momentum).add_(g)
        if b is not buf:
            buf.copy_(b)
        updates.append(g.add(b, alpha=momentum) if nesterov else b)
    return updates


def _lists(param, state, grad, seed=0):
    g = torch.Generator().manual_seed(seed)
    make = lambda dtype: [torch.randn(s, generator=g).to(dtype) for s in SHAPES]  # noqa: E731
    return make(param), make(grad), make(state)


# (param, state, grad) dtypes: fp32 (Megatron's main params), bf16 throughout (its CPU foreach
# rounds a scalar factor to bf16 first: the per-tensor mul stays), narrower and wider state
@pytest.mark.parametrize("dtypes", [(F32, F32, F32), (BF16, BF16, BF16), (F32, BF16, F32),
                                    (BF16, F32, BF16)])  # fmt: skip
@pytest.mark.parametrize("nesterov,l2", [(False, 0.0), (True, 0.1)])
def test_momentum_and_apply_are_bitwise_the_per_tensor_ops(dtypes, nesterov, l2):
    params, grads, bufs = _lists(*dtypes)
    ref_bufs = [b.clone() for b in bufs]
    want = per_tensor_momentum(params, grads, ref_bufs, 0.95, nesterov, l2)
    got = muon_momentum_(params, grads, bufs, momentum=0.95, nesterov=nesterov, l2_weight_decay=l2)
    assert all(torch.equal(a, b) for a, b in zip(got + bufs, want + ref_bufs))
    ref = [p.clone() for p in params]
    for p, o in zip(ref, grads):
        p.mul_(1 - 0.01 * 0.1).add_(o, alpha=-0.01)
    muon_apply_(params, grads, lr=0.01, weight_decay=0.1)
    assert all(torch.equal(a, b) for a, b in zip(params, ref))


@pytest.mark.parametrize("count", [3, 30])
def test_fp32_lists_take_a_constant_number_of_kernels(count):
    """Momentum (Nesterov, L2) and the update of ``count`` fp32 matrices: 6 foreach kernels
    whatever the count; the per-tensor loop took 4 (momentum) + 2 (update) per matrix."""
    g = torch.Generator().manual_seed(0)
    params, grads, bufs = ([torch.randn(4, 4, generator=g) for _ in range(count)] for _ in "pgb")
    with DispatchCounter() as counter:
        muon_momentum_(params, grads, bufs, momentum=0.9, nesterov=True, l2_weight_decay=0.1)
        muon_apply_(params, grads, lr=0.01, weight_decay=0.1)
    assert counter.counts.kernels == 6, counter.counts.by_op
