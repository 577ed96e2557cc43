"""Draw our Muon package as a Mermaid graph from its imports: writes docs/package.md.

Nodes: our modules of megatron/core/optimizer (``megatron_muon/`` with ``planner/``, ``repairs/``,
``muon.py``, ``qk_clip.py``), each with the first sentence of its docstring and its line count,
and the upstream modules whose patches import them (read from the ``+`` lines of patches/).
Arrows: A --> B where A imports B (ast: relative imports resolved, imports inside functions
counted, drawn dotted when that is A's only import of B). Printed and written on the page: import
circles (SCCs of the graph), the docstring share of lines and the longest function.

    python tools/package_map.py           # writes docs/package.md (also: make docs)
    python tools/package_map.py --check   # exits 1 if docs/package.md is stale
"""

import argparse
import ast
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OPT = "megatron/core/optimizer"
PACKAGE = "megatron.core.optimizer"
PAGE = "docs/package.md"
COMMAND = "make docs  (python tools/package_map.py)"
GROUPS = {  # our modules' subgraphs, by package; planner/ nests in megatron_muon/
    PACKAGE: "megatron/core/optimizer/",
    PACKAGE + ".megatron_muon": "megatron_muon/",
    PACKAGE + ".megatron_muon.planner": "planner/",
    PACKAGE + ".repairs": "repairs/",
}


def _name(rel: str) -> str:
    """megatron/core/optimizer/__init__.py -> megatron.core.optimizer (a package's module)."""
    parts = Path(rel).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _ours(root: Path) -> dict[str, Path]:
    """Our modules of megatron/core/optimizer by dotted name, package __init__s left out."""
    paths = sorted(p for p in (root / OPT).rglob("*.py") if p.name != "__init__.py")
    return {_name(p.relative_to(root).as_posix()): p for p in paths}


def _targets(name: str, is_package: bool, node: ast.AST, nodes) -> set[str]:
    """The nodes one import statement of module ``name`` names (relative imports resolved)."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name in nodes}
    if not isinstance(node, ast.ImportFrom):
        return set()
    base = node.module or ""
    if node.level:
        package = name.split(".") if is_package else name.split(".")[:-1]
        anchor = package[: len(package) - (node.level - 1)]
        base = ".".join(anchor + ([base] if base else []))
    found = {f"{base}.{a.name}" for a in node.names} & set(nodes)  # from pkg import module
    if base in nodes and len(found) < len(node.names):  # from module import names
        found.add(base)
    return found - {name}


def _statements(body: list, lazy: bool = False):
    """(statement, inside a function?) for every statement, nested ones included."""
    for node in body:
        yield node, lazy
        inner = lazy or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        for field in ("body", "orelse", "finalbody", "handlers", "cases"):
            yield from _statements(getattr(node, field, []), inner)


def _edges(name: str, is_package: bool, tree: ast.Module, nodes) -> dict[str, bool]:
    """{imported node: True if imported at module level (else only inside a function)}."""
    found: dict[str, bool] = {}
    for node, lazy in _statements(tree.body):
        for target in _targets(name, is_package, node, nodes):
            found[target] = found.get(target, False) or not lazy
    return found


def _patch_imports(root: Path, ours) -> dict[str, dict[str, set[str]]]:
    """{upstream module: {our module: patch numbers}} from the import lines patches add."""
    found: dict[str, dict[str, set[str]]] = {}
    for patch in sorted((root / "patches").glob("*.patch")):
        path, lines = "", patch.read_text().splitlines()
        for i, line in enumerate(lines):
            if line.startswith("+++ b/"):
                path = line[len("+++ b/") :]
            stmt = line[1:].strip()
            if not (
                line.startswith("+") and path.endswith(".py") and re.match(r"(from|import) ", stmt)
            ):
                continue
            while "(" in stmt and ")" not in stmt:  # a parenthesized import over several lines
                i += 1
                stmt += "\n" + lines[i][1:].strip()
            name = _name(path)
            for target in _edges(name, path.endswith("__init__.py"), ast.parse(stmt), ours):
                found.setdefault(name, {}).setdefault(target, set()).add(patch.name[:4])
    return found


def _replaced(root: Path) -> set[str]:
    """Our modules that replace upstream's file of that name (tools/fork.py's REPLACED)."""
    for node in ast.parse((root / "tools/fork.py").read_text()).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "REPLACED":
            return {_name(rel) for rel in ast.literal_eval(node.value)}
    return set()


def _docstring_lines(tree: ast.Module) -> int:
    """Lines inside the module's, its classes' and its functions' docstrings."""
    total = 0
    for node in [tree] + [n for n, _ in _statements(tree.body)]:
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                if isinstance(first.value.value, str):
                    total += first.end_lineno - first.lineno + 1
    return total


def _functions(prefix: str, body: list) -> list[tuple[int, str]]:
    """(length in lines, qualified name) of every function, methods and nested ones included."""
    found = []
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = f"{prefix}.{node.name}"
            if not isinstance(node, ast.ClassDef):
                found.append((node.end_lineno - node.lineno + 1, name))
            found += _functions(name, node.body)
        elif hasattr(node, "body"):  # if/try/with blocks holding definitions
            found += _functions(prefix, node.body + getattr(node, "orelse", []))
    return found


def _role(tree: ast.Module) -> str:
    """The docstring's first sentence (its first 90 characters), markup dropped, wrapped."""
    text = " ".join((ast.get_docstring(tree) or "(no docstring)").split("\n\n")[0].split())
    text = re.split(r"(?<=[a-z)])\. ", text)[0].rstrip(".").replace("`", "").replace('"', "'")
    if len(text) > 90:  # to the last clause that ends before 90 characters, else a word
        ends = [i for i in range(40, 90) if text[i : i + 2] in (": ", ", ", "; ", " (")]
        ends = [i for i in ends if text[:i].count("(") == text[:i].count(")")]
        text = text[: ends[-1]] if ends else text[:88].rsplit(" ", 1)[0] + " ..."
    lines = [""]
    for word in text.split():  # lines of about 32 characters: narrow nodes
        lines[-1:] = (
            [lines[-1], word] if len(lines[-1]) + len(word) > 32 else [lines[-1] + " " + word]
        )
    return "<br/>".join(line.strip() for line in lines if line.strip())


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index, low, stack, found = {}, {}, [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = stack[stack.index(v) :]
            del stack[stack.index(v) :]
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def analyse(root: Path = ROOT) -> dict:
    """Nodes, edges and figures of the checkout at ``root`` (its megatron/, patches/, tools/)."""
    ours = _ours(root)
    trees = {n: ast.parse(p.read_text()) for n, p in ours.items()}
    upstream = _patch_imports(root, ours)
    nodes = set(ours) | set(upstream)
    edges = {n: _edges(n, False, trees[n], nodes) for n in trees}
    for name, targets in upstream.items():
        edges[name] = {t: sorted(p) for t, p in targets.items()}
    lines = {n: len(p.read_text().splitlines()) for n, p in ours.items()}
    figures = {}
    for scope, prefix in (
        ("megatron_muon/", PACKAGE + ".megatron_muon."),
        ("all drawn: with repairs/, muon.py, qk_clip.py", ""),
    ):
        names = [n for n in ours if n.startswith(prefix)]
        functions = sorted(
            f for n in names for f in _functions(n[len(PACKAGE) + 1 :], trees[n].body)
        )
        figures[scope] = {
            "files": len(names),
            "lines": sum(lines[n] for n in names),
            "docstring": sum(_docstring_lines(trees[n]) for n in names),
            "largest": functions[-1],
            "median": statistics.median(length for length, _ in functions),
        }
    return {
        "ours": ours,
        "upstream": upstream,
        "replaced": _replaced(root),
        "edges": edges,
        "lines": lines,
        "roles": {n: _role(t) for n, t in trees.items()},
        "circles": _circles({n: set(e) for n, e in edges.items()}),
        "figures": figures,
    }


def _mermaid(a: dict) -> list[str]:
    """The graph: our modules in their packages' subgraphs, upstream's apart, then the arrows."""

    def key(name):  # a Mermaid id; upstream's names may repeat ours ("distrib_optimizer")
        short = name.removeprefix(PACKAGE + ".") if name in a["ours"] else "up." + name
        return short.removeprefix("megatron.core.").replace(".", "_")

    def group(package, indent):
        out.append(f'{indent}subgraph {package.replace(".", "_")}["{GROUPS[package]}"]')
        for name in sorted(a["ours"]):
            if name.rpartition(".")[0] == package:
                note = "<br/><i>replaces upstream's</i>" if name in a["replaced"] else ""
                label = f"<b>{name.rpartition('.')[2]}.py</b> · {a['lines'][name]} lines{note}"
                out.append(f'{indent}  {key(name)}["{label}<br/>{a["roles"][name]}"]')
        for inner in sorted(GROUPS):
            if inner.rpartition(".")[0] == package:
                group(inner, indent + "  ")
        out.append(f"{indent}end")

    out = ["```mermaid", "graph LR"]
    group(PACKAGE, "  ")
    out.append('  subgraph upstream["upstream megatron-core 0.19.2, patched"]')
    for name in sorted(a["upstream"]):
        path = "/".join(name.split(".")[2:]) + ("/__init__" if name == PACKAGE else "")
        out.append(f'    {key(name)}["{path}.py"]:::upstream')
    out.append("  end")
    for name in sorted(a["edges"]):
        for target, how in sorted(a["edges"][name].items()):
            if isinstance(how, list):  # an upstream module importing ours: by which patches
                arrow = f'-- "{", ".join(how)}" -->'
            else:
                arrow = "-->" if how else "-.->"
            out.append(f"  {key(name)} {arrow} {key(target)}")
    out.append("  classDef upstream fill:#eee,stroke:#888,stroke-dasharray:4 3,color:#333")
    out.append("```")
    return out


def render(root: Path = ROOT, a: dict | None = None) -> str:
    """The text of docs/package.md for the checkout at ``root`` (``a``: its analysis, if made)."""
    a = a or analyse(root)
    rows = [
        f"| {scope} | {f['files']} | {f['lines']} | {f['docstring']} "
        f"({100 * f['docstring'] / f['lines']:.1f}%) | {f['largest'][0]} "
        f"(`{f['largest'][1]}`) | {f['median']:g} |"
        for scope, f in a["figures"].items()
    ]

    def short(name):  # ours relative to the package, upstream's marked
        return name.removeprefix(PACKAGE + ".") if name in a["ours"] else f"upstream {name}"

    circles = "; ".join(" -> ".join(map(short, c)) for c in a["circles"])
    circles = f" ({circles})" if circles else ""
    return "\n".join(
        [
            "# The Muon package, drawn from its imports",
            "",
            "Generated by `tools/package_map.py` from the modules' imports and the import lines",
            "our patches add; do not edit: after a change run `make docs`",
            "(`tests/meta/test_package_map.py` fails while this page is stale).",
            "",
            "An arrow A → B: A imports B; dotted: only inside a function. Grey: the upstream",
            "modules a patch makes import ours (such an arrow names the patches), and our",
            "imports of them.",
            "Each of our nodes: its line count and its docstring's first sentence.",
            "Prose map: [muon_in_megatron.md](muon_in_megatron.md#module-map).",
            "",
            *_mermaid(a),
            "",
            f"Import circles: {len(a['circles'])}{circles}.",
            "",
            "| scope | files | lines | docstring lines (share, goal <= 25%) | longest function "
            "| median function |",
            "| --- | ---: | ---: | ---: | --- | ---: |",
            *rows,
            "",
        ]
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the page is stale")
    args = parser.parse_args(argv)
    page, a = ROOT / PAGE, analyse()
    print(f"import circles: {len(a['circles'])}", *a["circles"])
    for scope, f in a["figures"].items():
        share = 100 * f["docstring"] / f["lines"]
        print(
            f"{scope}: {f['files']} files, {f['lines']} lines, docstrings {share:.1f}%, "
            f"longest function {f['largest'][0]} lines ({f['largest'][1]}), median {f['median']:g}"
        )
    text = render(ROOT, a)
    if args.check:
        fresh = page.exists() and page.read_text() == text
        print(f"{PAGE} is {'up to date' if fresh else 'stale: run ' + COMMAND}")
        return 0 if fresh else 1
    page.write_text(text)
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
