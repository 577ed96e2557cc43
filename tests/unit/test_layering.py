"""Layering of megatron/core/optimizer's Muon modules: no import circles, no CPU shim in core.

Two views of the same rule. Statically, every ``import`` of one of our optimizer modules by
another (function-level imports included: a lazy import only hides a circle) forms a graph that
must be acyclic. Dynamically, each module imports on its own in a fresh interpreter (a circle
that happens to work in one import order breaks in another) and pulls in no CPU-mode shim.
"""

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OPT = ROOT / "megatron/core/optimizer"
PACKAGE = "megatron.core.optimizer"
_spec = importlib.util.spec_from_file_location("fork", ROOT / "tools/fork.py")
fork = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fork)
OURS = sorted(p.stem for p in OPT.glob("*.py"))
# The package itself (upstream's __init__, patched by 0002 to import our factory hooks): a
# module that imports from it and is imported by it closes a circle too.
INIT = "__init__"


def _source(module: str) -> str:
    if module == INIT:
        return (fork.FORK_DIR / "megatron/core/optimizer/__init__.py").read_text()
    return (OPT / f"{module}.py").read_text()


def _imports(module: str) -> set[str]:
    """Our optimizer modules (and the package) that ``module`` imports, anywhere in the file."""
    found = set()
    for node in ast.walk(ast.parse(_source(module))):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1 and node.module:
                base = node.module
            elif node.module and node.module.startswith(PACKAGE + "."):
                base = node.module[len(PACKAGE) + 1 :]
            elif node.level == 1 or node.module == PACKAGE:  # from . import name
                found.update(a.name if a.name in OURS else INIT for a in node.names)
                continue
            else:
                continue
            found.add(base.split(".")[0])
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(PACKAGE + "."):
                    found.add(alias.name[len(PACKAGE) + 1 :].split(".")[0])
    return {m for m in found if m in OURS + [INIT] and m != module}


def _cycle(graph: dict[str, set[str]]):
    """A list of modules forming a circle, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_our_optimizer_modules_import_each_other_without_a_circle():
    graph = {m: _imports(m) for m in OURS + [INIT]}
    assert len(OURS) >= 9, OURS
    assert graph[INIT] >= {"muon_megatron"}, "the patched package imports the factory hooks"
    assert graph["muon_config"] == set(), "vocabularies and defaults import nothing of ours"
    assert graph["newton_schulz"] <= {"muon_config"}, "Newton-Schulz: pure math"
    assert graph["muon_optimizer"] <= {"muon_config", "muon_functional", "newton_schulz"}
    assert _cycle(graph) is None, f"import circle: {' -> '.join(_cycle(graph))}"


def test_the_cycle_finder_sees_a_circle():
    # negative control: the checker must report a circle when there is one
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_core_module_imports_the_cpu_shim():
    core = ROOT / "megatron/core"
    offenders = [
        str(p.relative_to(ROOT)) for p in core.rglob("*.py") if "cpu_mode" in p.read_text()
    ]
    assert offenders == []


def test_each_module_imports_first_in_a_fresh_optimizer_package():
    # One interpreter (importing megatron.core costs seconds); before each module, the
    # optimizer package is dropped from sys.modules, so each import starts the package afresh
    # from that module, as a first import in a new process would.
    code = f"""
import sys, warnings
warnings.simplefilter('ignore')
import megatron.core
for module in {OURS!r}:
    for name in [m for m in sys.modules if m.startswith('{PACKAGE}')]:
        del sys.modules[name]
    __import__('{PACKAGE}.' + module)
    bad = [m for m in sys.modules if m.endswith('cpu_mode') or m == 'megatron.training']
    assert not bad, (module, bad)
print('ok', len({OURS!r}))
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["ok", str(len(OURS))]
