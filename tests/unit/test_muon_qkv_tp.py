"""QKV split, pluggable orthogonalizers fed shards, and upstream's TensorParallelMuon."""

import dataclasses

import pytest
import torch

from megatron.core.optimizer.megatron_muon.functional import (
    OrthoSpec,
    orthogonalize_matrices,
    scale_flat_,
)
from megatron.core.optimizer.megatron_muon.newton_schulz import newton_schulz
from megatron.core.optimizer.muon import (
    LocalOrthogonalizer,
    Muon,
    MuonParamInfo,
    TensorParallelMuon,
)

# GQA: 3 query groups, 2 query heads per group, head_dim 4, hidden 24.
GROUPS, HEADS_PER_GROUP, HEAD_DIM, HIDDEN = 3, 2, 4, 24
SPLIT = (HEADS_PER_GROUP * HEAD_DIM, HEAD_DIM, HEAD_DIM)
QKV_ROWS = GROUPS * sum(SPLIT)


def _randn(*shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _block_rows(block):
    """Row indices of Q (0), K (1) or V (2) in Megatron's fused QKV weight: per query group the
    rows are [q (heads_per_group * head_dim); k (head_dim); v (head_dim)] (attention.py,
    get_query_key_value_tensors), written out with loops, independent of the implementation."""
    rows = []
    for g in range(GROUPS):
        start = g * sum(SPLIT) + sum(SPLIT[:block])
        rows.extend(range(start, start + SPLIT[block]))
    return torch.tensor(rows)


def _manual_qkv(u, spec):
    out = torch.empty_like(u)
    for block in range(3):
        rows = _block_rows(block)
        out[rows] = spec.scale(len(rows), HIDDEN) * newton_schulz(
            u[rows], spec.steps, spec.coefficients, spec.precision
        )
    return out


@pytest.mark.parametrize("scale_mode", ["spectral", "unit_rms_norm"])  # uniform / per-block s
def test_qkv_split_equals_manual_per_block_ns(scale_mode):
    u = _randn(QKV_ROWS, HIDDEN)
    spec = OrthoSpec(5, "simple", "highest", 1e-7, scale_mode, 0.5)
    (got,) = orthogonalize_matrices([u], [MuonParamInfo(tuple(u.shape), SPLIT)], spec)
    # K and V run batched, Q alone: same math as the manual loop up to fp32 rounding order.
    torch.testing.assert_close(got, _manual_qkv(u, spec), rtol=0, atol=1e-6)
    whole = orthogonalize_matrices([u], [MuonParamInfo(tuple(u.shape))], spec)[0]
    assert (got - whole).abs().max() > 0.05  # splitting really changes the result


@pytest.mark.parametrize("split", [SPLIT, None])
def test_scaling_flat_pieces_afterwards_is_bit_identical(split):
    """The DistOpt exchange returns unscaled bf16 NS output and holders scale their pieces
    (``scale_flat_``): per Q/K/V block (``unit_rms_norm``: a different s per block), for pieces
    cut anywhere (inside a row, across groups), the same bits as ``orthogonalize``'s scale."""
    u = _randn(QKV_ROWS, HIDDEN)
    info = MuonParamInfo(tuple(u.shape), split)
    spec = OrthoSpec(5, "quintic", "medium", 1e-7, "unit_rms_norm", 0.7)
    (want,) = orthogonalize_matrices([u], [info], spec)
    (raw,) = orthogonalize_matrices([u], [info], dataclasses.replace(spec, apply_scale=False))
    assert torch.equal(raw.bfloat16().float(), raw)  # bf16 NS output: exact in bf16
    flat = raw.reshape(-1)
    cuts = [0, 5, HIDDEN * 7 + 3, HIDDEN * sum(SPLIT) + 11, flat.numel()]
    for lo, hi in zip(cuts, cuts[1:]):
        got = scale_flat_(flat[lo:hi].bfloat16().float(), info, lo, HIDDEN, spec)
        assert torch.equal(got, want.reshape(-1)[lo:hi])
    assert not torch.equal(raw, want)  # the scale is not 1


def test_qkv_split_with_mha_batches_all_three_blocks():
    split = (HEAD_DIM, HEAD_DIM, HEAD_DIM)  # one head per group: Q, K, V share a shape
    u = _randn(GROUPS * 3 * HEAD_DIM, HIDDEN)
    spec = OrthoSpec(5, "quintic", "highest", 1e-7, "spectral", 1.0)
    (got,) = orthogonalize_matrices([u], [MuonParamInfo(tuple(u.shape), split)], spec)
    per_group = u.view(GROUPS, 3, HEAD_DIM, HIDDEN)
    scale = max(GROUPS * HEAD_DIM, HIDDEN) ** 0.5  # spectral, from the block's shape
    for block in range(3):
        want = scale * newton_schulz(
            per_group[:, block].reshape(-1, HIDDEN), 5, "quintic", "highest"
        )
        block_out = got.view(GROUPS, 3, HEAD_DIM, HIDDEN)[:, block].reshape(-1, HIDDEN)
        torch.testing.assert_close(block_out, want, rtol=0, atol=1e-6)


class ShardingOrthogonalizer:
    """Test double for a distributed orthogonalizer: gets flat 1-D shards, reassembles whole
    matrices from MuonParamInfo, runs the math, hands back shards. Records what it saw."""

    def __init__(self):
        self.seen = []

    def __call__(self, updates, infos, spec):
        self.seen.append([(tuple(u.shape), info) for u, info in zip(updates, infos)])
        whole = [u.view(info.shape) for u, info in zip(updates, infos)]
        return [o.reshape(-1) for o in orthogonalize_matrices(whole, infos, spec)]


def test_orthogonalizer_fed_shards_matches_local_and_scale_comes_from_info():
    w2d = _randn(QKV_ROWS, HIDDEN, seed=1)
    flat = w2d.reshape(-1).clone().requires_grad_()
    full = w2d.clone().requires_grad_()
    info = MuonParamInfo((QKV_ROWS, HIDDEN), SPLIT)
    sharded = ShardingOrthogonalizer()
    opt_flat = Muon([flat], lr=0.01, param_info={flat: info}, orthogonalizer=sharded)
    opt_full = Muon([full], lr=0.01, param_info={full: info})
    for step in range(3):
        grad = _randn(QKV_ROWS, HIDDEN, seed=10 + step)
        flat.grad, full.grad = grad.reshape(-1).clone(), grad.clone()
        opt_flat.step(), opt_full.step()
    assert torch.equal(flat.detach().view(QKV_ROWS, HIDDEN), full.detach())
    assert sharded.seen[0] == [((QKV_ROWS * HIDDEN,), info)]


def test_local_orthogonalizer_rejects_shards():
    flat = _randn(12).requires_grad_()
    opt = Muon([flat], param_info={flat: MuonParamInfo((3, 4))})
    flat.grad = torch.ones(12)
    with pytest.raises(ValueError, match=r"needs whole matrices: tensor \(12,\) vs .* \(3, 4\)"):
        opt.step()
    assert isinstance(opt.orthogonalizer, LocalOrthogonalizer)


# ----------------------------------------------------------------------------- TensorParallelMuon
def _upstream_kwargs(**overrides):
    """Every parameter of upstream 0.19's TensorParallelMuon, by name."""
    kwargs = dict(
        lr=3e-4,
        momentum=0.95,
        nesterov=True,
        weight_decay=0.01,
        use_decoupled_weight_decay=True,
        split_qkv=True,
        is_qkv_fn=lambda p: getattr(p, "is_qkv", False),
        qkv_split_shapes=SPLIT,
        fp32_matmul_prec="medium",
        coefficient_type="quintic",
        num_ns_steps=5,
        scale_mode="spectral",
        extra_scale_factor=1.0,
        pg_collection=None,
        tp_mode="duplicated",
    )
    return {**kwargs, **overrides}


def _tp_params():
    qkv = _randn(QKV_ROWS, HIDDEN, seed=2).requires_grad_()
    qkv.is_qkv = True
    return [qkv, _randn(HIDDEN, 4 * HIDDEN, seed=3).requires_grad_()]


class _PgCollection:
    tp = None  # world size 1: what ProcessGroupCollection gives a single process
    expt_tp = None


@pytest.mark.parametrize("pg_collection", [None, _PgCollection()])
@pytest.mark.parametrize("mode", ["blockwise", "duplicated", "distributed", "owner"])
def test_tensor_parallel_muon_equals_muon_with_mapped_settings(mode, pg_collection):
    ours = _tp_params()
    ref = [p.detach().clone().requires_grad_() for p in ours]
    tp = TensorParallelMuon(
        [dict(params=ours, wd_mult=1.0)],
        **_upstream_kwargs(tp_mode=mode, pg_collection=pg_collection),
    )
    qkv_info = {ref[0]: MuonParamInfo((QKV_ROWS, HIDDEN), SPLIT)}
    plain = Muon(
        ref,
        lr=3e-4,
        weight_decay=0.01,
        nesterov=True,
        ns_coefficients="quintic",
        ns_precision="medium",
        matched_adamw_rms=None,
        param_info=qkv_info,
    )
    assert tp.param_info[ours[0]].qkv_split == SPLIT and tp.param_info[ours[1]].qkv_split is None
    for step in range(2):
        for p, q in zip(ours, ref):
            p.grad = _randn(*p.shape, seed=20 + step)
            q.grad = p.grad.clone()
        tp.step(), plain.step()
    for p, q in zip(ours, ref):
        assert torch.equal(p, q)
    assert tp.mode == mode and tp.split_qkv and tp.qkv_split_shapes == SPLIT


def test_tensor_parallel_muon_rejects_bad_mode_and_incomplete_qkv():
    with pytest.raises(ValueError, match="mode must be one of"):
        TensorParallelMuon(_tp_params(), **_upstream_kwargs(tp_mode="ring"))
    with pytest.raises(ValueError, match="needs is_qkv_fn and qkv_split_shapes"):
        TensorParallelMuon(_tp_params(), **_upstream_kwargs(qkv_split_shapes=None))
    with pytest.raises(ValueError, match="num_ns_steps|ns_steps must be an int >= 1, got 0"):
        TensorParallelMuon(_tp_params(), **_upstream_kwargs(num_ns_steps=0))


def test_tensor_parallel_muon_checks_grads_only_when_asked(monkeypatch):
    """Upstream's TensorParallelMuon checks no grad; ours neither by default (no finiteness
    check, no TP all-reduce per step); on_nonfinite_grad='raise' (or 'skip') opts in."""
    syncs = []
    monkeypatch.setattr(TensorParallelMuon, "_agree", lambda self, ok: syncs.append(ok) or ok)

    def nan_step(**overrides):
        opt = TensorParallelMuon(_tp_params(), **_upstream_kwargs(**overrides))
        for group in opt.param_groups:
            for p in group["params"]:
                p.grad = torch.full_like(p, float("nan"))
        opt.step()

    nan_step()  # upstream's behaviour: the step runs, nothing checked or synchronized
    assert syncs == []
    with pytest.raises(FloatingPointError, match="non-finite gradient"):
        nan_step(on_nonfinite_grad="raise")
    assert syncs == [False]
