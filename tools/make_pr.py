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

import ast
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import fork
from pr_series import (  # noqa: F401  (FORK_ONLY, SERIES, UNSENT: tests/meta/test_make_pr.py)
    FORK_FORM_ONLY,
    FORK_ONLY,
    FORK_TESTS,
    MAIN_CHECKOUT_ENV,
    MAIN_PIN,
    PR_FORM,
    PRS,
    SERIES,
    UNSENT,
)

ROOT = Path(__file__).resolve().parent.parent
HEADER = "# Copyright (c) 2025, NVIDIA CORPORATION. All rights reserved.\n\n"
AUTHOR = ["-c", "user.name=megatron-muon", "-c", "user.email=megatron-muon@users.noreply"]
SOURCES = {"docs/source/api-guide/muon.md": ROOT / "docs" / "muon.md"}
DESCRIPTIONS = ROOT / "docs" / "pull_requests.md"


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


def _commit_all(repo: Path, commit: tuple) -> None:
    subject, body, files, patches = commit
    for rel in files:
        if rel not in FORK_FORM_ONLY:
            _write_ours(repo, rel)
    for name in patches:
        _git(repo, "apply", "--whitespace=nowarn", str(fork.PATCH_DIR / PR_FORM.get(name, name)))
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", f"{subject}\n\n{body}{tests_line(commit)}")


def tests_line(commit: tuple) -> str:
    """The commit message's last paragraph: the tests that cover it (those it carries, in
    upstream's form, and the fork's suite's)."""
    carried = [rel for rel in commit[2] if rel.startswith("tests/unit_tests/")]
    fork_tests = FORK_TESTS.get(id(commit))
    parts = [f"Tests: {', '.join(carried)} (this PR; upstream's Utils)"] if carried else []
    if fork_tests:
        parts.append(f"Tested in megatron-muon by {fork_tests}")
    return "\n\n" + "\n".join(parts) if parts else ""


def _reset(repo: Path, rev: str) -> None:
    _git(repo, "checkout", "-q", "-f", "--detach", rev)
    _git(repo, "clean", "-fdxq")


def series_dir(out: Path, index: int, slug: str) -> Path:
    return out / f"{index + 1:02d}-{slug}"


def build_series(out: Path) -> dict[str, list[Path]]:
    """Write each pull request of ``PRS`` into ``out/NN-slug/`` (``out`` emptied first), every
    one built alone on the pristine tree and checked (``git am`` on the pristine tree gives the
    built tree); return {slug: its patch files in order}."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    written = {}
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "megatron-lm"
        init_pristine(repo)
        base = _git(repo, "rev-parse", "HEAD").strip()
        for index, (slug, commits, _) in enumerate(PRS):
            _reset(repo, base)
            for commit in commits:
                _commit_all(repo, commit)
            tree = _git(repo, "rev-parse", "HEAD^{tree}").strip()
            dest = series_dir(out, index, slug)
            _git(repo, "format-patch", "-q", "-o", str(dest), f"{base}..HEAD")
            written[slug] = sorted(dest.glob("*.patch"))
            _reset(repo, base)
            _git(repo, "am", "-q", *map(str, written[slug]))
            got = _git(repo, "rev-parse", "HEAD^{tree}").strip()
            if got != tree:
                raise RuntimeError(f"make_pr: git am of {slug} gives tree {got}, not {tree}")
            check_parses(repo, base)
            write_description(dest, slug, commits)
    return written


def check_parses(repo: Path, base: str) -> None:
    """Every Python file the commits since ``base`` touch parses (a hunk that lands in the wrong
    place shows as a syntax error)."""
    names = _git(repo, "diff", "--name-only", "--diff-filter=AM", base, "HEAD").split()
    for name in names:
        if name.endswith(".py"):
            ast.parse((repo / name).read_text(), filename=name)


def description(slug: str) -> str:
    """The pull request's description: its section of docs/pull_requests.md."""
    text = DESCRIPTIONS.read_text()
    match = re.search(rf"^## `{re.escape(slug)}`\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    if not match:
        raise RuntimeError(f"make_pr: docs/pull_requests.md has no section ## `{slug}`")
    return match.group(1).strip()


def write_description(dest: Path, slug: str, commits: list) -> None:
    lines = [f"# {slug}", "", description(slug), "", "## Commits", ""]
    lines += [f"- {subject}" for subject, *_ in commits]
    (dest / "DESCRIPTION.md").write_text("\n".join(lines) + "\n")


def apply_series(repo: Path, patches: list[Path]) -> None:
    """A fresh pristine repository at ``repo`` with ``patches`` applied by ``git am``."""
    init_pristine(repo)
    _git(repo, "am", "-q", *map(str, patches))


def check_main(checkout: Path, written: dict[str, list[Path]]) -> dict[str, str]:
    """``git am`` of each series onto Megatron-LM main at ``MAIN_PIN`` (``checkout``: a clone
    holding that commit, work tree or bare); {slug: '' where it applied, else git's error}."""
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "main"
        clone = ["git", "clone", "-q", "--shared", "--no-checkout", str(checkout), str(repo)]
        subprocess.run(clone, check=True, capture_output=True)
        for slug, patches in written.items():
            _reset(repo, MAIN_PIN)
            done = subprocess.run(
                ["git", *AUTHOR, "am", "-q", *map(str, patches)],
                cwd=repo,
                capture_output=True,
                text=True,
            )
            results[slug] = "" if done.returncode == 0 else (done.stdout + done.stderr).strip()
            if done.returncode:
                _git(repo, "am", "--abort")
            else:
                check_parses(repo, MAIN_PIN)
    return results


def main(argv: list[str]) -> int:
    out = Path(argv[0]) if argv else ROOT / "build" / "pr"
    written = build_series(out)
    print(
        f"{len(written)} pull requests ({sum(map(len, written.values()))} patches) for "
        f"Megatron-LM core_v{fork.UPSTREAM_VERSION} in {out}, each checked alone with git am "
        "on a fresh pristine tree"
    )
    checkout = os.environ.get(MAIN_CHECKOUT_ENV)
    if not checkout:
        print(
            f"(set {MAIN_CHECKOUT_ENV}=<Megatron-LM clone> to check them on main {MAIN_PIN[:10]})"
        )
        return 0
    results = check_main(Path(checkout), written)
    expected = {slug: main for slug, _, main in PRS}
    bad = []
    for slug, error in results.items():
        want = expected[slug] is True
        state = "applies" if not error else "does not apply"
        note = "" if want else f" (expected not to: {expected[slug]})"
        print(f"  main {MAIN_PIN[:10]}: {slug}: {state}{note}")
        if want and error:
            bad.append(f"{slug}:\n{error}")
    ok = sum(not e for e in results.values())
    print(f"{ok} of {len(results)} pull requests apply to Megatron-LM main {MAIN_PIN[:10]}")
    if bad:
        print("expected to apply but do not:\n" + "\n".join(bad), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
