"""``TikTokenizer`` with Megatron-LM's semantics (its legacy ``CustomTikTokenizer``), on the
``tiktoken`` package (imported lazily).

``--tokenizer-model`` is a JSON list of ``{"rank": i, "token_bytes": base64, "token_str": str}``
in rank order, the first 256 being the single bytes 0..255 (Megatron-LM's format). Ids:

    0 .. S-1            special tokens: --tiktoken-special-tokens (default <unk> <s> </s>; they
                        must be among them), then fillers <SPECIAL_k> up to
                        S = --tiktoken-num-special-tokens (default 1000)
    S .. V-1            the first V - S ranks of the file, rank r -> id S + r
                        (V = --vocab-size, default 2**17; the file is cut, never padded)

Text is split with ``--tiktoken-pattern`` v1 or v2 (Megatron-LM's two regexes), then byte-pair
merged by rank; special tokens are never parsed out of text (``encode_ordinary``). eod = ``</s>``.
"""

import base64
import binascii
import json
import os

from megatron.core.datasets.megatron_tokenizer import MegatronLegacyTokenizer

# Megatron-LM's two split patterns (tiktoken's regex dialect: possessive quantifiers, \p{..}).
TIKTOKEN_PATTERNS = {
    "v1": r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    "v2": r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}
DEFAULT_VOCAB_SIZE = 2**17  # Megatron-LM's fallback without --vocab-size
REQUIRED_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")


def _import_tiktoken():
    try:
        import tiktoken
    except ImportError as err:
        raise ImportError(
            "TikTokenizer needs the `tiktoken` package: pip install -r requirements/base.txt"
        ) from err
    return tiktoken


def special_token_list(special_tokens, num_special_tokens: int, vocab_size: int) -> list:
    """The ``num_special_tokens`` names of ids 0.., checked as Megatron-LM asserts them."""
    tokens = list(REQUIRED_SPECIAL_TOKENS if special_tokens is None else special_tokens)
    if len(set(tokens)) != len(tokens):
        raise ValueError(f"--tiktoken-special-tokens must be unique, got {tokens}")
    missing = [t for t in REQUIRED_SPECIAL_TOKENS if t not in tokens]
    if missing:
        raise ValueError(
            f"--tiktoken-special-tokens must include {' '.join(REQUIRED_SPECIAL_TOKENS)} "
            f"(missing {' '.join(missing)})"
        )
    if not len(tokens) <= num_special_tokens < vocab_size:
        raise ValueError(
            f"need len(--tiktoken-special-tokens) ({len(tokens)}) <= "
            f"--tiktoken-num-special-tokens ({num_special_tokens}) < --vocab-size ({vocab_size})"
        )
    return tokens + [f"<SPECIAL_{i}>" for i in range(len(tokens), num_special_tokens)]


def load_ranks(path: str, max_vocab: int) -> dict:
    """{token bytes: rank} of the first ``max_vocab`` entries of Megatron-LM's JSON ranks file;
    every malformed entry is a ValueError naming the file and the entry."""
    where = f"--tokenizer-model {path!r}"
    try:
        with open(path, encoding="utf-8") as f:
            entries = json.load(f)
    except (OSError, ValueError) as err:
        raise ValueError(f"{where}: not a JSON ranks file ({err})") from None
    if not isinstance(entries, list):
        raise ValueError(f"{where}: expected a JSON list of rank entries")
    return {_entry_bytes(where, i, e): i for i, e in enumerate(entries[:max_vocab])}


def _entry_bytes(where: str, index: int, entry) -> bytes:
    if not isinstance(entry, dict) or set(entry) != {"rank", "token_bytes", "token_str"}:
        raise ValueError(f"{where}: entry {index} must have exactly rank, token_bytes, token_str")
    if entry["rank"] != index:
        raise ValueError(f"{where}: entry {index} has rank {entry['rank']} (ranks run 0, 1, ...)")
    try:
        token = base64.b64decode(entry["token_bytes"], validate=True)
    except (binascii.Error, TypeError):
        raise ValueError(f"{where}: entry {index}: token_bytes is not base64") from None
    if index < 256 and token != bytes([index]):
        raise ValueError(f"{where}: entry {index} must be the single byte {index} (ranks 0-255)")
    return token


class TikTokenizer(MegatronLegacyTokenizer):
    """Megatron-LM's TikTokenizer (see the module docstring for the id layout)."""

    def __init__(
        self,
        path: str,
        pattern: str,
        vocab_size: int | None = None,
        num_special_tokens: int = 1000,
        special_tokens: list | None = None,
    ):
        if pattern not in TIKTOKEN_PATTERNS:
            raise ValueError(f"TikTokenizer needs --tiktoken-pattern v1 or v2, got {pattern!r}")
        vocab_size = DEFAULT_VOCAB_SIZE if vocab_size is None else int(vocab_size)
        super().__init__(
            path,
            pattern=pattern,
            vocab_size=vocab_size,
            num_special_tokens=num_special_tokens,
            special_tokens=special_tokens,
        )
        specials = special_token_list(special_tokens, num_special_tokens, vocab_size)
        ranks = load_ranks(path, vocab_size - num_special_tokens)
        if len(ranks) < vocab_size - num_special_tokens:
            raise ValueError(
                f"--tokenizer-model {path!r} has {len(ranks)} ranks, but --vocab-size "
                f"({vocab_size}) - --tiktoken-num-special-tokens ({num_special_tokens}) = "
                f"{vocab_size - num_special_tokens} are needed (a smaller --vocab-size cuts it)"
            )
        mergeable = {token: rank + num_special_tokens for token, rank in ranks.items()}
        self._special = {token: i for i, token in enumerate(specials)}
        self._model = _import_tiktoken().Encoding(
            name=os.path.basename(path),
            pat_str=TIKTOKEN_PATTERNS[pattern],
            mergeable_ranks=mergeable,
            special_tokens=self._special,
        )
        self._vocab_size = vocab_size
        self._token_to_id = {**mergeable, **self._special}
        self._id_to_token = {i: t for t, i in self._token_to_id.items()}

    def tokenize(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        ids = self._model.encode_ordinary(text)
        return [self.bos] * bos + ids + [self.eos] * eos

    def detokenize(self, ids) -> str:
        return self._model.decode([int(i) for i in ids])

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def vocab(self) -> dict:
        return self._token_to_id

    @property
    def inv_vocab(self) -> dict:
        return self._id_to_token

    @property
    def unk(self) -> int:
        return self._special["<unk>"]

    @property
    def bos(self) -> int:
        return self._special["<s>"]

    @property
    def eos(self) -> int:
        return self._special["</s>"]

    @property
    def eod(self) -> int:
        return self.eos
