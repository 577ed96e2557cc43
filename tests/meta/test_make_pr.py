"""`make pr`: the pull requests, each built alone from the pristine archive, apply with `git am`
to a fresh pristine tree; the Muon one imports; every file tools/fork.py links in and every patch
is in one commit, every commit in a pull request or the fork's own."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import make_pr  # noqa: E402

# A hunk into an upstream file adds a call or a field, not an algorithm (patches/ rule).
MAX_CHANGED_LINES_PER_HUNK = 30


def _hunks_into_upstream_files(patch: str):
    """(file, changed lines) for every hunk that touches a file upstream already has."""
    for part in patch.split("diff --git ")[1:]:
        if "\nnew file mode" in part:
            continue
        name = part.split()[0][2:]
        for hunk in part.split("\n@@")[1:]:
            lines = hunk.split("\n")[1:]
            yield name, sum(1 for x in lines if x[:1] in "+-" and x[:3] not in ("+++", "---"))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """({slug: patch files}, the repository `git am` of the Muon ZeRO-3 PR made from a fresh
    pristine tree: the largest, which carries our Muon whole)."""
    tmp = tmp_path_factory.mktemp("pr")
    written = make_pr.build_series(tmp / "out")
    repo = tmp / "megatron-lm"
    make_pr.apply_series(repo, written["muon-zero3"])
    return written, repo


def test_each_pull_request_applies_alone_in_review_order(built):
    """build_series checks each with `git am` on the pristine tree (and that every file it
    touches parses); here: one patch per commit, in order, and a description each."""
    written, _ = built
    assert list(written) == [slug for slug, *_ in make_pr.PRS]
    for slug, commits, _ in make_pr.PRS:
        patches = written[slug]
        assert len(patches) == len(commits), slug
        for patch, (subject, *_) in zip(patches, commits):
            assert "Subject: [PATCH" in patch.read_text() and subject[:40] in patch.read_text()
        text = (patches[0].parent / "DESCRIPTION.md").read_text()
        assert "How to run" in text and "Why" in text, slug


def test_hunks_into_upstream_files_stay_small_and_our_files_carry_the_header(built):
    written, repo = built
    ours = {rel for _, _, files, _ in make_pr.SERIES for rel in files}  # muon.py: replaced
    for patch in (p for ps in written.values() for p in ps):
        for name, changed in _hunks_into_upstream_files(patch.read_text()):
            if name not in ours:
                assert changed <= MAX_CHANGED_LINES_PER_HUNK, (patch.name, name, changed)
    applied = next(commits for slug, commits, _ in make_pr.PRS if slug == "muon-zero3")
    for rel in {rel for _, _, files, _ in applied for rel in files}:  # the tree `built` holds
        if rel.endswith(".py"):
            assert (repo / rel).read_text().startswith(make_pr.HEADER), rel


def test_only_what_is_ours_to_send_travels(built):
    """megatron/ (less the corpora, UNSENT, and the fork's own commits: CPU stand-ins, the
    triton stand-in), upstream-form unit tests and docs; benchmarks never travel."""
    written, _ = built
    text = "".join(p.read_text() for ps in written.values() for p in ps)
    added = set(re.findall(r"create mode \d+ (\S+)", text))
    allowed = ("megatron/", "tests/unit_tests/", "docs/")
    assert added and all(f.startswith(allowed) for f in added), sorted(added)
    assert not added & set(make_pr.UNSENT)
    fork_only = {f for _, _, files, _ in make_pr.FORK_ONLY for f in files}
    assert {"megatron/training/cpu_mode.py", "megatron/training/cpu_loop.py"} <= fork_only
    assert not added & fork_only
    assert "MagicMock" not in text
    assert "megatron-muon:" not in text  # our marker comments stay out of the hunks sent
    assert "megatron/training/muon_args.py" in added


def test_every_commit_is_in_a_pull_request_or_the_fork_only():
    carried = {id(c) for _, commits, _ in make_pr.PRS for c in commits}
    fork_only = {id(c) for c in make_pr.FORK_ONLY}
    assert not carried & fork_only
    missing = [c[0] for c in make_pr.SERIES if id(c) not in carried | fork_only]
    assert not missing, f"place these commits in a PR of tools/pr_series.py PRS: {missing}"
    for slug, _, main in make_pr.PRS:  # a series not meant for main says why
        assert main is True or (isinstance(main, str) and main), slug


def test_the_applied_tree_imports(built):
    _, repo = built
    code = (
        "import warnings; warnings.simplefilter('ignore')\n"
        "import megatron.core.optimizer.muon as m\n"
        "from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer\n"
        "print(m.__file__, m.TensorParallelMuon.__name__, m.get_megatron_muon_optimizer.__name__,"
        " OptimizerConfig().muon_tp_mode, OptimizerConfig().muon_impl)\n"
        "from megatron.training.muon_args import add_megatron_muon_args as a; print(a.__name__)\n"
    )
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=repo, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    path, *names = done.stdout.split()
    assert Path(path) == repo / "megatron/core/optimizer/muon.py"  # the applied tree, not ours
    expected = ["blockwise", "emerging", "add_megatron_muon_args"]  # upstream's defaults
    assert names == ["TensorParallelMuon", "get_megatron_muon_optimizer", *expected]


def _tracked() -> list:
    """Our files tools/fork.py links in and the patches, new ones too: it links and applies what
    is on disk."""
    paths = [*make_pr.fork.OVERLAY, ":(glob)patches/*.patch"]
    cmd = ["git", "ls-files", "--cached", "--others", "--exclude-standard", *paths]  # as linked
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    return done.stdout.split()


def _unplaced(tracked: list, commits: list) -> list:
    files = {rel for _, _, fs, _ in commits for rel in fs}
    patches = {f"patches/{name}" for *_, ps in commits for name in ps}
    return sorted(set(tracked) - files - patches - set(make_pr.UNSENT))


def test_every_linked_file_and_patch_is_in_the_series():
    """A file added under megatron/, or a patch, must be placed in a commit of the series
    (tools/pr_series.py); each patch in one commit only."""
    tracked = _tracked()
    assert any(name.endswith(".patch") for name in tracked)
    missing = _unplaced(tracked, make_pr.SERIES)
    assert not missing, f"add these to tools/pr_series.py SERIES: {missing}"
    named = [name for *_, ps in make_pr.SERIES for name in ps]
    assert len(named) == len(set(named))


def test_a_patch_in_no_commit_is_found():
    """Negative control of the check above: the series without one of its patches, and a patch
    file no commit names, are both reported."""
    commits = make_pr.SERIES
    dropped = [(s, b, f, ps[1:]) if ps else (s, b, f, ps) for s, b, f, ps in commits]
    first = next(ps[0] for *_, ps in commits if ps)
    tracked = _tracked() + ["patches/0099-nowhere.patch"]
    assert f"patches/{first}" in _unplaced(tracked, dropped)
    assert _unplaced(tracked, commits) == ["patches/0099-nowhere.patch"]


def test_every_patch_has_a_header():
    """Each patch (and each PR form, patches/pr/) opens with its subject, why, and the test that
    covers it, before its first hunk."""
    for path in sorted((ROOT / "patches").glob("*.patch")) + sorted(
        (ROOT / "patches" / "pr").glob("*.patch")
    ):
        head = re.split(r"^(?:--- a/|diff --git )", path.read_text(), maxsplit=1, flags=re.M)[0]
        lines = head.splitlines()
        assert lines and lines[0].strip() and not lines[0].startswith("Why"), path.name
        assert any(x.startswith("Why:") for x in lines), f"{path.name}: no 'Why:' line"
        assert any(x.startswith("Test") for x in lines), f"{path.name}: no 'Test:' line"
