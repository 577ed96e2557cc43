"""Tokenizer model files made in the test, never downloaded: a sentencepiece BPE model trained
here on a few sentences (~0.05 s), and a tiktoken ranks file in Megatron-LM's JSON format with a
handful of hand-picked merges whose encodings are worked out by hand in test_tokenizer_libraries.
"""

import base64
import io
import json

SP_SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, hello moon",
    "naïve café: ünïcödé ✓ 42",
    "pack my box with five dozen liquor jugs",
    "sphinx of black quartz, judge my vow",
]

# Merges after the 256 single bytes, in rank order (rank 256 + position).
TIKTOKEN_MERGES = [b"he", b"ll", b"hell", b"hello", b" w", b"or", b" wor", b"ld", b" world", b"oW"]


def write_sentencepiece_model(path, vocab_size: int = 120) -> str:
    """A BPE model with sentencepiece's default ids: <unk> 0, <s> 1, </s> 2, no pad."""
    import sentencepiece

    out = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(SP_SENTENCES * 20),
        model_writer=out,
        vocab_size=vocab_size,
        model_type="bpe",
        character_coverage=1.0,
        num_threads=1,
        minloglevel=2,
    )
    with open(path, "wb") as f:
        f.write(out.getvalue())
    return str(path)


def tiktoken_ranks() -> list:
    """Megatron-LM's ranks file content: 256 single bytes, then TIKTOKEN_MERGES."""
    tokens = [bytes([i]) for i in range(256)] + TIKTOKEN_MERGES
    return [
        {
            "rank": rank,
            "token_bytes": base64.b64encode(token).decode("ascii"),
            "token_str": token.decode("utf-8", errors="replace"),
        }
        for rank, token in enumerate(tokens)
    ]


def write_tiktoken_ranks(path, entries=None) -> str:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(tiktoken_ranks() if entries is None else entries, f)
    return str(path)
