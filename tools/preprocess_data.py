"""Tokenize a jsonl corpus into Megatron's indexed dataset (.bin/.idx), flags as upstream
Megatron-LM's tools/preprocess_data.py.

Launch (from the repo root):
    .venv/bin/python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt \
        --append-eod --workers 4

Each jsonl line is one document; for every key of --json-keys (default: text) it writes
{output-prefix}_{key}_document.bin/.idx through megatron-core's IndexedDatasetBuilder; train with
--data-path {output-prefix}_{key}_document. Tokenizer types: ByteLevelTokenizer (ours, no files),
GPT2BPETokenizer, HuggingFaceTokenizer (--tokenizer-model tokenizer.json), NullTokenizer
(--vocab-size), GPTSentencePieceTokenizer, Llama2Tokenizer and SentencePieceTokenizer
(--tokenizer-model x.model; --vocab-extra-ids),
TikTokenizer (--tokenizer-model ranks.json --tiktoken-pattern v1|v2, optionally --vocab-size,
--tiktoken-num-special-tokens, --tiktoken-special-tokens): the flags of pretrain_gpt.py, so that
the ids written are the ones training embeds. Not supported from upstream: --split-sentences,
--partitions.
Bad input exits non-zero with a message naming the flag, and leaves no output files: data is
written under *.partial names and renamed only once every document is in.
"""

import argparse
import json
import multiprocessing
import os
import sys
import time
import warnings

# megatron.core warns on import that TE/Apex are absent; preprocessing uses neither.
warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")

# Same tuple as megatron.training.tokenizer.TOKENIZER_TYPES (a test keeps them equal): kept here so
# that argparse rejects a bad --tokenizer-type before the ~5 s megatron.core import.
TOKENIZER_TYPES = (
    "ByteLevelTokenizer",
    "GPT2BPETokenizer",
    "HuggingFaceTokenizer",
    "NullTokenizer",
    "GPTSentencePieceTokenizer",
    "Llama2Tokenizer",
    "TikTokenizer",
    "SentencePieceTokenizer",
)


def get_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = parser.add_argument_group("input data")
    group.add_argument("--input", required=True, help="jsonl file, one document per line")
    group.add_argument("--json-keys", nargs="+", default=["text"], help="keys to extract")
    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    group.add_argument("--vocab-file", help="GPT2BPETokenizer: vocab.json")
    group.add_argument("--merge-file", help="GPT2BPETokenizer: merges.txt")
    group.add_argument(
        "--tokenizer-model",
        help="HuggingFaceTokenizer: tokenizer.json or folder; GPTSentencePieceTokenizer, "
        "Llama2Tokenizer: sentencepiece .model; TikTokenizer: JSON ranks file",
    )
    group.add_argument(
        "--vocab-size", type=int, help="NullTokenizer: ids below this value; TikTokenizer: size"
    )
    group.add_argument(
        "--vocab-extra-ids", type=int, default=0, help="SentencePieceTokenizer: <extra_id_k>"
    )
    group.add_argument("--tiktoken-pattern", help="TikTokenizer: v1 or v2 (required)")
    group.add_argument(
        "--tiktoken-num-special-tokens", type=int, default=1000, help="TikTokenizer (1000)"
    )
    group.add_argument(
        "--tiktoken-special-tokens", nargs="+", help="TikTokenizer (default <unk> <s> </s>)"
    )
    group.add_argument(
        "--legacy-tokenizer",
        action="store_true",
        help="accepted, no effect: the tokenizers here always follow Megatron-LM's legacy ones",
    )
    group.add_argument("--append-eod", action="store_true", help="end each document with eod")
    group = parser.add_argument_group("output data")
    group.add_argument("--output-prefix", required=True, help="path prefix of the output files")
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    group.add_argument("--log-interval", type=int, default=1000, help="documents between logs")
    args = parser.parse_args(argv)
    _check_args(parser, args)
    return args


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Checks that need no tokenizer, done before the slow megatron.core import."""
    if not os.path.isfile(args.input):
        parser.error(f"--input {args.input!r} does not exist or is not a file")
    if args.workers < 1:
        parser.error(f"--workers must be >= 1, got {args.workers}")
    if args.log_interval < 1:
        parser.error(f"--log-interval must be >= 1, got {args.log_interval}")
    if len(set(args.json_keys)) != len(args.json_keys):
        parser.error(f"--json-keys has duplicates: {args.json_keys}")


def build_tokenizer_from_args(args: argparse.Namespace):
    from megatron.training.tokenizer import build_tokenizer

    return build_tokenizer(
        args.tokenizer_type,
        vocab_file=args.vocab_file,
        merge_file=args.merge_file,
        tokenizer_model=args.tokenizer_model,
        vocab_size=args.vocab_size,
        tiktoken_pattern=args.tiktoken_pattern,
        tiktoken_num_special_tokens=args.tiktoken_num_special_tokens,
        tiktoken_special_tokens=args.tiktoken_special_tokens,
        vocab_extra_ids=args.vocab_extra_ids,
    )


class Encoder:
    """Tokenizes one numbered jsonl line; each worker process builds its own tokenizer once."""

    tokenizer = None

    def __init__(self, args: argparse.Namespace):
        self.args = args

    def initializer(self) -> None:
        Encoder.tokenizer = build_tokenizer_from_args(self.args)

    def encode(self, numbered_line: tuple[int, str]) -> tuple[dict[str, list[int]], int]:
        lineno, line = numbered_line
        doc = _parse_line(lineno, line, self.args)
        ids = {}
        for key in self.args.json_keys:
            ids[key] = list(Encoder.tokenizer.tokenize(doc[key]))
            # As upstream: an empty document gets no eod, so it stays empty.
            if self.args.append_eod and ids[key]:
                ids[key].append(Encoder.tokenizer.eod)
        return ids, len(line)


def _parse_line(lineno: int, line: str, args: argparse.Namespace) -> dict:
    where = f"--input {args.input!r} line {lineno}"
    try:
        doc = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"{where} is not valid JSON: {err}") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{where} is not a JSON object")
    for key in args.json_keys:
        if key not in doc:
            raise ValueError(
                f"{where} has no key {key!r} (--json-keys {' '.join(args.json_keys)}); "
                f"keys present: {sorted(doc)}"
            )
        if not isinstance(doc[key], str):
            raise ValueError(f"{where}: {key!r} is {type(doc[key]).__name__}, expected a string")
    return doc


def output_prefix(prefix: str, key: str) -> str:
    """Upstream's name for a document-level dataset of one json key."""
    return f"{prefix}_{key}_document"


def _numbered_lines(path: str):
    """(line number, text) of the non-blank lines; bad UTF-8 is an error naming the line."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(
                    f"--input {path!r} line {lineno} is not valid UTF-8 ({err.reason} at byte "
                    f"{err.start} of the line)"
                ) from None
            if line.strip():
                yield lineno, line


def _encoded_docs(args: argparse.Namespace, encoder: Encoder):
    """Encoded documents in input order; a Pool only when it can help."""
    if args.workers == 1:
        encoder.initializer()
        yield from map(encoder.encode, _numbered_lines(args.input))
        return
    with multiprocessing.Pool(args.workers, initializer=encoder.initializer) as pool:
        yield from pool.imap(encoder.encode, _numbered_lines(args.input), chunksize=32)


def _write(args: argparse.Namespace, tokenizer, partial: dict[str, str]) -> None:
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    builders = {k: IndexedDatasetBuilder(p + ".bin", dtype=dtype) for k, p in partial.items()}
    start, total_bytes, n = time.time(), 0, 0
    for n, (ids, nbytes) in enumerate(_encoded_docs(args, Encoder(args)), 1):
        total_bytes += nbytes
        for key, doc in ids.items():
            builders[key].add_document(doc, [len(doc)] if doc else [])
        if n % args.log_interval == 0:
            _log_progress(n, total_bytes, time.time() - start)
    if n == 0:
        raise ValueError(f"--input {args.input!r} has no documents (empty or blank lines only)")
    for key, builder in builders.items():
        builder.finalize(partial[key] + ".idx")


def _log_progress(docs: int, nbytes: int, seconds: float) -> None:
    seconds = max(seconds, 1e-9)
    print(
        f"processed {docs} documents ({docs / seconds:.1f} docs/s, "
        f"{nbytes / seconds / 1024**2:.2f} MB/s)",
        file=sys.stderr,
    )


def _remove(paths) -> None:
    for path in paths:
        if os.path.exists(path):
            os.remove(path)


def preprocess(args: argparse.Namespace) -> list[str]:
    """Write one dataset per json key; returns their prefixes. ValueError on bad input, after
    removing every file this call wrote."""
    _check_output_prefix(args.output_prefix)
    tokenizer = build_tokenizer_from_args(args)
    if args.append_eod:
        tokenizer.eod  # noqa: B018 -- fail before writing if the tokenizer has no eod
    finals = {k: output_prefix(args.output_prefix, k) for k in args.json_keys}
    partial = {k: p + ".partial" for k, p in finals.items()}
    os.makedirs(os.path.dirname(os.path.abspath(args.output_prefix)), exist_ok=True)
    try:
        _write(args, tokenizer, partial)
    except BaseException:
        _remove(p + ext for p in partial.values() for ext in (".bin", ".idx"))
        raise
    for key in finals:
        for ext in (".bin", ".idx"):
            os.replace(partial[key] + ext, finals[key] + ext)
    return list(finals.values())


def _check_output_prefix(prefix: str) -> None:
    """Before any tokenizing: the output folder exists or can be created, and is writable."""
    from megatron.training.data_check import check_writable

    check_writable(os.path.dirname(os.path.abspath(prefix)), "--output-prefix")


def main(argv=None) -> int:
    args = get_args(argv)
    try:
        prefixes = preprocess(args)
    except (ValueError, NotImplementedError) as err:
        print(f"preprocess_data.py: error: {err}", file=sys.stderr)
        return 1
    for prefix in prefixes:
        print(f"wrote {prefix}.bin and {prefix}.idx")
    return 0


if __name__ == "__main__":
    sys.exit(main())
