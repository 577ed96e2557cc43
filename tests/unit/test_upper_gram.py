"""The sharded steps' Gram computed as its upper triangle in row blocks (``upper_gram``): the
same upper triangle as the whole product, the FLOPs counted, what the packing reads."""

import pytest
import torch
from test_newton_schulz import _randn, _sharded, reference_ns
from test_newton_schulz_gram import _MatmulFlops

from megatron.core.optimizer.megatron_muon import newton_schulz as ns


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of 4+ rows, so test-sized Grams are cut in several (70B's: 512+)."""
    monkeypatch.setattr(ns, "GRAM_BLOCK_ROWS", 4)


@pytest.mark.parametrize("g, lines", [(3, 5), (9, 7), (16, 5), (33, 20)])
@pytest.mark.parametrize("tall", [False, True])
def test_upper_triangle_equals_the_whole_product(small_blocks, g, lines, tall):
    """Integer entries in float64: every product and sum is exact, so the blocks' upper triangle
    is the whole product's bit for bit, from a wide matrix or a tall one's transposed view (the
    row shards' ``buf.mT``); the blocks cover ``[0, g)`` in order."""
    gen = torch.Generator().manual_seed(g)
    x = torch.randint(-9, 10, (lines, g) if tall else (g, lines), generator=gen).double()
    wide = x.mT if tall else x
    upper = tuple(torch.triu_indices(g, g))
    assert torch.equal(ns.upper_gram(wide)[upper], (wide @ wide.mT)[upper])
    blocks = ns.gram_blocks(g)
    assert blocks[0][0] == 0 and blocks[-1][1] == g
    assert all(a[1] == b[0] and b[1] - b[0] >= min(g, 4) for a, b in zip(blocks, blocks[1:]))


@pytest.mark.parametrize("g", [1, 2, 8, 33])
def test_packing_reads_the_upper_triangle_only(g):
    """``pack_symmetric`` of a matrix whose lower triangle holds NaN packs what the symmetric
    matrix packs (``upper_gram`` leaves the lower triangle unset). Negative control: its
    transpose, the NaN above, does not pack to finite values."""
    b = _randn((g, g))
    a = b + b.mT
    junk = a.clone()
    below = tuple(torch.tril_indices(g, g, -1))
    junk[below] = float("nan")
    assert torch.equal(ns.pack_symmetric(junk), ns.pack_symmetric(a))
    if g > 1:
        assert ns.pack_symmetric(junk.mT.contiguous()).isnan().any()


@pytest.mark.parametrize("g, lines", [(64, 10), (30, 7), (3, 4)])
def test_flop_count_is_what_runs(small_blocks, g, lines):
    """``upper_gram_flops`` is the counted matmul FLOPs; with k equal blocks it is ``(k + 1) /
    2k`` of the whole product's ``2 g^2 lines`` (64 = 16 blocks of 4: 17/32)."""
    with _MatmulFlops() as counter:
        ns.upper_gram(_randn((g, lines)))
    assert counter.flops == ns.upper_gram_flops(g, lines)
    if g == 64:
        assert 32 * ns.upper_gram_flops(g, lines) == 17 * 2 * g * g * lines


def test_one_block_below_twice_the_block_rows():
    """The real rule: a Gram under 1024 rows is one block (the whole product's FLOPs); 70B's
    8192-side Gram is 16 blocks of 512, 17/32 of them."""
    assert ns.gram_blocks(1023) == [(0, 1023)]
    assert ns.upper_gram_flops(1023, 5) == 2 * 1023**2 * 5
    assert len(ns.gram_blocks(8192)) == 16
    assert 32 * ns.upper_gram_flops(8192, 1) == 17 * 2 * 8192**2


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("shape, dim, cuts", [((40, 96), 1, [10, 60]), ((96, 40), 0, [30, 60])])
def test_sharded_steps_in_blocks_match_float64_reference(small_blocks, shape, dim, cuts, split):
    """Three shards, each Gram in 10 blocks of 4 rows, the polynomial whole or split: the
    shards' Newton-Schulz as ``test_newton_schulz``'s sharded tests check it (fp32, same
    tolerance)."""
    x = _randn(shape)
    got = _sharded(x, dim, cuts, False, split=split)
    torch.testing.assert_close(got.double(), reference_ns(x, "quintic", 5), rtol=0, atol=1e-5)
