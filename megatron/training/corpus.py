"""A default training corpus that every machine has offline: the Python standard library's own
source files (code, comments and docstrings), one document per file, byte-level tokenized.

Launch (prints the data prefix to pass as --data-path):
    .venv/bin/python -m megatron.training.corpus [--cache-dir DIR] [--max-bytes 4194304]

The corpus depends on the Python version (its stdlib), so the cache folder is named after it and
the size cap; within one version the build is deterministic and a second call only looks it up.
"""

import argparse
import json
import os
import sys
import sysconfig
import tempfile

import numpy

DEFAULT_MAX_BYTES = 4 * 1024 * 1024
DEFAULT_CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "megatron-muon", "corpus")

# Third-party code and the (huge, repetitive) test suites are not the stdlib proper.
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}

BYTE_EOD = 256  # ByteLevelTokenizer's eod: ids 0..255 are the UTF-8 bytes.


def stdlib_files() -> list[tuple[str, str]]:
    """(relative posix path, absolute path) of every stdlib ``.py`` file, sorted by the relative
    path so that the order does not depend on the file system."""
    root = sysconfig.get_paths()["stdlib"]
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS]
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                found.append((os.path.relpath(path, root).replace(os.sep, "/"), path))
    return sorted(found)


def stdlib_documents(max_bytes: int = DEFAULT_MAX_BYTES):
    """Yield ``{"path", "text"}`` per non-empty stdlib file in order, stopping before the UTF-8
    total would pass ``max_bytes``."""
    total = 0
    for rel, path in stdlib_files():
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (UnicodeDecodeError, OSError):
            continue  # a few test fixtures are deliberately not UTF-8
        if not text.strip():
            continue  # empty __init__.py files carry nothing
        total += len(text.encode("utf-8"))
        if total > max_bytes:
            return
        yield {"path": rel, "text": text}


def write_corpus_jsonl(path: str, max_bytes: int = DEFAULT_MAX_BYTES) -> int:
    """Write the corpus as jsonl (the input of tools/preprocess_data.py); returns documents."""
    count = 0
    with open(path, "w", encoding="utf-8") as f:
        for doc in stdlib_documents(max_bytes):
            f.write(json.dumps(doc) + "\n")
            count += 1
    return count


def corpus_dir(cache_dir: str | None = None, max_bytes: int = DEFAULT_MAX_BYTES) -> str:
    version = ".".join(map(str, sys.version_info[:3]))
    return os.path.join(cache_dir or DEFAULT_CACHE_DIR, f"py{version}-{max_bytes}")


def build_corpus(cache_dir: str | None = None, max_bytes: int = DEFAULT_MAX_BYTES) -> str:
    """Build (once) the byte-level indexed dataset of the stdlib corpus and return its prefix,
    the same files ``preprocess_data.py --tokenizer-type ByteLevelTokenizer --append-eod`` writes
    from ``write_corpus_jsonl``'s output. Safe to call from several processes at once: each
    writes to a private temp name and renames."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    folder = corpus_dir(cache_dir, max_bytes)
    prefix = os.path.join(folder, "stdlib_text_document")
    if IndexedDataset.exists(prefix):
        return prefix
    os.makedirs(folder, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=folder, prefix=".build-")
    try:
        _write_indexed(os.path.join(tmp, "stdlib"), max_bytes)
        # .idx last: IndexedDataset.exists checks it, so a reader never sees a half-built pair.
        for ext in (".bin", ".idx"):
            os.replace(os.path.join(tmp, "stdlib" + ext), prefix + ext)
    finally:
        for name in os.listdir(tmp):
            os.remove(os.path.join(tmp, name))
        os.rmdir(tmp)
    return prefix


def _write_indexed(prefix: str, max_bytes: int) -> None:
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=DType.optimal_dtype(BYTE_EOD + 1))
    for doc in stdlib_documents(max_bytes):
        data = numpy.frombuffer(doc["text"].encode("utf-8"), dtype=numpy.uint8)
        ids = numpy.append(data.astype(builder.dtype), builder.dtype(BYTE_EOD))
        builder.add_document(ids, [len(ids)])
    builder.finalize(prefix + ".idx")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Build the stdlib corpus; print its prefix.")
    parser.add_argument("--cache-dir", default=None, help=f"default {DEFAULT_CACHE_DIR}")
    parser.add_argument("--max-bytes", type=int, default=DEFAULT_MAX_BYTES)
    parser.add_argument("--jsonl", default=None, help="also write the corpus as jsonl here")
    args = parser.parse_args(argv)
    if args.max_bytes < 1:
        parser.error(f"--max-bytes must be >= 1, got {args.max_bytes}")
    if args.jsonl:
        write_corpus_jsonl(args.jsonl, args.max_bytes)
    print(build_corpus(args.cache_dir, args.max_bytes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
