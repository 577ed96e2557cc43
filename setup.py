"""Build megatron-core 0.19.2 + the Muon patches as one distribution, megatron-core==0.19.2+muon:
upstream's ``megatron.core`` and ``megatron.training`` (Megatron-LM's loop), patched.

The pinned upstream archive must be fetched first (``python tools/fork.py fetch``; ``make install``
does it): inside pip's isolated build environment there is no pip to download it with. This file
assembles ``build/fork`` (upstream + ``patches/`` + our ``megatron/`` files) and packages that tree.
With ``pip install -e .`` our files stay symlinked, so edits are live without a rebuild.
"""

import subprocess
import sys
from pathlib import Path

from setuptools import Extension, find_namespace_packages, setup

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "tools"))
import fork  # noqa: E402

try:
    fork.assemble()
except fork.ForkError as err:
    sys.exit(f"megatron-muon build: {err}")

TREE = fork.FORK_DIR.relative_to(ROOT).as_posix()


def pybind11_includes():
    out = subprocess.check_output([sys.executable, "-m", "pybind11", "--includes"], text=True)
    return out.split()


setup(
    name="megatron-core",
    version=f"{fork.UPSTREAM_VERSION}+muon",
    description=f"Megatron Core {fork.UPSTREAM_VERSION} with Muon as a first-class optimizer "
    "(incl. DistOpt/ZeRO-1)",
    python_requires=">=3.12",
    package_dir={"": TREE},
    packages=find_namespace_packages(TREE, include=["megatron.core*", "megatron.training*"]),
    package_data={"megatron.core": ["requirements.txt", "README.md"]},
    install_requires=["torch>=2.6.0", "numpy", "packaging>=24.2", "psutil"],
    ext_modules=[
        Extension(
            "megatron.core.datasets.helpers_cpp",
            sources=[f"{TREE}/megatron/core/datasets/helpers.cpp"],
            language="c++",
            extra_compile_args=pybind11_includes() + ["-O3", "-Wall", "-std=c++17"],
        )
    ],
)
