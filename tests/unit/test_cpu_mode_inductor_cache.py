"""CPU mode keeps one inductor cache per ATEN_CPU_CAPABILITY (``_inductor_cache_per_capability``).

Why: torch 2.13 reused a kernel generated under avx2 in a run under ``ATEN_CPU_CAPABILITY=default``
and compiled it with that run's flags (``'at::vec' has not been declared``): every e2e launch
failed at its first ``jit_fuser`` fusion. Negative control (by hand): with the call removed from
``cpu_mode.enable``, ``ATEN_CPU_CAPABILITY=default`` pytest tests/e2e/test_upstream_loop.py
after a run without it fails so; with it, both pass.
"""

import os

from torch._inductor.runtime.cache_dir_utils import cache_dir, default_cache_dir

from megatron.training import cpu_mode


def test_a_capability_gets_its_own_cache_folder(monkeypatch):
    default = os.path.abspath(default_cache_dir())
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    cpu_mode._inductor_cache_per_capability()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == default + "_default"
    # the folder torch itself wrote into the environment (its default) counts as no choice
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default)
    cpu_mode._inductor_cache_per_capability()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == default + "_avx2"
    assert cache_dir() == default + "_avx2"  # what inductor now uses


def test_an_explicit_cache_folder_wins(monkeypatch, tmp_path):
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    cpu_mode._inductor_cache_per_capability()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path)


def test_without_a_capability_torchs_folder_stays(monkeypatch):
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    cpu_mode._inductor_cache_per_capability()
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", os.path.abspath(default_cache_dir()))
    cpu_mode._inductor_cache_per_capability()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == os.path.abspath(default_cache_dir())
