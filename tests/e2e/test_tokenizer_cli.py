"""Tokenizer families through the real CLI, one launch each: tools/preprocess_data.py writes the
data with a model file made here (tests/tokenizer_files.py), pretrain_gpt.py trains 3 steps on it
with the same tokenizer flags. Folded in: --per-split-data-args-path, --data-args-path,
--apply-layernorm-1p with the local layers, --dataloader-type cyclic (sharded and not),
--eod-mask-loss, --reset-position-ids and --reset-attention-mask (masks in the local attention).

    .venv/bin/python -m pytest -q tests/e2e/test_tokenizer_cli.py
"""

import json
import os
import random
import subprocess
import sys

import pytest

from tests.tokenizer_files import SP_SENTENCES, write_sentencepiece_model, write_tiktoken_ranks

from .cli import ROOT, TINY, losses, run

TIKTOKEN_FLAGS = [
    "--tiktoken-pattern", "v2", "--vocab-size", "270", "--tiktoken-num-special-tokens", "4",
    "--tiktoken-special-tokens", "<unk>", "<s>", "</s>", "<pad>",
]  # fmt: skip
MODEL_FLAGS = [a for a in TINY if a not in ("--mock-data", "--vocab-size", "64")]


def _jsonl(path) -> str:
    """200 documents of shuffled sentences under two keys: text (train) and valid."""
    rng = random.Random(0)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(200):
            docs = [". ".join(rng.sample(SP_SENTENCES, 3)) for _ in range(2)]
            f.write(json.dumps({"text": docs[0], "valid": docs[1]}) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """{family: (tokenizer flags, output prefix)}: both preprocessed by the real tool at once."""
    folder = tmp_path_factory.mktemp("tok_cli")
    src = _jsonl(folder / "docs.jsonl")
    families = {
        "sentencepiece": ["--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model",
                          write_sentencepiece_model(folder / "sp.model")],
        "tiktoken": ["--tokenizer-type", "TikTokenizer", "--tokenizer-model",
                     write_tiktoken_ranks(folder / "ranks.json"), *TIKTOKEN_FLAGS],
    }  # fmt: skip
    tool = os.path.join(ROOT, "tools", "preprocess_data.py")
    procs = {
        name: subprocess.Popen(
            [sys.executable, tool, "--input", src, "--output-prefix", str(folder / name)]
            + ["--json-keys", "text", "valid", "--append-eod", *flags],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, flags in families.items()
    }
    for proc in procs.values():
        _, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, err
    return {name: (flags, str(folder / name)) for name, flags in families.items()}


def _documents(prefix: str) -> list:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix)
    return [ds[i].tolist() for i in range(len(ds))]


def test_llama2_sentencepiece_trains_with_per_split_file_and_layernorm_1p(data, tmp_path):
    flags, prefix = data["sentencepiece"]
    docs = _documents(prefix + "_text_document")
    assert all(d[0] == 1 and d[-1] == 2 for d in docs)  # <s> ... </s> (eod), Megatron-LM's
    splits = tmp_path / "splits.json"
    splits.write_text(json.dumps({
        "train": [prefix + "_text_document"], "valid": prefix + "_valid_document", "test": None,
    }))  # fmt: skip
    args = MODEL_FLAGS + flags + ["--per-split-data-args-path", str(splits), "--train-iters", 3]
    args += ["--apply-layernorm-1p", "--dataloader-type", "cyclic"]
    proc = run(args)
    assert sorted(losses(proc)) == [1, 2, 3]
    assert proc.stdout.count("validation loss at iteration 2") == 1


def test_tiktoken_trains_with_data_args_file_document_masks_and_unsharded_cyclic(data, tmp_path):
    flags, prefix = data["tiktoken"]
    docs = _documents(prefix + "_text_document")
    assert all(d[-1] == 2 and max(d[:-1]) < 270 and min(d[:-1]) >= 4 for d in docs)
    data_args = tmp_path / "data.txt"
    data_args.write_text(f"1.0 {prefix}_text_document\n")
    args = MODEL_FLAGS + flags + ["--data-args-path", str(data_args), "--split", "90,10,0"]
    args += ["--train-iters", 3, "--dataloader-type", "cyclic", "--no-data-sharding"]
    args += ["--eod-mask-loss", "--reset-position-ids", "--reset-attention-mask"]
    proc = run(args)
    assert sorted(losses(proc)) == [1, 2, 3]
    assert proc.stdout.count("validation loss at iteration 2") == 1
    assert "--reset-attention-mask: the data loader builds per-sample attention masks" in (
        proc.stderr
    )
