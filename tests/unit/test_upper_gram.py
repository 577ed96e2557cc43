"""The sharded steps' Gram computed as its upper triangle in row blocks (``upper_gram``): the
same upper triangle as the whole product, the FLOPs counted, what the packing reads."""

import functools
import threading

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


@pytest.mark.parametrize("g, lines", [(64, 10), (33, 20), (9, 7)])
@pytest.mark.parametrize("precision", ["highest", "medium"])
def test_staged_gram_is_the_packed_upper_gram_in_chunks(small_blocks, g, lines, precision):
    """A staged Gram (``staged_gram``): its chunks tile the packed vector in order
    (``staged_size``, ``packed_size(g)`` in all), each chunk's matmul FLOPs are
    ``staged_gram_flops`` (``upper_gram_flops`` in all), and unpacked it is bit for bit the
    unstaged ``unpack_symmetric(pack_symmetric(upper_gram))`` in the NS dtype. 64 = 16 blocks
    of 4 in 8 chunks of 2 (``GRAM_CHUNKS``)."""
    dtype = ns.compute_dtype(precision)
    wide = _randn((g, lines)).to(dtype)
    staged, chunks = ns.staged_gram(wide), ns.gram_chunks(g)
    assert len(staged.ranges) == len(chunks) == min(len(ns.gram_blocks(g)), ns.GRAM_CHUNKS)
    assert staged.ranges[0][0] == 0 and staged.ranges[-1][1] == ns.packed_size(g)
    assert all(a[1] == b[0] for a, b in zip(staged.ranges, staged.ranges[1:]))
    flops = 0
    for j, ((lo, hi), (start, end)) in enumerate(zip(chunks, staged.ranges)):
        assert end - start == ns.staged_size(g, lo, hi)
        with _MatmulFlops() as counter:
            staged.fill(j)
        assert counter.flops == ns.staged_gram_flops(g, lines, lo, hi)
        flops += counter.flops
    assert flops == ns.upper_gram_flops(g, lines)
    unstaged = ns.unpack_symmetric(ns.pack_symmetric(ns.upper_gram(wide)), dtype)
    assert torch.equal(ns.unpack_staged(staged.flat, g, dtype), unstaged)


@pytest.mark.parametrize("shape, dim", [((40, 96), 1), ((96, 40), 0)])
def test_staged_sharded_steps_are_the_unstaged_bit_for_bit(small_blocks, shape, dim):
    """Two shards summed (``serve`` sums each ``EARLY`` chunk at once): the staged steps
    give the unstaged steps' result bit for bit, in bf16 and fp32 NS."""
    x = _randn(shape)
    for precision in ("medium", "highest"):
        got = [_two_shards(x, dim, precision, staged) for staged in (False, True)]
        assert torch.equal(*got)


def _two_shards(x, dim: int, precision: str, staged: bool):
    """``sharded_newton_schulz_steps`` on two shards of ``x``, one thread each, ``serve``d with
    a sum over the threads (in one order on both)."""
    shards = torch.tensor_split(x, 2, dim=dim)
    barrier, parts, out = threading.Barrier(2), {}, [None, None]

    def reduce(i, t):
        parts[i] = t.clone()
        barrier.wait()
        total = parts[0] + parts[1]
        barrier.wait()
        t.copy_(total)

    def run(i):
        steps = ns.sharded_newton_schulz_steps(
            shards[i], dim, 5, "quintic", precision, 1e-7, staged=staged
        )
        out[i] = ns.serve(steps, {ns.SUM: functools.partial(reduce, i)})

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return torch.cat(out, dim=dim)


def test_interleave_moves_early_sums_on_while_their_generator_computes():
    """``interleave`` with one generator yielding three ``EARLY`` chunks (sums of two
    collectives) and a last ``SUM``: each chunk's sum posted after it is computed, then the
    earlier chunks' moved on newest first, every wait in the posts' order; the generator resumes
    only when all are done."""
    log, posted = [], []

    def steps():
        for j in range(4):
            log.append(("compute", j))
            yield ns.EARLY if j < 3 else ns.SUM, j
        log.append(("resumed",))

    def post(i, kind, t):
        assert kind == ns.SUM  # an EARLY request is served as a sum
        handle = (t, 0) if not isinstance(t, tuple) else t
        log.append(("post", handle))
        posted.append(handle)
        return handle

    def wait(handle):
        assert posted.pop(0) == handle, "waited out of the posts' order"
        log.append(("wait", handle))
        j, at = handle
        return ns.Then(post(0, ns.SUM, (j, 1))) if at == 0 else None

    ns.interleave([steps()], post, wait)
    assert log == [
        ("compute", 0), ("post", (0, 0)),
        ("compute", 1), ("post", (1, 0)), ("wait", (0, 0)), ("post", (0, 1)),
        ("compute", 2), ("post", (2, 0)), ("wait", (1, 0)), ("post", (1, 1)), ("wait", (0, 1)),
        ("compute", 3), ("post", (3, 0)), ("wait", (2, 0)), ("post", (2, 1)), ("wait", (1, 1)),
        ("wait", (3, 0)), ("post", (3, 1)), ("wait", (2, 1)),
        ("wait", (3, 1)),
        ("resumed",),
    ]  # fmt: skip
    assert posted == []
