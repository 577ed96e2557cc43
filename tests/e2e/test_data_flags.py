"""Data flags through the real CLI: per-split paths, --no-mmap-bin-files, --data-cache-path,
--dataloader-type single, --no-create-attention-mask-in-dataloader.

    .venv/bin/python -m pytest -q tests/e2e/test_data_flags.py
"""

import os
import re
import subprocess
import sys

from .cli import ROOT, TINY, losses, run


def _prefix(tmp_path) -> str:
    from megatron.training.corpus import write_corpus_jsonl

    jsonl = str(tmp_path / "corpus.jsonl")
    write_corpus_jsonl(jsonl, max_bytes=60_000)
    prefix = str(tmp_path / "text")
    tool = os.path.join(ROOT, "tools", "preprocess_data.py")
    subprocess.run(
        [sys.executable, tool, "--input", jsonl, "--output-prefix", prefix]
        + ["--tokenizer-type", "ByteLevelTokenizer", "--append-eod"],
        check=True,
        capture_output=True,
        timeout=120,
    )
    return prefix + "_text_document"


def test_per_split_paths_read_the_same_tokens_with_and_without_mmap(tmp_path):
    prefix = _prefix(tmp_path)
    args = [a for a in TINY if a not in ("--mock-data", "--vocab-size", "64")]
    args += ["--train-iters", 3, "--train-data-path", prefix, "--valid-data-path", prefix]
    args += ["--test-data-path", prefix]  # evaluated once, after the last step
    args += ["--dataloader-type", "single", "--no-create-attention-mask-in-dataloader"]
    cache = str(tmp_path / "cache")
    mapped = run(args + ["--data-cache-path", cache])
    read = run(args + ["--data-cache-path", cache, "--no-mmap-bin-files"])
    assert sorted(losses(mapped)) == [1, 2, 3] and losses(read) == losses(mapped)
    for label in ("2", "3 on validation set", "3 on test set"):
        assert mapped.stdout.count(f"validation loss at iteration {label} |") == 1, label
    evaluations = re.compile(r"validation loss at .*")
    assert evaluations.findall(read.stdout) == evaluations.findall(mapped.stdout)
    assert any(name.endswith(".npy") for _, _, names in os.walk(cache) for name in names)
