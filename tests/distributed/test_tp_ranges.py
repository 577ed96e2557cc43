"""``tp.reduce_scatter_ranges`` on 3 gloo ranks with uneven ranges: each rank's range ends as the
fp32 sum of every rank's partials, the rest of its tensor untouched; moving the partials in bf16
changes no bit where they are bf16 values (the gangs' packed Gram partials are), and does where
they are not (the negative control).

    .venv/bin/python -m pytest tests/distributed/test_tp_ranges.py -q
"""

import torch
from harness import run_distributed

N = 10  # 3 ranks: ranges of 3 / 3 / 4 elements, padded to 4 in the all-to-all
BOUNDS = [(0, 3), (3, 6), (6, 10)]


def _partial(rank: int, bf16_values: bool) -> torch.Tensor:
    """Rank ``rank``'s fp32 partial sum; ``bf16_values``: each element a bf16 value."""
    x = torch.randn(N, generator=torch.Generator().manual_seed(rank)) * (rank + 1)
    return x.bfloat16().float() if bf16_values else x


def _reduce(bf16_values: bool) -> dict:
    from megatron.core.optimizer.megatron_muon.tp import reduce_scatter_ranges

    group, rank = torch.distributed.group.WORLD, torch.distributed.get_rank()
    out = {}
    for name, dtype in (("fp32", None), ("bf16", torch.bfloat16)):
        flat = _partial(rank, bf16_values)
        reduce_scatter_ranges(flat, BOUNDS, rank, group, dtype)
        out[name] = flat
    return out


def _expected(rank: int, bf16_values: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s tensor after the call, its range's sum in float64; and the bound of the
    fp32 sum's error: two adds in any order and the rounding of the result, each within the
    unit roundoff 2^-24 of the sum of magnitudes."""
    out = _partial(rank, bf16_values).double()
    lo, hi = BOUNDS[rank]
    parts = torch.stack([_partial(q, bf16_values)[lo:hi].double() for q in range(3)])
    out[lo:hi] = parts.sum(0)
    return out, 3 * 2.0**-24 * parts.abs().sum(0)


def test_each_range_is_the_sum_and_bf16_partials_move_in_bf16_bit_for_bit():
    for rank, got in enumerate(run_distributed(_reduce, 3, args=(True,))):
        lo, hi = BOUNDS[rank]
        want, bound = _expected(rank, True)
        assert ((got["fp32"][lo:hi].double() - want[lo:hi]).abs() <= bound).all(), rank
        rest = torch.cat([got["fp32"][:lo], got["fp32"][hi:]]).double()
        assert torch.equal(rest, torch.cat([want[:lo], want[hi:]])), rank  # untouched
        assert torch.equal(got["bf16"], got["fp32"]), rank


def test_negative_control_partials_that_are_not_bf16_values_lose_bits_in_bf16():
    runs = run_distributed(_reduce, 3, args=(False,))
    assert all(not torch.equal(got["bf16"], got["fp32"]) for got in runs)
