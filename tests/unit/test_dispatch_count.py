"""bench/dispatch_count.py's counter: kernels, host syncs and host-scalar reads of known code,
and the Newton-Schulz matmuls of a real Muon step as the schedule the code runs predicts."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from dispatch_count import PER_MATRIX, DispatchCounter, measure  # noqa: E402

from megatron.core.optimizer.megatron_muon.optimizer import Muon  # noqa: E402

MATMULS = {"aten::mm.out", "aten::addmm.out", "aten::mm", "aten::addmm"}
BATCHED = {"aten::bmm.out", "aten::baddbmm.out"}


def test_counts_kernels_and_syncs_of_known_code():
    x = torch.ones(4)
    host_step = torch.zeros(())
    with DispatchCounter(host_resident=[host_step]) as counter:
        y = x * 2 + 1  # 2 kernels
        y.view(2, 2).t()  # views: none
        y.sum().item()  # 1 kernel, 1 sync
        host_step.add_(1).item()  # 1 kernel, 1 read of a host-resident scalar: no sync
    c = counter.counts
    assert (c.kernels, c.host_syncs, c.host_reads) == (4, 1, 1), c


def test_a_read_of_a_device_scalar_is_a_sync():
    # negative control: the same read on a tensor not declared host-resident is a sync
    step = torch.zeros(())
    with DispatchCounter() as counter:
        step.item()
    assert (counter.counts.host_syncs, counter.counts.host_reads) == (1, 0)


@pytest.mark.parametrize("ns_steps", [3, 5])
def test_muon_step_runs_three_matmuls_per_newton_schulz_iteration(ns_steps):
    """Standard Newton-Schulz: A = X X^T, B = b A + c A A, X = a X + B X: one mm and two addmm
    per iteration and matrix, nothing more in the step."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(*s)) for s in [(8, 16), (16, 16), (24, 8)]]
    optimizer = Muon(params, ns_steps=ns_steps, on_nonfinite_grad="ignore")
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer.step()  # state exists from here on
    with DispatchCounter() as counter:
        optimizer.step()
    matmuls = sum(n for op, n in counter.counts.by_op.items() if op in MATMULS)
    assert matmuls == 3 * ns_steps * len(params)
    assert counter.counts.host_syncs == 0


@pytest.mark.parametrize("batch_bytes, chains", [(None, 2), (1, 5)])
def test_muon_step_runs_one_batched_chain_per_shape(batch_bytes, chains):
    """Three 16 x 24 matrices run as one batched chain (3 batched matmuls per iteration), the
    lone 40 x 24 one as before; negative control: a 1-byte cap runs a chain per matrix (and a
    stack of one is no batch: 2-D matmuls)."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(*s)) for s in [(16, 24)] * 3 + [(40, 24)] * 2]
    cap = {} if batch_bytes is None else {"ns_batch_bytes": batch_bytes}
    optimizer = Muon(params, ns_steps=5, on_nonfinite_grad="ignore", **cap)
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer.step()
    with DispatchCounter() as counter:
        optimizer.step()
    ops = counter.counts.by_op
    single = sum(n for op, n in ops.items() if op in MATMULS)
    batched = sum(n for op, n in ops.items() if op in BATCHED)
    assert single + batched == 3 * 5 * chains
    assert batched == (3 * 5 * chains if batch_bytes is None else 0)
    assert counter.counts.host_syncs == 0


def test_distopt_step_runs_a_chain_per_shape_and_no_host_sync_of_its_own():
    """A real step of bench/dispatch_count.py (2 layers, DP 2, bf16): each owner runs at most one
    Newton-Schulz chain (5 iterations x 3 matmuls) per shape of the model's 4 (128 x 128: Q
    blocks and output projections; 64 x 128: K/V blocks; fc1; fc2), and its host syncs are the
    AdamW + DistributedOptimizer step's (Megatron's wrapper). Negative control: a chain per
    matrix and Q/K/V block (``ns_batch_bytes=1``) runs more chains than shapes on some rank."""
    ranks = measure(2, ("adamw", "ours", "ours" + PER_MATRIX))
    matmuls = {
        who: [sum(n for op, n in r[who].by_op.items() if op in MATMULS | BATCHED) for r in ranks]
        for who in ("ours", "ours" + PER_MATRIX)
    }
    assert all(m % 15 == 0 for ms in matmuls.values() for m in ms), matmuls
    assert all(0 < m // 15 <= 4 for m in matmuls["ours"]), matmuls
    assert max(matmuls["ours" + PER_MATRIX]) // 15 > 4, matmuls
    for r in ranks:
        assert r["ours"].host_syncs == r["adamw"].host_syncs == 2, r
