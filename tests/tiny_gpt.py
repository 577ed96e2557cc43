"""A tiny real Megatron GPT (local spec, GQA, SwiGLU) that trains identically under any layout.

Used inside ranks started by ``harness.run_distributed``. The pieces that make runs comparable
across (TP, PP, DP, DistOpt, buckets) layouts:

* ``layout_invariant_init``: each weight is drawn from a generator seeded by its *global* name
  (global layer number, global expert index) at its *global* shape, then sliced to the local TP
  shard. Any layout therefore starts from the same model as one process.
* ``global_batches``: the same token data everywhere; each DP rank takes its contiguous slice of
  every global batch, so DP ranks x micro-batches cover exactly the reference's micro-batches.
* ``full_params``: the inverse of the slicing, to compare whole tensors by global name.
"""

import re
import zlib
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn.functional as F
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer import MLATransformerConfig, TransformerConfig

from megatron.core import parallel_state as ps
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.qk_clip import clip_qk


@dataclass
class TinyGPT:
    """Model, data and run settings; every field is layout-independent."""

    num_layers: int = 4
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_query_groups: int = 2
    ffn_hidden_size: int = 96
    vocab_size: int = 128
    seq_length: int = 16
    micro_batch_size: int = 2
    global_batch_size: int = 8
    dtype: str = "fp32"  # fp32 | bf16 | fp16
    tie_embeddings: bool = False
    num_moe_experts: int | None = None
    moe_router_topk: int = 2
    moe_token_dispatcher_type: str = "alltoall"  # allgather avoids the alltoall's CUDA events
    moe_grouped_gemm: bool = False  # the local spec builds SequentialMLP either way (0.19)
    extra: dict = field(default_factory=dict)  # further TransformerConfig fields
    # multi-latent attention: MLATransformerConfig's fields (q_lora_rank, kv_lora_rank,
    # qk_head_dim, qk_pos_emb_head_dim, v_head_dim, ...) on the local spec; None: Megatron's GQA
    mla: dict | None = None


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def transformer_config(spec: TinyGPT) -> TransformerConfig:
    dtype = DTYPES[spec.dtype]
    moe = {}
    if spec.num_moe_experts:
        moe = dict(
            num_moe_experts=spec.num_moe_experts,
            moe_router_topk=spec.moe_router_topk,
            moe_token_dispatcher_type=spec.moe_token_dispatcher_type,
            moe_grouped_gemm=spec.moe_grouped_gemm,
            moe_aux_loss_coeff=0.0,
        )
    fields = dict(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_query_groups,
        ffn_hidden_size=spec.ffn_hidden_size,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        normalization="RMSNorm",
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        virtual_pipeline_model_parallel_size=ps.get_virtual_pipeline_model_parallel_world_size(),
        expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
        expert_tensor_parallel_size=ps.get_expert_tensor_parallel_world_size(),
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=spec.dtype == "bf16",
        fp16=spec.dtype == "fp16",
    )
    if spec.mla is not None:  # MLA has no query groups; RoPE on its qk_pos_emb_head_dim part
        fields.pop("num_query_groups")
        mla = dict(multi_latent_attention=True, rope_type="rope", **spec.mla)
        return MLATransformerConfig(**{**fields, **moe, **mla, **spec.extra})
    return TransformerConfig(**{**fields, **moe, **spec.extra})  # extra: over the defaults


def build_model(
    spec: TinyGPT,
    *,
    distopt=False,
    bucket_size=None,
    overlap_grad_reduce=False,
    overlap_param_gather=False,
    seed=0,
    invariant_init=True,
    ddp_extra=None,
    layer_wise=False,
    muon_layout=False,
):
    """This rank's DDP-wrapped GPT chunks (one per virtual pipeline stage, else one),
    initialized layout-invariantly, with the schedule's callbacks set as Megatron-LM sets them.
    ``ddp_extra``: further ``DistributedDataParallelConfig`` fields. ``layer_wise``: wrapped as
    Megatron-LM wraps them for upstream's LayerWiseDistributedOptimizer (``--optimizer muon
    --use-distributed-optimizer``, its param layout on: ``_wrap_layer_wise``). ``muon_layout``:
    as Megatron-LM wraps them for our Muon's DistOpt (``--muon-impl megatron_muon``: its
    ``compute_full_param_layout``, shard-aligned where that balances); else DDP's own DistOpt
    layout (byte-level)."""
    config = transformer_config(spec)
    vpp = config.virtual_pipeline_model_parallel_size
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=overlap_grad_reduce,
        overlap_param_gather=overlap_param_gather,
        use_distributed_optimizer=distopt,
        bucket_size=bucket_size,
        **(ddp_extra or {}),
    )
    chunks = []
    for stage in range(vpp or 1):
        model = _gpt(spec, config, None if vpp is None else stage)
        if spec.dtype != "fp32":
            model = model.to(DTYPES[spec.dtype])
        if invariant_init:  # else Megatron's own init, which depends on the layout (control)
            layout_invariant_init(model, spec, seed)
        if layer_wise or muon_layout:  # wrapped together below, as Megatron-LM's get_model does
            chunks.append(model)
            continue
        # Megatron-LM: only the first chunk uses buckets (later ones reduce at once)
        ddp = DistributedDataParallel(
            config=config, ddp_config=ddp_config, module=model, disable_bucketing=stage > 0
        )
        chunks.append(ddp)
    if layer_wise:
        chunks = _wrap_layer_wise(chunks, config, ddp_config)
    elif muon_layout:
        from megatron.core.optimizer.megatron_muon.distrib_optimizer import MuonDistributedOptimizer

        wrap = dict(distributed_optimizer_class=MuonDistributedOptimizer)
        chunks = _wrap_layer_wise(chunks, config, ddp_config, **wrap)
    _hook_up_schedule(config, chunks, overlap_grad_reduce, overlap_param_gather)
    return chunks


def _wrap_layer_wise(models: list, config, ddp_config, **wrap) -> list:
    """DDP chunks as Megatron-LM's ``get_model`` makes them for LayerWise (``--optimizer muon
    --use-distributed-optimizer``, default ``--use-layer-wise-param-layout``): its bucket-size
    rule, then ``wrap_model_chunks_with_ddp``, which tags the Muon matrices, gives them a buffer
    of their own laid out by ``LayerWiseDistributedOptimizer.compute_full_param_layout`` (whole
    matrices bin-packed into DP shards) and the rest DistOpt's layout. With ``wrap`` (our Muon's
    ``distributed_optimizer_class``): as ``get_model`` makes them for that DistOpt."""
    from megatron.training.training import resolve_ddp_bucket_size, wrap_model_chunks_with_ddp

    dp_cp = ps.get_data_parallel_group(with_context_parallel=True)
    numel = sum(p.numel() for m in models for p in m.parameters())
    overlap = ddp_config.overlap_grad_reduce
    ddp_config.bucket_size = resolve_ddp_bucket_size(ddp_config, dp_cp, overlap, numel)
    disable = [stage > 0 for stage in range(len(models))]
    first = ps.get_pipeline_model_parallel_rank() == 0
    sizes = [ddp_config.bucket_size if first and not off else None for off in disable]
    return wrap_model_chunks_with_ddp(
        models,
        config,
        ddp_config,
        use_layer_wise_distributed_optimizer=not wrap,
        bucket_sizes=sizes,
        disable_bucketing_per_chunk=disable,
        **wrap,
    )


def _gpt(spec: TinyGPT, config: TransformerConfig, vp_stage) -> GPTModel:
    first = ps.is_pipeline_first_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
    last = ps.is_pipeline_last_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(
            num_experts=spec.num_moe_experts,
            moe_grouped_gemm=spec.moe_grouped_gemm,
            multi_latent_attention=spec.mla is not None,
            qk_layernorm=spec.extra.get("qk_layernorm", False),
        ),
        vocab_size=spec.vocab_size,
        max_sequence_length=spec.seq_length,
        pre_process=first,
        post_process=last,
        share_embeddings_and_output_weights=spec.tie_embeddings,
        position_embedding_type="rope",
        vp_stage=vp_stage,
    )


def _hook_up_schedule(config, chunks: list, overlap_grad_reduce, overlap_param_gather) -> None:
    one_or_list = lambda fs: fs[0] if len(fs) == 1 else fs  # noqa: E731
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = one_or_list([c.no_sync for c in chunks])
    if len(chunks) > 1 and overlap_grad_reduce:  # the interleaved schedule launches them
        config.grad_sync_func = [c.start_grad_sync for c in chunks]
    if len(chunks) > 1 and overlap_param_gather:
        config.param_sync_func = [c.start_param_sync for c in chunks]


# ---------------------------------------------------------------- layout-invariant initialization

_LAYER = re.compile(r"decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"experts\.local_experts\.(\d+)\.")


def global_name(model: GPTModel, local_name: str, spec: TinyGPT) -> str:
    """The parameter's name in a one-process model (global layer number, global expert index)."""
    name = local_name.removeprefix("module.")
    match = _LAYER.search(name)
    if match:
        layer = model.decoder.layers[int(match.group(1))].layer_number - 1
        name = _LAYER.sub(f"decoder.layers.{layer}.", name, count=1)
    match = _EXPERT.search(name)
    if match:
        per_rank = spec.num_moe_experts // ps.get_expert_model_parallel_world_size()
        expert = ps.get_expert_model_parallel_rank() * per_rank + int(match.group(1))
        name = _EXPERT.sub(f"experts.local_experts.{expert}.", name, count=1)
    if spec.tie_embeddings and name == "output_layer.weight":
        name = "embedding.word_embeddings.weight"  # the same tensor in a one-process model
    return name


def _tp_world(param) -> tuple:
    """(size, rank, group) of the TP group that shards this param, or (1, 0, None)."""
    if not getattr(param, "tensor_model_parallel", False):
        return 1, 0, None
    if not getattr(param, "allreduce", True):  # expert params use the expert-TP group
        return (
            ps.get_expert_tensor_parallel_world_size(),
            ps.get_expert_tensor_parallel_rank(),
            ps.get_expert_tensor_parallel_group(),
        )
    return (
        ps.get_tensor_model_parallel_world_size(),
        ps.get_tensor_model_parallel_rank(),
        ps.get_tensor_model_parallel_group(),
    )


def _is_swiglu_fc1(name: str) -> bool:
    # Each TP rank holds [gate_r; up_r] of the full [gate; up]: slice both halves, not the whole.
    return name.endswith("linear_fc1.weight") or name.endswith("linear_fc1.bias")


def _full_shape(param, tp: int) -> list:
    shape = list(param.shape)
    if tp > 1:
        shape[param.partition_dim] *= tp
    return shape


def _draw(name: str, shape, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()) + seed)
    if "norm" in name:  # RMSNorm weights near one, as a trained model has them
        return 1.0 + 0.1 * torch.randn(shape, generator=gen)
    return 0.05 * torch.randn(shape, generator=gen)


def shard(full: torch.Tensor, name: str, dim: int, tp: int, rank: int) -> torch.Tensor:
    if tp == 1:
        return full
    if _is_swiglu_fc1(name):
        gate, up = full.chunk(2, dim=dim)
        return torch.cat([gate.chunk(tp, dim)[rank], up.chunk(tp, dim)[rank]], dim=dim)
    return full.chunk(tp, dim=dim)[rank]


def unshard(shards: list, name: str, dim: int) -> torch.Tensor:
    if len(shards) == 1:
        return shards[0]
    if _is_swiglu_fc1(name):
        halves = [s.chunk(2, dim=dim) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=dim)
    return torch.cat(shards, dim=dim)


@torch.no_grad()
def layout_invariant_init(model: GPTModel, spec: TinyGPT, seed: int = 0) -> None:
    for local_name, param in model.named_parameters():
        name = global_name(model, local_name, spec)
        tp, rank, _ = _tp_world(param)
        full = _draw(name, _full_shape(param, tp), seed)
        param.copy_(shard(full, name, getattr(param, "partition_dim", 0), tp, rank))


@torch.no_grad()
def full_params(model_chunks, spec: TinyGPT) -> dict:
    """{global name: full fp32 tensor} of this rank's stage (all TP/expert-TP shards gathered)."""
    return _gathered(model_chunks, spec, lambda param: param.data)


@torch.no_grad()
def full_grads(model_chunks, spec: TinyGPT) -> dict:
    """As ``full_params``, of the params' ``main_grad`` (DDP's grad buffer)."""
    return _gathered(model_chunks, spec, lambda param: param.main_grad)


def _gathered(model_chunks, spec: TinyGPT, pick) -> dict:
    out = {}
    for chunk in model_chunks:
        model = chunk.module
        for local_name, param in model.named_parameters():
            name = global_name(model, local_name, spec)
            tp, _, group = _tp_world(param)
            local = pick(param)
            shards = [torch.empty_like(local) for _ in range(tp)]
            if tp > 1:
                torch.distributed.all_gather(shards, local.contiguous(), group=group)
            else:
                shards = [local]
            out[name] = unshard(shards, name, getattr(param, "partition_dim", 0)).float().clone()
    return out


def gather_all_params(model_chunks, spec: TinyGPT) -> dict:
    """Every stage's and every expert rank's full params, merged, on every rank."""
    mine = full_params(model_chunks, spec)
    everyone = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, mine)
    merged = {}
    for params in everyone:
        merged.update(params)
    return merged


# ---------------------------------------------------------------------------- data and training


def global_batches(spec: TinyGPT, steps: int, seed: int = 0) -> list:
    """``steps`` global batches of tokens [global_batch_size, seq_length + 1], same everywhere."""
    gen = torch.Generator().manual_seed(seed)
    shape = (steps, spec.global_batch_size, spec.seq_length + 1)
    return list(torch.randint(0, spec.vocab_size, shape, generator=gen))


def _micro_batches(spec: TinyGPT, batch: torch.Tensor) -> list:
    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    mine = batch.chunk(dp)[rank]
    return list(mine.split(spec.micro_batch_size))


def _forward_step(data_iterator, model):
    tokens = next(data_iterator)
    inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    positions = torch.arange(inputs.shape[1]).unsqueeze(0).expand_as(inputs)
    loss = model(inputs, positions, None, labels=labels)

    def loss_func(per_token):
        mean = per_token.float().mean()
        # the schedule divides the returned loss in place by the micro-batch count: report a copy
        return mean, {"lm loss": mean.detach().clone()}

    return loss, partial(loss_func)


def train_step(spec: TinyGPT, model_chunks, optimizer, batch: torch.Tensor) -> dict:
    """One optimizer step on a global batch; returns loss (last stage; else nan) and step info."""
    micro = _micro_batches(spec, batch)
    for chunk in model_chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    data = [iter(micro) for _ in model_chunks]  # virtual stages: one iterator per chunk
    losses = get_forward_backward_func()(
        forward_step_func=_forward_step,
        data_iterator=data[0] if len(data) == 1 else data,
        model=model_chunks,
        num_microbatches=len(micro),
        seq_length=spec.seq_length,
        micro_batch_size=spec.micro_batch_size,
        forward_only=False,
    )
    ok, grad_norm, _ = optimizer.step()
    max_logit = _clip_qk(model_chunks, optimizer)
    info = {"ok": ok, "grad_norm": grad_norm, "max_logit": max_logit}
    return {"loss": _dp_mean_loss(losses), **info}


def _clip_qk(model_chunks, optimizer):
    """clip_qk where the config asks for it, else None without calling it: upstream 0.16.1's
    clip_qk has another signature, and these helpers also drive plain upstream (upstream_core)."""
    config = model_chunks[0].module.config
    if not (config.qk_clip or config.log_max_attention_logit):
        return None
    return clip_qk(model_chunks, optimizer=optimizer)


def _dp_mean_loss(losses: list) -> float:
    """The global batch's mean loss on last-stage ranks (each DP rank saw 1/dp of it); else nan."""
    if not losses:
        return float("nan")
    loss = torch.stack([x["lm loss"] for x in losses]).mean()
    torch.distributed.all_reduce(loss, group=ps.get_data_parallel_group())
    return loss.item() / ps.get_data_parallel_world_size()


def build_optimizer(spec: TinyGPT, model_chunks, **overrides):
    params = dict(optimizer="adam", lr=1e-2, weight_decay=0.01, clip_grad=0.0)
    params.update(bf16=spec.dtype == "bf16", fp16=spec.dtype == "fp16")
    params.update(overrides)
    optimizer = get_megatron_optimizer(OptimizerConfig(**params), model_chunks)
    for chunk in model_chunks:
        chunk.module.config.grad_scale_func = optimizer.scale_loss
    return optimizer


def train(
    spec: TinyGPT,
    steps: int,
    *,
    distopt=False,
    bucket_size=None,
    overlap=False,
    seed=0,
    invariant_init=True,
    optimizer_hook=None,
    ddp_extra=None,
    muon_layout=False,
    **optimizer_overrides,
):
    """Train ``steps`` steps on the shared data; return (initial params, final params, losses).

    ``optimizer_hook(optimizer)``, if given, runs once after the optimizer is built (tests use it
    to swap in a reference orthogonalizer or to break one on purpose).
    """
    model = build_model(
        spec,
        distopt=distopt,
        bucket_size=bucket_size,
        overlap_grad_reduce=overlap,
        overlap_param_gather=overlap,
        seed=seed,
        invariant_init=invariant_init,
        ddp_extra=ddp_extra,
        muon_layout=muon_layout,
    )
    initial = gather_all_params(model, spec)
    optimizer = build_optimizer(
        spec, model, use_distributed_optimizer=distopt, **optimizer_overrides
    )
    if optimizer_hook is not None:
        optimizer_hook(optimizer)
    losses = [train_step(spec, model, optimizer, b)["loss"] for b in global_batches(spec, steps)]
    if overlap:  # the last step's param all-gather otherwise waits for the next forward
        for chunk in model:
            chunk.start_param_sync(force_sync=True)
    return initial, gather_all_params(model, spec), losses
