"""Small tokenizer files the offline tests make (no download): a GPT-2 style byte-level BPE
(vocab.json, merges.txt), a BERT WordPiece vocab.txt, a SentencePiece model, a TikToken vocabulary,
a Hugging Face tokenizer directory, and stubs of the hub's config for GPT-2 and BERT (what
``AutoTokenizer.from_pretrained("gpt2", vocab_file=..., merges_file=...)`` reads from the hub
besides the files)."""

import argparse
import base64
import json
from pathlib import Path

from megatron.training.arguments import _add_tokenizer_args

from megatron.training.preprocess_data import TOKENIZER_DUMMIES

# The text the vocabularies are trained on; TEXTS are encoded by the tests (unseen words, bytes
# outside ASCII, runs of spaces and newlines, the end-of-text token written out)
CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Megatron trains GPT models with tensor, pipeline and data parallelism.",
    "hello world, hello there; the cluster has no internet.",
]
TEXTS = [
    "hello world",
    "The lazy dog trains GPT models.",
    "  two  spaces\nand a newline\n\n",
    "naïve café ☃ 1234 ünïcödé",
    "unseen words: zebra quartz",
    "a<|endoftext|>b",
]
EOT = "<|endoftext|>"
# The hub's gpt2 (openai-community/gpt2) tokenizer_config.json and the fields of its config.json
GPT2_HUB_CONFIG = {"model_max_length": 1024}
GPT2_HUB_MODEL = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": 50257}
BERT_HUB_CONFIG = {
    True: {"do_lower_case": True, "model_max_length": 512},
    False: {"do_lower_case": False, "model_max_length": 512},
}
BERT_HUB_MODEL = {"model_type": "bert", "architectures": ["BertForMaskedLM"], "vocab_size": 30522}


def gpt2_files(folder: Path, vocab_size: int = 320) -> tuple:
    """(vocab.json, merges.txt) of a byte-level BPE trained on CORPUS, GPT-2's layout: the 256
    byte symbols first, the merges, the end-of-text token last."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    vocab_file, merges_file = tok.model.save(str(folder))
    ranked = sorted((i, t) for t, i in tok.get_vocab().items() if t != EOT)
    vocab = {t: k for k, (_, t) in enumerate(ranked)}
    vocab[EOT] = len(vocab)
    Path(vocab_file).write_text(json.dumps(vocab))
    return Path(vocab_file), Path(merges_file)


def bert_vocab(folder: Path) -> Path:
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "hello", "world", "lazy", "dog"]
    words += ["##s", "gp", "##t", "model", "na", "##ive", ",", ".", ":", "a", "b", "1234", "The"]
    words += list("abcdefghijklmnopqrstuvwxyz") + ["##" + c for c in "abcdefghijklmnopqrstuvwxyz"]
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "vocab.txt"
    path.write_text("\n".join(words) + "\n")
    return path


def hub_stub(folder: Path, model: dict, config: dict, tokenizer_json: Path = None) -> Path:
    """A directory with the hub's config.json and tokenizer_config.json (and a tokenizer.json,
    as the hub's gpt2 has one, where given)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(model))
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    if tokenizer_json is not None:
        (folder / "tokenizer.json").write_bytes(tokenizer_json.read_bytes())
    return folder


def sentencepiece_model(folder: Path) -> Path:
    import io

    import sentencepiece

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS * 20),
        model_writer=model,
        vocab_size=60,
        model_type="bpe",
        minloglevel=2,
    )
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "sp.model"
    path.write_bytes(model.getvalue())
    return path


def tiktoken_vocab(folder: Path) -> Path:
    """Megatron's TikToken json: the 256 bytes, then a few merges (rank order)."""
    merges = [b"he", b"ll", b"hell", b"hello", b" w", b"or", b" wor", b"ld", b" world", b"th"]
    tokens = [bytes([i]) for i in range(256)] + merges
    entries = [
        {"rank": i, "token_bytes": base64.b64encode(t).decode(), "token_str": t.decode("latin-1")}
        for i, t in enumerate(tokens)
    ]
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "tiktoken.json"
    path.write_text(json.dumps(entries))
    return path


def tokenizer_args(*argv) -> argparse.Namespace:
    """Upstream's tokenizer flags parsed, with the values upstream's preprocess_data.py sets."""
    args = _add_tokenizer_args(argparse.ArgumentParser()).parse_args([str(a) for a in argv])
    for name, value in TOKENIZER_DUMMIES.items():
        setattr(args, name, value)
    return args
