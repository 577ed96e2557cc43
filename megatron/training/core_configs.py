"""megatron-core config objects from parsed args: every flag whose state in flags.tsv is a core
dataclass field fills that field; the few translations Megatron-LM's flags need are below."""

import torch
import torch.nn.functional as F
from megatron.core.activations import squared_relu
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.transformer import MLATransformerConfig, TransformerConfig

from megatron.core.optimizer import OptimizerConfig
from megatron.training import cpu_mode

from . import pipeline_layout, pipeline_split, rerun
from .arguments import FLAGS


def _homed(args, *classes) -> dict:
    """{field: value} of every flag mapped onto one of ``classes`` (aliases collapse)."""
    return {f.field: getattr(args, f.dest) for f in FLAGS if f.home in classes}


def params_dtype(args) -> torch.dtype:
    return torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32


def activation(args):
    """Megatron-LM's activation flags: --swiglu, --squared-relu, --openai-gelu, --quick-geglu."""
    if args.swiglu:
        return dict(gated_linear_unit=True, activation_func=F.silu)
    if args.quick_geglu:
        from megatron.core.fusions.fused_bias_geglu import quick_gelu

        return dict(gated_linear_unit=True, activation_func=quick_gelu)
    if args.squared_relu:
        return dict(activation_func=squared_relu)
    if args.openai_gelu:
        return dict(activation_func=lambda x: F.gelu(x, approximate="tanh"))
    return dict(activation_func=F.gelu)


def transformer_config(args) -> TransformerConfig:
    mla = args.multi_latent_attention
    kw = _homed(args, TransformerConfig, *([MLATransformerConfig] if mla else []))
    dtype = params_dtype(args)
    kw.update(
        activation(args),
        num_query_groups=args.num_query_groups,
        params_dtype=dtype,
        pipeline_dtype=dtype,  # bf16/fp16 under PP sends activations in that dtype
        # Drawing full weights on the CPU and slicing keeps TP runs equal to TP=1 ones there.
        use_cpu_initialization=cpu_mode.is_enabled() or bool(args.use_cpu_initialization),
        virtual_pipeline_model_parallel_size=virtual_pipeline_size(args),
        **pipeline_p2p(args),
    )
    if args.init_method_xavier_uniform:  # as Megatron-LM: init_method only (the embedding
        kw["init_method"] = torch.nn.init.xavier_uniform_  # follows it; output layers stay scaled)
    return (MLATransformerConfig if mla else TransformerConfig)(**kw)


def virtual_pipeline_size(args):
    """Model chunks per pipeline rank, None without interleaving: one chunk per rank is the
    plain schedule, as Megatron-LM sets it (megatron-core's interleaved schedule with one chunk
    fails at the first step)."""
    if pipeline_layout.given(args):
        return pipeline_layout.virtual_size(args)
    if args.num_virtual_stages_per_pipeline_rank is not None:
        size = args.num_virtual_stages_per_pipeline_rank
    elif args.num_layers_per_virtual_pipeline_stage is not None:
        size = pipeline_split.per_stage(args) // args.num_layers_per_virtual_pipeline_stage
    else:
        return None
    return size if size > 1 else None


def pipeline_p2p(args) -> dict:
    """Megatron-LM's pipeline send/recv settings: with virtual stages overlapped with compute
    (``--no-overlap-p2p-communication``: waited for at once), else batched.

    A batched exchange pairs the messages between two ranks in the order they are posted. At
    PP=2 the previous and the next stage are the same rank, and the interleaved schedule's
    combined exchange (activations to the next stage, grads to the previous one) then hands
    each side the other's tensor, of the same shape: silently wrong training. There the
    waited-for exchange is unbatched (megatron-core orders it by even and odd rank)."""
    vpp = virtual_pipeline_size(args)
    overlap = vpp is not None and args.overlap_p2p_comm
    one_peer = vpp is not None and args.pipeline_model_parallel_size == 2
    return dict(overlap_p2p_comm=overlap, batch_p2p_comm=not overlap and not one_peer)


def optimizer_config(args) -> OptimizerConfig:
    kw = _homed(args, OptimizerConfig)
    # --bf16/--fp16 live in TransformerConfig (their table home) and in OptimizerConfig, as
    # Megatron-LM fills both: there they pick the mixed-precision optimizer (fp32 main params and
    # grads; fp16 loss scaling). Without them a 16-bit model got the FP32 optimizer, which
    # failed on its first step unless the DistributedOptimizer was on, and fp16 had no scaler.
    # --no-barrier-with-level-1-timing likewise fills both configs' barrier_with_L1_time.
    kw.update(params_dtype=params_dtype(args), bf16=args.bf16, fp16=args.fp16)
    kw.update(barrier_with_L1_time=args.barrier_with_L1_time)
    return OptimizerConfig(**kw)


def _grads_checked_by_rerun(args) -> bool:
    """Megatron-LM's check of each bucket's local grad norm (NaN/Inf, before the DP reduction)
    through the rerun state machine (``rerun.checks_nan``); not with fp16 (its loss scaler owns
    overflowing grads)."""
    return rerun.checks_nan(args) and not args.fp16


def ddp_config(args, num_parameters: int = 0) -> DistributedDataParallelConfig:
    """``num_parameters``: this rank's, over all its model chunks; --ddp-num-buckets divides it
    into the bucket size, as Megatron-LM's get_model does."""
    kw = _homed(args, DistributedDataParallelConfig)
    kw.update(
        use_distributed_optimizer=args.use_distributed_optimizer,
        overlap_param_gather=args.overlap_param_gather,
        check_for_nan_in_grad=_grads_checked_by_rerun(args),
    )
    if args.ddp_num_buckets is not None:
        kw.update(bucket_size=max(num_parameters // args.ddp_num_buckets, 1))
    return DistributedDataParallelConfig(**kw)
