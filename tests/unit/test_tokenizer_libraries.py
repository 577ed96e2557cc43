"""GPTSentencePieceTokenizer, Llama2Tokenizer and TikTokenizer on model files made here
(tests/tokenizer_files.py): ids against the libraries and hand-worked BPE, round trips,
Megatron-LM's id layout and checks, bad input.

    .venv/bin/python -m pytest -q tests/unit/test_tokenizer_libraries.py
"""

import json

import pytest

from megatron.training import tokenizer as tk
from megatron.training.tiktokenizer import TIKTOKEN_PATTERNS
from tests.tokenizer_files import (
    SP_SENTENCES,
    tiktoken_ranks,
    write_sentencepiece_model,
    write_tiktoken_ranks,
)

TEXTS = ["hello world", "the lazy dog jumps", "naïve café ✓ 42", "", "  two  spaces\n"]


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    return write_sentencepiece_model(tmp_path_factory.mktemp("sp") / "tiny.model")


@pytest.fixture(scope="module")
def ranks_file(tmp_path_factory):
    return write_tiktoken_ranks(tmp_path_factory.mktemp("tt") / "ranks.json")


def _processor(path):
    import sentencepiece

    return sentencepiece.SentencePieceProcessor(model_file=path)


@pytest.mark.parametrize("text", TEXTS + SP_SENTENCES)
def test_gpt_sentencepiece_ids_are_the_library_ids(sp_model, text):
    tok = tk.build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=sp_model)
    sp = _processor(sp_model)
    assert tok.tokenize(text) == sp.encode(text)
    assert tok.detokenize(tok.tokenize(text)) == " ".join(text.split())  # sentencepiece's
    # normalizer folds whitespace runs: that is the library's round trip, Megatron-LM's too
    assert (tok.vocab_size, tok.eod, tok.eos, tok.bos) == (sp.get_piece_size(), 2, 2, 1)


@pytest.mark.parametrize("text", TEXTS)
def test_llama2_puts_bos_first_as_megatron_lm(sp_model, text):
    tok = tk.build_tokenizer("Llama2Tokenizer", tokenizer_model=sp_model)
    sp = _processor(sp_model)
    assert tok.tokenize(text) == [sp.bos_id()] + sp.encode(text)
    assert tok.tokenize(text, bos=False, eos=True) == sp.encode(text) + [sp.eos_id()]
    assert tok.detokenize(tok.tokenize(text)) == " ".join(text.split())  # <s> decodes to nothing
    assert tok.eod == sp.eos_id() == 2 and tok.vocab_size == sp.get_piece_size()


def test_sentencepiece_vocab_and_identifiers(sp_model):
    tok = tk.build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=sp_model)
    assert tok.vocab["</s>"] == 2 and tok.inv_vocab[2] == "</s>" and len(tok.inv_vocab) == 120
    # GPTDataset hashes these into cache names: another type or model is another cache
    llama = tk.build_tokenizer("Llama2Tokenizer", tokenizer_model=sp_model)
    assert tok.unique_identifiers["tokenizer_path"] == [sp_model]
    assert (tok.unique_identifiers["class"], llama.unique_identifiers["class"]) == (
        "GPTSentencePieceTokenizer",
        "Llama2Tokenizer",
    )


def test_sentencepiece_model_without_eos_or_bos_is_a_clear_error(tmp_path):
    import io

    import sentencepiece

    out = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(SP_SENTENCES * 20), model_writer=out, vocab_size=100,
        model_type="bpe", character_coverage=1.0, num_threads=1, minloglevel=2,
        eos_id=-1, bos_id=-1,
    )  # fmt: skip
    path = tmp_path / "noeos.model"
    path.write_bytes(out.getvalue())
    gpt = tk.build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=str(path))
    with pytest.raises(NotImplementedError, match="no </s> \\(eos_id is -1\\)"):
        gpt.eod  # noqa: B018
    llama = tk.build_tokenizer("Llama2Tokenizer", tokenizer_model=str(path))
    with pytest.raises(NotImplementedError, match="no <s> \\(bos_id is -1\\)"):
        llama.tokenize("hello")


# Hand-worked BPE on tokenizer_files.TIKTOKEN_MERGES (ranks 256..265: he ll hell hello ' w' or
# ' wor' ld ' world' oW); ids are rank + S, S = number of special tokens.
# 'hello' merges he, ll, hell, hello -> [259]; ' world': ' w', or, ' wor', ld, ' world' -> [264].
# 'HelloWorld': v1 keeps one letter run: H e ll oW or ld; v2 splits at the capital: Hello|World.
TIKTOKEN_CASES = [
    ("v1", "hello world", [259, 264]),
    ("v2", "hello world", [259, 264]),
    ("v1", "HelloWorld", [72, 101, 257, 265, 261, 263]),
    ("v2", "HelloWorld", [72, 101, 257, 111, 87, 261, 263]),
    ("v2", "he\n", [256, 10]),
]
S = 5  # <unk> <s> </s> <SPECIAL_3> <SPECIAL_4>


def _tiktoken(path, pattern="v2", vocab_size=S + 266, num_special=S, special=None):
    return tk.build_tokenizer(
        "TikTokenizer",
        tokenizer_model=path,
        vocab_size=vocab_size,
        tiktoken_pattern=pattern,
        tiktoken_num_special_tokens=num_special,
        tiktoken_special_tokens=special,
    )


@pytest.mark.parametrize("pattern, text, ranks", TIKTOKEN_CASES)
def test_tiktoken_matches_hand_worked_bpe(ranks_file, pattern, text, ranks):
    tok = _tiktoken(ranks_file, pattern)
    assert tok.tokenize(text) == [r + S for r in ranks]
    assert tok.detokenize(tok.tokenize(text)) == text


def test_tiktoken_id_layout_as_megatron_lm(ranks_file):
    tok = _tiktoken(ranks_file)
    assert [tok.inv_vocab[i] for i in range(S)] == [
        "<unk>", "<s>", "</s>", "<SPECIAL_3>", "<SPECIAL_4>",
    ]  # fmt: skip
    assert (tok.unk, tok.bos, tok.eos, tok.eod, tok.vocab_size) == (0, 1, 2, 2, S + 266)
    assert tok.inv_vocab[S + 0x41] == b"A" and tok.vocab[b"oW"] == S + 265
    assert tok.tokenize("hi", bos=True, eos=True) == [1, ord("h") + S, ord("i") + S, 2]
    assert tok.tokenize("</s>") == [ord(c) + S for c in "</s>"]  # never parsed as special


def test_tiktoken_vocab_size_cuts_the_ranks(ranks_file):
    # 260 ranks kept: ' w' (rank 260) and later merges are gone, so ' world' falls to bytes
    tok = _tiktoken(ranks_file, vocab_size=S + 260)
    assert tok.tokenize("hello world") == [259 + S] + [b + S for b in b" world"]
    assert tok.vocab_size == S + 260


def test_tiktoken_custom_special_tokens(ranks_file):
    special = ["<pad>", "</s>", "<s>", "<unk>"]
    tok = _tiktoken(ranks_file, vocab_size=4 + 266, num_special=4, special=special)
    assert (tok.eod, tok.bos, tok.unk) == (1, 2, 3)
    assert tok.tokenize("hello") == [259 + 4]


def test_tiktoken_ids_equal_megatron_core_tiktoken_tokenizer(ranks_file):
    """megatron-core 0.16.1 ships its own TikTokenTokenizer (the new tokenizer system, whose
    default special tokens are seven): given those seven, its ids must equal ours."""
    from megatron.core.tokenizers.text.libraries.tiktoken_tokenizer import (
        SPECIAL_TOKENS,
        TikTokenTokenizer,
    )

    for pattern in ("v1", "v2"):
        core = TikTokenTokenizer(
            ranks_file, special_tokens=list(SPECIAL_TOKENS), num_special_tokens=9,
            pattern=pattern, vocab_size=9 + 266,
        )  # fmt: skip
        ours = _tiktoken(ranks_file, pattern, 9 + 266, 9, list(SPECIAL_TOKENS))
        for text in TEXTS + SP_SENTENCES + ["HelloWorld", "hello world"]:
            assert ours.tokenize(text) == core.text_to_ids(text), (pattern, text)


def test_tiktoken_patterns_are_megatron_cores():
    from megatron.core.tokenizers.text.libraries import tiktoken_tokenizer as core

    assert TIKTOKEN_PATTERNS == {
        "v1": core._PATTERN_TIKTOKEN_V1,
        "v2": core._PATTERN_TIKTOKEN_V2,
    }


def _entries(change):
    entries = tiktoken_ranks()
    change(entries)
    return entries


BAD_TIKTOKEN = [  # (build kwargs or file change, message)
    (dict(pattern=None), "needs --tiktoken-pattern v1 or v2, got None"),
    (dict(pattern="v3"), "needs --tiktoken-pattern v1 or v2, got 'v3'"),
    (dict(special=["<s>", "</s>"], num_special=S), "must include <unk> <s> </s> (missing <unk>)"),
    (dict(special=["<unk>", "<s>", "</s>", "<s>"]), "must be unique"),
    (dict(num_special=2), "len(--tiktoken-special-tokens) (3) <= --tiktoken-num-special-tokens"),
    (dict(vocab_size=S + 300), "has 266 ranks, but --vocab-size (305) - "
     "--tiktoken-num-special-tokens (5) = 300 are needed"),
    (lambda e: e[257].update(rank=7), "entry 257 has rank 7"),
    (lambda e: e[3].update(token_bytes="QQ=="), "entry 3 must be the single byte 3"),
    (lambda e: e[260].update(token_bytes="***"), "entry 260: token_bytes is not base64"),
    (lambda e: e[5].pop("token_str"), "entry 5 must have exactly rank, token_bytes, token_str"),
    (lambda e: e.clear() or e.append(None), "entry 0 must have exactly"),
]  # fmt: skip


@pytest.mark.parametrize("bad, message", BAD_TIKTOKEN)
def test_tiktoken_bad_input_names_the_flag(tmp_path, ranks_file, bad, message):
    path = ranks_file
    if callable(bad):
        path, bad = write_tiktoken_ranks(tmp_path / "bad.json", _entries(bad)), {}
    with pytest.raises(ValueError) as err:
        _tiktoken(path, **bad)
    assert message in str(err.value)


def test_tiktoken_ranks_file_not_json(tmp_path):
    path = tmp_path / "ranks.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="--tokenizer-model .* not a JSON ranks file"):
        _tiktoken(str(path))
    path.write_text(json.dumps({"rank": 0}))
    with pytest.raises(ValueError, match="expected a JSON list"):
        _tiktoken(str(path))


@pytest.mark.parametrize(
    "tokenizer_type", ["GPTSentencePieceTokenizer", "Llama2Tokenizer", "TikTokenizer"]
)
def test_missing_or_bad_model_file(tmp_path, tokenizer_type):
    with pytest.raises(ValueError, match=f"{tokenizer_type} needs --tokenizer-model"):
        tk.build_tokenizer(tokenizer_type)
    with pytest.raises(ValueError, match="--tokenizer-model '/no/m' does not exist"):
        tk.build_tokenizer(tokenizer_type, tokenizer_model="/no/m")
    if tokenizer_type != "TikTokenizer":
        junk = tmp_path / "junk.model"
        junk.write_bytes(b"not a model")
        with pytest.raises(ValueError, match="is not a sentencepiece model"):
            tk.build_tokenizer(tokenizer_type, tokenizer_model=str(junk))


def test_sentencepiece_tokenizer_adds_megatron_lms_special_tokens(sp_model):
    tok = tk.build_tokenizer("SentencePieceTokenizer", tokenizer_model=sp_model, vocab_extra_ids=2)
    sp = _processor(sp_model)
    n = sp.get_piece_size()  # 120; the model has <unk> <s> </s>, no pad
    added = ["<CLS>", "<SEP>", "<EOD>", "<MASK>", "<PAD>", "<extra_id_0>", "<extra_id_1>"]
    assert [tok.inv_vocab[n + k] for k in range(len(added))] == added
    assert (tok.cls, tok.sep, tok.eod, tok.mask, tok.pad) == (n, n + 1, n + 2, n + 3, n + 4)
    assert (tok.bos, tok.eos, tok.vocab_size) == (1, 2, n + 7)  # the model's <s>, </s>
    assert tok.additional_special_tokens_ids == [n + 5, n + 6]
    # special tokens' text is cut out (the earliest first); the rest is sentencepiece's
    text = "hello world<EOD>the dog<extra_id_1>"
    assert tok.tokenize(text) == (
        sp.encode("hello world") + [n + 2] + sp.encode("the dog") + [n + 6]
    )
    assert tok.tokenize("</s>x") == [2] + sp.encode("x")  # the model's own eos piece counts
    assert tok.tokenize("hello moon") == sp.encode("hello moon")
    # upstream's detokenize puts a space on each side of a special token
    assert tok.detokenize(tok.tokenize("hello<SEP>moon")) == "hello <SEP> moon"
