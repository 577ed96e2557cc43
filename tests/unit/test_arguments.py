"""The command line: the table of Megatron-LM's flags (each in exactly one state, upstream's
dest/type/default/choices), aliases, refusals, and cross-flag validation, as tables."""

import hashlib
import math
import re
from pathlib import Path

import pytest
import torch
from megatron.core.transformer.enums import LayerType

from megatron.core.optimizer import OptimizerConfig
from megatron.training import arguments
from megatron.training.arguments import (
    FLAGS,
    ArgumentsError,
    build_parser,
    default_of,
    parse_args,
)

BASE = (
    "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
    "--micro-batch-size 2 --train-iters 10 --lr 1e-3 --mock-data"
).split()
# sha256 of flags_core_v0.16.1.tsv (line ends normalized), read off Megatron-LM's parser.
UPSTREAM_SHA256 = "61168724a357b10efa48dd74ee096144c9634cd84879ada4b29e225cde4db813"
ROOT = Path(__file__).resolve().parents[2]


def parse(extra="", world_size=1):
    return parse_args(BASE + extra.split(), world_size=world_size)


def test_upstream_columns_are_upstreams_table_verbatim():
    lines = arguments.TABLE.read_text().splitlines()
    rows = [line.split("\t") for line in lines]
    upstream = ["\t".join(r[:8]) for r in rows if r[8] in ("source", "core_v0.16.1")]
    assert len(upstream) == 652  # header + 651 argparse actions
    digest = hashlib.sha256(("\n".join(upstream) + "\n").encode()).hexdigest()
    assert digest == UPSTREAM_SHA256


def _code() -> str:
    files = [ROOT / "pretrain_gpt.py", *sorted((ROOT / "megatron" / "training").glob("*.py"))]
    return "\n".join(f.read_text() for f in files)


def test_each_flag_is_in_exactly_one_state():
    code = _code()
    kinds = {}
    for flag in FLAGS:
        kinds[flag.kind] = kinds.get(flag.kind, 0) + 1
        if flag.kind == "core":  # the field exists (load_table fails loudly otherwise)
            assert flag.field in {f.name for f in arguments.dataclasses.fields(flag.home)}
        elif flag.kind == "args":  # our code reads it
            assert re.search(rf"\ba(rgs)?\.{flag.dest}\b", code), flag.names[0]
        else:
            assert flag.note, flag.names[0]
    assert sum(kinds.values()) == len(FLAGS) and set(kinds) == set(arguments.STATES)


def test_a_misspelt_field_fails_loudly(tmp_path):
    table = arguments.TABLE.read_text().replace(
        "TransformerConfig.hidden_dropout", "TransformerConfig.hiden_dropout"
    )
    (tmp_path / "flags.tsv").write_text(table)
    with pytest.raises(RuntimeError, match="--hidden-dropout maps to TransformerConfig.hiden"):
        arguments.load_table(tmp_path / "flags.tsv")


def test_names_are_unique():
    names = [name for flag in FLAGS for name in flag.names]
    assert len(names) == len(set(names))


def _actions() -> dict:
    return {a.option_strings[0]: a for a in build_parser()._actions if a.option_strings}


def test_parser_has_upstreams_types_choices_and_nargs():
    actions = _actions()
    for flag in FLAGS:
        if arguments._overrides(flag):
            continue  # a deliberate difference (DIFFERENCES)
        action = actions[flag.names[0]]
        if flag.action in ("StoreTrue", "StoreFalse"):
            assert action.const is (flag.action == "StoreTrue") and action.nargs == 0
            assert set(action.option_strings) == set(flag.names)
        elif flag.action == "Store":
            assert action.type is arguments.TYPES[flag.type] or flag.type == "enum_type_handler"
            upstream = [arguments._enum_name(c) for c in flag.choices.split("|")]
            assert list(action.choices or [])[: len(upstream)] == (
                [type(c)(u) for c, u in zip(action.choices, upstream)] if flag.choices else []
            )
            assert str(action.nargs or "") == flag.nargs


def test_defaults_are_upstreams_cli_defaults():
    args = parse()
    for flag in FLAGS:
        if flag.names[0] in arguments.DIFFERENCES:
            continue  # checked below
        if flag.kind in ("core", "args") and flag.dest not in DERIVED | args.given:
            assert _same(getattr(args, flag.dest), default_of(flag)), flag.names[0]


# Dests whose value validation derives from others, as Megatron-LM's validate_args does.
DERIVED = {
    "num_query_groups",
    "global_batch_size",
    "max_position_embeddings",
    "lr_decay_iters",
    "attention_backend",
    "accumulate_allreduce_grads_in_fp32",
    "rope_type",
    "vocab_size",
    "split",
    "dataloader_type",  # None -> single, as Megatron-LM
}


def _same(a, b) -> bool:
    return a == b or (isinstance(a, float) and isinstance(b, int) and a == b)


def test_deliberate_differences_are_documented():
    args = parse()
    assert (args.transformer_impl, args.eval_interval, args.tokenizer_type) == (
        "local",
        1000,
        "NullTokenizer",
    )
    help_text = _help_text()
    for name in arguments.DIFFERENCES:
        entry = help_text.split(f"\n  {name}", 1)[1].split("\n  --", 1)[0]
        assert "differs from Megatron-LM" in " ".join(entry.split())


MUON_CLI_DEFAULTS = [  # flags_core_v0.16.1.tsv, then main_muon_flags.tsv for main-only flags
    ("muon_momentum", 0.9),
    ("muon_tp_mode", "blockwise"),
    ("muon_use_nesterov", False),
    ("muon_split_qkv", True),
    ("muon_scale_mode", "spectral"),
    ("muon_fp32_matmul_prec", "medium"),
    ("muon_num_ns_steps", 5),
    ("muon_extra_scale_factor", 1.0),
    ("muon_coefficient_type", "quintic"),
    ("muon_scalar_optimizer", "adam"),
    ("muon_use_syrk", False),
    ("muon_matched_adamw_rms", None),  # ours: off
    ("muon_distopt_exchange_dtype", "fp32"),  # ours: off (the exchange in the main dtype)
    ("muon_plan_tflops", None),  # ours: the planner's built-in machine
    ("muon_plan_dp_link_gbps", None),
    ("muon_plan_nvlink_gbps", None),
    ("muon_plan_nvlink_domain", None),
    ("muon_plan_min_efficiency", None),  # ours: the fastest plan
]


@pytest.mark.parametrize("attr, value", MUON_CLI_DEFAULTS)
def test_muon_cli_defaults_are_megatron_lms(attr, value):
    assert getattr(parse(), attr) == value


def test_every_refused_flag_exits_with_its_reason():
    for flag in FLAGS:
        if flag.kind != "refused":
            continue
        with pytest.raises(ArgumentsError) as err:
            parse(f"{flag.names[0]} {_a_value(flag)}".strip())
        assert str(err.value) == f"{flag.names[0]} is not supported here: {flag.note}"


def _a_value(flag) -> str:
    if flag.action != "Store":
        return ""
    if flag.choices:
        return arguments._enum_name(flag.choices.split("|")[0])
    return {"int": "1", "float": "1.0", "moe_freq_type": "1", "tuple_type": "1,2"}.get(
        flag.type, "1"
    )


def test_no_effect_flags_are_accepted_and_listed():
    names = [f.names[0] for f in FLAGS if f.kind == "noeffect" and f.action != "Store"]
    # --no-position-embedding is accepted with rope positions only, as Megatron-LM
    args = parse(" ".join(names) + " --position-embedding-type rope")
    assert args.no_effect == sorted(names)
    value_flags = [f for f in FLAGS if f.kind == "noeffect" and f.action == "Store"]
    for flag in value_flags:
        assert parse(f"{flag.names[0]} {_a_value(flag)}").no_effect == [flag.names[0]]


def test_dist_muon_is_muon_with_the_distributed_optimizer():
    args = parse("--optimizer dist_muon")
    assert (args.optimizer, args.use_distributed_optimizer) == ("muon", True)
    assert "Use --optimizer muon --use-distributed-optimizer instead" in args.notices[0]


def test_num_query_groups_without_gqa_is_ignored_as_in_megatron_lm():
    args = parse("--num-query-groups 2")
    assert (
        args.num_query_groups == 4
        and "ignored without --group-query-attention" in (args.notices[0])
    )
    assert parse("--group-query-attention --num-query-groups 2").num_query_groups == 2
    assert parse("--group-query-attention").num_query_groups == 1  # Megatron-LM's default


def test_core_fields_reach_the_configs():
    from megatron.training.core_configs import ddp_config, optimizer_config, transformer_config

    args = parse(
        "--norm-epsilon 1e-6 --qk-layernorm --deterministic-mode --disable-bias-linear "
        "--num-experts 4 "
        "--moe-router-topk 3 --accumulate-allreduce-grads-in-fp32 --ddp-bucket-size 1000 "
        "--overlap-grad-reduce "
        "--optimizer muon --muon-momentum 0.5 --decoupled-lr 1e-4"
    )
    tc, oc, ddp = transformer_config(args), optimizer_config(args), ddp_config(args)
    assert (tc.layernorm_epsilon, tc.qk_layernorm, tc.deterministic_mode) == (1e-6, True, True)
    assert (tc.add_bias_linear, tc.num_moe_experts, tc.moe_router_topk) == (False, 4, 3)
    assert (oc.muon_momentum, oc.decoupled_lr) == (0.5, 1e-4)
    assert (ddp.grad_reduce_in_fp32, ddp.bucket_size) == (True, 1000)
    assert isinstance(oc, OptimizerConfig)
    # --bf16/--fp16 reach both configs: the optimizer config picks the mixed-precision optimizer
    for flag in ("bf16", "fp16"):
        tc, oc = transformer_config(parse(f"--{flag}")), optimizer_config(parse(f"--{flag}"))
        assert getattr(tc, flag) and getattr(oc, flag) and oc.params_dtype == tc.params_dtype


def _help_text() -> str:
    return build_parser().format_help()


ALIASES = [
    ("--muon-ns-steps 3", "muon_num_ns_steps", 3),
    ("--muon-num-ns-steps 3", "muon_num_ns_steps", 3),
    ("--muon-ns-steps 3 --muon-num-ns-steps 3", "muon_num_ns_steps", 3),
    ("--no-muon-nesterov", "muon_use_nesterov", False),
    ("--muon-use-nesterov", "muon_use_nesterov", True),
    ("--muon-no-split-qkv", "muon_split_qkv", False),
    ("--muon-coefficient-set quintic", "muon_coefficient_type", "quintic"),
    ("--muon-exchange-dtype bf16", "muon_distopt_exchange_dtype", "bf16"),
    ("--muon-nesterov", "muon_use_nesterov", True),
    ("--muon-nesterov --muon-use-nesterov", "muon_use_nesterov", True),
    ("--muon-coefficient-type simple", "muon_coefficient_type", "simple"),
    ("--muon-matched-adamw-rms none", "muon_matched_adamw_rms", None),
    ("--muon-scale-mode unit_rms_norm", "muon_matched_adamw_rms", None),  # upstream's rule
    ("--muon-plan-dp-link-gbps inf", "muon_plan_dp_link_gbps", math.inf),  # a free link
    ("--muon-plan-nvlink-gbps 7200", "muon_plan_nvlink_gbps", 7200.0),
    ("--muon-plan-tflops 800", "muon_plan_tflops", 800.0),
    ("--muon-plan-nvlink-domain 72", "muon_plan_nvlink_domain", 72),
    ("--muon-plan-min-efficiency 0.9", "muon_plan_min_efficiency", 0.9),
    ("--num-experts 4", "num_experts", 4),
]


@pytest.mark.parametrize("extra, attr, value", ALIASES)
def test_aliases_map_to_one_field(extra, attr, value):
    if "muon" in extra:  # Muon's flags need Muon (and the exchange dtype DistOpt)
        extra += " --optimizer muon --use-distributed-optimizer"
    assert getattr(parse(extra), attr) == value


ERRORS = [  # (extra flags, world size, words the message must contain)
    ("--num-layer 3", 1, ["unknown flag --num-layer", "--num-layers"]),
    ("--lr-decay-stile cosine", 1, ["--lr-decay-style"]),
    ("stray", 1, ["unexpected argument 'stray'"]),
    (
        "--optimizer muon --muon-ns-steps 3 --muon-num-ns-steps 4",
        1,
        ["conflicting", "--muon-ns-steps=3"],
    ),
    ("--optimizer muon --muon-use-nesterov --no-muon-nesterov", 1, ["conflicting"]),
    ("--optimizer lion", 1, ["--optimizer", "invalid choice"]),
    ("--optimizer muon --muon-tp-mode sideways", 1, ["--muon-tp-mode", "duplicated"]),
    ("--optimizer muon --muon-plan-nvlink-domain 8", 1, ["--muon-plan-nvlink-domain", "add --use"]),
    (
        "--optimizer muon --muon-plan-min-efficiency 0.9",
        1,
        ["--muon-plan-min-efficiency", "add --use"],
    ),
    (
        "--optimizer muon --use-distributed-optimizer --muon-plan-min-efficiency 1.1",
        1,
        ["--muon-plan-min-efficiency must be in (0, 1]", "got 1.1"],
    ),
    (
        "--optimizer muon --use-distributed-optimizer --muon-plan-tflops 0",
        1,
        ["--muon-plan-tflops must be in (0, 1e+06]", "got 0.0"],
    ),
    (  # a byte's cost would overflow to inf, and inf x 0 is NaN in the planner's comparisons
        "--optimizer muon --use-distributed-optimizer --muon-plan-dp-link-gbps 1e-310",
        1,
        ["--muon-plan-dp-link-gbps must be >= 0.001", "inf: a free link", "got 1e-310"],
    ),
    (
        "--optimizer muon --use-distributed-optimizer --muon-plan-tflops 1e300",
        1,
        ["--muon-plan-tflops must be in (0, 1e+06]", "got 1e+300"],
    ),
    (
        "--optimizer muon --use-distributed-optimizer --muon-plan-tflops inf",
        1,
        ["--muon-plan-tflops must be a finite number"],
    ),
    (
        "--optimizer muon --use-distributed-optimizer --muon-plan-dp-link-gbps nan",
        1,
        ["--muon-plan-dp-link-gbps must be a finite number"],
    ),
    ("--transformer-impl transformer_engine", 1, ["--transformer-impl transformer_engine"]),
    ("--sequence-parallel", 1, ["--sequence-parallel"]),
    ("--attention-backend flash", 1, ["--attention-backend"]),
    ("--bf16 --fp16", 1, ["--bf16 and --fp16"]),
    (
        "--use-checkpoint-opt_param-scheduler --override-opt_param-scheduler",
        1,
        ["--use-checkpoint-opt_param-scheduler and --override-opt_param-scheduler", "exclusive"],
    ),
    ("--global-batch-size 6", 2, ["--global-batch-size (6)", "--micro-batch-size (2)"]),
    ("--tensor-model-parallel-size 3", 4, ["--tensor-model-parallel-size (3)", "world size (4)"]),
    ("--tensor-model-parallel-size 8", 8, ["--num-attention-heads (4)"]),
    ("--pipeline-model-parallel-size 3", 3, ["--num-layers (4)"]),
    ("--min-lr 1", 1, ["--min-lr"]),
    ("--lr-warmup-iters 2 --lr-warmup-fraction 0.1", 1, ["exclusive"]),
    ("--fp8-format hybrid", 1, ["--fp8-format is not supported here", "--bf16"]),
    ("--optimizer muon --muon-scalar-optimizer lion", 1, ["--muon-scalar-optimizer", "adam"]),
    ("--muon-use-syrk", 1, ["--muon-use-syrk", "SYRK"]),
    ("--context-parallel-size 2", 1, ["--context-parallel-size", "Transformer Engine"]),
    ("--multi-latent-attention", 1, ["--multi-latent-attention", "transformer_engine"]),
    ("--moe-token-dispatcher-type flex --num-experts 2", 1, ["flex", "alltoall"]),
    ("--deterministic-mode --cross-entropy-loss-fusion", 1, ["--deterministic-mode excludes"]),
    ("--optimizer muon --muon-coefficient-type cubic", 1, ["--muon-coefficient-type", "quintic"]),
    ("--overlap-param-gather", 1, ["--use-distributed-optimizer"]),
    ("--save-interval 5", 1, ["--save"]),
    ("--finetune", 1, ["--load"]),
    ("--data-path x", 1, ["exclusive"]),
    ("--num-layers-per-virtual-pipeline-stage 1", 1, ["--pipeline-model-parallel-size >= 2"]),
    (
        "--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 3",
        2,
        ["must divide"],
    ),
    ("--rampup-batch-size 4 2 100 --global-batch-size 8", 1, ["exclusive", "--train-samples"]),
    ("--expert-model-parallel-size 2", 2, ["--num-experts"]),
    ("--optimizer muon --muon-momentum 1.5", 1, ["muon_momentum"]),
    ("--micro-batch-size -1", 1, ["--micro-batch-size must be >= 1"]),
    ("--use-mup --mup-base-hidden-size 32", 1, ["--use-mup is not supported", "core_v0.16.1"]),
    ("--tokenizer-library tiktoken", 1, ["--tokenizer-type TikTokenizer needs --tokenizer-model"]),
    (
        "--tokenizer-library sentencepiece --tokenizer-type TikTokenizer",
        1,
        ["--tokenizer-library sentencepiece and --tokenizer-type TikTokenizer disagree"],
    ),
    ("--tokenizer-library byte-level", 1, ["byte-level", "--tokenizer-type ByteLevelTokenizer"]),
    (
        "--tokenizer-library huggingface --tokenizer-type NullTokenizer",
        1,
        ["--tokenizer-library huggingface and --tokenizer-type NullTokenizer disagree"],
    ),
    ("--async-save --ckpt-format torch", 1, ["--async-save needs --ckpt-format torch_dist"]),
    ("--exit-on-missing-checkpoint", 1, ["--exit-on-missing-checkpoint", "needs --load"]),
]


FIRST, LAST = "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers"
UNEVEN_ERRORS = [  # (extra, world size, words): every message names the flags concerned
    ("--num-layers 3 --pipeline-model-parallel-size 2", 2, ["--num-layers (3) must", FIRST]),
    (
        "--pipeline-model-parallel-size 2 --account-for-loss-in-pipeline-split",
        2,
        ["--num-layers (4) plus the loss (5)", "--pipeline-model-parallel-size (2)"],
    ),
    (f"{FIRST} 1", 1, [FIRST, "--pipeline-model-parallel-size >= 2"]),
    (f"--pipeline-model-parallel-size 2 {FIRST} 0", 2, [FIRST, ">= 1, got [0]"]),
    (f"--pipeline-model-parallel-size 3 {FIRST} 1", 3, ["leaves 3 layer(s) for 2 middle"]),
    (f"--pipeline-model-parallel-size 2 {FIRST} 5", 2, ["leaves -1 layer(s)"]),
    (f"--pipeline-model-parallel-size 2 {FIRST} 1 {LAST} 2", 2, ["leaves 1 layer(s) for 0"]),
    (
        f"--pipeline-model-parallel-size 4 {FIRST} 1 {LAST} 1 --num-layers 5",
        4,
        ["3 layer(s) for 2"],
    ),
    (
        f"--pipeline-model-parallel-size 2 {FIRST} 1 --account-for-embedding-in-pipeline-split",
        2,
        ["--account-for-embedding-in-pipeline-split", "exclusive"],
    ),
    (
        f"--pipeline-model-parallel-size 2 {FIRST} 2 --num-layers-per-virtual-pipeline-stage 1",
        2,
        ["--num-virtual-stages-per-pipeline-rank instead"],
    ),
    (
        f"--pipeline-model-parallel-size 2 {FIRST} 1 {LAST} 3 "
        "--num-virtual-stages-per-pipeline-rank 2",
        2,
        ["--num-virtual-stages-per-pipeline-rank (2) must divide", "[1, 3]"],
    ),
]
ERRORS += UNEVEN_ERRORS

# Review s8d (fixed): each bad layout below started and then failed (or ran) in
# megatron-core without naming a flag; Megatron-LM's validate_args refuses or normalizes it.
VPP_STAGES = "--pipeline-model-parallel-size 2 --global-batch-size 4"
SILENT_VPP = [
    pytest.param(  # megatron-core: "num_layers_per_pipeline_rank 2 should be divisible by vp_size"
        f"{VPP_STAGES} --num-virtual-stages-per-pipeline-rank 3",
        2,
        ["--num-virtual-stages-per-pipeline-rank (3)", "2"],
        id="stages-not-dividing-an-even-split",
    ),
    pytest.param(  # megatron-core, in initialize: "pipeline-model-parallel size should be > 1"
        "--num-virtual-stages-per-pipeline-rank 2",
        1,
        ["--num-virtual-stages-per-pipeline-rank", "--pipeline-model-parallel-size"],
        id="stages-without-pp",
    ),
    pytest.param(  # accepted: the stages form wins, --num-layers-per-... is silently ignored
        f"{VPP_STAGES} --num-virtual-stages-per-pipeline-rank 2 "
        "--num-layers-per-virtual-pipeline-stage 2",
        2,
        ["--num-virtual-stages-per-pipeline-rank", "--num-layers-per-virtual-pipeline-stage"],
        id="both-forms",
    ),
]
ERRORS += SILENT_VPP

LAYOUT, PP2 = "--pipeline-model-parallel-layout", "--pipeline-model-parallel-size 2"
LAYOUT_ERRORS = [  # refused as Megatron-LM / megatron-core refuse them, naming the flags
    (f"{PP2} {LAYOUT} E|tt|t|tL --num-virtual-stages-per-pipeline-rank 2", 2, [LAYOUT, "give one"]),
    (f"{PP2} {LAYOUT} Et|tttL --num-layers-per-virtual-pipeline-stage 2", 2, [LAYOUT, "give one"]),
    (f"{PP2} {LAYOUT} Et|tttL {FIRST} 1", 2, [LAYOUT, FIRST, "give one"]),
    (f"{PP2} {LAYOUT} Et|tttL --account-for-loss-in-pipeline-split", 2, [LAYOUT, "-loss-in-"]),
    (f"{PP2} {LAYOUT} Et|tt|tL", 2, [LAYOUT, "lists 3 stage(s)", "multiple of"]),
    (f"{LAYOUT} Ett|ttL", 1, [LAYOUT, "needs --pipeline-model-parallel-size >= 2"]),
    (f"{PP2} {LAYOUT} Ex|tttL", 2, [LAYOUT, "Invalid layer character: x"]),
    (f"{PP2} {LAYOUT} Et|ttL", 2, [LAYOUT, "Number of decoder layers 3", "--num-layers 4"]),
    (f"{PP2} {LAYOUT} tE|tttL", 2, [LAYOUT, "The first layer must be embedding"]),
    (f"{PP2} {LAYOUT} Et|tLtt", 2, [LAYOUT, "The last layer must be loss"]),
    (f"{PP2} {LAYOUT} Et|tttmL", 2, [LAYOUT, "mtp layers", "--mtp-num-layers None"]),
    (f"{PP2} {LAYOUT} Etm|tttL --mtp-num-layers 1", 2, [LAYOUT, "before MTP"]),
    (f"{PP2} {LAYOUT} E|tt|ttm|L --mtp-num-layers 1", 2, [LAYOUT, "off the last pipeline rank"]),
    (  # 2 micro-batches: the interleaved schedule the layout's 4 stages give needs a multiple of 2
        f"{PP2} {LAYOUT} E|tt|t|tL --global-batch-size 2",
        2,
        ["--global-batch-size 2", "interleaved", "multiple of --pipeline-model-parallel-size"],
    ),
]
ERRORS += LAYOUT_ERRORS
ERRORS += [  # --moe-per-layer-logging writes TensorBoard scalars of the MoE routers' losses
    (
        "--moe-per-layer-logging --tensorboard-dir tb",
        1,
        ["--moe-per-layer-logging", "--num-experts"],
    ),
    (
        "--moe-per-layer-logging --num-experts 4",
        1,
        ["--moe-per-layer-logging", "--tensorboard-dir"],
    ),
]

if not torch.cuda.is_available():  # on GPUs recomputation runs
    ERRORS.append(("--recompute-granularity full", 1, ["--recompute-granularity", "CUDA"]))


@pytest.mark.parametrize("extra, world_size, words", ERRORS)
def test_bad_input_names_the_flag(extra, world_size, words):
    with pytest.raises(ArgumentsError) as err:
        parse(extra, world_size)
    for word in words:
        assert word in str(err.value)


@pytest.mark.parametrize("flag", ["--num-layers", "--lr", "--train-iters", "--seq-length"])
def test_required_flags(flag):
    argv = list(BASE)
    i = argv.index(flag)
    del argv[i : i + 2]
    with pytest.raises(ArgumentsError, match=f"{flag} (or --train-samples )?is required"):
        parse_args(argv, world_size=1)


def test_no_data_is_an_error():
    argv = [a for a in BASE if a != "--mock-data"]
    with pytest.raises(ArgumentsError, match="--data-path"):
        parse_args(argv, world_size=1)


def test_derived_values():
    args = parse("--tensor-model-parallel-size 2 --micro-batch-size 4", world_size=8)
    assert (args.data_parallel_size, args.global_batch_size) == (4, 16)
    args = parse("--group-query-attention --bf16")
    assert args.num_query_groups == 1 and args.accumulate_allreduce_grads_in_fp32
    assert not parse("--bf16 --grad-reduce-in-bf16").accumulate_allreduce_grads_in_fp32
    args = parse("--load /x --finetune")
    assert args.no_load_optim and args.no_load_rng
    # upstream main's --tokenizer-library alone stands for its library's tokenizer type
    for library, tokenizer_type in (
        ("null", "NullTokenizer"),
        ("megatron", "GPT2BPETokenizer"),
        ("sentencepiece --tokenizer-model m", "GPTSentencePieceTokenizer"),
        ("tiktoken --tokenizer-model r --tiktoken-pattern v2", "TikTokenizer"),
    ):
        assert parse(f"--tokenizer-library {library}").tokenizer_type == tokenizer_type


def test_help_shows_homes_and_defaults(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    text = capsys.readouterr().out
    assert "[OptimizerConfig.muon_momentum; default: 0.9" in text
    assert "--use-mcore-models" in text and "NOEFFECT" in text and "REFUSED" in text


SAMPLES = [a for a in BASE if a not in ("--train-iters", "10")] + ["--train-samples", "100"]

SAMPLE_ERRORS = [  # sample-based training: exclusive with the iteration forms, as Megatron-LM
    ("--train-iters 5", ["--train-iters", "--train-samples", "exclusive"]),
    ("--lr-decay-iters 5", ["--lr-decay-iters", "exclusive"]),
    ("--lr-warmup-iters 5", ["--lr-warmup-iters", "exclusive"]),
    ("--lr-warmup-samples 8 --lr-warmup-fraction 0.1", ["--lr-warmup-samples", "exclusive"]),
    ("--rampup-batch-size 3 2 40 --global-batch-size 8", ["multiples"]),
    ("--global-batch-size 128 --micro-batch-size 2", ["--train-samples (100)", "one global"]),
    ("--decoupled-min-lr 1e-4", ["--decoupled-min-lr needs --decoupled-lr"]),
    (
        "--global-batch-size 8 --rampup-batch-size 2 2 40 --full-validation",
        ["--full-validation", "--rampup-batch-size"],
    ),
    ("--decoupled-lr 1e-4 --decoupled-min-lr 1e-3", ["--decoupled-min-lr (0.001)"]),
]


@pytest.mark.parametrize("extra, words", SAMPLE_ERRORS)
def test_sample_based_bad_input(extra, words):
    with pytest.raises(ArgumentsError) as err:
        parse_args(SAMPLES + extra.split(), world_size=1)
    for word in words:
        assert word in str(err.value)


@pytest.mark.parametrize(
    "extra, iters",
    [
        ("--global-batch-size 8", 12),  # 100 // 8, the partial last batch dropped
        # batch +2 every 40/3 samples: 7 steps of 2 (to 14 samples), 4 of 4 (to 30), 2 of 6
        # (to 42, past the ramp), then (100 - 42) // 8 = 7 of 8: Megatron-LM's count
        ("--global-batch-size 8 --rampup-batch-size 2 2 40", 20),
    ],
)
def test_train_iters_from_samples(extra, iters):
    args = parse_args(SAMPLES + extra.split(), world_size=1)
    assert args.train_iters == iters and args.lr_decay_samples == 100


REFUSED_NOW = [  # known Megatron-LM flags this stack does not run yet: refused with the reason
    ("--ckpt-step 3", "not implemented"),
    ("--tokenizer-type BertWordPieceCase", "implemented: ByteLevelTokenizer"),
    ("--dataloader-type external", "custom training script"),
]


@pytest.mark.parametrize("extra, why", REFUSED_NOW)
def test_flags_not_run_yet_are_refused_with_the_reason(extra, why):
    with pytest.raises(ArgumentsError, match="not supported") as err:
        parse(extra)
    assert why in str(err.value) and extra.split()[0] in str(err.value)


@pytest.mark.parametrize(
    "extra, message",
    [
        ("--log-timers-to-tensorboard", "--log-timers-to-tensorboard configures TensorBoard"),
        ("--no-log-loss-scale-to-tensorboard", "it needs --tensorboard-dir"),
        ("--tensorboard-queue-size 5", "--tensorboard-queue-size configures TensorBoard"),
        ("--tensorboard-dir t --tensorboard-log-interval 0", "--tensorboard-log-interval must be"),
        ("--log-memory-interval 0", "--log-memory-interval must be >= 1, got 0"),
        ("--log-muon-figures", "--log-muon-figures reports Muon's own figures: it needs --opt"),
        ("--log-progress", "--log-progress writes progress.txt under --save: it needs --save"),
        ("--timing-log-level 3", "invalid choice: 3"),
        ("--timing-log-option mean", "invalid choice: 'mean'"),
    ],
)
def test_logging_flags_refuse_what_would_do_nothing(extra, message):
    with pytest.raises(ArgumentsError, match=re.escape(message)):
        parse(extra)


def test_logging_flags_keep_upstream_defaults():
    args = parse("--no-barrier-with-level-1-timing")
    assert (args.timing_log_level, args.timing_log_option) == (0, "minmax")
    assert (args.tensorboard_log_interval, args.tensorboard_queue_size) == (1, 1000)
    assert args.log_loss_scale_to_tensorboard and not args.log_muon_figures
    assert args.barrier_with_L1_time is False  # both configs take it, as Megatron-LM's do
    from megatron.training.core_configs import optimizer_config, transformer_config

    assert not transformer_config(args).barrier_with_L1_time
    assert not optimizer_config(args).barrier_with_L1_time


@pytest.mark.parametrize(
    "extra, message",
    [
        ("--manual-gc --manual-gc-interval -1", "--manual-gc-interval must be >= 0, got -1"),
        ("--manual-gc-interval 5", "--manual-gc-interval and --no-manual-gc-eval need --manual-gc"),
        ("--no-manual-gc-eval", "need --manual-gc"),
        ("--empty-unused-memory-level 3", "--empty-unused-memory-level"),
    ],
)
def test_memory_flags_refuse_bad_values(extra, message):
    with pytest.raises(ArgumentsError, match=message):
        parse(extra)


def test_memory_flags_keep_upstream_defaults():
    args = parse()
    assert (args.manual_gc, args.manual_gc_interval, args.manual_gc_eval) == (False, 0, True)
    assert args.empty_unused_memory_level == 0


def test_use_checkpoint_args_needs_load():
    with pytest.raises(ArgumentsError, match="--use-checkpoint-args needs --load"):
        parse("--use-checkpoint-args")


def test_nan_check_is_on_by_default_as_megatron_lm():
    assert parse().check_for_nan_in_loss_and_grad is True
    assert parse("--no-check-for-nan-in-loss-and-grad").check_for_nan_in_loss_and_grad is False


@pytest.mark.parametrize(
    "extra, world_size, fields",
    [
        (f"--pipeline-model-parallel-size 2 {FIRST} 1", 2, (1, None, False, False)),
        (f"--pipeline-model-parallel-size 3 {FIRST} 1 {LAST} 1", 3, (1, 1, False, False)),
        (f"--pipeline-model-parallel-size 2 {LAST} 3 --num-layers 5", 2, (None, 3, False, False)),
        (
            "--pipeline-model-parallel-size 2 --account-for-loss-in-pipeline-split --num-layers 5",
            2,
            (None, None, False, True),
        ),
        (
            "--pipeline-model-parallel-size 2 --account-for-embedding-in-pipeline-split "
            "--account-for-loss-in-pipeline-split",
            2,
            (None, None, True, True),
        ),
    ],
)
def test_uneven_pipeline_split_reaches_the_transformer_config(extra, world_size, fields):
    """Megatron-LM's uneven split flags fill megatron-core's fields, which build the stages."""
    from megatron.training.core_configs import transformer_config

    config = transformer_config(parse(extra, world_size))
    assert (
        config.num_layers_in_first_pipeline_stage,
        config.num_layers_in_last_pipeline_stage,
        config.account_for_embedding_in_pipeline_split,
        config.account_for_loss_in_pipeline_split,
    ) == fields


def test_recompute_activations_is_selective_recompute(monkeypatch):
    """Megatron-LM's shorthand sets the granularity, over an explicit one too; without CUDA it
    is refused with the reason, as --recompute-granularity is."""
    if not torch.cuda.is_available():
        with pytest.raises(ArgumentsError, match="--recompute-activations, which sets it"):
            parse("--recompute-activations")
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the derivation alone
    args = parse("--recompute-activations --recompute-granularity full")
    assert args.recompute_granularity == "selective"
    full = "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1"
    assert parse(full).recompute_granularity == "full"


def test_a_checkpoint_of_another_pipeline_split_is_refused():
    """The stages hold other layers: a resume must keep the split (the message names it)."""
    from megatron.training import checkpointing

    args = parse(f"--pipeline-model-parallel-size 2 {FIRST} 1", 2)
    saved = checkpointing._saved_args(args)
    checkpointing.check_compatible(args, saved, "ckpt")  # the same split loads
    other = parse(f"--pipeline-model-parallel-size 2 {FIRST} 2", 2)
    with pytest.raises(checkpointing.CheckpointError, match=f"{FIRST}: checkpoint 1, this run 2"):
        checkpointing.check_compatible(other, saved, "ckpt")


@pytest.mark.parametrize(
    "layout, world_size, virtual, first, built",
    [  # built: decoder layers per (pipeline rank, virtual stage)
        ("Et|ttt|L", 3, None, 1, [[1], [3], [0]]),
        ("E|tt|t|tL", 2, 2, None, [[0, 1], [2, 1]]),
        ("EttttL", 1, None, None, [[4]]),
    ],
)
def test_pipeline_layout_reaches_the_transformer_config(layout, world_size, virtual, first, built):
    """The layout fills megatron-core's field (which builds the stages: test_muon_parity.py),
    its stage count sets the virtual pipeline, and it is printed once at start-up."""
    from megatron.training.core_configs import transformer_config

    pp = f"--pipeline-model-parallel-size {world_size}"
    args = parse(f"{pp} --global-batch-size 4 {LAYOUT} {layout}", world_size)
    config = transformer_config(args)
    assert config.virtual_pipeline_model_parallel_size == args.virtual_pipeline_size == virtual
    assert config.num_layers_in_first_pipeline_stage is None  # the layout alone splits
    counts = config.pipeline_model_parallel_layout.layout
    assert [[stage.count(LayerType.decoder) for stage in rank] for rank in counts] == built
    assert any(n.startswith(f"{LAYOUT} places the layers") for n in args.notices)


def test_a_checkpoint_of_another_pipeline_layout_is_refused():
    """A resume must keep the layout (torch-format files hold each stage's layers)."""
    from megatron.training import checkpointing

    args = parse(f"{PP2} {LAYOUT} Et|tttL", 2)
    saved = checkpointing._saved_args(args)
    checkpointing.check_compatible(args, saved, "ckpt")  # the same layout loads
    other = parse(f"{PP2} {LAYOUT} Ett|ttL", 2)
    with pytest.raises(
        checkpointing.CheckpointError, match=re.escape(f"{LAYOUT}: checkpoint 'Et|tttL'")
    ):
        checkpointing.check_compatible(other, saved, "ckpt")
    with pytest.raises(checkpointing.CheckpointError, match=f"{FIRST}: checkpoint None"):
        checkpointing.check_compatible(parse(f"{PP2} {FIRST} 1", 2), saved, "ckpt")


def test_record_memory_history_needs_cuda(monkeypatch):
    """CUDA's allocator history: a CPU run refuses the flag (and its path without it); with
    CUDA both keep Megatron-LM's values."""
    from megatron.training import cpu_mode

    if cpu_mode.requested():
        with pytest.raises(ArgumentsError, match="--record-memory-history .* it needs CUDA"):
            parse("--record-memory-history")
        monkeypatch.setattr(cpu_mode, "requested", lambda: False)  # the flags' own checks
    with pytest.raises(ArgumentsError, match="--memory-snapshot-path .* --record-memory-history"):
        parse("--memory-snapshot-path m.pickle")
    args = parse("--record-memory-history")
    assert (args.record_memory_history, args.memory_snapshot_path) == (True, "snapshot.pickle")
    assert not parse().record_memory_history


PROFILE = "--profile --use-pytorch-profiler --tensorboard-dir tb"


@pytest.mark.parametrize(
    "extra, world_size, message",
    [
        ("--use-pytorch-profiler --profile-ranks 1", 2, "--use-pytorch-profiler, --profile-ranks"),
        ("--profile --use-pytorch-profiler", 1, "writes its trace under --tensorboard-dir"),
        (f"{PROFILE} --profile-step-start 3 --profile-step-end 3", 1, "(3) must be greater"),
        (f"{PROFILE} --profile-step-start -1 --profile-step-end 3", 1, "must be >= 0"),
        (f"{PROFILE} --profile-ranks 0 2", 2, "--profile-ranks [2]: not ranks of this run"),
    ]
    + ([] if torch.cuda.is_available() else [("--profile", 1, "needs CUDA; add --use-pytorch")]),
)
def test_profile_flags_refuse_what_would_do_nothing(extra, world_size, message):
    with pytest.raises(ArgumentsError) as err:
        parse(extra, world_size)
    assert message in str(err.value)


def test_profile_flags_keep_upstream_defaults():
    args = parse(PROFILE)
    assert (args.profile_step_start, args.profile_step_end, args.profile_ranks) == (10, 12, [0])


def test_ddp_bucket_flags_reach_the_ddp_config():
    """--ddp-num-buckets divides this rank's parameter count (Megatron-LM's get_model);
    --ddp-pad-buckets-for-high-nccl-busbw and --ddp-average-in-collective are DDP fields."""
    from megatron.training.core_configs import ddp_config

    overlap = " --overlap-grad-reduce"  # the bucket size takes effect only with it
    assert ddp_config(parse("--ddp-num-buckets 4" + overlap), 1003).bucket_size == 250
    assert ddp_config(parse("--ddp-bucket-size 7" + overlap), 1003).bucket_size == 7
    padded = ddp_config(parse("--ddp-pad-buckets-for-high-nccl-busbw --use-distributed-optimizer"))
    assert padded.pad_buckets_for_high_nccl_busbw and not padded.average_in_collective
    if torch.cuda.is_available():
        assert ddp_config(parse("--ddp-average-in-collective")).average_in_collective


@pytest.mark.parametrize(
    "extra, message",
    [
        ("--ddp-num-buckets 0", "--ddp-num-buckets must be >= 1, got 0"),
        ("--ddp-num-buckets 2 --ddp-bucket-size 10 --overlap-grad-reduce", "both set the DDP"),
    ]
    + ([] if torch.cuda.is_available() else [("--ddp-average-in-collective", "ReduceOp.AVG")]),
)
def test_ddp_bucket_flags_refuse_bad_input(extra, message):
    with pytest.raises(ArgumentsError, match=re.escape(message)):
        parse(extra)


def test_local_rank_defaults_to_the_launchers(monkeypatch):
    """Megatron-LM's --local-rank defaults to $LOCAL_RANK (torchrun); a launcher that passes
    the flag instead (torch.distributed.launch) sets it; it picks the CUDA device."""
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert parse().local_rank == 3
    assert parse("--local-rank 1").local_rank == 1
    monkeypatch.delenv("LOCAL_RANK")
    assert parse().local_rank == 0


INTERLEAVED = "--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1"
INTERLEAVED_ERRORS = [  # (extra flags: iteration- or sample-based, words of the message)
    (
        "--global-batch-size 2",
        ["--global-batch-size 2", "1 micro-batches", "multiple of --pipeline-model-parallel-size"],
    ),
    ("--global-batch-size 6", ["--global-batch-size 6", "3 micro-batches"]),
    (
        "--train-samples 40 --global-batch-size 8 --rampup-batch-size 4 2 8",
        ["--rampup-batch-size", "3 micro-batches"],
    ),
]


@pytest.mark.parametrize("extra, words", INTERLEAVED_ERRORS)
def test_interleaved_schedule_needs_micro_batches_in_multiples_of_pp(extra, words):
    """megatron-core's interleaved 1F1B runs groups of PP micro-batches per virtual stage: any
    other count per step (at a --rampup-batch-size size too) fails in the first step's schedule,
    after start-up, without naming a flag."""
    argv = [a for a in BASE if a not in ("--train-iters", "10")] + f"{INTERLEAVED} {extra}".split()
    if "--train-samples" not in extra:
        argv += ["--train-iters", "10"]
    with pytest.raises(ArgumentsError) as err:
        parse_args(argv, world_size=2)
    for word in words:
        assert word in str(err.value)


def test_interleaved_schedule_takes_multiples_of_pp():
    parse(f"{INTERLEAVED} --global-batch-size 8", world_size=2)  # 4 micro-batches: 2 groups


def test_moe_load_balancing_flags_with_one_value_are_scalars_as_in_megatron_lm():
    """Both flags take several values (nargs='+', one coefficient per loss type); Megatron-LM
    unwraps a single one, which megatron-core expects as a scalar."""
    cases = {
        "--moe-aux-loss-coeff 0.01": ("aux_loss", 0.01),
        "--moe-router-load-balancing-type seq_aux_loss": ("seq_aux_loss", 0.0),
        "--moe-router-load-balancing-type aux_loss seq_aux_loss --moe-aux-loss-coeff 0.01 0.001": (
            ["aux_loss", "seq_aux_loss"],
            [0.01, 0.001],
        ),
    }
    from megatron.training.core_configs import transformer_config

    for flags, want in cases.items():
        config = transformer_config(parse("--num-experts 4 " + flags))
        assert (config.moe_router_load_balancing_type, config.moe_aux_loss_coeff) == want, flags
    # a single value is then a float flag's: finite numbers only
    with pytest.raises(ArgumentsError, match="--moe-aux-loss-coeff must be a finite number"):
        parse("--num-experts 4 --moe-aux-loss-coeff nan")


def test_iterations_to_skip_must_name_steps_of_the_run():
    assert parse("--iterations-to-skip 0 9").iterations_to_skip == [0, 9]
    with pytest.raises(ArgumentsError, match=r"--iterations-to-skip \[10, -1\]: .* 0 to 9"):
        parse("--iterations-to-skip 10 -1 3")


@pytest.mark.parametrize(
    "extra",
    ["--num-virtual-stages-per-pipeline-rank 1", "--num-layers-per-virtual-pipeline-stage 2"],
)
def test_one_virtual_stage_is_no_virtual_pipeline(extra):
    from megatron.training.core_configs import transformer_config

    args = parse(f"{VPP_STAGES} {extra}", 2)  # 4 layers, PP 2: 2 layers per stage
    assert transformer_config(args).virtual_pipeline_model_parallel_size is None
    parse(f"--pipeline-model-parallel-size 2 --global-batch-size 2 {extra}", 2)  # 1 micro-batch


@pytest.mark.parametrize("extra", ["--ddp-num-buckets 3", "--ddp-bucket-size 1000"])
def test_bucket_flags_without_overlap_grad_reduce_are_refused(extra):
    with pytest.raises(ArgumentsError, match="--overlap-grad-reduce"):
        parse(extra)
    parse(f"{extra} --overlap-grad-reduce")  # where they take effect


def test_every_aux_loss_coefficient_must_be_finite():
    types = "--num-experts 4 --moe-router-load-balancing-type aux_loss seq_aux_loss"
    with pytest.raises(ArgumentsError, match="--moe-aux-loss-coeff must be a finite number"):
        parse(f"{types} --moe-aux-loss-coeff 0.01 nan")


def test_a_checkpoint_of_the_same_virtual_pipeline_spelt_otherwise_loads():
    from megatron.training import checkpointing

    layers_form = parse(f"{VPP_STAGES} --num-layers-per-virtual-pipeline-stage 1", 2)
    stages_form = parse(f"{VPP_STAGES} --num-virtual-stages-per-pipeline-rank 2", 2)
    checkpointing.check_compatible(stages_form, checkpointing._saved_args(layers_form), "ckpt")
    plain = parse(VPP_STAGES, 2)  # one chunk per rank: another layout, refused
    with pytest.raises(checkpointing.CheckpointError, match=r"rank\): checkpoint 2, this run None"):
        checkpointing.check_compatible(plain, checkpointing._saved_args(layers_form), "ckpt")
    older = {**checkpointing._saved_args(layers_form), "num_layers_per_virtual_pipeline_stage": 1}
    del older["virtual_pipeline_size"]  # a checkpoint written before the size was recorded
    checkpointing.check_compatible(stages_form, older, "ckpt")


def test_bucket_padding_without_distopt_is_refused():
    with pytest.raises(ArgumentsError, match="--use-distributed-optimizer"):
        parse("--ddp-pad-buckets-for-high-nccl-busbw")
    parse("--ddp-pad-buckets-for-high-nccl-busbw --use-distributed-optimizer")
