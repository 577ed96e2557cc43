"""``pretrain_gpt.py --help`` on upstream's loop (base megatron-core 0.19.2), as a user runs it.

Pristine 0.19.2's ``--help`` raises: upstream builds the help of TransformerConfig's fields from
their docstrings, and ``--moe-paged-stash-buffer-size-factor-cuda``'s says "10%" (argparse
formats help with ``%``). Patch ``0050-training-help-percent-in-docstrings`` escapes the
``%`` of docstring help; negative control: without it this test fails with
``ValueError: unsupported format character ')'`` (checked by hand: patch removed, fork
re-assembled).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.e2e,
]


@pytest.mark.timeout(600)
def test_help_lists_upstreams_flags_and_ours(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(ROOT / "pretrain_gpt.py"), "--help"]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, done.stderr[-3000:]
    text = " ".join(done.stdout.split())  # argparse wraps lines at the terminal's width
    assert text.startswith("usage: ")  # prog: gpt_entry.py (pretrain_gpt.py runs it as main)
    # the flag whose help held the bare '%', printed as its docstring says it
    assert "--moe-paged-stash-buffer-size-factor-cuda" in text and "1.10 = 10%)" in text
    for flag in ("--optimizer", "--use-distributed-optimizer", "--muon-nesterov", "--save"):
        assert f" {flag} " in text, flag  # upstream's
    for flag in ("--muon-impl {emerging,megatron_muon}", "--muon-matched-adamw-rms"):
        assert flag in text, flag  # ours (patch 0030)
    assert "megatron-muon:" in text
