"""The fork build: the patch series applies to the pristine pinned archive; failures are named."""

import importlib.util
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
    """patches/ against the pinned archive, with git apply and no fuzz."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "fork.py"), "check"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    count = len(list((ROOT / "patches").glob("*.patch")))
    assert count >= 20
    assert f"{count} patches apply cleanly to megatron_core-0.19.2.tar.gz" in result.stdout


def test_the_base_is_0192_and_ours_replace_two_upstream_files(fork):
    assert (fork.UPSTREAM_VERSION, fork.FORK_DIR, fork.PATCH_DIR) == (
        "0.19.2",
        ROOT / "build/fork",
        ROOT / "patches",
    )
    assert fork.ARCHIVE_SHA256 == "de643eee32007a7504ad52f061103fe7432503603b6321c16c861eb67dbd3353"
    assert fork.OVERLAY == ("megatron",)
    assert fork.REPLACED == (
        "megatron/core/optimizer/muon.py",
        "megatron/core/optimizer/qk_clip.py",
    )


def test_a_file_of_ours_named_as_upstreams_is_refused(fork, tmp_path, monkeypatch):
    """Negative control of REPLACED: any other clash with an upstream file is an error."""
    ours = tmp_path / "megatron" / "training"
    ours.mkdir(parents=True)
    (ours / "training.py").write_text("")  # upstream's loop
    tree = tmp_path / "tree" / "megatron" / "training"
    tree.mkdir(parents=True)
    (tree / "training.py").write_text("upstream")
    monkeypatch.setattr(fork, "ROOT", tmp_path)
    monkeypatch.setattr(fork, "FORK_DIR", tmp_path / "tree")
    monkeypatch.setattr(fork, "patches", lambda: [])
    with pytest.raises(fork.ForkError, match="would replace upstream's file: patch it"):
        fork.link_overlay()
    assert (tree / "training.py").read_text() == "upstream"


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
    # a folder upstream lacks is linked whole (our package), a file beside upstream's by itself
    for rel in (
        "megatron/core/optimizer/megatron_muon/newton_schulz.py",
        "megatron/core/optimizer/muon.py",
    ):
        linked = fork.FORK_DIR / rel
        assert linked.resolve() == ROOT / rel and linked.resolve() != linked.absolute()


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
