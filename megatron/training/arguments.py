"""Megatron-LM compatible command line for pretrain_gpt.py, driven by one table.

    args = parse_args(argv)      # raises ArgumentsError with a message naming the flag

``flags.tsv`` (beside this file) holds one row per argparse action. Its first eight columns are
Megatron-LM core_v0.16.1's own parser read off as data (option strings, dest, action, type,
default, choices, nargs, group); rows from upstream main and our own follow. Three columns are
ours: ``source``, ``state`` and ``note``. The state of a flag is exactly one of:

- implemented: ``TransformerConfig.<field>`` (or ``MLATransformerConfig`` / ``OptimizerConfig`` /
  ``DistributedDataParallelConfig``): the value fills that megatron-core field, which implements
  the feature; ``args``: our training code reads ``args.<dest>``.
- ``noeffect``: accepted and listed once at start-up; only pure performance or deprecated switches
  (or switches that turn off something this stack does not have). ``note`` says why.
- ``refused``: using it is an error naming the flag and ``note`` (the reason), before any process
  group or file is touched.

Flipping a flag from refused to implemented is a change of its ``state`` cell. Defaults are
upstream's CLI defaults, read from the table; ``DIFFERENCES`` lists where we deliberately differ.
Several names for one dest are aliases; giving two with different values is an error. Unknown
flags fail with the closest known names. Cross-flag checks live in ``validation.py``.
"""

import argparse
import ast
import dataclasses
import difflib
import enum
import os
import re
import typing
from dataclasses import dataclass
from functools import cache, lru_cache
from pathlib import Path
from typing import Any, Optional

from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.transformer import MLATransformerConfig, TransformerConfig

from megatron.core.optimizer import OptimizerConfig

TABLE = Path(__file__).with_name("flags.tsv")
UPSTREAM_COLUMNS = ("flags", "dest", "action", "type", "default", "choices", "nargs", "group")
HOMES = {
    cls.__name__: cls
    for cls in (
        TransformerConfig,
        MLATransformerConfig,
        OptimizerConfig,
        DistributedDataParallelConfig,
    )
}
STATES = ("core", "args", "noeffect", "refused")

# Deliberate differences from upstream's CLI, shown in --help and the README.
DIFFERENCES = {
    "--tokenizer-type": (
        dict(extra_choices=("ByteLevelTokenizer",)),
        "adds ByteLevelTokenizer (ours: bytes as tokens, no files needed); default: "
        "NullTokenizer with --mock-data, else ByteLevelTokenizer",
    ),
    "--transformer-impl": (
        {},
        "without Transformer Engine installed, the default becomes local",
    ),
    "--eval-interval": (
        {},
        "unset: 1000 here (upstream's loop then evaluates only if an interval is set)",
    ),
    "--exit-duration-in-mins": (dict(type=float), "a fraction of a minute is accepted too"),
    "--no-create-attention-mask-in-dataloader": (
        dict(default=False),
        "no mask is built by default here (causal models: it would cost memory for nothing)",
    ),
    "--exit-signal": (
        dict(type=str, choices=None),
        "a name (SIGTERM) or a number; validation turns it into the signal",
    ),
    "--muon-fp32-matmul-prec": (
        dict(extra_choices=("highest",)),
        "adds highest (fp32 Newton-Schulz, TF32 off), the third of torch's names that upstream's "
        "Muon passes to torch.set_float32_matmul_precision; low, which torch lacks, is refused",
    ),
}


class ArgumentsError(ValueError):
    """Bad command line: the message names the flag and what is allowed."""


@dataclass(frozen=True)
class Flag:
    """One row of the table."""

    names: tuple
    dest: str
    action: str
    type: str
    default: str
    choices: str
    nargs: str
    group: str
    source: str
    state: str
    note: str

    @property
    def kind(self) -> str:
        return self.state if self.state in STATES[1:] else "core"

    @property
    def home(self) -> Optional[type]:
        return HOMES[self.state.split(".")[0]] if self.kind == "core" else None

    @property
    def field(self) -> Optional[str]:
        return self.state.split(".", 1)[1] if self.kind == "core" else None

    @property
    def attr(self) -> str:
        return self.dest


def _row(line: str, header: list) -> Flag:
    cells = dict(zip(header, line.split("\t")))
    names = tuple(cells.pop("flags").split())
    return Flag(names=names, **cells)


def load_table(path: Path = TABLE) -> list:
    """The rows of ``flags.tsv``; a core row naming a field its dataclass lacks fails here."""
    lines = path.read_text().splitlines()
    header = lines[0].split("\t")
    flags = [_row(line, header) for line in lines[1:] if line]
    for flag in flags:
        _check_state(flag)
    return flags


def _check_state(flag: Flag) -> None:
    if flag.kind != "core":
        if flag.kind in ("noeffect", "refused") and not flag.note:
            raise RuntimeError(f"flags.tsv: {flag.names[0]} is {flag.kind} without a reason")
        return
    home = HOMES.get(flag.state.split(".")[0])
    if home is None or flag.field not in {f.name for f in dataclasses.fields(home)}:
        raise RuntimeError(f"flags.tsv: {flag.names[0]} maps to {flag.state}, which does not exist")


FLAGS = load_table()


# ---- values: types, defaults and choices as upstream's parser has them ----


def _float_or_none(text: str):
    return None if text.lower() == "none" else float(text)


def _bool(text: str) -> bool:
    if text.lower() not in ("true", "false", "1", "0"):
        raise ValueError(text)
    return text.lower() in ("true", "1")


def _int_tuple(text: str) -> tuple:
    return tuple(int(i) for i in text.strip("()").split(","))


def _layer_pattern(text: str):
    """Upstream's layer-frequency pattern: ``N`` or a list expression such as
    ``([1]*3+[0]*1)*3``, evaluated here without eval (only lists of ints, + and *)."""
    if re.search(r"[^,\d\[\]\(\)\+\*\s]", text):
        raise ValueError(f"invalid pattern {text!r}")
    return _pattern_value(ast.parse(text, mode="eval").body) if "[" in text else int(text)


def _pattern_value(node):
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.List):
        return [_pattern_value(item) for item in node.elts]
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _pattern_value(node.left), _pattern_value(node.right)
        return left + right if isinstance(node.op, ast.Add) else left * right
    raise ValueError("invalid pattern")


TYPES = {
    "int": int,
    "float": float,
    "str": str,
    "": str,
    "bool": _bool,
    "float_or_none": _float_or_none,
    "enum_type_handler": str,  # member names; validation turns them into the enum
    "<lambda>": str,
    "moe_freq_type": _layer_pattern,
    "la_freq_type": _layer_pattern,
    "no_rope_freq_type": _layer_pattern,
    "tuple_type": _int_tuple,
}


def _enum_name(text: str) -> str:
    """``<AttnBackend.auto: 5>`` or ``AttnBackend.auto`` -> ``auto``."""
    match = re.fullmatch(r"<?\w+\.(\w+)(: .*>)?", text)
    return match.group(1) if match else text


@cache
def default_of(flag: Flag) -> Any:
    """Upstream's CLI default, as the table records it (a Python literal)."""
    if flag.default.startswith("<"):
        return _enum_name(flag.default)
    return ast.literal_eval(flag.default) if flag.default else None


@cache
def allowed_values(flag: Flag) -> Optional[tuple]:
    """Upstream's choices; else, for a core field typed ``Literal``/enum, its values."""
    if flag.choices:
        convert = TYPES[flag.type] if flag.type in ("int", "float") else _enum_name
        extra = DIFFERENCES.get(flag.names[0], ({}, ""))[0].get("extra_choices", ())
        return tuple(convert(c) for c in flag.choices.split("|")) + extra
    if flag.kind != "core":
        return None
    hint = typing.get_type_hints(flag.home).get(flag.field)
    for candidate in (hint, *typing.get_args(hint)):
        if typing.get_origin(candidate) is typing.Literal:
            return typing.get_args(candidate)
        if isinstance(candidate, type) and issubclass(candidate, enum.Enum):
            return tuple(candidate.__members__)
    return None


# ---- the argparse parser ----


def _help(flag: Flag) -> str:
    where = {"core": flag.state, "args": "implemented"}.get(flag.kind, flag.kind.upper())
    text = f"{flag.note} [{where}; default: {default_of(flag)!r}"
    if flag.names[0] in DIFFERENCES:
        text += f"; differs from Megatron-LM: {DIFFERENCES[flag.names[0]][1]}"
    if flag.source != "core_v0.16.1":
        text += f"; from {'upstream main' if flag.source == 'main' else 'this project'}"
    return (text + "]").replace("%", "%%").strip()


def _add(group, flag: Flag, slot: str) -> None:
    kw = dict(dest=slot, help=_help(flag))
    if flag.action == "Store":
        kw["metavar"] = flag.dest.upper()
    if flag.action in ("StoreTrue", "StoreFalse"):
        const = flag.action == "StoreTrue"
        group.add_argument(*flag.names, action="store_const", const=const, **kw)
    elif flag.action == "BooleanOptional":
        group.add_argument(flag.names[0], action=argparse.BooleanOptionalAction, **kw)
    else:
        nargs = int(flag.nargs) if flag.nargs.isdigit() else flag.nargs or None
        choices = allowed_values(flag) if flag.choices else None
        convert = _enum_name if flag.type == "enum_type_handler" else TYPES[flag.type]
        kw.update(dict(type=convert, choices=choices, nargs=nargs), **_overrides(flag))
        group.add_argument(*flag.names, **kw)


def _overrides(flag: Flag) -> dict:
    """A deliberate difference's type/choices (DIFFERENCES)."""
    changes = DIFFERENCES.get(flag.names[0], ({}, ""))[0]
    return {k: v for k, v in changes.items() if k in ("type", "choices")}


@lru_cache(maxsize=1)
def build_parser() -> argparse.ArgumentParser:
    """One parser per process (661 rows take a while to add); parsing does not change it."""
    parser = _Parser(prog="pretrain_gpt.py", allow_abbrev=False, argument_default=argparse.SUPPRESS)
    groups: dict = {}
    for i, flag in enumerate(FLAGS):
        if flag.group not in groups:
            groups[flag.group] = parser.add_argument_group(flag.group)
        _add(groups[flag.group], flag, _slot(i))
    return parser


def _slot(index: int) -> str:
    """A private dest per row, so that two aliases given together can be compared."""
    return f"row:{index}"


def known_flags() -> list:
    return [name for flag in FLAGS for name in flag.names]


def flag_states(names) -> dict:
    """{name: state} for flag names as a launch script lists them (no values needed): the
    row's kind (core, args, noeffect, refused), or None for a name the table does not know."""
    rows = {name: flag for flag in FLAGS for name in flag.names}
    return {name: rows[name].kind if name in rows else None for name in names}


def _raise_unknown(unknown: list) -> None:
    for item in unknown:
        if item.startswith("-"):
            name = item.split("=", 1)[0]
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


# ---- from parsed rows to one value per dest ----


def _given_values(namespace: argparse.Namespace) -> dict:
    """{dest: [(flag, value), ...]} of the flags on the command line."""
    given: dict = {}
    for slot, value in vars(namespace).items():
        flag = FLAGS[int(slot.split(":")[1])]
        given.setdefault(flag.dest, []).append((flag, value))
    return given


def _refuse(given: dict) -> None:
    for items in given.values():
        for flag, _ in items:
            if flag.kind == "refused":
                raise ArgumentsError(f"{flag.names[0]} is not supported here: {flag.note}")


def _defaults() -> dict:
    values: dict = {}
    for flag in FLAGS:
        values.setdefault(flag.dest, default_of(flag))  # the first row of a dest wins (argparse)
    for name, (changes, _) in DIFFERENCES.items():
        if "default" in changes:
            values[_by_name(name).dest] = changes["default"]
    return values


def _by_name(name: str) -> Flag:
    return next(flag for flag in FLAGS if name in flag.names)


def _resolve(given: dict) -> dict:
    """One value per dest: defaults, given values over them; conflicting aliases are errors."""
    values = _defaults()
    for dest, items in given.items():
        if len({repr(v) for _, v in items}) > 1:
            shown = ", ".join(f"{f.names[0]}={v!r}" for f, v in items)
            raise ArgumentsError(f"conflicting values for one setting ({dest}): {shown}")
        values[dest] = items[0][1]
    return values


def no_effect_names(given: dict) -> list:
    return sorted(f.names[0] for items in given.values() for f, _ in items if f.kind == "noeffect")


def parse_args(argv=None, world_size: Optional[int] = None) -> argparse.Namespace:
    """Parse and validate. ``args.given`` is the set of dests set on the command line,
    ``args.no_effect`` the accepted-without-effect flags given (main prints them once) and
    ``args.world_size`` the launcher's WORLD_SIZE (1 without a launcher)."""
    namespace, unknown = build_parser().parse_known_args(argv)
    if unknown:
        _raise_unknown(unknown)
    given = _given_values(namespace)
    _refuse(given)
    args = argparse.Namespace(**_resolve(given))
    args.given = set(given)
    args.no_effect = no_effect_names(given)
    args.world_size = world_size or int(os.environ.get("WORLD_SIZE", "1"))
    if args.use_checkpoint_args:
        from . import checkpoint_args

        checkpoint_args.apply(args)
    from .validation import validate_args

    validate_args(args)
    return args
