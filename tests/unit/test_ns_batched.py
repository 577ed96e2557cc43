"""Batched Newton-Schulz (``orthogonalize_matrices``): one chain per (shape, dtype, scale) on the
stacked matrices, each result the per-matrix one, the batch capped by ``batch_bytes``."""

import dataclasses

import torch

from megatron.core.optimizer.megatron_muon.functional import (
    MuonParamInfo,
    OrthoSpec,
    batches,
    orthogonalize_matrices,
)
from megatron.core.optimizer.megatron_muon.newton_schulz import newton_schulz, newton_schulz_stack

SPLIT = (8, 4, 4)  # one query group's Q/K/V rows: K and V one shape, batched with each other


def _mixed():
    """Same-shape matrices (one of them 1000x larger: norms stay per matrix), a lone shape, two
    fused QKV weights whose 16 x 24 K/V blocks join the plain 16 x 24 matrices' batch."""
    g = torch.Generator().manual_seed(0)
    shapes = [(16, 24), (16, 24), (16, 24), (40, 24), (2 * sum(SPLIT), 24), (2 * sum(SPLIT), 24)]
    us = [torch.randn(*s, generator=g) for s in shapes]
    us[1] *= 1000
    infos = [MuonParamInfo(s, SPLIT if i >= 4 else None) for i, s in enumerate(shapes)]
    return us, infos


def _spec(precision: str, **kw) -> OrthoSpec:
    return OrthoSpec(5, "quintic", precision, 1e-7, "spectral", 1.0, **kw)


def test_batched_is_bit_identical_to_per_matrix_in_bf16():
    # bf16 Newton-Schulz (upstream's default, 'medium'): torch's batched bf16 matmul computes each
    # matrix of the batch as the single one does (checked on CPU, ATEN_CPU_CAPABILITY=default
    # too), so a batched chain is exact, also with the K/V blocks of QKV weights in it.
    us, infos = _mixed()
    spec = _spec("medium")
    got = orthogonalize_matrices(us, infos, spec)
    for u, info, o in zip(us, infos, got):
        assert torch.equal(o, orthogonalize_matrices([u], [info], spec)[0])
    # and in pieces of at most two 16 x 24 fp32 matrices (the cap): the same numbers
    capped = orthogonalize_matrices(
        us, infos, dataclasses.replace(spec, batch_bytes=2 * 16 * 24 * 4)
    )
    assert all(torch.equal(a, b) for a, b in zip(capped, got))
    # the stack cast straight to bf16 rounds as newton_schulz's own cast of the stack
    assert torch.equal(newton_schulz_stack(us[:3]), newton_schulz(torch.stack(us[:3])))


def test_batched_is_within_fp32_rounding_of_per_matrix():
    # fp32 ('highest'): baddbmm sums in another order than addmm (MKL's batched gemm; measured
    # differences of 0.4-1 fp32 ulp of 1 per entry before the scale, through 5 steps), and no
    # batch size is exact against another. Bound: 1e-5 relative to the entries' scale s (an
    # update of spectral scale s has entries <= ~1.2 s), 10x the measured 1e-6; a lost per-matrix
    # norm or scale moves entries by O(1) (test below).
    us, infos = _mixed()
    spec = _spec("highest")
    got = orthogonalize_matrices(us, infos, spec)
    for u, info, o in zip(us, infos, got):
        want = orthogonalize_matrices([u], [info], spec)[0]
        s = spec.scale(*info.shape)
        torch.testing.assert_close(o / s, want / s, rtol=0, atol=1e-5)


def test_negative_control_one_norm_for_the_batch_is_caught():
    # A batch normalized as one matrix (the 1000x larger member sets the norm) is far off:
    # what the per-matrix normalization of newton_schulz's batches prevents.
    us, _ = _mixed()
    stack = torch.stack(us[:3])
    wrong = newton_schulz(stack.reshape(-1, 24), precision="highest").view_as(stack)
    per = [newton_schulz(u, precision="highest") for u in us[:3]]
    assert (wrong[0] - per[0]).abs().max() > 0.1


def test_batches_caps_bytes_and_keeps_order():
    assert batches([4, 4, 4, 4, 4], 8) == [[0, 1], [2, 3], [4]]
    assert batches([10, 1, 1], 8) == [[0], [1, 2]]  # an item over the cap runs alone
    assert batches([], 8) == []


def test_tp_stream_leaves_unsharded_matrices_to_the_batched_call():
    """tp.py's ``distributed`` ``stream`` runs only TP-sharded matrices: it loads and stores none
    of those no TP group shards (here: no TP group at all) and returns them all; the call then
    batches them (bf16: bit-identical to the per-matrix results)."""
    from megatron.core.optimizer.megatron_muon import tp

    us, infos = _mixed()
    spec = _spec("medium", batch_bytes=3 * 16 * 24 * 4)  # three 16 x 24 fp32 matrices
    ortho = tp.TPOrthogonalizer("distributed", {False: None})
    loaded, stored = [], []
    loads = [lambda i=i: loaded.append(i) for i in range(len(us))]
    left = ortho.stream(loads, infos, spec, lambda i, o: stored.append(i))
    assert (left, loaded, stored) == (list(range(len(us))), [], [])
    for got, want in zip(ortho(us, infos, spec), orthogonalize_matrices(us, infos, spec)):
        assert torch.equal(got, want)
