"""Tokenizers: byte-level round trip, GPT-2 BPE against a hand-computed encoding, a tiny
tokenizer.json through the `tokenizers` package, NullTokenizer, vocab padding, bad input."""

import json
import os

import pytest

from megatron.training import tokenizer as tk

# A hand-written GPT-2 style vocab and merges. Byte-level: ' ' is 'Ġ' and '\n' is 'Ċ'.
GPT2_VOCAB = {
    "<|endoftext|>": 0, "h": 1, "e": 2, "l": 3, "o": 4, "Ġ": 5, "w": 6, "r": 7, "d": 8,
    "he": 9, "ll": 10, "hell": 11, "hello": 12, "Ġh": 13, "or": 14, "wor": 15, "Ċ": 16,
}  # fmt: skip
GPT2_MERGES = ["h e", "l l", "he ll", "hell o", "Ġ h", "o r", "w or"]

# Worked by hand with the merge ranks above:
# ' hello' = Ġ h e l l o: (h,e) has rank 0, beating (Ġ,h) at rank 4, so it goes first; then
# (l,l), (he,ll), (hell,o); (Ġ,hello) is no merge -> [Ġ, hello] = [5, 12].
# ' ho' = Ġ h o: only (Ġ,h) merges -> [Ġh, o] = [13, 4].
# ' world' = Ġ w o r l d: (o,r), then (w,or) -> [Ġ, wor, l, d] = [5, 15, 3, 8].
GPT2_CASES = [
    ("hello", [12]),
    ("hello hello world", [12, 5, 12, 5, 15, 3, 8]),
    (" ho", [13, 4]),
    ("hello\n", [12, 16]),
]


@pytest.fixture(scope="module")
def gpt2_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpt2")
    vocab, merges = folder / "vocab.json", folder / "merges.txt"
    vocab.write_text(json.dumps(GPT2_VOCAB), encoding="utf-8")
    merges.write_text("#version: 0.2\n" + "\n".join(GPT2_MERGES) + "\n", encoding="utf-8")
    return str(vocab), str(merges)


@pytest.fixture(scope="module")
def hf_tokenizer_json(tmp_path_factory):
    """A word-level tokenizer.json made with the `tokenizers` package itself."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "</s>": 3, "<pad>": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path_factory.mktemp("hf") / "tokenizer.json"
    tok.save(str(path))
    return str(path)


@pytest.mark.parametrize("text", ["", "hello", "naïve café ✓ 你好\n\ttabs", "\x00\xff"])
def test_byte_level_round_trip(text):
    tok = tk.build_tokenizer("ByteLevelTokenizer")
    ids = tok.tokenize(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.detokenize(ids + [tok.eod]) == text  # eod carries no text
    assert (tok.vocab_size, tok.eod) == (257, 256)


def test_byte_level_ids_are_utf8_bytes():
    assert tk.ByteLevelTokenizer().tokenize("é!") == [0xC3, 0xA9, 0x21]


@pytest.mark.parametrize(
    "orig, divisible_by, tp, padded",
    [(257, 128, 1, 384), (257, 128, 2, 512), (256, 128, 1, 256), (50257, 128, 1, 50304),
     (50257, 128, 8, 51200), (101, 1, 1, 101)],
)  # fmt: skip
def test_padded_vocab_size(orig, divisible_by, tp, padded):
    assert tk.padded_vocab_size(orig, divisible_by, tp) == padded


def test_padded_vocab_size_rejects_zero():
    with pytest.raises(ValueError, match="must both be >= 1"):
        tk.padded_vocab_size(257, 0, 1)


@pytest.mark.parametrize("text, ids", GPT2_CASES)
def test_gpt2_bpe_matches_hand_computed(gpt2_files, text, ids):
    tok = tk.build_tokenizer("GPT2BPETokenizer", vocab_file=gpt2_files[0], merge_file=gpt2_files[1])
    assert tok.tokenize(text) == ids
    assert tok.detokenize(ids) == text
    assert (tok.eod, tok.vocab_size) == (0, len(GPT2_VOCAB))


def test_gpt2_pretokenizer_splits_as_gpt2():
    # GPT-2's regex: contractions, optional leading space on words/numbers/punctuation, and a
    # whitespace run leaves its last space to the next word.
    pieces = tk.gpt2_pretokenize_pattern().findall("I'm 2 cool!!  ok ²3 naïve")
    assert pieces == ["I", "'m", " 2", " cool", "!!", " ", " ok", " ²3", " naïve"]


def test_bytes_to_unicode_is_a_bijection_onto_printables():
    table = tk.bytes_to_unicode()
    assert len(table) == 256 and len(set(table.values())) == 256
    assert (table[ord(" ")], table[ord("\n")], table[ord("a")]) == ("Ġ", "Ċ", "a")
    assert all(c.isprintable() and not c.isspace() for c in table.values())


def test_huggingface_tokenizer_json(hf_tokenizer_json):
    tok = tk.build_tokenizer("HuggingFaceTokenizer", tokenizer_model=hf_tokenizer_json)
    assert tok.tokenize("hello world hello") == [1, 2, 1]
    assert tok.tokenize("hello moon") == [1, 0]
    assert tok.vocab_size == 5
    assert tok.eod == 3  # '</s>' found among the usual end-of-document names


def test_huggingface_folder_and_config_eos(hf_tokenizer_json):
    folder = os.path.dirname(hf_tokenizer_json)
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": {"content": "<pad>"}}, f)
    try:
        tok = tk.build_tokenizer("HuggingFaceTokenizer", tokenizer_model=folder)
        assert tok.eod == 4
        explicit = tk.build_tokenizer(
            "HuggingFaceTokenizer", tokenizer_model=folder, eod_token="world"
        )
        assert explicit.eod == 2
    finally:
        os.remove(os.path.join(folder, "tokenizer_config.json"))


def test_null_tokenizer():
    tok = tk.build_tokenizer("NullTokenizer", vocab_size=100)
    assert tok.tokenize("5 17 99") == [5, 17, 99]
    assert tok.detokenize([5, 17]) == "5 17"
    assert (tok.vocab_size, tok.eod) == (101, 100)


def test_unique_identifiers_name_the_class_and_files(gpt2_files):
    # GPTDataset hashes these into its index cache names: different tokenizers, different caches.
    tok = tk.build_tokenizer("GPT2BPETokenizer", vocab_file=gpt2_files[0], merge_file=gpt2_files[1])
    assert tok.unique_identifiers["class"] == "GPT2BPETokenizer"
    assert tok.unique_identifiers["tokenizer_path"] == list(gpt2_files)


BAD_BUILDS = [
    (dict(tokenizer_type="Foo"), "unknown --tokenizer-type 'Foo'; allowed: ByteLevelTokenizer"),
    (dict(tokenizer_type="GPT2BPETokenizer"), "GPT2BPETokenizer needs --vocab-file"),
    (dict(tokenizer_type="GPT2BPETokenizer", vocab_file="VOCAB"), "needs --merge-file"),
    (dict(tokenizer_type="GPT2BPETokenizer", vocab_file="/no/v.json", merge_file="MERGES"),
     "--vocab-file '/no/v.json' does not exist"),
    (dict(tokenizer_type="HuggingFaceTokenizer"), "HuggingFaceTokenizer needs --tokenizer-model"),
    (dict(tokenizer_type="NullTokenizer"), "NullTokenizer needs --vocab-size >= 1, got None"),
]  # fmt: skip


@pytest.mark.parametrize("kwargs, message", BAD_BUILDS)
def test_build_tokenizer_bad_input(gpt2_files, kwargs, message):
    kwargs = {k: gpt2_files[0] if v == "VOCAB" else v for k, v in kwargs.items()}
    kwargs = {k: gpt2_files[1] if v == "MERGES" else v for k, v in kwargs.items()}
    with pytest.raises(ValueError) as err:
        tk.build_tokenizer(**kwargs)
    assert message in str(err.value)


def test_missing_eod_is_a_clear_error(tmp_path):
    vocab, merges = tmp_path / "v.json", tmp_path / "m.txt"
    vocab.write_text(json.dumps({"a": 0}))
    merges.write_text("")
    tok = tk.build_tokenizer("GPT2BPETokenizer", vocab_file=str(vocab), merge_file=str(merges))
    with pytest.raises(NotImplementedError, match="no '<\\|endoftext\\|>' token"):
        tok.eod  # noqa: B018
