"""Our Muon under ZeRO-3 (torch FSDP2, Megatron-FSDP) is exact Muon: the same numbers as one
process, every matrix orthogonalized whole, once, by one owner.

A tiny real GPT (local spec, GQA, SwiGLU, QKV split) trains on gloo CPU ranks; every rank's
unsharded params after the steps are compared with one process's. Reproduce a case by hand:

    .venv/bin/python -m pytest tests/distributed/test_fsdp_muon.py -k fsdp2_dp2 -q
"""

import dataclasses
import functools
import math
import os
import sys

import pytest
import torch
from harness import run_distributed
from parity import assert_close_runs, misses, update_rel_error
from tiny_gpt import (
    TinyGPT,
    _gpt,
    _hook_up_schedule,
    _tp_world,
    build_optimizer,
    global_batches,
    global_name,
    layout_invariant_init,
    train,
    train_step,
    transformer_config,
    unshard,
)

from megatron.core import parallel_state as ps
from megatron.core.optimizer import OptimizerConfig
from megatron.core.optimizer.megatron_muon import fsdp
from megatron.core.optimizer.megatron_muon.factory import build_muon
from megatron.core.optimizer.megatron_muon.functional import (
    MuonParamInfo,
    orthogonalize_matrices,
)
from megatron.training.muon_recipe import SEED_RECIPE

STEPS = 3
MUON = dict(optimizer="muon", muon_fp32_matmul_prec="highest", lr=1e-2, weight_decay=0.01)
MUON.update(SEED_RECIPE)

# Tolerance on parity.update_rel_error, as the DistOpt parity tests (test_muon_distopt.py) and
# for their reason: ZeRO-3 only reorders fp32 gradient sums (FSDP2 reduce-scatters per
# micro-batch; Megatron-FSDP per bucket), the exchange moves fp32 values unchanged and Newton-
# Schulz runs on the very same whole matrix, so fp32 runs agree to ~1e-5; 1e-4 keeps a 10x margin
# and sits far below NS of a local piece (~1, the negative control).
TOL = 1e-4
LOSS_RTOL = 1e-5


# ------------------------------------------------------------------ torch FSDP2 (fully_shard)


def _build_muon(spec, model, config_overrides):
    config = OptimizerConfig(**{**MUON, **config_overrides})
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [dict(params=params, wd_mult=1.0, lr_mult=1.0)]
    muon, _ = build_muon(config, [model], groups)
    return muon


def _forward_backward(spec, model, batch):
    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    micro = list(batch.chunk(dp)[rank].split(spec.micro_batch_size))
    total = 0.0
    for tokens in micro:
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        positions = torch.arange(inputs.shape[1]).unsqueeze(0).expand_as(inputs)
        loss = model(inputs, positions, None, labels=labels).float().mean() / len(micro)
        loss.backward()
        total += loss.item()
    out = torch.tensor([total])
    torch.distributed.all_reduce(out, group=ps.get_data_parallel_group())
    return out.item() / dp


def _full(model, spec) -> dict:
    """{global name: the full param} as this rank sees it (its DTensor's full tensor)."""
    out = {}
    for n, p in model.named_parameters():
        full = p.full_tensor() if isinstance(p, torch.distributed.tensor.DTensor) else p
        out[global_name(model, n, spec)] = full.detach().float().clone()
    return out


def train_fsdp2(spec: TinyGPT, steps: int, hook=None, replicas: int = 1, **config_overrides):
    """(initial params, final params, losses) of ``steps`` steps under FSDP2 (one process:
    plain params); ``replicas`` > 1: HSDP, the DP ranks a (replicas x shards) mesh, Replicate
    over the first dimension and Shard(0) over the second."""
    model = _gpt(spec, transformer_config(spec), None)
    layout_invariant_init(model, spec)
    attrs = {n: dict(vars(p)) for n, p in model.named_parameters()}
    dp = ps.get_data_parallel_world_size()
    if dp > 1:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        mesh = DeviceMesh.from_group(ps.get_data_parallel_group(), "cpu")
        if replicas > 1:  # the DP group is every rank here (no TP, PP)
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh("cpu", (replicas, dp // replicas), mesh_dim_names=("r", "s"))
        for layer in model.decoder.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        for n, p in model.named_parameters():
            for key, value in attrs[n].items():
                setattr(p, key, value)
    initial = _full(model, spec)
    muon = _build_muon(spec, model, config_overrides)  # over DTensors: the exchange attached
    assert isinstance(muon.orthogonalizer, fsdp.Zero3Orthogonalizer) == (dp > 1)
    if dp > 1:  # HSDP: the exchange spans a shard group, not the replicas
        assert {ex.plan.world for ex in muon.orthogonalizer.exchanges} == {dp // replicas}
    if hook is not None:
        hook(muon)
    losses = []
    for batch in global_batches(spec, steps):
        muon.zero_grad()
        losses.append(_forward_backward(spec, model, batch))
        muon.step()
    return initial, _full(model, spec), losses


@functools.cache
def reference_fsdp2(steps: int = STEPS):
    return run_distributed(train_fsdp2, 1, args=(TinyGPT(), steps))[0]


@pytest.mark.parametrize("world_size", [2, 4])
def test_fsdp2_muon_matches_one_process(world_size):
    got = run_distributed(train_fsdp2, world_size, args=(TinyGPT(), STEPS))
    for rank_result in got:  # every DP replica's unsharded params
        assert_close_runs(reference_fsdp2(), [rank_result], tol=TOL, loss_rtol=LOSS_RTOL)


def test_hsdp_fsdp2_muon_matches_one_process():
    """HSDP (FSDP2 on a 2 x 2 mesh): the exchange runs within each shard group of 2; the two
    replicas orthogonalize alike."""
    got = run_distributed(train_fsdp2, 4, args=(TinyGPT(), STEPS), kwargs=dict(replicas=2))
    assert_every_rank_close(reference_fsdp2(), got)


@pytest.mark.parametrize("tp_mode", ["duplicated", "owner", "distributed"])
def test_fsdp2_wrapper_muon_tp2_dp2_matches_one_process(tp_mode):
    """Megatron's own FSDP2 wrapper (``TorchFullyShardedDataParallel``, as ``--use-torch-fsdp2``
    builds it) at TP 2 x DP 2: the exchange over DP brings each TP shard's pieces to an owner,
    whose TP orthogonalizer runs as under the DistOpt (every rank, each replica compared)."""
    from test_fsdp_adam import train_fsdp

    args, kwargs = (TinyGPT(), STEPS, "torch_fsdp2"), dict(MUON, muon_tp_mode=tp_mode)
    got = run_distributed(train_fsdp, 4, tp=2, args=args, kwargs=kwargs)
    assert_every_rank_close(reference(), got)


def _ns_on_local_pieces(muon):
    """Negative control (upstream PR #5961's warning): each rank runs Newton-Schulz on its own
    Shard(0) piece, as if it were the matrix, instead of the exchange."""
    ortho = muon.orthogonalizer

    def local_ns(updates, _infos, spec):
        out = []
        for u in updates:
            piece = fsdp.local(u)
            if not piece.numel():
                out.append(torch.zeros_like(u))
                continue
            shape = tuple(piece.shape)
            o = orthogonalize_matrices([piece.clone()], [MuonParamInfo(shape)], spec)[0]
            out.append(fsdp._like(u, o.reshape(-1)))
        return out

    assert isinstance(ortho, fsdp.Zero3Orthogonalizer)
    muon.orthogonalizer = local_ns


def test_negative_control_ns_on_local_pieces_misses():
    initial, ref, _ = reference_fsdp2(1)
    got = run_distributed(
        train_fsdp2, 2, args=(TinyGPT(), 1), kwargs=dict(hook=_ns_on_local_pieces)
    )
    assert misses(update_rel_error(initial, ref, got[0][1]), 100 * TOL)


# ------------------------------------------------------------------ Megatron-FSDP


def build_megatron_fsdp(
    spec: TinyGPT, strategy: str, bucket_size=None, overlap=True, before_0093=False
):
    """This rank's GPT as Megatron-LM's get_model wraps it for ``--use-megatron-fsdp``
    (``FullyShardedDataParallel``), initialized layout-invariantly, and hooked up to the
    schedule as its train() does with (``overlap``) or without ``--overlap-grad-reduce``; HSDP
    (``--num-distributed-optimizer-instances``) where the run's parallel state has it."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

    config = transformer_config(spec)
    model = _gpt(spec, config, None)
    layout_invariant_init(model, spec)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        use_distributed_optimizer=True,
        use_megatron_fsdp=True,
        data_parallel_sharding_strategy=strategy,
        bucket_size=bucket_size,
        overlap_grad_reduce=overlap,
        overlap_param_gather=overlap and strategy == "optim_grads_params",
        num_distributed_optimizer_instances=_dp_instances(),
    )
    chunk = FullyShardedDataParallel(config=config, ddp_config=ddp_config, module=model)
    # train() hooks no_sync where the wrapper overlaps its grad reduce: --overlap-grad-reduce, or
    # Megatron-FSDP's own setting, on when it shards gradients (patch 0093; before it, the flag
    # alone: see MEGATRON_FSDP and test_hsdp_before_0093_misses)
    hooked = overlap or (chunk.ddp_config.overlap_grad_reduce and not before_0093)
    _hook_up_schedule(config, [chunk], hooked, False)
    if not hooked:
        config.no_sync_func = None
    return [chunk]


def _dp_instances() -> int:
    """The run's HSDP replica count (``run_distributed``'s ``dp_instances``)."""
    outer = ps.get_inter_distributed_optimizer_instance_group(check_initialized=False)
    return outer.size() if outer is not None else 1


def _gathered_fsdp(chunks, spec: TinyGPT) -> dict:
    """{global name: full fp32 tensor} of this rank's Megatron-FSDP params: each optimizer
    param's piece (a range of the flattened TP-local param) gathered over DP, then the TP shards
    as tiny_gpt gathers them."""
    out = {}
    for chunk in chunks:
        model = chunk.module.module
        for local_name, param in chunk.module.param_and_grad_buffer.optimizer_named_parameters:
            name = global_name(model, local_name.removeprefix("module."), spec)
            orig = param.orig_param
            tp_local = _dp_gathered(param)
            tp, _, group = _tp_world(orig)
            shards = [torch.empty_like(tp_local) for _ in range(tp)]
            if tp > 1:
                torch.distributed.all_gather(shards, tp_local, group=group)
            else:
                shards = [tp_local]
            out[name] = unshard(shards, name, getattr(orig, "partition_dim", 0))
    return out


def _dp_gathered(param) -> torch.Tensor:
    """The TP-local param from every DP rank's piece of Megatron-FSDP's flat buffer."""
    buffers = param._megatron_fsdp_model.param_and_grad_buffer
    group = buffers.parameter_groups[buffers.param_to_param_group[param.orig_param]]
    buffer = group.main_weight_buffer or group.model_weight_buffer
    item = buffer.param_idx[param.orig_param]
    lo, _ = buffer._get_item_slice_in_shard(item)
    pieces = [None] * buffer.dp_world_size
    mine = (lo, fsdp.local(param).detach().float().reshape(-1).clone())
    torch.distributed.all_gather_object(pieces, mine, group=buffer.data_parallel_group)
    shape = tuple(buffer.item_index_map[item].shape)
    full = torch.full((math.prod(shape),), float("nan"))
    for at, piece in pieces:
        full[at : at + piece.numel()] = piece
    assert not full.isnan().any(), "the DP pieces cover the param"
    return full.view(shape)


def train_megatron_fsdp(
    spec: TinyGPT,
    steps: int,
    strategy="optim_grads_params",
    hook=None,
    bucket_size=None,
    overlap=True,
    before_0093=False,
    **overrides,
):
    """(initial params, final params, losses) of ``steps`` steps under Megatron-FSDP."""
    chunks = build_megatron_fsdp(spec, strategy, bucket_size, overlap, before_0093)
    initial = _gathered_fsdp(chunks, spec)
    optimizer = build_optimizer(
        spec, chunks, use_distributed_optimizer=True, **{**MUON, **overrides}
    )
    if hook is not None:
        hook(optimizer)
    losses = [train_step(spec, chunks, optimizer, b)["loss"] for b in global_batches(spec, steps)]
    return initial, _gathered_fsdp(chunks, spec), losses


@functools.cache
def reference(steps: int = STEPS, moe: bool = False):
    """One process, Megatron's own path (DDP, no DistOpt), our Muon."""
    spec = TinyGPT(**(MOE if moe else {}))
    return run_distributed(train, 1, args=(spec, steps), kwargs=MUON)[0]


MEGATRON_FSDP = {
    "optim": dict(world_size=2, strategy="optim"),
    # without --overlap-grad-reduce (Megatron-LM's default), hooked up as train() does: no
    # no_sync_func. Megatron-FSDP's 'optim' reduces in its backward hooks only on the last
    # micro-batch (no_sync's exit marks it) and, without overlap, once more in finish_grad_sync:
    # no_sync without overlap, or overlap without no_sync (combinations train() never makes)
    # gave update errors 0.73 and 1.26 with AdamW, 0.57 and 1.12 with Muon (measured, DP 2)
    "optim_no_overlap": dict(world_size=2, strategy="optim", overlap=False),
    "optim_grads_params_no_overlap": dict(
        world_size=2, strategy="optim_grads_params", overlap=False
    ),
    "optim_grads": dict(world_size=2, strategy="optim_grads"),
    "optim_grads_params": dict(world_size=2, strategy="optim_grads_params"),
    # small buckets: several parameter groups, matrices cut by 4 shards, some ranks hold none
    "optim_grads_params_dp4_buckets": dict(
        world_size=4, strategy="optim_grads_params", bucket_size=6000
    ),
    "tp2_optim_grads_params": dict(world_size=4, tp=2, strategy="optim_grads_params"),
    # --muon-tp-mode owner: the DP exchange's owners hand each TP-sharded matrix to one TP rank
    "tp2_owner_optim_grads_params": dict(
        world_size=4, tp=2, strategy="optim_grads_params", muon_tp_mode="owner"
    ),
    # --muon-tp-mode distributed: the owners' TP-sharded matrices streamed (tp.py's ``stream``)
    "tp2_distributed_optim_grads_params": dict(
        world_size=4, tp=2, strategy="optim_grads_params", muon_tp_mode="distributed"
    ),
    # gangs (low split targets, as test_muon_gangs.py): at TP 2 x DP 2 each matrix's NS split
    # over both DP ranks, TP-gathered blocks (duplicated) or each TP rank's own part (distributed)
    "tp2_gangs_optim_grads_params": dict(
        world_size=4, tp=2, strategy="optim_grads_params", gangs=True
    ),
    "tp2_distributed_gangs_optim_grads_params": dict(
        world_size=4, tp=2, strategy="optim_grads_params", muon_tp_mode="distributed", gangs=True
    ),
    # experts over EP 2: their own (expert DP) buffers and exchange beside the dense one
    "ep2_moe_optim_grads_params": dict(world_size=4, ep=2, strategy="optim_grads_params"),
    # HSDP: 2 replicas (--num-distributed-optimizer-instances 2) of 2 shards; the exchange runs
    # within each shard group, and the replicas orthogonalize alike
    "hsdp_2x2_optim_grads_params": dict(world_size=4, instances=2, strategy="optim_grads_params"),
    "hsdp_2x2_optim": dict(world_size=4, instances=2, strategy="optim"),
    "hsdp_2x2_optim_grads_params_no_overlap": dict(
        world_size=4, instances=2, strategy="optim_grads_params", overlap=False
    ),
}
MOE = dict(num_layers=2, num_moe_experts=4, moe_token_dispatcher_type="allgather")


@pytest.mark.parametrize("layout", MEGATRON_FSDP)
def test_megatron_fsdp_muon_matches_one_process(layout):
    case = dict(MEGATRON_FSDP[layout])
    world_size, strategy = case.pop("world_size"), case.pop("strategy")
    instances = case.pop("instances", 1)
    layout = dict(tp=case.pop("tp", 1), ep=case.pop("ep", 1), dp_instances=instances)
    moe = layout["ep"] > 1
    args = (TinyGPT(**(MOE if moe else {})), STEPS, strategy)
    if instances > 1:  # HSDP: each exchange spans one shard group, not the replicas
        case["hook"] = functools.partial(_exchanges_span, world_size // instances)
    if case.get("muon_tp_mode") == "owner":  # the owners run the owner mode's TP exchange
        case["hook"] = _owners_in_owner_mode
    if case.pop("gangs", False):
        case["hook"] = _split_every_exchange
    got = run_distributed(train_megatron_fsdp, world_size, **layout, args=args, kwargs=case)
    assert_every_rank_close(reference(moe=moe), got)


def test_hsdp_before_0093_misses():
    """Control for patch 0093: HSDP without --overlap-grad-reduce hooked up as train() did
    before it (no no_sync) never sums the replicas' gradients: every rank misses the reference
    (measured: 1.03-1.13 update error, bound 100 x TOL)."""
    case = dict(strategy="optim_grads_params", overlap=False, before_0093=True)
    args = (TinyGPT(), STEPS, case.pop("strategy"))
    got = run_distributed(train_megatron_fsdp, 4, dp_instances=2, args=args, kwargs=case)
    initial, ref, _ = reference()
    for _, params, _ in got:
        assert misses(update_rel_error(initial, ref, params), 100 * TOL)


def _owners_in_owner_mode(optimizer) -> None:
    assert {ex.inner.mode for ex in optimizer.optimizer.orthogonalizer.exchanges} == {"owner"}


def _split_every_exchange(optimizer) -> None:
    """Re-plan every exchange with gangs of every DP rank (``test_muon_gangs._split``'s low
    targets, FLOPs alone), on every rank alike; the matrices' layout stays, so the shard infos
    still hold."""
    exchanges = optimizer.optimizer.orthogonalizer.exchanges
    for ex in exchanges:
        model = dataclasses.replace(ex.plan.model, link_flops_per_byte=0.0)
        ex.plan = ex.plan.rebuilt(model=model, targets=(0.1,), bundles=())
        ex.gangs.make_groups(ex.plan)
    assert any(len(m.units) > 1 for ex in exchanges for m in ex.plan.matrices), "no gang"


def _exchanges_span(ranks: int, optimizer) -> None:
    assert {ex.plan.world for ex in optimizer.optimizer.orthogonalizer.exchanges} == {ranks}


def assert_every_rank_close(ref_result, results) -> None:
    """Every rank's params (its stage's, its experts') against the reference's same params, and
    the ranks together hold every param: each replica compared, none merged into another."""
    initial, ref, losses = ref_result
    for rank_initial, params, rank_losses in results:
        rank_ref = ({k: initial[k] for k in params}, {k: ref[k] for k in params}, losses)
        assert_close_runs(
            rank_ref, [(rank_initial, params, rank_losses)], tol=TOL, loss_rtol=LOSS_RTOL
        )
    assert set().union(*(params for _, params, _ in results)) == set(ref)


def test_megatron_fsdp_negative_control_ns_on_local_pieces_misses():
    initial, ref, _ = reference(1)
    hook = lambda optimizer: _ns_on_local_pieces(optimizer.optimizer)  # noqa: E731
    got = run_distributed(train_megatron_fsdp, 2, args=(TinyGPT(), 1), kwargs=dict(hook=hook))
    assert misses(update_rel_error(initial, ref, got[0][1]), 100 * TOL)


def _same_bits(a: dict, b: dict) -> list:
    """The names of the params whose values differ in any bit."""
    assert set(a) == set(b)
    return [k for k in a if not torch.equal(a[k], b[k])]


def test_zero3_muon_is_the_distopts_bit_for_bit_where_the_sums_agree():
    """Ours under Megatron-FSDP ZeRO-3 and under the DistributedOptimizer, upstream's default
    bf16 Newton-Schulz, DP 2: the same bits on every rank where the framework gives both the same
    gradients: one micro-batch per rank (ZeRO-2/3 reduce-scatter every micro-batch's gradients,
    ``grad_reduce_every_bprop`` in megatron_fsdp.py, where DDP sums the micro-batches first) and no
    clipping (the global norm sums the squares of other shards in another order; one fp32 ulp of
    clip coefficient moves a value that sits on a bf16 rounding tie, and bf16 Newton-Schulz
    amplifies it: measured through pretrain_gpt.py, docs/fsdp.md). Control: two micro-batches
    per rank, the same comparison tells the runs apart."""

    def runs(spec):
        kw = dict(MUON, muon_fp32_matmul_prec="medium")
        distopt = run_distributed(train, 2, args=(spec, STEPS), kwargs=dict(kw, distopt=True))
        zero3 = run_distributed(train_megatron_fsdp, 2, args=(spec, STEPS), kwargs=kw)
        return distopt, zero3

    distopt, zero3 = runs(TinyGPT(global_batch_size=4))
    for (_, ref, ref_losses), (_, got, losses) in zip(distopt, zero3):  # each DP replica
        assert _same_bits(ref, got) == [] and losses == ref_losses
    distopt, zero3 = runs(TinyGPT(global_batch_size=8))
    assert all(_same_bits(ref, got) for (_, ref, _), (_, got, _) in zip(distopt, zero3))


# ------------------------------------------------------------------ counted figures (bench)


def _figures_watched(spec: TinyGPT) -> dict:
    """bench/fsdp_figures.py's counts of ours under Megatron-FSDP, and what the step really did:
    the Newton-Schulz FLOPs of the matrices this rank's owners orthogonalized, and the bytes the
    exchange says it moved."""
    import fsdp_figures

    from megatron.core.optimizer.megatron_muon.planner.plan import ns_cost

    done, ortho = [], {}

    def watch(optimizer):
        ortho["z"] = optimizer.optimizer.orthogonalizer
        ortho["steps"] = optimizer.optimizer.ortho_specs()[0].steps
        for ex in ortho["z"].exchanges:
            ex.inner = functools.partial(_recording, ex.inner, done)

    kind, settings = fsdp_figures.VARIANTS["muon_fsdp"]
    out = fsdp_figures.counts(spec, kind, settings, hook=watch)
    second = done[len(done) // 2 :]  # both steps orthogonalize the same matrices
    out["orthogonalized_flops"] = sum(ns_cost(info, ortho["steps"]) for info in second)
    out["bytes_moved"] = ortho["z"].bytes_moved
    return out


def _recording(inner, done, updates, infos, spec):
    done.extend(infos)
    return inner(updates, infos, spec)


def test_counted_figures_are_the_real_steps():
    """The bench's counts tie to a real run: the exchange bytes the collectives recorded are the
    plan's (``bytes_per_step``) and the exchange's own count; the plan's NS FLOPs per rank are
    those of the matrices the rank's owners orthogonalized in the step."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
    ranks = run_distributed(_figures_watched, 2, args=(TinyGPT(),))
    for r in ranks:
        assert r["exchange_bytes"] == r["planned_exchange_bytes"] == r["bytes_moved"] > 0
        assert r["ns_flops"] == r["orthogonalized_flops"] > 0
