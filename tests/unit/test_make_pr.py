"""`make pr`: the series built from the pristine archive applies with `git am` and imports."""

import re
import subprocess
import sys
from pathlib import Path

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


def test_series_applies_to_the_pristine_tree_and_imports(tmp_path):
    patches = make_pr.build_series(tmp_path / "out")
    assert len(patches) == len(make_pr.SERIES)
    repo = tmp_path / "megatron-lm"
    make_pr.init_pristine(repo)
    subprocess.run(["git", *make_pr.AUTHOR, "am", "-q", *map(str, patches)], cwd=repo, check=True)
    log = subprocess.run(["git", "log", "--format=%s"], cwd=repo, capture_output=True, text=True)
    assert log.stdout.splitlines()[: len(patches)] == [s for s, *_ in reversed(make_pr.SERIES)]

    ours = {rel for _, _, files, _ in make_pr.SERIES for rel in files}  # e.g. muon.py: replaced
    for patch in patches:
        for name, changed in _hunks_into_upstream_files(patch.read_text()):
            if name not in ours:
                assert changed <= MAX_CHANGED_LINES_PER_HUNK, (patch.name, name, changed)
    for _, _, files, _ in make_pr.SERIES:
        for rel in files:
            if rel.endswith(".py"):
                assert (repo / rel).read_text().startswith(make_pr.HEADER), rel
    # no module of our training stack, CPU shim or benchmarks travels with the core series
    added = set(re.findall(r"create mode \d+ (\S+)", "".join(p.read_text() for p in patches)))
    assert added and all(
        f.startswith(("megatron/core/", "tests/unit_tests/", "docs/")) for f in added
    )

    code = (
        "import warnings; warnings.simplefilter('ignore')\n"
        "import megatron.core.optimizer.muon as m\n"
        "from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer\n"
        "print(m.__file__, m.TensorParallelMuon.__name__, m.get_megatron_muon_optimizer.__name__,"
        " OptimizerConfig().muon_tp_mode)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    path, *names = done.stdout.split()
    assert Path(path) == repo / "megatron/core/optimizer/muon.py"  # the applied tree, not ours
    assert names == ["TensorParallelMuon", "get_megatron_muon_optimizer", "blockwise"]


def test_every_core_file_and_patch_is_in_the_series():
    """A file added under megatron/core, or a patch, must be placed in a commit of the series."""
    # base 0.16.1's series (patches/*.patch); the staged 0.19.2's under patches/0.19.2 is not yet
    # what make pr sends
    paths = ["megatron/core", ":(glob)patches/*.patch"]
    listed = subprocess.run(
        ["git", "ls-files", *paths], cwd=ROOT, capture_output=True, text=True
    ).stdout.split()
    files = {rel for _, _, fs, _ in make_pr.SERIES for rel in fs}
    patches = {f"patches/{name}" for *_, ps in make_pr.SERIES for name in ps}
    missing = sorted(set(listed) - files - patches)
    assert listed and not missing, f"add these to tools/make_pr.py SERIES: {missing}"
