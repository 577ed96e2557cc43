"""Tokenizers for our training stack, named after Megatron-LM's ``--tokenizer-type`` choices.

``build_tokenizer(tokenizer_type, ...)`` returns a subclass of megatron-core's
``MegatronLegacyTokenizer`` (``megatron.core.datasets.megatron_tokenizer``, the base that
Megatron-LM's own tokenizers use): it carries the ``unique_identifiers`` that GPTDataset hashes
into its cache names, and ``eod``/``vocab_size`` that the datasets read.

Types:
- ``ByteLevelTokenizer`` (ours, no files): ids 0..255 are the UTF-8 bytes, 256 is end-of-document.
- ``GPT2BPETokenizer``: GPT-2 byte-level BPE from ``vocab_file`` (vocab.json) and ``merge_file``
  (merges.txt), implemented here in pure Python.
- ``HuggingFaceTokenizer``: a ``tokenizer.json`` (or a folder holding one) via the ``tokenizers``
  package, imported lazily.
- ``NullTokenizer``: ids written as space-separated integers; ``vocab_size`` ids plus one eod
  (Megatron-LM's tokenizer for mock data).
- ``GPTSentencePieceTokenizer``, ``Llama2Tokenizer``, ``SentencePieceTokenizer``
  (``sentencepiece_tokenizer.py``) and
  ``TikTokenizer`` (``tiktokenizer.py``): Megatron-LM's, on the sentencepiece/tiktoken packages.
"""

import functools
import json
import logging
import math
import os
import re
import unicodedata

from megatron.core.datasets.megatron_tokenizer import MegatronLegacyTokenizer

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

# megatron-core's tokenizer libraries (``megatron.core.tokenizers``) and the --tokenizer-type
# values each one builds there; upstream main's --tokenizer-library names the library. The first
# type is the one a library alone stands for (megatron: the GPT tokenizer).
LIBRARY_TYPES = {
    "megatron": ("GPT2BPETokenizer", "BertWordPieceLowerCase", "BertWordPieceCase"),
    "huggingface": ("HuggingFaceTokenizer",),
    "null": ("NullTokenizer",),
    "sentencepiece": ("GPTSentencePieceTokenizer", "SentencePieceTokenizer", "Llama2Tokenizer"),
    "tiktoken": ("TikTokenizer",),
    "byte-level": (),  # megatron-core's own byte tokenizer (eos 0, pad 1): not ours, see below
}

GPT2_EOD_TOKEN = "<|endoftext|>"

# End-of-document names tried, in order, when a tokenizer.json has no tokenizer_config.json beside.
HF_EOD_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "[SEP]")


class _DropLegacyWarning(logging.Filter):
    """The legacy base logs a deprecation warning per instance; every preprocessing worker and
    dataset build would repeat it. We use that base on purpose (GPTDataset needs its
    ``unique_identifiers``), so only that one message is dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "legacy tokenizer system" not in record.getMessage()


logging.getLogger("megatron.core.datasets.megatron_tokenizer").addFilter(_DropLegacyWarning())


def padded_vocab_size(orig_vocab_size: int, divisible_by: int = 128, tp: int = 1) -> int:
    """Round the vocab up to a multiple of ``divisible_by * tp`` as Megatron-LM does, so that every
    tensor-parallel rank holds an equal, aligned slice of the embedding."""
    if divisible_by < 1 or tp < 1:
        raise ValueError(
            f"make_vocab_size_divisible_by ({divisible_by}) and tensor parallel size ({tp}) "
            "must both be >= 1"
        )
    multiple = divisible_by * tp
    return int(math.ceil(orig_vocab_size / multiple) * multiple)


def build_tokenizer(
    tokenizer_type: str,
    vocab_file: str | None = None,
    merge_file: str | None = None,
    tokenizer_model: str | None = None,
    vocab_size: int | None = None,
    tiktoken_pattern: str | None = None,
    tiktoken_num_special_tokens: int = 1000,
    tiktoken_special_tokens: list | None = None,
    vocab_extra_ids: int = 0,
    **kwargs,
) -> MegatronLegacyTokenizer:
    """Build the tokenizer named by ``tokenizer_type``; a missing file or flag is a ValueError
    naming the flag. ``kwargs`` go to HuggingFaceTokenizer (e.g. ``eod_token``). The defaults
    of the ``tiktoken_*`` options are Megatron-LM's."""
    if tokenizer_type == "ByteLevelTokenizer":
        return ByteLevelTokenizer()
    if tokenizer_type == "GPT2BPETokenizer":
        _require_file("--vocab-file", vocab_file, tokenizer_type)
        _require_file("--merge-file", merge_file, tokenizer_type)
        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type == "HuggingFaceTokenizer":
        _require_file("--tokenizer-model", tokenizer_model, tokenizer_type, allow_dir=True)
        return HuggingFaceTokenizer(tokenizer_model, **kwargs)
    if tokenizer_type == "NullTokenizer":
        if vocab_size is None or int(vocab_size) < 1:
            raise ValueError(f"NullTokenizer needs --vocab-size >= 1, got {vocab_size}")
        return NullTokenizer(int(vocab_size))
    if tokenizer_type in ("GPTSentencePieceTokenizer", "Llama2Tokenizer"):
        from . import sentencepiece_tokenizer

        _require_file("--tokenizer-model", tokenizer_model, tokenizer_type)
        return getattr(sentencepiece_tokenizer, tokenizer_type)(tokenizer_model)
    if tokenizer_type == "SentencePieceTokenizer":
        from .sentencepiece_tokenizer import SentencePieceTokenizer

        _require_file("--tokenizer-model", tokenizer_model, tokenizer_type)
        return SentencePieceTokenizer(tokenizer_model, vocab_extra_ids)
    if tokenizer_type == "TikTokenizer":
        from .tiktokenizer import TikTokenizer

        _require_file("--tokenizer-model", tokenizer_model, tokenizer_type)
        return TikTokenizer(
            tokenizer_model,
            tiktoken_pattern,
            vocab_size,
            tiktoken_num_special_tokens,
            tiktoken_special_tokens,
        )
    raise ValueError(
        f"unknown --tokenizer-type {tokenizer_type!r}; allowed: {', '.join(TOKENIZER_TYPES)}"
    )


def _require_file(flag: str, path: str | None, tokenizer_type: str, allow_dir: bool = False):
    if path is None:
        raise ValueError(f"{tokenizer_type} needs {flag}")
    ok = os.path.isfile(path) or (allow_dir and os.path.isdir(path))
    if not ok:
        raise ValueError(f"{flag} {path!r} does not exist (needed by {tokenizer_type})")


class ByteLevelTokenizer(MegatronLegacyTokenizer):
    """UTF-8 bytes as ids 0..255 plus eod = 256: needs no files, so any machine can train."""

    def __init__(self):
        super().__init__(None)

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids) -> str:
        # eod and padding ids above 255 carry no text.
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    @property
    def vocab_size(self) -> int:
        return 257

    @property
    def vocab(self) -> dict:
        return {**{bytes([i]).decode("latin-1"): i for i in range(256)}, "<eod>": 256}

    @property
    def inv_vocab(self) -> dict:
        return {i: t for t, i in self.vocab.items()}

    @property
    def eod(self) -> int:
        return 256


class NullTokenizer(MegatronLegacyTokenizer):
    """Megatron-LM's NullTokenizer: text is space-separated ids; eod is ``vocab_size``."""

    def __init__(self, vocab_size: int):
        super().__init__(None, vocab_size=vocab_size)
        self._vocab_size_without_eod = int(vocab_size)

    def tokenize(self, text: str) -> list[int]:
        return [int(x) for x in text.split()]

    def detokenize(self, ids) -> str:
        return " ".join(str(int(x)) for x in ids)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size_without_eod + 1

    @property
    def vocab(self):
        raise NotImplementedError("NullTokenizer has no vocab")

    @property
    def inv_vocab(self):
        raise NotImplementedError("NullTokenizer has no vocab")

    @property
    def eod(self) -> int:
        return self._vocab_size_without_eod

    @property
    def eos(self) -> int:
        return self._vocab_size_without_eod


@functools.lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-character map (OpenAI's encoder.py): printable Latin-1
    bytes map to themselves, the other 68 to code points 256.., so BPE never sees whitespace or
    control bytes."""
    bs = list(range(ord("!"), ord("~") + 1))
    bs += list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _unicode_class(prefixes: str) -> str:
    """A stdlib-``re`` character class of every code point whose Unicode category starts with one
    of ``prefixes``: stands in for the ``regex`` module's ``\\p{L}``/``\\p{N}``."""
    ranges, start, prev = [], None, None
    for cp in range(0x110000):
        if unicodedata.category(chr(cp))[0] in prefixes:
            if start is None:
                start = cp
            prev = cp
        elif start is not None:
            ranges.append((start, prev))
            start = None
    if start is not None:
        ranges.append((start, prev))
    return "".join(f"\\U{a:08x}-\\U{b:08x}" for a, b in ranges)


@functools.lru_cache(maxsize=1)
def gpt2_pretokenize_pattern() -> re.Pattern:
    """GPT-2's split pattern ``'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+|
    ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+`` on stdlib ``re`` (built once, ~0.3 s)."""
    letters, numbers = _unicode_class("L"), _unicode_class("N")
    return re.compile(
        rf"'s|'t|'re|'ve|'m|'ll|'d| ?[{letters}]+| ?[{numbers}]+"
        rf"| ?[^\s{letters}{numbers}]+|\s+(?!\S)|\s+"
    )


def bpe_merge(word: tuple[str, ...], ranks: dict[tuple[str, str], int]) -> tuple[str, ...]:
    """Merge the lowest-ranked adjacent pair, all its occurrences left to right, until no pair of
    ``word`` is in ``ranks`` (GPT-2's ``bpe``)."""
    while len(word) > 1:
        pairs = {(a, b) for a, b in zip(word, word[1:])}
        best = min(pairs, key=lambda p: ranks.get(p, math.inf))
        if best not in ranks:
            break
        merged, i = [], 0
        while i < len(word):
            if i < len(word) - 1 and (word[i], word[i + 1]) == best:
                merged.append(word[i] + word[i + 1])
                i += 2
            else:
                merged.append(word[i])
                i += 1
        word = tuple(merged)
    return word


class GPT2BPETokenizer(MegatronLegacyTokenizer):
    """GPT-2 byte-level BPE: pre-split with GPT-2's pattern, map bytes to printable characters,
    apply ``merges.txt`` by rank, look pieces up in ``vocab.json``. eod is ``<|endoftext|>``."""

    def __init__(self, vocab_file: str, merge_file: str):
        super().__init__(vocab_file, merge_file)
        with open(vocab_file, encoding="utf-8") as f:
            self.encoder: dict[str, int] = json.load(f)
        self.decoder = {i: t for t, i in self.encoder.items()}
        self.bpe_ranks = _read_merges(merge_file)
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {c: b for b, c in self.byte_encoder.items()}
        self._cache: dict[str, list[int]] = {}

    def _encode_word(self, word: str) -> list[int]:
        if word not in self._cache:
            chars = "".join(self.byte_encoder[b] for b in word.encode("utf-8"))
            pieces = bpe_merge(tuple(chars), self.bpe_ranks)
            self._cache[word] = [self.encoder[p] for p in pieces]
        return self._cache[word]

    def tokenize(self, text: str) -> list[int]:
        ids = []
        for word in gpt2_pretokenize_pattern().findall(text):
            ids.extend(self._encode_word(word))
        return ids

    def detokenize(self, ids) -> str:
        text = "".join(self.decoder[int(i)] for i in ids)
        return bytearray(self.byte_decoder[c] for c in text).decode("utf-8", errors="replace")

    @property
    def vocab_size(self) -> int:
        return len(self.encoder)

    @property
    def vocab(self) -> dict:
        return self.encoder

    @property
    def inv_vocab(self) -> dict:
        return self.decoder

    @property
    def eod(self) -> int:
        if GPT2_EOD_TOKEN not in self.encoder:
            raise NotImplementedError(f"vocab has no {GPT2_EOD_TOKEN!r} token to use as eod")
        return self.encoder[GPT2_EOD_TOKEN]


def _read_merges(merge_file: str) -> dict[tuple[str, str], int]:
    """merges.txt: an optional ``#version`` header, then one ``a b`` pair per line by rank."""
    with open(merge_file, encoding="utf-8") as f:
        lines = [ln.rstrip("\n") for ln in f]
    pairs = [tuple(ln.split()) for ln in lines if ln.strip() and not ln.startswith("#version")]
    for p in pairs:
        if len(p) != 2:
            raise ValueError(f"--merge-file {merge_file!r}: bad merge line {' '.join(p)!r}")
    return {p: r for r, p in enumerate(pairs)}


def _import_tokenizers():
    try:
        import tokenizers
    except ImportError as err:
        raise ImportError(
            "HuggingFaceTokenizer needs the `tokenizers` package: "
            "pip install -r requirements/base.txt"
        ) from err
    return tokenizers


class HuggingFaceTokenizer(MegatronLegacyTokenizer):
    """A ``tokenizer.json`` through the ``tokenizers`` package. eod is ``eod_token`` if given,
    else ``eos_token`` of a ``tokenizer_config.json`` beside it, else the first of
    ``HF_EOD_CANDIDATES`` in the vocab. Special tokens are added as transformers does by default."""

    def __init__(self, tokenizer_model: str, eod_token: str | None = None):
        super().__init__(tokenizer_model, eod_token=eod_token)
        path = tokenizer_model
        if os.path.isdir(path):
            path = os.path.join(path, "tokenizer.json")
        self._tokenizer = _import_tokenizers().Tokenizer.from_file(path)
        self._eod_id = self._find_eod(os.path.dirname(path), eod_token)

    def _find_eod(self, folder: str, eod_token: str | None) -> int | None:
        if eod_token is None:
            eod_token = _config_eos_token(os.path.join(folder, "tokenizer_config.json"))
        names = [eod_token] if eod_token is not None else HF_EOD_CANDIDATES
        for name in names:
            token_id = self._tokenizer.token_to_id(name)
            if token_id is not None:
                return token_id
        if eod_token is not None:
            raise ValueError(f"eod token {eod_token!r} is not in the tokenizer's vocab")
        return None

    def tokenize(self, text: str) -> list[int]:
        return self._tokenizer.encode(text).ids

    def detokenize(self, ids) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def vocab(self) -> dict:
        return self._tokenizer.get_vocab(with_added_tokens=True)

    @property
    def inv_vocab(self) -> dict:
        return {i: t for t, i in self.vocab.items()}

    @property
    def eod(self) -> int:
        if self._eod_id is None:
            raise NotImplementedError(
                f"no end-of-document token found (tried {', '.join(HF_EOD_CANDIDATES)}); "
                "pass eod_token="
            )
        return self._eod_id


def _config_eos_token(config_path: str) -> str | None:
    if not os.path.isfile(config_path):
        return None
    with open(config_path, encoding="utf-8") as f:
        eos = json.load(f).get("eos_token")
    # transformers writes either a plain string or an AddedToken dict.
    return eos.get("content") if isinstance(eos, dict) else eos
