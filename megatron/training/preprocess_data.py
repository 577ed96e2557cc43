"""jsonl to the ``.bin``/``.idx`` pairs ``--data-path`` takes, from the installed package (the
0.19.2 archive ships no ``tools/``), with the flags of Megatron-LM's ``tools/preprocess_data.py``
and its output names (``PREFIX_KEY_document.bin/.idx``):

    python -m megatron.training.preprocess_data --input docs.jsonl --output-prefix data/docs \\
        --tokenizer-type GPT2BPETokenizer --vocab-file gpt2-vocab.json \\
        --merge-file gpt2-merges.txt --append-eod --workers 8

Every tokenizer of upstream's ``--tokenizer-type`` works, offline where its files are local
(``docs/air_gapped.md``). The tokenizer is built once in this process first: a missing file,
flag or package is one line and exit status 2 before any worker starts (upstream's pool restarts
a worker whose initializer fails, forever). The workers are forked and inherit it.
With ``--partitions N`` the input (a glob, ``.gz`` too) is dealt into N partition files beside it
(line by line, or in N contiguous blocks with ``--keep-sequential-samples``), each is encoded and
the N outputs are merged in partition order, as upstream's. Not built here (refused):
``--split-sentences`` (NLTK's punkt, downloaded at run time upstream) and
``--find-optimal-num-workers``.
"""

import argparse
import glob
import gzip
import json
import math
import multiprocessing
import os
import sys
import time

from megatron.core.datasets import indexed_dataset
from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
from megatron.training.arguments import _add_tokenizer_args

from megatron.training import preflight

# Lines a worker takes at a time (upstream's chunk size)
CHUNK = 32
# Upstream's preprocess_data.py sets these for the tokenizer (no model, no TP)
TOKENIZER_DUMMIES = dict(
    rank=1, make_vocab_size_divisible_by=128, tensor_model_parallel_size=1, vocab_extra_ids=0
)
# (flag, args attribute) of upstream's flags this command does not build
REFUSED = (
    ("--split-sentences", "split_sentences"),
    ("--find-optimal-num-workers", "find_optimal_num_workers"),
)

_tokenizer = None  # the parent's, inherited by the forked workers
_json_keys = ("text",)
_append_eod = False


def parser() -> argparse.ArgumentParser:
    """Upstream's flags: its tokenizer group and the preprocessing ones."""
    p = _add_tokenizer_args(
        argparse.ArgumentParser(prog="python -m megatron.training.preprocess_data")
    )
    g = p.add_argument_group(title="input data")
    g.add_argument(
        "--input", type=str, required=True, help="Path to input JSON (a glob with --partitions)"
    )
    g.add_argument(
        "--json-keys", nargs="+", default=["text"], help="Keys to extract from each JSON line"
    )
    g.add_argument(
        "--split-sentences",
        action="store_true",
        help="Split documents into sentences (not built here)",
    )
    g.add_argument(
        "--keep-newlines",
        action="store_true",
        help="Keep newlines between sentences when splitting",
    )
    g = p.add_argument_group(title="tokenization process")
    g.add_argument(
        "--append-eod", action="store_true", help="Append an <eod> token to each document"
    )
    g.add_argument(
        "--lang", type=str, default="english", help="Language of NLTK's sentence splitting"
    )
    g = p.add_argument_group(title="output data")
    g.add_argument(
        "--output-prefix", type=str, required=True, help="Path of the output files without suffix"
    )
    g = p.add_argument_group(title="runtime")
    g.add_argument("--workers", type=int, required=True, help="Number of worker processes")
    g.add_argument("--find-optimal-num-workers", action="store_true", help="(not built here)")
    g.add_argument(
        "--workers-to-check", nargs="+", type=int, default=[16, 32, 64], help="(not built here)"
    )
    g.add_argument("--max-documents", type=int, default=100_000, help="(not built here)")
    g.add_argument("--partitions", type=int, default=1, help="Number of file partitions")
    g.add_argument(
        "--log-interval", type=int, default=1000, help="Interval between progress updates"
    )
    g.add_argument(
        "--keep-sequential-samples",
        action="store_true",
        help="Keep the order of the documents with --partitions > 1 (contiguous blocks)",
    )
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    for name, value in TOKENIZER_DUMMIES.items():
        setattr(args, name, value)
    problems = refusals(args)
    if problems:
        print(f"preprocess_data: error: {'; '.join(problems)}", file=sys.stderr, flush=True)
        return 2
    global _tokenizer, _json_keys, _append_eod
    _tokenizer, _json_keys, _append_eod = (
        build_tokenizer(args),
        tuple(args.json_keys),
        args.append_eod,
    )
    level = "document"
    os.makedirs(os.path.dirname(os.path.abspath(args.output_prefix)), exist_ok=True)
    parts = partitions(args)
    for source, prefix in parts:
        encode_file(source, prefix, args.workers // len(parts), args.log_interval)
    if len(parts) > 1:
        for key in args.json_keys:
            merge(
                [f"{prefix}_{key}_{level}" for _, prefix in parts],
                f"{args.output_prefix}_{key}_{level}",
            )
    return 0


def refusals(args) -> list:
    """One line per flag not built, bad value, or missing file/package (before any worker)."""
    found = [
        f"{flag} is not built by this command" for flag, name in REFUSED if getattr(args, name)
    ]
    if args.tokenizer_type is None:
        found.append("--tokenizer-type is required (upstream's types: see --help)")
    if args.workers < 1 or args.partitions < 1 or args.workers % args.partitions:
        found.append(
            f"--workers {args.workers} must be a positive multiple of "
            f"--partitions {args.partitions}"
        )
    if args.partitions == 1 and not os.path.isfile(args.input):
        found.append(f"--input {args.input}: no such file")
    if args.partitions > 1 and not glob.glob(args.input):
        found.append(f"--input {args.input}: no file matches")
    return found + preflight.tokenizer_problems(args, default_tokenizer=args.tokenizer_type)


def encode_file(source: str, prefix: str, workers: int, log_interval: int) -> None:
    """``source`` (jsonl) to ``PREFIX_KEY_document.bin/.idx``, one builder per JSON key."""
    dtype = indexed_dataset.DType.optimal_dtype(_tokenizer.vocab_size)
    builders = {
        key: indexed_dataset.IndexedDatasetBuilder(f"{prefix}_{key}_document.bin", dtype=dtype)
        for key in _json_keys
    }
    # tokenizers' own thread pool does not survive a fork; the workers are the parallelism
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    start, done = time.time(), 0
    with _open(source) as lines, multiprocessing.get_context("fork").Pool(workers) as pool:
        for count, (docs, nbytes) in enumerate(pool.imap(encode, lines, CHUNK), start=1):
            for key, (ids, lengths) in docs.items():
                builders[key].add_document(ids, lengths)
            done += nbytes
            if count % log_interval == 0:
                _progress(count, done, time.time() - start)
    for key, builder in builders.items():
        builder.finalize(f"{prefix}_{key}_document.idx")


def encode(line: str):
    """One JSON line: per key, (token ids, [their count]) with the eod appended if asked; and the
    line's size in bytes."""
    data = json.loads(line)
    docs = {}
    for key in _json_keys:
        text = data[key]
        ids = []
        lengths = []
        for sentence in text if isinstance(text, list) else [text]:
            sentence_ids = _tokenizer.tokenize(sentence)
            if sentence_ids:
                ids.extend(sentence_ids)
                lengths.append(len(sentence_ids))
        if ids and _append_eod:
            ids.append(_tokenizer.eod)
            lengths[-1] += 1
        docs[key] = (ids, lengths)
    return docs, len(line)


def partitions(args) -> list:
    """[(jsonl file, output prefix)]: the input itself, or N partition files dealt from the
    input files (reused where they exist, as upstream's)."""
    if args.partitions == 1:
        return [(args.input, args.output_prefix)]
    stem, ext = os.path.splitext(args.input)
    parts = [(f"{stem}_{i}{ext}", f"{args.output_prefix}_{i}") for i in range(args.partitions)]
    if not all(os.path.exists(name) for name, _ in parts):
        _deal(
            sorted(glob.glob(args.input)), [name for name, _ in parts], args.keep_sequential_samples
        )
    return parts


def _deal(sources: list, targets: list, sequential: bool) -> None:
    block = math.ceil(sum(_count(s) for s in sources) / len(targets)) if sequential else None
    outs = [open(name, "w", encoding="utf-8") for name in targets]
    try:
        index = 0
        for source in sources:
            with _open(source) as lines:
                for line in lines:
                    if sequential:
                        outs[index // block].write(line)
                    else:
                        outs[index % len(outs)].write(line)
                    index += 1
    finally:
        for out in outs:
            out.close()


def merge(prefixes: list, output: str) -> None:
    """The partitions' ``.bin/.idx`` pairs, one after another, as one pair."""
    dtype = indexed_dataset.DType.optimal_dtype(_tokenizer.vocab_size)
    builder = indexed_dataset.IndexedDatasetBuilder(f"{output}.bin", dtype=dtype)
    for prefix in prefixes:
        builder.add_index(prefix)
    builder.finalize(f"{output}.idx")


def _count(source: str) -> int:
    with _open(source) as lines:
        return sum(1 for _ in lines)


def _open(source: str):
    if source.endswith(".gz"):
        return gzip.open(source, "rt", encoding="utf-8")
    return open(source, encoding="utf-8")


def _progress(count: int, nbytes: int, elapsed: float) -> None:
    elapsed = max(elapsed, 1e-9)
    print(
        f"Processed {count} documents ({count / elapsed:.1f} docs/s, "
        f"{nbytes / elapsed / 2**20:.2f} MB/s).",
        file=sys.stderr,
    )


if __name__ == "__main__":
    sys.exit(main())
