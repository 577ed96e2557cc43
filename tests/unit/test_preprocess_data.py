"""tools/preprocess_data.py: every tokenizer end to end (read back with megatron-core's
IndexedDataset), --append-eod, several json keys, workers, and a table of bad inputs run through
the real command line (clear message, non-zero exit, no output files)."""

import importlib.util
import json
import os
import subprocess
import sys

import numpy
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset
from test_tokenizer import GPT2_MERGES, GPT2_VOCAB

from megatron.training.tokenizer import TOKENIZER_TYPES
from tests.tokenizer_files import write_sentencepiece_model, write_tiktoken_ranks

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "tools", "preprocess_data.py")

_spec = importlib.util.spec_from_file_location("preprocess_data", SCRIPT)
preprocess_data = importlib.util.module_from_spec(_spec)
sys.modules["preprocess_data"] = preprocess_data  # so that Pool workers can unpickle Encoder
_spec.loader.exec_module(preprocess_data)

# Per tokenizer: documents it can read (NullTokenizer reads ids); the empty one stays empty.
DOCS = {
    "ByteLevelTokenizer": ["hello world", "", "naïve ✓"],
    "GPT2BPETokenizer": ["hello hello world", "", " ho\n"],
    "HuggingFaceTokenizer": ["hello world", "", "world hello moon"],
    "NullTokenizer": ["1 2 3", "", "7 0"],
    "GPTSentencePieceTokenizer": ["hello world", "", "the lazy dog"],
    "Llama2Tokenizer": ["hello world", "", "the lazy dog"],
    "TikTokenizer": ["hello world", "", "HelloWorld\n"],
    "SentencePieceTokenizer": ["hello<SEP>world", "", "the lazy dog<extra_id_1>"],
}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Tokenizer files shared by the tests: GPT-2 vocab/merges, a tokenizer.json, a sentencepiece
    model and a tiktoken ranks file (tests/tokenizer_files.py)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder = tmp_path_factory.mktemp("tok")
    (folder / "vocab.json").write_text(json.dumps(GPT2_VOCAB), encoding="utf-8")
    (folder / "merges.txt").write_text("\n".join(GPT2_MERGES) + "\n", encoding="utf-8")
    hf = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2, "</s>": 3}, "[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.save(str(folder / "tokenizer.json"))
    write_sentencepiece_model(folder / "sp.model")
    write_tiktoken_ranks(folder / "ranks.json")
    return folder


def tokenizer_flags(tokenizer_type: str, files) -> list[str]:
    gpt2 = ["--vocab-file", f"{files}/vocab.json", "--merge-file", f"{files}/merges.txt"]
    extra = {
        "GPT2BPETokenizer": gpt2,
        "HuggingFaceTokenizer": ["--tokenizer-model", f"{files}/tokenizer.json"],
        "NullTokenizer": ["--vocab-size", "10"],
        "GPTSentencePieceTokenizer": ["--tokenizer-model", f"{files}/sp.model"],
        "Llama2Tokenizer": ["--tokenizer-model", f"{files}/sp.model"],
        "SentencePieceTokenizer": ["--tokenizer-model", f"{files}/sp.model",
                                   "--vocab-extra-ids", "2"],
        "TikTokenizer": ["--tokenizer-model", f"{files}/ranks.json", "--tiktoken-pattern", "v1",
                         "--vocab-size", "270", "--tiktoken-num-special-tokens", "4",
                         "--tiktoken-special-tokens", "<unk>", "<s>", "</s>", "<pad>"],
    }  # fmt: skip
    return ["--tokenizer-type", tokenizer_type, *extra.get(tokenizer_type, [])]


def write_jsonl(path, docs, key="text") -> str:
    with open(path, "w", encoding="utf-8") as f:
        for text in docs:
            f.write(json.dumps({key: text, "id": len(text)}) + "\n")
    return str(path)


def read_back(prefix: str) -> list[list[int]]:
    """Token ids per document (an empty document has no sequence)."""
    ds = IndexedDataset(prefix)
    docs = ds.document_indices
    return [
        [int(t) for s in range(docs[d], docs[d + 1]) for t in ds[s]] for d in range(len(docs) - 1)
    ]


def test_tokenizer_types_match_the_library():
    assert preprocess_data.TOKENIZER_TYPES == TOKENIZER_TYPES


@pytest.mark.parametrize("tokenizer_type", TOKENIZER_TYPES)
@pytest.mark.parametrize("append_eod", [False, True])
def test_end_to_end_each_tokenizer(tmp_path, files, tokenizer_type, append_eod):
    src = write_jsonl(tmp_path / "in.jsonl", DOCS[tokenizer_type])
    flags = tokenizer_flags(tokenizer_type, files) + ["--append-eod"] * append_eod
    argv = ["--input", src, "--output-prefix", str(tmp_path / "out" / "ds"), *flags]
    assert preprocess_data.main(argv) == 0
    tok = preprocess_data.build_tokenizer_from_args(preprocess_data.get_args(argv))
    expected = [
        tok.tokenize(t) + [tok.eod] * (append_eod and bool(tok.tokenize(t)))
        for t in DOCS[tokenizer_type]
    ]
    assert read_back(str(tmp_path / "out" / "ds_text_document")) == expected
    assert sorted(os.listdir(tmp_path / "out")) == ["ds_text_document.bin", "ds_text_document.idx"]
    # Llama2Tokenizer starts every document with <s> (id 1), even an empty one (Megatron-LM)
    assert expected[1][:1] == ([1] if tokenizer_type == "Llama2Tokenizer" else [])
    assert all(expected[0::2])


def test_append_eod_adds_exactly_one_token_per_document(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", ["ab", "c"])
    for flag in ([], ["--append-eod"]):
        prefix = str(tmp_path / ("eod" if flag else "plain"))
        argv = ["--input", src, "--output-prefix", prefix, "--tokenizer-type", "ByteLevelTokenizer"]
        assert preprocess_data.main(argv + flag) == 0
    assert read_back(str(tmp_path / "plain_text_document")) == [[97, 98], [99]]
    assert read_back(str(tmp_path / "eod_text_document")) == [[97, 98, 256], [99, 256]]
    ds = IndexedDataset(str(tmp_path / "eod_text_document"))
    assert ds.index.dtype == numpy.uint16  # upstream's optimal dtype for a 257-token vocab


def test_several_json_keys_write_one_dataset_each(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text('{"text": "ab", "title": "T"}\n{"text": "c", "title": "UV"}\n')
    prefix = str(tmp_path / "ds")
    argv = ["--input", str(src), "--output-prefix", prefix, "--json-keys", "text", "title"]
    assert preprocess_data.main(argv + ["--tokenizer-type", "ByteLevelTokenizer"]) == 0
    assert read_back(prefix + "_text_document") == [[97, 98], [99]]
    assert read_back(prefix + "_title_document") == [[84], [85, 86]]


def run_cli(argv) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, SCRIPT, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


# (case, argv, jsonl lines, exit code, message on stderr). Exit 2 comes from argparse (before
# the slow megatron.core import), 1 from a bad tokenizer flag or a bad document.
BAD_INPUTS = [
    ("missing input", ["--input", "/no/such.jsonl", "--tokenizer-type", "ByteLevelTokenizer"],
     None, 2, "--input '/no/such.jsonl' does not exist"),
    ("unknown tokenizer", ["--tokenizer-type", "Foo"], None, 2,
     "argument --tokenizer-type: invalid choice: 'Foo' (choose from 'ByteLevelTokenizer'"),
    ("bpe without vocab", ["--tokenizer-type", "GPT2BPETokenizer"], None, 1,
     "GPT2BPETokenizer needs --vocab-file"),
    ("bpe without merges", ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "VOCAB"],
     None, 1, "GPT2BPETokenizer needs --merge-file"),
    ("bpe vocab missing", ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "/no/v.json",
     "--merge-file", "MERGES"], None, 1, "--vocab-file '/no/v.json' does not exist"),
    ("hf model missing", ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
     "/no/tokenizer.json"], None, 1, "--tokenizer-model '/no/tokenizer.json' does not exist"),
    ("null without size", ["--tokenizer-type", "NullTokenizer"], None, 1,
     "NullTokenizer needs --vocab-size"),
    ("sentencepiece without model", ["--tokenizer-type", "Llama2Tokenizer"], None, 1,
     "Llama2Tokenizer needs --tokenizer-model"),
    ("tiktoken without pattern", ["--tokenizer-type", "TikTokenizer", "--tokenizer-model",
     "RANKS"], None, 1, "TikTokenizer needs --tiktoken-pattern v1 or v2, got None"),
    ("missing json key", ["--tokenizer-type", "ByteLevelTokenizer", "--json-keys", "text",
     "title", "--workers", "2"], ['{"text": "a", "title": "b"}', '{"text": "c"}'], 1,
     "line 2 has no key 'title' (--json-keys text title); keys present: ['text']"),
    ("bad json", ["--tokenizer-type", "ByteLevelTokenizer"], ['{"text": "a"}', "{not json"], 1,
     "line 2 is not valid JSON"),
    ("non-string value", ["--tokenizer-type", "ByteLevelTokenizer"], ['{"text": 5}'], 1,
     "'text' is int, expected a string"),
    ("no workers", ["--tokenizer-type", "ByteLevelTokenizer", "--workers", "0"], None, 2,
     "--workers must be >= 1, got 0"),
]  # fmt: skip
CASE_IDS = [c[0] for c in BAD_INPUTS]
# Through the real command line: the two argparse cases cost no import; the missing key pays the
# ~5 s megatron.core import and shows a worker's error reaching the exit code and the cleanup.
CLI_CASES = ("missing input", "unknown tokenizer", "missing json key")


def bad_input_argv(folder, files, argv, lines) -> list[str]:
    src = folder / "in.jsonl"
    src.write_text("\n".join(lines or ['{"text": "hello"}']) + "\n")
    names = {
        "VOCAB": f"{files}/vocab.json",
        "MERGES": f"{files}/merges.txt",
        "RANKS": f"{files}/ranks.json",
    }
    argv = [names.get(a, a) for a in argv]
    if "--input" not in argv:
        argv = ["--input", str(src), *argv]
    return argv + ["--output-prefix", str(folder / "out" / "ds")]


def assert_clean_failure(folder, returncode, stderr, code, message):
    assert returncode == code, stderr
    assert message in stderr
    assert "Traceback" not in stderr
    out_dir = folder / "out"
    assert not out_dir.exists() or os.listdir(out_dir) == []


@pytest.mark.parametrize("case, argv, lines, code, message", BAD_INPUTS, ids=CASE_IDS)
def test_bad_input_is_a_clear_error_and_leaves_no_files(
    tmp_path, files, capsys, case, argv, lines, code, message
):
    try:
        returncode = preprocess_data.main(bad_input_argv(tmp_path, files, argv, lines))
    except SystemExit as exit_:  # argparse
        returncode = exit_.code
    assert_clean_failure(tmp_path, returncode, capsys.readouterr().err, code, message)


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory, files):
    """Every command line of this module at once, so their imports overlap."""
    runs = {}
    for case, argv, lines, _, _ in BAD_INPUTS:
        if case in CLI_CASES:
            folder = tmp_path_factory.mktemp(case.replace(" ", "_"))
            runs[case] = (run_cli(bad_input_argv(folder, files, argv, lines)), folder)
    folder = tmp_path_factory.mktemp("workers")
    src = write_jsonl(folder / "in.jsonl", [f"hello {'world ' * (i % 5)}ho\n" for i in range(200)])
    flags = tokenizer_flags("GPT2BPETokenizer", files) + ["--append-eod", "--log-interval", "50"]
    argv = ["--input", src, "--output-prefix", str(folder / "cli"), "--workers", "2", *flags]
    runs["workers"] = (run_cli(argv), folder)
    results = {case: (*proc.communicate(timeout=240), proc.returncode, folder)
               for case, (proc, folder) in runs.items()}  # fmt: skip
    return results, ["--input", src, "--output-prefix", str(folder / "ref"), *flags]


@pytest.mark.parametrize("case", CLI_CASES)
def test_bad_input_through_the_cli(cli_runs, case):
    _, _, _, code, message = BAD_INPUTS[CASE_IDS.index(case)]
    _, stderr, returncode, folder = cli_runs[0][case]
    assert_clean_failure(folder, returncode, stderr, code, message)


def test_cli_with_workers_writes_the_same_files(cli_runs):
    """The real command line with two worker processes against the in-process single worker."""
    (stdout, stderr, returncode, folder), ref_argv = cli_runs[0]["workers"], cli_runs[1]
    assert returncode == 0, stderr
    assert "wrote" in stdout and "processed 200 documents" in stderr
    assert preprocess_data.main(ref_argv) == 0
    for ext in (".bin", ".idx"):
        cli = (folder / f"cli_text_document{ext}").read_bytes()
        assert cli == (folder / f"ref_text_document{ext}").read_bytes()
