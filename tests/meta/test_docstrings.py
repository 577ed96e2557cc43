"""The `make pr` series carries Google-style docstrings (issue 15, item 6).

Upstream reviews public definitions by their docstrings, so every public function and class in
our megatron.core files has one, and every public function taking two or more arguments says
what each is in an ``Args:`` section (and what it gives back in ``Returns:``). Only ``ast`` is
used: the modules are not imported, so the check takes milliseconds.
"""

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import make_pr  # noqa: E402


def _core_files():
    """Our .py files under megatron/core that the `make pr` series exports."""
    every = [rel for _, _, files, _ in make_pr.SERIES for rel in files]
    return [
        rel
        for rel in dict.fromkeys(every)
        if rel.startswith("megatron/core/") and rel.endswith(".py")
    ]


def _params(fn):
    """Names of fn's parameters besides self/cls (*args and **kwargs included)."""
    args = fn.args
    names = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]
    names += [a.arg for a in (args.vararg, args.kwarg) if a is not None]
    return [n for n in names if n not in ("self", "cls")]


def _returns_value(fn):
    """True if fn's own body (not a nested def) has ``return <expr>`` other than None."""
    todo = list(fn.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        if isinstance(node, ast.Return) and node.value is not None:
            if not (isinstance(node.value, ast.Constant) and node.value.value is None):
                return True
        todo.extend(ast.iter_child_nodes(node))
    return False


def _is_property(fn):
    """Properties (and their setters) are documented as attributes, not as functions."""
    for d in fn.decorator_list:
        name = d.attr if isinstance(d, ast.Attribute) else getattr(d, "id", "")
        if name in ("property", "setter", "cached_property", "deleter"):
            return True
    return False


def _check_function(fn, where):
    """Problems with one public function's docstring."""
    doc = ast.get_docstring(fn)
    if not doc:
        return [f"{where}: no docstring"]
    names = _params(fn)
    problems = []
    if len(names) >= 2:
        args = re.search(r"^\s*Args:\s*$(.*?)(?=^\s*[A-Z][A-Za-z ]*:\s*$|\Z)", doc, re.M | re.S)
        if args is None:
            problems.append(f"{where}: no Args: section")
        else:
            for n in names:
                if not re.search(rf"^\s*\**{re.escape(n)}\b", args.group(1), re.M):
                    problems.append(f"{where}: Args: does not name {n}")
        if _returns_value(fn) and not re.search(r"^\s*Returns:", doc, re.M):
            problems.append(f"{where}: no Returns: section")
    return problems


def _public_defs(tree):
    """(qualified name, node) of public module-level and class-level functions and classes."""
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if not node.name.startswith("_"):
                yield node.name, node
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                for sub in node.body:
                    is_def = isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                    if is_def and not sub.name.startswith("_"):
                        yield f"{node.name}.{sub.name}", sub


def problems_in(source, filename):
    """Every missing docstring, Args: entry or Returns: section in one module's source."""
    problems = []
    for name, node in _public_defs(ast.parse(source)):
        where = f"{filename}:{node.lineno} {name}"
        if isinstance(node, ast.ClassDef):
            if not ast.get_docstring(node):
                problems.append(f"{where}: no docstring")
        elif not _is_property(node):
            problems.extend(_check_function(node, where))
    return problems


def test_negative_control_reports_missing_args_and_returns():
    src = (
        "def f(a, b):\n"
        '    """Adds."""\n'
        "    return a + b\n"
        "class C:\n"
        "    def g(self, x, y):\n"
        '        """G.\n\n        Args:\n            x: an x.\n        """\n'
        "    def h(self):\n"
        "        pass\n"
    )
    found = problems_in(src, "neg.py")
    assert "neg.py:1 f: no Args: section" in found
    assert "neg.py:5 C.g: Args: does not name y" in found
    assert "neg.py:4 C: no docstring" in found
    assert "neg.py:11 C.h: no docstring" in found


def test_a_complete_docstring_passes():
    src = (
        "def f(a, *, b=1):\n"
        '    """Adds.\n\n    Args:\n        a: first.\n        b: second.\n\n'
        '    Returns:\n        The sum.\n    """\n'
        "    def inner(x, y):\n"
        "        return x\n"
        "    return a + b\n"
    )
    assert problems_in(src, "ok.py") == []


def test_core_files_have_google_style_docstrings():
    files = _core_files()
    assert files, "tools/pr_series.py lists no megatron/core files"
    problems = []
    for rel in files:
        problems += problems_in((ROOT / rel).read_text(), rel)
    assert not problems, "\n".join(problems)
