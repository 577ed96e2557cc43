"""``pretrain_gpt.py`` on upstream's own training loop (the ``megatron.training`` of megatron-core
0.19): the GPT model, datasets and forward step that upstream's ``pretrain()`` calls, with its CLI,
checkpointing, rerun state machine and signal handler as they are.

    torchrun --nproc-per-node 2 pretrain_gpt.py --mock-data --tokenizer-type NullTokenizer \\
        --vocab-size 128 --num-layers 2 --hidden-size 64 --num-attention-heads 4 \\
        --seq-length 64 --max-position-embeddings 64 --micro-batch-size 2 \\
        --global-batch-size 8 --train-iters 10 --lr 1e-3 --eval-interval 1000 --eval-iters 1

Where CUDA is absent the run takes gloo CPU ranks (``cpu_loop``: ``cpu_mode`` plus the stand-ins
that upstream's loop needs); on GPUs nothing of that is installed (``cpu_loop``'s packaging
stand-in aside). Flags are upstream's (``--help``); the variants this entry does not build
(``--spec``, ``--yaml-cfg``, SFT, heterogeneous layers, ...: ``REFUSED``) are refused, and so, where
Transformer Engine is absent, are the features only it provides (``NEEDS_TE``), each naming the
way out.
"""

import argparse
import importlib.util
import os
import sys
import warnings
from functools import partial

import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.enums import ModelType
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
    get_transformer_block_with_experimental_attention_variant_spec,
    get_transformer_layer_with_experimental_attention_variant_spec,
)
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
    get_gpt_mtp_block_spec,
)
from megatron.core.rerun_state_machine import get_rerun_state_machine
from megatron.core.transformer.multi_token_prediction import mtp_on_this_rank
from megatron.core.utils import (
    get_attr_wrapped_model,
    get_batch_on_this_cp_rank,
    get_batch_on_this_tp_rank,
)
from megatron.training.argument_utils import pretrain_cfg_container_from_args
from megatron.training.arguments import (
    add_megatron_arguments,
    core_transformer_config_from_args,
    parse_and_validate_args,
)
from megatron.training.datasets.fim_dataset import GPTFIMDataset, GPTFIMDatasetConfig
from megatron.training.utils import get_blend_and_blend_per_split, is_first_or_last_pipeline_stage

from megatron.core import mpu
from megatron.training import (
    cpu_loop,
    get_args,
    get_timers,
    get_tokenizer,
    preflight,
    pretrain,
    print_rank_0,
)

# A loss this many times the largest seen so far is "spiky" (--check-for-spiky-loss), as upstream.
SPIKY_LOSS_FACTOR = 10

# (flag, args attribute) of the model and data variants this entry does not build.
REFUSED = (
    ("--spec", "spec"),
    ("--yaml-cfg", "yaml_cfg"),
    ("--sft", "sft"),
    ("--heterogeneous-layers-config-path", "heterogeneous_layers_config_path"),
    ("--dataloader-inter-document-masking", "dataloader_inter_document_masking"),
    ("--hybrid-context-parallel", "hybrid_context_parallel"),
)

# (flag, args attribute, the way out) of what only Transformer Engine provides: refused where it is
# not installed or not the layers' implementation; with it, built as upstream builds them.
NEEDS_TE = (
    (
        "--experimental-attention-variant",
        "experimental_attention_variant",
        "upstream builds its layers with Transformer Engine only; on a machine with TE give "
        "--transformer-impl transformer_engine, else drop it (standard attention)",
    ),
    (
        "--fp8-format",
        "fp8",
        "without TE upstream's layers would train without fp8, silently; drop the fp8 flags "
        "(--fp8-format, --fp8-recipe, --fp8-param-gather, ...) and train with --bf16",
    ),
    (
        "--moe-permute-fusion",
        "moe_permute_fusion",
        "upstream's fused token permutation is TE's (>= 2.1); drop it (the unfused permutation "
        "routes the same tokens)",
    ),
    (
        "--fine-grained-activation-offloading",
        "fine_grained_activation_offloading",
        "upstream offloads through TE's layers only; on a machine with TE give --transformer-impl "
        "transformer_engine, else drop it and --offload-modules",
    ),
    (
        "--fp4-format",
        "fp4",
        "without TE upstream's layers would train without fp4, silently; drop the fp4 flags and "
        "train with --bf16",
    ),
)
# Of NEEDS_TE, those refused with --transformer-impl local even where TE is installed
TE_LAYERS_ONLY = ("experimental_attention_variant", "fine_grained_activation_offloading")
# Of --recompute-modules (with --recompute-granularity selective), those that upstream recomputes
# with CheckpointWithoutOutput, which asks TE's FP8GlobalStateManager whatever the precision (its
# ``fp8 is not None`` holds for fp8=False): without TE, a NameError at the first forward.
RECOMPUTE_NEEDS_TE = ("layernorm", "mla_up_proj")


def te_refusals(args, have_te: bool) -> list:
    """The NEEDS_TE (and RECOMPUTE_NEEDS_TE) messages that apply to ``args`` where TE is (not)
    installed."""
    local = args.transformer_impl != "transformer_engine"
    return ([] if have_te else _recompute_refusals(args)) + [
        f"{flag} needs Transformer Engine"
        + (" layers (--transformer-impl local given)" if have_te else ", which is not installed")
        + f": {way_out}"
        for flag, name, way_out in NEEDS_TE
        if getattr(args, name, None) and (not have_te or (local and name in TE_LAYERS_ONLY))
    ]


def _recompute_refusals(args) -> list:
    if getattr(args, "recompute_granularity", None) != "selective":
        return []
    modules = [m for m in args.recompute_modules or () if m in RECOMPUTE_NEEDS_TE]
    if not modules:
        return []
    return [
        f"--recompute-modules {' '.join(modules)} needs Transformer Engine, which is not "
        "installed (upstream recomputes them with CheckpointWithoutOutput, which reads TE's fp8 "
        "state): drop them from --recompute-modules (core_attn, mlp, moe and shared_experts "
        "recompute without TE)"
    ]


def model_provider(
    pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None
):
    """A GPTModel: TE layer spec with ``--transformer-impl transformer_engine``, else the local
    (torch) one; MoE (``--num-experts``) through the decoder block spec, MTP layers after it."""
    args = get_args()
    print_rank_0("building GPT model ...")
    if config is None:
        config = core_transformer_config_from_args(args)
    use_te = args.transformer_impl == "transformer_engine"
    spec = _layer_spec(args, config, use_te, vp_stage)
    mtp_spec = None
    if args.mtp_num_layers is not None:
        last = spec.layer_specs[-1] if hasattr(spec, "layer_specs") and spec.layer_specs else None
        if last is not None and args.experimental_attention_variant is not None:
            last = get_transformer_layer_with_experimental_attention_variant_spec(config=config)[-1]
        mtp_spec = get_gpt_mtp_block_spec(
            config, last or _layer_spec(args, config, use_te, None, dense=True), use_te, vp_stage
        )
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        rope_scaling=args.use_rope_scaling,
        mtp_block_spec=mtp_spec,
        vp_stage=vp_stage,
        pg_collection=pg_collection,
    )


def _layer_spec(args, config, use_te, vp_stage, dense=False):
    if args.experimental_attention_variant is not None and not dense:  # TE only (NEEDS_TE)
        return get_transformer_block_with_experimental_attention_variant_spec(
            config=config, vp_stage=vp_stage
        )
    if args.num_experts and not dense:
        return get_gpt_decoder_block_spec(
            config,
            use_transformer_engine=use_te,
            normalization=args.normalization,
            qk_l2_norm=args.qk_l2_norm,
            vp_stage=vp_stage,
        )
    options = dict(
        num_experts=config.num_moe_experts,
        moe_grouped_gemm=config.moe_grouped_gemm,
        qk_layernorm=config.qk_layernorm,
        multi_latent_attention=config.multi_latent_attention,
        qk_l2_norm=config.qk_l2_norm,
    )
    if use_te:
        return get_gpt_layer_with_transformer_engine_spec(**options)
    return get_gpt_layer_local_spec(**options, normalization=config.normalization)


def dataset_config(args) -> GPTDatasetConfig:
    """The GPT dataset config of the data flags, with the tokenizer upstream's setup built
    (``--fim-data``: the FIM dataset's config, with upstream's FIM flags)."""
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    fim = {}
    if args.fim_data:
        fim = dict(
            fim_rate=args.fim_rate,
            fim_spm_rate=args.fim_spm_rate,
            fim_extra_tokens={
                "prefix": args.fim_prefix_token,
                "middle": args.fim_middle_token,
                "suffix": args.fim_suffix_token,
                "pad": args.fim_pad_token,
                "eod": args.fim_eod_token,
            },
            fim_split_sample=args.fim_split_sample,
            fim_fragment_rate=args.fim_fragment_rate,
            fim_no_prefix=args.fim_no_prefix,
        )
    return (GPTFIMDatasetConfig if args.fim_data else GPTDatasetConfig)(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=args.split,
        multiple_validation_sets=args.multiple_validation_sets,
        full_validation=args.full_validation,
        num_dataset_builder_threads=args.num_dataset_builder_threads,
        path_to_cache=args.data_cache_path,
        mmap_bin_files=args.mmap_bin_files,
        tokenizer=get_tokenizer(),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
        object_storage_cache_path=args.object_storage_cache_path,
        mid_level_dataset_surplus=args.mid_level_dataset_surplus,
        allow_ambiguous_pad_tokens=args.allow_ambiguous_pad_tokens,
        fast_cache_load=args.dataloader_fast_cache_load,
        defer_npy_index_mmap=args.dataloader_defer_npy_index_mmap,
        context_parallel_size=args.context_parallel_size,
        data_parallel_size=args.data_parallel_size,
        sequence_parallel_size=args.tensor_model_parallel_size * args.sequence_parallel,
        **fim,
    )


def _reads_data(vp_stage=None) -> bool:
    """TP rank 0 of the stages that take tokens or labels (first, last, MTP) reads data."""
    if mpu.get_tensor_model_parallel_rank() != 0:
        return False
    return is_first_or_last_pipeline_stage(vp_stage) or _has_mtp(vp_stage)


def _has_mtp(vp_stage) -> bool:
    config = core_transformer_config_from_args(get_args())
    return mtp_on_this_rank(
        layout=config.pipeline_model_parallel_layout,
        mtp_num_layers=config.mtp_num_layers,
        ignore_virtual=False,
        vp_stage=vp_stage,
    )


def datasets_provider(train_val_test_num_samples, vp_stage=None):
    """(train, valid, test) GPT datasets (``--mock-data``: MockGPTDataset, ``--fim-data``:
    upstream's GPTFIMDataset) from megatron-core's builder; every rank calls it, the readers
    build."""
    args = get_args()
    kind = MockGPTDataset if args.mock_data else GPTFIMDataset if args.fim_data else GPTDataset
    print_rank_0("> building train, validation, and test datasets for GPT ...")
    datasets = BlendedMegatronDatasetBuilder(
        kind, train_val_test_num_samples, partial(_reads_data, vp_stage), dataset_config(args)
    ).build()
    print_rank_0("> finished creating GPT datasets ...")
    return datasets


datasets_provider.is_distributed = True  # upstream's loop calls it on every rank


_BATCH_KEYS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")


def get_batch(data_iterator, vp_stage=None):
    """(tokens, labels, loss_mask, attention_mask, position_ids) of this rank: TP rank 0 reads
    and broadcasts to its TP group, then each context-parallel rank keeps its slice. Stages that
    need neither tokens nor labels get Nones."""
    args = get_args()
    has_mtp = _has_mtp(vp_stage)
    if not is_first_or_last_pipeline_stage(vp_stage) and not has_mtp:
        return (None,) * len(_BATCH_KEYS)
    tp_rank = mpu.get_tensor_model_parallel_rank()
    batch = {}
    if tp_rank == 0:
        batch = next(data_iterator)
        batch = {k: batch[k].cuda(non_blocking=True) if k in batch else None for k in _BATCH_KEYS}
    batch = get_batch_on_this_tp_rank(
        batch,
        has_cu_seqlens=False,
        is_hybrid_cp=False,
        create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
        broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
        broadcast_group=mpu.get_tensor_model_parallel_group(),
        cp_size=args.context_parallel_size,
        tp_rank=tp_rank,
        micro_batch_size=args.micro_batch_size,
        seq_length=args.seq_length,
        mtp_on_this_rank=has_mtp,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        is_pipeline_first_stage=mpu.is_pipeline_first_stage(),
        is_pipeline_last_stage=mpu.is_pipeline_last_stage(),
    )
    batch.setdefault("cu_seqlens", None)
    batch = get_batch_on_this_cp_rank(
        batch, is_hybrid_cp=False, cp_group=mpu.get_context_parallel_group()
    )
    return tuple(batch.get(k) for k in _BATCH_KEYS)


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """(sum of the unmasked tokens' losses, their count, report): the schedule divides by the
    count; ``lm loss`` is reported as the (loss, tokens) pair, reduced over DP. The local loss
    goes through the rerun state machine's NaN/Inf (and spiky-loss) checks first."""
    args = get_args()
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    machine = get_rerun_state_machine()
    if args.check_for_nan_in_loss_and_grad:
        for reject, what in ((torch.isnan, "NaN"), (torch.isinf, "Inf")):
            machine.validate_result(
                result=loss,
                rejection_func=reject,
                message=f"found {what} in local forward loss calculation",
                tolerance=0.0,  # the forward pass is deterministic
                fatal=True,
            )
    if args.check_for_spiky_loss:
        machine.validate_result(
            result=loss,
            rejection_func=partial(
                machine.is_unexpectedly_large, threshold=SPIKY_LOSS_FACTOR, context="loss"
            ),
            message="Spiky loss",
            tolerance=0.0,
            fatal=False,
        )
    num_tokens = mask.sum().clone().detach().to(torch.int)
    report = torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])
    return loss, num_tokens, {"lm loss": report}


def forward_step(data_iterator, model: GPTModel):
    """The model's per-token losses on the next micro-batch, and the loss function for them."""
    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    vp_stage = get_attr_wrapped_model(model, "vp_stage")
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator, vp_stage)
    timers("batch-generator").stop()
    output = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    return output, partial(loss_func, loss_mask)


def main() -> int:
    cpu_loop.install()  # before any process group: CPU stand-ins only where CUDA is absent
    # Before parse_and_validate_args: its set_global_variables already imports wandb on the last
    # rank (and starts the W&B run there).
    flags = _flags()
    missing = [
        f"needs the package {name}: {why}" for name, why in cpu_loop.missing_dependencies(flags)
    ]
    # the tokenizer's files and packages, and those of other flags (einops, ...), on every rank
    missing += preflight.problems(flags)
    if missing:
        return _fail("; ".join(missing))
    args = parse_and_validate_args(args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
    refused = [flag for flag, name in REFUSED if getattr(args, name, None)]
    if refused:
        return _fail(f"not built by this entry: {' '.join(refused)}")
    have_te = _has("transformer_engine")
    needs_te = te_refusals(args, have_te)
    if args.transformer_impl == "transformer_engine" and not have_te:
        needs_te.append(
            "--transformer-impl transformer_engine (the default) needs Transformer Engine, "
            "which is not installed: give --transformer-impl local"
        )
    if needs_te:
        return _fail("; ".join(needs_te))
    with warnings.catch_warnings():  # "use a ModelConfig": this entry gives a model provider
        warnings.filterwarnings("ignore", message=r"(?s).*recommended to use a ModelConfig")
        config = pretrain_cfg_container_from_args(args, None)
    pretrain(
        config,
        datasets_provider,
        ModelType.encoder_or_decoder,
        forward_step,
        model_provider=model_provider,
    )
    return 0


class _Quiet(argparse.ArgumentParser):
    def error(self, message):
        raise ValueError(message)


def _flags():
    """The command line on upstream's parser alone, none of parse_args's side effects (--yaml-cfg,
    MSC), nothing printed; None for --help or where it does not parse (a bad value): upstream's
    parse then answers."""
    parser = _Quiet(add_help=False, allow_abbrev=False)
    try:
        flags, rest = add_megatron_arguments(parser).parse_known_args()
    except ValueError:
        return None
    return None if {"-h", "--help"} & set(rest) else flags


def _has(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def _fail(message: str) -> int:
    if os.environ.get("RANK", "0") == "0":
        print(f"pretrain_gpt.py: error: {message}", file=sys.stderr, flush=True)
    return 2


if __name__ == "__main__":
    sys.exit(cpu_loop.exit_status(main))
