# Copyright (c) 2025, NVIDIA CORPORATION. All rights reserved.

"""python -m megatron.training.preprocess_data: the package ships no tools/preprocess_data.py, so
an installed megatron-core could not make its own --data-path. The module takes that script's
flags, builds the tokenizer once before its workers fork, and writes what GPTDataset reads.
Before a worker starts, megatron.training.preflight names in one line a tokenizer file, flag or
package the command lacks (exit status 2), instead of a worker's traceback or a download."""

import json

import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset

from megatron.training import preprocess_data

tokenizers = pytest.importorskip("tokenizers")
pytest.importorskip("transformers")

TEXTS = [f"Document {i}: the quick brown fox jumps over {i % 7} lazy dogs." for i in range(24)]
EOT = "<|endoftext|>"


def _gpt2_files(folder):
    """A byte-level BPE trained on TEXTS in GPT-2's layout (vocab.json, merges.txt)."""
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    alphabet = tokenizers.pre_tokenizers.ByteLevel.alphabet()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300, special_tokens=[EOT], initial_alphabet=alphabet, show_progress=False
    )
    tok.train_from_iterator(TEXTS, trainer)
    vocab_file, merges_file = tok.model.save(str(folder))
    ranked = sorted((i, t) for t, i in tok.get_vocab().items() if t != EOT)
    vocab = {t: k for k, (_, t) in enumerate(ranked)}
    vocab[EOT] = len(vocab)
    with open(vocab_file, "w") as f:
        json.dump(vocab, f)
    return vocab_file, merges_file


def _argv(tmp_path, vocab, merges, corpus):
    argv = ["--input", str(corpus), "--output-prefix", str(tmp_path / "out" / "corpus")]
    argv += ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(vocab)]
    return argv + ["--merge-file", str(merges), "--append-eod", "--workers", "2"]


@pytest.fixture
def files(tmp_path):
    vocab, merges = _gpt2_files(tmp_path)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": text}) + "\n" for text in TEXTS))
    return vocab, merges, corpus


def test_preprocess_writes_each_document_tokenized_in_order(tmp_path):
    # NullTokenizer (ids written as text): no tokenizer files, no hub
    corpus = tmp_path / "ids.jsonl"
    docs = [[(7 * i + j) % 100 for j in range(1 + i % 5)] for i in range(24)]
    corpus.write_text("".join(json.dumps({"text": " ".join(map(str, d))}) + "\n" for d in docs))
    argv = ["--input", str(corpus), "--output-prefix", str(tmp_path / "out" / "ids")]
    argv += ["--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--append-eod"]
    assert preprocess_data.main(argv + ["--workers", "2"]) == 0
    dataset = IndexedDataset(str(tmp_path / "out" / "ids_text_document"))
    assert len(dataset) == len(docs)
    for i, doc in enumerate(docs):
        assert dataset[i].tolist() == doc + [127]  # NullTokenizer's eod: vocab_size - 1


def test_a_missing_tokenizer_file_is_one_line_naming_the_flag(tmp_path, files, capsys):
    vocab, merges, corpus = files
    missing = tmp_path / "nowhere" / "vocab.json"
    assert preprocess_data.main(_argv(tmp_path, missing, merges, corpus)) == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and f"--vocab-file {missing}: no such file" in error, error
    assert not (tmp_path / "out").exists()  # nothing written, no worker started
