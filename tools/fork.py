#!/usr/bin/env python3
"""Assemble the megatron-muon fork from the pinned upstream megatron-core archive.

    python tools/fork.py fetch      # download megatron_core-0.19.2.tar.gz into .cache/upstream
    python tools/fork.py assemble   # verify, extract, apply patches/, link our megatron/ files
    python tools/fork.py check      # apply patches/ to a pristine copy in a temp dir (CI check)
    python tools/fork.py pristine DIR  # extract the untouched upstream tree (to write a patch)

The assembled tree lives in ``build/fork``; ``setup.py`` installs it (editable in dev mode). Our
files are *symlinked* into it, so an edit under ``megatron/`` is live at the next import; a new
file, or a changed patch, needs ``assemble`` again (``make fork``; ``make test`` runs it too).
Only the standard library is used: this runs before any dependency is installed.

The archive ships upstream's ``megatron/training`` (Megatron-LM's loop) beside ``megatron/core``;
our ``megatron/core`` files and the few of ``megatron/training`` (the entry ``pretrain_gpt.py``
runs, the CPU mode, our Muon's flags, the built-in corpus) are linked into it.
"""

import compileall
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import warnings
from pathlib import Path

UPSTREAM_NAME = "megatron-core"
ROOT = Path(__file__).resolve().parent.parent
CACHE_DIR = Path(os.environ.get("MEGATRON_MUON_CACHE", ROOT / ".cache" / "upstream"))

UPSTREAM_VERSION = "0.19.2"  # requires Python >= 3.12
ARCHIVE_SHA256 = "de643eee32007a7504ad52f061103fe7432503603b6321c16c861eb67dbd3353"
PATCH_DIR = ROOT / "patches"
FORK_DIR = ROOT / "build" / "fork"
# Our files linked over the tree: folders upstream lacks whole, else file by file
OVERLAY = ("megatron",)
# The upstream files ours replace whole (any other name clash is an error): upstream's Muon shim,
# whose entry keeps upstream's behaviour for muon_impl != 'megatron_muon', and its QK-clip, whose
# clip_qk (same signature) adds the local attention and DistOpt shards of ours
REPLACED = ("megatron/core/optimizer/muon.py", "megatron/core/optimizer/qk_clip.py")
ARCHIVE = f"megatron_core-{UPSTREAM_VERSION}.tar.gz"
STAMP = FORK_DIR / ".assembled"


class ForkError(RuntimeError):
    """A build step failed; the message names the file and what to do."""


def archive_path() -> Path:
    return CACHE_DIR / ARCHIVE


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch() -> Path:
    """Download the pinned source archive with pip (hash-checked) unless it is cached."""
    target = archive_path()
    if target.exists() and sha256(target) == ARCHIVE_SHA256:
        return target
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        req = Path(tmp) / "upstream.txt"
        req.write_text(f"{UPSTREAM_NAME}=={UPSTREAM_VERSION} --hash=sha256:{ARCHIVE_SHA256}\n")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
        cmd += ["--no-build-isolation", "--require-hashes", "-r", str(req), "-d", str(CACHE_DIR)]
        # upstream's setup.py runs `python3 -m pybind11` while pip reads its metadata
        env = dict(
            os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
        )
        if subprocess.run(cmd, env=env).returncode != 0:
            raise ForkError(f"could not download {ARCHIVE} from the package index: {' '.join(cmd)}")
    verify(target)
    return target


def verify(path: Path) -> None:
    if not path.exists():
        raise ForkError(f"{path} is missing: run `python tools/fork.py fetch` (or `make install`)")
    got = sha256(path)
    if got != ARCHIVE_SHA256:
        raise ForkError(f"{path}: sha256 {got} does not match the pinned {ARCHIVE_SHA256}")


def patches() -> list:
    return sorted(PATCH_DIR.glob("*.patch"))


def extract(dest: Path) -> None:
    """Extract the upstream ``megatron/`` folder of the verified archive into ``dest``."""
    verify(archive_path())
    prefix = f"megatron_core-{UPSTREAM_VERSION}/"
    with tarfile.open(archive_path()) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix + "megatron/")]
        for m in members:
            m.name = m.name[len(prefix) :]
        tar.extractall(dest, members=members, filter="data")


def apply_patches(tree: Path) -> None:
    for patch in patches():
        cmd = ["git", "apply", "--whitespace=nowarn", "-p1", str(patch)]
        result = subprocess.run(cmd, cwd=tree, capture_output=True, text=True)
        if result.returncode != 0:
            raise ForkError(f"patch {patch.name} does not apply:\n{result.stderr}")


def fingerprint() -> str:
    digest = hashlib.sha256(ARCHIVE_SHA256.encode())
    for patch in patches():
        digest.update(patch.name.encode() + patch.read_bytes())
    return digest.hexdigest()


def overlay_entries():
    """Our paths to link (under the base's ``OVERLAY``): whole folders upstream lacks, else
    single files (as given, or found in our folders)."""
    yield from (Path(top) for top in OVERLAY if (ROOT / top).is_file())
    for dirpath, dirnames, filenames in (w for top in OVERLAY for w in os.walk(ROOT / top)):
        here = Path(dirpath).relative_to(ROOT)
        for name in sorted(dirnames):
            upstream = FORK_DIR / here / name
            if name == "__pycache__" or not upstream.exists() or upstream.is_symlink():
                dirnames.remove(name)
                if name != "__pycache__":
                    yield here / name
        for name in sorted(filenames):
            if not name.endswith((".pyc", ".so")):
                yield here / name


def link_overlay() -> None:
    touched = _patched_files()
    for rel in overlay_entries():
        if str(rel) in touched:
            raise ForkError(f"{rel} is both patched (patches/) and replaced (megatron/): pick one")
        dest = FORK_DIR / rel
        if dest.is_file() and not dest.is_symlink() and str(rel) not in REPLACED:
            raise ForkError(f"{rel} would replace upstream's file: patch it (patches/) instead")
        if dest.is_symlink() or dest.is_file():
            dest.unlink()
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.symlink_to(ROOT / rel)
    _drop_dangling_links(FORK_DIR / "megatron")


def _patched_files() -> set:
    names = set()
    for patch in patches():
        for line in patch.read_text().splitlines():
            if line.startswith("+++ b/"):
                names.add(line[len("+++ b/") :].strip())
    return names


def _drop_dangling_links(tree: Path) -> None:
    for path in tree.rglob("*"):
        if path.is_symlink() and not path.exists():
            path.unlink()


def assemble() -> Path:
    """Build ``build/fork``; cheap when archive and patches are unchanged (links only)."""
    if not (STAMP.exists() and STAMP.read_text() == fingerprint()):
        built = _saved_extensions()
        if FORK_DIR.exists():
            shutil.rmtree(FORK_DIR)
        FORK_DIR.mkdir(parents=True)
        extract(FORK_DIR)
        apply_patches(FORK_DIR)
        for rel, data in built.items():
            (FORK_DIR / rel).write_bytes(data)
        STAMP.write_text(fingerprint())
    link_overlay()
    _compile_bytecode()
    return FORK_DIR


def _compile_bytecode() -> None:
    """Write the tree's .pyc files now: each rank of each launch imports ~400 of its modules, and
    where PYTHONDONTWRITEBYTECODE is set (as on our development machine) each would be compiled
    from source again, ~1.5 CPU-seconds per rank. Incremental: only changed files. compileall
    does not enter a linked folder (ours: megatron_muon/, repairs/; ~0.13 CPU-seconds of each
    importing process, measured): those are compiled at their target, where the import looks."""
    with warnings.catch_warnings():  # upstream's own invalid escapes (SyntaxWarning), not ours
        warnings.simplefilter("ignore")
        compileall.compile_dir(FORK_DIR / "megatron", quiet=1)
        for rel in overlay_entries():
            if (ROOT / rel).is_dir():
                compileall.compile_dir(ROOT / rel, quiet=1)


def _saved_extensions() -> dict:
    """Keep compiled dataset helpers across a re-assembly (they do not depend on patches)."""
    if not FORK_DIR.exists():
        return {}
    return {p.relative_to(FORK_DIR): p.read_bytes() for p in FORK_DIR.rglob("helpers_cpp*.so")}


def check() -> None:
    """Apply the series to a pristine copy: the test that the patch series is sound."""
    with tempfile.TemporaryDirectory() as tmp:
        extract(Path(tmp))
        apply_patches(Path(tmp))
    print(f"{len(patches())} patches apply cleanly to {ARCHIVE}")


def main(argv) -> int:
    commands = {"fetch": fetch, "assemble": assemble, "check": check}
    try:
        if len(argv) == 2 and argv[0] == "pristine":
            extract(Path(argv[1]))
        elif len(argv) == 1 and argv[0] in commands:
            commands[argv[0]]()
        else:
            print(__doc__, file=sys.stderr)
            return 2
    except ForkError as err:
        print(f"fork: error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
