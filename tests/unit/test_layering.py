"""Layering of our megatron/ files: no import circles (the Muon modules of megatron/core/optimizer
and, at the end, every file of ours with the upstream files our patches edit), no CPU shim in core.

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
# Our optimizer modules, named relative to the package: "muon", "megatron_muon.config",
# "megatron_muon.planner.plan", "repairs.group_matching", ...
OURS = sorted(
    ".".join(p.relative_to(OPT).with_suffix("").parts)
    for p in OPT.rglob("*.py")
    if p.name != "__init__.py"
)
# The package itself (upstream's __init__, patched by 0002 to import our factory hooks): a
# module that imports from it and is imported by it closes a circle too.
INIT = "__init__"
MUON = "megatron_muon."


def _source(module: str) -> str:
    if module == INIT:
        return (fork.FORK_DIR / "megatron/core/optimizer/__init__.py").read_text()
    return (OPT / (module.replace(".", "/") + ".py")).read_text()


def _package_of(module: str) -> list[str]:
    return [] if module == INIT else module.split(".")[:-1]


def _imports(module: str) -> set[str]:
    """Our optimizer modules (and the package) that ``module`` imports, anywhere in the file."""
    found = set()
    for node in ast.walk(ast.parse(_source(module))):
        targets = []
        if isinstance(node, ast.ImportFrom):
            if node.level:
                package = _package_of(module)
                if node.level - 1 > len(package):  # above megatron.core.optimizer: not ours
                    continue
                anchor = package[: len(package) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            elif node.module == PACKAGE or (node.module or "").startswith(PACKAGE + "."):
                base = node.module[len(PACKAGE) + 1 :]
            else:
                continue
            targets = [f"{base}.{a.name}".strip(".") for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name[len(PACKAGE) + 1 :] for a in node.names if a.name.startswith(PACKAGE)]
        for target in targets:
            if target.partition(".")[0] in ("megatron_muon", "repairs") or target in OURS:
                while target not in OURS:  # a.b.c -> a.b: the module that holds c
                    target = target.rpartition(".")[0]
                found.add(target)
            elif isinstance(node, ast.ImportFrom) and base == "":  # from <the package> import x
                found.add(INIT)
    return {m for m in found if m != module}


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
    assert graph[INIT] >= {MUON + "factory"}, "the patched package imports the factory hooks"
    assert graph[MUON + "config"] == set(), "vocabularies and defaults import nothing of ours"
    assert graph[MUON + "newton_schulz"] <= {MUON + "config"}, "Newton-Schulz: pure math"
    assert graph[MUON + "optimizer"] <= {
        MUON + m for m in ("config", "functional", "newton_schulz")
    }
    repairs = [m for m in OURS if m.startswith("repairs.")]
    assert repairs and not any(d.startswith(MUON) for m in repairs for d in graph[m]), (
        "the repairs of upstream defects need nothing of our Muon"
    )
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


# ----------------------------------------------------------------- all of our megatron/ files
# Nodes: each of our modules, and each upstream module our patches edit (they import ours, so a
# circle can close through them). Upstream modules nobody patched are left out: a circle through
# them alone would need an unpatched upstream file to import ours, which none does.
def _module_name(path: Path) -> str:
    parts = path.with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _tree_nodes() -> dict[str, Path]:
    ours = {_module_name(p.relative_to(ROOT)): p for p in (ROOT / "megatron").rglob("*.py")}
    patched = set()
    for patch in (ROOT / "patches").glob("*.patch"):
        for line in patch.read_text().splitlines():
            if line.startswith("+++ b/"):
                patched.add(line[len("+++ b/") :])
    for rel in sorted(patched):
        if rel.endswith(".py") and (fork.FORK_DIR / rel).exists():
            ours.setdefault(_module_name(Path(rel)), fork.FORK_DIR / rel)
    return ours


def _tree_imports(name: str, path: Path, nodes) -> set[str]:
    """The nodes ``name`` imports anywhere in its file (relative imports resolved)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        for target in targets:
            while target and target not in nodes:  # a.b.c -> a.b: the module that holds c
                target = target.rpartition(".")[0]
            # a module's own parent packages are imported before it, always: not an edge
            if target and target != name and not name.startswith(target + "."):
                found.add(target)
    return found


def _tree_graph() -> dict[str, set[str]]:
    """Our files' imports of nodes; an upstream file's imports of our files only (the lines our
    patches add: upstream's own imports among its modules are upstream's layering)."""
    nodes = _tree_nodes()
    ours = {n for n, p in nodes.items() if (ROOT / "megatron") in p.parents}
    graph = {}
    for name, path in nodes.items():
        found = _tree_imports(name, path, nodes)
        graph[name] = found if name in ours else found & ours
    return graph


def test_no_import_circle_among_all_our_megatron_files():
    graph = _tree_graph()
    ours = [n for n, p in _tree_nodes().items() if (ROOT / "megatron") in p.parents]
    assert len(ours) >= 30 and "megatron.training.gpt_entry" in ours, ours
    assert "megatron.core.optimizer.megatron_muon.factory" in graph["megatron.core.optimizer"]
    assert _cycle(graph) is None, f"import circle: {' -> '.join(_cycle(graph))}"


def test_the_tree_graph_sees_a_circle_our_files_would_close():
    # negative control: an import of gpt_entry from cpu_mode (which gpt_entry imports through
    # cpu_loop) is a circle the whole-tree check reports
    graph = _tree_graph()
    graph["megatron.training.cpu_mode"] = graph["megatron.training.cpu_mode"] | {
        "megatron.training.gpt_entry"
    }
    assert "megatron.training.cpu_mode" in (_cycle(graph) or [])
