"""The built-in stdlib corpus: deterministic, capped, cached, and the same files that
tools/preprocess_data.py writes from its jsonl."""

import itertools
import json
import os

import numpy
from megatron.core.datasets.indexed_dataset import IndexedDataset

from megatron.training import corpus

SMALL = 200_000  # bytes: a few dozen stdlib files, enough to see order and the cap


def test_jsonl_is_deterministic_sorted_and_capped(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    count = corpus.write_corpus_jsonl(str(a), SMALL)
    corpus.write_corpus_jsonl(str(b), SMALL)
    assert a.read_bytes() == b.read_bytes()
    docs = [json.loads(line) for line in a.read_text(encoding="utf-8").splitlines()]
    assert len(docs) == count > 5
    paths = [d["path"] for d in docs]
    assert paths == sorted(paths) and paths[0] == "__future__.py"
    total = sum(len(d["text"].encode("utf-8")) for d in docs)
    assert total <= SMALL
    # The cap stops before the next file, not earlier: adding it would pass the cap.
    uncapped = list(itertools.islice(corpus.stdlib_documents(10**12), count + 1))
    assert uncapped[:count] == docs
    assert total + len(uncapped[count]["text"].encode("utf-8")) > SMALL
    assert all(d["text"].strip() for d in docs)
    assert not any(p.startswith(("test/", "site-packages/")) for p in paths)


def test_build_matches_preprocess_data_and_is_cached(tmp_path):
    from test_preprocess_data import preprocess_data

    prefix = corpus.build_corpus(str(tmp_path / "cache"), SMALL)
    assert prefix.endswith("stdlib_text_document") and IndexedDataset.exists(prefix)
    src = str(tmp_path / "c.jsonl")
    corpus.write_corpus_jsonl(src, SMALL)
    ref = str(tmp_path / "ref")
    argv = ["--input", src, "--output-prefix", ref, "--tokenizer-type", "ByteLevelTokenizer"]
    assert preprocess_data.main(argv + ["--append-eod"]) == 0
    for ext in (".bin", ".idx"):
        with open(prefix + ext, "rb") as mine, open(ref + "_text_document" + ext, "rb") as theirs:
            assert mine.read() == theirs.read()

    mtime = os.path.getmtime(prefix + ".bin")
    assert corpus.build_corpus(str(tmp_path / "cache"), SMALL) == prefix  # a lookup, no rebuild
    assert os.path.getmtime(prefix + ".bin") == mtime
    # No temp build folder is left behind.
    names = sorted(os.listdir(os.path.dirname(prefix)))
    assert names == ["stdlib_text_document.bin", "stdlib_text_document.idx"]


def test_documents_are_utf8_bytes_then_eod(tmp_path):
    prefix = corpus.build_corpus(str(tmp_path), 20_000)
    ds = IndexedDataset(prefix)
    first = next(corpus.stdlib_documents(20_000))["text"].encode("utf-8")
    assert numpy.array_equal(ds[0][:-1], numpy.frombuffer(first, numpy.uint8))
    assert ds[0][-1] == corpus.BYTE_EOD


def test_cache_folder_names_python_version_and_cap(tmp_path):
    folder = corpus.corpus_dir(str(tmp_path), 1234)
    assert os.path.basename(folder).startswith("py3.") and folder.endswith("-1234")


def test_cli_prints_the_prefix(tmp_path, capsys):
    assert corpus.main(["--cache-dir", str(tmp_path), "--max-bytes", "20000"]) == 0
    assert capsys.readouterr().out.strip() == corpus.build_corpus(str(tmp_path), 20_000)
