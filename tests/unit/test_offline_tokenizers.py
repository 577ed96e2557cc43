"""Upstream's GPT-2 BPE and BERT WordPiece tokenizers built from local files, offline (patch 0070):
the ids, eod, vocabulary size and padded vocabulary size equal upstream's path with the same
files, whose hub access (``AutoTokenizer.from_pretrained("gpt2", vocab_file=...,
merges_file=...)``) is served by a stub of the hub's config; ours runs with the hub and every
socket refused. Also: online, upstream's path takes the hub's tokenizer.json over the files given
(the defect the patch repairs), and without files, network or wget, one line names the flags.
~4 s on 2 cores.
"""

import socket

import offline_fixtures as fx
import pytest
from megatron.core.tokenizers.text.libraries import huggingface_tokenizer, megatron_hf_tokenizer
from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer

from megatron.training import preflight

BERT_TYPES = {"BertWordPieceLowerCase": True, "BertWordPieceCase": False}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("offline_tokenizers")
    vocab, merges = fx.gpt2_files(root / "gpt2")
    return {"root": root, "vocab": vocab, "merges": merges, "bert": fx.bert_vocab(root / "bert")}


@pytest.fixture
def no_network(monkeypatch):
    _refuse_network(monkeypatch)


def _refuse_network(monkeypatch):
    """Every connection and every hub load refused: the tokenizer must come from the files."""

    def refuse(*args, **kwargs):
        raise OSError("network refused by the test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(huggingface_tokenizer.AutoTokenizer, "from_pretrained", refuse)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _upstream(monkeypatch, kind, stub):
    """Upstream's path: AutoTokenizer.from_pretrained of the hub name, here the stub's folder."""
    monkeypatch.setattr(
        megatron_hf_tokenizer.MegatronHFTokenizer,
        "_from_local_files",
        huggingface_tokenizer.HuggingFaceTokenizer._from_local_files,
    )
    entry = dict(megatron_hf_tokenizer.MEGATRON_CONFIG_MAP[kind], tokenizer_name=str(stub))
    monkeypatch.setitem(megatron_hf_tokenizer.MEGATRON_CONFIG_MAP, kind, entry)


def _summary(tokenizer, args) -> dict:
    ids = [tokenizer.tokenize(text) for text in fx.TEXTS]
    return {
        "ids": ids,
        "text": [tokenizer.detokenize(i) for i in ids],
        "eod": tokenizer.eod,
        "vocab_size": tokenizer.vocab_size,
        "padded_vocab_size": args.padded_vocab_size,
    }


def _built(*argv):
    args = fx.tokenizer_args(*argv)
    return _summary(build_tokenizer(args), args)


def _cases(files):
    gpt2 = ("--vocab-file", files["vocab"], "--merge-file", files["merges"])
    yield (
        "GPT2BPETokenizer",
        fx.hub_stub(files["root"] / "hub_gpt2", fx.GPT2_HUB_MODEL, fx.GPT2_HUB_CONFIG),
        gpt2,
    )
    for kind, lower in BERT_TYPES.items():
        stub = fx.hub_stub(
            files["root"] / f"hub_{kind}", fx.BERT_HUB_MODEL, fx.BERT_HUB_CONFIG[lower]
        )
        yield kind, stub, ("--vocab-file", files["bert"])


def test_local_files_equal_upstreams_path(files, monkeypatch):
    for kind, stub, flags in _cases(files):
        with monkeypatch.context() as offline:
            _refuse_network(offline)
            ours = _built("--tokenizer-type", kind, *flags)
        with monkeypatch.context() as hub:
            _upstream(hub, kind, stub)
            theirs = _built("--tokenizer-type", kind, *flags)
        assert ours == theirs, kind
        assert len(set(map(tuple, ours["ids"]))) == len(fx.TEXTS), kind  # the texts differ


def test_gpt2_ids_are_the_files(files, no_network):
    """A negative control for the comparison above: the ids are the fixture vocabulary's (its
    end-of-text token last, as GPT-2's), not a default vocabulary's."""
    import json

    vocab = json.loads(files["vocab"].read_text())
    got = _built(
        "--tokenizer-type",
        "GPT2BPETokenizer",
        "--vocab-file",
        files["vocab"],
        "--merge-file",
        files["merges"],
    )
    assert got["eod"] == vocab[fx.EOT] == len(vocab) - 1
    assert got["vocab_size"] == len(vocab) and got["padded_vocab_size"] == 384  # 320 -> 128 * 3
    assert got["ids"][-1] == [vocab["a"], vocab[fx.EOT], vocab["b"]]
    assert got["text"][0] == fx.TEXTS[0]


def test_upstreams_path_online_takes_the_hubs_tokenizer_json(files, monkeypatch, tmp_path):
    """Online the hub also serves gpt2's tokenizer.json, and upstream's path builds from it, not
    from the files given (here a tokenizer.json whose ids are the fixture's reversed)."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = json.loads(files["vocab"].read_text())
    merges = [tuple(line.split()) for line in files["merges"].read_text().splitlines()[1:] if line]
    other = Tokenizer(
        models.BPE(vocab={t: len(vocab) - 1 - i for t, i in vocab.items()}, merges=merges)
    )
    other.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    other.decoder = decoders.ByteLevel()
    other.save(str(tmp_path / "tokenizer.json"))
    stub = fx.hub_stub(
        tmp_path / "hub", fx.GPT2_HUB_MODEL, fx.GPT2_HUB_CONFIG, tmp_path / "tokenizer.json"
    )
    flags = (
        "--tokenizer-type",
        "GPT2BPETokenizer",
        "--vocab-file",
        files["vocab"],
        "--merge-file",
        files["merges"],
    )
    _upstream(monkeypatch, "GPT2BPETokenizer", stub)
    theirs = _built(*flags)
    monkeypatch.undo()
    _refuse_network(monkeypatch)
    ours = _built(*flags)
    assert theirs["ids"][0] == [len(vocab) - 1 - i for i in ours["ids"][0]]
    assert theirs["eod"] == 0 and ours["eod"] == len(vocab) - 1


@pytest.mark.parametrize("kind", ["GPT2BPETokenizer", "BertWordPieceLowerCase"])
def test_no_files_no_network_one_line(kind, no_network, monkeypatch, tmp_path):
    """No files, no wget, nothing cached: the preflight and the tokenizer (every rank) each
    say in one line which flags to pass."""
    monkeypatch.setattr(megatron_hf_tokenizer, "MEGATRON_CACHE", str(tmp_path))
    monkeypatch.setattr(megatron_hf_tokenizer, "HAVE_WGET", False)
    monkeypatch.setattr(preflight, "_has", lambda package: package != "wget")
    args = fx.tokenizer_args("--tokenizer-type", kind)
    (problem,) = preflight.problems(args)
    assert "\n" not in problem and "--vocab-file" in problem, problem
    assert ("--merge-file" in problem) == (kind == "GPT2BPETokenizer")
    with pytest.raises(ModuleNotFoundError) as raised:
        build_tokenizer(args)
    assert "\n" not in str(raised.value) and "--vocab-file" in str(raised.value)
