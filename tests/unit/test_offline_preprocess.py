"""``python -m megatron.training.preprocess_data`` (the installed package's preprocessing,
upstream's flags) turns a small jsonl into the ``.bin/.idx`` pair GPTDataset reads, for every
tokenizer type given local files, offline (every socket refused, HF_HUB_OFFLINE=1), with forked
workers (``--workers 2``): each document is the tokenizer's ids plus the eod. Partitions merge in
partition order; a missing file or flag is one line and status 2 before any worker. A run that
trains on its output: tests/e2e/test_offline_recipe.py. ~11 s on 2 loaded cores.
"""

import json
import socket

import numpy
import offline_fixtures as fx
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer

from megatron.training import preprocess_data

DOCS = [{"text": t, "title": f"doc {i}"} for i, t in enumerate(fx.TEXTS)] + [
    {"text": "", "title": "-"}
]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("offline_preprocess")
    vocab, merges = fx.gpt2_files(root / "gpt2")
    from megatron.core.tokenizers.text.libraries.megatron_hf_tokenizer import MegatronHFTokenizer

    hf_dir = root / "hf_gpt2"
    MegatronHFTokenizer("GPT2BPETokenizer", str(vocab), str(merges)).save_pretrained(str(hf_dir))
    jsonl = root / "docs.jsonl"
    jsonl.write_text("".join(json.dumps(doc) + "\n" for doc in DOCS))
    numbers = root / "numbers.jsonl"
    numbers.write_text("".join(json.dumps({"text": f"{i} {i + 1} 7"}) + "\n" for i in range(5)))
    return {
        "root": root,
        "jsonl": jsonl,
        "numbers": numbers,
        "GPT2BPETokenizer": ["--vocab-file", vocab, "--merge-file", merges],
        "BertWordPieceLowerCase": ["--vocab-file", fx.bert_vocab(root / "bert")],
        "HuggingFaceTokenizer": ["--tokenizer-model", hf_dir],
        "SentencePieceTokenizer": ["--tokenizer-model", fx.sentencepiece_model(root / "sp")],
        "GPTSentencePieceTokenizer": ["--tokenizer-model", root / "sp" / "sp.model"],
        # --vocab-size: 1000 special tokens (upstream's default count) + the 266 of the file
        "TikTokenizer": [
            "--tokenizer-model",
            fx.tiktoken_vocab(root / "tiktoken"),
            "--vocab-size",
            1266,
        ],
        "NullTokenizer": ["--vocab-size", 128],
    }


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    def refuse(*args, **kwargs):
        raise OSError("network refused by the test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


KINDS = [
    "GPT2BPETokenizer",
    "BertWordPieceLowerCase",
    "HuggingFaceTokenizer",
    "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer",
    "TikTokenizer",
    "NullTokenizer",
]


def _run(assets, kind, prefix, *extra, source=None):
    flags = ["--tokenizer-type", kind, *assets[kind]]
    source = source or assets["numbers" if kind == "NullTokenizer" else "jsonl"]
    argv = ["--input", source, "--output-prefix", prefix, "--workers", "2", *flags, *extra]
    status = preprocess_data.main([str(a) for a in argv])
    return status, build_tokenizer(fx.tokenizer_args(*flags))


def _documents(prefix) -> list:
    data = IndexedDataset(str(prefix))
    bounds = data.document_indices
    return [
        numpy.concatenate([data[j] for j in range(bounds[i], bounds[i + 1])] or [[]]).tolist()
        for i in range(len(bounds) - 1)
    ]


@pytest.mark.parametrize("kind", KINDS)
def test_every_tokenizer_type_offline(assets, kind):
    prefix = assets["root"] / kind / "docs"
    status, tokenizer = _run(assets, kind, prefix, "--append-eod")
    assert status == 0
    source = assets["numbers" if kind == "NullTokenizer" else "jsonl"]
    texts = [json.loads(line)["text"] for line in source.read_text().splitlines()]
    ids = [tokenizer.tokenize(t) for t in texts]
    expected = [i + [tokenizer.eod] if i else [] for i in ids]
    assert _documents(f"{prefix}_text_document") == expected
    assert any(len(doc) > 2 for doc in expected)  # the texts do tokenize


def test_json_keys_and_partitions_merge_in_order(assets, tmp_path):
    """--partitions 2 deals the lines into two files (round robin) and merges their outputs in
    partition order, as upstream's; --keep-sequential-samples keeps the input's order; each JSON
    key gets its own pair."""
    kind = "GPT2BPETokenizer"
    source = tmp_path / "in.jsonl"
    source.write_text(assets["jsonl"].read_text())
    status, tokenizer = _run(assets, kind, tmp_path / "rr", "--partitions", "2", source=source)
    assert status == 0
    ids = [tokenizer.tokenize(doc["text"]) for doc in DOCS]
    assert _documents(tmp_path / "rr_text_document") == ids[0::2] + ids[1::2]
    for name in ("in_0.jsonl", "in_1.jsonl"):
        (tmp_path / name).unlink()
    extra = ("--partitions", "2", "--keep-sequential-samples", "--json-keys", "text", "title")
    status, _ = _run(assets, kind, tmp_path / "seq", *extra, source=source)
    assert status == 0
    assert _documents(tmp_path / "seq_text_document") == ids
    expected_ids = [tokenizer.tokenize(doc["title"]) for doc in DOCS]
    assert _documents(tmp_path / "seq_title_document") == expected_ids


REFUSALS = [
    (["--vocab-file", "missing.json"], "--vocab-file missing.json: no such file"),
    ([], "needs --vocab-file and --merge-file"),
    (["--split-sentences"], "--split-sentences is not built by this command"),
]


@pytest.mark.parametrize("flags, message", REFUSALS)
def test_refused_in_one_line_before_any_worker(
    assets, tmp_path, capsys, monkeypatch, flags, message
):
    monkeypatch.setattr(preprocess_data.preflight, "_has", lambda package: package != "wget")
    forks = []
    monkeypatch.setattr(preprocess_data, "encode_file", lambda *a: forks.append(a))
    argv = ["--input", assets["jsonl"], "--output-prefix", tmp_path / "x", "--workers", "2"]
    if "--vocab-file" not in flags and flags != []:
        flags = [*flags, *assets["GPT2BPETokenizer"]]
    argv += ["--tokenizer-type", "GPT2BPETokenizer", *flags]
    assert preprocess_data.main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err and not forks
