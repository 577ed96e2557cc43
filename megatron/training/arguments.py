"""Megatron-LM compatible command line for pretrain_gpt.py.

    args = parse_args(argv)      # raises ArgumentsError with a message naming the flag

Every flag is one row of ``FLAGS``: its names, the dataclass field that is its home (megatron-core's
``TransformerConfig`` / ``OptimizerConfig`` / ``DistributedDataParallelConfig`` or ours in
``config.py``) and the ``args`` attribute it fills. Defaults are read from the home field, never
written here. Several names for one field (``--muon-ns-steps`` and ``--muon-num-ns-steps``) are
aliases; giving two with different values is an error. Unknown flags fail with the closest known
names. Cross-flag checks live in ``validation.py``.
"""

import argparse
import dataclasses
import difflib
import enum
import os
import typing
from dataclasses import dataclass
from typing import Any, Optional

from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.transformer import TransformerConfig

from megatron.core.optimizer import OptimizerConfig

from . import refused
from .config import CheckpointArgs, DataArgs, LoggingArgs, ModelArgs, TrainingArgs

TC, OC, DDP = TransformerConfig, OptimizerConfig, DistributedDataParallelConfig


class ArgumentsError(ValueError):
    """Bad command line: the message names the flag and what is allowed."""


@dataclass(frozen=True)
class Flag:
    """One command-line flag. ``value`` is what a store_true/store_false-style switch stores."""

    names: tuple
    home: type
    field: str
    dest: Optional[str] = None  # the args attribute; defaults to ``field``
    type: Any = None
    choices: Optional[tuple] = None
    nargs: Any = None
    switch: Optional[bool] = None  # a flag without a value that stores this bool
    help: str = ""

    @property
    def attr(self) -> str:
        return self.dest or self.field


def _float_or_none(text: str):
    return None if text.lower() == "none" else float(text)


def F(names, home, field, **kw) -> Flag:
    return Flag(tuple(names.split()), home, field, **kw)


MODEL = [
    F("--num-layers", TC, "num_layers", type=int),
    F("--hidden-size", TC, "hidden_size", type=int),
    F("--ffn-hidden-size", TC, "ffn_hidden_size", type=int),
    F("--num-attention-heads", TC, "num_attention_heads", type=int),
    F("--num-query-groups", TC, "num_query_groups", type=int),
    F("--group-query-attention", ModelArgs, "group_query_attention", switch=True),
    F("--kv-channels", TC, "kv_channels", type=int),
    F("--seq-length", ModelArgs, "seq_length", type=int),
    F("--max-position-embeddings", ModelArgs, "max_position_embeddings", type=int),
    F("--position-embedding-type", ModelArgs, "position_embedding_type", type=str),
    F("--rotary-base", ModelArgs, "rotary_base", type=int),
    F("--rotary-percent", ModelArgs, "rotary_percent", type=float),
    F("--squared-relu", ModelArgs, "squared_relu", switch=True),
    F("--apply-layernorm-1p", TC, "layernorm_zero_centered_gamma", switch=True),
    F("--norm-epsilon", TC, "layernorm_epsilon", type=float),
    F("--qk-layernorm", TC, "qk_layernorm", switch=True),
    F("--calculate-per-token-loss", TC, "calculate_per_token_loss", switch=True),
    F("--cross-entropy-loss-fusion", TC, "cross_entropy_loss_fusion", switch=True),
    F("--cross-entropy-fusion-impl", TC, "cross_entropy_fusion_impl", type=str),
    F("--normalization", TC, "normalization", choices=("LayerNorm", "RMSNorm")),
    F("--swiglu", ModelArgs, "swiglu", switch=True),
    F(
        "--untie-embeddings-and-output-weights",
        ModelArgs,
        "untie_embeddings_and_output_weights",
        switch=True,
    ),
    F("--disable-bias-linear", ModelArgs, "disable_bias_linear", switch=True),
    F("--init-method-std", TC, "init_method_std", type=float),
    F("--attention-dropout", TC, "attention_dropout", type=float),
    F("--hidden-dropout", TC, "hidden_dropout", type=float),
    F("--transformer-impl", ModelArgs, "transformer_impl", type=str),
    F("--attention-backend", TC, "attention_backend", type=str),
    F("--num-experts", TC, "num_moe_experts", dest="num_experts", type=int),
    F("--moe-router-topk", TC, "moe_router_topk", type=int),
    F("--make-vocab-size-divisible-by", ModelArgs, "make_vocab_size_divisible_by", type=int),
    F("--fp8-format", ModelArgs, "fp8_format", type=str),
    F("--qk-clip", TC, "qk_clip", switch=True, help="QK-clip (MuonClip) after each step"),
    F("--qk-clip-alpha", TC, "qk_clip_alpha", type=float, help="query share of the clip"),
    F("--qk-clip-threshold", TC, "qk_clip_threshold", type=float, help="max logit tau"),
    F("--log-max-attention-logit", TC, "log_max_attention_logit", switch=True),
]

PARALLEL = [
    F("--tensor-model-parallel-size", TC, "tensor_model_parallel_size", type=int),
    F("--pipeline-model-parallel-size", TC, "pipeline_model_parallel_size", type=int),
    F(
        "--num-layers-per-virtual-pipeline-stage",
        ModelArgs,
        "num_layers_per_virtual_pipeline_stage",
        type=int,
    ),
    F("--expert-model-parallel-size", TC, "expert_model_parallel_size", type=int),
    F("--sequence-parallel", TC, "sequence_parallel", switch=True),
    F("--use-distributed-optimizer", OC, "use_distributed_optimizer", switch=True),
    F("--overlap-grad-reduce", DDP, "overlap_grad_reduce", switch=True),
    F("--overlap-param-gather", OC, "overlap_param_gather", switch=True),
    F("--ddp-bucket-size", DDP, "bucket_size", type=int),
    F("--accumulate-allreduce-grads-in-fp32", DDP, "grad_reduce_in_fp32", switch=True),
]

TRAINING = [
    F("--micro-batch-size", TrainingArgs, "micro_batch_size", type=int),
    F("--global-batch-size", TrainingArgs, "global_batch_size", type=int),
    F("--rampup-batch-size", TrainingArgs, "rampup_batch_size", type=int, nargs=3),
    F("--train-iters", TrainingArgs, "train_iters", type=int),
    F("--train-samples", TrainingArgs, "train_samples", type=int),
    F("--exit-interval", TrainingArgs, "exit_interval", type=int),
    F("--exit-duration-in-mins", TrainingArgs, "exit_duration_in_mins", type=float),
    F("--exit-signal-handler", TrainingArgs, "exit_signal_handler", switch=True),
    F("--exit-signal", TrainingArgs, "exit_signal", type=str),
    F("--lr", OC, "lr", type=float),
    F("--min-lr", OC, "min_lr", type=float),
    F("--lr-decay-style", TrainingArgs, "lr_decay_style", type=str),
    F("--lr-decay-iters", TrainingArgs, "lr_decay_iters", type=int),
    F("--lr-warmup-iters", TrainingArgs, "lr_warmup_iters", type=int),
    F("--lr-warmup-fraction", TrainingArgs, "lr_warmup_fraction", type=float),
    F("--lr-warmup-init", TrainingArgs, "lr_warmup_init", type=float),
    F("--lr-decay-samples", TrainingArgs, "lr_decay_samples", type=int),
    F("--lr-warmup-samples", TrainingArgs, "lr_warmup_samples", type=int),
    F("--lr-wsd-decay-samples", TrainingArgs, "lr_wsd_decay_samples", type=int),
    F("--decoupled-lr", OC, "decoupled_lr", type=float),
    F("--decoupled-min-lr", OC, "decoupled_min_lr", type=float),
    F("--lr-wsd-decay-style", TrainingArgs, "lr_wsd_decay_style", type=str),
    F("--lr-wsd-decay-iters", TrainingArgs, "lr_wsd_decay_iters", type=int),
    F("--weight-decay", OC, "weight_decay", type=float),
    F("--start-weight-decay", TrainingArgs, "start_weight_decay", type=float),
    F("--end-weight-decay", TrainingArgs, "end_weight_decay", type=float),
    F("--weight-decay-incr-style", TrainingArgs, "weight_decay_incr_style", type=str),
    F("--clip-grad", OC, "clip_grad", type=float),
    F("--adam-beta1", OC, "adam_beta1", type=float),
    F("--adam-beta2", OC, "adam_beta2", type=float),
    F("--adam-eps", OC, "adam_eps", type=float),
    F("--sgd-momentum", OC, "sgd_momentum", type=float),
    F("--optimizer", OC, "optimizer", choices=("adam", "sgd", "muon")),
    F("--bf16", OC, "bf16", switch=True),
    F("--fp16", OC, "fp16", switch=True),
    F("--loss-scale", OC, "loss_scale", type=float),
    F("--initial-loss-scale", OC, "initial_loss_scale", type=float),
    F("--min-loss-scale", OC, "min_loss_scale", type=float),
    F("--loss-scale-window", OC, "loss_scale_window", type=float),
    F("--hysteresis", OC, "hysteresis", type=int),
    F("--seed", TrainingArgs, "seed", type=int),
    F(
        "--no-check-for-nan-in-loss-and-grad",
        TrainingArgs,
        "check_for_nan_in_loss_and_grad",
        switch=False,
    ),
]

# Seed names, upstream 0.16 names and ours; aliases share a field.
MUON = [
    F("--muon-momentum", OC, "muon_momentum", type=float),
    F("--muon-ns-steps", OC, "muon_num_ns_steps", type=int),
    F("--muon-num-ns-steps", OC, "muon_num_ns_steps", type=int),
    F("--muon-use-nesterov", OC, "muon_use_nesterov", switch=True),
    F("--no-muon-nesterov", OC, "muon_use_nesterov", switch=False),
    F("--muon-scale-mode", OC, "muon_scale_mode", type=str),
    F("--muon-matched-adamw-rms", OC, "muon_matched_adamw_rms", type=_float_or_none),
    F("--muon-extra-scale-factor", OC, "muon_extra_scale_factor", type=float),
    F("--muon-fp32-matmul-prec", OC, "muon_fp32_matmul_prec", type=str),
    F("--muon-tp-mode", OC, "muon_tp_mode", type=str),
    F("--muon-no-split-qkv", OC, "muon_split_qkv", switch=False),
    F("--muon-coefficient-set", OC, "muon_coefficient_type", type=str),
    F("--muon-coefficient-type", OC, "muon_coefficient_type", type=str),
    F("--muon-exchange-dtype", OC, "muon_distopt_exchange_dtype", type=str),
]

DATA = [
    F("--data-path", DataArgs, "data_path", nargs="+"),
    F("--train-data-path", DataArgs, "train_data_path", nargs="*"),
    F("--valid-data-path", DataArgs, "valid_data_path", nargs="*"),
    F("--test-data-path", DataArgs, "test_data_path", nargs="*"),
    F("--no-mmap-bin-files", DataArgs, "mmap_bin_files", switch=False),
    F(
        "--no-create-attention-mask-in-dataloader",
        DataArgs,
        "create_attention_mask_in_dataloader",
        switch=False,
    ),
    F("--dataloader-type", DataArgs, "dataloader_type", type=str),
    F("--split", DataArgs, "split", type=str),
    F("--mock-data", DataArgs, "mock_data", switch=True),
    F("--tokenizer-type", DataArgs, "tokenizer_type", type=str),
    F("--vocab-file", DataArgs, "vocab_file", type=str),
    F("--merge-file", DataArgs, "merge_file", type=str),
    F("--tokenizer-model", DataArgs, "tokenizer_model", type=str),
    F("--vocab-size", ModelArgs, "vocab_size", type=int),
    F("--data-cache-path", DataArgs, "data_cache_path", type=str),
    F("--num-workers", DataArgs, "num_workers", type=int),
]

CHECKPOINT = [
    F("--save", CheckpointArgs, "save", type=str),
    F("--load", CheckpointArgs, "load", type=str),
    F("--save-interval", CheckpointArgs, "save_interval", type=int),
    F("--ckpt-format", CheckpointArgs, "ckpt_format", type=str),
    F("--no-load-optim", CheckpointArgs, "no_load_optim", switch=True),
    F("--no-load-rng", CheckpointArgs, "no_load_rng", switch=True),
    F("--no-save-optim", CheckpointArgs, "no_save_optim", switch=True),
    F("--no-save-rng", CheckpointArgs, "no_save_rng", switch=True),
    F("--finetune", CheckpointArgs, "finetune", switch=True),
]

LOGGING = [
    F("--log-interval", LoggingArgs, "log_interval", type=int),
    F("--eval-interval", LoggingArgs, "eval_interval", type=int),
    F("--eval-iters", LoggingArgs, "eval_iters", type=int),
    F("--full-validation", LoggingArgs, "full_validation", switch=True),
    F("--tensorboard-dir", LoggingArgs, "tensorboard_dir", type=str),
    F("--log-throughput", LoggingArgs, "log_throughput", switch=True),
    F("--log-num-zeros-in-grad", OC, "log_num_zeros_in_grad", switch=True),
    F("--log-params-norm", LoggingArgs, "log_params_norm", switch=True),
    F(
        "--log-validation-ppl-to-tensorboard",
        LoggingArgs,
        "log_validation_ppl_to_tensorboard",
        switch=True,
    ),
]

GROUPS = {
    "model": MODEL,
    "parallelism": PARALLEL,
    "training": TRAINING,
    "muon": MUON,
    "data": DATA,
    "checkpointing": CHECKPOINT,
    "logging": LOGGING,
}
FLAGS = [flag for group in GROUPS.values() for flag in group]


def home_field(flag: Flag) -> Optional[dataclasses.Field]:
    """The dataclass field behind a flag, or None where this build's dataclass lacks it (a Muon
    field that another change adds: the flag then exists but refuses a value)."""
    return {f.name: f for f in dataclasses.fields(flag.home)}.get(flag.field)


def default_of(flag: Flag) -> Any:
    field = home_field(flag)
    if field is None:
        return None
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None if field.default is dataclasses.MISSING else field.default


def allowed_values(flag: Flag) -> Optional[tuple]:
    """The values a flag takes when its home field is a ``Literal`` or an enum: read from the
    type, so that choices have one home too."""
    if flag.choices or home_field(flag) is None:
        return flag.choices
    hint = typing.get_type_hints(flag.home).get(flag.field)
    for candidate in (hint, *typing.get_args(hint)):
        if typing.get_origin(candidate) is typing.Literal:
            return typing.get_args(candidate)
        if isinstance(candidate, type) and issubclass(candidate, enum.Enum):
            return tuple(candidate.__members__)
    return None


def _help(flag: Flag) -> str:
    home = f"{flag.home.__name__}.{flag.field}"
    if home_field(flag) is None:
        return f"{flag.help} [{home}: not in this build]".strip()
    return f"{flag.help} [{home}, default: {default_of(flag)!r}]".strip()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pretrain_gpt.py", allow_abbrev=False, argument_default=argparse.SUPPRESS
    )
    for title, flags in GROUPS.items():
        group = parser.add_argument_group(title)
        for i, flag in enumerate(flags):
            kw = dict(dest=_slot(flag, i, title), help=_help(flag))
            if flag.switch is not None:
                kw.update(action="store_const", const=flag.switch)
            else:
                kw.update(type=flag.type, choices=flag.choices, nargs=flag.nargs)
            group.add_argument(*flag.names, **kw)
    return parser


def _slot(flag: Flag, index: int, group: str) -> str:
    """A private dest per flag name, so that two aliases given together can be compared."""
    return f"{group}:{index}"


def known_flags() -> list:
    return [name for flag in FLAGS for name in flag.names]


def _raise_unknown(unknown: list) -> None:
    for item in unknown:
        if item.startswith("-"):
            name = item.split("=", 1)[0]
            why = refused.reason(name)
            if why:
                raise ArgumentsError(f"{name} is not supported by this stack: {why}")
            close = difflib.get_close_matches(name, known_flags(), n=3, cutoff=0.6)
            # a known flag that is a prefix of the given one (--optimizer for
            # --optimizer-cpu-offload) names another feature, not a misspelling
            close = [c for c in close if not name.startswith(c + "-")]
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ArgumentsError(f"unknown flag {name}{hint}")
    raise ArgumentsError(f"unexpected argument {unknown[0]!r} (flags start with --)")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse would exit(2) with the usage: we want one clear line
        raise ArgumentsError(message)


def _given_values(namespace: argparse.Namespace) -> dict:
    """{args attribute: [(flag name, value), ...]} of the flags on the command line."""
    given: dict = {}
    slots = {_slot(f, i, g): f for g, fs in GROUPS.items() for i, f in enumerate(fs)}
    for slot, value in vars(namespace).items():
        flag = slots[slot]
        given.setdefault(flag.attr, []).append((flag, value))
    return given


def _resolve(given: dict) -> tuple[dict, set]:
    """One value per attribute: defaults from the homes, given values over them; conflicting
    aliases and flags whose home field is missing from this build are errors."""
    values = {flag.attr: default_of(flag) for flag in FLAGS}
    for attr, items in given.items():
        distinct = {repr(v) for _, v in items}
        if len(distinct) > 1:
            shown = ", ".join(f"{f.names[0]}={v!r}" for f, v in items)
            raise ArgumentsError(f"conflicting values for one setting ({attr}): {shown}")
        flag, value = items[0]
        if home_field(flag) is None:
            raise ArgumentsError(
                f"{flag.names[0]} is not supported by this build: "
                f"{flag.home.__name__} has no field {flag.field!r}"
            )
        values[attr] = value
    return values, set(given)


def parse_args(argv=None, world_size: Optional[int] = None) -> argparse.Namespace:
    """Parse and validate; ``args.given`` is the set of attributes set on the command line and
    ``args.world_size`` the launcher's WORLD_SIZE (1 without a launcher)."""
    parser = build_parser()
    parser.__class__ = _Parser
    namespace, unknown = parser.parse_known_args(argv)
    if unknown:
        _raise_unknown(unknown)
    values, given = _resolve(_given_values(namespace))
    args = argparse.Namespace(**values)
    args.given = given
    args.world_size = world_size or int(os.environ.get("WORLD_SIZE", "1"))
    from .validation import validate_args

    validate_args(args)
    return args
