"""`make pr`: the series, built from the pristine archive, applies with `git am` to a fresh
pristine tree and imports; every file tools/fork.py links in and every patch is in one commit."""

import ast
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


def _touched(patch: str) -> set:
    return set(re.findall(r"^\+\+\+ b/(\S+)", patch, re.MULTILINE))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(patch files, the repository `git am` made from a fresh pristine tree)."""
    tmp = tmp_path_factory.mktemp("pr")
    patches = make_pr.build_series(tmp / "out")
    repo = tmp / "megatron-lm"
    make_pr.apply_series(repo, patches)
    return patches, repo


def test_series_applies_to_the_pristine_tree_in_review_order(built):
    patches, repo = built
    commits = make_pr.SERIES
    assert len(patches) == len(commits)
    log = subprocess.run(["git", "log", "--format=%s"], cwd=repo, capture_output=True, text=True)
    assert log.stdout.splitlines() == [s for s, *_ in reversed(commits)] + [
        f"megatron-core {make_pr.fork.UPSTREAM_VERSION} (pristine archive)"
    ]


def test_hunks_into_upstream_files_stay_small_and_our_files_carry_the_header(built):
    patches, repo = built
    ours = {rel for _, _, files, _ in make_pr.SERIES for rel in files}  # muon.py: replaced
    for patch in patches:
        for name, changed in _hunks_into_upstream_files(patch.read_text()):
            if name not in ours:
                assert changed <= MAX_CHANGED_LINES_PER_HUNK, (patch.name, name, changed)
    for rel in ours:
        if rel.endswith(".py"):
            assert (repo / rel).read_text().startswith(make_pr.HEADER), rel


def test_only_what_is_linked_in_travels(built):
    """megatron/ (less the corpora, UNSENT), its unit test and docs; benchmarks never travel."""
    patches, _ = built
    text = "".join(p.read_text() for p in patches)
    added = set(re.findall(r"create mode \d+ (\S+)", text))
    allowed = ("megatron/", "tests/unit_tests/", "docs/")
    assert added and all(f.startswith(allowed) for f in added), sorted(added)
    assert not added & set(make_pr.UNSENT)
    assert {"megatron/training/muon_args.py", "megatron/training/gpt_entry.py"} <= added


def test_every_touched_python_file_parses(built):
    """A patch that lands in the wrong place shows as a syntax error (0.19.2's facts: fuzz put
    lines inside an import tuple); checked on every file the series adds or changes."""
    patches, repo = built
    touched = set().union(*(_touched(p.read_text()) for p in patches))
    assert any(name.startswith("megatron/") for name in touched)
    for name in sorted(touched):
        if name.endswith(".py"):
            ast.parse((repo / name).read_text(), filename=name)


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
