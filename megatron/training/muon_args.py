"""megatron-muon's flags on upstream Megatron-LM's command line (base megatron-core 0.19.2).

Upstream 0.19.2's ``megatron/training/arguments.py`` has no flag for the ``OptimizerConfig``
fields that patch ``0001`` adds. Patch ``0030-training-args-megatron-muon`` calls
into this module from three places of upstream's file:

- ``add_megatron_arguments``: ``add_megatron_muon_args(parser)`` registers ``--muon-impl`` and
  our knobs, each ``dest`` an ``OptimizerConfig`` field, so upstream's
  ``get_megatron_optimizer_config`` (which copies every ``args`` attribute named like a field)
  hands them to megatron-core unchanged;
- ``validate_args``: ``validate_megatron_muon_args(args)``, just before upstream's emerging
  optimizer check, which then skips ``--muon-impl megatron_muon`` (``is_megatron_muon``): our
  Muon runs inside the ``DistributedOptimizer`` that ``--use-distributed-optimizer`` asks for,
  not in upstream's LayerWise optimizer that the check rewrites it into for its own Muon.

``validate_megatron_muon_args`` also refuses ``--qk-clip-per-head`` without ``--qk-clip``. That
flag needs no code here: upstream's ``ArgumentGroupFactory(TransformerConfig)`` makes one per
config field, so patch ``0013``'s ``TransformerConfig.qk_clip_per_head`` (our per-head QK-clip
rule, off by default) gets ``--qk-clip-per-head``, which ``core_transformer_config_from_args``
copies back by name.

Patch ``0063-training-ddp-layout-megatron-muon`` asks ``distributed_optimizer_class(args)``
which DistributedOptimizer lays out DDP's buffers in ``get_model`` (ours: shard-aligned Muon
matrices where that balances, ``megatron_muon/layout.py``).

Patch ``0031-checkpoint-args-muon-impl`` calls ``check_checkpoint_muon_impl`` from
upstream's ``check_checkpoint_args``: the two Muons' optimizer states are not interchangeable.

Every default is ``OptimizerConfig``'s (read from its fields, never repeated here); the names
are those our 0.16.1-based fork's command line had (docs/migrating_from_0.16.1.md lists what
changed).
"""

import argparse
import dataclasses
from typing import Optional

from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

from megatron.core.optimizer.megatron_muon.config import (
    EXCHANGE_DTYPES,
    MUON_IMPLS,
    NS_FORMS,
    is_megatron_muon,
    validate_muon_config,
)
from megatron.core.optimizer.megatron_muon.distrib_optimizer import MuonDistributedOptimizer

__all__ = [
    "add_megatron_muon_args",
    "admit_muon_tp_mode_owner",
    "check_checkpoint_muon_impl",
    "distributed_optimizer_class",
    "is_megatron_muon",
    "validate_megatron_muon_args",
]

# args attribute: {dest: the option string given}, filled while parsing, read (and removed) once
GIVEN = "_megatron_muon_given"


def distributed_optimizer_class(args):
    """The ``DistributedOptimizer`` class the optimizer factory will build for ``args``, whose
    ``compute_full_param_layout`` lays out DDP's buffers: ours for ``--muon-impl megatron_muon``,
    else upstream's."""
    return MuonDistributedOptimizer if is_megatron_muon(args) else DistributedOptimizer


def _float_or_none(text: str):
    return None if text.lower() == "none" else float(text)


# Our knobs: (option strings, dest = OptimizerConfig field, type, choices, help). Read only by
# --muon-impl megatron_muon; one name each, the field's.
KNOBS = (
    (
        ("--muon-matched-adamw-rms",),
        "muon_matched_adamw_rms",
        _float_or_none,
        None,
        "Scale Muon's updates to this AdamW-like RMS, r * sqrt(max(m, n)) (Moonlight: 0.2), "
        "instead of --muon-scale-mode/--muon-extra-scale-factor; none: off.",
    ),
    (
        ("--muon-ns-form",),
        "muon_ns_form",
        str,
        NS_FORMS,
        "Newton-Schulz's form: standard (upstream's steps) or auto (the same polynomial in its "
        "Gram form where that saves >= 1/4 of the FLOPs, on matrices orthogonalized whole; "
        "sharded ones stay standard). Its m x m steps run in full fp32: faster in time where "
        "the standard form's are fp32 too, slower where they run in bf16 or TF32 (GPUs).",
    ),
    (
        ("--muon-distopt-exchange-dtype",),
        "muon_distopt_exchange_dtype",
        str,
        EXCHANGE_DTYPES,
        "dtype of the Muon momentum the DistributedOptimizer exchanges (fp32 is exact; bf16 "
        "Newton-Schulz exchanges bf16 both ways, exactly). Needs --use-distributed-optimizer.",
    ),
    (
        ("--muon-plan-tflops",),
        "muon_plan_tflops",
        _float_or_none,
        None,
        "Achieved matmul TFLOP/s per GPU the DistOpt Muon planner assumes (none: 396, "
        "H100-class). Needs --use-distributed-optimizer.",
    ),
    (
        ("--muon-plan-dp-link-gbps",),
        "muon_plan_dp_link_gbps",
        _float_or_none,
        None,
        "Gb/s per GPU and direction between nodes the planner assumes (none: 400; inf: free). "
        "Needs --use-distributed-optimizer.",
    ),
    (
        ("--muon-plan-nvlink-gbps",),
        "muon_plan_nvlink_gbps",
        _float_or_none,
        None,
        "Gb/s per GPU and direction over NVLink the planner assumes (none: 3600; inf: free). "
        "Needs --use-distributed-optimizer.",
    ),
    (
        ("--muon-plan-nvlink-domain",),
        "muon_plan_nvlink_domain",
        int,
        None,
        "GPUs sharing NVLink, consecutive global ranks (default: the GPUs of one host; 72 on "
        "NVL72). Needs --use-distributed-optimizer.",
    ),
    (
        ("--muon-plan-min-efficiency",),
        "muon_plan_min_efficiency",
        _float_or_none,
        None,
        "Floor in (0, 1] on the DistOpt Muon plan's counted Newton-Schulz FLOP efficiency: the "
        "fastest plan that reaches it (none: the fastest plan). Needs --use-distributed-optimizer.",
    ),
)
# Settings of the DistributedOptimizer's Muon exchange and plan: without DistOpt they do nothing.
DISTOPT_ONLY = tuple(
    dest for _, dest, *_ in KNOBS if dest not in ("muon_matched_adamw_rms", "muon_ns_form")
)


def _field_defaults() -> dict:
    """OptimizerConfig's field defaults: the one home of every default."""
    from megatron.core.optimizer import OptimizerConfig

    return {f.name: f.default for f in dataclasses.fields(OptimizerConfig)}


class _StoreGiven(argparse.Action):
    """argparse's store, also noting which flag set the value (a knob given at its default is
    still a knob given: with upstream's Muon it would be ignored, so it is refused)."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        given = dict(getattr(namespace, GIVEN, None) or {})
        given[self.dest] = option_string
        setattr(namespace, GIVEN, given)


def add_megatron_muon_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Register ``--muon-impl`` and our Muon's knobs (defaults: ``OptimizerConfig``'s)."""
    defaults = _field_defaults()
    group = parser.add_argument_group(
        title="megatron-muon",
        description="megatron-muon's exact, sharded Muon: --optimizer muon --muon-impl "
        "megatron_muon (with --use-distributed-optimizer it shards inside the "
        "DistributedOptimizer). The knobs below need --muon-impl megatron_muon.",
    )
    group.add_argument(
        "--muon-impl",
        type=str,
        default=defaults["muon_impl"],
        choices=MUON_IMPLS,
        dest="muon_impl",
        help="Which Muon --optimizer muon builds: emerging (upstream's emerging_optimizers "
        "TensorParallelMuon; with --use-distributed-optimizer its LayerWise optimizer) or "
        "megatron_muon (ours: exact inside the DistributedOptimizer, fp16 too; its checkpoints "
        "are not upstream's). Default: %(default)s.",
    )
    for names, dest, type_, choices, text in KNOBS:
        group.add_argument(
            *names,
            type=type_,
            default=defaults[dest],
            choices=choices,
            dest=dest,
            action=_StoreGiven,
            help=f"{text} Default: %(default)s.",
        )
    return parser


def admit_muon_tp_mode_owner(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``owner`` (ours, needs ``--muon-impl megatron_muon``) to the choices of upstream's
    ``--muon-tp-mode`` (patch 0091); its default and other values stay upstream's.

    Args:
        parser: upstream's parser, ``--muon-tp-mode`` registered.

    Returns:
        The parser.
    """
    action = next(a for a in parser._actions if a.dest == "muon_tp_mode")
    action.choices = [*action.choices, "owner"]
    return parser


def validate_megatron_muon_args(args) -> None:
    """Check ``--muon-impl`` and our knobs in upstream's ``validate_args``, before its emerging
    optimizer check (which skips ``is_megatron_muon(args)``).

    ``--muon-impl megatron_muon`` with ``--optimizer dist_muon`` (upstream's deprecated name)
    becomes ``--optimizer muon --use-distributed-optimizer``: our Muon inside the DistOpt.

    Raises:
        ValueError: naming the flag, its value and what is allowed.
    """
    given = getattr(args, GIVEN, None) or {}
    if hasattr(args, GIVEN):
        delattr(args, GIVEN)  # parse-time bookkeeping: not an argument (nor saved in checkpoints)
    flags = sorted(given.values())
    if getattr(args, "qk_clip_per_head", False) and not args.qk_clip:
        raise ValueError(
            "--qk-clip-per-head selects the rule of --qk-clip: add --qk-clip or drop it"
        )
    if args.muon_impl != "megatron_muon":
        if getattr(args, "muon_tp_mode", None) == "owner":
            raise ValueError(
                "--muon-tp-mode owner is megatron-muon's TP mode, but --muon-impl is "
                f"{args.muon_impl!r}: add --muon-impl megatron_muon or pick one of upstream's "
                "blockwise, duplicated, distributed"
            )
        if flags:
            verb = "configures" if len(flags) == 1 else "configure"
            raise ValueError(
                f"{', '.join(flags)} {verb} megatron-muon's Muon, but --muon-impl is "
                f"{args.muon_impl!r}: add --muon-impl megatron_muon (with --optimizer muon) or "
                "drop them"
            )
        return
    if args.optimizer == "dist_muon":
        from megatron.training.utils import warn_rank_0

        warn_rank_0(
            "optimizer='dist_muon' is deprecated. "
            "Use --optimizer muon --use-distributed-optimizer instead."
        )
        args.optimizer = "muon"
        args.use_distributed_optimizer = True
    if args.optimizer != "muon":
        raise ValueError(
            f"--muon-impl megatron_muon selects the Muon that --optimizer muon builds, but "
            f"--optimizer is {args.optimizer!r}: add --optimizer muon or drop --muon-impl"
        )
    distopt = sorted(flag for dest, flag in given.items() if dest in DISTOPT_ONLY)
    sharded = args.use_distributed_optimizer or getattr(args, "use_torch_fsdp2", False)
    if distopt and not sharded:  # FSDP2 runs the same exchange (megatron_muon/fsdp.py)
        verb = "configures" if len(distopt) == 1 else "configure"
        raise ValueError(
            f"{', '.join(distopt)} {verb} the DistributedOptimizer's Muon exchange and plan: "
            "add --use-distributed-optimizer (or --use-torch-fsdp2) or drop them"
        )
    _check_fsdp2_format(args)
    _check_values(args)


def _check_fsdp2_format(args) -> None:
    """FSDP2 checkpoints save as torch_dcp; upstream's default torch_dist fails at the first
    save, after the run has trained (measured: "Param id 8 does not match any model sharded
    param"), so a run that would save is refused before it starts."""
    fsdp2 = getattr(args, "use_torch_fsdp2", False)
    if fsdp2 and getattr(args, "save", None) and args.ckpt_format == "torch_dist":
        raise ValueError(
            "--use-torch-fsdp2 with --save and --ckpt-format torch_dist (upstream's default): "
            "FSDP2 checkpoints of our Muon save with --ckpt-format torch_dcp; torch_dist fails "
            "at the first save"
        )


def _check_values(args) -> None:
    """megatron-core's check of the Muon settings (``validate_muon_config``), run now on the
    values args will give ``OptimizerConfig``; its message names the fields, ours the flags."""
    view = argparse.Namespace(
        **{name: getattr(args, name, default) for name, default in _field_defaults().items()}
    )
    try:
        validate_muon_config(view)
    except ValueError as err:
        fields = getattr(err, "fields", ())
        named = ", ".join(_given(name, getattr(view, name)) for name in fields)
        raise ValueError(f"{named or '--muon-impl megatron_muon'}: {err}") from None


def _given(field: str, value) -> str:
    """A field's flag as given: ``--flag`` for a switch, else ``--flag value``."""
    return _flag(field) if isinstance(value, bool) else f"{_flag(field)} {value}"


def _flag(field: str) -> str:
    """The flag of an OptimizerConfig Muon field: ours from KNOBS, else upstream's spelling."""
    for names, dest, *_ in KNOBS:
        if dest == field:
            return names[0]
    return "--muon-no-split-qkv" if field == "muon_split_qkv" else "--" + field.replace("_", "-")


def check_checkpoint_muon_impl(checkpoint_args, args) -> None:
    """Refuse to resume one Muon's optimizer state with the other (upstream's LayerWise/emerging
    state and ours differ in layout and keys). A checkpoint saved without ``--muon-impl`` is
    upstream's; ``--no-load-optim`` (or ``--finetune``) loads the model only, which either Muon
    can then train. Nor is our Muon's state converted between the DistributedOptimizer,
    Megatron-FSDP and FSDP2 (each such load failed unnamed once it began: docs/fsdp.md). Called
    from upstream's ``check_checkpoint_args`` (every format) and, for ``torch_dist``,
    ``fsdp_dtensor`` and (``check_muon_impl_before_load``) ``torch_dcp``, as soon as the
    checkpoint's args are read on every rank: before the state to load is built from this run's
    optimizer.

    Raises:
        RuntimeError: one line naming the flags (``--muon-impl``, or the wrappers' and
            ``--ckpt-format``), the saved values and this run's.
    """
    if args.optimizer != "muon" or args.no_load_optim or args.finetune:
        return
    if getattr(checkpoint_args, "optimizer", None) not in ("muon", "dist_muon"):
        return
    saved = getattr(checkpoint_args, "muon_impl", None) or _field_defaults()["muon_impl"]
    if saved != args.muon_impl:
        raise RuntimeError(
            f"checkpoint was saved with --muon-impl {saved}; this run uses {args.muon_impl}: "
            "the two Muons' optimizer states are not interchangeable (resume with --muon-impl "
            f"{saved}, or add --no-load-optim to load the model only)"
        )
    saved, mine = _wrapper(checkpoint_args), _wrapper(args)
    across = None not in (saved, mine) and saved[0] != mine[0] and ZERO3 & {saved[0], mine[0]}
    if across and args.muon_impl == "megatron_muon":
        raise RuntimeError(
            f"checkpoint was saved with {saved[0]} (--ckpt-format {saved[1]}); this run uses "
            f"{mine[0]} (--ckpt-format {mine[1]}): such checkpoints are not converted between "
            "the DistributedOptimizer, Megatron-FSDP and FSDP2 (resume with the saving run's "
            "flags; docs/fsdp.md)"
        )


ZERO3 = {"--use-megatron-fsdp", "--use-torch-fsdp2"}


def check_muon_impl_before_load(args, read_checkpoint) -> None:
    """For our Muon with ``--ckpt-format torch_dcp`` (FSDP2), read the checkpoint's args before
    its state (upstream reads torch_dist's and fsdp_dtensor's first; patch 0092) and refuse a
    mismatch (``check_checkpoint_muon_impl``) on every rank before anything loads. Any other run:
    nothing is read.

    Args:
        args: this run's Megatron-LM args.
        read_checkpoint: returns the checkpoint's rank-0 state dict (its ``args``), or None where
            there is none (``load_checkpoint`` passes ``_load_base_checkpoint(rank0=True)``).

    Raises:
        RuntimeError: as ``check_checkpoint_muon_impl``.
    """
    ours = args.optimizer == "muon" and getattr(args, "muon_impl", None) == "megatron_muon"
    if not ours or args.ckpt_format != "torch_dcp":
        return
    state_dict = read_checkpoint()
    if state_dict is not None and state_dict.get("args"):
        check_checkpoint_muon_impl(state_dict["args"], args)


def _wrapper(args) -> Optional[tuple]:
    """(the data-parallel wrapper's flag, ``--ckpt-format``) a run's args name; None: none."""
    for flag in ("--use-megatron-fsdp", "--use-torch-fsdp2", "--use-distributed-optimizer"):
        if getattr(args, flag.removeprefix("--").replace("-", "_"), False):
            return flag, getattr(args, "ckpt_format", "?")
    return None  # no DistOpt: not refused (untested across)
