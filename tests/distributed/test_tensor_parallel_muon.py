"""Upstream's ``TensorParallelMuon`` API on Megatron-style TP-sharded params (no GPT needed):
exact TP modes at TP=2 equal one process on the whole matrices; blockwise does not.

    .venv/bin/python -m pytest tests/distributed/test_tensor_parallel_muon.py -q
"""

import pytest
import torch
from harness import run_distributed
from parity import record

from megatron.core.optimizer.megatron_muon.newton_schulz import polynomial_ranges, splits_polynomial
from megatron.core.optimizer.muon import TensorParallelMuon

# (rows, cols, partition_dim): a column-parallel (rows split) and a row-parallel (cols split) W.
MATRICES = [(64, 32, 0), (32, 48, 1)]
STEPS = 3


def _whole(seed: int, rows: int, cols: int) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))


def _run(mode: str, matrices=MATRICES) -> list:
    """Each rank steps its TP shard of every matrix; returns the gathered whole matrices."""
    from megatron.core import parallel_state as ps

    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    params = []
    for i, (rows, cols, dim) in enumerate(matrices):
        p = torch.nn.Parameter(_whole(i, rows, cols).chunk(tp, dim)[rank].clone())
        p.tensor_model_parallel, p.partition_dim = True, dim
        params.append(p)
    opt = TensorParallelMuon(params, lr=0.1, fp32_matmul_prec="highest", tp_mode=mode)
    for step in range(STEPS):
        for i, (p, (rows, cols, dim)) in enumerate(zip(params, matrices)):
            p.grad = _whole(100 * step + i + 10, rows, cols).chunk(tp, dim)[rank].clone()
        opt.step()
    return [
        _gather(p.detach(), dim, ps.get_tensor_model_parallel_group())
        for p, (_, _, dim) in zip(params, matrices)
    ]


def _gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


# fp32 Newton-Schulz on both sides; TP only reorders fp32 sums (Gram matrices, norms) -> ~1e-6.
TOL = 1e-5


@pytest.mark.parametrize("mode", ["duplicated", "distributed", "owner"])
def test_exact_tp_modes_equal_one_process(mode):
    (ref,) = run_distributed(_run, 1, args=(mode,))
    for got in run_distributed(_run, 2, tp=2, args=(mode,)):
        record(
            "parity", "max |diff|", max((a - b).abs().max().item() for a, b in zip(got, ref)), TOL
        )
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, rtol=0, atol=TOL)


def test_blockwise_is_not_the_exact_result():
    (ref,) = run_distributed(_run, 1, args=("duplicated",))
    got = run_distributed(_run, 2, tp=2, args=("blockwise",))[0]
    assert max((a - b).abs().max().item() for a, b in zip(got, ref)) > 100 * TOL


class _Done:
    def wait(self) -> None:
        pass


def _counted(broken_gather: bool = False, matrices=MATRICES, block_rows=None) -> float:
    """Matmul FLOPs of one ``distributed``-mode step on this rank (``broken_gather``: the
    negative control below, the other rank's polynomial piece never arrives; ``block_rows``: the
    Gram's ``GRAM_BLOCK_ROWS`` in this rank)."""
    from test_muon_distopt import MatmulFlops

    from megatron.core.optimizer.megatron_muon import newton_schulz, tp

    if block_rows is not None:
        newton_schulz.GRAM_BLOCK_ROWS = block_rows
    if broken_gather:
        tp.post_pieces = lambda pieces, group: (_Done(), None)
    counter = MatmulFlops()
    with counter:
        result = _run("distributed", matrices)
    return counter.flops / STEPS, result


def test_distributed_mode_splits_the_polynomial_and_runs_the_counted_flops():
    """Each TP rank computes a piece of every polynomial ``p(G)`` (``polynomial_rows``: rows
    0-11 from column 0, rows 12-31 from column 12; ``tp.post_pieces`` gathers them): the matmul
    FLOPs TP rank p runs per step are ``4 r n^2 + 2 n P_p`` (``P_p``: its piece, 384 or 400
    elements), the busiest's ``tp_ns_cost``'s, below the ``2 n^3`` of the whole polynomial and
    the ``n^3`` of half its rows; without the gather the result is wrong."""
    from megatron.core.optimizer.megatron_muon.factory import MegatronMuonParamInfo
    from megatron.core.optimizer.megatron_muon.planner.plan import tp_ns_cost

    infos = [MegatronMuonParamInfo((r, c), None, partition_dim=d) for r, c, d in MATRICES]
    # 64 x 32 row shards: 32 lines, Gram 32^2; 32 x 48 column shards: 24 lines, Gram 32^2;
    # the larger polynomial piece 20 x 20 (the smaller 12 x 32); 5 Newton-Schulz steps.
    assert polynomial_ranges(32, 2) == ((0, 384), (384, 784))
    want = [
        5 * (4 * 32 * 32**2 + 2 * 32 * p) + 5 * (4 * 24 * 32**2 + 2 * 32 * p) for p in (384, 400)
    ]
    assert sum(tp_ns_cost(info, 5, "distributed", 2) for info in infos) == want[1]
    for (flops, _), rank_want in zip(run_distributed(_counted, 2, tp=2), want):
        assert flops == rank_want
    (ref,) = run_distributed(_run, 1, args=("distributed",))
    got = run_distributed(_counted, 2, tp=2, args=(True,))[0][1]
    assert not any(torch.allclose(a, b, rtol=0, atol=100 * TOL) for a, b in zip(got, ref))


def test_distributed_mode_computes_the_gram_upper_triangle_in_blocks(monkeypatch):
    """Each TP rank's Gram in 8 blocks of 4 rows (``upper_gram``): the one-process result, and
    per step the counted FLOPs ``tp_ns_cost`` models, ``(k + 1) / 2k = 9/16`` of the whole
    Gram's ``2 r n^2`` plus the same polynomial and update as above."""
    from megatron.core.optimizer.megatron_muon import newton_schulz
    from megatron.core.optimizer.megatron_muon.factory import MegatronMuonParamInfo
    from megatron.core.optimizer.megatron_muon.planner.plan import tp_ns_cost

    monkeypatch.setattr(newton_schulz, "GRAM_BLOCK_ROWS", 4)
    infos = [MegatronMuonParamInfo((r, c), None, partition_dim=d) for r, c, d in MATRICES]
    gram = 9 * 2 * 32 * 32**2 // 16 + 9 * 2 * 24 * 32**2 // 16  # 32 and 24 lines, 32^2 Gram
    rest = [
        5 * (2 * 32 * 32**2 + 2 * 32 * p) + 5 * (2 * 24 * 32**2 + 2 * 32 * p) for p in (384, 400)
    ]
    want = [5 * gram + r for r in rest]  # TP rank 0's piece 384 elements, rank 1's 400
    assert sum(tp_ns_cost(info, 5, "distributed", 2) for info in infos) == want[1]
    (ref,) = run_distributed(_run, 1, args=("distributed",))
    runs = run_distributed(_counted, 2, tp=2, args=(False, MATRICES, 4))
    for (flops, got), rank_want in zip(runs, want):
        assert flops == rank_want
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, rtol=0, atol=TOL)


# Blocks with fewer lines than their Gram side (32 of 48), by rows and by columns.
SHORT = [(32, 48, 0), (48, 32, 1)]


def test_distributed_mode_reassociates_short_blocks():
    """Where a polynomial piece costs more than reassociating (``splits_polynomial``: 900
    elements, ``2 g P`` above the reassociated step's extra ``2 g^2 l``, g = 48, l = 16), the
    polynomial is not split: each TP rank applies ``a X + G (b X + c G X)`` to its 16 lines
    (``4 l g^2``), without the polynomial's all-gather. With that gather broken
    (``tp.post_pieces`` dropped, which wrecks the split blocks above) the result still equals
    one process; the model counts no all-gather and the FLOPs run."""
    from megatron.core.optimizer.megatron_muon.factory import MegatronMuonParamInfo
    from megatron.core.optimizer.megatron_muon.planner.plan import tp_collectives, tp_ns_cost

    infos = [MegatronMuonParamInfo((r, c), None, partition_dim=d) for r, c, d in SHORT]
    assert not splits_polynomial(48, 32, 2, True) and polynomial_ranges(48, 2)[1] == (864, 1764)
    want = 2 * 5 * (2 * 16 * 48**2 + 4 * 16 * 48**2)  # the Gram (one block), the two products
    assert sum(tp_ns_cost(info, 5, "distributed", 2) for info in infos) == want
    # fp32 NS, as the run below: a Gram sum is one all-reduce, so any gather would be a piece's
    fp32 = {c.op for info in infos for c in tp_collectives(info, 5, "distributed", 2, "float32")}
    assert fp32 == {"all_reduce"}
    (ref,) = run_distributed(_run, 1, args=("distributed", SHORT))
    for flops, got in run_distributed(_counted, 2, tp=2, args=(True, SHORT)):
        assert flops == want
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, rtol=0, atol=TOL)


# 8 lines per TP rank of a 64-side Gram: cheaper whole on each rank than split (``gathers``), as
# a GQA K or V block under TP; by rows and by columns.
GATHERED = [(16, 64, 0), (64, 16, 1)]


def test_distributed_mode_gathers_a_block_cheaper_whole():
    """A block cheaper whole is gathered (``tp.post_pieces``) and orthogonalized whole on each TP
    rank: the one-process result, the whole Newton-Schulz's FLOPs (``tp_ns_cost``), and no
    Gram sum; without the gather the result is wrong."""
    from megatron.core.optimizer.megatron_muon.factory import MegatronMuonParamInfo
    from megatron.core.optimizer.megatron_muon.newton_schulz import gathers, ns_flops
    from megatron.core.optimizer.megatron_muon.planner.plan import tp_collectives, tp_ns_cost

    infos = [MegatronMuonParamInfo((r, c), None, partition_dim=d) for r, c, d in GATHERED]
    assert gathers(64, 16, 2) and not gathers(32, 64, 2)  # GATHERED, MATRICES[0]
    want = sum(ns_flops(r, c, 5, "standard") for r, c, _ in GATHERED)
    assert sum(tp_ns_cost(info, 5, "distributed", 2) for info in infos) == want
    ops = [c.op for info in infos for c in tp_collectives(info, 5, "distributed", 2)]
    assert ops == ["all_gather_into_tensor"] * 2
    (ref,) = run_distributed(_run, 1, args=("distributed", GATHERED))
    for flops, got in run_distributed(_counted, 2, tp=2, args=(False, GATHERED)):
        assert flops == want
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, rtol=0, atol=TOL)
    got = run_distributed(_counted, 2, tp=2, args=(True, GATHERED))[0][1]
    assert not any(torch.allclose(a, b, rtol=0, atol=100 * TOL) for a, b in zip(got, ref))
