"""megatron-core config objects from parsed args: each flag homed in a core dataclass fills its
field (the table in arguments.py), plus the few translations Megatron-LM's flags need."""

import torch
import torch.nn.functional as F
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.transformer import TransformerConfig

from megatron.core.optimizer import OptimizerConfig
from megatron.training import cpu_mode

from .arguments import FLAGS, home_field


def _homed(args, cls) -> dict:
    """{field: value} of every flag whose home is ``cls`` (aliases collapse to one field)."""
    return {
        f.field: getattr(args, f.attr) for f in FLAGS if f.home is cls and home_field(f) is not None
    }


def params_dtype(args) -> torch.dtype:
    return torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32


def transformer_config(args) -> TransformerConfig:
    kw = _homed(args, TransformerConfig)
    dtype = params_dtype(args)
    kw.update(
        gated_linear_unit=args.swiglu,
        activation_func=activation_func(args),
        add_bias_linear=not args.disable_bias_linear,
        params_dtype=dtype,
        pipeline_dtype=dtype,  # bf16/fp16 under PP sends activations in that dtype
        bf16=args.bf16,
        fp16=args.fp16,
        # Drawing full weights on the CPU and slicing keeps TP runs equal to TP=1 ones there.
        use_cpu_initialization=cpu_mode.is_enabled(),
        virtual_pipeline_model_parallel_size=virtual_pipeline_size(args),
    )
    return TransformerConfig(**kw)


def activation_func(args):
    """Megatron-LM's choice: SiLU gated by --swiglu, squared ReLU, else GeLU."""
    if args.swiglu:
        return F.silu
    if args.squared_relu:
        from megatron.core.activations import squared_relu

        return squared_relu
    return F.gelu


def virtual_pipeline_size(args):
    if args.num_layers_per_virtual_pipeline_stage is None:
        return None
    per_stage = args.num_layers // args.pipeline_model_parallel_size
    return per_stage // args.num_layers_per_virtual_pipeline_stage


def optimizer_config(args) -> OptimizerConfig:
    kw = _homed(args, OptimizerConfig)
    kw.update(params_dtype=params_dtype(args))
    if kw.get("min_lr") is None:
        kw["min_lr"] = 0.0  # Megatron-LM's --min-lr default
    return OptimizerConfig(**kw)


def ddp_config(args) -> DistributedDataParallelConfig:
    kw = _homed(args, DistributedDataParallelConfig)
    kw.update(
        use_distributed_optimizer=args.use_distributed_optimizer,
        overlap_param_gather=args.overlap_param_gather,
    )
    return DistributedDataParallelConfig(**kw)
