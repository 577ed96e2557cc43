#!/usr/bin/env python3
"""Export our changes as a ``git format-patch`` series for upstream Megatron-LM.

    python tools/make_pr.py [OUT]     # default OUT: build/pr (also `make pr`)
    MEGATRON_MUON_BASE=0.19.2 python tools/make_pr.py [OUT]   # build/pr-0.19.2 (make pr BASE=)

Megatron-LM itself cannot be cloned here (no network but package registries), so the series is
built on a git repository initialized from the pristine megatron-core archive's ``megatron/``
tree of the base (``tools/fork.py`` ``BASES``): the same paths as in Megatron-LM at its tag
(core_v0.16.1, core_v0.19.2). Each commit adds our files (with the NVIDIA header that upstream's
copyright check expects, added here) and applies our patches, in review order
(``tools/pr_series.py``); the series is then checked: ``git am`` on a fresh pristine tree gives
the same tree. ``OUT/*.patch`` apply to a Megatron-LM checkout with ``git am``.

On 0.16.1 the series is megatron.core's alone: our training stack stays this project's. On
0.19.2 upstream's ``megatron/training`` is in the archive, and the series carries our patches to
it and the files of ours the base links into it. Benchmarks never travel. Only the standard
library and git are used.
"""

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from pr_series import SERIES, UNSENT

ROOT = Path(__file__).resolve().parent.parent
HEADER = "# Copyright (c) 2025, NVIDIA CORPORATION. All rights reserved.\n\n"
AUTHOR = ["-c", "user.name=megatron-muon", "-c", "user.email=megatron-muon@users.noreply"]
DEFAULT_BASE = "0.16.1"
SOURCES = {"docs/source/api-guide/muon.md": ROOT / "docs" / "muon.md"}


def _fork(base: str):
    """tools/fork.py as it is for ``base`` (it reads MEGATRON_MUON_BASE when loaded)."""
    spec = importlib.util.spec_from_file_location(f"fork_for_pr_{base}", ROOT / "tools" / "fork.py")
    module = importlib.util.module_from_spec(spec)
    saved = os.environ.get("MEGATRON_MUON_BASE")
    os.environ["MEGATRON_MUON_BASE"] = base
    try:
        spec.loader.exec_module(module)
    finally:
        if saved is None:
            del os.environ["MEGATRON_MUON_BASE"]
        else:
            os.environ["MEGATRON_MUON_BASE"] = saved
    return module


def series(base: str = DEFAULT_BASE) -> list:
    """The commits of ``base``'s series: (subject, body, our files, our patches)."""
    if base not in SERIES:
        raise ValueError(f"make_pr: no series for base {base!r}: known bases are {list(SERIES)}")
    return SERIES[base]


def unsent(base: str = DEFAULT_BASE) -> list:
    """Files of ours that ``base`` links in but its series does not send (``UNSENT``)."""
    return UNSENT[base]


def _git(repo: Path, *args: str) -> str:
    cmd = ["git", *AUTHOR, *args]
    done = subprocess.run(cmd, cwd=repo, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)} failed in {repo}:\n{done.stderr}")
    return done.stdout


def init_pristine(repo: Path, base: str = DEFAULT_BASE) -> None:
    """A git repository holding the pristine ``base`` archive's megatron/ tree, one commit."""
    _fork(base).extract(repo)
    _git(repo, "init", "-q", "-b", f"core_v{base}")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", f"megatron-core {base} (pristine archive, megatron/)")


def _write_ours(repo: Path, rel: str) -> None:
    source = SOURCES.get(rel, ROOT / rel)
    text = source.read_text()
    if rel.endswith(".py") and not text.startswith("# Copyright"):
        text = HEADER + text
    dest = repo / rel
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(text)


def build_series(out: Path, base: str = DEFAULT_BASE) -> list[Path]:
    """Write ``base``'s series into ``out`` (emptied first) and check it (``check_series``);
    return the patch files in order."""
    commits, patch_dir = series(base), _fork(base).PATCH_DIR
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "megatron-lm"
        init_pristine(repo, base)
        for subject, body, files, patches in commits:
            for rel in files:
                _write_ours(repo, rel)
            for name in patches:
                _git(repo, "apply", "--whitespace=nowarn", str(patch_dir / name))
            _git(repo, "add", "-A")
            _git(repo, "commit", "-q", "-m", f"{subject}\n\n{body}")
        _git(repo, "format-patch", "-q", "-o", str(out), "HEAD~" + str(len(commits)))
        written = sorted(out.glob("*.patch"))
        check_series(written, base, _git(repo, "rev-parse", "HEAD^{tree}").strip())
    return written


def apply_series(repo: Path, patches: list[Path], base: str = DEFAULT_BASE) -> None:
    """A fresh pristine ``base`` repository at ``repo`` with ``patches`` applied by ``git am``."""
    init_pristine(repo, base)
    _git(repo, "am", "-q", *map(str, patches))


def check_series(patches: list[Path], base: str, tree: str) -> None:
    """``git am`` of ``patches`` on a fresh pristine tree gives ``tree`` (the built one)."""
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "megatron-lm"
        apply_series(repo, patches, base)
        got = _git(repo, "rev-parse", "HEAD^{tree}").strip()
    if got != tree:
        raise RuntimeError(f"make_pr: git am of the {base} series gives tree {got}, not {tree}")


def main(argv: list[str]) -> int:
    base = os.environ.get("MEGATRON_MUON_BASE") or DEFAULT_BASE
    suffix = "" if base == DEFAULT_BASE else f"-{base}"
    out = Path(argv[0]) if argv else ROOT / "build" / f"pr{suffix}"
    written = build_series(out, base)
    print(
        f"{len(written)} patches for Megatron-LM core_v{base} in {out} (apply with git am; "
        "checked on a fresh pristine tree)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
