"""Variants of upstream's recipes that ``pretrain_gpt.py`` (``gpt_entry``) used to refuse and now
builds as upstream's own entry does, or refuses only where Transformer Engine is absent, naming the
way out:

- ``--fim-data``: upstream's ``GPTFIMDataset`` with ``GPTFIMDatasetConfig`` (megatron-core 0.19.2
  ships both, under ``megatron/training/datasets``), built here on CPU from a small indexed corpus;
- ``--experimental-attention-variant``: upstream's TE-only block spec (its backend asserts
  ``transformer_impl == 'transformer_engine'``), so refused without TE layers;
- ``--fp8-format``/``--fp4-format`` without TE: upstream's layers would silently train without
  them (``fp8_utils`` hands out a null context); refused, pointing at ``--bf16``.
"""

import argparse

import numpy as np
import pytest
import torch
from megatron.core.datasets.gpt_dataset import GPTDataset
from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder
from megatron.training.datasets.fim_dataset import GPTFIMDataset, GPTFIMDatasetConfig

from megatron.training import arguments, gpt_entry

SPECIALS = ["<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>", "<|endoftext|>"]
FIRST_SPECIAL = 256  # bytes 0..255 are the text, the FIM tokens follow


class _Bytes:
    """The text side of a byte tokenizer, with the calls upstream's FIM dataset makes."""

    def tokens_to_ids(self, tokens):
        return [FIRST_SPECIAL + SPECIALS.index(t) for t in tokens]

    def text_to_ids(self, text):
        return list(text.encode("latin-1"))

    def ids_to_text(self, ids, remove_special_tokens=False):
        return bytes(int(i) for i in ids if i < FIRST_SPECIAL).decode("latin-1")


class _Tokenizer:
    unique_identifiers = {"class": "fim-test-bytes"}  # the dataset cache's key
    _tokenizer = _Bytes()
    vocab_size = FIRST_SPECIAL + len(SPECIALS)
    eod = FIRST_SPECIAL + SPECIALS.index("<|endoftext|>")
    pad = FIRST_SPECIAL + SPECIALS.index("<fim_pad>")


def _corpus(prefix: str) -> None:
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=DType.optimal_dtype(512))
    rng = np.random.default_rng(0)
    for _ in range(40):
        text = rng.integers(ord("a"), ord("z") + 1, size=int(rng.integers(20, 60)))
        builder.add_item(torch.tensor([*text, _Tokenizer.eod]))
        builder.end_document()
    builder.finalize(prefix + ".idx")


def _args(prefix: str, cache: str, *extra: str) -> argparse.Namespace:
    parser = arguments.add_megatron_arguments(argparse.ArgumentParser())
    argv = ["--data-path", prefix, "--split", "100,0,0", "--seq-length", "32"]
    argv += ["--data-cache-path", cache, *extra]
    args = parser.parse_args(argv)
    args.data_parallel_size = 1  # validate_args's, for one process
    return args


def _train_set(monkeypatch, args):
    monkeypatch.setattr(gpt_entry, "get_args", lambda: args)
    monkeypatch.setattr(gpt_entry, "get_tokenizer", _Tokenizer)
    monkeypatch.setattr(gpt_entry, "_reads_data", lambda vp_stage=None: True)
    train, _, _ = gpt_entry.datasets_provider([16, 0, 0])
    return train


def test_fim_data_builds_upstreams_fim_dataset(tmp_path, monkeypatch):
    prefix = str(tmp_path / "corpus")
    _corpus(prefix)
    fim = ("--fim-data", "--fim-rate", "1.0", "--fim-spm-rate", "0.5")
    args = _args(prefix, str(tmp_path / "fim"), *fim)
    monkeypatch.setattr(gpt_entry, "get_tokenizer", _Tokenizer)
    config = gpt_entry.dataset_config(args)
    assert isinstance(config, GPTFIMDatasetConfig)
    assert (config.fim_rate, config.fim_spm_rate) == (1.0, 0.5)
    assert config.fim_extra_tokens["prefix"] == "<fim_prefix>"  # upstream's defaults
    train = _train_set(monkeypatch, args)
    assert type(train) is GPTFIMDataset and len(train) >= 16
    sentinels = set(_Tokenizer._tokenizer.tokens_to_ids(SPECIALS[:3]))
    for i in range(4):  # fim rate 1: every sample is rearranged around the three sentinels
        tokens = set(train[i]["tokens"].tolist()) | set(train[i]["labels"].tolist())
        assert sentinels <= tokens, (i, sorted(tokens))
    # negative control: the same corpus without --fim-data has no sentinel in it
    plain = _train_set(monkeypatch, _args(prefix, str(tmp_path / "plain")))
    assert type(plain) is GPTDataset
    assert not sentinels & set(plain[0]["tokens"].tolist())


def _entry_args(impl, **given):
    names = {name: None for _, name, _ in gpt_entry.NEEDS_TE}
    return argparse.Namespace(transformer_impl=impl, **{**names, **given})


@pytest.mark.parametrize(
    "given, flag",
    [
        ({"fp8": "hybrid"}, "--fp8-format"),
        ({"fp4": "nvfp4"}, "--fp4-format"),
        ({"experimental_attention_variant": "gated_delta_net"}, "--experimental-attention-variant"),
    ],
)
def test_te_only_features_are_refused_without_te_naming_the_way_out(given, flag):
    (message,) = gpt_entry.te_refusals(_entry_args("local", **given), have_te=False)
    assert message.startswith(f"{flag} needs Transformer Engine, which is not installed")
    assert ("--bf16" if "fp" in flag else "--transformer-impl transformer_engine") in message
    # with TE and its layers, nothing is refused: upstream builds them
    assert gpt_entry.te_refusals(_entry_args("transformer_engine", **given), have_te=True) == []
    assert gpt_entry.te_refusals(_entry_args("local"), have_te=False) == []  # not given


def test_experimental_attention_needs_te_layers_even_with_te():
    args = _entry_args("local", experimental_attention_variant="dsa")
    (message,) = gpt_entry.te_refusals(args, have_te=True)
    assert "--transformer-impl local given" in message
    # fp8 with TE installed and local layers: upstream's business, not refused here
    assert gpt_entry.te_refusals(_entry_args("local", fp8="hybrid"), have_te=True) == []


def test_experimental_attention_builds_upstreams_block_spec(monkeypatch):
    """With TE the model takes upstream's block spec for the variant, as upstream's gpt_builder
    does (the spec itself needs TE, so it is stood in for here)."""
    calls = []

    def spec(config, vp_stage):
        calls.append((config, vp_stage))
        return "upstream's spec"

    monkeypatch.setattr(
        gpt_entry, "get_transformer_block_with_experimental_attention_variant_spec", spec
    )
    args = argparse.Namespace(experimental_attention_variant="gated_delta_net", num_experts=None)
    assert gpt_entry._layer_spec(args, "config", True, 1) == "upstream's spec"
    assert calls == [("config", 1)]
