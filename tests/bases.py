"""Which megatron-core base the running interpreter has installed (0.16.1 or the staged 0.19.2)."""

import importlib.machinery
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def upstream_loop_installed() -> bool:
    """Whether the installed megatron.training is upstream's (base 0.19.2), not our loop (0.16.1).

    Decided as pretrain_gpt.py decides, without importing: the repository's own megatron/training
    (our loop's source) shadows the installed package in a process started from its root."""
    path = [p for p in sys.path if Path(p or os.curdir).resolve() != ROOT]
    spec = importlib.machinery.PathFinder.find_spec("megatron", path)
    places = (spec.submodule_search_locations or []) if spec else []
    return any((Path(p) / "training/global_vars.py").is_file() for p in places)


# The mark of every tests/e2e_next module: they drive upstream's loop (base 0.19.2)
UPSTREAM_LOOP_ONLY = pytest.mark.skipif(
    not upstream_loop_installed(),
    reason="the installed megatron.training is ours (base 0.16.1), not upstream's",
)
