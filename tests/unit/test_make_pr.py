"""`make pr`: each base's series, built from its pristine archive, applies with `git am` to a
fresh pristine tree and imports; every file the base links in and every patch of its series is in
one commit (`make test` fetches the 0.19.2 archive first: a missing archive fails here)."""

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

BASES = ["0.16.1", "0.19.2"]
# A hunk into an upstream file adds a call or a field, not an algorithm (patches/ rule).
MAX_CHANGED_LINES_PER_HUNK = 30
# What the applied tree must import: (code, expected output after the module path), per base,
# under this (0.16.1, Python 3.11) interpreter: megatron.core 0.19.2 imports on 3.11 too, its
# megatron.training package does not (typing.override), so muon_args is loaded as a file
IMPORTS = {
    "0.16.1": ("", ["blockwise"]),
    "0.19.2": (
        "import importlib.util as u\n"
        "s = u.spec_from_file_location('muon_args', 'megatron/training/muon_args.py')\n"
        "a = u.module_from_spec(s); s.loader.exec_module(a)\n"
        "print(OptimizerConfig().muon_impl, a.add_megatron_muon_args.__name__)\n",
        ["blockwise", "emerging", "add_megatron_muon_args"],
    ),
}


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


@pytest.fixture(scope="module", params=BASES)
def built(request, tmp_path_factory):
    """(base, patch files, the repository `git am` made from a fresh pristine tree)."""
    base, tmp = request.param, tmp_path_factory.mktemp(f"pr-{request.param}")
    patches = make_pr.build_series(tmp / "out", base)
    repo = tmp / "megatron-lm"
    make_pr.apply_series(repo, patches, base)
    return base, patches, repo


def test_series_applies_to_the_pristine_tree_in_review_order(built):
    base, patches, repo = built
    commits = make_pr.series(base)
    assert len(patches) == len(commits)
    log = subprocess.run(["git", "log", "--format=%s"], cwd=repo, capture_output=True, text=True)
    assert log.stdout.splitlines() == [s for s, *_ in reversed(commits)] + [
        f"megatron-core {base} (pristine archive, megatron/)"
    ]


def test_hunks_into_upstream_files_stay_small_and_our_files_carry_the_header(built):
    base, patches, repo = built
    ours = {rel for _, _, files, _ in make_pr.series(base) for rel in files}  # muon.py: replaced
    for patch in patches:
        for name, changed in _hunks_into_upstream_files(patch.read_text()):
            if name not in ours:
                assert changed <= MAX_CHANGED_LINES_PER_HUNK, (patch.name, name, changed)
    for rel in ours:
        if rel.endswith(".py"):
            assert (repo / rel).read_text().startswith(make_pr.HEADER), rel


def test_only_what_the_base_links_in_travels(built):
    """0.16.1: megatron.core (and its unit test, docs); 0.19.2: also the training files the base
    overlays. Our loop, the CPU shim on 0.16.1 and the benchmarks never travel."""
    base, patches, _ = built
    text = "".join(p.read_text() for p in patches)
    added = set(re.findall(r"create mode \d+ (\S+)", text))
    overlay = make_pr._fork(base).OVERLAY
    allowed = tuple(f"{top}/" if not top.endswith(".py") else top for top in overlay)
    if base == "0.16.1":
        allowed = ("megatron/core/", "tests/unit_tests/", "docs/")
    assert added and all(f.startswith(allowed) for f in added), sorted(added)
    if base == "0.19.2":
        assert {"megatron/training/muon_args.py", "megatron/training/gpt_entry.py"} <= added


def test_every_touched_python_file_parses(built):
    """A patch that lands in the wrong place shows as a syntax error (0.19.2's facts: fuzz put
    lines inside an import tuple); checked on every file the series adds or changes."""
    _, patches, repo = built
    touched = set().union(*(_touched(p.read_text()) for p in patches))
    assert any(name.startswith("megatron/") for name in touched)
    for name in sorted(touched):
        if name.endswith(".py"):
            ast.parse((repo / name).read_text(), filename=name)


def test_the_applied_tree_imports(built):
    base, _, repo = built
    more, expected = IMPORTS[base]
    code = (
        "import warnings; warnings.simplefilter('ignore')\n"
        "import megatron.core.optimizer.muon as m\n"
        "from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer\n"
        "print(m.__file__, m.TensorParallelMuon.__name__, m.get_megatron_muon_optimizer.__name__,"
        " OptimizerConfig().muon_tp_mode)\n" + more
    )
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=repo, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    path, *names = done.stdout.split()
    assert Path(path) == repo / "megatron/core/optimizer/muon.py"  # the applied tree, not ours
    assert names == ["TensorParallelMuon", "get_megatron_muon_optimizer", *expected]


def _tracked(base: str) -> list:
    """Our files the base links in (or, on 0.16.1, all of megatron/core) and its patches, new
    ones too: tools/fork.py links and applies what is on disk."""
    fork = make_pr._fork(base)
    paths = ["megatron/core"] if base == "0.16.1" else list(fork.OVERLAY)
    patch_dir = fork.PATCH_DIR.relative_to(ROOT)
    paths.append(f":(glob){patch_dir}/*.patch")
    cmd = ["git", "ls-files", "--cached", "--others", "--exclude-standard", *paths]  # as linked
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    return done.stdout.split()


def _unplaced(base: str, tracked: list, commits: list) -> list:
    patch_dir = make_pr._fork(base).PATCH_DIR.relative_to(ROOT)
    files = {rel for _, _, fs, _ in commits for rel in fs}
    patches = {f"{patch_dir}/{name}" for *_, ps in commits for name in ps}
    return sorted(set(tracked) - files - patches - set(make_pr.unsent(base)))


@pytest.mark.parametrize("base", BASES)
def test_every_linked_file_and_patch_is_in_the_series(base):
    """A file added where the base links ours in, or a patch, must be placed in a commit of the
    series (tools/pr_series.py); each patch in one commit only."""
    tracked = _tracked(base)
    assert any(name.endswith(".patch") for name in tracked)
    missing = _unplaced(base, tracked, make_pr.series(base))
    assert not missing, f"add these to tools/pr_series.py SERIES[{base!r}]: {missing}"
    named = [name for *_, ps in make_pr.series(base) for name in ps]
    assert len(named) == len(set(named))


@pytest.mark.parametrize("base", BASES)
def test_a_patch_in_no_commit_is_found(base):
    """Negative control of the check above: the series without one of its patches, and a patch
    file no commit names, are both reported."""
    commits = make_pr.series(base)
    dropped = [(s, b, f, ps[1:]) if ps else (s, b, f, ps) for s, b, f, ps in commits]
    patch_dir = make_pr._fork(base).PATCH_DIR.relative_to(ROOT)
    first = next(ps[0] for *_, ps in commits if ps)
    tracked = _tracked(base) + [f"{patch_dir}/0099-nowhere.patch"]
    assert f"{patch_dir}/{first}" in _unplaced(base, tracked, dropped)
    assert _unplaced(base, tracked, commits) == [f"{patch_dir}/0099-nowhere.patch"]
