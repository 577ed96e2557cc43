"""Newton-Schulz: against a float64 polynomial reference, singular-value bands, API contracts."""

import functools
import threading
import types

import pytest
import torch

from megatron.core.optimizer.megatron_muon.newton_schulz import (
    COEFFICIENT_SETS,
    PIECES_ALIGN,
    SUM,
    Pieces,
    _joined_polynomial,
    matmul_precision,
    newton_schulz,
    pack_symmetric,
    packed_size,
    polynomial_ranges,
    polynomial_rows,
    polynomial_size,
    reassociates,
    serve,
    sharded_newton_schulz,
    sharded_newton_schulz_steps,
    splits_polynomial,
    unpack_symmetric,
)

SHAPES = [(64, 96), (96, 64), (80, 80), (4, 48, 32), (2, 3, 24, 40)]  # wide, tall, square, batched
SETS = list(COEFFICIENT_SETS)
# Upstream's rule past a set's end (emerging_optimizers' get_coefficient_iterator): these repeat
# their last triple, every other set starts its list again. The triples themselves are checked
# against upstream's numbers in test_ns_upstream_reference.py.
REPEAT_LAST = {"polar_express", "cans", "deepseekv4"}


def reference_triple(name, i):
    triples = COEFFICIENT_SETS[name].triples
    return triples[min(i, len(triples) - 1)] if name in REPEAT_LAST else triples[i % len(triples)]


def reference_ns(x, name, steps, eps=1e-7):
    """Explicit odd polynomial a X + b (X X^T) X + c (X X^T)^2 X in float64, no SVD, no fusing."""
    X = x.double()
    tall = X.shape[-2] > X.shape[-1]
    X = X.mT if tall else X
    X = X / torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True).clamp_min(eps)
    for i in range(steps):
        a, b, c = reference_triple(name, i)
        A = X @ X.mT
        AX = A @ X
        X = a * X + b * AX + c * (A @ AX)
    return X.mT if tall else X


def _randn(shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("steps", [1, 5, 11])  # 11 > every set's length: cycles or repeats
@pytest.mark.parametrize("name", SETS)
@pytest.mark.parametrize("shape", SHAPES)
def test_fp32_matches_float64_reference(shape, name, steps):
    x = _randn(shape)
    got = newton_schulz(x, steps=steps, coefficients=name, precision="highest")
    # fp32 rounding (6e-8) grows by the polynomials' slope (<= 8.5 on a first step, <= ~4.1
    # after) and sqrt(n)-long dot products; measured <= 3.2e-6 on these shapes (1.3e-5 for CANS,
    # whose first triple (8.47, -25.1, 18.6) cancels most): 1e-5, 5e-5 for CANS.
    atol = 5e-5 if name == "cans" else 1e-5
    torch.testing.assert_close(got.double(), reference_ns(x, name, steps), rtol=0, atol=atol)


@pytest.mark.parametrize("name", SETS)
@pytest.mark.parametrize("shape", SHAPES)
def test_bf16_matches_float64_reference(shape, name):
    x = _randn(shape)
    got = newton_schulz(x, steps=5, coefficients=name, precision="medium")
    assert got.dtype == torch.float32  # returned in the input's dtype
    # bf16 keeps 8 bits (rounding 2^-9 per op, ~15 ops per step); measured <= 1.7e-2 on entries
    # of size ~0.5 (AOL 2.2e-2): 3.5e-2 still catches a wrong coefficient (>0.05). CANS's first
    # triple amplifies bf16 rounding ~40x: 0.30 on the 24 x 40 inputs, as much as upstream's
    # 'medium' on the same inputs (measured), so its bound only catches a broken iteration.
    atol = 0.4 if name == "cans" else 3.5e-2
    torch.testing.assert_close(got.double(), reference_ns(x, name, 5), rtol=0, atol=atol)


# Singular values of NS_k(X) for Gaussian X with aspect 1:2 or 2:1 (sigma_min/sigma_max ~ 0.17
# after normalization), k = the set's own length (5; AOL 4, DeepSeek-V4 10). Measured on seeds 0-3
# at 64x128, 128x64, 96x192 in fp32:
#   simple [0.68, 1.14] (Keller Jordan's set trades accuracy for slope at 0: ~U(0.7, 1.2) claimed)
#   quintic [0.978, 1.032]; polar_express [0.870, 1.124] (5 of its 8 steps; 8 give 1 +- 1e-4);
#   cans [0.886, 1.119]; aol [0.987, 1.012]; deepseekv4 [1.000, 1.001].
# Bands below add ~0.03-0.05 headroom for bf16 (measured within 0.01 of fp32), except CANS in
# bf16: [0.873, 1.697], its first triple amplifying bf16 rounding (upstream's numbers too: it
# normalizes in fp32 before the cast, we after, one bf16 rounding apart).
STEPS = {"simple": 5, "quintic": 5, "polar_express": 5, "cans": 5, "aol": 4, "deepseekv4": 10}
BANDS = {
    "simple": (0.64, 1.18),
    "quintic": (0.95, 1.06),
    "polar_express": (0.82, 1.16),
    "cans": (0.84, 1.16),
    "aol": (0.96, 1.04),
    "deepseekv4": (0.98, 1.02),
}
BF16_BANDS = {**BANDS, "cans": (0.84, 1.8)}


@pytest.mark.parametrize("precision", ["highest", "medium"])
@pytest.mark.parametrize("name", SETS)
@pytest.mark.parametrize("shape", [(64, 128), (128, 64), (96, 192)])
def test_singular_values_in_promised_band(shape, name, precision):
    lo, hi = (BANDS if precision == "highest" else BF16_BANDS)[name]
    for seed in range(2):
        out = newton_schulz(_randn(shape, seed), STEPS[name], name, precision)
        sv = torch.linalg.svdvals(out.double())
        assert lo <= sv.min() and sv.max() <= hi, (name, sv.min().item(), sv.max().item())


def test_polar_express_converges_with_its_eight_steps():
    sv = torch.linalg.svdvals(
        newton_schulz(_randn((64, 128)), 8, "polar_express", "highest").double()
    )
    torch.testing.assert_close(sv, torch.ones_like(sv), rtol=0, atol=1e-3)


def test_tall_is_transpose_of_wide_and_batched_is_per_matrix():
    x = _randn((3, 40, 24))
    out = newton_schulz(x, precision="highest")
    tall = newton_schulz(x.mT.contiguous(), precision="highest")
    torch.testing.assert_close(tall, out.mT, rtol=0, atol=1e-6)
    for i in range(3):
        torch.testing.assert_close(
            newton_schulz(x[i], precision="highest"), out[i], rtol=0, atol=1e-6
        )


def test_input_untouched_and_custom_triples():
    x = _randn((16, 24))
    before = x.clone()
    custom = newton_schulz(x, steps=3, coefficients=[(3.4445, -4.7750, 2.0315)])
    assert torch.equal(x, before)
    assert torch.equal(custom, newton_schulz(x, steps=3, coefficients="simple"))


def test_precision_names_are_upstreams():
    """'highest' and 'high' run fp32 off CUDA (TF32 is CUDA's); 'medium' casts to bf16 first, then
    normalizes and runs bf16 matmuls (torch.optim.Muon's order; upstream normalizes in fp32 first,
    one bf16 rounding apart)."""
    x = _randn((32, 48))
    assert torch.equal(newton_schulz(x, precision="high"), newton_schulz(x, precision="highest"))
    bf16 = [(a, b, c) for a, b, c in COEFFICIENT_SETS["quintic"].triples]
    X = x.bfloat16()
    X = X / torch.linalg.vector_norm(X)
    for a, b, c in bf16:
        A = X @ X.mT
        X = torch.addmm(X, torch.addmm(A, A, A, beta=b, alpha=c), X, beta=a)
    assert torch.equal(newton_schulz(x, precision="medium"), X.float())


@pytest.mark.parametrize("precision,tf32", [("high", True), ("highest", False), ("medium", None)])
def test_high_allows_tf32_on_cuda_only(precision, tf32):
    """The setting upstream's context sets, inside the block only, for a CUDA device; nothing
    changes for another device (the flag is read, not a device, so this runs without a GPU).
    The CUDA device is a stand-in with its ``type``: the test process's CPU mode turns
    ``torch.device("cuda")`` into the CPU device, as it does for megatron-core's code."""
    before = torch.get_float32_matmul_precision()
    with matmul_precision(precision, torch.device("cpu")):
        assert torch.get_float32_matmul_precision() == before
    with matmul_precision(precision, types.SimpleNamespace(type="cuda")):
        inside = torch.backends.cuda.matmul.allow_tf32
    assert torch.get_float32_matmul_precision() == before
    if tf32 is not None:
        assert inside is tf32


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(steps=0), "steps must be >= 1"),
        (dict(coefficients="cubic"), "unknown Newton-Schulz coefficient set 'cubic'"),
        (dict(coefficients=[(1.0, 2.0)]), r"\(a, b, c\) triples"),
        (dict(precision="fp8"), "unknown Newton-Schulz precision 'fp8'"),
        (dict(precision="fp32"), r"precision 'fp32'; allowed: \['highest', 'high', 'medium'\]"),
    ],
)
def test_invalid_arguments_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        newton_schulz(_randn((8, 8)), **kwargs)


def test_vector_input_raises():
    with pytest.raises(ValueError, match=r"\(\.\.\., m, n\) tensor, got shape \(8,\)"):
        newton_schulz(torch.ones(8))


def _sharded(x, dim, cuts, reassociate, split=False, drop_gather=False):
    """``sharded_newton_schulz`` on the shards of ``x`` (cut along ``dim`` at ``cuts``), one
    thread per shard, ``reduce`` a sum over the threads: a gang without processes. ``split``:
    each shard computes its rows of the polynomial, ``gather`` copies the others' ranges in
    (``drop_gather``: the negative control, the other rows stay unset)."""
    shards = list(torch.tensor_split(x, cuts, dim=dim))
    k = len(shards)
    barrier, parts, got = threading.Barrier(k), {}, {}

    def reduce(t):
        parts[threading.get_ident()] = t.clone()
        barrier.wait()
        total = sum(parts.values())  # every thread sums in the same (insertion) order
        barrier.wait()
        t.copy_(total)

    def gather(i, pieces):
        got[i] = pieces
        barrier.wait()
        for j, other in got.items():
            lo, hi = other.ranges[j]
            if j != i and not drop_gather:
                pieces.flat[lo:hi] = other.flat[lo:hi]
        barrier.wait()

    out = [None] * k

    def run(i):
        part = (i, k, functools.partial(gather, i)) if split else None
        out[i] = sharded_newton_schulz(
            shards[i], dim, reduce, 5, "quintic", "highest", 1e-7, reassociate, part=part
        )

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(shards))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return torch.cat(out, dim=dim)


@pytest.mark.parametrize("reassociate", [False, True])
@pytest.mark.parametrize("shape, dim, cuts", [((40, 96), 1, [10, 60]), ((96, 40), 0, [10, 60])])
def test_sharded_forms_match_float64_reference(shape, dim, cuts, reassociate):
    """Shards of 10, 50 and 36 lines against a 40 x 40 Gram: with ``reassociate`` the first and
    last run ``a X + G (b X + c G X)``, the middle one the polynomial; either way each is its
    share of the whole matrix's Newton-Schulz (fp32 tolerance as above)."""
    assert [reassociates(40, n) for n in (10, 50, 36)] == [True, False, True]
    x = _randn(shape)
    got = _sharded(x, dim, cuts, reassociate)
    torch.testing.assert_close(got.double(), reference_ns(x, "quintic", 5), rtol=0, atol=1e-5)


@pytest.mark.parametrize("shape, dim, cuts", [((40, 96), 1, [10, 60]), ((96, 40), 0, [30, 60])])
def test_split_polynomial_matches_float64_reference(shape, dim, cuts):
    """Each of 3 shards computes rows ``cut(40, 3)[p]`` of ``p(G)`` (``part`` of two: whole
    rows; the pieces of ``polynomial_rows`` run in the TP tests) and gathers the others' (a 40 x
    40 Gram, 96 lines: ``splits_polynomial``); same tolerance as above. Negative control:
    without the gather the result is far off."""
    assert splits_polynomial(40, 96, 3, True) and not splits_polynomial(40, 10, 3, True)
    assert not splits_polynomial(40, 40, 3, True, pieces=False)  # whole rows: reassociated
    assert splits_polynomial(40, 40, 3, False) and not splits_polynomial(40, 96, 1, False)
    x = _randn(shape)
    got = _sharded(x, dim, cuts, False, split=True)
    torch.testing.assert_close(got.double(), reference_ns(x, "quintic", 5), rtol=0, atol=1e-5)
    broken = _sharded(x, dim, cuts, False, split=True, drop_gather=True)
    assert not torch.allclose(broken.double(), reference_ns(x, "quintic", 5), rtol=0, atol=1e-2)


def _least_largest_piece(g: int, k: int) -> int:
    """By exhaustion: the least largest piece ``(hi - lo) (g - lo)`` over all ways to cut g rows
    into at most k contiguous runs."""

    @functools.cache
    def best(lo: int, parts: int) -> float:
        if lo == g:
            return 0
        if parts == 0:
            return float("inf")
        return min(max((hi - lo) * (g - lo), best(hi, parts - 1)) for hi in range(lo + 1, g + 1))

    return best(0, k)


@pytest.mark.parametrize("g, k", [(1, 1), (5, 2), (12, 3), (13, 4), (3, 5), (40, 3), (31, 8)])
def test_polynomial_pieces_cover_it_once_balanced(g, k):
    """``polynomial_rows``: contiguous row runs covering all g rows, so the pieces (each run
    from its diagonal on) hold every upper element once; the largest is the least any cut
    allows (exhaustion); ``polynomial_ranges`` lay them out back to back. Joining the pieces of
    a symmetric matrix gives it back, bit for bit (each lower element is its mirror's copy)."""
    rows, ranges = polynomial_rows(g, k), polynomial_ranges(g, k)
    assert len(rows) == k and rows[0][0] == 0 and rows[-1][1] == g
    assert all(a[1] == b[0] for a, b in zip(rows, rows[1:]))
    assert [e - s for s, e in ranges] == [(hi - lo) * (g - lo) for lo, hi in rows]
    assert ranges[0][0] == 0 and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert max(e - s for s, e in ranges) == _least_largest_piece(g, k)
    sym = _randn((g, g))
    sym = sym + sym.mT
    flat = torch.cat([sym[lo:hi, lo:].reshape(-1) for lo, hi in rows])
    assert torch.equal(_joined_polynomial(Pieces(flat, ranges), g), sym)
    assert polynomial_size(g, k) % PIECES_ALIGN == 0 and polynomial_size(g, k) >= ranges[-1][1]


def test_polynomial_pieces_in_slots_give_equal_slices():
    """In ``slots`` slots (a gang of 3 over TP 2: 6 places), each slot holds its 3 places'
    pieces back to back from the slot's start, all slots as large as the largest group: TP
    rank t's even slice of the buffer is its places' pieces."""
    g, k, slots = 40, 6, 2
    sizes = [(hi - lo) * (g - lo) for lo, hi in polynomial_rows(g, k)]
    ranges, size = polynomial_ranges(g, k, slots), polynomial_size(g, k, slots)
    assert size == slots * max(sum(sizes[:3]), sum(sizes[3:]))
    assert [e - s for s, e in ranges] == sizes
    assert ranges[0][0] == 0 and ranges[3][0] == size // 2 and ranges[2][1] <= size // 2
    assert all(ranges[q][1] == ranges[q + 1][0] for q in (0, 1, 3, 4))


@pytest.mark.parametrize("g", [1, 2, 3, 8, 33])
def test_packed_symmetric_holds_each_upper_element_once(g):
    """``pack_symmetric`` keeps exactly the upper triangle (diagonal included): its values are
    the triangle's, each once; unpacking restores the matrix exactly; packing is linear
    elementwise, so a sum of packs over shards unpacks to the sum of the matrices (what a gang's
    Gram sum relies on), bit for bit."""
    upper = torch.randperm(g * g).float().view(g, g).triu()  # distinct values
    a = upper + upper.triu(1).mT
    packed = pack_symmetric(a)
    assert packed.numel() == packed_size(g) == g * (g + 1) // 2
    want = a[tuple(torch.triu_indices(g, g))]
    assert torch.equal(packed.sort().values, want.sort().values)
    assert torch.equal(unpack_symmetric(packed, torch.float32), a)
    b = torch.randn(g, g)
    b = b + b.mT
    total = unpack_symmetric(pack_symmetric(a) + pack_symmetric(b), torch.float32)
    assert torch.equal(total, a + b)
    assert unpack_symmetric(packed, torch.bfloat16).dtype == torch.bfloat16


def test_sharded_steps_sum_packed_grams():
    """A sharded iteration asks for its squared norm and one packed Gram per step to be summed:
    ``1 + steps * g (g + 1) / 2`` elements in all (half of the ``g^2`` a whole Gram would move);
    one shard, whose sums are no-ops, equals ``newton_schulz`` (fp32, same tolerance as above)."""
    x = _randn((24, 40))
    sizes = []
    steps = sharded_newton_schulz_steps(x, 1, 5, "quintic", "highest", 1e-7)
    got = serve(steps, {SUM: lambda t: sizes.append(t.numel())})
    assert sizes == [1] + [packed_size(24)] * 5
    torch.testing.assert_close(
        got, newton_schulz(x, 5, "quintic", "highest", 1e-7), rtol=0, atol=1e-5
    )
