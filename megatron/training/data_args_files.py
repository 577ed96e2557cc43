"""Megatron-LM's data files: ``--per-dataset-sequences-path`` (JSON ``{prefix: [sequences,
documents]}``, the counts of each ``.idx`` header, so that megatron-core need not read them),
``--data-args-path`` (the ``--data-path`` items, whitespace separated, in a text file) and
``--per-split-data-args-path`` (a JSON file of per-split paths):

    {"train": "0.7 data/a_text_document 0.3 data/b_text_document",
     "valid": ["data/v_text_document"],
     "test": null}

Each of the three keys is required; a value is a string (split on whitespace), a list of the
same items, or null (no dataset for that split). Items are ``--train-data-path``'s: prefixes,
optionally weighted. The file stands for ``--train-data-path``, ``--valid-data-path`` and
``--test-data-path``; giving it with any of them (or with ``--data-path``) is an error, as
Megatron-LM asserts for ``--data-path``.
"""

import json

FLAG = "--per-split-data-args-path"
SPLITS = ("train", "valid", "test")


def read_sequences_per_dataset(path: str) -> dict:
    """{prefix: [sequence count, document count]}; ValueError naming the file otherwise."""
    flag = "--per-dataset-sequences-path"
    try:
        with open(path, encoding="utf-8") as f:
            table = json.load(f)
    except (OSError, ValueError) as err:
        raise ValueError(f"{flag} {path!r}: not a readable JSON file ({err})") from None
    ok = isinstance(table, dict) and all(
        isinstance(v, list) and len(v) == 2 and all(type(n) is int and n >= 0 for n in v)
        for v in table.values()
    )
    if not ok:
        raise ValueError(
            f"{flag} {path!r}: expected {{prefix: [sequence count, document count]}} with "
            "counts >= 0"
        )
    return table


def apply_data_args_path(args) -> None:
    """``--data-args-path FILE``: ``args.data_path`` from the file's whitespace-separated items
    (prefixes, optionally weighted), as Megatron-LM reads it; exclusive with ``--data-path``."""
    path = args.data_args_path
    if path is None:
        return
    if args.data_path:
        raise ValueError("--data-args-path and --data-path are exclusive: the file gives the paths")
    try:
        with open(path, encoding="utf-8") as f:
            items = f.read().split()
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"--data-args-path {path!r}: cannot read it ({err})") from None
    if not items:
        raise ValueError(f"--data-args-path {path!r} is empty: it should hold --data-path's items")
    args.data_path = items


def read_per_split_data_args(path: str) -> dict:
    """{split: list of items or None}; ValueError naming the file and what is wrong."""
    try:
        with open(path, encoding="utf-8") as f:
            table = json.load(f)
    except OSError as err:
        raise ValueError(f"{FLAG} {path!r}: cannot read it ({err.strerror})") from None
    except ValueError as err:
        raise ValueError(f"{FLAG} {path!r}: not valid JSON ({err})") from None
    if not isinstance(table, dict):
        raise ValueError(f"{FLAG} {path!r}: expected a JSON object with keys {list(SPLITS)}")
    missing = [s for s in SPLITS if s not in table]
    unknown = sorted(set(table) - set(SPLITS))
    if missing or unknown:
        raise ValueError(
            f"{FLAG} {path!r}: keys must be exactly {list(SPLITS)} "
            f"(missing {missing}, unknown {unknown})"
        )
    return {split: _items(path, split, table[split]) for split in SPLITS}


def _items(path: str, split: str, value) -> list | None:
    if value is None:
        return None
    if isinstance(value, str):
        return value.split() or None
    if isinstance(value, list) and all(isinstance(v, (str, int, float)) for v in value):
        return [str(v) for v in value] or None
    raise ValueError(
        f"{FLAG} {path!r}: {split!r} must be a string, a list of prefixes (and weights) or "
        f"null, got {type(value).__name__}"
    )


def apply_per_split_data_args(args) -> None:
    """Fill ``args.{train,valid,test}_data_path`` from the file (before the data checks)."""
    if args.per_split_data_args_path is None:
        return
    given = [f"--{s}-data-path" for s in SPLITS if f"{s}_data_path" in args.given]
    if given or args.data_path:
        others = given + ["--data-path"] * bool(args.data_path)
        raise ValueError(
            f"{FLAG} and {', '.join(others)} are exclusive: the file gives every split's paths"
        )
    for split, items in read_per_split_data_args(args.per_split_data_args_path).items():
        setattr(args, f"{split}_data_path", items)
