"""Cross-flag checks and derived values for the parsed command line, as tables of rules.

Each rule is (is_bad(args), message(args)); the first bad one raises ``ArgumentsError`` with its
message, which names the flag(s) and what is allowed. ``UNSUPPORTED`` lists known flags whose
feature this stack does not run: using one is an error naming it, never a silent no-op.
"""

import importlib.util
import math
import os
import re

import torch

from megatron.core.optimizer.muon_config import MAX_PLAN_TFLOPS, MIN_PLAN_GBPS

from . import memory_history, pipeline_layout, pipeline_split, profiling, rerun
from .arguments import FLAGS, ArgumentsError, allowed_values

REQUIRED = (
    ("num_layers", "--num-layers"),
    ("hidden_size", "--hidden-size"),
    ("num_attention_heads", "--num-attention-heads"),
    ("seq_length", "--seq-length"),
    ("micro_batch_size", "--micro-batch-size"),
    ("lr", "--lr"),
)

POSITIVE = (
    ("num_layers", "--num-layers"),
    ("hidden_size", "--hidden-size"),
    ("num_attention_heads", "--num-attention-heads"),
    ("seq_length", "--seq-length"),
    ("micro_batch_size", "--micro-batch-size"),
    ("train_iters", "--train-iters"),
    ("train_samples", "--train-samples"),
    ("lr_decay_samples", "--lr-decay-samples"),
    ("lr_decay_iters", "--lr-decay-iters"),
    ("lr_wsd_decay_iters", "--lr-wsd-decay-iters"),
    ("lr_wsd_decay_samples", "--lr-wsd-decay-samples"),
    ("seed", "--seed"),  # Megatron-LM refuses a seed <= 0
    ("tensor_model_parallel_size", "--tensor-model-parallel-size"),
    ("pipeline_model_parallel_size", "--pipeline-model-parallel-size"),
    ("expert_model_parallel_size", "--expert-model-parallel-size"),
    ("log_interval", "--log-interval"),
    ("eval_interval", "--eval-interval"),
    ("global_batch_size", "--global-batch-size"),
    ("save_interval", "--save-interval"),
    ("save_retain_interval", "--save-retain-interval"),
    ("exit_interval", "--exit-interval"),
    ("num_experts", "--num-experts"),
    ("muon_num_ns_steps", "--muon-num-ns-steps"),
    ("tensorboard_log_interval", "--tensorboard-log-interval"),
    ("tensorboard_queue_size", "--tensorboard-queue-size"),
    ("log_memory_interval", "--log-memory-interval"),
    ("muon_plan_nvlink_domain", "--muon-plan-nvlink-domain"),
    ("ddp_num_buckets", "--ddp-num-buckets"),
)

# The planner's machine: a rate in (0, MAX_PLAN_TFLOPS], bandwidths >= MIN_PLAN_GBPS, where inf
# means a free link (the planner then weighs FLOPs alone); past these a byte's cost overflows.
_RATE = (lambda v: 0 < v <= MAX_PLAN_TFLOPS, f"in (0, {MAX_PLAN_TFLOPS:g}] (TFLOP/s per GPU)")
_GBPS = (lambda v: v >= MIN_PLAN_GBPS, f">= {MIN_PLAN_GBPS:g} (Gb/s per GPU; inf: a free link)")
PLAN_RANGES = (
    ("muon_plan_tflops", "--muon-plan-tflops", *_RATE),
    ("muon_plan_dp_link_gbps", "--muon-plan-dp-link-gbps", *_GBPS),
    ("muon_plan_nvlink_gbps", "--muon-plan-nvlink-gbps", *_GBPS),
    ("muon_plan_min_efficiency", "--muon-plan-min-efficiency", lambda v: 0 < v <= 1, "in (0, 1]"),
)
INFINITE_OK = ("muon_plan_dp_link_gbps", "muon_plan_nvlink_gbps")

# Flags whose only effect is on TensorBoard's output: without --tensorboard-dir they would do
# nothing, so they are refused rather than ignored.
TENSORBOARD_ONLY = (
    ("log_timers_to_tensorboard", "--log-timers-to-tensorboard"),
    ("log_memory_to_tensorboard", "--log-memory-to-tensorboard"),
    ("log_world_size_to_tensorboard", "--log-world-size-to-tensorboard"),
    ("log_loss_scale_to_tensorboard", "--no-log-loss-scale-to-tensorboard"),
    ("tensorboard_log_interval", "--tensorboard-log-interval"),
    ("tensorboard_queue_size", "--tensorboard-queue-size"),
    ("moe_per_layer_logging", "--moe-per-layer-logging"),
)


# Muon settings of the DistributedOptimizer's exchange and plan: without it they do nothing.
DISTOPT_ONLY = (
    "muon_distopt_exchange_dtype",
    "muon_plan_tflops",
    "muon_plan_dp_link_gbps",
    "muon_plan_nvlink_gbps",
    "muon_plan_nvlink_domain",
    "muon_plan_min_efficiency",
)


def _tensorboard_only(args):
    """The first TensorBoard-only flag given, or None."""
    return next((flag for dest, flag in TENSORBOARD_ONLY if dest in args.given), None)


def _has_te() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


UNSUPPORTED = (
    (
        lambda a: a.transformer_impl == "transformer_engine" and not _has_te(),
        "--transformer-impl transformer_engine: Transformer Engine is not installed here; "
        "use --transformer-impl local",
    ),
    (
        lambda a: a.sequence_parallel and a.transformer_impl == "local",
        "--sequence-parallel is not supported with --transformer-impl local (its torch LayerNorm "
        "is not sequence-parallel aware); use transformer_engine or drop the flag",
    ),
    (
        lambda a: a.multi_latent_attention and a.transformer_impl == "local",
        "--multi-latent-attention needs --transformer-impl transformer_engine (megatron-core "
        "0.16.1's local attention cannot take MLA's head dimensions)",
    ),
    (
        lambda a: a.recompute_granularity is not None and not torch.cuda.is_available(),
        "--recompute-granularity (or --recompute-activations, which sets it to selective) needs "
        "CUDA here (megatron-core 0.16.1's recomputed attention builds its causal mask on the GPU)",
    ),
    (
        lambda a: a.ddp_average_in_collective and not torch.cuda.is_available(),
        "--ddp-average-in-collective reduces gradients with ReduceOp.AVG, which gloo (the CPU "
        "backend) does not have; drop the flag on CPU (the default pre-scales and sums: the "
        "same mean)",
    ),
    (
        lambda a: (a.ddp_bucket_size, a.ddp_num_buckets) != (None, None)
        and not a.overlap_grad_reduce,
        "--ddp-bucket-size / --ddp-num-buckets size the DDP buckets, which megatron-core uses only "
        "with --overlap-grad-reduce (without it a model chunk's grads reduce as one bucket): add "
        "--overlap-grad-reduce or drop them",
    ),
    (
        lambda a: a.ddp_pad_buckets_for_high_nccl_busbw and not a.use_distributed_optimizer,
        "--ddp-pad-buckets-for-high-nccl-busbw pads the distributed optimizer's buckets only: add "
        "--use-distributed-optimizer or drop it",
    ),
    (
        lambda a: a.exit_on_missing_checkpoint and not a.load,
        "--exit-on-missing-checkpoint exits when --load holds no checkpoint: it needs --load",
    ),
    (
        lambda a: a.ddp_num_buckets is not None and a.ddp_bucket_size is not None,
        "--ddp-num-buckets and --ddp-bucket-size both set the DDP bucket size: give one (as "
        "Megatron-LM)",
    ),
    (
        lambda a: a.context_parallel_size > 1,
        "--context-parallel-size > 1: context parallelism needs Transformer Engine attention",
    ),
    (
        lambda a: a.moe_token_dispatcher_type == "flex",
        "--moe-token-dispatcher-type flex needs DeepEP/HybridEP (CUDA); use alltoall or allgather",
    ),
    (
        lambda a: a.muon_scalar_optimizer != "adam",
        "--muon-scalar-optimizer: only adam here (the non-matrix params use AdamW inside the Muon "
        "optimizer)",
    ),
    (
        lambda a: a.position_embedding_type in ("mrope", "relative"),
        "--position-embedding-type mrope/relative: multimodal RoPE and T5's relative positions "
        "are not built here; use learned_absolute, rope or none",
    ),
    (
        lambda a: a.transformer_impl == "local" and a.attention_backend in ("flash", "fused"),
        "--attention-backend {flash,fused} needs --transformer-impl transformer_engine; "
        "with local: auto, local or unfused",
    ),
    (
        lambda a: a.cross_entropy_loss_fusion
        and a.cross_entropy_fusion_impl == "te"
        and not _has_te(),
        "--cross-entropy-fusion-impl te needs Transformer Engine (not installed here); use native",
    ),
    (
        lambda a: a.tensorboard_dir and importlib.util.find_spec("tensorboard") is None,
        "--tensorboard-dir needs the tensorboard package: pip install tensorboard",
    ),
)

# numpy takes seeds below 2**32; each pipeline stage adds 100 to --seed (initialize.set_seeds)
MAX_SEED = 2**32 - 1


def _max_seed(a) -> int:
    return MAX_SEED - 100 * (a.pipeline_model_parallel_size - 1)


# megatron-core reads --split as its numbers (up to three) and divides by their sum
_SPLIT = re.compile(r"\s*[0-9.]+\s*(?:[,/]\s*[0-9.]+\s*){0,2}")


def _bad_split(split) -> bool:
    if split is None:
        return False
    try:
        values = [float(x) for x in re.findall(r"[0-9.]+", split)]
    except ValueError:  # "1..2"
        return True
    return not (_SPLIT.fullmatch(split) and sum(values) > 0)


RULES = (
    (lambda a: a.bf16 and a.fp16, lambda a: "--bf16 and --fp16 are exclusive: pick one"),
    (
        lambda a: _bad_split(a.split),
        lambda a: f"--split {a.split!r} must be one to three non-negative proportions "
        "(train,valid,test; e.g. 969,30,1 or 98,2,0) with a positive sum",
    ),
    (
        lambda a: a.seed > _max_seed(a),
        lambda a: f"--seed must be <= {_max_seed(a)} (numpy takes seeds below 2**32 and each "
        f"pipeline stage adds 100), got {a.seed}",
    ),
    (
        lambda a: a.lr_warmup_iters < 0,
        lambda a: f"--lr-warmup-iters must be >= 0, got {a.lr_warmup_iters}",
    ),
    (
        lambda a: a.lr_warmup_samples < 0,
        lambda a: f"--lr-warmup-samples must be >= 0, got {a.lr_warmup_samples}",
    ),
    (
        lambda a: a.deterministic_mode and (a.cross_entropy_loss_fusion or a.use_flash_attn),
        lambda a: "--deterministic-mode excludes --cross-entropy-loss-fusion and --use-flash-attn "
        "(not deterministic; Megatron-LM refuses the combination too)",
    ),
    (
        lambda a: a.use_checkpoint_opt_param_scheduler and a.override_opt_param_scheduler,
        lambda a: "--use-checkpoint-opt_param-scheduler and --override-opt_param-scheduler are "
        "exclusive: take the lr/wd schedule from the checkpoint, or from the command line",
    ),
    (
        lambda a: a.squared_relu and a.swiglu,
        lambda a: "--squared-relu and --swiglu are exclusive: pick one activation",
    ),
    (
        lambda a: {"glu_linear_offset", "activation_func_clamp_value"} & a.given
        and not (a.swiglu or a.quick_geglu),
        lambda a: "--glu-linear-offset and --activation-func-clamp-value act on a gated MLP: "
        "add --swiglu or --quick-geglu (without one they would be ignored)",
    ),
    (
        lambda a: a.activation_func_clamp_value is not None
        and not a.activation_func_clamp_value > 0,
        lambda a: f"--activation-func-clamp-value must be > 0, got {a.activation_func_clamp_value}",
    ),
    (
        lambda a: a.no_rope_freq is not None and a.position_embedding_type != "rope",
        lambda a: "--no-rope-freq picks layers that skip RoPE: it needs --position-embedding-type "
        f"rope (got {a.position_embedding_type})",
    ),
    (
        lambda a: not 0 < a.rotary_percent <= 1,
        lambda a: f"--rotary-percent must be in (0, 1], got {a.rotary_percent}",
    ),
    (
        lambda a: a.layernorm_epsilon <= 0,
        lambda a: f"--norm-epsilon must be > 0, got {a.layernorm_epsilon}",
    ),
    (
        lambda a: a.world_size % _model_parallel(a),
        lambda a: f"--tensor-model-parallel-size ({a.tensor_model_parallel_size}) x "
        f"--pipeline-model-parallel-size ({a.pipeline_model_parallel_size}) = "
        f"{_model_parallel(a)} must divide the world size ({a.world_size})",
    ),
    (
        lambda a: a.padded_vocab_size is not None
        and (a.padded_vocab_size < 1 or a.padded_vocab_size % a.tensor_model_parallel_size),
        lambda a: f"--padded-vocab-size ({a.padded_vocab_size}) must be >= 1 and divisible by "
        f"--tensor-model-parallel-size ({a.tensor_model_parallel_size}): each TP rank holds an "
        "equal slice of the embedding",
    ),
    (
        lambda a: a.num_attention_heads % a.tensor_model_parallel_size,
        lambda a: f"--num-attention-heads ({a.num_attention_heads}) must be divisible by "
        f"--tensor-model-parallel-size ({a.tensor_model_parallel_size})",
    ),
    (
        lambda a: a.num_query_groups % a.tensor_model_parallel_size,
        lambda a: f"--num-query-groups ({a.num_query_groups}) must be divisible by "
        f"--tensor-model-parallel-size ({a.tensor_model_parallel_size})",
    ),
    (
        lambda a: a.num_attention_heads % a.num_query_groups,
        lambda a: f"--num-attention-heads ({a.num_attention_heads}) must be divisible by "
        f"--num-query-groups ({a.num_query_groups})",
    ),
    (
        lambda a: a.kv_channels is None and a.hidden_size % a.num_attention_heads,
        lambda a: f"--hidden-size ({a.hidden_size}) must be divisible by --num-attention-heads "
        f"({a.num_attention_heads}), or give --kv-channels",
    ),
    (
        lambda a: a.global_batch_size % (a.micro_batch_size * a.data_parallel_size),
        lambda a: f"--global-batch-size ({a.global_batch_size}) must be divisible by "
        f"--micro-batch-size ({a.micro_batch_size}) x data-parallel size "
        f"({a.data_parallel_size}) = {a.micro_batch_size * a.data_parallel_size}",
    ),
    (
        lambda a: a.manual_gc_interval < 0,
        lambda a: f"--manual-gc-interval must be >= 0, got {a.manual_gc_interval}",
    ),
    (
        lambda a: {"manual_gc_interval", "manual_gc_eval"} & a.given and not a.manual_gc,
        lambda a: "--manual-gc-interval and --no-manual-gc-eval need --manual-gc (without it the "
        "automatic collector is on)",
    ),
    (
        lambda a: {"qk_clip_alpha", "qk_clip_threshold"} & a.given and not a.qk_clip,
        lambda a: "--qk-clip-alpha and --qk-clip-threshold need --qk-clip (without it nothing "
        "is clipped)",
    ),
    (
        lambda a: a.min_lr is not None and a.min_lr > a.lr,
        lambda a: f"--min-lr ({a.min_lr}) must be <= --lr ({a.lr})",
    ),
    (
        lambda a: "lr_warmup_iters" in a.given and a.lr_warmup_fraction is not None,
        lambda a: "--lr-warmup-iters and --lr-warmup-fraction are exclusive: pick one",
    ),
    (
        lambda a: a.lr_warmup_fraction is not None and not 0 <= a.lr_warmup_fraction <= 1,
        lambda a: f"--lr-warmup-fraction must be in [0, 1], got {a.lr_warmup_fraction}",
    ),
    (
        lambda a: a.lr_decay_style == "WSD"
        and a.lr_wsd_decay_iters is None
        and a.lr_wsd_decay_samples is None,
        lambda a: "--lr-decay-style WSD needs --lr-wsd-decay-iters (or, sample-based, "
        "--lr-wsd-decay-samples)",
    ),
    (
        lambda a: a.decoupled_min_lr is not None and a.decoupled_lr is None,
        lambda a: "--decoupled-min-lr needs --decoupled-lr",
    ),
    (
        lambda a: a.decoupled_lr is not None
        and a.decoupled_min_lr is not None
        and a.decoupled_min_lr > a.decoupled_lr,
        lambda a: f"--decoupled-min-lr ({a.decoupled_min_lr}) must be <= --decoupled-lr "
        f"({a.decoupled_lr})",
    ),
    (
        lambda a: a.position_embedding_type == "learned_absolute"
        and a.seq_length > a.max_position_embeddings,
        lambda a: f"--seq-length ({a.seq_length}) must be <= --max-position-embeddings "
        f"({a.max_position_embeddings}) with learned_absolute positions",
    ),
    (
        lambda a: a.overlap_param_gather and not a.use_distributed_optimizer,
        lambda a: "--overlap-param-gather needs --use-distributed-optimizer",
    ),
    (
        lambda a: a.num_experts is not None and a.num_experts % a.expert_model_parallel_size,
        lambda a: f"--num-experts ({a.num_experts}) must be divisible by "
        f"--expert-model-parallel-size ({a.expert_model_parallel_size})",
    ),
    (
        lambda a: a.moe_pad_expert_input_to_capacity and a.moe_expert_capacity_factor is None,
        lambda a: "--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor (the "
        "capacity it pads to), as Megatron-LM",
    ),
    (
        lambda a: a.expert_model_parallel_size > 1 and a.num_experts is None,
        lambda a: "--expert-model-parallel-size > 1 needs --num-experts",
    ),
    (
        lambda a: a.moe_per_layer_logging and a.num_experts is None,
        lambda a: "--moe-per-layer-logging logs the MoE routers' losses: it needs --num-experts",
    ),
    (
        lambda a: a.expert_model_parallel_size > 1
        and (a.world_size // a.pipeline_model_parallel_size)
        % (a.expert_model_parallel_size * a.tensor_model_parallel_size),
        lambda a: f"--expert-model-parallel-size ({a.expert_model_parallel_size}) x "
        f"--tensor-model-parallel-size ({a.tensor_model_parallel_size}) must divide the ranks of "
        f"one pipeline stage ({a.world_size // a.pipeline_model_parallel_size})",
    ),
    (
        lambda a: a.save_interval is not None and a.save is None,
        lambda a: "--save-interval needs --save",
    ),
    (
        lambda a: a.save_retain_interval is not None and a.save_interval is None,
        lambda a: "--save-retain-interval needs --save and --save-interval (it decides which of "
        "the interval's checkpoints stay)",
    ),
    (
        lambda a: a.save_retain_interval is not None
        and a.save_interval is not None
        and a.save_retain_interval % a.save_interval,
        lambda a: f"--save-retain-interval ({a.save_retain_interval}) must be a multiple of "
        f"--save-interval ({a.save_interval}), as Megatron-LM requires",
    ),
    (
        lambda a: not a.add_position_embedding and a.position_embedding_type != "rope",
        lambda a: "--no-position-embedding is deprecated (Megatron-LM accepts it only with "
        "--position-embedding-type rope, where it changes nothing): for a model without "
        "position embeddings give --position-embedding-type none",
    ),
    (
        lambda a: a.ckpt_format not in ("torch_dist", "torch"),
        lambda a: f"--ckpt-format {a.ckpt_format} is not supported here: this stack writes and "
        "reads torch_dist (the default) and torch checkpoints only",
    ),
    (
        lambda a: a.async_save and a.ckpt_format != "torch_dist",
        lambda a: f"--async-save needs --ckpt-format torch_dist (got {a.ckpt_format}): the "
        "torch format is written synchronously, as in Megatron-LM",
    ),
    (lambda a: a.finetune and a.load is None, lambda a: "--finetune needs --load"),
    (
        lambda a: _tensorboard_only(a) and not a.tensorboard_dir,
        lambda a: f"{_tensorboard_only(a)} configures TensorBoard output: it needs "
        "--tensorboard-dir",
    ),
    (
        lambda a: a.log_muon_figures and a.optimizer != "muon",
        lambda a: "--log-muon-figures reports Muon's own figures: it needs --optimizer muon",
    ),
    (
        lambda a: a.log_progress and not a.save,
        lambda a: "--log-progress writes progress.txt under --save: it needs --save",
    ),
    (
        lambda a: a.log_validation_ppl_to_tensorboard and not a.tensorboard_dir,
        lambda a: "--log-validation-ppl-to-tensorboard needs --tensorboard-dir",
    ),
    (
        lambda a: not a.mock_data and not a.data_path and not _per_split(a),
        lambda a: "no data: give --data-path PREFIX [PREFIX ...] (or --train-data-path, "
        "--valid-data-path, --test-data-path) or --mock-data",
    ),
    (
        lambda a: a.mock_data and (a.data_path or _per_split(a)),
        lambda a: "--mock-data and --data-path (or the per-split paths) are exclusive: pick one",
    ),
    (
        lambda a: "split" in a.given and _per_split(a),
        lambda a: "--split divides --data-path's documents into train, valid and test: with "
        "--train-data-path/--valid-data-path/--test-data-path (or --per-split-data-args-path) "
        "each split has its own files; drop --split (megatron-core refuses the two together)",
    ),
    (
        lambda a: a.data_path and _per_split(a),
        lambda a: "--data-path and --train-data-path/--valid-data-path/--test-data-path are "
        "exclusive (megatron-core: blend and blend_per_split are incompatible)",
    ),
    (
        lambda a: a.dataloader_type == "external",
        lambda a: "--dataloader-type external is not supported here: Megatron-LM then hands the "
        "dataset object to the loop as the iterator, which only a custom training script that "
        "builds its own loader can use; pretrain_gpt.py builds GPT datasets: use single (the "
        "default) or cyclic",
    ),
    (
        lambda a: a.mid_level_dataset_surplus < 0,
        lambda a: f"--mid-level-dataset-surplus must be >= 0, got {a.mid_level_dataset_surplus}",
    ),
    (
        lambda a: a.mock_data and a.per_dataset_sequences_path,
        lambda a: "--per-dataset-sequences-path gives the counts of real data files: not with "
        "--mock-data",
    ),
    (
        lambda a: not a.data_sharding and a.dataloader_type != "cyclic",
        lambda a: "--no-data-sharding changes the shuffled order of --dataloader-type cyclic "
        "only: add --dataloader-type cyclic or drop it",
    ),
    (
        lambda a: a.tokenizer_type not in _tokenizer_types(),
        lambda a: f"--tokenizer-type {a.tokenizer_type} is not supported by this stack; "
        f"implemented: {', '.join(_tokenizer_types())}",
    ),
    (
        lambda a: a.tokenizer_type in _NEEDS_TOKENIZER_MODEL and a.tokenizer_model is None,
        lambda a: f"--tokenizer-type {a.tokenizer_type} needs --tokenizer-model "
        f"({_NEEDS_TOKENIZER_MODEL[a.tokenizer_type]})",
    ),
    (
        lambda a: _TIKTOKEN_FLAGS.keys() & a.given and a.tokenizer_type != "TikTokenizer",
        lambda a: f"{', '.join(_given_tiktoken_flags(a))} configure TikTokenizer: add "
        "--tokenizer-type TikTokenizer or drop them",
    ),
    (
        lambda a: a.vocab_extra_ids and a.tokenizer_type != "SentencePieceTokenizer",
        lambda a: "--vocab-extra-ids adds <extra_id_k> tokens to SentencePieceTokenizer only "
        "(Megatron-LM's BERT tokenizers are not built here): drop it or use that tokenizer",
    ),
    (
        lambda a: a.vocab_extra_ids < 0,
        lambda a: f"--vocab-extra-ids must be >= 0, got {a.vocab_extra_ids}",
    ),
    (
        lambda a: a.tokenizer_type == "TikTokenizer" and a.tiktoken_pattern not in ("v1", "v2"),
        lambda a: f"--tokenizer-type TikTokenizer needs --tiktoken-pattern v1 or v2, got "
        f"{a.tiktoken_pattern}",
    ),
    (
        lambda a: a.tokenizer_type == "NullTokenizer" and a.vocab_size is None,
        lambda a: "--tokenizer-type NullTokenizer needs --vocab-size",
    ),
    (lambda a: a.eval_iters < 0, lambda a: f"--eval-iters must be >= 0, got {a.eval_iters}"),
    (
        lambda a: a.full_validation and a.rampup_batch_size is not None,
        lambda a: "--full-validation cuts the validation split into whole global batches of the "
        "final size: not with --rampup-batch-size",
    ),
    (lambda a: a.num_workers < 0, lambda a: f"--num-workers must be >= 0, got {a.num_workers}"),
)

# Megatron-LM: iteration-based and sample-based training are exclusive, flag by flag; a flag of
# the other form would be silently ignored, so it is an error (checked before deriving).
_ITERATION_FORMS = (
    ("train_iters", "--train-iters"),
    ("lr_decay_iters", "--lr-decay-iters"),
    ("lr_warmup_iters", "--lr-warmup-iters"),
    ("lr_wsd_decay_iters", "--lr-wsd-decay-iters"),
)
_SAMPLE_FORMS = (
    ("train_samples", "--train-samples"),
    ("lr_decay_samples", "--lr-decay-samples"),
    ("lr_warmup_samples", "--lr-warmup-samples"),
    ("lr_wsd_decay_samples", "--lr-wsd-decay-samples"),
    ("rampup_batch_size", "--rampup-batch-size"),
)


def _check_schedule_form(args) -> None:
    iteration = [flag for attr, flag in _ITERATION_FORMS if attr in args.given]
    sample = [flag for attr, flag in _SAMPLE_FORMS if attr in args.given]
    if args.train_iters is None and args.train_samples is None:
        raise ArgumentsError("--train-iters or --train-samples is required")
    if iteration and sample:
        raise ArgumentsError(
            f"iteration-based ({', '.join(iteration)}) and sample-based "
            f"({', '.join(sample)}) training flags are exclusive, as in Megatron-LM: "
            "use --train-iters with the *-iters flags, or --train-samples with the *-samples "
            "flags (--rampup-batch-size needs --train-samples)"
        )
    if args.lr_warmup_fraction is not None and "lr_warmup_samples" in args.given:
        raise ArgumentsError("--lr-warmup-samples and --lr-warmup-fraction are exclusive: pick one")


def _derive_train_iters(args) -> None:
    """Sample-based training: the step count and decay length from the samples."""
    if args.train_samples is None:
        return
    from .schedule import train_iters_from_samples

    if args.lr_decay_samples is None:
        args.lr_decay_samples = args.train_samples
    args.train_iters = train_iters_from_samples(args)
    if args.train_iters < 1:
        raise ArgumentsError(
            f"--train-samples ({args.train_samples}) is less than one global batch "
            f"({args.global_batch_size}): nothing to train"
        )


def _check_warmup(args) -> None:
    """megatron-core's scheduler asserts lr_warmup_steps < lr_decay_steps once the model is
    built: refuse it up front, in the run's unit, naming the flags that set the two lengths."""
    from .schedule import schedule_steps

    steps = schedule_steps(args)
    warmup, decay = steps["lr_warmup_steps"], steps["lr_decay_steps"]
    if warmup < decay:
        return
    form = "samples" if args.train_samples is not None else "iters"
    scale = 1 if form == "samples" else args.global_batch_size
    unit = "samples" if form == "samples" else "iterations"
    warm_flag = "--lr-warmup-fraction" if args.lr_warmup_fraction is not None else None
    warm_flag = warm_flag or f"--lr-warmup-{form}"
    decay_flag = f"--lr-decay-{form}" if f"lr_decay_{form}" in args.given else f"--train-{form}"
    raise ArgumentsError(
        f"{warm_flag} gives a warm-up of {warmup / scale:g} {unit}, not shorter than the lr "
        f"decay ({decay_flag}: {decay / scale:g} {unit}): the warm-up must end before the decay"
    )


VPP_RULES = (
    (
        lambda a: a.pipeline_model_parallel_size < 2,
        lambda a: "--num-layers-per-virtual-pipeline-stage needs "
        "--pipeline-model-parallel-size >= 2",
    ),
    *pipeline_split.VPP_RULES,
    (
        lambda a: pipeline_split.per_stage(a) % a.num_layers_per_virtual_pipeline_stage,
        lambda a: f"--num-layers-per-virtual-pipeline-stage "
        f"({a.num_layers_per_virtual_pipeline_stage}) must divide the layers per pipeline stage "
        f"({pipeline_split.per_stage(a)})",
    ),
)


_NEEDS_TOKENIZER_MODEL = {
    "HuggingFaceTokenizer": "a tokenizer.json or its folder",
    "GPTSentencePieceTokenizer": "a sentencepiece .model file",
    "Llama2Tokenizer": "a sentencepiece .model file",
    "SentencePieceTokenizer": "a sentencepiece .model file",
    "TikTokenizer": "Megatron-LM's JSON list of tiktoken ranks",
}
_TIKTOKEN_FLAGS = {
    "tiktoken_pattern": "--tiktoken-pattern",
    "tiktoken_num_special_tokens": "--tiktoken-num-special-tokens",
    "tiktoken_special_tokens": "--tiktoken-special-tokens",
}


def _given_tiktoken_flags(a) -> list:
    return [flag for dest, flag in _TIKTOKEN_FLAGS.items() if dest in a.given]


def _tokenizer_types() -> tuple:
    from .tokenizer import TOKENIZER_TYPES

    return TOKENIZER_TYPES


def _per_split(a) -> bool:
    return bool(a.train_data_path or a.valid_data_path or a.test_data_path)


def _model_parallel(a) -> int:
    return a.tensor_model_parallel_size * a.pipeline_model_parallel_size


def _check_required(args) -> None:
    for attr, flag in REQUIRED:
        # not given (the home's default is None or 0); a given 0 is checked by its range
        if attr not in args.given and getattr(args, attr) in (None, 0):
            raise ArgumentsError(f"{flag} is required")


def _check_finite(args) -> None:
    """Float flags take finite numbers only: an inf or NaN hyper-parameter trains to NaN."""
    for flag in FLAGS:
        value = getattr(args, flag.attr, None)
        values = value if isinstance(value, list) else [value]  # nargs flags: every value
        for v in values:
            if flag.attr in args.given and isinstance(v, float) and not math.isfinite(v):
                if not (flag.attr in INFINITE_OK and v == math.inf):
                    raise ArgumentsError(f"{flag.names[0]} must be a finite number, got {v}")
    if not args.lr > 0:
        raise ArgumentsError(
            f"--lr must be > 0, got {args.lr} (a zero learning rate trains nothing)"
        )


def _check_table(args) -> None:
    for flag in FLAGS:
        if flag.dest not in args.given or flag.choices:  # argparse checked upstream's choices
            continue
        allowed = allowed_values(flag)
        value = getattr(args, flag.attr, None)
        value = getattr(value, "name", value)  # enums (attention_backend) by name
        if allowed and value is not None and value not in allowed:
            raise ArgumentsError(
                f"{flag.names[0]} {value!r} is not allowed; choose from {list(allowed)}"
            )
    for attr, flag in POSITIVE:
        value = getattr(args, attr)
        if value is not None and value < 1:
            raise ArgumentsError(f"{flag} must be >= 1, got {value}")
    for attr, flag, ok, allowed in PLAN_RANGES:
        value = getattr(args, attr)
        if value is not None and not ok(value):
            raise ArgumentsError(f"{flag} must be {allowed}, got {value}")
    for is_bad, message in UNSUPPORTED:
        if is_bad(args):
            raise ArgumentsError(message)


def _check_rules(args, rules) -> None:
    for is_bad, message in rules:
        if is_bad(args):
            raise ArgumentsError(message(args))


def _derive(args) -> None:
    """Megatron-LM's derived defaults."""
    if "local_rank" not in args.given:  # upstream's default is $LOCAL_RANK (torchrun sets it)
        args.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    args.data_parallel_size = args.world_size // _model_parallel(args)
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * args.data_parallel_size
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    _derive_query_groups(args)
    if isinstance(args.attention_backend, str):
        from megatron.core.transformer.enums import AttnBackend

        args.attention_backend = AttnBackend[args.attention_backend]
    if args.lr_decay_iters is None and args.train_samples is None:
        args.lr_decay_iters = args.train_iters
    if args.data_path and args.split is None:
        args.split = "969, 30, 1"
    _derive_tokenizer_library(args)
    if args.tokenizer_type is None:
        args.tokenizer_type = "NullTokenizer" if args.mock_data else "ByteLevelTokenizer"
    if args.dataloader_type is None:
        args.dataloader_type = "single"  # Megatron-LM's default
    _derive_attention_mask(args)
    if args.mock_data and args.vocab_size is None:
        args.vocab_size = 256  # a small mock vocabulary; Megatron-LM needs one given
    if args.bf16 and not args.grad_reduce_in_bf16:
        args.accumulate_allreduce_grads_in_fp32 = True  # as Megatron-LM: bf16 grads reduced in fp32
    _derive_rotary(args)
    if args.rope_type is None:
        args.rope_type = "yarn" if args.multi_latent_attention else "rope"
    if args.finetune:
        args.no_load_optim = args.no_load_rng = True
    _derive_exit_signal(args)
    upstream_scale = {"muon_scale_mode", "muon_extra_scale_factor"} & args.given
    if upstream_scale and "muon_matched_adamw_rms" not in args.given:
        # upstream 0.16's flags select its scale rule, which the matched-RMS rule would override
        args.muon_matched_adamw_rms = None


def _derive_tokenizer_library(args) -> None:
    """Upstream main's --tokenizer-library names megatron-core's tokenizer library; alone it
    stands for that library's tokenizer type, with --tokenizer-type the two must agree."""
    from .tokenizer import LIBRARY_TYPES, TOKENIZER_TYPES

    library = args.tokenizer_library
    if library is None:
        return
    types = LIBRARY_TYPES[library]
    if not set(types) & set(TOKENIZER_TYPES):
        raise ArgumentsError(
            f"--tokenizer-library {library} is not supported here: megatron-core's byte-level "
            "tokenizer (eos 0, pad 1, 512 ids) is not built by this stack; --tokenizer-type "
            "ByteLevelTokenizer is ours (bytes 0-255, eod 256)"
        )
    if args.tokenizer_type is None:
        args.tokenizer_type = types[0]
    elif args.tokenizer_type not in types:
        raise ArgumentsError(
            f"--tokenizer-library {library} and --tokenizer-type {args.tokenizer_type} disagree: "
            f"the {library} library builds {', '.join(types)}"
        )


def _derive_rotary(args) -> None:
    """Megatron-LM's legacy --use-rotary-position-embeddings means rope; a different
    --position-embedding-type given with it would be overridden silently upstream: refused."""
    if not args.use_rotary_position_embeddings:
        return
    if "position_embedding_type" in args.given and args.position_embedding_type != "rope":
        raise ArgumentsError(
            f"--use-rotary-position-embeddings means --position-embedding-type rope, but "
            f"{args.position_embedding_type} is given: drop one"
        )
    args.position_embedding_type = "rope"


def _derive_attention_mask(args) -> None:
    """--reset-attention-mask acts on the mask the data loader builds, which is off by default
    here (DIFFERENCES): it turns mask building on, said once; with the mask explicitly off it
    would be silently ignored, so that is an error."""
    if not args.reset_attention_mask or args.create_attention_mask_in_dataloader:
        return
    if "create_attention_mask_in_dataloader" in args.given:
        raise ArgumentsError(
            "--reset-attention-mask needs the data loader's attention mask: drop "
            "--no-create-attention-mask-in-dataloader"
        )
    args.create_attention_mask_in_dataloader = True
    args.notices.append(
        "--reset-attention-mask: the data loader builds per-sample attention masks "
        "(documents do not attend to each other)"
    )


def _derive_exit_signal(args) -> None:
    from .exit_conditions import parse_signal

    try:
        args.exit_signal = parse_signal(str(args.exit_signal))
    except ValueError as err:
        raise ArgumentsError(f"--exit-signal: {err}") from None
    if args.exit_duration_in_mins is not None and args.exit_duration_in_mins < 0:
        raise ArgumentsError(
            f"--exit-duration-in-mins must be >= 0, got {args.exit_duration_in_mins}"
        )
    if args.exit_duration_in_mins == 0:
        args.exit_duration_in_mins = None  # Megatron-LM: 0 means no time limit


def _check_optimizer_specific(args) -> None:
    """Muon's flags with another optimizer, and DistOpt-only flags without DistOpt, would be
    silently ignored: refused instead (drop them, or pick the optimizer they configure)."""
    first = {f.dest: f.names[0] for f in reversed(FLAGS)}  # one name per setting
    muon = sorted(first[d] for d in args.given if d.startswith("muon_"))
    if muon and args.optimizer != "muon":
        raise ArgumentsError(
            f"{', '.join(muon)} configure Muon, but --optimizer is {args.optimizer!r}: "
            "add --optimizer muon or drop them"
        )
    distopt = sorted(first[d] for d in args.given if d in DISTOPT_ONLY)
    if distopt and not args.use_distributed_optimizer:
        raise ArgumentsError(
            f"{', '.join(distopt)} configure the DistributedOptimizer's Muon exchange and plan: "
            "add --use-distributed-optimizer or drop them"
        )


def _derive_query_groups(args) -> None:
    """Megatron-LM uses --num-query-groups only with --group-query-attention; without it, every
    head has its own key/value (a given --num-query-groups is ignored, and said so)."""
    if args.group_query_attention:
        return
    if "num_query_groups" in args.given and args.num_query_groups != args.num_attention_heads:
        args.notices.append(
            f"--num-query-groups {args.num_query_groups} is ignored without "
            "--group-query-attention (as in Megatron-LM)"
        )
    args.num_query_groups = args.num_attention_heads


def _derive_optimizer(args) -> None:
    if args.optimizer == "dist_muon":  # core_v0.16.1's spelling, deprecated on upstream main
        args.notices.append(
            "optimizer='dist_muon' is deprecated. "
            "Use --optimizer muon --use-distributed-optimizer instead."
        )
        args.optimizer = "muon"
        args.use_distributed_optimizer = True


def _deliberate_defaults(args) -> None:
    """Where our defaults differ from Megatron-LM's (DIFFERENCES in arguments.py)."""
    if "transformer_impl" not in args.given and not _has_te():
        args.transformer_impl = "local"  # upstream's transformer_engine could only fail here
    if args.eval_interval is None:
        args.eval_interval = 1000


def _unwrap_single_values(args) -> None:
    """Megatron-LM's: one --moe-router-load-balancing-type / --moe-aux-loss-coeff value (the
    flags take one per loss type) is a scalar, which megatron-core expects with one type; a
    one-element list failed in the router (TypeError) or in its length check."""
    for dest in ("moe_router_load_balancing_type", "moe_aux_loss_coeff"):
        value = getattr(args, dest)
        if isinstance(value, list) and len(value) == 1:
            setattr(args, dest, value[0])


def validate_args(args) -> None:
    args.notices = []  # what main prints once at start-up
    _deliberate_defaults(args)
    _derive_optimizer(args)
    _check_required(args)
    _unwrap_single_values(args)
    _check_finite(args)
    _check_optimizer_specific(args)
    if args.recompute_activations:  # Megatron-LM's shorthand, also over --recompute-granularity
        args.recompute_granularity = "selective"
    _check_table(args)
    _check_schedule_form(args)
    _apply_data_args_files(args)
    _derive(args)
    _check_rules(args, RULES)
    if pipeline_layout.given(args):  # before the split's rules: a conflict is named as such
        _check_rules(args, pipeline_layout.RULES)
        args.notices.append(pipeline_layout.notice(args))
    _check_rules(args, pipeline_split.RULES)
    _check_rules(args, profiling.RULES)
    _check_rules(args, memory_history.RULES)
    _check_rules(args, rerun.RULES)
    if args.num_layers_per_virtual_pipeline_stage is not None:
        _check_rules(args, VPP_RULES)
    if args.num_virtual_stages_per_pipeline_rank is not None:
        _check_rules(args, pipeline_split.VIRTUAL_STAGES_RULES)
    args.virtual_pipeline_size = _virtual_pipeline_size(args)  # recorded in checkpoints
    if args.rampup_batch_size is not None:
        _check_rampup(args)
    _check_interleaved_microbatches(args)
    _derive_train_iters(args)
    _check_warmup(args)
    _check_iterations_to_skip(args)
    _check_core_configs(args)


def _virtual_pipeline_size(args):
    from .core_configs import virtual_pipeline_size

    return virtual_pipeline_size(args)


def _check_iterations_to_skip(args) -> None:
    bad = [i for i in args.iterations_to_skip if not 0 <= i < args.train_iters]
    if bad:
        raise ArgumentsError(
            f"--iterations-to-skip {bad}: a step is named by the steps done before it, 0 to "
            f"{args.train_iters - 1} here (as Megatron-LM)"
        )


def _apply_data_args_files(args) -> None:
    from .data_args_files import apply_data_args_path, apply_per_split_data_args

    try:
        apply_data_args_path(args)
        apply_per_split_data_args(args)
    except ValueError as err:
        raise ArgumentsError(str(err)) from None


def _check_core_configs(args) -> None:
    """Build the core configs once now, so that their own checks fail before any process
    group exists (their messages name the config field)."""
    from megatron.core.optimizer.muon_config import validate_muon_config

    from .core_configs import optimizer_config, transformer_config

    for build in (optimizer_config, transformer_config):
        try:
            config = build(args)
            if build is optimizer_config:  # core checks Muon's fields only where Muon is built;
                validate_muon_config(config)  # a bad --muon-* value is an error with any optimizer
        except (ValueError, AssertionError) as err:
            raise ArgumentsError(f"{build.__name__}: {err}") from None


def _check_interleaved_microbatches(args) -> None:
    """megatron-core's interleaved 1F1B runs each virtual stage on groups of PP micro-batches
    (microbatch_group_size_per_vp_stage, PP here): a step's micro-batch count, at every
    --rampup-batch-size size too, must be a multiple of PP, or the first step raises."""
    pp, unit = args.pipeline_model_parallel_size, args.micro_batch_size * args.data_parallel_size
    if args.virtual_pipeline_size is None:
        return
    sizes = [("--global-batch-size", args.global_batch_size)]
    if args.rampup_batch_size is not None:
        start, increment, _ = args.rampup_batch_size
        ramp = range(start, args.global_batch_size, increment)
        sizes = [("--rampup-batch-size", size) for size in ramp] + sizes
    for flag, size in sizes:
        if (size // unit) % pp:
            raise ArgumentsError(
                f"{flag} {size} gives {size // unit} micro-batches per step (of --micro-batch-size "
                f"x data-parallel size = {unit}); the interleaved pipeline schedule (virtual "
                f"stages) needs a multiple of --pipeline-model-parallel-size ({pp})"
            )


def _check_rampup(args) -> None:
    start, increment, samples = args.rampup_batch_size
    unit = args.micro_batch_size * args.data_parallel_size
    if start < 1 or increment < 1 or samples < 1:
        raise ArgumentsError(
            f"--rampup-batch-size values must be >= 1, got {[start, increment, samples]}"
        )
    if start % unit or increment % unit:
        raise ArgumentsError(
            f"--rampup-batch-size start ({start}) and increment ({increment}) must be multiples "
            f"of --micro-batch-size x data-parallel size ({unit})"
        )
    if (args.global_batch_size - start) % increment:
        raise ArgumentsError(
            f"--global-batch-size ({args.global_batch_size}) minus the --rampup-batch-size start "
            f"({start}) must be a multiple of its increment ({increment})"
        )
