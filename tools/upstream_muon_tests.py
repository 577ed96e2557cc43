"""Run Megatron-LM's own Muon unit tests against the installed fork (issue 27, item 10).

    .venv/bin/python tools/upstream_muon_tests.py CHECKOUT [--ranks 2]
        [--ref core_v0.19.0] [--ours] [--without PATCH] [--pr build/pr/NN-slug] [-- PYTEST_ARGS]

CHECKOUT is a Megatron-LM work tree or git directory (e.g. ``git clone --bare
https://github.com/NVIDIA/Megatron-LM``); with a git directory the tests are read at ``--ref``.
Only upstream's ``tests/`` files are copied, to a temporary folder: nothing of theirs enters this
repository, and ``megatron`` is imported from the installed fork, never from the checkout.

Runs, under ``torch.distributed.run`` on ``--ranks`` processes (gloo CPU ranks where CUDA is
absent), ``tests/unit_tests/test_emerging_optimizers.py``, ``test_layer_wise_optimizer.py`` and
``dist_checkpointing/test_layer_wise_optimizer.py`` with tools/upstream_muon_conftest.py in place
of upstream's conftest, ``NVIDIA_PYTORCH_VERSION`` set (both files skip everything on <= 25.05,
their "LTS" marker), and prints pass/fail/skip counts per file, each skip reason with its count,
and every failure. A test counts as failed when it failed on any rank. Exit status 1 when any
failed. ``--ours`` runs instead this repository's tests in upstream's form
(``tests/unit_tests/``, upstream's ``Utils``; they travel with ``make pr``), copied into the same
tree. ``--without PATCH[,PATCH]`` (files of ``patches/``, e.g. ``0022``) runs them on the fork's
tree with those patches reversed, first on ``PYTHONPATH``: a fix's test must fail there
(docs/pull_requests.md records how). ``--pr build/pr/NN-slug`` (``make pr`` writes it) runs the
tests that pull request carries on the pristine 0.19.2 tree with its patches ``git am``-ed, not on
the fork: each PR's tests pass with that PR alone (our CPU stand-in ``cpu_mode.py`` linked in, and
where triton is absent the fork's patch 0024 and where CUDA is absent 0033, as the fork itself
needs on CPU).
"""

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
FILES = (
    "tests/unit_tests/test_emerging_optimizers.py",
    "tests/unit_tests/test_layer_wise_optimizer.py",
    "tests/unit_tests/dist_checkpointing/test_layer_wise_optimizer.py",
)
# what the three files import from upstream's tests/ (their conftest is replaced by ours)
SUPPORT = (
    "tests/__init__.py",
    "tests/unit_tests/__init__.py",
    "tests/unit_tests/test_utilities.py",
    "tests/unit_tests/dist_checkpointing",
)
# Our tests in upstream's form (they travel with `make pr`): copied over the export; --ours runs
# them instead of upstream's Muon files
OURS = HERE.parent / "tests" / "unit_tests"
NGC_VERSION = "26.01"  # any NGC release above the files' 25.05 "LTS" cut-off


def export_tests(checkout: Path, ref: str, dest: Path) -> None:
    """Copy upstream's test files (at ``ref`` for a git directory) into ``dest``."""
    paths = [*FILES, *SUPPORT]
    if (checkout / "tests").is_dir():
        for path in paths:
            src = checkout / path
            if src.is_dir():
                shutil.copytree(src, dest / path, dirs_exist_ok=True)
            elif src.exists():
                (dest / path).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(src, dest / path)
        return
    archive = dest / "tests.tar"
    cmd = ["git", "--git-dir", str(checkout), "archive", "--format=tar", ref, "--", *paths]
    with open(archive, "wb") as f:
        subprocess.run(cmd, stdout=f, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(dest, filter="data")
    archive.unlink()


def copy_ours(tree: Path, ours: Path = OURS) -> list:
    """Copy our upstream-form tests (``ours``: a tests/unit_tests folder) into ``tree`` (a package
    ``__init__.py`` where a folder has none); their paths, as pytest arguments."""
    names = []
    for src in sorted(ours.rglob("test_*.py")):
        rel = Path("tests/unit_tests") / src.relative_to(ours)
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(src, tree / rel)
        for folder in list(rel.parents)[:-2]:
            (tree / folder / "__init__.py").touch(exist_ok=True)
        names.append(str(rel))
    return names


def tree_without(patches: str, dest: Path) -> Path:
    """The fork's assembled ``megatron/`` tree (build/fork, our files as its links) copied to
    ``dest`` with the patches named in ``patches`` (numbers will do; comma-separated, reversed
    in the order given: a later patch on the same lines first) reversed."""
    sys.path.insert(0, str(HERE))
    import fork

    shutil.copytree(fork.FORK_DIR / "megatron", dest / "megatron", symlinks=True)
    for patch in patches.split(","):
        found = [p for p in fork.patches() if p.name == patch or p.name.startswith(patch + "-")]
        if len(found) != 1:
            raise SystemExit(f"--without {patch}: no single patch of that name under patches/")
        cmd = ["git", "apply", "-R", "--whitespace=nowarn", "-p1", str(found[0])]
        subprocess.run(cmd, cwd=dest, check=True)
    return dest


def tree_of_pr(folder: Path, dest: Path) -> tuple:
    """The pristine archive's ``megatron/`` with the pull request in ``folder`` applied by
    ``git am`` (and what CPU ranks need of the fork: ``cpu_mode.py``; 0024 without triton; 0033
    without CUDA, where the PR does not carry it);
    (the tree, its tests/unit_tests files as pytest paths)."""
    sys.path.insert(0, str(HERE))
    import importlib.util

    import make_pr
    import torch

    make_pr.apply_series(dest, sorted(folder.glob("*.patch")))
    link = dest / "megatron" / "training" / "cpu_mode.py"
    if not link.exists():
        link.symlink_to(HERE.parent / "megatron" / "training" / "cpu_mode.py")
    stand_ins = []
    if importlib.util.find_spec("triton") is None:
        stand_ins.append("0024")
    if not torch.cuda.is_available():
        stand_ins.append("0033")  # the persistent checkpoint worker
    for number in stand_ins:
        stand_in = str(next(make_pr.fork.PATCH_DIR.glob(f"{number}-*.patch")))
        check = ["git", "apply", "--check", "--whitespace=nowarn", stand_in]
        if subprocess.run(check, cwd=dest, capture_output=True).returncode == 0:  # not in the PR
            make_pr._git(dest, "apply", "--whitespace=nowarn", stand_in)
    tests = sorted((dest / "tests" / "unit_tests").rglob("test_*.py"))
    return dest, [str(t.relative_to(dest)) for t in tests]


def run(tree: Path, ranks: int, extra: list, pythonpath=None) -> dict:
    """Run the files on ``ranks`` processes; each rank's {test id: [outcome, reason]}."""
    report = tree / "report"
    report.mkdir()
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    env.setdefault("NVIDIA_PYTORCH_VERSION", NGC_VERSION)
    env["MEGATRON_UPSTREAM_TESTS_REPORT"] = str(report)
    env["MEGATRON_UPSTREAM_TESTS_TMP"] = str(tree / "tmp")
    if pythonpath:  # a tree without one patch: its megatron before the installed fork's
        env["PYTHONPATH"] = os.pathsep.join([str(pythonpath), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}"]
    cmd += ["--standalone", "--log-dir", str(tree / "logs"), "--redirects", "3"]
    files = [a for a in extra if a.startswith("tests/")] or list(FILES)  # a subset if given
    extra = [a for a in extra if not a.startswith("tests/")]
    cmd += ["-m", "pytest", "-v", "-p", "no:cacheprovider", "--rootdir", str(tree), *files]
    cmd += ["-o", "faulthandler_timeout=600"]  # a hung collective: its stacks in the rank's log
    with open(tree / "launch.log", "w") as log:  # torchrun's own report; ranks' under logs/
        subprocess.run(cmd + extra, cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT)
    results = {}
    for rank in range(ranks):
        path = report / f"rank{rank}.json"
        results[rank] = json.loads(path.read_text()) if path.exists() else None
    return results


def merge(results: dict) -> dict:
    """One outcome per test: failed where any rank failed, else rank 0's."""
    merged = {}
    for rank, tests in sorted(results.items()):
        if tests is None:
            raise SystemExit(f"rank {rank} wrote no report: see its log under the run's logs/")
        for test, (outcome, reason) in tests.items():
            if test not in merged or outcome == "failed":
                merged[test] = (
                    outcome,
                    reason if outcome != "failed" else f"rank {rank}: {reason}",
                )
    return merged


def summarize(merged: dict) -> int:
    counts = collections.defaultdict(collections.Counter)
    skips, failures = collections.Counter(), []
    for test, (outcome, reason) in sorted(merged.items()):
        counts[test.split("::")[0]][outcome] += 1
        if outcome == "skipped":
            skips[reason] += 1
        elif outcome == "failed":
            failures.append(f"  {test}\n      {reason}")
    for name, c in counts.items():
        print(f"{name}: {c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped")
    total = sum(counts.values(), collections.Counter())
    print(f"total: {total['passed']} passed, {total['failed']} failed, {total['skipped']} skipped")
    for reason, n in skips.most_common():
        print(f"  skipped {n}: {reason}")
    if failures:
        print("failed:\n" + "\n".join(failures))
    return 1 if failures else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkout", type=Path, help="Megatron-LM work tree or git directory")
    parser.add_argument("--ref", default="core_v0.19.0", help="tag read from a git directory")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder")
    parser.add_argument("--ours", action="store_true", help="run our upstream-form tests instead")
    parser.add_argument("--without", metavar="PATCH", help="on the fork with PATCH reversed")
    parser.add_argument("--pr", type=Path, help="a build/pr/NN-slug folder: its tests, on it")
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:cut])  # what follows "--" goes to pytest
    args.pytest_args = argv[cut + 1 :]
    tree = Path(tempfile.mkdtemp(prefix="upstream_muon_tests_"))
    try:
        export_tests(args.checkout.resolve(), args.ref, tree)
        shutil.copy(HERE / "upstream_muon_conftest.py", tree / "tests/unit_tests/conftest.py")
        without, ours = None, copy_ours(tree)
        if args.pr:  # the PR's own tests, on the pristine tree with the PR applied
            without, _ = tree_of_pr(args.pr.resolve(), tree / "pr")
            ours = copy_ours(tree, without / "tests" / "unit_tests")
            args.ours = True
        if args.ours and not any(a.startswith("tests/") for a in args.pytest_args):
            args.pytest_args = ours + args.pytest_args
        if args.without:
            without = tree_without(args.without, tree / "without")
        start = time.time()
        merged = merge(run(tree, args.ranks, args.pytest_args, without))
        print(f"{args.ranks} ranks, {time.time() - start:.0f} s")
        return summarize(merged)
    finally:
        if args.keep:
            print(f"kept {tree}")
        else:
            shutil.rmtree(tree, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
