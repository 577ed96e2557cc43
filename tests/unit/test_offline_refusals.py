"""What an air-gapped node lacks is named in one line before any rank or worker starts
(``preflight.problems``, ``gpt_entry``'s TE-only refusals), naming the flag and the way out:
a tokenizer's package or file, a hub name offline and not cached, einops for Megatron-FSDP,
selective recompute of ``layernorm``/``mla_up_proj`` without Transformer Engine (upstream's
CheckpointWithoutOutput reads TE's fp8 state: ``NameError: FP8GlobalStateManager`` at the first
forward), and ``--moe-permute-fusion``/``--fine-grained-activation-offloading`` without TE
(upstream raises a traceback). Flags are upstream's parser's (``add_megatron_arguments``).
Packages are faked absent (``preflight._has``). One launch of ``pretrain_gpt.py`` shows the line
and exit status 2 on the real entry (~15 s of it on 2 loaded cores; the rest < 1 s each).
"""

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron.training import arguments, gpt_entry, preflight

ROOT = Path(__file__).resolve().parents[2]


def _flags(*argv):
    parser = arguments.add_megatron_arguments(argparse.ArgumentParser())
    return parser.parse_args([str(a) for a in argv])


@pytest.fixture
def tiny(tmp_path):
    (tmp_path / "sp.model").write_bytes(b"x")
    (tmp_path / "vocab.json").write_text("{}")
    (tmp_path / "merges.txt").write_text("#version: 0.2\n")
    return tmp_path


FILES = ["--vocab-file", "{d}/vocab.json", "--merge-file", "{d}/merges.txt"]
CASES = [  # (flags, packages absent, offline, the line's words); {d}: a folder with files
    (
        ["--use-megatron-fsdp", *FILES],
        {"einops"},
        False,
        "--use-megatron-fsdp needs the package einops",
    ),
    (
        ["--num-distributed-optimizer-instances", "2", *FILES],
        {"einops"},
        False,
        "--num-distributed-optimizer-instances > 1 needs the package einops",
    ),
    (
        ["--vocab-file", "{d}/vocab.json", "--merge-file", "{d}/merges.txt"],
        {"transformers"},
        False,
        "--tokenizer-type GPT2BPETokenizer needs the package transformers",
    ),
    (
        ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", "{d}/sp.model"],
        {"sentencepiece"},
        False,
        "needs the package sentencepiece",
    ),
    (
        ["--tokenizer-type", "TikTokenizer", "--tokenizer-model", "{d}/none.json"],
        set(),
        False,
        "--tokenizer-type TikTokenizer needs --tokenizer-model FILE (its model file): no such",
    ),
    (["--vocab-file", "{d}/none.json"], set(), False, "--vocab-file {d}/none.json: no such file"),
    (["--merge-file", "{d}/merges.txt"], {"wget"}, False, "needs --vocab-file (GPT-2's"),
    (
        ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "org/not-cached"],
        set(),
        True,
        "--tokenizer-model org/not-cached is not a local path and HF_HUB_OFFLINE is set",
    ),
]
FINE = [  # nothing to say
    (["--vocab-file", "{d}/vocab.json", "--merge-file", "{d}/merges.txt"], {"wget"}, True),
    (["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "{d}"], {"wget"}, True),
    (["--tokenizer-type", "NullTokenizer", "--vocab-size", "8"], {"transformers", "wget"}, True),
    (["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "org/name"], set(), False),
]


def _problems(monkeypatch, tiny, argv, absent, offline):
    monkeypatch.setattr(preflight, "_has", lambda package: package not in absent)
    if offline:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    else:
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tiny / "hf_home"))  # an empty cache
    return preflight.problems(_flags(*[a.format(d=tiny) for a in argv]))


@pytest.mark.parametrize("argv, absent, offline, words", CASES)
def test_named_in_one_line(monkeypatch, tiny, argv, absent, offline, words):
    (problem,) = _problems(monkeypatch, tiny, argv, absent | {"wget"}, offline)
    assert words.format(d=tiny) in problem and "\n" not in problem, problem


@pytest.mark.parametrize("argv, absent, offline", FINE)
def test_nothing_to_say(monkeypatch, tiny, argv, absent, offline):
    assert _problems(monkeypatch, tiny, argv, absent, offline) == []


RECOMPUTE = [  # (--recompute-modules, refused without TE)
    (["layernorm", "mla_up_proj", "mlp"], ["layernorm", "mla_up_proj"]),
    (["layernorm"], ["layernorm"]),
    (["core_attn", "mlp", "moe", "shared_experts"], []),
]


@pytest.mark.parametrize("modules, refused", RECOMPUTE)
def test_recompute_modules_that_need_te(modules, refused):
    argv = ["--transformer-impl", "local", "--recompute-granularity", "selective"]
    args = _flags(*argv, "--recompute-modules", *modules)
    found = gpt_entry.te_refusals(args, have_te=False)
    if not refused:
        assert found == []
        return
    (message,) = found
    assert message.startswith(f"--recompute-modules {' '.join(refused)} needs Transformer Engine")
    assert "drop them from --recompute-modules" in message
    assert gpt_entry.te_refusals(args, have_te=True) == []  # with TE upstream's path runs
    full = _flags("--transformer-impl", "local", "--recompute-modules", *modules)
    assert gpt_entry.te_refusals(full, have_te=False) == []  # modules count with selective only


def test_the_recompute_refused_does_crash_without_te():
    """Why the refusal: upstream's CheckpointWithoutOutput (``fp8=False`` by default, stored as
    ``fp8 is not None``, so True) asks TE's FP8GlobalStateManager, a name bound only where TE
    imports. Should upstream fix it, this fails and the refusal can go."""
    import torch

    from megatron.core import tensor_parallel

    def recompute():
        x = torch.ones(2, requires_grad=True)
        return tensor_parallel.CheckpointWithoutOutput().checkpoint(lambda t: t * 2, x)

    if preflight._has("transformer_engine"):  # then the entry refuses nothing (tested above)
        assert recompute().tolist() == [2.0, 2.0]
        return
    with pytest.raises(NameError, match="FP8GlobalStateManager"):
        recompute()


TE_ONLY = [  # (flag, args attribute, value, refused with TE installed but local layers)
    ("--moe-permute-fusion", "moe_permute_fusion", True, False),
    ("--fine-grained-activation-offloading", "fine_grained_activation_offloading", True, True),
]


@pytest.mark.parametrize("flag, name, value, layers_only", TE_ONLY)
def test_te_only_flags_of_upstreams_recipes(flag, name, value, layers_only):
    """Upstream raises for these at config time with a traceback (fused permutation "not
    available", offloading "only supported with transformer_engine"); the entry names the flag
    and the way out in one line."""
    args = _flags("--transformer-impl", "local")
    setattr(args, name, value)
    (message,) = gpt_entry.te_refusals(args, have_te=False)
    assert message.startswith(f"{flag} needs Transformer Engine") and "drop it" in message
    assert bool(gpt_entry.te_refusals(args, have_te=True)) == layers_only
    args.transformer_impl = "transformer_engine"
    assert gpt_entry.te_refusals(args, have_te=True) == []


def test_pretrain_gpt_refuses_before_any_process_group(tmp_path):
    """The entry itself: no vocabulary files (and no wget), a TE-only recompute module: one
    line, exit status 2, before torch.distributed starts (no rendezvous variables are set)."""
    argv = ["--mock-data", "--transformer-impl", "local", "--num-layers", "2"]
    argv += ["--recompute-granularity", "selective", "--recompute-modules", "layernorm"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-W", "ignore", str(ROOT / "pretrain_gpt.py"), *argv]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    errors = [line for line in done.stderr.splitlines() if "pretrain_gpt.py: error" in line]
    assert done.returncode == 2, done.stderr[-3000:]
    (line,) = errors
    assert "needs --vocab-file and --merge-file" in line
    assert "Traceback" not in done.stderr
