"""Muon inside the DistributedOptimizer (ZeRO-1) is exact Muon, balanced and cheap to exchange.

A tiny real GPT (local spec, GQA, SwiGLU, QKV split) trains with ``OptimizerConfig(
optimizer='muon', use_distributed_optimizer=True)`` and small DDP buckets, so that matrices
straddle DP shard boundaries and some ranks hold none of a matrix. Reproduce a case by hand:

    .venv/bin/python -m pytest tests/distributed/test_muon_distopt.py -k dp4 -q
"""

import dataclasses
import functools
import weakref

import pytest
import torch
from harness import run_distributed
from parity import assert_close_runs, misses, update_rel_error, within
from tiny_gpt import TinyGPT, build_model, build_optimizer, global_batches, train, train_step
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from megatron.core.optimizer.megatron_muon.layout import is_shard_aligned
from megatron.core.optimizer.megatron_muon.planner import figures as plan_figures
from megatron.training.muon_recipe import SEED_RECIPE

STEPS = 3
# DDP makes several buckets only with overlap_grad_reduce; 6000 elements cut the tiny GPT into
# ~12 buckets, and matrices straddle DP shard boundaries in every layout.
BUCKET = 6000
MUON = dict(optimizer="muon", muon_fp32_matmul_prec="highest", **SEED_RECIPE)

# Tolerances on parity.update_rel_error, as in test_muon_parity.py: DP sharding only reorders
# fp32 gradient sums (the exchange itself moves fp32 values unchanged and NS runs on the very same
# whole matrix), so fp32 runs agree to ~1e-5; 1e-4 keeps a 10x margin and sits far below a
# broken exchange (~1). bf16: the model computes in bf16, where TP's partial-sum all-reduce rounds
# at 8 mantissa bits (~4e-3); Muon matrices then differ by ~0.1 and the AdamW params (norms,
# embeddings; sign-like first steps) too, the 1-D ones pooled (parity.update_rel_error): 0.3 for
# both. Measured under every summation order tools/parity_margins.py runs (ATEN_CPU_CAPABILITY
# default/avx2 x 1/2 threads per rank): fp32 <= 7.4e-6 (MoE: the AdamW router, 2.7e-5), bf16
# 0.121 (2.5x margin).
TOL = {"fp32": 1e-4, "bf16": 0.3}
LOSS_RTOL = {"fp32": 1e-5, "bf16": 2e-2}

LAYOUTS = {
    "dp2_one_bucket": dict(world_size=2, overlap=False),
    "dp2": dict(world_size=2),
    "dp4": dict(world_size=4),
    "tp2_dp2": dict(world_size=4, tp=2),
    "pp2_dp2": dict(world_size=4, pp=2),
    "tp2_pp2_dp2": dict(world_size=8, tp=2, pp=2),
    "tp2_dp2_distributed_tp": dict(world_size=4, tp=2, muon_tp_mode="distributed"),
    # --ddp-pad-buckets-for-high-nccl-busbw: buckets padded to multiples of 2^16 elements
    "dp4_padded_buckets": dict(
        world_size=4, ddp_extra={"pad_buckets_for_high_nccl_busbw": True}, hook="padded"
    ),
}


def _buckets_are_padded(optimizer):
    """The padded layout is what it says: every bucket a multiple of 2^16 elements."""
    sizes = [
        bucket.grad_data.numel()
        for inner in optimizer.chained_optimizers
        for chunk in inner.model_chunks
        for buffer in chunk.buffers
        for bucket in buffer.buckets
    ]
    assert sizes and all(size % 2**16 == 0 for size in sizes), sizes


HOOKS = {"padded": _buckets_are_padded}


MOE = dict(num_layers=2, num_moe_experts=4, moe_token_dispatcher_type="allgather")


# Negative controls run 1 step (against a 1-step reference): every control misses there, most
# with NaN updates of the broken matrices. (They once seemed to need 2: ``max`` over the errors
# skipped those NaNs; ``parity.worst`` / ``misses`` count them.)
CONTROL_STEPS = 1


@functools.cache
def reference(dtype: str, moe: bool = False, steps: int = STEPS):
    spec = TinyGPT(dtype=dtype, **(MOE if moe else {}))
    return run_distributed(train, 1, args=(spec, steps), kwargs=MUON)[0]


def run_layout(
    dtype, world_size, tp=1, pp=1, ep=1, etp=None, hook=None, moe=False, steps=STEPS, **kwargs
):
    kwargs = {
        **MUON,
        "distopt": True,
        "bucket_size": BUCKET,
        "overlap": True,
        "optimizer_hook": HOOKS.get(hook, hook),
        **kwargs,
    }
    spec = TinyGPT(dtype=dtype, **(MOE if moe else {}))
    layout = dict(tp=tp, pp=pp, ep=ep, etp=etp)
    return run_distributed(train, world_size, **layout, args=(spec, steps), kwargs=kwargs)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_distopt_muon_fp32_matches_one_process(layout):
    got = run_layout("fp32", **LAYOUTS[layout])
    assert_close_runs(reference("fp32"), got, tol=TOL["fp32"], loss_rtol=LOSS_RTOL["fp32"])


# The Gram form's fp32 rounding is ~100x the standard form's relative to the float64 iteration
# (its m x m steps square the condition number: 2e-4 relative on decaying spectra against 2e-6,
# bench/README.md), so two layouts' ulp-different gradients end further apart: measured 6.2e-5
# (DistOpt vs one process) and 5.1e-5 (Gram vs standard) under ATEN_CPU_CAPABILITY default,
# avx2 and native; 5e-4 keeps 8x margin and sits far below a broken exchange (~1).
GRAM_TOL = 5e-4


def test_distopt_muon_gram_form_matches_one_process():
    """``muon_ns_form='auto'``: DistOpt owners (TP ``duplicated``: whole matrices) run the Gram
    form as one process does; it did run (not bit-equal to the standard form, but close)."""
    kwargs = dict(MUON, muon_ns_form="auto")
    ref = run_distributed(train, 1, args=(TinyGPT(dtype="fp32"), STEPS), kwargs=kwargs)[0]
    got = run_layout("fp32", **LAYOUTS["tp2_dp2"], muon_ns_form="auto")
    assert_close_runs(ref, got, tol=GRAM_TOL, loss_rtol=LOSS_RTOL["fp32"])
    initial, standard, _ = reference("fp32")
    errors = update_rel_error(initial, standard, ref[1])
    assert 0 < within(errors, GRAM_TOL)[1] <= GRAM_TOL  # the same polynomial, other roundings


@pytest.mark.parametrize("layout", ["dp4", "tp2_pp2_dp2"])
def test_distopt_muon_bf16_matches_one_process(layout):
    got = run_layout("bf16", **LAYOUTS[layout])
    assert_close_runs(
        reference("bf16"), got, tol=TOL["bf16"], loss_rtol=LOSS_RTOL["bf16"], pool_vectors=True
    )


@pytest.mark.parametrize("etp", [1, 2])
def test_distopt_muon_moe_expert_params_use_the_expert_groups(etp):
    """EP=2 (x expert TP): expert weights sit in the expert DistOpt over the expert DP group.

    The allgather dispatcher: the alltoall one gathers uneven sizes over expert TP, which gloo's
    all_gather cannot do (NCCL can); test_muon_moe.py runs the alltoall one at EP=2.
    """
    got = run_layout("fp32", 4, ep=2, etp=etp, moe=True)
    errors = assert_close_runs(
        reference("fp32", moe=True), got, tol=TOL["fp32"], loss_rtol=LOSS_RTOL["fp32"]
    )
    assert sum(".experts.local_experts." in k for k in errors) == 2 * 2 * 4


def distopts(optimizer) -> list:
    """The DistributedOptimizer instances inside a (possibly chained) Megatron optimizer."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _lose_gathered_pieces(optimizer):
    """Negative control: owners assemble matrices from zeros instead of the received pieces."""
    for distopt in distopts(optimizer):
        ortho = distopt.optimizer.orthogonalizer
        ortho._orthogonalize_owned = functools.partial(_zeros_instead, ortho._orthogonalize_owned)


def _zeros_instead(orthogonalize, ex, receives, received, spec):
    return orthogonalize(ex, receives, torch.zeros_like(received), spec)


def test_negative_control_broken_gather_misses_the_reference():
    initial, ref, _ = reference("fp32", steps=CONTROL_STEPS)
    got = run_layout("fp32", **LAYOUTS["dp4"], hook=_lose_gathered_pieces, steps=CONTROL_STEPS)
    errors = update_rel_error(initial, ref, got[0][1])
    assert misses(errors, 100 * TOL["fp32"])


# ------------------------------------------------------------------ the shard-aligned layout


def _muon_distopt(optimizer):
    (distopt,) = [d for d in distopts(optimizer) if hasattr(d, "muon_plan")]
    return distopt


def _layout_figures(spec, muon_layout: bool, bucket=None) -> tuple:
    """(shard-aligned per DDP buffer, planned exchange bytes per step) of a freshly built
    DistOpt Muon (no step)."""
    overlap = bucket is not None
    model = build_model(
        spec, distopt=True, bucket_size=bucket, overlap_grad_reduce=overlap, muon_layout=muon_layout
    )
    distopt = _muon_distopt(build_optimizer(spec, model, use_distributed_optimizer=True, **MUON))
    return [is_shard_aligned(b) for b in distopt.buffers], plan_figures.bytes_per_step(
        distopt.muon_plan, 4, 4
    )


def _aligned_run(spec: TinyGPT, steps: int):
    """Train at DP=2 with our Muon's layout (as get_model builds it, one bucket: the param
    all-gather goes through ``start_param_sync_for_bucket_group_subset``), counting each step's
    exchange bytes; then the controls, built without a step: DDP's byte-level layout (small
    buckets: matrices straddle shards, so it moves bytes) and a one-layer model, whose four whole
    matrices cannot balance over two ranks."""
    moved = []

    def count(optimizer):
        distopt, step = _muon_distopt(optimizer), optimizer.step
        assert [is_shard_aligned(b) for b in distopt.buffers] == [False, True]

        def counted():
            out = step()
            moved.append(distopt.optimizer.orthogonalizer.bytes_moved)
            return out

        optimizer.step = counted

    run = train(spec, steps, distopt=True, muon_layout=True, optimizer_hook=count, **MUON)
    controls = {
        "byte-level": _layout_figures(spec, muon_layout=False, bucket=BUCKET),
        "one layer": _layout_figures(dataclasses.replace(spec, num_layers=1), muon_layout=True),
    }
    return run, moved, controls


def test_shard_aligned_layout_matches_one_process_and_exchanges_nothing():
    """Where whole matrices balance (DP=2), each stays on its holder: exact Muon, 0 bytes
    exchanged in every step; the byte-level layout of the same model moves bytes, and where
    whole matrices cannot balance the byte-level layout is kept (the exchange balances)."""
    results = run_distributed(_aligned_run, 2, args=(TinyGPT(), STEPS))
    runs = [run for run, _, _ in results]
    assert_close_runs(reference("fp32"), runs, tol=TOL["fp32"], loss_rtol=LOSS_RTOL["fp32"])
    for _, moved, controls in results:
        assert moved == [0] * STEPS
        assert controls["byte-level"][0] == [False] and controls["byte-level"][1] > 0
        assert controls["one layer"][0] == [False] and controls["one layer"][1] > 0


# ------------------------------------------------------------------ bf16 and the exchange dtype


def _exchange_run(exchange: str, force_fp32: bool = False, precision: str = "medium", **overrides):
    """Params, wire dtypes and exchange bytes after 3 steps at DP=4; ``force_fp32``: the
    exchange as before it followed the NS dtype (fp32 both ways, owners scale)."""

    def hook(optimizer):
        for distopt in distopts(optimizer):
            ortho = distopt.optimizer.orthogonalizer
            if force_fp32:
                ortho.forward_dtype = ortho.return_dtype = torch.float32
                ortho.scale_at_holder = False
            record["wire"] = (str(ortho.forward_dtype), str(ortho.return_dtype))
            record["ortho"] = ortho

    record = {}
    kwargs = dict(muon_fp32_matmul_prec=precision, muon_distopt_exchange_dtype=exchange)
    kwargs.update(overrides)
    _, params, _ = train(
        TinyGPT(),
        STEPS,
        distopt=True,
        bucket_size=BUCKET,
        overlap=True,
        optimizer_hook=hook,
        **{**MUON, **kwargs},
    )
    return params, record["wire"], record["ortho"].bytes_moved


def _bf16_exchanges():
    return {
        "auto": _exchange_run("fp32"),
        "fp32": _exchange_run("fp32", force_fp32=True),
        "bf16": _exchange_run("bf16"),
        "fp32 NS, fp32": _exchange_run("fp32", precision="highest"),
        "fp32 NS, bf16": _exchange_run("bf16", precision="highest"),
    }


@functools.cache
def bf16_exchange_runs():
    return run_distributed(_bf16_exchanges, 4)


def test_bf16_newton_schulz_exchanges_bf16_with_the_same_numbers_as_fp32():
    """NS in bf16 casts its input first, so moving bf16 instead of fp32 to the owners rounds the
    same values once, at another place; its output is bf16 values, so owners return it unscaled
    in bf16 and holders scale it (the same fp32 product): bit-identical params at half the bytes
    of the fp32 exchange, whatever ``muon_distopt_exchange_dtype`` says. Negative control of the
    comparison: the fp32-NS run differs."""
    for rank in bf16_exchange_runs():
        (auto, wire, auto_bytes), (fp32, fp32_wire, fp32_bytes) = rank["auto"], rank["fp32"]
        assert wire == ("torch.bfloat16", "torch.bfloat16") and fp32_wire[1] == "torch.float32"
        assert all(torch.equal(auto[k], fp32[k]) for k in fp32)
        assert auto_bytes * 2 == fp32_bytes > 0
        bf16, _, bf16_bytes = rank["bf16"]
        assert all(torch.equal(bf16[k], fp32[k]) for k in fp32) and bf16_bytes == auto_bytes
        other = rank["fp32 NS, fp32"][0]
        assert not all(torch.equal(other[k], fp32[k]) for k in fp32)


def _holder_and_owner_scaled(tp_mode: str):
    # unit_rms_norm: s = sqrt(m / n) differs between the Q and the K/V blocks
    rule = dict(muon_matched_adamw_rms=None, muon_scale_mode="unit_rms_norm")
    runs = [_exchange_run("fp32", force, muon_tp_mode=tp_mode, **rule) for force in (False, True)]
    return [params for params, _, _ in runs]


@pytest.mark.parametrize("tp_mode", ["duplicated", "distributed", "blockwise"])
def test_holders_scale_the_bf16_return_bit_exactly_at_tp2(tp_mode):
    """TP2 x DP2 with fused QKV and a different scale per Q/K/V block (``unit_rms_norm``): owners
    returning unscaled bf16 NS output and holders scaling their TP-local shard pieces give the
    same bits as owners scaling and returning fp32, in every TP mode: the exact ones scale by the
    whole matrix, ``blockwise`` (upstream's default) by the TP-local slice (negative controls,
    checked by hand: one scale for the whole QKV matrix in ``scale_flat_`` fails the first two;
    the TP-global shape fails ``blockwise``, as the review's repro did)."""
    for by_holder, by_owner in run_distributed(_holder_and_owner_scaled, 4, tp=2, args=(tp_mode,)):
        assert by_holder.keys() == by_owner.keys()
        assert all(torch.equal(by_holder[k], by_owner[k]) for k in by_owner)


def test_bf16_exchange_dtype_with_fp32_newton_schulz_rounds_both_ways():
    """``muon_distopt_exchange_dtype='bf16'`` with fp32 NS: the momentum sent and the scaled
    update returned are rounded to bf16 (8 bits: relative error <= 2^-9 per element); over 3
    steps the changed params change the gradients, and params end 4.7% (of the update) from
    the fp32 exchange's, measured under every summation order of tools/parity_margins.py;
    0.15 leaves 3x margin and sits far below a broken exchange (~1)."""
    initial, _, _ = reference("fp32")
    for rank in bf16_exchange_runs():
        (fp32, wire32, bytes32), (bf16, wire16, bytes16) = (
            rank["fp32 NS, fp32"],
            rank["fp32 NS, bf16"],
        )
        assert wire32 == ("torch.float32",) * 2 and wire16 == ("torch.bfloat16",) * 2
        errors = update_rel_error(initial, fp32, bf16)
        assert 0 < within(errors, 0.15)[1] <= 0.15
        assert bytes16 * 2 == bytes32  # 2 B both ways vs 4 B both ways


# ------------------------------------------------------------------------- counted figures

# The setting: 8 layers, buckets of 30 000 elements (about one layer's four matrices),
# so per-bucket sync points would leave most owners idle (efficiency 0.43 was counted there).
COUNT_SPEC = TinyGPT(num_layers=8)
COUNT_BUCKET = 30_000


class MatmulFlops(TorchFunctionMode):
    """Counts the FLOPs of every matmul this process runs (2 m k n per product)."""

    OPS = {torch.matmul, torch.mm, torch.bmm, torch.Tensor.matmul, torch.Tensor.__matmul__}
    FMA = {torch.addmm, torch.baddbmm, torch.Tensor.addmm, torch.Tensor.baddbmm}

    def __init__(self):
        super().__init__()
        self.flops = 0.0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.OPS or func in self.FMA:
            a, b = args[1:3] if func in self.FMA else args[:2]
            self.flops += 2.0 * a.shape[:-1].numel() * a.shape[-1] * b.shape[-1]
        return func(*args, **kwargs)


def count_optimizer_step(optimizer, counter: MatmulFlops) -> None:
    """Count the matmuls of ``optimizer.step`` only (not forward/backward) from now on."""
    step = optimizer.step

    def counted_step():
        with counter:
            return step()

    optimizer.step = counted_step


def _counted_step(window, form="standard"):
    """One real DP step: matmul FLOPs this rank runs between consecutive Muon collectives."""
    model = build_model(
        COUNT_SPEC, distopt=True, bucket_size=COUNT_BUCKET, overlap_grad_reduce=True
    )
    muon = dict(MUON, muon_ns_form=form)
    optimizer = build_optimizer(COUNT_SPEC, model, use_distributed_optimizer=True, **muon)
    (distopt,) = distopts(optimizer)
    ortho = distopt.optimizer.orthogonalizer
    ortho.plan = distopt.muon_plan = plan_figures.with_window(distopt.muon_plan, window)
    counter, segments = MatmulFlops(), []
    exchange = ortho._all_to_all

    def marked(*args, **kwargs):
        segments.append(counter.flops)  # work done since the previous collective
        counter.flops = 0.0
        return exchange(*args, **kwargs)

    ortho._all_to_all = marked
    count_optimizer_step(optimizer, counter)
    train_step(COUNT_SPEC, model, optimizer, global_batches(COUNT_SPEC, 1)[0])
    plan = distopt.muon_plan
    return {
        "segments": segments + [counter.flops],
        "plan_per_exchange": [plan_figures.exchange_ns_flops(plan, ex) for ex in plan.exchanges],
        "critical": plan_figures.critical_path_flops(plan),
        "efficiency": plan_figures.efficiency(plan),
        "sync_points": plan_figures.sync_points(plan),
        "buckets": sum(1 for b in plan.buckets if b.matrices),  # holding Muon matrices
        "per_rank": plan_figures.ns_flops_per_rank(plan),
    }


@functools.cache
def counted_runs(window, form="standard"):
    return run_distributed(_counted_step, 4, args=(window, form))


def _counted_critical_path(ranks) -> float:
    """Sum over segments (between collectives) of the max over ranks of counted FLOPs."""
    segments = [r["segments"] for r in ranks]
    assert len({len(s) for s in segments}) == 1, "ranks ran different numbers of collectives"
    return sum(max(column) for column in zip(*segments))


@pytest.mark.parametrize("window,form", [(None, "standard"), (1, "standard"), (None, "auto")])
def test_counted_critical_path_matches_the_plan(window, form):
    """The plan's figures are what the step executes: per rank and segment the matmul FLOPs
    counted in a real DP=4 step equal the plan's, so its critical path is the counted one.
    ``muon_ns_form='auto'``: the Gram form on the wide matrices (fc1 192 x 64, K and V 32 x
    64), fewer FLOPs, counted as they run."""
    ranks = counted_runs(window, form)
    plan = ranks[0]
    assert plan["buckets"] >= 8
    assert plan["sync_points"] == (1 if window is None else plan["buckets"])
    for rank, counted in enumerate(ranks):  # forward, NS, return per exchange; NS between
        ns = counted["segments"][1::2]
        assert counted["segments"][0::2] == [0.0] * (plan["sync_points"] + 1)
        assert ns == [flops[rank] for flops in plan["plan_per_exchange"]]
    assert _counted_critical_path(ranks) == plan["critical"]
    if form != "standard":  # fewer matmul FLOPs ran: 0.79x of the standard form's here
        ran = [sum(sum(r["segments"]) for r in runs) for runs in (ranks, counted_runs(window))]
        assert ran[0] < 0.85 * ran[1]


def test_one_exchange_keeps_every_rank_busy_whatever_the_bucket_size():
    """Goal: counted parallel efficiency (ideal / critical path) >= 0.9 at DP=4 with buckets of
    about one layer; the bucket-by-bucket schedule (window=1) is the negative control."""
    ideal = sum(counted_runs(None)[0]["per_rank"]) / 4
    ours = ideal / _counted_critical_path(counted_runs(None))
    per_bucket = ideal / _counted_critical_path(counted_runs(1))
    assert ours >= 0.9 and ours == pytest.approx(counted_runs(None)[0]["efficiency"])
    assert per_bucket < 0.7  # 0.62: each bucket's owners work while the others wait


# ------------------------------------------------------------------------- transient memory


def record_peaks(ortho) -> list[int]:
    """Wrap the exchange's ``_run``: each call's peak of live allocations (``LiveBytes``) is
    appended to the returned list."""
    call, peaks = ortho._run, []

    def profiled(*args):
        with LiveBytes() as tracker:
            out = call(*args)
        peaks.append(tracker.peak)
        return out

    ortho._run = profiled
    return peaks


class LiveBytes(TorchDispatchMode):
    """Live bytes of the storages that ops run under this mode allocate, and their peak.

    Each op output is tracked by its storage; a storage counts as freed when the last tracked
    tensor on it (views included: they are op outputs too) is garbage: deterministic, unlike
    sampling a profiler's timeline. Buffers a communication library keeps internally are not
    ours and are not seen.
    """

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.refs: dict[int, list] = {}  # storage address: [bytes, tracked tensors alive]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {_address(a) for a in (*args, *(kwargs or {}).values())}
        for t in out if isinstance(out, (tuple, list)) else [out]:
            key = _address(t)
            if key in self.refs or (key not in inputs and key):  # tracked, or newly allocated
                self._track(t, key)  # (views of tensors made before the mode are not ours)
        return out

    def _track(self, t, key):
        if key not in self.refs:
            self.refs[key] = [t.untyped_storage().nbytes(), 0]
            self.live += self.refs[key][0]
            self.peak = max(self.peak, self.live)
        self.refs[key][1] += 1
        weakref.finalize(t, self._release, key)

    def _release(self, key):
        entry = self.refs[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.live -= entry[0]
            del self.refs[key]


def _address(x) -> int:
    """The storage address of a tensor with elements, else 0."""
    if not isinstance(x, torch.Tensor) or x.untyped_storage().nbytes() == 0:
        return 0
    return x.untyped_storage().data_ptr()


def _measured_transient(tp_mode=None):
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer.megatron_muon.planner.figures import working_set_bytes

    model = build_model(
        COUNT_SPEC, distopt=True, bucket_size=COUNT_BUCKET, overlap_grad_reduce=True
    )
    muon = dict(MUON, muon_tp_mode=tp_mode) if tp_mode else MUON
    optimizer = build_optimizer(COUNT_SPEC, model, use_distributed_optimizer=True, **muon)
    tp = ps.get_tensor_model_parallel_world_size()
    (distopt,) = distopts(optimizer)
    ortho, plan = distopt.optimizer.orthogonalizer, distopt.muon_plan
    peaks = record_peaks(ortho)
    train_step(COUNT_SPEC, model, optimizer, global_batches(COUNT_SPEC, 1)[0])
    muon_bytes = 4 * sum(m.end - m.start for m in plan.matrices)
    return {
        "measured": max(peaks),
        "bound": plan_figures.transient_bytes(
            plan, 4, 4, lambda m, u: working_set_bytes(m, 4, 4, tp, u)
        ),
        "largest": max(
            4 * sum(plan.matrices[i].end - plan.matrices[i].start for i in run)
            for run in _owned_runs(plan)
        ),
        "muon_bytes": muon_bytes,
    }


def _owned_runs(plan) -> list:
    """The batches of whole matrices this rank orthogonalizes together, every exchange's."""
    from megatron.core.optimizer.megatron_muon.config import DEFAULT_NS_BATCH_BYTES
    from megatron.core.optimizer.megatron_muon.exchange import owned_runs

    runs = []
    for ex in plan.exchanges:
        whole = [i for i in ex.matrices if plan.matrices[i].owner == plan.rank]
        runs += owned_runs(plan, whole, plan.rank, 4, DEFAULT_NS_BATCH_BYTES)
    return runs


def test_transient_memory_stays_within_the_stated_bound():
    """Measured peak of the exchange's allocations (``LiveBytes``) <= the plan's bound <= 2 M/dp
    plus a few copies of the largest batch of owned matrices orthogonalized together (its NS
    working set; here all of an owner's, under ``DEFAULT_NS_BATCH_BYTES``), M = Muon momentum
    bytes."""
    for rank in run_distributed(_measured_transient, 4):
        # measured ~2 M/dp (send + receive buffers of the forward exchange): the profiler sees them
        assert rank["muon_bytes"] / 4 <= rank["measured"] <= rank["bound"], rank
        assert rank["bound"] <= 2 * rank["muon_bytes"] / 4 * 1.15 + 8 * rank["largest"]


def test_transient_memory_of_the_distributed_tp_mode_stays_within_the_bound():
    """TP 2 x DP 2, ``distributed``: tp.py's ``stream`` loads each owned matrix when it starts,
    two in flight; the measured peak stays within the plan's bound, which counts the two largest
    working sets (``figures.transient_bytes``)."""
    for rank in run_distributed(_measured_transient, 4, tp=2, args=("distributed",)):
        assert rank["muon_bytes"] / 4 <= rank["measured"] <= rank["bound"], rank
