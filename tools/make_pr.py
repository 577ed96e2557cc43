#!/usr/bin/env python3
"""Export our changes as a ``git format-patch`` series for upstream Megatron-LM.

    python tools/make_pr.py [OUT]     # default OUT: build/pr (also `make pr`)

Megatron-LM itself cannot be cloned here (no network but package registries), so the series is
built on a git repository initialized from the pristine megatron-core archive's ``megatron/``
tree: the same paths as in Megatron-LM at its tag (core_v0.19.2). Each commit adds our files
(with the NVIDIA header that upstream's copyright check expects, added here) and applies our
patches, in review order (``tools/pr_series.py``); the series is then checked: ``git am`` on a
fresh pristine tree gives the same tree. ``OUT/*.patch`` apply to a Megatron-LM checkout with
``git am``.

The series carries our patches to upstream's ``megatron/core`` and ``megatron/training`` and the
files of ours linked into them. Benchmarks never travel. Only the standard library and git are
used.
"""

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import fork
from pr_series import SERIES, UNSENT  # noqa: F401  (UNSENT: tests/meta/test_make_pr.py)

ROOT = Path(__file__).resolve().parent.parent
HEADER = "# Copyright (c) 2025, NVIDIA CORPORATION. All rights reserved.\n\n"
AUTHOR = ["-c", "user.name=megatron-muon", "-c", "user.email=megatron-muon@users.noreply"]
SOURCES = {"docs/source/api-guide/muon.md": ROOT / "docs" / "muon.md"}


def _git(repo: Path, *args: str) -> str:
    cmd = ["git", *AUTHOR, *args]
    done = subprocess.run(cmd, cwd=repo, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)} failed in {repo}:\n{done.stderr}")
    return done.stdout


def init_pristine(repo: Path) -> None:
    """A git repository holding the pristine archive's megatron/ tree, one commit."""
    fork.extract(repo)
    _git(repo, "init", "-q", "-b", f"core_v{fork.UPSTREAM_VERSION}")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", f"megatron-core {fork.UPSTREAM_VERSION} (pristine archive)")


def _write_ours(repo: Path, rel: str) -> None:
    source = SOURCES.get(rel, ROOT / rel)
    text = source.read_text()
    if rel.endswith(".py") and not text.startswith("# Copyright"):
        text = HEADER + text
    dest = repo / rel
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(text)


def build_series(out: Path) -> list[Path]:
    """Write the series into ``out`` (emptied first) and check it (``check_series``); return the
    patch files in order."""
    commits, patch_dir = SERIES, fork.PATCH_DIR
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "megatron-lm"
        init_pristine(repo)
        for subject, body, files, patches in commits:
            for rel in files:
                _write_ours(repo, rel)
            for name in patches:
                _git(repo, "apply", "--whitespace=nowarn", str(patch_dir / name))
            _git(repo, "add", "-A")
            _git(repo, "commit", "-q", "-m", f"{subject}\n\n{body}")
        _git(repo, "format-patch", "-q", "-o", str(out), "HEAD~" + str(len(commits)))
        written = sorted(out.glob("*.patch"))
        check_series(written, _git(repo, "rev-parse", "HEAD^{tree}").strip())
    return written


def apply_series(repo: Path, patches: list[Path]) -> None:
    """A fresh pristine repository at ``repo`` with ``patches`` applied by ``git am``."""
    init_pristine(repo)
    _git(repo, "am", "-q", *map(str, patches))


def check_series(patches: list[Path], tree: str) -> None:
    """``git am`` of ``patches`` on a fresh pristine tree gives ``tree`` (the built one)."""
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "megatron-lm"
        apply_series(repo, patches)
        got = _git(repo, "rev-parse", "HEAD^{tree}").strip()
    if got != tree:
        raise RuntimeError(f"make_pr: git am of the series gives tree {got}, not {tree}")


def main(argv: list[str]) -> int:
    out = Path(argv[0]) if argv else ROOT / "build" / "pr"
    written = build_series(out)
    print(
        f"{len(written)} patches for Megatron-LM core_v{fork.UPSTREAM_VERSION} in {out} (git am; "
        "checked on a fresh pristine tree)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
