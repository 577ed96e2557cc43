"""The fork build: the patch series applies to the pristine pinned archive; failures are named."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def fork():
    spec = importlib.util.spec_from_file_location("fork_under_test", ROOT / "tools" / "fork.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_patch_series_applies_to_pristine_archive():
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "fork.py"), "check"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert "apply cleanly to megatron_core-0.16.1.tar.gz" in result.stdout


def test_next_base_series_applies_to_its_pristine_archive():
    """The staged 0.19.2 series (patches/0.19.2/) against its own pinned archive, with git apply
    and no fuzz; `make test` fetches that archive (hash-checked, 2 MB)."""
    env = dict(os.environ, MEGATRON_MUON_BASE="0.19.2")
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "fork.py"), "check"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    count = len(list((ROOT / "patches/0.19.2").glob("*.patch")))
    assert count >= 18  # 16 refreshed and ours of 0030-0031, 0050-0051
    assert f"{count} patches apply cleanly to megatron_core-0.19.2.tar.gz" in result.stdout


def test_default_base_is_0161_and_the_next_is_selected_by_env(fork):
    assert (fork.BASE, fork.FORK_DIR, fork.PATCH_DIR) == (
        "0.16.1",
        ROOT / "build/fork",
        ROOT / "patches",
    )
    assert fork.OVERLAY == ("megatron",)
    sha, series, tree, overlay = fork.BASES["0.19.2"]
    assert sha == "de643eee32007a7504ad52f061103fe7432503603b6321c16c861eb67dbd3353"
    assert (series, tree) == (ROOT / "patches/0.19.2", ROOT / "build/fork-0.19.2")
    # upstream's megatron/training is kept; of ours only pretrain_gpt.py's entry on its loop,
    # our Muon's flags, the seed's recipe and the built-in corpora
    assert overlay == (
        "megatron/core",
        "megatron/training/cpu_mode.py",
        "megatron/training/cpu_loop.py",
        "megatron/training/gpt_entry.py",
        "megatron/training/muon_args.py",
        "megatron/training/checkpoint_origin.py",
        "megatron/training/muon_recipe.py",
        "megatron/training/corpus.py",
        "megatron/training/shakespeare.py",
    )


def test_patched_tree_is_what_python_imports(fork):
    import megatron.core

    assert Path(megatron.core.__file__).resolve() == fork.FORK_DIR / "megatron/core/__init__.py"
    for patch in fork.patches():  # every line a patch adds is in the tree that is imported
        target = None
        for line in patch.read_text().splitlines():
            if line.startswith("+++ b/"):
                target = (fork.FORK_DIR / line[6:].strip()).read_text()
            elif line.startswith("+") and not line.startswith("+++"):
                assert line[1:] in target, f"{patch.name}: {line!r} missing from the tree"


def test_overlay_files_are_linked_live(fork):
    ours = ROOT / "megatron/core/optimizer/newton_schulz.py"
    linked = fork.FORK_DIR / "megatron/core/optimizer/newton_schulz.py"
    assert linked.is_symlink() and linked.resolve() == ours


def test_wrong_hash_is_refused_with_the_file_named(fork, tmp_path):
    bad = tmp_path / fork.ARCHIVE
    bad.write_bytes(b"not the archive")
    with pytest.raises(fork.ForkError, match=f"{bad}: sha256 .* does not match the pinned"):
        fork.verify(bad)


def test_missing_archive_says_how_to_fetch(fork, tmp_path):
    with pytest.raises(fork.ForkError, match="is missing: run `python tools/fork.py fetch`"):
        fork.verify(tmp_path / fork.ARCHIVE)


def test_patch_that_does_not_apply_names_the_patch(fork, tmp_path, monkeypatch):
    patches = tmp_path / "patches"
    patches.mkdir()
    (patches / "0099-broken.patch").write_text(
        "--- a/megatron/core/package_info.py\n+++ b/megatron/core/package_info.py\n"
        "@@ -1,1 +1,1 @@\n-this line is not upstream's\n+neither is this\n"
    )
    monkeypatch.setattr(fork, "PATCH_DIR", patches)
    tree = tmp_path / "tree"
    fork.extract(tree)
    with pytest.raises(fork.ForkError, match="patch 0099-broken.patch does not apply"):
        fork.apply_patches(tree)
